#pragma once
// Adam (Kingma & Ba) with bias correction, a global gradient-norm clip, and a learning rate that
// warms up linearly and then decays along a cosine.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "model.hpp"

namespace train {

struct AdamConfig {
  double lr = 2e-3;  ///< peak learning rate
  double beta1 = 0.9, beta2 = 0.98, eps = 1e-8;
  double clip_norm = 1.0;          ///< gradients are scaled down to this global L2 norm
  index_t warmup = 100;            ///< steps of linear warm-up
  index_t total_steps = 1000;      ///< the cosine reaches its end here
  double final_lr_fraction = 0.1;  ///< the learning rate at total_steps, relative to lr
};

/// The optimizer's state: first and second moments of every parameter, in double.
template <class T>
struct Adam {
  AdamConfig cfg;
  std::vector<Param<T>*> params;
  std::vector<std::vector<double>> m, v;
  index_t step = 0;

  Adam(const AdamConfig& c, std::vector<Param<T>*> p) : cfg(c), params(std::move(p)) {
    for (const Param<T>* q : params) {
      m.emplace_back(q->value.size(), 0.0);
      v.emplace_back(q->value.size(), 0.0);
    }
  }
};

/// The learning rate of step `step` (1-based).
inline double learning_rate(const AdamConfig& c, index_t step) {
  if (step <= c.warmup) return c.lr * double(step) / double(std::max<index_t>(c.warmup, 1));
  const double span = double(std::max<index_t>(c.total_steps - c.warmup, 1));
  const double progress = std::min(1.0, double(step - c.warmup) / span);
  const double cosine = 0.5 * (1.0 + std::cos(3.14159265358979323846 * progress));
  return c.lr * (c.final_lr_fraction + (1.0 - c.final_lr_fraction) * cosine);
}

/// The factor that brings the global gradient norm down to clip_norm (1 when it is below):
/// rare large gradients must not throw a small model far off in one step.
template <class T>
double clip_factor(const Adam<T>& opt) {
  double sum_sq = 0.0;
  for (const Param<T>* p : opt.params)
    for (const T g : p->grad) sum_sq += double(g) * double(g);
  const double norm = std::sqrt(sum_sq);
  return norm > opt.cfg.clip_norm ? opt.cfg.clip_norm / norm : 1.0;
}

/// One update of every parameter from its gradient.
template <class T>
void adam_step(Adam<T>& opt) {
  const AdamConfig& c = opt.cfg;
  ++opt.step;
  const double lr = learning_rate(c, opt.step), clip = clip_factor(opt);
  const double correct1 = 1.0 - std::pow(c.beta1, double(opt.step));
  const double correct2 = 1.0 - std::pow(c.beta2, double(opt.step));
  for (std::size_t i = 0; i < opt.params.size(); ++i) {
    Param<T>& p = *opt.params[i];
    std::vector<double>&m = opt.m[i], &v = opt.v[i];
    for (std::size_t j = 0; j < p.value.size(); ++j) {
      const double g = double(p.grad[j]) * clip;
      m[j] = c.beta1 * m[j] + (1.0 - c.beta1) * g;
      v[j] = c.beta2 * v[j] + (1.0 - c.beta2) * g * g;
      const double step = lr * (m[j] / correct1) / (std::sqrt(v[j] / correct2) + c.eps);
      p.value[j] = static_cast<T>(double(p.value[j]) - step);
    }
  }
}

}  // namespace train

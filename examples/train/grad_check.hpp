#pragma once
// The model's backward against central finite differences, in double on a tiny model: every
// entry of every parameter (embedding, head, and each layer's weights), so that the embedding,
// residual and head code written here is checked together with its use of the layer.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "model.hpp"
#include "recall_task.hpp"

namespace train {

/// One tensor's worst error: max |analytic - numeric| / max |numeric|.
struct GradError {
  std::string name;
  double error = 0.0;
};

/// A tiny model and one batch to check it on.
struct GradProblem {
  Model<double> model;
  recall::Batch batch;
};

inline GradProblem make_grad_problem(bool compose, unsigned seed) {
  recall::TaskConfig task;
  task.symbols = 6;
  task.pairs = 4;
  ModelConfig mc;
  mc.vocab = task.vocab();
  mc.classes = task.symbols;
  mc.E = 8;
  mc.H = 2;
  mc.D = 4;
  mc.layers = 2;
  mc.compose = compose;
  mc.num_threads = 1;  // tiny problems: a team of threads would only wait on each other
  GradProblem p{make_model<double>(mc, task.length(), seed), {}};
  // The official init makes the projection's output tiny, which would leave the composition's
  // share of every gradient below the finite differences' resolution: enlarge it.
  for (LayerParams<double>& l : p.model.layers) {
    for (double& v : l.qkw.value) v *= 300.0;
    for (double& v : l.dd.value) v *= 10.0;
  }
  std::mt19937 rng(seed);
  p.batch = recall::make_batch(task, 3, rng);
  return p;
}

inline double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

/// The gradient of one tensor by central differences of the loss.
inline std::vector<double> numeric_gradient(GradProblem& p, Param<double>& param,
                                            Activations<double>& a) {
  const double h = 1e-5;
  std::vector<double> grad(param.value.size());
  for (std::size_t i = 0; i < grad.size(); ++i) {
    const double saved = param.value[i];
    param.value[i] = saved + h;
    const double plus = forward(p.model, p.batch, a).loss;
    param.value[i] = saved - h;
    const double minus = forward(p.model, p.batch, a).loss;
    param.value[i] = saved;
    grad[i] = (plus - minus) / (2.0 * h);
  }
  return grad;
}

/// Every parameter's error, for the MHA (compose off) or the DCMHA model.
inline std::vector<GradError> check_gradients(bool compose, unsigned seed = 5) {
  GradProblem p = make_grad_problem(compose, seed);
  Activations<double> a;
  forward(p.model, p.batch, a);
  backward(p.model, p.batch, a);
  std::vector<GradError> errors;
  for (Param<double>* param : parameters(p.model)) {
    const std::vector<double> analytic = param->grad;
    const std::vector<double> numeric = numeric_gradient(p, *param, a);
    double scale = 0.0;
    for (const double g : numeric) scale = std::max(scale, std::fabs(g));
    errors.push_back({param->name, max_abs_difference(analytic, numeric) / std::max(scale, 1e-12)});
  }
  return errors;
}

}  // namespace train

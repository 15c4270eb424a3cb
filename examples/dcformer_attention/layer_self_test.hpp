#pragma once
// Self-checks of the DCFormer layer that need no case file: its backward against central finite
// differences in double (DCMHA with G > 1 and GQA, MHA, sliding windows, qk-norm on and off), MHA
// mode against DCMHA with a zero projection, the window's effect on the output rows, the RoPE
// tables' relative-position property, the bf16 / fp16 dense products (one rounding per result,
// across panels), and the rejection of bad arguments.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dcformer_layer.hpp"

namespace dcformer::self_test {

using Vec = std::vector<double>;

/// A small random layer problem in double, owning every tensor.
struct Problem {
  LayerConfig cfg;
  index_t B = 2, T = 5;
  Vec x, wqkv, wo, dw1, qkw, dd, q_norm, k_norm, dy;
  RopeTables<double> rope;

  LayerWeights<double> weights() const {
    LayerWeights<double> w;
    w.wqkv = dcmha::view<2>(wqkv.data(), {cfg.qkv_width(), cfg.E});
    w.wo = dcmha::view<2>(wo.data(), {cfg.E, cfg.H * cfg.D});
    if (cfg.compose) {
      const index_t G = cfg.G, M = cfg.M(), K = cfg.hidden();
      w.dw1 = dcmha::view<4>(dw1.data(), {cfg.E, G, 4, K});
      w.qkw = dcmha::view<5>(qkw.data(), {G, 4, K, 2 * cfg.R, M});
      w.dd = dcmha::view<3>(dd.data(), {cfg.E, G, 4 * M});
    }
    if (cfg.qk_norm) {
      w.q_norm = dcmha::view<1>(q_norm.data(), {cfg.D});
      w.k_norm = dcmha::view<1>(k_norm.data(), {cfg.D});
    }
    return w;
  }
  dcmha::TensorView<const double, 3> x_view() const {
    return dcmha::view<3>(x.data(), {B, T, cfg.E});
  }
};

inline Vec randn(std::size_t n, double stddev, double mean, std::mt19937& rng) {
  std::normal_distribution<double> dist(mean, stddev);
  Vec v(n);
  for (double& e : v) e = dist(rng);
  return v;
}

inline Problem make_problem(const LayerConfig& cfg, unsigned seed) {
  std::mt19937 rng(seed);
  Problem p;
  p.cfg = cfg;
  const auto n = [](index_t v) { return static_cast<std::size_t>(v); };
  const index_t E = cfg.E, HD = cfg.H * cfg.D, M = cfg.M(), K = cfg.hidden();
  const double e_scale = 1.0 / std::sqrt(double(E));
  p.x = randn(n(p.B * p.T * E), 1.0, 0.0, rng);
  p.dy = randn(p.x.size(), 1.0, 0.0, rng);
  p.wqkv = randn(n(cfg.qkv_width() * E), e_scale, 0.0, rng);
  p.wo = randn(n(E * HD), 1.0 / std::sqrt(double(HD)), 0.0, rng);
  if (cfg.compose) {  // larger than the official init, so that composition matters
    p.dw1 = randn(n(E * cfg.G * 4 * K), e_scale, 0.0, rng);
    p.qkw = randn(n(cfg.G * 4 * K * 2 * cfg.R * M), 0.5, 0.0, rng);
    p.dd = randn(n(E * cfg.G * 4 * M), 0.5 * e_scale, 0.0, rng);
  }
  if (cfg.qk_norm) {
    p.q_norm = randn(n(cfg.D), 0.2, 1.0, rng);
    p.k_norm = randn(n(cfg.D), 0.2, 1.0, rng);
  }
  p.rope = make_rope_tables<double>(p.T, cfg.D);
  return p;
}

inline Vec run_forward(const Problem& p) {
  Vec y(p.x.size());
  LayerCache<double> cache;
  forward(p.cfg, p.x_view(), p.rope.views(), p.weights(),
          dcmha::view<3>(y.data(), {p.B, p.T, p.cfg.E}), cache);
  return y;
}

inline double loss(const Problem& p) {
  const Vec y = run_forward(p);
  double s = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) s += y[i] * p.dy[i];
  return s;
}

/// The gradient of one tensor, by the layer's backward and by finite differences.
struct Checked {
  std::string name;
  Vec* value;
  Vec analytic;
};

inline double* find_gradient(std::vector<Checked>& c, const std::string& name) {
  for (Checked& e : c)
    if (e.name == name) return e.analytic.data();
  return nullptr;
}

/// Views of the analytic gradients in c, shaped as the problem's parameters.
inline LayerGrads<double> gradient_views(const Problem& p, std::vector<Checked>& c) {
  LayerGrads<double> g;
  const LayerWeights<double> w = p.weights();
  g.wqkv = dcmha::view<2>(find_gradient(c, "wqkv"), w.wqkv.shape);
  g.wo = dcmha::view<2>(find_gradient(c, "wo"), w.wo.shape);
  if (p.cfg.compose) {
    g.dw1 = dcmha::view<4>(find_gradient(c, "dw1"), w.dw1.shape);
    g.qkw = dcmha::view<5>(find_gradient(c, "qkw"), w.qkw.shape);
    g.dd = dcmha::view<3>(find_gradient(c, "dd"), w.dd.shape);
  }
  if (p.cfg.qk_norm) {
    g.q_norm = dcmha::view<1>(find_gradient(c, "q_norm"), w.q_norm.shape);
    g.k_norm = dcmha::view<1>(find_gradient(c, "k_norm"), w.k_norm.shape);
  }
  return g;
}

/// Every gradient by the layer's backward (NaN first: a gradient left unwritten fails).
inline std::vector<Checked> analytic_gradients(Problem& p) {
  std::vector<Checked> c = {{"x", &p.x, {}}, {"wqkv", &p.wqkv, {}}, {"wo", &p.wo, {}}};
  if (p.cfg.compose)
    for (auto [name, v] : {std::pair{"dw1", &p.dw1}, {"qkw", &p.qkw}, {"dd", &p.dd}})
      c.push_back({name, v, {}});
  if (p.cfg.qk_norm) {
    c.push_back({"q_norm", &p.q_norm, {}});
    c.push_back({"k_norm", &p.k_norm, {}});
  }
  for (Checked& e : c) e.analytic.assign(e.value->size(), std::nan(""));
  const LayerGrads<double> g = gradient_views(p, c);
  const auto shape = dcmha::Shape<3>{p.B, p.T, p.cfg.E};
  Vec y(p.x.size());
  LayerCache<double> cache;
  forward(p.cfg, p.x_view(), p.rope.views(), p.weights(), dcmha::view<3>(y.data(), shape), cache);
  backward(p.cfg, p.x_view(), p.rope.views(), p.weights(), cache,
           dcmha::view<3>(static_cast<const double*>(p.dy.data()), shape),
           dcmha::view<3>(find_gradient(c, "x"), shape), g);
  return c;
}

/// max over the tensor's entries of |analytic - central difference| / max(1, max|difference|).
inline double finite_difference_error(Problem& p, Checked& c) {
  const double h = 1e-5;
  double diff = 0.0, scale = 1.0;
  for (std::size_t i = 0; i < c.value->size(); ++i) {
    const double saved = (*c.value)[i];
    (*c.value)[i] = saved + h;
    const double up = loss(p);
    (*c.value)[i] = saved - h;
    const double down = loss(p);
    (*c.value)[i] = saved;
    const double fd = (up - down) / (2.0 * h);
    const double d = std::fabs(fd - c.analytic[i]);
    diff = std::isnan(d) ? INFINITY : std::max(diff, d);
    scale = std::max(scale, std::fabs(fd));
  }
  return diff / scale;
}

/// One configuration: every gradient against finite differences.
inline bool check_gradients(const char* label, const LayerConfig& cfg, unsigned seed) {
  constexpr double kTol = 1e-6;
  Problem p = make_problem(cfg, seed);
  std::vector<Checked> grads = analytic_gradients(p);
  std::string worst = "-";
  double worst_error = 0.0;
  for (Checked& c : grads) {
    const double e = finite_difference_error(p, c);
    if (!(e <= worst_error)) worst = c.name, worst_error = e;
  }
  const bool ok = worst_error <= kTol;
  std::printf("%s self-test %s: %zu gradients vs finite differences, worst %s %.3g (tol %.0e)\n",
              ok ? "PASS" : "FAIL", label, grads.size(), worst.c_str(), worst_error, kTol);
  return ok;
}

inline double max_abs(const Vec& v) {
  double m = 0.0;
  for (double e : v) m = std::max(m, std::fabs(e));
  return m;
}

/// max |a - b| over rows [t0, t1) of every sequence of (B, T, E) tensors.
inline double row_diff(const Problem& p, const Vec& a, const Vec& b, index_t t0, index_t t1) {
  double m = 0.0;
  for (index_t bi = 0; bi < p.B; ++bi)
    for (index_t t = t0; t < t1; ++t)
      for (index_t e = 0; e < p.cfg.E; ++e) {
        const std::size_t i = static_cast<std::size_t>((bi * p.T + t) * p.cfg.E + e);
        m = std::max(m, std::isnan(a[i] - b[i]) ? INFINITY : std::fabs(a[i] - b[i]));
      }
  return m;
}

inline bool report(bool ok, const char* what, double value, const char* bound) {
  std::printf("%s self-test %s: %.3g (%s)\n", ok ? "PASS" : "FAIL", what, value, bound);
  return ok;
}

/// MHA mode is DCMHA with a zero projection (every compose weight 0: the identity), and a
/// nonzero projection changes the output.
inline bool check_mha_switch(const LayerConfig& cfg) {
  Problem p = make_problem(cfg, 11);
  const Vec y_dcmha = run_forward(p);
  std::fill(p.dw1.begin(), p.dw1.end(), 0.0);
  std::fill(p.qkw.begin(), p.qkw.end(), 0.0);
  std::fill(p.dd.begin(), p.dd.end(), 0.0);
  const Vec y_zero = run_forward(p);
  p.cfg.compose = false;
  const Vec y_mha = run_forward(p);
  const double scale = std::max(1.0, max_abs(y_mha));
  const double same = row_diff(p, y_zero, y_mha, 0, p.T) / scale;
  const double apart = row_diff(p, y_dcmha, y_mha, 0, p.T) / scale;
  return report(same <= 1e-12, "MHA mode vs DCMHA with zero projection, max rel diff", same,
                "<= 1e-12") &
         report(apart >= 1e-3, "MHA mode vs DCMHA, max rel diff", apart, ">= 1e-3");
}

/// Rows t < W see the same keys with and without the window; every later row sees fewer.
inline bool check_window(LayerConfig cfg) {
  const index_t W = cfg.window;
  Problem p = make_problem(cfg, 12);
  const Vec y_local = run_forward(p);
  p.cfg.window = 0;
  const Vec y_global = run_forward(p);
  const double scale = std::max(1.0, max_abs(y_global));
  bool ok = report(row_diff(p, y_local, y_global, 0, W) / scale <= 1e-12,
                   "window: rows t < W equal the global layer's, max rel diff",
                   row_diff(p, y_local, y_global, 0, W) / scale, "<= 1e-12");
  double least = INFINITY;
  for (index_t t = W; t < p.T; ++t)
    least = std::min(least, row_diff(p, y_local, y_global, t, t + 1));
  return report(least / scale >= 1e-6, "window: rows t >= W differ from the global layer's, least",
                least / scale, ">= 1e-6") &
         ok;
}

/// RoPE: <rot(q, t1), rot(k, t2)> depends on t1 - t2 only, and equals <q, k> at t1 = t2.
inline bool check_rope() {
  const index_t D = 8, half = D / 2;
  const RopeTables<double> tab = make_rope_tables<double>(16, D);
  std::mt19937 rng(13);
  const Vec q = randn(D, 1.0, 0.0, rng), k = randn(D, 1.0, 0.0, rng);
  const auto rotated_dot = [&](index_t t1, index_t t2) {
    Vec a = q, b = k;
    detail::rotate(a.data(), &tab.cos[t1 * half], &tab.sin[t1 * half], half);
    detail::rotate(b.data(), &tab.cos[t2 * half], &tab.sin[t2 * half], half);
    double s = 0.0;
    for (index_t d = 0; d < D; ++d) s += a[d] * b[d];
    return s;
  };
  double plain = 0.0;
  for (index_t d = 0; d < D; ++d) plain += q[d] * k[d];
  const double err = std::max({std::fabs(rotated_dot(3, 1) - rotated_dot(14, 12)),
                               std::fabs(rotated_dot(9, 9) - plain),
                               std::fabs(rotated_dot(2, 7) - rotated_dot(10, 15))});
  const double moved = std::fabs(rotated_dot(3, 1) - rotated_dot(3, 3));
  return report(err <= 1e-12, "RoPE tables: relative positions only, max diff", err, "<= 1e-12") &
         report(moved >= 1e-3, "RoPE tables: a distance changes the score", moved, ">= 1e-3");
}

/// The layer's dense products in T (bf16, half) against double on the same values, in the three
/// forms the layer uses (a·bᵀ, a·b + addend, aᵀ·b), each output wider than a panel: every result
/// within one rounding of T (unit roundoff u) plus float accumulation.
template <class T>
bool check_narrow_product(const char* type_name, double u) {
  const index_t rows = 7, inner = 40, cols = 2 * detail::kProductPanel + 37;
  std::mt19937 rng(17);
  auto narrow = [&](index_t n) {
    std::vector<T> v;
    for (double x : randn(static_cast<std::size_t>(n), 1.0, 0.0, rng))
      v.push_back(static_cast<T>(x));
    return v;
  };
  const std::vector<T> a = narrow(rows * inner), b = narrow(cols * inner),
                       addend = narrow(rows * cols), at = narrow(inner * rows);
  using Map = detail::ConstMatrixMap<T>;
  std::vector<T> nt(addend.size()), nn(addend.size()), tn(addend.size());
  detail::product<T>(Map(a.data(), rows, inner), Map(b.data(), cols, inner).transpose(),
                     detail::MatrixMap<T>(nt.data(), rows, cols));
  detail::product<T>(Map(a.data(), rows, inner), Map(b.data(), inner, cols),
                     detail::MatrixMap<T>(nn.data(), rows, cols), addend.data());
  detail::product<T>(Map(at.data(), inner, rows).transpose(), Map(b.data(), inner, cols),
                     detail::MatrixMap<T>(tn.data(), rows, cols));
  double worst = 0.0;  // |got - exact| / bound
  auto check = [&](const std::vector<T>& got, auto a_at, auto b_at, bool add) {
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < cols; ++j) {
        double exact = add ? double(addend[i * cols + j]) : 0.0, magnitude = std::fabs(exact);
        for (index_t k = 0; k < inner; ++k) {
          exact += a_at(i, k) * b_at(k, j);
          magnitude += std::fabs(a_at(i, k) * b_at(k, j));
        }
        const double bound = u * std::fabs(exact) + 1e-6 * magnitude;
        worst = std::max(worst, std::fabs(double(got[i * cols + j]) - exact) / bound);
      }
  };
  auto a_rows = [&](index_t i, index_t k) { return double(a[i * inner + k]); };
  auto at_cols = [&](index_t i, index_t k) { return double(at[k * rows + i]); };
  auto b_t = [&](index_t k, index_t j) { return double(b[j * inner + k]); };
  auto b_rows = [&](index_t k, index_t j) { return double(b[k * cols + j]); };
  check(nt, a_rows, b_t, false);
  check(nn, a_rows, b_rows, true);
  check(tn, at_cols, b_rows, false);
  const std::string what = std::string("dense products in ") + type_name +
                           " (a bᵀ, a b + addend, aᵀ b; 3 panels): error / one rounding's bound";
  return report(worst <= 1.0, what.c_str(), worst, "<= 1");
}

/// f must throw dcmha::Error whose message contains `expected`.
inline bool expect_error(const char* what, const std::function<void()>& f,
                         const std::string& expected) {
  std::string got = "no exception";
  try {
    f();
  } catch (const dcmha::Error& e) {
    got = e.what();
    if (got.find(expected) != std::string::npos) return true;
  }
  std::printf("FAIL self-test bad argument (%s): expected dcmha::Error with '%s', got '%s'\n", what,
              expected.c_str(), got.c_str());
  return false;
}

inline bool check_errors(const LayerConfig& cfg) {
  Problem p = make_problem(cfg, 14);
  Vec y(p.x.size(), 7.0);
  LayerCache<double> cache;
  const auto y_view = dcmha::view<3>(y.data(), {p.B, p.T, cfg.E});
  auto run = [&](const LayerConfig& c, const Rope<double>& rope, const LayerWeights<double>& w) {
    return [&, c, rope, w] { forward(c, p.x_view(), rope, w, y_view, cache); };
  };
  LayerWeights<double> narrow = p.weights();
  narrow.wqkv.shape[1] -= 1;
  LayerConfig mha = cfg, bad_hk = cfg;
  mha.compose = false;
  bad_hk.Hk = 3;
  Rope<double> short_rope = p.rope.views();
  short_rope.cos.shape[0] -= 1;
  const std::string wqkv_shape =
      "(" + std::to_string(cfg.qkv_width()) + ", " + std::to_string(cfg.E) + ")";
  bool ok = expect_error("wqkv", run(cfg, p.rope.views(), narrow),
                         "weights.wqkv: expected shape " + wqkv_shape);
  ok &= expect_error("dw1 in MHA mode", run(mha, p.rope.views(), p.weights()),
                     "weights.dw1: expected no tensor");
  ok &= expect_error("rope", run(cfg, short_rope, p.weights()),
                     "rope.cos: expected at least T = " + std::to_string(p.T));
  ok &= expect_error("Hk", run(bad_hk, p.rope.views(), p.weights()),
                     "config.Hk: expected a divisor of H = " + std::to_string(cfg.H));
  ok &= expect_error(
      "backward without forward",
      [&] {
        backward(cfg, p.x_view(), p.rope.views(), p.weights(), cache, p.x_view(), y_view,
                 LayerGrads<double>{});
      },
      "cache: expected the activations of a forward on x");
  const bool untouched = std::all_of(y.begin(), y.end(), [](double v) { return v == 7.0; });
  if (!untouched) std::printf("FAIL self-test bad argument: an output was written\n");
  std::printf(
      "%s self-test bad arguments: 5 cases throw dcmha::Error naming the argument and "
      "the expected value, outputs untouched\n",
      ok && untouched ? "PASS" : "FAIL");
  return ok && untouched;
}

/// Every self-check; prints one line each.
inline bool run() {
  LayerConfig base;
  base.E = 12;
  base.H = 4;
  base.Hk = 2;
  base.D = 4;
  base.num_threads = 1;
  LayerConfig dcmha_g2 = base, mha = base, dcmha_local = base, mha_local = base;
  dcmha_g2.G = 2;
  dcmha_g2.K = 3;
  dcmha_g2.qk_norm = true;
  mha.compose = false;
  dcmha_local.Hk = 4;
  dcmha_local.R = 1;
  dcmha_local.window = 2;
  dcmha_local.qk_norm = true;
  mha_local.compose = false;
  mha_local.window = 3;
  mha_local.qk_norm = true;
  bool ok = check_gradients("DCMHA G=2 R=2 GQA H4/Hk2 qk-norm, global", dcmha_g2, 1);
  ok &= check_gradients("MHA GQA H4/Hk2, global", mha, 2);
  ok &= check_gradients("DCMHA G=1 R=1 qk-norm, window 2", dcmha_local, 3);
  ok &= check_gradients("MHA qk-norm, window 3", mha_local, 4);
  ok &= check_mha_switch(base);
  ok &= check_window(dcmha_local);
  ok &= check_rope();
  ok &= check_narrow_product<dcmha::bf16>("bf16", std::ldexp(1.0, -8));
  ok &= check_narrow_product<dcmha::half>("fp16", std::ldexp(1.0, -11));
  ok &= check_errors(dcmha_g2);
  std::printf("self-test: %s\n", ok ? "all checks passed" : "FAILED");
  return ok;
}

}  // namespace dcformer::self_test

#pragma once
// Argument checks of dynamic_weights_forward / dynamic_weights_backward. Every failure throws
// dcmha::Error naming the function, the argument, the expected value and the actual one.
#include <array>
#include <cmath>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "../detail/checks.hpp"
#include "../error.hpp"
#include "../tensor.hpp"

// Included from the end of dynamic_weights.hpp, which defines the types used here.
namespace dcmha::detail::projection {

struct ProjectionDims {
  index_t B = 0, L = 0, E = 0;  // batch, positions, model width
  index_t G = 0, K = 0;         // groups, hidden width per split
  index_t R = 0, M = 0;         // rank, heads per group
  index_t rows() const { return B * L; }
};

/// The twelve dynamic tensors indexed by split c = 0..3 (pre/query, pre/key, post/query,
/// post/key): the compute loops and the checks run over splits, the API names them by role.
template <class U>
struct SplitViews {
  std::array<TensorView<U, 5>, 4> w1, w2;
  std::array<TensorView<U, 4>, 4> dd;
};

template <class U>
SplitViews<U> by_split(const DynamicWeights<U>& w) {
  SplitViews<U> s;
  const DynamicWeightsSide<U>* side[2] = {&w.pre, &w.post};
  for (int c = 0; c < 4; ++c) {
    const DynamicWeightsSide<U>& d = *side[c / 2];
    const bool key = (c % 2) == 1;
    s.w1[c] = key ? d.kw1 : d.qw1;
    s.w2[c] = key ? d.kw2 : d.qw2;
    s.dd[c] = key ? d.kdd : d.qdd;
  }
  return s;
}

inline std::string split_name(const char* prefix, int c, const char* kind) {
  static const char* const side[4] = {"pre", "pre", "post", "post"};
  static const char* const role[4] = {"q", "k", "q", "k"};
  return std::string(prefix) + "." + side[c] + "." + role[c] + kind;
}

/// Outputs of shape (B, L, G, R, M) / (B, L, G, M), whether the forward's results or the
/// backward's upstream gradients.
template <class U>
void check_dynamic_weights(const char* fn, const char* prefix, const SplitViews<U>& s,
                           const ProjectionDims& d) {
  for (int c = 0; c < 4; ++c) {
    for (int k = 0; k < 2; ++k) {
      const std::string name = split_name(prefix, c, k == 0 ? "w1" : "w2");
      const TensorView<U, 5>& v = k == 0 ? s.w1[c] : s.w2[c];
      require_given(fn, name, v, "(B, L, G, R, M)");
      check_shape(fn, name, v,
                  {{"B", d.B, "x.shape[0]"},
                   {"L", d.L, "x.shape[1]"},
                   {"G", d.G, "dw1.shape[1]"},
                   {"R", d.R, "qkw.shape[3] / 2"},
                   {"M", d.M, "qkw.shape[4]"}});
    }
    const std::string name = split_name(prefix, c, "dd");
    require_given(fn, name, s.dd[c], "(B, L, G, M)");
    check_shape(fn, name, s.dd[c],
                {{"B", d.B, "x.shape[0]"},
                 {"L", d.L, "x.shape[1]"},
                 {"G", d.G, "dw1.shape[1]"},
                 {"M", d.M, "qkw.shape[4]"}});
  }
}

inline void check_config(const char* fn, const ProjectionConfig& cfg) {
  if (cfg.gelu != Gelu::erf && cfg.gelu != Gelu::tanh)
    fail(fn, ": cfg.gelu: expected Gelu::erf or Gelu::tanh, got ", static_cast<int>(cfg.gelu));
  if (!(cfg.eps >= 0.0) || !std::isfinite(cfg.eps))
    fail(fn, ": cfg.eps: expected a finite value >= 0, got ", cfg.eps);
  if (cfg.num_threads < 0)
    fail(fn, ": cfg.num_threads: expected >= 0 (0 = OpenMP default), got ", cfg.num_threads);
}

/// Every dim of x and the parameters must be >= 1: they fix every other size.
template <class V, std::size_t N>
void check_source(const char* fn, const char* name, const V& v, const char* shape,
                  const char* const (&what)[N]) {
  static_assert(N == V::rank, "one name per dim");
  require_given(fn, name, v, shape);
  for (int d = 0; d < V::rank; ++d) check_positive(fn, name, v, d, what[d]);
}

inline const char* const kXDims[] = {"B", "L", "E"};
inline const char* const kDw1Dims[] = {"E", "G", "splits", "K"};
inline const char* const kQkwDims[] = {"G", "splits", "K", "2R", "M"};
inline const char* const kDdDims[] = {"E", "G", "4M"};

/// x and the parameters fix every dimension; everything else is checked against them.
template <class T>
ProjectionDims check_inputs(const char* fn, TensorView<const T, 3> x,
                            const DynamicWeightProjection<T>& p) {
  check_source(fn, "x", x, "(B, L, E)", kXDims);
  check_source(fn, "dw1", p.dw1, "(E, G, 4, K)", kDw1Dims);
  check_source(fn, "qkw", p.qkw, "(G, 4, K, 2R, M)", kQkwDims);
  check_source(fn, "dd", p.dd, "(E, G, 4M)", kDdDims);
  ProjectionDims d;
  d.B = x.shape[0];
  d.L = x.shape[1];
  d.E = x.shape[2];
  check_dim(fn, "dw1", p.dw1, 0, "E", d.E, "x.shape[2]");
  check_dim(fn, "dw1", p.dw1, 2, "splits", 4);
  d.G = p.dw1.shape[1];
  d.K = p.dw1.shape[3];
  check_dim(fn, "qkw", p.qkw, 0, "G", d.G, "dw1.shape[1]");
  check_dim(fn, "qkw", p.qkw, 1, "splits", 4);
  check_dim(fn, "qkw", p.qkw, 2, "K", d.K, "dw1.shape[3]");
  if (p.qkw.shape[3] % 2 != 0)
    fail(fn, ": qkw.shape[3] (2R): expected an even number, got ", p.qkw.shape[3]);
  d.R = p.qkw.shape[3] / 2;
  d.M = p.qkw.shape[4];
  check_dim(fn, "dd", p.dd, 0, "E", d.E, "x.shape[2]");
  check_dim(fn, "dd", p.dd, 1, "G", d.G, "dw1.shape[1]");
  check_dim(fn, "dd", p.dd, 2, "4M", 4 * d.M, "4 * qkw.shape[4]");
  return d;
}

/// Checks the extent of a view (any strides) and records its footprint.
template <class V>
void add_view(const char* fn, std::vector<Footprint>& to, std::string name, const V& v) {
  check_extent(fn, name, v);
  to.push_back(footprint(std::move(name), v));
}

template <class U>
void add_split_views(const char* fn, std::vector<Footprint>& to, const char* prefix,
                     const SplitViews<U>& s) {
  for (int c = 0; c < 4; ++c) {
    add_view(fn, to, split_name(prefix, c, "w1"), s.w1[c]);
    add_view(fn, to, split_name(prefix, c, "w2"), s.w2[c]);
    add_view(fn, to, split_name(prefix, c, "dd"), s.dd[c]);
  }
}

template <class T>
std::vector<Footprint> input_views(const char* fn, TensorView<const T, 3> x,
                                   const DynamicWeightProjection<T>& p) {
  std::vector<Footprint> in;
  add_view(fn, in, "x", x);
  add_view(fn, in, "dw1", p.dw1);
  add_view(fn, in, "qkw", p.qkw);
  add_view(fn, in, "dd", p.dd);
  return in;
}

/// An output element reached by two indices would be written twice with different values.
template <class U>
void check_split_self_overlap(const char* fn, const char* prefix, const SplitViews<U>& s) {
  for (int c = 0; c < 4; ++c) {
    check_no_self_overlap(fn, split_name(prefix, c, "w1"), s.w1[c]);
    check_no_self_overlap(fn, split_name(prefix, c, "w2"), s.w2[c]);
    check_no_self_overlap(fn, split_name(prefix, c, "dd"), s.dd[c]);
  }
}

template <class T>
ProjectionDims validate_forward(const char* fn, const ProjectionConfig& cfg,
                                TensorView<const T, 3> x, const DynamicWeightProjection<T>& p,
                                const DynamicWeights<T>& out) {
  check_config(fn, cfg);
  const ProjectionDims d = check_inputs<T>(fn, x, p);
  const SplitViews<T> o = by_split(out);
  check_dynamic_weights(fn, "out", o, d);
  const std::vector<Footprint> in = input_views(fn, x, p);
  std::vector<Footprint> outs;
  add_split_views(fn, outs, "out", o);
  check_no_alias(fn, outs, in);
  check_split_self_overlap(fn, "out", o);
  return d;
}

template <class T>
ProjectionDims validate_backward(const char* fn, const ProjectionConfig& cfg,
                                 TensorView<const T, 3> x, const DynamicWeightProjection<T>& p,
                                 const DynamicWeights<const T>& dout, TensorView<T, 3> dx,
                                 const DynamicWeightProjectionGrads<T>& grads) {
  check_config(fn, cfg);
  const ProjectionDims d = check_inputs<T>(fn, x, p);
  const SplitViews<const T> g = by_split(dout);
  check_dynamic_weights(fn, "dout", g, d);
  require_given(fn, "dx", dx, "(B, L, E)");
  check_same_shape(fn, "dx", dx, kXDims, "x", x);
  require_given(fn, "grads.dw1", grads.dw1, "(E, G, 4, K)");
  require_given(fn, "grads.qkw", grads.qkw, "(G, 4, K, 2R, M)");
  require_given(fn, "grads.dd", grads.dd, "(E, G, 4M)");
  check_same_shape(fn, "grads.dw1", grads.dw1, kDw1Dims, "dw1", p.dw1);
  check_same_shape(fn, "grads.qkw", grads.qkw, kQkwDims, "qkw", p.qkw);
  check_same_shape(fn, "grads.dd", grads.dd, kDdDims, "dd", p.dd);

  std::vector<Footprint> in = input_views(fn, x, p);
  add_split_views(fn, in, "dout", g);
  std::vector<Footprint> outs;
  add_view(fn, outs, "dx", dx);
  add_view(fn, outs, "grads.dw1", grads.dw1);
  add_view(fn, outs, "grads.qkw", grads.qkw);
  add_view(fn, outs, "grads.dd", grads.dd);
  check_no_alias(fn, outs, in);
  check_no_self_overlap(fn, "dx", dx);
  check_no_self_overlap(fn, "grads.dw1", grads.dw1);
  check_no_self_overlap(fn, "grads.qkw", grads.qkw);
  check_no_self_overlap(fn, "grads.dd", grads.dd);
  return d;
}

}  // namespace dcmha::detail::projection

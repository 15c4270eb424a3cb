#pragma once
// Argument checks of dynamic_weights_forward / dynamic_weights_backward. Every failure throws
// dcmha::Error naming the function, the argument, the expected value and the actual one.
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "../config.hpp"
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

template <class V>
void check_given(const char* fn, const std::string& name, const V& v) {
  if (v.empty()) fail(fn, ": ", name, ": expected a tensor, got an empty view");
  for (int d = 0; d < V::rank; ++d)
    if (v.shape[d] <= 0)
      fail(fn, ": ", name, ".shape[", d, "]: expected a positive size, got ", v.shape[d]);
}

/// A dimension must equal one fixed by another argument (`source`) or by the format.
template <class V>
void check_dim(const char* fn, const std::string& name, const V& v, int d, const char* what,
               index_t expected, const char* source = nullptr) {
  if (v.shape[d] == expected) return;
  if (source)
    fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected ", expected, " (", source,
         "), got ", v.shape[d]);
  fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected ", expected, ", got ",
       v.shape[d]);
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
      check_given(fn, name, v);
      check_dim(fn, name, v, 0, "B", d.B, "x.shape[0]");
      check_dim(fn, name, v, 1, "L", d.L, "x.shape[1]");
      check_dim(fn, name, v, 2, "G", d.G, "dw1.shape[1]");
      check_dim(fn, name, v, 3, "R", d.R, "qkw.shape[3] / 2");
      check_dim(fn, name, v, 4, "M", d.M, "qkw.shape[4]");
    }
    const std::string name = split_name(prefix, c, "dd");
    check_given(fn, name, s.dd[c]);
    check_dim(fn, name, s.dd[c], 0, "B", d.B, "x.shape[0]");
    check_dim(fn, name, s.dd[c], 1, "L", d.L, "x.shape[1]");
    check_dim(fn, name, s.dd[c], 2, "G", d.G, "dw1.shape[1]");
    check_dim(fn, name, s.dd[c], 3, "M", d.M, "qkw.shape[4]");
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

/// x and the parameters fix every dimension; everything else is checked against them.
template <class T>
ProjectionDims check_inputs(const char* fn, TensorView<const T, 3> x,
                            const DynamicWeightProjection<T>& p) {
  check_given(fn, "x", x);
  check_given(fn, "dw1", p.dw1);
  check_given(fn, "qkw", p.qkw);
  check_given(fn, "dd", p.dd);
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

/// Half-open address range [lo, hi) a view can touch, whatever the signs of its strides.
struct AddressRange {
  std::uintptr_t lo = 0, hi = 0;
  bool overlaps(const AddressRange& o) const { return lo < o.hi && o.lo < hi; }
};

template <class V>
AddressRange address_range(const V& v) {
  index_t lo = 0, hi = 0;
  for (int d = 0; d < V::rank; ++d) {
    const index_t extent = (v.shape[d] - 1) * v.stride[d];
    (extent < 0 ? lo : hi) += extent;
  }
  using E = typename V::value_type;
  const auto base = reinterpret_cast<std::uintptr_t>(v.data);
  const auto size = static_cast<std::intptr_t>(sizeof(E));
  return {static_cast<std::uintptr_t>(static_cast<std::intptr_t>(base) + lo * size),
          static_cast<std::uintptr_t>(static_cast<std::intptr_t>(base) + (hi + 1) * size)};
}

struct NamedRange {
  std::string name;
  AddressRange range;
  const void* data;
};

/// Outputs are written while inputs are still being read (and the backward reads its
/// upstream gradients after writing some results), so any overlap of an output's address
/// range with an input's is rejected. Two outputs may share a buffer when they interleave
/// (e.g. qw1 and qw2 as halves of one (B, L, G, 2R, M) allocation), which address ranges
/// cannot tell from real aliasing; only the unambiguous case, the same start address, is
/// rejected there.
inline void check_no_alias(const char* fn, const std::vector<NamedRange>& inputs,
                           const std::vector<NamedRange>& outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (const NamedRange& in : inputs)
      if (outputs[i].range.overlaps(in.range))
        fail(fn, ": ", outputs[i].name, ": expected memory disjoint from input ", in.name,
             ", got overlapping address ranges");
    for (std::size_t j = 0; j < i; ++j)
      if (outputs[i].data == outputs[j].data)
        fail(fn, ": ", outputs[i].name, ": expected memory distinct from output ",
             outputs[j].name, ", got the same address");
  }
}

template <class V>
NamedRange named_range(std::string name, const V& v) {
  return {std::move(name), address_range(v), static_cast<const void*>(v.data)};
}

template <class U>
void add_ranges(std::vector<NamedRange>& out, const char* prefix, const SplitViews<U>& s) {
  for (int c = 0; c < 4; ++c) {
    out.push_back(named_range(split_name(prefix, c, "w1"), s.w1[c]));
    out.push_back(named_range(split_name(prefix, c, "w2"), s.w2[c]));
    out.push_back(named_range(split_name(prefix, c, "dd"), s.dd[c]));
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
  std::vector<NamedRange> in{named_range("x", x), named_range("dw1", p.dw1),
                             named_range("qkw", p.qkw), named_range("dd", p.dd)};
  std::vector<NamedRange> outs;
  add_ranges(outs, "out", o);
  check_no_alias(fn, in, outs);
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
  check_given(fn, "dx", dx);
  for (int k = 0; k < 3; ++k)
    check_dim(fn, "dx", dx, k, k == 0 ? "B" : k == 1 ? "L" : "E", x.shape[k],
              k == 0 ? "x.shape[0]" : k == 1 ? "x.shape[1]" : "x.shape[2]");
  check_given(fn, "grads.dw1", grads.dw1);
  check_given(fn, "grads.qkw", grads.qkw);
  check_given(fn, "grads.dd", grads.dd);
  static const char* const dw1_what[4] = {"E", "G", "splits", "K"};
  static const char* const dw1_src[4] = {"dw1.shape[0]", "dw1.shape[1]", "dw1.shape[2]",
                                         "dw1.shape[3]"};
  for (int k = 0; k < 4; ++k)
    check_dim(fn, "grads.dw1", grads.dw1, k, dw1_what[k], p.dw1.shape[k], dw1_src[k]);
  static const char* const qkw_what[5] = {"G", "splits", "K", "2R", "M"};
  static const char* const qkw_src[5] = {"qkw.shape[0]", "qkw.shape[1]", "qkw.shape[2]",
                                         "qkw.shape[3]", "qkw.shape[4]"};
  for (int k = 0; k < 5; ++k)
    check_dim(fn, "grads.qkw", grads.qkw, k, qkw_what[k], p.qkw.shape[k], qkw_src[k]);
  static const char* const dd_what[3] = {"E", "G", "4M"};
  static const char* const dd_src[3] = {"dd.shape[0]", "dd.shape[1]", "dd.shape[2]"};
  for (int k = 0; k < 3; ++k)
    check_dim(fn, "grads.dd", grads.dd, k, dd_what[k], p.dd.shape[k], dd_src[k]);

  std::vector<NamedRange> in{named_range("x", x), named_range("dw1", p.dw1),
                             named_range("qkw", p.qkw), named_range("dd", p.dd)};
  add_ranges(in, "dout", g);
  std::vector<NamedRange> outs{named_range("dx", dx), named_range("grads.dw1", grads.dw1),
                               named_range("grads.qkw", grads.qkw),
                               named_range("grads.dd", grads.dd)};
  check_no_alias(fn, in, outs);
  return d;
}

}  // namespace dcmha::detail::projection

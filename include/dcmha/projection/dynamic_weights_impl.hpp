#pragma once
// Entry points of the dynamic weight projection (spec section 2), included from the end of
// dynamic_weights.hpp.
//
//   dynamic_weights_forward (cfg, x, p, out)                 x (B, L, E) -> the twelve tensors
//   dynamic_weights_backward(cfg, x, p, dout, dx, grads)     gradients of sum(out * dout)
//
// Shapes: x, dx (B, L, E); dw1 (E, G, 4, K); qkw (G, 4, K, 2R, M); dd (E, G, 4M); w1/w2
// (B, L, G, R, M); dd outputs (B, L, G, M). Any strides. Outputs are overwritten. The backward
// recomputes the hidden activations from x: nothing is kept between the two calls.
#include "kernels.hpp"
#include "validate.hpp"

namespace dcmha {

namespace detail {
template <class T>
void dynamic_weights_forward_impl(const ProjectionConfig& cfg, TensorView<const T, 3> x,
                                  const DynamicWeightProjection<T>& p,
                                  const DynamicWeights<T>& out) {
  const projection::ProjectionDims d =
      projection::validate_forward("dcmha::dynamic_weights_forward", cfg, x, p, out);
  projection::forward(cfg, d, x, p, out);
}

template <class T>
void dynamic_weights_backward_impl(const ProjectionConfig& cfg, TensorView<const T, 3> x,
                                   const DynamicWeightProjection<T>& p,
                                   const DynamicWeights<const T>& dout, TensorView<T, 3> dx,
                                   const DynamicWeightProjectionGrads<T>& grads) {
  const projection::ProjectionDims d = projection::validate_backward(
      "dcmha::dynamic_weights_backward", cfg, x, p, dout, dx, grads);
  projection::backward(cfg, d, x, p, dout, dx, grads);
}

template <class T>
DynamicWeightsSide<const T> as_const_side(const DynamicWeightsSide<T>& s) {
  return {s.qw1, s.qw2, s.kw1, s.kw2, s.qdd, s.kdd};
}
}  // namespace detail

/// Read-only views of dynamic tensors, e.g. gradients an attention backward just wrote.
template <class T>
DynamicWeights<const T> read_only(const DynamicWeights<T>& w) {
  return {detail::as_const_side(w.pre), detail::as_const_side(w.post)};
}

// Non-template overloads, so that views of mutable memory convert to the const views below
// without spelling out the scalar type. The second backward takes upstream gradients held in
// mutable views (the buffers compose_grads() hands to the attention backward).
#define DCMHA_DEFINE_PROJECTION_ENTRY_POINTS(T)                                                 \
  inline void dynamic_weights_forward(const ProjectionConfig& cfg, TensorView<const T, 3> x,    \
                                      const DynamicWeightProjection<T>& p,                      \
                                      const DynamicWeights<T>& out) {                           \
    detail::dynamic_weights_forward_impl<T>(cfg, x, p, out);                                    \
  }                                                                                             \
  inline void dynamic_weights_backward(const ProjectionConfig& cfg, TensorView<const T, 3> x,   \
                                       const DynamicWeightProjection<T>& p,                     \
                                       const DynamicWeights<const T>& dout, TensorView<T, 3> dx, \
                                       const DynamicWeightProjectionGrads<T>& grads) {          \
    detail::dynamic_weights_backward_impl<T>(cfg, x, p, dout, dx, grads);                       \
  }                                                                                             \
  inline void dynamic_weights_backward(const ProjectionConfig& cfg, TensorView<const T, 3> x,   \
                                       const DynamicWeightProjection<T>& p,                     \
                                       const DynamicWeights<T>& dout, TensorView<T, 3> dx,      \
                                       const DynamicWeightProjectionGrads<T>& grads) {          \
    detail::dynamic_weights_backward_impl<T>(cfg, x, p, read_only(dout), dx, grads);             \
  }

DCMHA_DEFINE_PROJECTION_ENTRY_POINTS(float)
DCMHA_DEFINE_PROJECTION_ENTRY_POINTS(double)
#undef DCMHA_DEFINE_PROJECTION_ENTRY_POINTS

}  // namespace dcmha

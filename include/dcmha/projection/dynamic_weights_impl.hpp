#pragma once
// Entry points of the dynamic weight projection (spec section 2), included from the end of
// dynamic_weights.hpp.
//
//   dynamic_weights_forward (cfg, x, p, out [, keep])          x (B, L, E) -> the twelve tensors
//   dynamic_weights_backward(cfg, x, p, [kept,] dout, dx, grads) gradients of sum(out * dout)
//
// Shapes: x, dx (B, L, E); dw1 (E, G, 4, K); qkw (G, 4, K, 2R, M); dd (E, G, 4M); w1/w2
// (B, L, G, R, M); dd outputs (B, L, G, M). Any strides. Outputs are overwritten. Without a
// ProjectionActivations the backward recomputes the hidden activations from x, so nothing is
// kept between the two calls; with one, the forward keeps them and the backward reads them.
// Scalar types: float, double, and bf16 / fp16 storage (narrow.hpp: the float kernels on the
// widened values, each result rounded once; kept activations in float).
#include "kernels.hpp"
#include "narrow.hpp"
#include "validate.hpp"

namespace dcmha {

namespace detail {
template <class T>
void dynamic_weights_forward_impl(const ProjectionConfig& cfg, TensorView<const T, 3> x,
                                  const DynamicWeightProjection<T>& p, const DynamicWeights<T>& out,
                                  ProjectionActivations<T>* keep = nullptr) {
  const char* fn = "dcmha::dynamic_weights_forward";
  with_allocation_errors(fn, [&] {
    const projection::ProjectionDims d = projection::validate_forward(fn, cfg, x, p, out);
    auto* r = keep ? &projection::ActivationsAccess::get(*keep) : nullptr;
    if constexpr (std::is_same_v<T, acc_t<T>>)
      projection::forward(cfg, d, x, p, out, r);
    else
      projection::forward_narrow(cfg, d, x, p, out, r);
  });
}

template <class T>
void dynamic_weights_backward_impl(const ProjectionConfig& cfg, TensorView<const T, 3> x,
                                   const DynamicWeightProjection<T>& p,
                                   const DynamicWeights<const T>& dout, TensorView<T, 3> dx,
                                   const DynamicWeightProjectionGrads<T>& grads,
                                   const ProjectionActivations<T>* kept = nullptr) {
  const char* fn = "dcmha::dynamic_weights_backward";
  with_allocation_errors(fn, [&] {
    const projection::ProjectionDims d =
        projection::validate_backward(fn, cfg, x, p, dout, dx, grads);
    const auto* r = kept ? projection::ActivationsAccess::find(*kept) : nullptr;
    if (kept) projection::check_activations(fn, r, d);
    if constexpr (std::is_same_v<T, acc_t<T>>)
      projection::backward(cfg, d, x, p, dout, dx, grads, r);
    else
      projection::backward_narrow(cfg, d, x, p, dout, dx, grads, r);
  });
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
#define DCMHA_DEFINE_PROJECTION_ENTRY_POINTS(T)                                                   \
  inline void dynamic_weights_forward(const ProjectionConfig& cfg, TensorView<const T, 3> x,      \
                                      const DynamicWeightProjection<T>& p,                        \
                                      const DynamicWeights<T>& out) {                             \
    detail::dynamic_weights_forward_impl<T>(cfg, x, p, out);                                      \
  }                                                                                               \
  inline void dynamic_weights_backward(const ProjectionConfig& cfg, TensorView<const T, 3> x,     \
                                       const DynamicWeightProjection<T>& p,                       \
                                       const DynamicWeights<const T>& dout, TensorView<T, 3> dx,  \
                                       const DynamicWeightProjectionGrads<T>& grads) {            \
    detail::dynamic_weights_backward_impl<T>(cfg, x, p, dout, dx, grads);                         \
  }                                                                                               \
  inline void dynamic_weights_backward(const ProjectionConfig& cfg, TensorView<const T, 3> x,     \
                                       const DynamicWeightProjection<T>& p,                       \
                                       const DynamicWeights<T>& dout, TensorView<T, 3> dx,        \
                                       const DynamicWeightProjectionGrads<T>& grads) {            \
    detail::dynamic_weights_backward_impl<T>(cfg, x, p, read_only(dout), dx, grads);              \
  }                                                                                               \
  inline void dynamic_weights_forward(                                                            \
      const ProjectionConfig& cfg, TensorView<const T, 3> x, const DynamicWeightProjection<T>& p, \
      const DynamicWeights<T>& out, ProjectionActivations<T>& keep) {                             \
    detail::dynamic_weights_forward_impl<T>(cfg, x, p, out, &keep);                               \
  }                                                                                               \
  inline void dynamic_weights_backward(                                                           \
      const ProjectionConfig& cfg, TensorView<const T, 3> x, const DynamicWeightProjection<T>& p, \
      const ProjectionActivations<T>& kept, const DynamicWeights<const T>& dout,                  \
      TensorView<T, 3> dx, const DynamicWeightProjectionGrads<T>& grads) {                        \
    detail::dynamic_weights_backward_impl<T>(cfg, x, p, dout, dx, grads, &kept);                  \
  }                                                                                               \
  inline void dynamic_weights_backward(                                                           \
      const ProjectionConfig& cfg, TensorView<const T, 3> x, const DynamicWeightProjection<T>& p, \
      const ProjectionActivations<T>& kept, const DynamicWeights<T>& dout, TensorView<T, 3> dx,   \
      const DynamicWeightProjectionGrads<T>& grads) {                                             \
    detail::dynamic_weights_backward_impl<T>(cfg, x, p, read_only(dout), dx, grads, &kept);       \
  }

template <class T>
ProjectionActivations<T>::ProjectionActivations() = default;
template <class T>
ProjectionActivations<T>::~ProjectionActivations() = default;
template <class T>
ProjectionActivations<T>::ProjectionActivations(ProjectionActivations&&) noexcept = default;
template <class T>
ProjectionActivations<T>& ProjectionActivations<T>::operator=(ProjectionActivations&&) noexcept =
    default;
template <class T>
std::size_t ProjectionActivations<T>::bytes() const {
  return r_ ? r_->bytes() : 0;
}
template <class T>
void ProjectionActivations<T>::release() {
  r_.reset();
}

DCMHA_DEFINE_PROJECTION_ENTRY_POINTS(float)
DCMHA_DEFINE_PROJECTION_ENTRY_POINTS(double)
DCMHA_DEFINE_PROJECTION_ENTRY_POINTS(bf16)
DCMHA_DEFINE_PROJECTION_ENTRY_POINTS(half)
#undef DCMHA_DEFINE_PROJECTION_ENTRY_POINTS

}  // namespace dcmha

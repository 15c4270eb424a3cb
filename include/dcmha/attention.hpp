#pragma once
// Public entry points of the attention core: MHA and DCMHA share one call shape.
//
//   forward (cfg, q, k, v, out, lse)                      multi-head attention
//   forward (cfg, q, k, v, out, lse, compose)             DCMHA: the same call plus compose weights
//   backward(cfg, q, k, v, lse, dout, dq, dk, dv)                   MHA gradients
//   backward(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose) DCMHA gradients
//   backward(cfg, q, k, v, out, lse, dout, dq, dk, dv[, compose, dcompose])  the same, given
//                                                                     the forward's output
//
// Logical shapes (any strides; see tensor.hpp for bhtd()/bthd()):
//   q (B, H, T, D)   k (B, Hk, S, D)   v (B, Hk, S, Dv)   out, dout (B, H, T, Dv)
//   lse (B, H, T): per-row softmax statistics written by forward and read by backward; the only
//   state kept between the two (O(B*H*T), never B*H*T*S). Pass an empty view for inference.
// Hk divides H (GQA: head h reads kv head h / (H / Hk)). Gradients are overwritten, not added.
// out, given to backward, must be the forward's output for the same inputs and lse: the CUDA
// backward then takes each row's D = sum(dout * out) from it (FlashAttention's way) instead of
// a pass over the keys, where Compose_post is off (MHA included); with Compose_post on, and on
// the CPU, D is computed as without it and `out` is only validated.
// Scalar types: float, double, and bf16 and fp16 storage (config.hpp: float arithmetic, float
// lse).
// Each entry point also takes a trailing Workspace& (after compose / dcompose, which may be {}):
// the kernels' buffers are then kept in it between calls instead of allocated per call.
#include "compose_weights.hpp"
#include "config.hpp"
#include "cpu/backward_launch.hpp"
#include "cpu/forward_launch.hpp"
#include "detail/validate.hpp"
#include "error.hpp"
#include "tensor.hpp"
#include "workspace.hpp"

namespace dcmha {

/// Whether cfg.products = Products::storage_type changes the arithmetic for storage type T on
/// this machine: bf16 where the CPU has AVX512_BF16 (asked at run time); false for every other
/// type and CPU, where the setting computes as Products::exact.
template <class T>
bool storage_type_products_available() {
  return cpu::uses_bf16_products<T>(Products::storage_type);
}

namespace detail {
template <class T>
void forward_impl(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,
                  TensorView<const T, 4> v, TensorView<T, 4> out, TensorView<acc_t<T>, 3> lse,
                  const ComposeWeights<T>& compose, Workspace* workspace) {
  const char* fn = "dcmha::forward";
  with_allocation_errors(fn, [&] {  // validation allocates too (names in messages)
    const ForwardParams<T> params = forward_params(fn, cfg, q, k, v, out, lse, compose);
    WorkspaceAccess::CallMemory mem(fn, workspace);
    cpu::forward(params, mem.get());
  });
}

template <class T>
void backward_impl(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,
                   TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,
                   TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk,
                   TensorView<T, 4> dv, const ComposeWeights<T>& compose,
                   const ComposeGrads<T>& dcompose, Workspace* workspace,
                   TensorView<const T, 4> out = {}) {
  const char* fn = "dcmha::backward";
  with_allocation_errors(fn, [&] {
    const BackwardParams<T> params =
        backward_params(fn, cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, out);
    WorkspaceAccess::CallMemory mem(fn, workspace);
    cpu::backward(params, mem.get());
  });
}
}  // namespace detail

// Non-template overloads, so that views of mutable memory convert to the const views below
// without spelling out the scalar type. The overloads with a Workspace keep the kernels' buffers
// there between calls (workspace.hpp); the others allocate them per call.
#define DCMHA_DEFINE_ATTENTION_ENTRY_POINTS(T)                                                    \
  inline void forward(const AttentionConfig& cfg, TensorView<const T, 4> q,                       \
                      TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<T, 4> out,   \
                      TensorView<acc_t<T>, 3> lse = {}, const ComposeWeights<T>& compose = {}) {  \
    detail::forward_impl<T>(cfg, q, k, v, out, lse, compose, nullptr);                            \
  }                                                                                               \
  inline void forward(const AttentionConfig& cfg, TensorView<const T, 4> q,                       \
                      TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<T, 4> out,   \
                      TensorView<acc_t<T>, 3> lse, const ComposeWeights<T>& compose,              \
                      Workspace& workspace) {                                                     \
    detail::forward_impl<T>(cfg, q, k, v, out, lse, compose, &workspace);                         \
  }                                                                                               \
  inline void backward(                                                                           \
      const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,             \
      TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse, TensorView<const T, 4> dout,   \
      TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,                              \
      const ComposeWeights<T>& compose = {}, const ComposeGrads<T>& dcompose = {}) {              \
    detail::backward_impl<T>(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, nullptr);    \
  }                                                                                               \
  inline void backward(                                                                           \
      const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,             \
      TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse, TensorView<const T, 4> dout,   \
      TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv,                              \
      const ComposeWeights<T>& compose, const ComposeGrads<T>& dcompose, Workspace& workspace) {  \
    detail::backward_impl<T>(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, &workspace); \
  }                                                                                               \
  inline void backward(                                                                           \
      const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,             \
      TensorView<const T, 4> v, TensorView<const T, 4> out, TensorView<const acc_t<T>, 3> lse,    \
      TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv, \
      const ComposeWeights<T>& compose = {}, const ComposeGrads<T>& dcompose = {}) {              \
    detail::backward_impl<T>(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, nullptr,     \
                             out);                                                                \
  }                                                                                               \
  inline void backward(                                                                           \
      const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,             \
      TensorView<const T, 4> v, TensorView<const T, 4> out, TensorView<const acc_t<T>, 3> lse,    \
      TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv, \
      const ComposeWeights<T>& compose, const ComposeGrads<T>& dcompose, Workspace& workspace) {  \
    detail::backward_impl<T>(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, &workspace,  \
                             out);                                                                \
  }

DCMHA_DEFINE_ATTENTION_ENTRY_POINTS(float)
DCMHA_DEFINE_ATTENTION_ENTRY_POINTS(double)
DCMHA_DEFINE_ATTENTION_ENTRY_POINTS(bf16)
DCMHA_DEFINE_ATTENTION_ENTRY_POINTS(half)
#undef DCMHA_DEFINE_ATTENTION_ENTRY_POINTS

}  // namespace dcmha

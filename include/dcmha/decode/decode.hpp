#pragma once
// Incremental decoding (spec section 3): new queries against a layer's DecodeCache.
//
// One step of a layer, for n new tokens per sequence (n = 1 for plain decoding, n = prompt length
// or a chunk of it for prefill):
//
//   cache.append(k_new, v_new, key_side, counts);   // 1. K, V and key-wise state of the new tokens
//   dcmha::decode(cfg, q_new, cache, query_side, out); // 2. their queries against everything kept
//
// Append first: a new token attends to itself and to the new tokens before it, so they must be in
// the cache already. The result equals the rows of the full causal forward over all tokens so far
// (with the layer's sliding window, if any) for the new positions. Calling decode() again
// without an append recomputes the same step.
//
// The weights are split by where they come from. key_side (for append): the key-wise terms
// kw1, kw2, kdd of the new tokens only. query_side (for decode): the static W and the query-wise
// terms qw1, qw2, qdd of the new tokens; its key_wise switches must be off, the key-wise terms of
// every cached key come from the cache, on exactly the sides the cache config enables.
// decode_query_side() / decode_key_side() make both from one dynamic weight projection output.
//
// cfg: scale and num_threads as in forward(); mask must be causal and window 0 or the cache's
// (the cache's window is used); query_lengths / key_lengths must be empty (the cache supplies
// them). A padded batch passes counts to append(); rows t >= counts[b] of out are then zero.
// decode(..., out, workspace) keeps the kernel's buffers in a Workspace between steps (one per
// decoding thread; see workspace.hpp) instead of allocating them every step.
#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../cpu/forward_launch.hpp"
#include "../dynamic_weights.hpp"
#include "../error.hpp"
#include "../tensor.hpp"
#include "../workspace.hpp"
#include "decode_cache.hpp"
#include "decode_params.hpp"

namespace dcmha {

/// decode()'s query_side from the dynamic weights of the new tokens: query-wise terms on both
/// sides, static terms where a W (G, M, M) is given.
template <class U, class T = std::remove_const_t<U>>
inline ComposeWeights<T> decode_query_side(const DynamicWeights<U>& dw,
                                           TensorView<const T, 3> pre_w = {},
                                           TensorView<const T, 3> post_w = {}) {
  auto side = [](const DynamicWeightsSide<U>& s, TensorView<const T, 3> w) {
    ComposeTerms<T> c;
    c.static_w = !w.empty();
    c.query_wise = true;
    c.w = w;
    c.qw1 = s.qw1;
    c.qw2 = s.qw2;
    c.qdd = s.qdd;
    return c;
  };
  return {side(dw.pre, pre_w), side(dw.post, post_w)};
}

/// DecodeCache::append()'s key_side from the same dynamic weights: key-wise terms on both sides.
template <class U, class T = std::remove_const_t<U>>
inline ComposeWeights<T> decode_key_side(const DynamicWeights<U>& dw) {
  auto side = [](const DynamicWeightsSide<U>& s) {
    ComposeTerms<T> c;
    c.key_wise = true;
    c.kw1 = s.kw1;
    c.kw2 = s.kw2;
    c.kdd = s.kdd;
    return c;
  };
  return {side(dw.pre), side(dw.post)};
}

namespace detail {

template <class T>
void decode_step(const char* fn, const AttentionConfig& cfg, TensorView<const T, 4> q_new,
                 const DecodeCache<T>& cache, const ComposeWeights<T>& query_side,
                 TensorView<T, 4> out, Workspace* workspace) {
  DecodeStepLengths lengths;
  const ForwardParams<T> params = decode_params(fn, cfg, q_new, cache, query_side, out, lengths);
  WorkspaceAccess::CallMemory mem(fn, workspace);
  cpu::forward(params, mem.get());
}

template <class T>
void decode_impl(const AttentionConfig& cfg, TensorView<const T, 4> q_new,
                 const DecodeCache<T>& cache, const ComposeWeights<T>& query_side,
                 TensorView<T, 4> out, Workspace* workspace) {
  const char* fn = "dcmha::decode";
  with_allocation_errors(fn,
                         [&] { decode_step(fn, cfg, q_new, cache, query_side, out, workspace); });
}

}  // namespace detail

// Non-template overloads, so that views of mutable memory convert to the const views below.
#define DCMHA_DEFINE_DECODE_ENTRY_POINTS(T)                                            \
  inline void decode(const AttentionConfig& cfg, TensorView<const T, 4> q_new,         \
                     const DecodeCache<T>& cache, const ComposeWeights<T>& query_side, \
                     TensorView<T, 4> out) {                                           \
    detail::decode_impl<T>(cfg, q_new, cache, query_side, out, nullptr);               \
  }                                                                                    \
  inline void decode(const AttentionConfig& cfg, TensorView<const T, 4> q_new,         \
                     const DecodeCache<T>& cache, TensorView<T, 4> out) {              \
    detail::decode_impl<T>(cfg, q_new, cache, ComposeWeights<T>{}, out, nullptr);      \
  }                                                                                    \
  inline void decode(const AttentionConfig& cfg, TensorView<const T, 4> q_new,         \
                     const DecodeCache<T>& cache, const ComposeWeights<T>& query_side, \
                     TensorView<T, 4> out, Workspace& workspace) {                     \
    detail::decode_impl<T>(cfg, q_new, cache, query_side, out, &workspace);            \
  }

DCMHA_DEFINE_DECODE_ENTRY_POINTS(float)
DCMHA_DEFINE_DECODE_ENTRY_POINTS(double)
DCMHA_DEFINE_DECODE_ENTRY_POINTS(bf16)
DCMHA_DEFINE_DECODE_ENTRY_POINTS(half)
#undef DCMHA_DEFINE_DECODE_ENTRY_POINTS

}  // namespace dcmha

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
#include <algorithm>
#include <vector>

#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../cpu/forward_launch.hpp"
#include "../detail/validate.hpp"
#include "../dynamic_weights.hpp"
#include "../error.hpp"
#include "../tensor.hpp"
#include "../workspace.hpp"
#include "decode_cache.hpp"

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
void check_query_side(const char* fn, const ComposeWeights<T>& qs, const DecodeCacheConfig& cc) {
  const char* names[2] = {"pre", "post"};
  const ComposeTerms<T>* sides[2] = {&qs.pre, &qs.post};
  for (int s = 0; s < 2; ++s) {
    const ComposeTerms<T>& c = *sides[s];
    const std::string arg = std::string("query_side.") + names[s];
    if (c.key_wise || !c.kw1.empty() || !c.kw2.empty() || !c.kdd.empty())
      fail(fn, ": ", arg,
           ".key_wise: expected off (key-wise terms of every cached key come from the "
           "cache; pass the new tokens' ones to DecodeCache::append), got on");
    // The cache's G is the layer's: query-wise terms of another grouping would mix other heads.
    if (!c.w.empty()) check_dim(fn, arg + ".w", c.w, 0, "G", cc.G, "cache.config().G");
    if (!c.qw1.empty()) check_dim(fn, arg + ".qw1", c.qw1, 2, "G", cc.G, "cache.config().G");
    if (!c.qw2.empty()) check_dim(fn, arg + ".qw2", c.qw2, 2, "G", cc.G, "cache.config().G");
    if (!c.qdd.empty()) check_dim(fn, arg + ".qdd", c.qdd, 2, "G", cc.G, "cache.config().G");
  }
}

template <class T>
void decode_step(const char* fn, const AttentionConfig& cfg, TensorView<const T, 4> q_new,
                 const DecodeCache<T>& cache, const ComposeWeights<T>& query_side,
                 TensorView<T, 4> out, Workspace* workspace) {
  const DecodeCacheConfig& cc = cache.config();
  if (cfg.mask != Mask::causal)
    fail(fn,
         ": cfg.mask: expected Mask::causal (new tokens see the cache and each other causally), "
         "got Mask::full");
  if (cfg.window != 0 && cfg.window != cc.window)
    fail(fn, ": cfg.window: expected 0 or ", cc.window, " (cache.config().window), got ",
         cfg.window);
  if (!cfg.query_lengths.empty())
    fail(fn,
         ": cfg.query_lengths: expected an empty view (the counts of the last "
         "DecodeCache::append are used), got a tensor");
  if (!cfg.key_lengths.empty())
    fail(fn,
         ": cfg.key_lengths: expected an empty view (the cache's lengths are used), got a tensor");
  if (cache.last_step() == 0)
    fail(fn,
         ": cache: expected the new tokens appended (call DecodeCache::append before decode), "
         "got no append since construction or reset()");
  require_given(fn, "q_new", q_new, "(B, H, n, D)");
  check_shape(fn, "q_new", q_new,
              {{"B", cc.B, "cache.config().B"},
               {"H", cc.H, "cache.config().H"},
               {"n", cache.last_step(), "the n of the last DecodeCache::append"},
               {"D", cc.D, "cache.config().D"}});
  check_query_side(fn, query_side, cc);

  const index_t B = cc.B, cap = cache.capacity();
  std::vector<index_t> counts(B), kept(B), start(B);
  index_t S = 1;  // a view needs >= 1 key even when every sequence is still empty
  for (index_t b = 0; b < B; ++b) {
    counts[b] = cache.last_count(b);
    kept[b] = cache.kept(b);
    // Logical key 0 is the oldest key kept: token length - kept, in slot (length - kept) % cap.
    start[b] = (cache.length(b) - kept[b]) % cap;
    S = std::max(S, kept[b]);
  }
  // A sequence holding fewer than cap keys has never wrapped (start 0), so slots stay below S for
  // it, and S == cap once one has: every slot the kernel reaches lies inside these views.
  auto first_keys = [S](auto v, int dim) {
    if (!v.empty()) v.shape[dim] = S;
    return v;
  };

  AttentionConfig c2 = cfg;
  c2.mask = Mask::causal;
  c2.window = cc.window;
  c2.query_lengths = view<1>(static_cast<const index_t*>(counts.data()), {B});
  c2.key_lengths = view<1>(static_cast<const index_t*>(kept.data()), {B});

  ComposeWeights<T> cw = query_side;
  ComposeTerms<T>* sides[2] = {&cw.pre, &cw.post};
  for (int s = 0; s < 2; ++s) {
    const bool post = s == 1;
    if (!(post ? cc.post_key_wise : cc.pre_key_wise)) continue;
    sides[s]->key_wise = true;
    sides[s]->kw1 = first_keys(cache.kw1_slots(post), 1);
    sides[s]->kw2 = first_keys(cache.kw2_slots(post), 1);
    sides[s]->kdd = first_keys(cache.kdd_slots(post), 1);
  }
  const TensorView<const T, 4> k = first_keys(cache.k_slots(), 2);
  const TensorView<const T, 4> v = first_keys(cache.v_slots(), 2);

  ForwardParams<T> params = forward_params<T>(fn, c2, q_new, k, v, out, {}, cw);
  if (cache.local()) params.keys = {cap, view<1>(static_cast<const index_t*>(start.data()), {B})};
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
#undef DCMHA_DEFINE_DECODE_ENTRY_POINTS

}  // namespace dcmha

#pragma once
// What every backend's decode step shares (decode.hpp, cuda/decode.hpp): a step's checks and
// its ForwardParams over the cache's slots.
#include <algorithm>
#include <string>
#include <vector>

#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../detail/validate.hpp"
#include "../error.hpp"
#include "../params.hpp"
#include "../tensor.hpp"
#include "decode_cache.hpp"

namespace dcmha {

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

/// The host arrays a decode step's ForwardParams point to: the step's token counts and the
/// kept keys (its lengths), and where each sequence's oldest kept key lies in its ring.
struct DecodeStepLengths {
  std::vector<index_t> counts, kept, start;
};

/// A decode step's checks of its arguments against the cache.
template <class T>
void check_decode_step(const char* fn, const AttentionConfig& cfg, TensorView<const T, 4> q_new,
                       const DecodeCache<T>& cache, const ComposeWeights<T>& query_side) {
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
}

/// The step's counts, kept keys and ring starts into `lengths`; returns the most keys any
/// sequence keeps (at least 1: a view needs a key even when every sequence is still empty).
template <class T>
index_t step_lengths(const DecodeCache<T>& cache, DecodeStepLengths& lengths) {
  const index_t B = cache.config().B, cap = cache.capacity();
  lengths.counts.resize(B), lengths.kept.resize(B), lengths.start.resize(B);
  index_t S = 1;
  for (index_t b = 0; b < B; ++b) {
    lengths.counts[b] = cache.last_count(b);
    lengths.kept[b] = cache.kept(b);
    // Logical key 0 is the oldest key kept: token length - kept, in slot (length - kept) % cap.
    lengths.start[b] = (cache.length(b) - lengths.kept[b]) % cap;
    S = std::max(S, lengths.kept[b]);
  }
  return S;
}

/// A decode step as a forward over the cache's slots: validates, then the backend's parameters
/// (lengths and ring starts in `lengths`, which must outlive them). Shared by the backends.
template <class T>
ForwardParams<T> decode_params(const char* fn, const AttentionConfig& cfg,
                               TensorView<const T, 4> q_new, const DecodeCache<T>& cache,
                               const ComposeWeights<T>& query_side, TensorView<T, 4> out,
                               DecodeStepLengths& lengths) {
  check_decode_step(fn, cfg, q_new, cache, query_side);
  const DecodeCacheConfig& cc = cache.config();
  const index_t B = cc.B, S = step_lengths(cache, lengths);
  // A sequence holding fewer keys than the cache's capacity has never wrapped (start 0), so its
  // slots stay below S, and S is the capacity once one has: every slot the kernel reaches lies
  // inside these views.
  auto first_keys = [S](auto v, int dim) {
    if (!v.empty()) v.shape[dim] = S;
    return v;
  };

  AttentionConfig c2 = cfg;
  c2.mask = Mask::causal;
  c2.window = cc.window;
  c2.query_lengths = view<1>(static_cast<const index_t*>(lengths.counts.data()), {B});
  c2.key_lengths = view<1>(static_cast<const index_t*>(lengths.kept.data()), {B});

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
  if (cache.local())
    params.keys = {cache.capacity(),
                   view<1>(static_cast<const index_t*>(lengths.start.data()), {B})};
  return params;
}

}  // namespace detail

}  // namespace dcmha

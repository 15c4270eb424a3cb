#pragma once
// Which Compose terms a call has, with their ranks: the term set every backend plans and
// dispatches on (spec section 1, Compose), read once from the ComposeWeights the caller passed.
#include "../compose_weights.hpp"
#include "../tensor.hpp"

namespace dcmha::detail {

/// One side's terms (pre or post).
struct ComposeTermSet {
  bool static_w = false, query_wise = false, key_wise = false;
  index_t query_rank = 0, key_rank = 0;  // R of the low-rank terms that are on, else 0

  DCMHA_INLINE bool enabled() const { return static_w || query_wise || key_wise; }
  DCMHA_INLINE index_t rank() const { return query_rank > key_rank ? query_rank : key_rank; }

  template <class T>
  DCMHA_INLINE static ComposeTermSet of(const ComposeTerms<T>& c) {
    ComposeTermSet s;
    s.static_w = c.static_w;
    s.query_wise = c.query_wise;
    s.key_wise = c.key_wise;
    s.query_rank = c.query_wise ? c.qw1.shape[3] : 0;
    s.key_rank = c.key_wise ? c.kw1.shape[3] : 0;
    return s;
  }
};

/// Both sides.
struct ComposeTermSets {
  ComposeTermSet pre, post;

  DCMHA_INLINE bool enabled() const { return pre.enabled() || post.enabled(); }
  /// The largest R of any low-rank term that is on (0: none).
  DCMHA_INLINE index_t largest_rank() const {
    return pre.rank() > post.rank() ? pre.rank() : post.rank();
  }

  template <class T>
  DCMHA_INLINE static ComposeTermSets of(const ComposeWeights<T>& c) {
    return {ComposeTermSet::of(c.pre), ComposeTermSet::of(c.post)};
  }
};

}  // namespace dcmha::detail

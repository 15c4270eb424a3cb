#pragma once
// Compose weights of a tile's rows and keys into shared memory (in their storage type), in the
// layouts the compose items read (compose_pass.hpp): query-wise [row][term][m], key-wise
// [key][term][m], static [m][n]. Rows and keys that are not real get zeros: the caller's padding is
// never read.
#include "../compose_weights.hpp"
#include "../params.hpp"
#include "compose_pass.hpp"
#include "simt.hpp"

namespace dcmha::cuda {

/// The positions a staging takes: `count` rows (or keys) of sequence b, group g, from `first`;
/// those at or past `real_end` are not real.
struct StagedPositions {
  index_t b, g, first;
  int count;
  index_t real_end;
};

/// Query-wise weights of the rows `rows`.
template <class Block, class T>
DCMHA_INLINE void stage_query_weights(const Block& blk, const SideWeights<T>& w,
                                      const ComposeTerms<T>& c, const StagedPositions& rows) {
  const int M = w.M, Rq = int(w.terms.query_rank), terms = w.query_terms();
  const index_t b = rows.b, g = rows.g;
  for_each_owned(blk, rows.count * terms * M, [&](int i) {
    const int row = i / (terms * M), term = i / M % terms, m = i % M;
    const index_t t = rows.first + row;
    T x(0.0f);
    if (t < rows.real_end)
      x = term < Rq       ? blk.load_global(&c.qw1(b, t, g, term, m))
          : term < 2 * Rq ? blk.load_global(&c.qw2(b, t, g, term - Rq, m))
                          : blk.load_global(&c.qdd(b, t, g, m));
    blk.store_shared(w.query_at(row, term, m), x);
  });
}

/// Keys of a head one staging step takes together from a decode cache's slots, as a shift:
/// runs of 4 (8 bytes of bf16 or fp16), so that a warp loads 8 heads' runs and stores, its keys
/// a half bank row apart in shared memory, at most two words a bank.
constexpr int kSlotRunShift = 2;

/// Item i of a key-wise staging as (key, term, head): runs of keys of one head (runs of one key
/// from the caller's (B, S, G, M) tensors, whose heads lie side by side as in shared memory; of
/// 1 << kSlotRunShift keys from a decode cache, whose slots lie side by side and heads a
/// capacity apart), then the heads, then the runs, then the terms; keys past `keys` are
/// skipped. One formula for both orders: a branch between two would hold both's registers.
struct KeyWeightOrder {
  int keys, terms, M, shift;

  DCMHA_INLINE int runs() const { return (keys + (1 << shift) - 1) >> shift; }
  DCMHA_INLINE int count() const { return (runs() << shift) * terms * M; }
  DCMHA_INLINE void item(int i, int& key, int& term, int& m) const {
    const int run = i >> shift, head_run = run / M;
    m = run % M;
    key = (i & ((1 << shift) - 1)) + (head_run % runs() << shift);
    term = head_run / runs();
  }
};

/// Key-wise weights of the keys `keys` (logical positions, stored at ring slots).
template <class Block, class T>
DCMHA_INLINE void stage_key_weights(const Block& blk, const SideWeights<T>& w,
                                    const ComposeTerms<T>& c, const StagedPositions& keys,
                                    const detail::KeyRing& ring) {
  const int Rk = int(w.terms.key_rank);
  const index_t b = keys.b, g = keys.g;
  const bool slots_adjacent = c.kdd.stride[1] == 1 && w.M > 1;
  const KeyWeightOrder order{keys.count, w.key_terms(), w.M, slots_adjacent ? kSlotRunShift : 0};
  for_each_owned(blk, order.count(), [&](int i) {
    int key = 0, term = 0, m = 0;
    order.item(i, key, term, m);
    if (key >= keys.count) return;
    const index_t s = keys.first + key;
    T x(0.0f);
    if (s < keys.real_end) {
      const index_t slot = ring.slot(b, s);
      x = term < Rk       ? blk.load_global(&c.kw1(b, slot, g, term, m))
          : term < 2 * Rk ? blk.load_global(&c.kw2(b, slot, g, term - Rk, m))
                          : blk.load_global(&c.kdd(b, slot, g, m));
    }
    blk.store_shared(w.key_at(term, m, key), x);
  });
}

template <class Block, class T>
DCMHA_INLINE void stage_static_weights(const Block& blk, const SideWeights<T>& w,
                                       const ComposeTerms<T>& c, index_t g) {
  if (!w.terms.static_w) return;
  const int M = w.M;
  for_each_owned(blk, M * M,
                 [&](int i) { blk.store_shared(w.w + i, blk.load_global(&c.w(g, i / M, i % M))); });
}

}  // namespace dcmha::cuda

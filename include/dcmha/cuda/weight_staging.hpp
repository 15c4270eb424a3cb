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

/// Query-wise weights of rows [t_first, t_first + rows) of sequence b, group g: rows at or past
/// `real_end` are not real.
template <class Block, class T>
DCMHA_INLINE void stage_query_weights(const Block& blk, const SideWeights<T>& w,
                                      const ComposeTerms<T>& c, index_t b, index_t g,
                                      index_t t_first, int rows, index_t real_end) {
  const int M = w.M, Rq = int(w.terms.query_rank), terms = w.query_terms();
  for_each_owned(blk, rows * terms * M, [&](int i) {
    const int row = i / (terms * M), term = i / M % terms, m = i % M;
    const index_t t = t_first + row;
    T x(0.0f);
    if (t < real_end)
      x = term < Rq       ? blk.load_global(&c.qw1(b, t, g, term, m))
          : term < 2 * Rq ? blk.load_global(&c.qw2(b, t, g, term - Rq, m))
                          : blk.load_global(&c.qdd(b, t, g, m));
    blk.store_shared(w.query_at(row, term, m), x);
  });
}

/// Key-wise weights of keys [s_first, s_first + keys) (logical; stored at ring slots), keys at or
/// past `real_end` not real.
template <class Block, class T>
DCMHA_INLINE void stage_key_weights(const Block& blk, const SideWeights<T>& w,
                                    const ComposeTerms<T>& c, index_t b, index_t g, index_t s_first,
                                    int keys, index_t real_end, const detail::KeyRing& ring) {
  const int M = w.M, Rk = int(w.terms.key_rank), terms = w.key_terms();
  // Lanes take consecutive heads of a key, as the weights lie in global memory (coalesced) and in
  // shared memory.
  for_each_owned(blk, keys * terms * M, [&](int i) {
    const int key = i / (terms * M), term = i / M % terms, m = i % M;
    const index_t s = s_first + key;
    T x(0.0f);
    if (s < real_end) {
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

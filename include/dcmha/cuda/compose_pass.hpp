#pragma once
// Compose (spec section 1, steps 2 and 5) on a tile of positions whose M heads' values sit in
// score tiles in shared memory: the tiles of a block's own heads, and in a cluster the peer
// blocks' tiles of the group's other heads (DSMEM). Each block composes a slice of the tile's
// rows for all M heads and writes every head's result back to that head's owner.
//
// A compose item is (up to kRows rows of the slice, one key, one part of the heads): the parts of
// an item are adjacent lanes, each summing the low-rank projections (sum_m x_m w1[r, m]) over its
// heads, then adding them up with shuffles, then producing the outputs of its heads. An item's
// rows share the key's weights, read once for all of them; a warp's lanes cover consecutive keys,
// so key-wise weights ([term][head][key]) are read without bank conflicts and query-wise ones
// ([row][term][head]) are broadcasts.
#include <cmath>

#include "../common/compose_terms.hpp"
#include "../common/mask.hpp"
#include "../common/softmax_state.hpp"
#include "../compose_weights.hpp"
#include "../params.hpp"
#include "simt.hpp"
#include "tile_layout.hpp"

namespace dcmha::cuda {

/// Largest low-rank R the CUDA kernels take (DCFormer's is 2).
constexpr int kMaxRank = 4;
/// Rows of one compose item.
constexpr int kComposeRows = 1;

/// One side's weights for the tile, in shared memory in the storage type W (zeros wherever a row or
/// key is not real: the caller's padding is never read).
template <class W>
struct SideWeights {
  detail::ComposeTermSet terms;
  W* query = nullptr;  // [slice row][term][m]: qw1 r < Rq, qw2 r < Rq, qdd
  W* key = nullptr;    // [term][m][key stride]: kw1, kw2, kdd
  W* w = nullptr;      // [m][n]
  int M = 0, key_stride = 0;

  DCMHA_INLINE int query_terms() const {
    return terms.query_wise ? 2 * int(terms.query_rank) + 1 : 0;
  }
  DCMHA_INLINE int key_terms() const { return terms.key_wise ? 2 * int(terms.key_rank) + 1 : 0; }
  DCMHA_INLINE W* query_at(int row, int term, int m) const {
    return query + (index_t(row) * query_terms() + term) * M + m;
  }
  DCMHA_INLINE W* key_at(int term, int m, int c) const {
    return key + (index_t(term) * M + m) * key_stride + c;
  }
};

/// Where one side's weights sit in shared memory (byte offsets; SharedCarver).
struct SideLayout {
  std::uint32_t query = 0, key = 0, w = 0;

  /// Room for the query-wise weights of `rows` rows and the key-wise ones of `keys` keys.
  template <class W>
  DCMHA_INLINE void carve(SharedCarver& c, const detail::ComposeTermSet& t, int M, int rows,
                          int keys) {
    const index_t query_terms = t.query_wise ? 2 * t.query_rank + 1 : 0;
    const index_t key_terms = t.key_wise ? 2 * t.key_rank + 1 : 0;
    query = c.take<W>(rows * query_terms * M);
    key = c.take<W>(key_terms * M * (keys + 1));
    w = c.take<W>(t.static_w ? index_t(M) * M : 0);
  }
  template <class W>
  DCMHA_INLINE SideWeights<W> view(void* base, const detail::ComposeTermSet& t, int M,
                                   int keys) const {
    SideWeights<W> s;
    s.terms = t;
    s.M = M;
    s.key_stride = keys + 1;  // odd: the parts of an item (heads M / parts apart) differ in bank
    s.query = at_offset<W>(base, query);
    s.key = at_offset<W>(base, key);
    s.w = at_offset<W>(base, w);
    return s;
  }
};

/// Where one compose item's positions and heads are.
struct ComposeItem {
  int row0 = 0;         // first row of the item in the tile
  int weight_row0 = 0;  // the same row in the query-wise weight arrays
  int rows = 0;         // rows of the item that are in the region (<= kComposeRows)
  int key = 0;          // column in the tile and in the key-wise weight arrays
  int head0 = 0, heads = 0;
  bool valid = false;
};

/// The positions a block composes: rows [row_begin, row_begin + rows) x keys [key_begin,
/// key_begin + keys) of the tile; the query-wise weights were staged from row weight_row_begin.
struct ComposeRegion {
  int row_begin = 0, rows = 0, key_begin = 0, keys = 0, weight_row_begin = 0;
};

/// The region as items of kComposeRows rows x one key x `parts` head parts, spread over the block
/// round by round: every thread takes part in every round (the parts' shuffles need all lanes of
/// a warp), holding an invalid item where none is left:
///   for (int round = 0; round < compose_rounds(...); ++round) { item = compose_item(...); ... }
template <class Block>
DCMHA_INLINE int compose_rounds(const Block& blk, const ComposeRegion& region, int parts) {
  const int items = (region.rows + kComposeRows - 1) / kComposeRows * region.keys * parts;
  return (items + blk.threads() - 1) / blk.threads();
}

template <class Block>
DCMHA_INLINE ComposeItem compose_item(const Block& blk, const ComposeRegion& region, int M,
                                      int parts, int round) {
  const int items = (region.rows + kComposeRows - 1) / kComposeRows * region.keys * parts;
  const int i = round * blk.threads() + blk.thread();
  ComposeItem item;
  item.valid = i < items;
  const int part = i % parts, key = i / parts % region.keys, group = i / (parts * region.keys);
  const int first = group * kComposeRows;
  item.row0 = region.row_begin + first;
  item.weight_row0 = item.row0 - region.weight_row_begin;
  item.rows = region.rows - first < kComposeRows ? region.rows - first : kComposeRows;
  item.key = region.key_begin + key;
  item.heads = M / parts;
  item.head0 = part * item.heads;
  return item;
}

/// Sums over the `parts` adjacent lanes of an item (every lane calls it).
template <class Block>
DCMHA_INLINE float sum_over_parts(const Block& blk, float x, int parts) {
  for (int o = 1; o < parts; o <<= 1) x += blk.shfl_xor(x, o);
  return x;
}

/// Compose runs forward (y = Compose(x): projections with w1, outputs with w2) or transposed
/// (dx = Compose^T(dy): projections of dy with w2, outputs with w1); the gates and the residual
/// are their own transpose.
enum class Direction { forward, transpose };

/// The low-rank projections of one item's rows: the sums over heads of x_m w[r, m], query-wise
/// and key-wise, with w the side's w1 (forward) or w2 (transpose).
struct Projections {
  float q[kComposeRows][kMaxRank], k[kComposeRows][kMaxRank];
  DCMHA_INLINE void zero() {
    DCMHA_UNROLL
    for (int i = 0; i < kComposeRows; ++i) DCMHA_UNROLL
    for (int r = 0; r < kMaxRank; ++r) q[i][r] = k[i][r] = 0.0f;
  }
  /// Adds x[i] (head m's value at the item's rows) times head m's weights.
  template <class Block, class W>
  DCMHA_INLINE void add(const Block& blk, const SideWeights<W>& w, const ComposeItem& it, int m,
                        const float (&x)[kComposeRows], Direction d = Direction::forward) {
    const int Rq = int(w.terms.query_rank), Rk = int(w.terms.key_rank);
    const int q0 = d == Direction::forward ? 0 : Rq, k0 = d == Direction::forward ? 0 : Rk;
    float kw[kMaxRank];
    DCMHA_UNROLL
    for (int r = 0; r < kMaxRank; ++r)
      kw[r] = r < Rk ? float(blk.load_shared(w.key_at(k0 + r, m, it.key))) : 0.0f;
    DCMHA_UNROLL
    for (int i = 0; i < kComposeRows; ++i) {
      if (i >= it.rows) continue;
      DCMHA_UNROLL
      for (int r = 0; r < kMaxRank; ++r) {
        if (r < Rq)
          q[i][r] += x[i] * float(blk.load_shared(w.query_at(it.weight_row0 + i, q0 + r, m)));
        if (r < Rk) k[i][r] += x[i] * kw[r];
      }
    }
    blk.count_fma(index_t(it.rows) * (Rq + Rk));
  }
  /// The sums over all heads: every part's own heads added up.
  template <class Block>
  DCMHA_INLINE void reduce(const Block& blk, int parts) {
    if (parts == 1) return;
    DCMHA_UNROLL
    for (int i = 0; i < kComposeRows; ++i) DCMHA_UNROLL
    for (int r = 0; r < kMaxRank; ++r) {
      q[i][r] = sum_over_parts(blk, q[i][r], parts);
      k[i][r] = sum_over_parts(blk, k[i][r], parts);
    }
  }
};

/// y[i] = Compose(x)_n (forward) or Compose^T(x)_n (transpose) at the item's rows without the
/// static term: the residual, the gates and the low-rank terms of head n, from x_n (x[i]) and the
/// projections.
template <class Block, class W>
DCMHA_INLINE void compose_head(const Block& blk, const SideWeights<W>& w, const ComposeItem& it,
                               const Projections& p, int n, const float (&x)[kComposeRows],
                               float (&y)[kComposeRows], Direction d = Direction::forward) {
  const int Rq = int(w.terms.query_rank), Rk = int(w.terms.key_rank);
  const int q0 = d == Direction::forward ? Rq : 0, k0 = d == Direction::forward ? Rk : 0;
  float kdd = 0, kw[kMaxRank];
  if (w.terms.key_wise) kdd = float(blk.load_shared(w.key_at(2 * Rk, n, it.key)));
  DCMHA_UNROLL
  for (int r = 0; r < kMaxRank; ++r)
    kw[r] = r < Rk ? float(blk.load_shared(w.key_at(k0 + r, n, it.key))) : 0.0f;
  DCMHA_UNROLL
  for (int i = 0; i < kComposeRows; ++i) {
    if (i >= it.rows) {
      y[i] = 0;
      continue;
    }
    float out = x[i] * (1.0f + kdd);
    if (w.terms.query_wise) {
      const int row = it.weight_row0 + i;
      out += x[i] * float(blk.load_shared(w.query_at(row, 2 * Rq, n)));
      DCMHA_UNROLL
      for (int r = 0; r < kMaxRank; ++r)
        if (r < Rq) out += p.q[i][r] * float(blk.load_shared(w.query_at(row, q0 + r, n)));
    }
    DCMHA_UNROLL
    for (int r = 0; r < kMaxRank; ++r)
      if (r < Rk) out += p.k[i][r] * kw[r];
    y[i] = out;
  }
  blk.count_fma(index_t(it.rows) * (2 + Rq + Rk));
}

/// The M heads' score tiles of a group as one block of a cluster sees them: head m is local head
/// m % own_heads of cluster block m / own_heads.
struct GroupTiles {
  ScoreTiles local;
  int own_heads = 1;
  template <class Block>
  DCMHA_INLINE ScoreTile head(const Block& blk, int m) const {
    const ScoreTile t = local.head(m % own_heads);
    return {blk.peer_shared(t.data, m / own_heads), t.stride};
  }
};

/// Reads head m's values at the item's rows (0 past its real rows).
template <class Block>
DCMHA_INLINE void load_item(const Block& blk, const ScoreTile& t, const ComposeItem& it,
                            float (&x)[kComposeRows]) {
  DCMHA_UNROLL
  for (int i = 0; i < kComposeRows; ++i)
    x[i] = i < it.rows ? blk.load_shared(t.at(it.row0 + i, it.key)) : 0.0f;
}

/// Adds the static term to y for head n: sum_m x_m W[m][n] (forward) or sum_m W[n][m] x_m
/// (transpose), reading every head's input at the item's rows.
template <class Block, class W>
DCMHA_INLINE void add_static_term(const Block& blk, const SideWeights<W>& w,
                                  const GroupTiles& input, const ComposeItem& it, int n,
                                  float (&y)[kComposeRows], Direction d = Direction::forward) {
  for (int m = 0; m < w.M; ++m) {
    float x[kComposeRows];
    load_item(blk, input.head(blk, m), it, x);
    const index_t at = d == Direction::forward ? index_t(m) * w.M + n : index_t(n) * w.M + m;
    const float wmn = float(blk.load_shared(w.w + at));
    DCMHA_UNROLL
    for (int i = 0; i < kComposeRows; ++i) y[i] += x[i] * wmn;
  }
  blk.count_fma(index_t(it.rows) * w.M);
}

}  // namespace dcmha::cuda

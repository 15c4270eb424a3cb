#pragma once
// Compose (spec section 1, steps 2 and 5) on a tile of positions whose M heads' values sit in
// score tiles in shared memory: the tiles of a block's own heads, and in a cluster the peer
// blocks' tiles of the group's other heads (DSMEM). Each block composes a slice of the tile's
// positions (rows, keys or both) for all M heads and writes every head's result back to that
// head's owner.
//
// A compose item is (up to kRows rows of the slice, one key, one part of the heads): the
// parts of an item are adjacent lanes, each summing the low-rank projections (sum_m x_m w1[r, m])
// over its heads, then adding them up with shuffles, then producing the outputs of its heads. A
// lane keeps its heads' values in registers from step to step (ItemValues) and loads one term's
// weights of all its heads at once (HeadWeights): the weights are staged with the heads in the
// lanes' order, fastest ([row][term][slot], [key][term][slot]).
#include <cmath>
#include <cstdint>
#include <type_traits>

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
/// Heads of one compose item whose values a lane keeps in registers from one loop over the heads
/// to the next: each value is read once from its tile (in a cluster, mostly a peer's), not once
/// per loop. The launch plan gives an item enough parts that a lane holds at most this many.
constexpr int kCachedHeads = 8;

/// One side's weights for the tile, in shared memory in the storage type W (zeros wherever a row or
/// key is not real: the caller's padding is never read). Heads are the fastest index, in the
/// compose items' order (head m at slot (m % parts) (M / parts) + m / parts), so that a lane
/// loads its heads' weights of one term together.
template <class W>
struct SideWeights {
  detail::ComposeTermSet terms;
  W* query = nullptr;  // [slice row][term][slot]: qw1 r < Rq, qw2 r < Rq, qdd
  W* key = nullptr;    // [key][term][slot]: kw1, kw2, kdd
  W* w = nullptr;      // [m][n]
  int M = 0, parts = 1;

  DCMHA_INLINE int slot(int m) const { return m % parts * (M / parts) + m / parts; }

  DCMHA_INLINE int query_terms() const {
    return terms.query_wise ? 2 * int(terms.query_rank) + 1 : 0;
  }
  DCMHA_INLINE int key_terms() const { return terms.key_wise ? 2 * int(terms.key_rank) + 1 : 0; }
  DCMHA_INLINE W* query_at(int row, int term, int m) const {
    return query + (index_t(row) * query_terms() + term) * M + slot(m);
  }
  DCMHA_INLINE W* key_at(int term, int m, int c) const {
    return key + (index_t(c) * key_terms() + term) * M + slot(m);
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
    key = c.take<W>(key_terms * M * keys);
    w = c.take<W>(t.static_w ? index_t(M) * M : 0);
  }
  template <class W>
  DCMHA_INLINE SideWeights<W> view(void* base, const detail::ComposeTermSet& t, int M,
                                   int parts) const {
    SideWeights<W> s;
    s.terms = t;
    s.M = M;
    s.parts = parts;
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
  int rows = 0;         // rows of the item that are in the region (<= the item's kRows)
  int key = 0;          // column in the tile
  int weight_key = 0;   // the same key in the key-wise weight arrays
  // The lane's heads: part + parts j for j < heads. Interleaved, so that at each j the parts
  // read the same cluster block's tiles (its own heads are consecutive) side by side.
  int part = 0, parts = 1, heads = 0;
  int round = 0;  // of the block's rounds of items
  int index = 0;  // in the block's items, round by round: below compose_items(...)
  bool valid = false;
  // The lane has the item's rows in every round (one round, or ComposeRegion::rows_held), so
  // that what it holds of its rows stays valid from round to round and tile to tile.
  bool rows_held = false;

  DCMHA_INLINE int head(int j) const { return part + parts * j; }
};

/// The positions a block composes: rows [row_begin, row_begin + rows) x keys [key_begin,
/// key_begin + keys) of the tile; the query-wise weights were staged from row weight_row_begin,
/// the key-wise ones from key weight_key_begin.
struct ComposeRegion {
  int row_begin = 0, rows = 0, key_begin = 0, keys = 0, weight_row_begin = 0, weight_key_begin = 0;
  // One-row items taken in several rounds go to the lanes row by row where the keys split
  // evenly among the rounds: each lane keeps its row and takes a share of its keys a round.
  bool rows_held = false;
};

/// The region as items of kRows rows x one key x `parts` head parts, spread over the block
/// round by round: every thread takes part in every round (the parts' shuffles need all lanes of
/// a warp), holding an invalid item where none is left:
///   for (round = 0; round < compose_rounds<kRows>(...); ++round) { it = compose_item<kRows>(...) }
/// Items are dealt in order (parts, then keys, then rows), or with rows held (rows_held_place).
DCMHA_INLINE int compose_items(const ComposeRegion& region, int parts, int rows_per_item) {
  return (region.rows + rows_per_item - 1) / rows_per_item * region.keys * parts;
}
template <int kRows, class Block>
DCMHA_INLINE int compose_rounds(const Block& blk, const ComposeRegion& region, int parts) {
  return (compose_items(region, parts, kRows) + blk.threads() - 1) / blk.threads();
}

/// The lane's place in a round of rows-held items: its part, its row (kept from round to round),
/// and a share of the keys, keys / rounds of them, which round r takes from share (r + row) %
/// rounds, so that a warp's rows, each with a different share, read the score tiles' rows (40
/// floats apart) in different banks.
struct ItemPlace {
  int part = 0, key = 0, group = 0, index = 0;
  bool valid = false;
};
template <class Block>
DCMHA_INLINE ItemPlace rows_held_place(const Block& blk, const ComposeRegion& region, int parts,
                                       int rounds, int round) {
  const int share = region.keys / rounds, per_round = region.rows * share * parts;
  const int t = blk.thread(), lane_key = t / parts % share;
  ItemPlace p;
  p.part = t % parts;
  p.group = t / (parts * share);
  p.key = lane_key + share * ((round + p.group) % rounds);
  p.index = round * per_round + t;
  p.valid = t < per_round;
  return p;
}
template <class Block>
DCMHA_INLINE ItemPlace dealt_place(const Block& blk, const ComposeRegion& region, int parts,
                                   int items, int round) {
  ItemPlace p;
  p.index = round * blk.threads() + blk.thread();
  p.part = p.index % parts;
  p.key = p.index / parts % region.keys;
  p.group = p.index / (parts * region.keys);
  p.valid = p.index < items;
  return p;
}

template <int kRows, class Block>
DCMHA_INLINE ComposeItem compose_item(const Block& blk, const ComposeRegion& region, int M,
                                      int parts, int round) {
  const int items = compose_items(region, parts, kRows);
  const int rounds = compose_rounds<kRows>(blk, region, parts);
  const bool rows_held = kRows == 1 && region.rows_held && rounds > 1 && region.keys % rounds == 0;
  const ItemPlace place = rows_held ? rows_held_place(blk, region, parts, rounds, round)
                                    : dealt_place(blk, region, parts, items, round);
  const int part = place.part, key = place.key, group = place.group;
  ComposeItem item;
  item.valid = place.valid;
  item.index = place.index;
  item.rows_held = rows_held || rounds == 1;
  const int first = group * kRows;
  item.row0 = region.row_begin + first;
  item.weight_row0 = item.row0 - region.weight_row_begin;
  item.rows = region.rows - first < kRows ? region.rows - first : kRows;
  item.key = region.key_begin + key;
  item.weight_key = item.key - region.weight_key_begin;
  item.heads = M / parts;
  item.part = part;
  item.parts = parts;
  item.round = round;
  return item;
}

/// Calls f(j) for the lane's heads it.head(j), j < it.heads <= kCachedHeads, unrolled: an
/// ItemValues indexed by j stays in registers.
template <class F>
DCMHA_INLINE void for_item_heads(const ComposeItem& it, F&& f) {
  DCMHA_UNROLL
  for (int j = 0; j < kCachedHeads; ++j)
    if (j < it.heads) f(j);
}

/// Sums over the `parts` adjacent lanes of an item (every lane calls it), from lane distance o.
template <class Block>
DCMHA_INLINE float sum_over_parts(const Block& blk, float x, int parts, int o = 1) {
  for (; o < parts; o <<= 1) x += blk.shfl_xor(x, o);
  return x;
}

/// Sums each of v[0, N) over the `parts` adjacent lanes (N a power of two; every lane calls it
/// and gets every sum): the lanes halve the values between them at each distance o (the lane
/// with bit o set keeps the upper half) and add their partner's share of the half they keep,
/// then pass the complete sums back in reverse order. 2N(1 - 1/parts) shuffles where summing
/// each value alone takes N log2(parts) (4 parts: 3/4 of them), and the same bits: each sum is
/// added up in the same pairs ((p0 + p1) + (p2 + p3)), by one lane.
template <int N, class Block>
DCMHA_INLINE void sum_values_over_parts(const Block& blk, float (&v)[N], int parts, int o = 1) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "a power of two of values");
  if (o >= parts) return;
  if constexpr (N == 1) {
    v[0] = sum_over_parts(blk, v[0], parts, o);
  } else {
    constexpr int kHalf = N / 2;
    const bool upper = (lane_of(blk) & o) != 0;
    float kept[kHalf];
    DCMHA_UNROLL
    for (int i = 0; i < kHalf; ++i) {
      const float given = upper ? v[i] : v[kHalf + i];
      kept[i] = (upper ? v[kHalf + i] : v[i]) + blk.shfl_xor(given, o);
    }
    sum_values_over_parts(blk, kept, parts, o << 1);
    DCMHA_UNROLL
    for (int i = 0; i < kHalf; ++i) {
      const float other = blk.shfl_xor(kept[i], o);
      v[i] = upper ? other : kept[i];
      v[kHalf + i] = upper ? kept[i] : other;
    }
  }
}

/// Sums each of v[0, N) over the `parts` adjacent lanes and leaves each sum with one of them:
/// value i with part i % parts, which gets take(k, sum) for i = k parts + part (k past N / parts
/// give zeros where N is not a multiple of parts). At each distance o the lanes split the
/// values by parity (the lane with bit o set keeps the odd ones) and add their partner's share
/// of what they keep: N - N / parts shuffles, about, where summing each value alone takes
/// N log2(parts); the same pairs as there, each sum added up by one lane. The lane bits are read
/// unhoisted, for callers inside a tile loop short of registers.
template <int N, class Block, class F>
DCMHA_INLINE void scatter_sums_over_parts(const Block& blk, const float (&v)[N], int parts,
                                          F&& take, int o = 1) {
  if (o >= parts) {
    DCMHA_UNROLL
    for (int k = 0; k < N; ++k) take(k, v[k]);
    return;
  }
  if constexpr (N == 1) {
    float x = v[0];  // element 0 stays with the lanes whose bits are clear; the others hold 0
    for (; o < parts; o <<= 1) {
      const bool odd = (unhoisted_lane_of(blk) & o) != 0;
      x = (odd ? 0.0f : x) + blk.shfl_xor(odd ? x : 0.0f, o);
    }
    take(0, x);
  } else {
    constexpr int kKept = (N + 1) / 2;
    const bool odd = (unhoisted_lane_of(blk) & o) != 0;
    float kept[kKept];
    DCMHA_UNROLL
    for (int k = 0; k < kKept; ++k) {
      const float even_value = v[2 * k], odd_value = 2 * k + 1 < N ? v[2 * k + 1] : 0.0f;
      kept[k] = (odd ? odd_value : even_value) + blk.shfl_xor(odd ? even_value : odd_value, o);
    }
    scatter_sums_over_parts(blk, kept, parts, take, o << 1);
  }
}

/// Compose runs forward (y = Compose(x): projections with w1, outputs with w2) or transposed
/// (dx = Compose^T(dy): projections of dy with w2, outputs with w1); the gates and the residual
/// are their own transpose.
enum class Direction { forward, transpose };

/// One value per head and row of an item, kept in registers between loops over its heads. An
/// item of kRows rows reads each key-wise weight once for all of them; each row costs registers.
template <int kRows>
struct ItemValues {
  float v[kCachedHeads][kRows];
};

/// One term's weights of a lane's heads (consecutive in shared memory), as loaded: packed in
/// 32-bit words, widened where used. Eight 2-byte or four 4-byte weights a 16-byte load where the
/// lane has kCachedHeads heads and they are aligned (DCFormer's M = 32: always); one by one
/// otherwise.
template <class W>
struct HeadWeights {
  using Bits = std::conditional_t<sizeof(W) == 4, std::uint32_t, std::uint16_t>;
  static constexpr int kPerWord = 4 / int(sizeof(W)), kWords = kCachedHeads / kPerWord;
  struct alignas(16) Chunk {
    std::uint32_t word[4];
  };
  std::uint32_t word[kWords] = {};

  template <class Block>
  DCMHA_INLINE void load(const Block& blk, const W* first, int heads) {
    if (heads == kCachedHeads && reinterpret_cast<std::uintptr_t>(first) % sizeof(Chunk) == 0) {
      DCMHA_UNROLL
      for (int c = 0; c < kWords / 4; ++c) {
        const Chunk x = blk.load_shared(reinterpret_cast<const Chunk*>(first) + c);
        DCMHA_UNROLL
        for (int e = 0; e < 4; ++e) word[4 * c + e] = x.word[e];
      }
      return;
    }
    DCMHA_UNROLL
    for (int j = 0; j < kCachedHeads; ++j)
      if (j < heads)
        word[j / kPerWord] |=
            std::uint32_t(Eigen::numext::bit_cast<Bits>(blk.load_shared(first + j)))
            << (32 / kPerWord * (j % kPerWord));
  }
  DCMHA_INLINE float operator[](int j) const {
    const auto bits = Bits(word[j / kPerWord] >> (32 / kPerWord * (j % kPerWord)));
    return float(Eigen::numext::bit_cast<W>(bits));
  }
};

/// sum_j x.v[j][i] w[j] over the item's heads, in order.
template <int kRows, class W>
DCMHA_INLINE float dot_heads(const ComposeItem& it, const ItemValues<kRows>& x, int i,
                             const HeadWeights<W>& w) {
  float sum = 0;
  DCMHA_UNROLL
  for (int j = 0; j < kCachedHeads; ++j)
    if (j < it.heads) sum += x.v[j][i] * w[j];
  return sum;
}
/// y.v[j][i] += a w[j] for the item's heads.
template <int kRows, class W>
DCMHA_INLINE void add_scaled_heads(const ComposeItem& it, float a, const HeadWeights<W>& w, int i,
                                   ItemValues<kRows>& y) {
  DCMHA_UNROLL
  for (int j = 0; j < kCachedHeads; ++j)
    if (j < it.heads) y.v[j][i] += a * w[j];
}

/// Calls f(r, weights) for each key-wise rank r of the side, with the item's key's weights of
/// term first + r, each read once for all of the item's rows.
template <class Block, class W, class F>
DCMHA_INLINE void for_each_key_rank(const Block& blk, const SideWeights<W>& w,
                                    const ComposeItem& it, int first, F&& f) {
  DCMHA_UNROLL
  for (int r = 0; r < kMaxRank; ++r) {
    if (r >= int(w.terms.key_rank)) continue;
    HeadWeights<W> kw;
    kw.load(blk, w.key_at(first + r, it.part, it.weight_key), it.heads);
    f(r, kw);
  }
}

/// The query-wise weights of an item's row i, read from shared memory where used: the
/// projections' (w1 forward, w2 transposed), the outputs' (the other) and the gate.
struct QueryWeights {
  template <class Block, class W>
  DCMHA_INLINE void hold(const Block&, const SideWeights<W>&, const ComposeItem&) {}
  template <class W>
  DCMHA_INLINE static int projection_term(const SideWeights<W>& w, int r, Direction d) {
    return d == Direction::forward ? r : int(w.terms.query_rank) + r;
  }
  template <class W>
  DCMHA_INLINE static int output_term(const SideWeights<W>& w, int r, Direction d) {
    return d == Direction::forward ? int(w.terms.query_rank) + r : r;
  }
  template <class Block, class W>
  DCMHA_INLINE static HeadWeights<W> term(const Block& blk, const SideWeights<W>& w,
                                          const ComposeItem& it, int i, int term) {
    HeadWeights<W> h;
    h.load(blk, w.query_at(it.weight_row0 + i, term, it.part), it.heads);
    return h;
  }
  template <class Block, class W>
  DCMHA_INLINE HeadWeights<W> projection(const Block& blk, const SideWeights<W>& w,
                                         const ComposeItem& it, int i, int r, Direction d) const {
    return term(blk, w, it, i, projection_term(w, r, d));
  }
  template <class Block, class W>
  DCMHA_INLINE HeadWeights<W> output(const Block& blk, const SideWeights<W>& w,
                                     const ComposeItem& it, int i, int r, Direction d) const {
    return term(blk, w, it, i, output_term(w, r, d));
  }
  template <class Block, class W>
  DCMHA_INLINE HeadWeights<W> gate(const Block& blk, const SideWeights<W>& w, const ComposeItem& it,
                                   int i) const {
    return term(blk, w, it, i, 2 * int(w.terms.query_rank));
  }
};

/// The same weights held in registers by a lane whose rows stay the same from one key tile to
/// the next (ComposeItem::rows_held), where the registers allow: loaded once, not at every use.
/// Ranks up to kHeldRanks (DCFormer's 2) are held; higher ones are read where used.
template <int kRows, class W>
struct HeldQueryWeights {
  static constexpr int kHeldRanks = 2;
  HeadWeights<W> w1[kRows][kHeldRanks], w2[kRows][kHeldRanks], gates[kRows];
  bool held = false;

  /// Loads the item's weights at the first compose (they must be staged and synced), or at
  /// every round where the lane's rows change from round to round.
  template <class Block>
  DCMHA_INLINE void hold(const Block& blk, const SideWeights<W>& w, const ComposeItem& it) {
    if (held && it.rows_held) return;
    held = true;
    if (!it.valid || !w.terms.query_wise) return;
    const QueryWeights from_shared{};
    DCMHA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      if (i >= it.rows) continue;
      gates[i] = from_shared.gate(blk, w, it, i);
      DCMHA_UNROLL
      for (int r = 0; r < kHeldRanks; ++r) {
        if (r >= int(w.terms.query_rank)) continue;
        w1[i][r] = from_shared.projection(blk, w, it, i, r, Direction::forward);
        w2[i][r] = from_shared.output(blk, w, it, i, r, Direction::forward);
      }
    }
  }
  template <class Block>
  DCMHA_INLINE HeadWeights<W> projection(const Block& blk, const SideWeights<W>& w,
                                         const ComposeItem& it, int i, int r, Direction d) const {
    if (r >= kHeldRanks) return QueryWeights{}.projection(blk, w, it, i, r, d);
    return d == Direction::forward ? w1[i][r] : w2[i][r];
  }
  template <class Block>
  DCMHA_INLINE HeadWeights<W> output(const Block& blk, const SideWeights<W>& w,
                                     const ComposeItem& it, int i, int r, Direction d) const {
    if (r >= kHeldRanks) return QueryWeights{}.output(blk, w, it, i, r, d);
    return d == Direction::forward ? w2[i][r] : w1[i][r];
  }
  template <class Block>
  DCMHA_INLINE HeadWeights<W> gate(const Block&, const SideWeights<W>&, const ComposeItem&,
                                   int i) const {
    return gates[i];
  }
};

/// The low-rank projections of one item's rows: the sums over heads of x_m w[r, m], query-wise
/// and key-wise, with w the side's w1 (forward) or w2 (transpose).
template <int kRows>
struct Projections {
  float q[kRows][kMaxRank], k[kRows][kMaxRank];
  DCMHA_INLINE void zero() {
    DCMHA_UNROLL
    for (int i = 0; i < kRows; ++i) DCMHA_UNROLL
    for (int r = 0; r < kMaxRank; ++r) q[i][r] = k[i][r] = 0.0f;
  }
  /// Adds the lane's heads' values (head it.head(j) in x.v[j]) times their weights, in head order;
  /// the query-wise weights from `query` (QueryWeights or HeldQueryWeights).
  template <class Block, class W, class Query = QueryWeights>
  DCMHA_INLINE void add(const Block& blk, const SideWeights<W>& w, const ComposeItem& it,
                        const ItemValues<kRows>& x, Direction d = Direction::forward,
                        const Query& query = {}) {
    const int Rq = int(w.terms.query_rank), Rk = int(w.terms.key_rank);
    for_each_key_rank(blk, w, it, d == Direction::forward ? 0 : Rk,
                      [&](int r, const HeadWeights<W>& kw) {
                        DCMHA_UNROLL
                        for (int i = 0; i < kRows; ++i)
                          if (i < it.rows) k[i][r] += dot_heads(it, x, i, kw);
                      });
    DCMHA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      if (i >= it.rows) continue;
      DCMHA_UNROLL
      for (int r = 0; r < kMaxRank; ++r) {
        if (r >= Rq) continue;
        q[i][r] += dot_heads(it, x, i, query.projection(blk, w, it, i, r, d));
      }
    }
    blk.count_fma(index_t(it.rows) * it.heads * (Rq + Rk));
  }
  /// The sums over all heads: every part's own heads added up, for the ranks the side has.
  /// Where both sides have kPackedRanks ranks or more (DCFormer's), those are summed together
  /// (sum_values_over_parts: 4 kRows values, a power of two), the rest one by one.
  static constexpr int kPackedRanks = 2;
  template <class Block>
  DCMHA_INLINE void reduce(const Block& blk, const detail::ComposeTermSet& t, int parts) {
    if (parts == 1) return;
    const bool packed = t.query_rank >= kPackedRanks && t.key_rank >= kPackedRanks;
    if (packed) {
      constexpr int kSide = kPackedRanks, kRow = 2 * kPackedRanks;  // v: [row][side][rank]
      float v[kRows * kRow];
      DCMHA_UNROLL
      for (int i = 0; i < kRows; ++i) DCMHA_UNROLL
      for (int r = 0; r < kPackedRanks; ++r)
        v[i * kRow + r] = q[i][r], v[i * kRow + kSide + r] = k[i][r];
      sum_values_over_parts(blk, v, parts);
      DCMHA_UNROLL
      for (int i = 0; i < kRows; ++i) DCMHA_UNROLL
      for (int r = 0; r < kPackedRanks; ++r)
        q[i][r] = v[i * kRow + r], k[i][r] = v[i * kRow + kSide + r];
    }
    DCMHA_UNROLL
    for (int i = 0; i < kRows; ++i) DCMHA_UNROLL
    for (int r = 0; r < kMaxRank; ++r) {
      if (packed && r < kPackedRanks) continue;
      if (r < t.query_rank) q[i][r] = sum_over_parts(blk, q[i][r], parts);
      if (r < t.key_rank) k[i][r] = sum_over_parts(blk, k[i][r], parts);
    }
  }
};

/// compose_heads's parts on one item: the side's weights, the direction, and where the
/// query-wise weights come from (QueryWeights or HeldQueryWeights).
template <class Block, class W, class Query>
struct ItemCompose {
  const Block& blk;
  const SideWeights<W>& w;
  const ComposeItem& it;
  Direction d;
  const Query& query;

  /// Row i without the key-wise low-rank terms: the residual, the gates, the query-wise terms.
  template <int kRows>
  DCMHA_INLINE void row(int i, const HeadWeights<W>& key_gate, const Projections<kRows>& p,
                        const ItemValues<kRows>& x, ItemValues<kRows>& y) const {
    HeadWeights<W> query_gate;
    if (i < it.rows && w.terms.query_wise) query_gate = query.gate(blk, w, it, i);
    set_residual_and_gates(i, key_gate, query_gate, x, y);
    if (i >= it.rows || !w.terms.query_wise) return;
    DCMHA_UNROLL
    for (int r = 0; r < kMaxRank; ++r) {
      if (r >= int(w.terms.query_rank)) continue;
      add_scaled_heads(it, p.q[i][r], query.output(blk, w, it, i, r, d), i, y);
    }
  }

  /// Row i of the item's heads without the low-rank terms: y = x (1 + key gate + query gate), x
  /// read as 0 past the item's rows. y may be x.
  template <int kRows>
  DCMHA_INLINE void set_residual_and_gates(int i, const HeadWeights<W>& key_gate,
                                           const HeadWeights<W>& query_gate,
                                           const ItemValues<kRows>& x, ItemValues<kRows>& y) const {
    const detail::ComposeTermSet& t = w.terms;
    DCMHA_UNROLL
    for (int j = 0; j < kCachedHeads; ++j) {
      if (j >= it.heads) continue;
      const float xj = i < it.rows ? x.v[j][i] : 0.0f;
      float out = xj * (1.0f + (t.key_wise ? key_gate[j] : 0.0f));
      if (t.query_wise) out += xj * query_gate[j];
      y.v[j][i] = out;
    }
  }

  /// Adds every row's key-wise low-rank terms, each weight read once for all rows.
  template <int kRows>
  DCMHA_INLINE void add_key_terms(const Projections<kRows>& p, ItemValues<kRows>& y) const {
    const int first = d == Direction::forward ? int(w.terms.key_rank) : 0;
    for_each_key_rank(blk, w, it, first, [&](int r, const HeadWeights<W>& kw) {
      DCMHA_UNROLL
      for (int i = 0; i < kRows; ++i) add_scaled_heads(it, p.k[i][r], kw, i, y);
    });
  }
};

/// y = Compose(x) (forward) or Compose^T(x) (transpose) of the lane's heads at the item's rows
/// without the static term: the residual, the gates and the low-rank terms, from x and the
/// projections. y may be x (head j's output depends on its own input only).
template <int kRows, class Block, class W, class Query = QueryWeights>
DCMHA_INLINE void compose_heads(const Block& blk, const SideWeights<W>& w, const ComposeItem& it,
                                const Projections<kRows>& p, const ItemValues<kRows>& x,
                                ItemValues<kRows>& y, Direction d = Direction::forward,
                                const Query& query = {}) {
  const ItemCompose<Block, W, Query> item{blk, w, it, d, query};
  const int Rq = int(w.terms.query_rank), Rk = int(w.terms.key_rank);
  HeadWeights<W> key_gate;
  if (w.terms.key_wise) key_gate.load(blk, w.key_at(2 * Rk, it.part, it.weight_key), it.heads);
  DCMHA_UNROLL
  for (int i = 0; i < kRows; ++i) item.row(i, key_gate, p, x, y);
  item.add_key_terms(p, y);
  blk.count_fma(index_t(it.rows) * it.heads * (2 + Rq + Rk));
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
template <int kRows, class Block>
DCMHA_INLINE void load_item(const Block& blk, const ScoreTile& t, const ComposeItem& it,
                            float (&x)[kRows]) {
  DCMHA_UNROLL
  for (int i = 0; i < kRows; ++i)
    x[i] = i < it.rows ? blk.load_shared(t.at(it.row0 + i, it.key)) : 0.0f;
}

/// Adds the static term to y for head n: sum_m x_m W[m][n] (forward) or sum_m W[n][m] x_m
/// (transpose), reading every head's input at the item's rows.
template <int kRows, class Block, class W>
DCMHA_INLINE void add_static_term(const Block& blk, const SideWeights<W>& w,
                                  const GroupTiles& input, const ComposeItem& it, int n,
                                  float (&y)[kRows], Direction d = Direction::forward) {
  for (int m = 0; m < w.M; ++m) {
    float x[kRows];
    load_item(blk, input.head(blk, m), it, x);
    const index_t at = d == Direction::forward ? index_t(m) * w.M + n : index_t(n) * w.M + m;
    const float wmn = float(blk.load_shared(w.w + at));
    DCMHA_UNROLL
    for (int i = 0; i < kRows; ++i) y[i] += x[i] * wmn;
  }
  blk.count_fma(index_t(it.rows) * w.M);
}

}  // namespace dcmha::cuda

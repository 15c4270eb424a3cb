#pragma once
// A warp's 16 rows x kKeys keys of one head as accumulator fragments: storing them into and
// loading them from score tiles, the mask, and the row softmax on them (FlashAttention's online
// softmax: each row's maximum and sum reduced over the quad of 4 lanes that holds the row).
#include "../common/mask.hpp"
#include "../common/softmax_state.hpp"
#include "simt.hpp"
#include "tile_layout.hpp"
#include "warp_product.hpp"

namespace dcmha::cuda {

/// Two floats stored and loaded together (a fragment's pair of columns).
using FloatPair = ColumnPair<float>;

/// tile(row0 + r, col0 + c) = scale * acc(r, c) for the warp's 16 x 8 kTiles block.
template <int kTiles, class Block>
DCMHA_INLINE void store_fragments(const Block& blk, const Accumulators<kTiles>& acc,
                                  const ScoreTile& tile, int row0, int col0, float scale) {
  const FragmentPlace f(blk);
  DCMHA_UNROLL
  for (int j = 0; j < kTiles; ++j) DCMHA_UNROLL
  for (int half = 0; half < 2; ++half)
    blk.store_shared(
        reinterpret_cast<FloatPair*>(tile.at(row0 + f.row(2 * half), col0 + 8 * j + 2 * f.t)),
        FloatPair{scale * acc.c[j][2 * half], scale * acc.c[j][2 * half + 1]});
}

/// tile(col0 + c, row0 + r) = scale * acc(r, c): a block whose rows are the tile's keys (the key
/// side's K Q^T), stored the other way round.
template <int kTiles, class Block>
DCMHA_INLINE void store_fragments_transposed(const Block& blk, const Accumulators<kTiles>& acc,
                                             const ScoreTile& tile, int key0, int row0,
                                             float scale) {
  const FragmentPlace f(blk);
  DCMHA_UNROLL
  for (int j = 0; j < kTiles; ++j) DCMHA_UNROLL
  for (int i = 0; i < 4; ++i)
    blk.store_shared(tile.at(row0 + 8 * j + f.column(i), key0 + f.row(i)), scale * acc.c[j][i]);
}

/// tile(row0 + r, col0 + c) = acc(r, c) rounded to T: a block the tensor cores take next as an
/// operand (MHA's one-pass backward: P and dS). A lane's two columns share a chunk, one 32-bit
/// store; the 8 rows of a phase fall in different banks by the tile's swizzle.
template <int kTiles, class Block, class T>
DCMHA_INLINE void store_operand_fragments(const Block& blk, const Accumulators<kTiles>& acc,
                                          const OperandTile<T>& tile, int row0, int col0) {
  const FragmentPlace f(blk);
  DCMHA_UNROLL
  for (int j = 0; j < kTiles; ++j) DCMHA_UNROLL
  for (int half = 0; half < 2; ++half)
    blk.store_shared(
        reinterpret_cast<std::uint32_t*>(tile.at(row0 + f.row(2 * half), col0 + 8 * j + 2 * f.t)),
        pack_pair<T>(acc.c[j][2 * half], acc.c[j][2 * half + 1]));
}

/// acc(r, c) = tile(row0 + r, col0 + c).
template <int kTiles, class Block>
DCMHA_INLINE void load_fragments(const Block& blk, const ScoreTile& tile, int row0, int col0,
                                 Accumulators<kTiles>& acc) {
  const FragmentPlace f(blk);
  DCMHA_UNROLL
  for (int j = 0; j < kTiles; ++j) DCMHA_UNROLL
  for (int half = 0; half < 2; ++half) {
    const FloatPair p = blk.load_shared(reinterpret_cast<const FloatPair*>(
        tile.at(row0 + f.row(2 * half), col0 + 8 * j + 2 * f.t)));
    acc.c[j][2 * half] = p.x;
    acc.c[j][2 * half + 1] = p.y;
  }
}

/// The keys the lane's two rows (g and g + 8 of the warp's block) see, as logical key indices
/// [begin, end); empty for rows that are not real. 32-bit (the plan keeps S below 2^31): a tall
/// warp holds four rows' ranges through its loop.
struct FragmentRows {
  int begin[2] = {0, 0}, end[2] = {0, 0};
  FragmentRows() = default;
  template <class Block>
  DCMHA_INLINE FragmentRows(const Block& blk, const detail::RowMask& mask, index_t b, index_t t0,
                            int rows_real) {
    const FragmentPlace f(blk);
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = f.row(2 * h);
      const detail::KeyRange range = r < rows_real ? mask.row(b, t0 + r) : detail::KeyRange{0, 0};
      begin[h] = int(range.begin), end[h] = int(range.end);
    }
  }
  DCMHA_INLINE bool sees(int h, int key) const { return key >= begin[h] && key < end[h]; }
};

/// Sets every element of acc whose key (s0 + its column) its row does not see to `value`.
template <int kTiles, class Block>
DCMHA_INLINE void mask_fragments(const Block& blk, const FragmentRows& rows, index_t s0,
                                 Accumulators<kTiles>& acc, float value) {
  const FragmentPlace f(blk);
  const int key0 = int(s0);
  DCMHA_UNROLL
  for (int j = 0; j < kTiles; ++j) DCMHA_UNROLL
  for (int i = 0; i < 4; ++i)
    if (!rows.sees(i / 2, key0 + 8 * j + f.column(i))) acc.c[j][i] = value;
}

/// The maximum over a row's values held by the 4 lanes of a quad.
template <class Block>
DCMHA_INLINE float quad_max(const Block& blk, float x) {
  const float a = blk.shfl_xor(x, 1);
  x = a > x ? a : x;
  const float b = blk.shfl_xor(x, 2);
  return b > x ? b : x;
}
template <class Block>
DCMHA_INLINE float quad_sum(const Block& blk, float x) {
  x += blk.shfl_xor(x, 1);
  return x + blk.shfl_xor(x, 2);
}

/// One step of the online softmax for the lane's two rows: raises each row's running maximum
/// to the block's values (masked ones are -inf), replaces acc by exp(value - maximum), adds the
/// row sums, and returns in `factor` what earlier terms of each row must be multiplied by.
/// `state` holds the quad's common state of each row.
template <int kTiles, class Block>
DCMHA_INLINE void online_softmax(const Block& blk, Accumulators<kTiles>& acc,
                                 detail::SoftmaxState<float> (&state)[2], float (&factor)[2]) {
  using std::exp;
  DCMHA_UNROLL
  for (int h = 0; h < 2; ++h) {
    float m = detail::negative_infinity<float>();
    DCMHA_UNROLL
    for (int j = 0; j < kTiles; ++j) DCMHA_UNROLL
    for (int i = 2 * h; i < 2 * h + 2; ++i) m = acc.c[j][i] > m ? acc.c[j][i] : m;
    m = quad_max(blk, m);
    factor[h] = state[h].raise_max(m);
    float sum = 0;
    DCMHA_UNROLL
    for (int j = 0; j < kTiles; ++j) DCMHA_UNROLL
    for (int i = 2 * h; i < 2 * h + 2; ++i) {
      // A row with no key so far keeps max -inf: its exponentials are 0, not exp(NaN).
      const float e = state[h].empty() ? 0.0f : exp(acc.c[j][i] - state[h].max);
      acc.c[j][i] = e;
      sum += e;
    }
    state[h].sum += quad_sum(blk, sum);
  }
  blk.count_exp(index_t(kTiles) * 4);
}

}  // namespace dcmha::cuda

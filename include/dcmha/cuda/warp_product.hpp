#pragma once
// The tile products of one warp: a 16-row block of C (float accumulators, m16n8 fragments)
// plus A x B (or two such blocks sharing B's fragments), with A and B in shared-memory operand
// tiles (tile_layout.hpp). For bf16 and fp16 storage the products are mma.sync.m16n8k16 with
// operands loaded by ldmatrix (.trans where the tile holds the operand's k index along its rows);
// float storage has no tensor-core path of the same precision and computes the same fragments on
// CUDA cores.
//
// Three shapes cover every product of the forward and backward (k: the summed index):
//   rows x rows   C[m][n] += sum_k a(m, k) b(n, k)   Q K^T, dO V^T, K Q^T, V dO^T
//   rows x cols   C[m][n] += sum_k a(m, k) b(k, n)   P' V, dL K
//   cols x cols   C[m][n] += sum_k a(k, m) b(k, n)   P'^T dO, dL^T Q
// where a(i, j) is element j of row i of tile a, from the offsets the caller gives.
//
// Fragments (PTX ISA, mma.m16n8k16): lane l, group g = l / 4, t = l % 4, holds of C the
// elements (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1) of each n8 tile.
#include <cstdint>
#include <type_traits>

#include "../config.hpp"
#include "simt.hpp"
#include "tile_layout.hpp"

namespace dcmha::cuda {

template <class T>
constexpr bool kTensorCoreType = std::is_same_v<T, bf16> || std::is_same_v<T, half>;

/// kTiles m16n8 accumulator fragments: a warp's 16 x 8 kTiles block of C.
template <int kTiles>
struct Accumulators {
  float c[kTiles][4];
  DCMHA_INLINE void zero() {
    DCMHA_UNROLL
    for (int j = 0; j < kTiles; ++j) DCMHA_UNROLL
    for (int i = 0; i < 4; ++i) c[j][i] = 0.0f;
  }
};

/// The rows and columns of C a lane's fragment elements sit at: element i of n8 tile j is
/// (row(i), 8 j + column(i)).
struct FragmentPlace {
  int g = 0, t = 0;
  template <class Block>
  DCMHA_INLINE explicit FragmentPlace(const Block& blk)
      : g(lane_of(blk) / 4), t(lane_of(blk) % 4) {}
  DCMHA_INLINE int row(int i) const { return g + (i >= 2 ? 8 : 0); }
  DCMHA_INLINE int column(int i) const { return 2 * t + (i & 1); }
};

/// A lane's two adjacent columns of a fragment row (elements i and i + 1, i even), moved by one
/// access of 2 sizeof(T) bytes.
template <class T>
struct alignas(2 * sizeof(T)) ColumnPair {
  T x, y;
};

/// x into first[0] and, where `both`, y into first[1] (global memory: a row of unit stride, as
/// validation requires of the head dim): one access where the pair is aligned (an even row
/// length, an aligned base), two where not.
template <class T, class Block>
DCMHA_INLINE void store_column_pair(const Block& blk, T* first, T x, T y, bool both) {
  if (both && reinterpret_cast<std::uintptr_t>(first) % sizeof(ColumnPair<T>) == 0) {
    blk.store_global(reinterpret_cast<ColumnPair<T>*>(first), ColumnPair<T>{x, y});
    return;
  }
  blk.store_global(first, x);
  if (both) blk.store_global(first + 1, y);
}

/// x added to first[0] and, where `both`, y to first[1] (float sums in global memory): one
/// 8-byte reduction where the pair is aligned, as store_column_pair decides.
template <class Block>
DCMHA_INLINE void add_column_pair(const Block& blk, float* first, float x, float y, bool both) {
  if (both && reinterpret_cast<std::uintptr_t>(first) % sizeof(ColumnPair<float>) == 0) {
    blk.atomic_add_global_pair(first, x, y);
    return;
  }
  blk.atomic_add_global(first, x);
  if (both) blk.atomic_add_global(first + 1, y);
}

/// first[0] and, where `both`, first[1] (else 0), loaded as store_column_pair stores them.
template <class T, class Block>
DCMHA_INLINE ColumnPair<T> load_column_pair(const Block& blk, const T* first, bool both) {
  if (both && reinterpret_cast<std::uintptr_t>(first) % sizeof(ColumnPair<T>) == 0)
    return blk.load_global(reinterpret_cast<const ColumnPair<T>*>(first));
  return {blk.load_global(first), both ? blk.load_global(first + 1) : T(0)};
}

namespace product_detail {

template <class T>
DCMHA_INLINE float widen(T x) {
  return static_cast<float>(x);
}

template <class T, class Block>
DCMHA_INLINE void mma(const Block& blk, float (&d)[4], const std::uint32_t (&a)[4],
                      const std::uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, bf16>)
    blk.mma_bf16(d, a, b);
  else
    blk.mma_f16(d, a, b);
}

/// The CUDA-core product for float storage: each lane sums its own fragment elements, k
/// outermost so that its two rows of A are read once per k for every n8 tile (and the loop
/// body, not kTiles * 4 loops, is what unrolls). The k loop itself stays rolled: ptxas, left to
/// unroll it, loads several k's 2 (kTiles + 1) operands ahead of their products, registers the
/// kernels' accumulators need, and the float kernels spilled at every head dim.
template <int kTiles, class Block, class A, class B>
DCMHA_INLINE void scalar_product(const Block& blk, Accumulators<kTiles>& acc, int depth, A&& a,
                                 B&& b) {
  const FragmentPlace f(blk);
  DCMHA_NO_UNROLL
  for (int k = 0; k < depth; ++k) {
    const float a_top = a(f.row(0), k), a_bottom = a(f.row(2), k);
    DCMHA_UNROLL
    for (int j = 0; j < kTiles; ++j) {
      const float b_even = b(k, 8 * j + f.column(0)), b_odd = b(k, 8 * j + f.column(1));
      acc.c[j][0] += a_top * b_even, acc.c[j][1] += a_top * b_odd;
      acc.c[j][2] += a_bottom * b_even, acc.c[j][3] += a_bottom * b_odd;
    }
  }
  blk.count_fma(index_t(kTiles) * 4 * depth);
}

}  // namespace product_detail

namespace product_detail {

/// One k16 step of rows x rows: acc[m] += af[m] b(b0 + n, k0 + k), each B fragment loaded once
/// for the kRowTiles A fragments.
template <int kRowTiles, int kTiles, class Block, class T>
DCMHA_INLINE void rows_step(const Block& blk, const std::uint32_t (&af)[kRowTiles][4],
                            const OperandTile<T>& b, int b0, int k0, Accumulators<kTiles>* acc) {
  static_assert(kTiles % 2 == 0, "B fragments are loaded two n8 tiles at a time");
  const int l = unhoisted_lane_of(blk);
  DCMHA_UNROLL
  for (int j = 0; j < kTiles; j += 2) {
    std::uint32_t bf[4];
    blk.ldmatrix_x4(bf, b.chunk(b0 + 8 * j + l % 8 + 8 * (l / 16), k0 / 8 + (l / 8) % 2));
    const std::uint32_t b_lo[2] = {bf[0], bf[1]}, b_hi[2] = {bf[2], bf[3]};
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) {
      mma<T>(blk, acc[m].c[j], af[m], b_lo);
      mma<T>(blk, acc[m].c[j + 1], af[m], b_hi);
    }
  }
}

/// acc[m] += a(a0 + 16 m + r, k) b(b0 + n, k): kRowTiles 16-row blocks of A sharing each B
/// fragment (a warp of 32 rows loads K once for both of its m16 tiles).
template <int kRowTiles, int kTiles, class Block, class T>
DCMHA_INLINE void rows_rows(const Block& blk, const OperandTile<T>& a, int a0,
                            const OperandTile<T>& b, int b0, int depth, Accumulators<kTiles>* acc) {
  const int l = unhoisted_lane_of(blk);
  if constexpr (kTensorCoreType<T>) {
    for (int k0 = 0; k0 < depth; k0 += 16) {
      std::uint32_t af[kRowTiles][4];
      DCMHA_UNROLL
      for (int m = 0; m < kRowTiles; ++m)
        blk.ldmatrix_x4(af[m], a.chunk(a0 + 16 * m + l % 16, k0 / 8 + l / 16));
      rows_step<kRowTiles>(blk, af, b, b0, k0, acc);
    }
  } else {
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m)
      scalar_product(
          blk, acc[m], depth,
          [&](int r, int k) { return blk.load_shared(a.at(a0 + 16 * m + r, k)); },
          [&](int k, int n) { return blk.load_shared(b.at(b0 + n, k)); });
  }
}

}  // namespace product_detail

/// acc += a(a0 + m, k) b(b0 + n, k) over k < depth (a multiple of 16; the tiles' columns up to
/// depth hold zeros past the data).
template <int kTiles, class Block, class T>
DCMHA_INLINE void product_rows_rows(const Block& blk, const OperandTile<T>& a, int a0,
                                    const OperandTile<T>& b, int b0, int depth,
                                    Accumulators<kTiles>& acc) {
  product_detail::rows_rows<1>(blk, a, a0, b, b0, depth, &acc);
}

/// The same for kRowTiles consecutive 16-row blocks of A: acc[m] takes rows a0 + 16 m.
template <int kTiles, int kRowTiles, class Block, class T>
DCMHA_INLINE void product_rows_rows(const Block& blk, const OperandTile<T>& a, int a0,
                                    const OperandTile<T>& b, int b0, int depth,
                                    Accumulators<kTiles> (&acc)[kRowTiles]) {
  product_detail::rows_rows<kRowTiles>(blk, a, a0, b, b0, depth, acc);
}

/// A warp's 16 rows of an A operand as m16k16 fragments for k < kDepth, loaded once and held in
/// registers by a warp that multiplies the same rows with many B tiles (the MHA backward: Q and dO
/// with every key tile, K and V with every query tile), so that they cross shared memory once.
template <int kDepth>
struct HeldRows {
  static_assert(kDepth % 16 == 0, "whole k16 steps");
  std::uint32_t fragments[kDepth / 16][1][4];
};

/// held = rows a0 .. a0 + 15 of a, k < depth (depth <= kDepth, a multiple of 16).
template <int kDepth, class Block, class T>
DCMHA_INLINE void load_held_rows(const Block& blk, const OperandTile<T>& a, int a0, int depth,
                                 HeldRows<kDepth>& held) {
  static_assert(kTensorCoreType<T>, "fragments are the tensor cores' operands");
  const int l = unhoisted_lane_of(blk);
  DCMHA_UNROLL
  for (int k = 0; k < kDepth / 16; ++k)
    if (16 * k < depth) blk.ldmatrix_x4(held.fragments[k][0], a.chunk(a0 + l % 16, 2 * k + l / 16));
}

/// acc += a(m, k) b(b0 + n, k) over k < depth, as product_rows_rows with A's rows held.
template <int kTiles, int kDepth, class Block, class T>
DCMHA_INLINE void product_held_rows(const Block& blk, const HeldRows<kDepth>& a,
                                    const OperandTile<T>& b, int b0, int depth,
                                    Accumulators<kTiles>& acc) {
  DCMHA_UNROLL
  for (int k = 0; k < kDepth / 16; ++k)
    if (16 * k < depth) product_detail::rows_step<1>(blk, a.fragments[k], b, b0, 16 * k, &acc);
}

namespace product_detail {

/// acc[m] += a(a0 + 16 m + r, k) b(b_k0 + k, b_n0 + n): kRowTiles 16-row blocks of A sharing
/// each B fragment (product_rows_cols).
template <int kRowTiles, int kTiles, class Block, class T>
DCMHA_INLINE void rows_cols(const Block& blk, const OperandTile<T>& a, int a0,
                            const OperandTile<T>& b, int b_k0, int b_n0, int depth,
                            Accumulators<kTiles>* acc) {
  const int l = unhoisted_lane_of(blk);
  if constexpr (kTensorCoreType<T>) {
    static_assert(kTiles % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    for (int k0 = 0; k0 < depth; k0 += 16) {
      std::uint32_t af[kRowTiles][4];
      DCMHA_UNROLL
      for (int m = 0; m < kRowTiles; ++m)
        blk.ldmatrix_x4(af[m], a.chunk(a0 + 16 * m + l % 16, k0 / 8 + l / 16));
      DCMHA_UNROLL
      for (int j = 0; j < kTiles; j += 2) {
        std::uint32_t bf[4];
        blk.ldmatrix_x4_trans(
            bf, b.chunk(b_k0 + k0 + l % 8 + 8 * ((l / 8) % 2), b_n0 / 8 + j + l / 16));
        const std::uint32_t b_lo[2] = {bf[0], bf[1]}, b_hi[2] = {bf[2], bf[3]};
        DCMHA_UNROLL
        for (int m = 0; m < kRowTiles; ++m) {
          mma<T>(blk, acc[m].c[j], af[m], b_lo);
          mma<T>(blk, acc[m].c[j + 1], af[m], b_hi);
        }
      }
    }
  } else {
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m)
      scalar_product(
          blk, acc[m], depth,
          [&](int r, int k) { return blk.load_shared(a.at(a0 + 16 * m + r, k)); },
          [&](int k, int n) { return blk.load_shared(b.at(b_k0 + k, b_n0 + n)); });
  }
}

/// acc[m] += a(k, a_m0 + 16 m + r) b(k, b_n0 + n): kRowTiles 16-column blocks of A sharing each
/// B fragment (product_cols_cols).
template <int kRowTiles, int kTiles, class Block, class T>
DCMHA_INLINE void cols_cols(const Block& blk, const OperandTile<T>& a, int a_m0,
                            const OperandTile<T>& b, int b_n0, int depth,
                            Accumulators<kTiles>* acc) {
  const int l = unhoisted_lane_of(blk);
  if constexpr (kTensorCoreType<T>) {
    static_assert(kTiles % 2 == 0, "B fragments are loaded two n8 tiles at a time");
    for (int k0 = 0; k0 < depth; k0 += 16) {
      std::uint32_t af[kRowTiles][4];
      DCMHA_UNROLL
      for (int m = 0; m < kRowTiles; ++m)
        blk.ldmatrix_x4_trans(af[m],
                              a.chunk(k0 + l % 8 + 8 * (l / 16), a_m0 / 8 + 2 * m + (l / 8) % 2));
      DCMHA_UNROLL
      for (int j = 0; j < kTiles; j += 2) {
        std::uint32_t bf[4];
        blk.ldmatrix_x4_trans(bf, b.chunk(k0 + l % 8 + 8 * ((l / 8) % 2), b_n0 / 8 + j + l / 16));
        const std::uint32_t b_lo[2] = {bf[0], bf[1]}, b_hi[2] = {bf[2], bf[3]};
        DCMHA_UNROLL
        for (int m = 0; m < kRowTiles; ++m) {
          mma<T>(blk, acc[m].c[j], af[m], b_lo);
          mma<T>(blk, acc[m].c[j + 1], af[m], b_hi);
        }
      }
    }
  } else {
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m)
      scalar_product(
          blk, acc[m], depth,
          [&](int r, int k) { return blk.load_shared(a.at(k, a_m0 + 16 * m + r)); },
          [&](int k, int n) { return blk.load_shared(b.at(k, b_n0 + n)); });
  }
}

}  // namespace product_detail

/// acc += a(a0 + m, k) b(b_k0 + k, b_n0 + n) over k < depth (a multiple of 16).
template <int kTiles, class Block, class T>
DCMHA_INLINE void product_rows_cols(const Block& blk, const OperandTile<T>& a, int a0,
                                    const OperandTile<T>& b, int b_k0, int b_n0, int depth,
                                    Accumulators<kTiles>& acc) {
  product_detail::rows_cols<1>(blk, a, a0, b, b_k0, b_n0, depth, &acc);
}

/// The same for kRowTiles consecutive 16-row blocks of A: acc[m] takes rows a0 + 16 m.
template <int kTiles, int kRowTiles, class Block, class T>
DCMHA_INLINE void product_rows_cols(const Block& blk, const OperandTile<T>& a, int a0,
                                    const OperandTile<T>& b, int b_k0, int b_n0, int depth,
                                    Accumulators<kTiles> (&acc)[kRowTiles]) {
  product_detail::rows_cols<kRowTiles>(blk, a, a0, b, b_k0, b_n0, depth, acc);
}

/// acc += a(k, a_m0 + m) b(k, b_n0 + n) over k < depth (a multiple of 16), both tiles holding k
/// along their rows.
template <int kTiles, class Block, class T>
DCMHA_INLINE void product_cols_cols(const Block& blk, const OperandTile<T>& a, int a_m0,
                                    const OperandTile<T>& b, int b_n0, int depth,
                                    Accumulators<kTiles>& acc) {
  product_detail::cols_cols<1>(blk, a, a_m0, b, b_n0, depth, &acc);
}

/// The same for kRowTiles consecutive 16-column blocks of A: acc[m] takes columns a_m0 + 16 m.
template <int kTiles, int kRowTiles, class Block, class T>
DCMHA_INLINE void product_cols_cols(const Block& blk, const OperandTile<T>& a, int a_m0,
                                    const OperandTile<T>& b, int b_n0, int depth,
                                    Accumulators<kTiles> (&acc)[kRowTiles]) {
  product_detail::cols_cols<kRowTiles>(blk, a, a_m0, b, b_n0, depth, acc);
}

/// Two values the way a fragment holds them in one 32-bit register: the first in the low half.
template <class T>
DCMHA_INLINE std::uint32_t pack_pair(float lo, float hi) {
  const T a(lo), b(hi);
  return std::uint32_t(Eigen::numext::bit_cast<std::uint16_t>(a)) |
         (std::uint32_t(Eigen::numext::bit_cast<std::uint16_t>(b)) << 16);
}

namespace product_detail {

/// acc[m] += p[m] v for kRowTiles blocks sharing each V fragment (product_fragments_cols).
template <int kRowTiles, int kTiles, int kKeyTiles, class Block, class T>
DCMHA_INLINE void fragments_cols(const Block& blk, const Accumulators<kKeyTiles>* p,
                                 const OperandTile<T>& v, int v_k0, Accumulators<kTiles>* acc) {
  static_assert(kTensorCoreType<T>, "float storage takes P through a tile");
  const int l = unhoisted_lane_of(blk);
  DCMHA_UNROLL
  for (int s = 0; s < kKeyTiles / 2; ++s) {
    std::uint32_t af[kRowTiles][4];
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) {
      const float* lo = p[m].c[2 * s];
      const float* hi = p[m].c[2 * s + 1];
      af[m][0] = pack_pair<T>(lo[0], lo[1]), af[m][1] = pack_pair<T>(lo[2], lo[3]);
      af[m][2] = pack_pair<T>(hi[0], hi[1]), af[m][3] = pack_pair<T>(hi[2], hi[3]);
    }
    DCMHA_UNROLL
    for (int j = 0; j < kTiles; j += 2) {
      std::uint32_t bf[4];
      blk.ldmatrix_x4_trans(bf, v.chunk(v_k0 + 16 * s + l % 8 + 8 * ((l / 8) % 2), j + l / 16));
      const std::uint32_t b_lo[2] = {bf[0], bf[1]}, b_hi[2] = {bf[2], bf[3]};
      DCMHA_UNROLL
      for (int m = 0; m < kRowTiles; ++m) {
        mma<T>(blk, acc[m].c[j], af[m], b_lo);
        mma<T>(blk, acc[m].c[j + 1], af[m], b_hi);
      }
    }
  }
}

}  // namespace product_detail

/// acc += p v where p is a warp's own accumulator block (16 x 8 kKeyTiles: probabilities in
/// registers, rounded to T as the tensor cores take them) and v's rows v_k0 + k are the k index:
/// P V of MHA straight from the scores' fragments, since an m16n8 C fragment pair is an m16k16 A
/// fragment. Tensor-core types only (float storage takes P through a tile).
template <int kTiles, int kKeyTiles, class Block, class T>
DCMHA_INLINE void product_fragments_cols(const Block& blk, const Accumulators<kKeyTiles>& p,
                                         const OperandTile<T>& v, int v_k0,
                                         Accumulators<kTiles>& acc) {
  product_detail::fragments_cols<1>(blk, &p, v, v_k0, &acc);
}

/// The same for kRowTiles blocks of 16 rows: acc[m] += p[m] v, each V fragment loaded once.
template <int kTiles, int kKeyTiles, int kRowTiles, class Block, class T>
DCMHA_INLINE void product_fragments_cols(const Block& blk,
                                         const Accumulators<kKeyTiles> (&p)[kRowTiles],
                                         const OperandTile<T>& v, int v_k0,
                                         Accumulators<kTiles> (&acc)[kRowTiles]) {
  product_detail::fragments_cols<kRowTiles>(blk, p, v, v_k0, acc);
}

}  // namespace dcmha::cuda

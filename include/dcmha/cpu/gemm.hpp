#pragma once
// The attention kernels' tile products, register-blocked, straight on caller memory.
//
// Why not Eigen's GEMM here: it packs both operands into contiguous panels on every call. For
// attention tiles (depth D = 64..128, a few dozen rows) that packing is a strided gather of K or V
// whose cost is a fixed fraction of the product, and it makes small key tiles (which keep a DCMHA
// panel slice in L2) slow (docs/performance.md). One kernel serves all products: gemm_nn,
// C (+)= A B with B's rows contiguous and A's elements broadcast, so A may have any strides (P'V,
// dS K, and read transposed P'^T dO, dS^T Q). The A B^T products (scores Q K^T, dP' = dO V^T)
// first transpose one key tile of B into a small buffer (pack_transposed), which the tile's Bq
// query rows then share.
// Without vector extensions gemm_nn falls back to plain loops (correct, slow).
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "../tensor.hpp"
#include "convert.hpp"
#include "simd.hpp"
#include "tile.hpp"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace dcmha::cpu {

#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
/// One vector of A read from S storage: a plain load where S is A, widened in registers where S
/// is bf16 or fp16, so that a product reads narrow storage in place (half the bytes) with the
/// arithmetic of the float product on the same values.
template <class A, class S>
inline typename Simd<A>::V vload_widened(const S* p) {
  using V = typename Simd<A>::V;
  constexpr int L = Simd<A>::L;
  if constexpr (std::is_same_v<S, A>) {
    return vload(p);
  } else {
    V v;
#if defined(__AVX512F__)
    if constexpr (L == 16 && kVectorStorage<S> && std::is_same_v<A, float>) {
      const __m512 w = load16_widened(p);
      std::memcpy(&v, &w, sizeof v);
      return v;
    }
#endif
#if defined(__AVX__)
    if constexpr ((L == 8 || L == 16) && kVectorStorage<S> && std::is_same_v<A, float>) {
      for (int h = 0; h < L; h += 8) {
        const __m256 w = load8_widened(p + h);
        std::memcpy(reinterpret_cast<char*>(&v) + h * sizeof(float), &w, sizeof w);
      }
      return v;
    }
#endif
    for (int l = 0; l < L; ++l) v[l] = A(p[l]);
    return v;
  }
}
#endif

/// How far ahead (in rows) products for few rows ask for narrow rows they read in place: their
/// stream, at half the bytes per multiply-add, outruns the hardware prefetchers.
constexpr index_t kNarrowRowsAhead = 16;

namespace detail_gemm {

#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
/// Column blocks of C (+)= A B, RB rows x CB vectors; A(i, k) = a[i * ars + k * acs]. B may be
/// narrower storage S, widened as it is loaded.
template <class A, int RB, int CB, class S = A>
inline void nn_block(index_t depth, const A* a, index_t ars, index_t acs, const S* b, index_t ldb,
                     A* c, index_t ldc, bool accumulate) {
  using V = typename Simd<A>::V;
  constexpr int L = Simd<A>::L;
  V acc[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < CB; ++j) acc[r][j] = accumulate ? vload(c + r * ldc + j * L) : V{};
  for (index_t k = 0; k < depth; ++k) {
    // Narrow B is read in place only for few rows (decoding a bf16 / fp16 cache): ask for its
    // rows ahead, as gemm_nt_few_rows does for the keys.
    if constexpr (!std::is_same_v<S, A>)
      if (k + kNarrowRowsAhead < depth)
        prefetch_bytes(b + (k + kNarrowRowsAhead) * ldb, CB * L * index_t(sizeof(S)));
    V bv[CB];
    for (int j = 0; j < CB; ++j) bv[j] = vload_widened<A>(b + k * ldb + j * L);
    for (int r = 0; r < RB; ++r) {
      // a broadcast (x - 0 is exact, so no add is emitted)
      const V av = a[r * ars + k * acs] - V{};
      for (int j = 0; j < CB; ++j) acc[r][j] = vmultiply_add(av, bv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < CB; ++j) vstore(c + r * ldc + j * L, acc[r][j]);
}

// Register budget: RB x CB accumulators + CB loads + one broadcast within 16 (AVX2) or 32
// (AVX-512) vector registers.
constexpr int kNnRows = 6;
constexpr int kNnCols = kVectorBytes == 64 ? 4 : 2;

/// Calls f(std::integral_constant<int, R>{}) for R = rows, 1 <= rows <= kNnRows: the row count
/// of a block as a template argument.
template <class F>
inline void with_row_count(index_t rows, F&& f) {
  static_assert(kNnRows == 6, "one case per row count");
  switch (rows) {
    case 6:
      f(std::integral_constant<int, 6>{});
      break;
    case 5:
      f(std::integral_constant<int, 5>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    case 3:
      f(std::integral_constant<int, 3>{});
      break;
    case 2:
      f(std::integral_constant<int, 2>{});
      break;
    default:
      f(std::integral_constant<int, 1>{});
      break;
  }
}

/// C = A B on rows [0, rows) over columns [j, j + CB * L): row blocks of kNnRows, then the rest.
template <class A, int CB, class S>
inline void nn_strip(index_t rows, index_t depth, const A* a, index_t ars, index_t acs, const S* b,
                     index_t ldb, A* c, index_t ldc, SpreadPrefetch& ahead) {
  for (index_t i = 0; i < rows; i += kNnRows, ahead.step())
    with_row_count(std::min<index_t>(kNnRows, rows - i), [&](auto rb) {
      nn_block<A, decltype(rb)::value, CB, S>(depth, a + i * ars, ars, acs, b, ldb, c + i * ldc,
                                              ldc, false);
    });
}

/// Every vector column of RB rows of C += A B; returns the first column left for scalar code.
/// `c_next`: the next row block's first C row (next_count rows, null for none), whose columns
/// are asked for strip by strip as this block reaches them.
template <class A, int RB, class S>
inline index_t nn_row_block(index_t ncol, index_t depth, const A* a, index_t ars, index_t acs,
                            const S* b, index_t ldb, A* c, index_t ldc, const A* c_next,
                            index_t next_count) {
  constexpr int L = Simd<A>::L;
  // Narrow rows read in place by one or two rows of A (decode's P'V): strips twice as wide, so
  // that a V row of 128 values is read in one pass rather than in two half-row streams.
  constexpr int CB = !std::is_same_v<S, A> && RB <= 2 && kVectorBytes == 64 ? 2 * kNnCols : kNnCols;
  index_t j = 0;
  for (; j + CB * L <= ncol; j += CB * L) {
    if (c_next) prefetch_rows(c_next + j, next_count, ldc, CB * L * index_t(sizeof(A)));
    nn_block<A, RB, CB, S>(depth, a, ars, acs, b + j, ldb, c + j, ldc, true);
  }
  for (; CB > kNnCols && j + kNnCols * L <= ncol; j += kNnCols * L) {
    if (c_next) prefetch_rows(c_next + j, next_count, ldc, kNnCols * L * index_t(sizeof(A)));
    nn_block<A, RB, kNnCols, S>(depth, a, ars, acs, b + j, ldb, c + j, ldc, true);
  }
  for (; j + L <= ncol; j += L) {
    if (c_next) prefetch_rows(c_next + j, next_count, ldc, L * index_t(sizeof(A)));
    nn_block<A, RB, 1, S>(depth, a, ars, acs, b + j, ldb, c + j, ldc, true);
  }
  if (c_next && j < ncol)
    prefetch_rows(c_next + j, next_count, ldc, (ncol - j) * index_t(sizeof(A)));
  return j;
}
#endif

}  // namespace detail_gemm

/// bt[d][j] = alpha * b[j][d] for j < n, d < depth: B^T with row stride ldt, so that C = A B^T
/// becomes the broadcast-A product gemm_nn. Packing one key tile costs 1/rows of the product it
/// feeds (one transpose per element against `rows` multiply-adds); dot products along the depth
/// instead need a horizontal reduction per output and two loads per multiply-add. B may be narrower
/// storage (bf16, fp16), widened here.
template <class A, class S>
void pack_transposed(index_t n, index_t depth, const S* b, index_t ldb, A alpha, A* bt,
                     index_t ldt) {
  index_t j = 0;
#if defined(__AVX__)
  if constexpr (std::is_same_v<A, float> && kVectorStorage<S>) {
    for (; j + 8 <= n; j += 8) {
      index_t d = 0;
      for (; d + 8 <= depth; d += 8) {
        const __m256 s = _mm256_set1_ps(alpha);
        __m256 r[8], col[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(load8_widened(b + (j + i) * ldb + d), s);
        transpose8x8(r, col);
        for (int q = 0; q < 8; ++q) _mm256_storeu_ps(bt + (d + q) * ldt + j, col[q]);
      }
      for (; d < depth; ++d)
        for (index_t i = 0; i < 8; ++i) bt[d * ldt + j + i] = alpha * A(b[(j + i) * ldb + d]);
    }
  }
#endif
  for (; j < n; ++j)
    for (index_t d = 0; d < depth; ++d) bt[d * ldt + j] = alpha * A(b[j * ldb + d]);
}

/// dst[j][:] = alpha * src[j][:] for j < n rows of `cols` values: one key tile of V (or Q, dO)
/// packed contiguous, widened to A if src is narrower storage. Caller rows are often far apart
/// (the (B, T, H, D) layout puts 16 KiB between the rows of one head at H32/D128), one page
/// each: read in place by every row block of a product, they would miss the TLB on most loads.
template <class A, class S>
void pack_rows(index_t n, index_t cols, const S* src, index_t lds, A* dst, index_t ldd,
               A alpha = A(1)) {
  for (index_t j = 0; j < n; ++j) {
    if constexpr (std::is_same_v<S, A>) {
      if (alpha == A(1)) {
        std::copy(src + j * lds, src + j * lds + cols, dst + j * ldd);
        continue;
      }
    }
    widen_row(src + j * lds, dst + j * ldd, cols, alpha);
  }
}

/// Narrow keys for few rows go eight at a time through few_rows_key_block: read at half the
/// bytes per multiply-add, one key at a time they leave the loop bound by its dependent lane
/// sums and outrun the hardware prefetchers. Float keys stay one at a time (their stream is
/// memory-bound, and eight rows read side by side measured slower).
template <class A, class S>
inline constexpr bool kFewRowsKeyBlocks =
#if defined(__AVX__) && defined(DCMHA_HAS_VECTOR_EXTENSIONS)
    std::is_same_v<A, float> && !std::is_same_v<S, float> && kVectorStorage<S> &&
    Simd<float>::L % 8 == 0;
#else
    false;
#endif

#if defined(__AVX__) && defined(DCMHA_HAS_VECTOR_EXTENSIONS)
/// Scores of every row against eight keys b[0..7]: the per-key loop's sums (same multiply-adds,
/// same lane order, bitwise the same results), keys asked for kNarrowRowsAhead keys ahead.
template <class S>
inline void few_rows_key_block(index_t rows, index_t keys_left, index_t depth, const float* a,
                               index_t lda, const S* b, index_t ldb, float* c, index_t ldc,
                               float alpha) {
  using V = typename Simd<float>::V;
  constexpr int L = Simd<float>::L;
  if (keys_left > kNarrowRowsAhead + 8)
    prefetch_rows(b + kNarrowRowsAhead * ldb, 8, ldb, depth * index_t(sizeof(S)));
  for (index_t i = 0; i < rows; ++i) {
    const float* ai = a + i * lda;
    V acc[8] = {};
    index_t d = 0;
    for (; d + L <= depth; d += L) {
      const V av = vload(ai + d);
      for (int k = 0; k < 8; ++k)
        acc[k] = vmultiply_add(av, vload_widened<float>(b + k * ldb + d), acc[k]);
    }
    float sums[8];
    _mm256_storeu_ps(sums, ordered_lane_sums8(acc));
    for (int k = 0; k < 8; ++k) {
      for (index_t e = d; e < depth; ++e)
        sums[k] = multiply_add(ai[e], float(b[k * ldb + e]), sums[k]);
      c[i * ldc + k] = alpha * sums[k];
    }
  }
}
#endif

/// C[i][j] = alpha * sum_d A[i][d] B[j][d] as dot products along the contiguous depth, for a
/// few rows only (decoding: one new token per sequence). Packing a key tile for so few rows would
/// read K three times instead of once; here every key is read from memory once, in place,
/// widened in registers where it is narrower storage S.
template <class A, class S>
void gemm_nt_few_rows(index_t rows, index_t n, index_t depth, const A* a, index_t lda, const S* b,
                      index_t ldb, A* c, index_t ldc, A alpha) {
  index_t j0 = 0;
#if defined(__AVX__) && defined(DCMHA_HAS_VECTOR_EXTENSIONS)
  if constexpr (kFewRowsKeyBlocks<A, S>)
    for (; j0 + 8 <= n; j0 += 8)
      few_rows_key_block(rows, n - j0, depth, a, lda, b + j0 * ldb, ldb, c + j0, ldc, alpha);
#endif
  for (index_t i0 = 0; i0 < rows; i0 += 4) {
    const index_t nr = std::min<index_t>(4, rows - i0);
    for (index_t j = j0; j < n; ++j) {
      const S* bj = b + j * ldb;
      A s[4] = {};
      index_t d = 0;
#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
      using V = typename Simd<A>::V;
      constexpr int L = Simd<A>::L;
      V acc[4] = {};
      for (; d + L <= depth; d += L) {
        const V bv = vload_widened<A>(bj + d);
        for (index_t r = 0; r < nr; ++r)
          acc[r] = vmultiply_add(vload(a + (i0 + r) * lda + d), bv, acc[r]);
      }
      for (index_t r = 0; r < nr; ++r)
        for (int l = 0; l < L; ++l) s[r] += acc[r][l];
#endif
      for (index_t r = 0; r < nr; ++r) {
        for (index_t e = d; e < depth; ++e)
          s[r] = multiply_add(a[(i0 + r) * lda + e], A(bj[e]), s[r]);
        c[(i0 + r) * ldc + j] = alpha * s[r];
      }
    }
  }
}

/// Below this many rows gemm_abt / gemm_ab read K and V in place instead of packing key tiles
/// that too few rows would share.
constexpr index_t kPackMinRows = 8;
/// B rows of a scaled product for so few rows are widened and scaled this many at a time, into
/// an L1-sized piece of the buffer: a decode tile holds thousands of keys, whose widened copy
/// (2 MiB at 4096 keys, D = 128) would go out to L3 and back.
constexpr index_t kFewRowsKeys = 64;

/// C[i][:] (+)= sum_k A(i, k) B[k][:] for i < rows, over `depth` rows of B (row stride ldb, ncol
/// contiguous columns); A(i, k) = a[i * ars + k * acs], so A may be read transposed. C is
/// overwritten unless `accumulate`. `next`: what the caller reads after this product, asked for
/// in shares, one per row block, while it runs (NextRows).
template <class A, class S = A>
void gemm_nn(index_t rows, index_t ncol, index_t depth, const A* a, index_t ars, index_t acs,
             const S* b, index_t ldb, A* c, index_t ldc, bool accumulate,
             const NextReads& next = {}) {
  if (rows <= 0 || ncol <= 0) return;
  if (depth <= 0) {
    if (!accumulate)
      for (index_t i = 0; i < rows; ++i) std::fill(c + i * ldc, c + i * ldc + ncol, A(0));
    return;
  }
  index_t j = 0;
#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
  using namespace detail_gemm;
  constexpr int L = Simd<A>::L;
  if (accumulate) {
    // Accumulated C rows are often far apart (the caller's dK, dV rows: 16 KiB at H32/D128) and
    // out of cache. Row blocks outer: each C row is read and written once, as one contiguous
    // run, and the next block's rows are asked for a block ahead, strip by strip as this block
    // reaches the same columns (nn_row_block). Column strips outer would read each row as one
    // cache line per strip, each with a short prefetch distance, and slow the backward's dK and
    // dV products. Asking for the next block's whole rows at once (48 lines at D = 128) stalls on
    // the prefetch instructions themselves once the DCMHA forward's per-thread outputs
    // (M x Bq x Dv values, 2 MiB at H32/D128) outgrow L2.
    constexpr int RB = kNnRows;
    const index_t bytes = ncol * index_t(sizeof(A));
    prefetch_rows(c, std::min<index_t>(rows, RB), ldc, bytes);
    SpreadPrefetch ahead(next, (rows + RB - 1) / RB);
    for (index_t i = 0; i < rows; i += RB, ahead.step()) {
      const index_t next_count = std::min<index_t>(RB, std::max<index_t>(rows - i - RB, 0));
      with_row_count(std::min<index_t>(RB, rows - i), [&](auto rb) {
        j = nn_row_block<A, decltype(rb)::value, S>(
            ncol, depth, a + i * ars, ars, acs, b, ldb, c + i * ldc, ldc,
            next_count > 0 ? c + (i + RB) * ldc : nullptr, next_count);
      });
    }
  } else {
    // Column strips outer: a strip of B (depth x CB vectors, 8 KiB at depth 128) stays in L1
    // while every row block of A passes over it.
    const index_t strips = ncol / (kNnCols * L) + ncol % (kNnCols * L) / L;
    SpreadPrefetch ahead(next, strips * ((rows + kNnRows - 1) / kNnRows));
    for (; j + kNnCols * L <= ncol; j += kNnCols * L)
      nn_strip<A, kNnCols, S>(rows, depth, a, ars, acs, b + j, ldb, c + j, ldc, ahead);
    for (; j + L <= ncol; j += L)
      nn_strip<A, 1, S>(rows, depth, a, ars, acs, b + j, ldb, c + j, ldc, ahead);
  }
#else
  (void)next;
#endif
  // Columns left over (all of them without vector extensions).
  for (; j < ncol; ++j)
    for (index_t i = 0; i < rows; ++i) {
      A s = accumulate ? c[i * ldc + j] : A(0);
      for (index_t k = 0; k < depth; ++k)
        s = multiply_add(a[i * ars + k * acs], A(b[k * ldb + j]), s);
      c[i * ldc + j] = s;
    }
}

/// C = alpha A B^T, rows x n over `depth` (scores Q K^T, dP' = dO V^T). B's n rows are transposed
/// into `buf` (depth x n values) that all rows share, unless there are too few rows to share it
/// (then B is read in place, or widened into buf in row order if it is narrower storage than A).
/// `next`: see gemm_nn.
template <class A, class S>
void gemm_abt(index_t rows, index_t n, index_t depth, const A* a, index_t lda, const S* b,
              index_t ldb, A* c, index_t ldc, A alpha, A* buf, const NextReads& next = {}) {
  if (rows < kPackMinRows)
    return gemm_nt_few_rows<A, S>(rows, n, depth, a, lda, b, ldb, c, ldc, alpha);
  pack_transposed<A>(n, depth, b, ldb, alpha, buf, n);
  gemm_nn<A>(rows, n, depth, a, lda, 1, buf, n, c, ldc, false, next);
}

/// Rows of a matrix in memory: row i at data + i * ld, its values contiguous.
template <class S>
struct MatrixRows {
  S* data = nullptr;
  index_t ld = 0;
};

/// C (+)= A (alpha B), B's `depth` rows of ncol values copied contiguous into `buf` (depth x ncol)
/// first unless too few rows would read them (then read in place when alpha is 1 and B is not
/// narrower storage than A). `next`: see gemm_nn.
template <class A, class S>
void gemm_ab(index_t rows, index_t ncol, index_t depth, MatrixRows<const A> a,
             MatrixRows<const S> b, MatrixRows<A> c, bool accumulate, A* buf, A alpha,
             const NextReads& next) {
  if (rows < kPackMinRows) {
    if (alpha == A(1))  // B in place, narrow storage widened as it is loaded
      return gemm_nn<A, S>(rows, ncol, depth, a.data, a.ld, 1, b.data, b.ld, c.data, c.ld,
                           accumulate, next);
    // Widened a chunk of rows at a time (the sums continue from chunk to chunk in the same order).
    for (index_t k = 0; k < depth; k += kFewRowsKeys) {
      const index_t keys = std::min(kFewRowsKeys, depth - k);
      pack_rows<A>(keys, ncol, b.data + k * b.ld, b.ld, buf, ncol, alpha);
      gemm_nn<A>(rows, ncol, keys, a.data + k, a.ld, 1, buf, ncol, c.data, c.ld,
                 accumulate || k > 0, next);
    }
    return;
  }
  pack_rows<A>(depth, ncol, b.data, b.ld, buf, ncol, alpha);
  gemm_nn<A>(rows, ncol, depth, a.data, a.ld, 1, buf, ncol, c.data, c.ld, accumulate, next);
}

}  // namespace dcmha::cpu

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
#include <type_traits>

#include "../tensor.hpp"
#include "convert.hpp"
#include "simd.hpp"
#include "tile.hpp"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace dcmha::cpu {

namespace detail_gemm {

#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
/// Column blocks of C (+)= A B, RB rows x CB vectors; A(i, k) = a[i * ars + k * acs].
template <class A, int RB, int CB>
inline void nn_block(index_t depth, const A* a, index_t ars, index_t acs, const A* b, index_t ldb,
                     A* c, index_t ldc, bool accumulate) {
  using V = typename Simd<A>::V;
  constexpr int L = Simd<A>::L;
  V acc[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < CB; ++j) acc[r][j] = accumulate ? vload(c + r * ldc + j * L) : V{};
  for (index_t k = 0; k < depth; ++k) {
    V bv[CB];
    for (int j = 0; j < CB; ++j) bv[j] = vload(b + k * ldb + j * L);
    for (int r = 0; r < RB; ++r) {
      // a broadcast (x - 0 is exact, so no add is emitted)
      const V av = a[r * ars + k * acs] - V{};
      for (int j = 0; j < CB; ++j) acc[r][j] += av * bv[j];
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
template <class A, int CB>
inline void nn_strip(index_t rows, index_t depth, const A* a, index_t ars, index_t acs, const A* b,
                     index_t ldb, A* c, index_t ldc, SpreadPrefetch& ahead) {
  for (index_t i = 0; i < rows; i += kNnRows, ahead.step())
    with_row_count(std::min<index_t>(kNnRows, rows - i), [&](auto rb) {
      nn_block<A, decltype(rb)::value, CB>(depth, a + i * ars, ars, acs, b, ldb, c + i * ldc, ldc,
                                           false);
    });
}

/// Every vector column of RB rows of C += A B; returns the first column left for scalar code.
/// `c_next`: the next row block's first C row (next_count rows, null for none), whose columns
/// are asked for strip by strip as this block reaches them.
template <class A, int RB>
inline index_t nn_row_block(index_t ncol, index_t depth, const A* a, index_t ars, index_t acs,
                            const A* b, index_t ldb, A* c, index_t ldc, const A* c_next,
                            index_t next_count) {
  constexpr int L = Simd<A>::L;
  index_t j = 0;
  for (; j + kNnCols * L <= ncol; j += kNnCols * L) {
    if (c_next) prefetch_rows(c_next + j, next_count, ldc, kNnCols * L * index_t(sizeof(A)));
    nn_block<A, RB, kNnCols>(depth, a, ars, acs, b + j, ldb, c + j, ldc, true);
  }
  for (; j + L <= ncol; j += L) {
    if (c_next) prefetch_rows(c_next + j, next_count, ldc, L * index_t(sizeof(A)));
    nn_block<A, RB, 1>(depth, a, ars, acs, b + j, ldb, c + j, ldc, true);
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
        __m256 r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(load8_widened(b + (j + i) * ldb + d), s);
        for (int i = 0; i < 4; ++i) {
          t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
          t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 2; ++i)
          for (int h = 0; h < 2; ++h) {
            r[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
            r[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xEE);
          }
        // r[0..3]: columns 0,1,4,5 / 2,3,6,7 interleaved by 128-bit lane; recombine the lanes.
        for (int q = 0; q < 4; ++q) {
          _mm256_storeu_ps(bt + (d + q) * ldt + j, _mm256_permute2f128_ps(r[q], r[4 + q], 0x20));
          _mm256_storeu_ps(bt + (d + 4 + q) * ldt + j,
                           _mm256_permute2f128_ps(r[q], r[4 + q], 0x31));
        }
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

/// C[i][j] = alpha * sum_d A[i][d] B[j][d] as dot products along the contiguous depth, for a
/// few rows only (decoding: one new token per sequence). Packing a key tile for so few rows would
/// read K three times instead of once; here every key is read once per block of 4 rows.
template <class A>
void gemm_nt_few_rows(index_t rows, index_t n, index_t depth, const A* a, index_t lda, const A* b,
                      index_t ldb, A* c, index_t ldc, A alpha) {
  for (index_t i0 = 0; i0 < rows; i0 += 4) {
    const index_t nr = std::min<index_t>(4, rows - i0);
    for (index_t j = 0; j < n; ++j) {
      const A* bj = b + j * ldb;
      A s[4] = {};
      index_t d = 0;
#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
      using V = typename Simd<A>::V;
      constexpr int L = Simd<A>::L;
      V acc[4] = {};
      for (; d + L <= depth; d += L) {
        const V bv = vload(bj + d);
        for (index_t r = 0; r < nr; ++r) acc[r] += vload(a + (i0 + r) * lda + d) * bv;
      }
      for (index_t r = 0; r < nr; ++r)
        for (int l = 0; l < L; ++l) s[r] += acc[r][l];
#endif
      for (index_t r = 0; r < nr; ++r) {
        for (index_t e = d; e < depth; ++e) s[r] += a[(i0 + r) * lda + e] * bj[e];
        c[(i0 + r) * ldc + j] = alpha * s[r];
      }
    }
  }
}

/// Below this many rows gemm_abt / gemm_ab read K and V in place instead of packing key tiles
/// that too few rows would share.
constexpr index_t kPackMinRows = 8;
/// Narrow K or V rows for so few rows (decoding a bf16 or fp16 cache) are widened this many at a
/// time, into an L1-sized piece of the buffer: a decode tile holds thousands of keys, whose
/// widened copy (2 MiB at 4096 keys, D = 128) would go out to L3 and back.
constexpr index_t kFewRowsKeys = 64;

/// C[i][:] (+)= sum_k A(i, k) B[k][:] for i < rows, over `depth` rows of B (row stride ldb, ncol
/// contiguous columns); A(i, k) = a[i * ars + k * acs], so A may be read transposed. C is
/// overwritten unless `accumulate`. `next`: what the caller reads after this product, asked for
/// in shares, one per row block, while it runs (NextRows).
template <class A>
void gemm_nn(index_t rows, index_t ncol, index_t depth, const A* a, index_t ars, index_t acs,
             const A* b, index_t ldb, A* c, index_t ldc, bool accumulate,
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
        j = nn_row_block<A, decltype(rb)::value>(
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
      nn_strip<A, kNnCols>(rows, depth, a, ars, acs, b + j, ldb, c + j, ldc, ahead);
    for (; j + L <= ncol; j += L)
      nn_strip<A, 1>(rows, depth, a, ars, acs, b + j, ldb, c + j, ldc, ahead);
  }
#else
  (void)next;
#endif
  // Columns left over (all of them without vector extensions).
  for (; j < ncol; ++j)
    for (index_t i = 0; i < rows; ++i) {
      A s = accumulate ? c[i * ldc + j] : A(0);
      for (index_t k = 0; k < depth; ++k) s += a[i * ars + k * acs] * b[k * ldb + j];
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
  if (rows < kPackMinRows) {
    if constexpr (std::is_same_v<S, A>) {
      return gemm_nt_few_rows<A>(rows, n, depth, a, lda, b, ldb, c, ldc, alpha);
    } else {  // widened in row order: the same dot products as for float storage
      for (index_t j = 0; j < n; j += kFewRowsKeys) {
        const index_t keys = std::min(kFewRowsKeys, n - j);
        pack_rows<A>(keys, depth, b + j * ldb, ldb, buf, depth);
        gemm_nt_few_rows<A>(rows, keys, depth, a, lda, buf, depth, c + j, ldc, alpha);
      }
      return;
    }
  }
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
    if constexpr (std::is_same_v<S, A>)
      if (alpha == A(1))
        return gemm_nn<A>(rows, ncol, depth, a.data, a.ld, 1, b.data, b.ld, c.data, c.ld,
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

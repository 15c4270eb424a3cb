#pragma once
// The tile products in bf16 with float accumulation, on AVX512_BF16's vdpbf16ps: the path of
// Products::storage_type for bf16 tensors (config.hpp), chosen at run time (cpu_features.hpp).
//
// vdpbf16ps works on pairs: acc[l] += a[2l] b[2l] + a[2l+1] b[2l+1] over 16 float lanes, 32
// products per instruction where an FMA on widened values does 16. So both operands are kept as
// pairs along the product's depth k, one 32-bit word per pair: A(i, kp) holds A(i, 2kp) and
// A(i, 2kp + 1) and is broadcast; B(kp, j) holds B(2kp, j) and B(2kp + 1, j), 16 columns to a
// vector. Each product's operands are rearranged into that form by one of the packers below
// (the caller's bf16 rows as they are, K^T by a 16 x 16 word transpose, two rows of V
// interleaved, float panels such as P' and dS rounded to bf16 to nearest, ties to even). An odd
// depth's last pair is completed with zeros on both sides, so it adds 0 * 0.
//
// Everything here is compiled for AVX-512 BF16 by a function attribute, whatever the compiler's
// flags, and must only be called where cpu_has_avx512_bf16() holds.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include <type_traits>

#include "../config.hpp"
#include "../tensor.hpp"
#include "cpu_features.hpp"

#if defined(DCMHA_X86_CPUID) && !defined(DCMHA_NO_BF16_PRODUCTS)
#include <immintrin.h>
#define DCMHA_HAS_BF16_PRODUCTS 1
#define DCMHA_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace dcmha::cpu {

/// Whether the bf16 products can run on this machine (compiled in, and the CPU has them).
inline bool bf16_products_available() {
#ifdef DCMHA_HAS_BF16_PRODUCTS
  return cpu_has_avx512_bf16();
#else
  return false;
#endif
}

/// Whether a call on storage type T with `products` takes the bf16 products.
template <class T>
inline bool uses_bf16_products(Products products) {
  return std::is_same_v<T, bf16> && products == Products::storage_type && bf16_products_available();
}

/// bf16 values as the bit patterns the packers read.
inline const std::uint16_t* bf16_bits(const bf16* p) {
  return reinterpret_cast<const std::uint16_t*>(p);
}

/// Words of pairs along a depth of n values.
inline index_t pair_count(index_t n) { return (n + 1) / 2; }

/// C (+)= alpha A B for `rows` x `cols`, over `pairs` pairs of the depth: A(i, kp) =
/// a[i * lda + kp], B(kp, j) = b[kp * ldb + j] (words of two bf16), C float. C = alpha A B,
/// or C + alpha A B when `accumulate`.
struct PairProduct {
  index_t rows = 0, cols = 0, pairs = 0;
  const std::uint32_t* a = nullptr;
  index_t lda = 0;
  const std::uint32_t* b = nullptr;
  index_t ldb = 0;
  float* c = nullptr;
  index_t ldc = 0;
  float alpha = 1;
  bool accumulate = false;
};

#ifdef DCMHA_HAS_BF16_PRODUCTS
namespace detail_bf16 {

/// Mask of the first n (<= 16) lanes.
inline __mmask16 first_lanes(index_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
}

// GCC 12 reports the _mm512_undefined_* inside the unmasked forms of these intrinsics as used
// uninitialized (GCC bug 105593) wherever they are inlined, in every program that includes
// dcmha: the zero-masking forms, the same instructions, have no undefined source.
DCMHA_BF16_TARGET inline __m512i unpacklo_epi32(__m512i a, __m512i b) {
  return _mm512_maskz_unpacklo_epi32(0xffff, a, b);
}
DCMHA_BF16_TARGET inline __m512i unpackhi_epi32(__m512i a, __m512i b) {
  return _mm512_maskz_unpackhi_epi32(0xffff, a, b);
}
DCMHA_BF16_TARGET inline __m512i unpacklo_epi64(__m512i a, __m512i b) {
  return _mm512_maskz_unpacklo_epi64(0xff, a, b);
}
DCMHA_BF16_TARGET inline __m512i unpackhi_epi64(__m512i a, __m512i b) {
  return _mm512_maskz_unpackhi_epi64(0xff, a, b);
}
template <int kLanes>
DCMHA_BF16_TARGET inline __m512i shuffle_lanes(__m512i a, __m512i b) {
  return _mm512_maskz_shuffle_i32x4(0xffff, a, b, kLanes);
}
/// Each 32-bit lane shifted left by 16 bits (the second word of a pair to its place).
DCMHA_BF16_TARGET inline __m512i shift_left_16(__m512i x) {
  return _mm512_maskz_slli_epi32(0xffff, x, 16);
}
/// 16 words zero-extended to 32 bits.
DCMHA_BF16_TARGET inline __m512i widen_words(__m256i x) {
  return _mm512_maskz_cvtepu16_epi32(0xffff, x);
}

/// RB rows x CB vectors of C (the last `last_mask` lanes wide) at row i, column j.
template <int RB, int CB>
DCMHA_BF16_TARGET inline void pair_block(const PairProduct& p, index_t i, index_t j,
                                         __mmask16 last_mask) {
  __mmask16 mask[CB];
  for (int v = 0; v < CB; ++v) mask[v] = v + 1 == CB ? last_mask : __mmask16(0xffff);
  __m512 acc[RB][CB];
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < CB; ++v) acc[r][v] = _mm512_setzero_ps();
  const std::uint32_t* a = p.a + i * p.lda;
  const std::uint32_t* b = p.b + j;
  for (index_t kp = 0; kp < p.pairs; ++kp, b += p.ldb) {
    __m512i bv[CB];
    for (int v = 0; v < CB; ++v) bv[v] = _mm512_maskz_loadu_epi32(mask[v], b + 16 * v);
    for (int r = 0; r < RB; ++r) {
      const __m512i av = _mm512_set1_epi32(int(a[r * p.lda + kp]));
      for (int v = 0; v < CB; ++v)
        acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)av, (__m512bh)bv[v]);
    }
  }
  const __m512 alpha = _mm512_set1_ps(p.alpha);
  for (int r = 0; r < RB; ++r)
    for (int v = 0; v < CB; ++v) {
      float* c = p.c + (i + r) * p.ldc + j + 16 * v;
      __m512 x = _mm512_mul_ps(acc[r][v], alpha);
      if (p.accumulate) x = _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], c), x);
      _mm512_mask_storeu_ps(c, mask[v], x);
    }
}

// 6 x 4 accumulators, 4 B vectors and a broadcast: 29 of the 32 vector registers.
constexpr int kPairRows = 6;
constexpr int kPairVectors = 4;

/// Every row block over the column strip at j of CB vectors.
template <int CB>
DCMHA_BF16_TARGET inline void pair_strip(const PairProduct& p, index_t j, __mmask16 last_mask) {
  for (index_t i = 0; i < p.rows; i += kPairRows) {
    switch (std::min<index_t>(kPairRows, p.rows - i)) {
      case 6:
        pair_block<6, CB>(p, i, j, last_mask);
        break;
      case 5:
        pair_block<5, CB>(p, i, j, last_mask);
        break;
      case 4:
        pair_block<4, CB>(p, i, j, last_mask);
        break;
      case 3:
        pair_block<3, CB>(p, i, j, last_mask);
        break;
      case 2:
        pair_block<2, CB>(p, i, j, last_mask);
        break;
      default:
        pair_block<1, CB>(p, i, j, last_mask);
        break;
    }
  }
}

/// 16 x 16 words transposed in registers: r[i] lane c becomes r[c] lane i.
DCMHA_BF16_TARGET inline void transpose_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3.
  __m512i u[16];
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i even0 = shuffle_lanes<0x88>(u[k], u[4 + k]);
    const __m512i odd0 = shuffle_lanes<0xdd>(u[k], u[4 + k]);
    const __m512i even1 = shuffle_lanes<0x88>(u[8 + k], u[12 + k]);
    const __m512i odd1 = shuffle_lanes<0xdd>(u[8 + k], u[12 + k]);
    r[k] = shuffle_lanes<0x88>(even0, even1);      // lane 0: column k
    r[4 + k] = shuffle_lanes<0x88>(odd0, odd1);    // lane 1: column 4 + k
    r[8 + k] = shuffle_lanes<0xdd>(even0, even1);  // lane 2: column 8 + k
    r[12 + k] = shuffle_lanes<0xdd>(odd0, odd1);   // lane 3: column 12 + k
  }
}

/// 16 words of bf16 pairs from two rows of 16 floats each: word l = (lo[l], hi[l]), each rounded
/// to nearest, ties to even (vcvtneps2bf16). A null `hi` row pairs with zeros.
DCMHA_BF16_TARGET inline __m512i pair_words(const float* lo, const float* hi, __mmask16 mask) {
  const __m512i l = widen_words((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, lo)));
  if (!hi) return l;
  const __m512i h = widen_words((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, hi)));
  return _mm512_or_si512(l, shift_left_16(h));
}

}  // namespace detail_bf16

/// C (+)= alpha A B (PairProduct): column strips of four vectors, every row block over each
/// strip while it is in L1.
DCMHA_BF16_TARGET inline void pair_product(const PairProduct& p) {
  using namespace detail_bf16;
  if (p.rows <= 0 || p.cols <= 0) return;
  index_t j = 0;
  for (; j + 16 * kPairVectors <= p.cols; j += 16 * kPairVectors)
    pair_strip<kPairVectors>(p, j, 0xffff);
  const index_t rest = p.cols - j;
  if (rest == 0) return;
  const __mmask16 last = first_lanes(rest - (rest - 1) / 16 * 16);
  switch ((rest + 15) / 16) {
    case 4:
      return pair_strip<4>(p, j, last);
    case 3:
      return pair_strip<3>(p, j, last);
    case 2:
      return pair_strip<2>(p, j, last);
    default:
      return pair_strip<1>(p, j, last);
  }
}

/// dst[i * ldd + kp] = (src[i][2kp], src[i][2kp + 1]) for i < n rows of `depth` bf16 values (bit
/// patterns), an odd depth's last pair completed with a zero: rows as the broadcast operand
/// A (Q, dO) or already in B's form.
inline void pairs_of_rows(index_t n, index_t depth, const std::uint16_t* src, index_t lds,
                          std::uint32_t* dst, index_t ldd) {
  const index_t whole = depth / 2;
  for (index_t i = 0; i < n; ++i) {
    const std::uint16_t* s = src + i * lds;
    std::memcpy(dst + i * ldd, s, whole * sizeof(std::uint32_t));
    if (depth % 2) dst[i * ldd + whole] = s[depth - 1];
  }
}

/// dst[kp * ldd + j] = (src[j][2kp], src[j][2kp + 1]) for j < n rows of `depth` bf16 values: the
/// B operand of A src^T (K^T for the scores, V^T for dP'), by 16 x 16 word transposes.
DCMHA_BF16_TARGET inline void pairs_transposed(index_t n, index_t depth, const std::uint16_t* src,
                                               index_t lds, std::uint32_t* dst, index_t ldd) {
  using namespace detail_bf16;
  const index_t words = depth / 2;
  for (index_t j = 0; j < n; j += 16) {
    const index_t jn = std::min<index_t>(16, n - j);
    for (index_t k = 0; k < words; k += 16) {
      const __mmask16 mask = first_lanes(words - k);
      __m512i r[16];
      for (index_t i = 0; i < 16; ++i)
        r[i] = i < jn ? _mm512_maskz_loadu_epi32(mask, src + (j + i) * lds + 2 * k)
                      : _mm512_setzero_si512();
      transpose_words(r);
      for (index_t c = 0; c < std::min<index_t>(16, words - k); ++c)
        _mm512_mask_storeu_epi32(dst + (k + c) * ldd + j, first_lanes(jn), r[c]);
    }
    if (depth % 2)
      for (index_t i = 0; i < jn; ++i) dst[words * ldd + j + i] = src[(j + i) * lds + depth - 1];
  }
}

/// dst[kp * ldd + c] = (src[2kp][c], src[2kp + 1][c]) for the n rows of `cols` bf16 values: two
/// rows interleaved, the B operand of P' V, dS K, P'^T dO and dS^T Q; an odd n's last row pairs
/// with zeros.
DCMHA_BF16_TARGET inline void pairs_interleaved(index_t n, index_t cols, const std::uint16_t* src,
                                                index_t lds, std::uint32_t* dst, index_t ldd) {
  using namespace detail_bf16;
  for (index_t kp = 0; kp < pair_count(n); ++kp) {
    const std::uint16_t* lo = src + 2 * kp * lds;
    const std::uint16_t* hi = 2 * kp + 1 < n ? lo + lds : nullptr;
    std::uint32_t* d = dst + kp * ldd;
    for (index_t c = 0; c < cols; c += 16) {
      const __mmask16 mask = first_lanes(cols - c);
      const __m512i l = widen_words(_mm256_maskz_loadu_epi16(mask, lo + c));
      const __m512i h =
          hi ? widen_words(_mm256_maskz_loadu_epi16(mask, hi + c)) : _mm512_setzero_si512();
      _mm512_mask_storeu_epi32(d + c, mask, _mm512_or_si512(l, shift_left_16(h)));
    }
  }
}

/// dst[i * ldd + kp] = bf16 pairs of (src[i][2kp], src[i][2kp + 1]) for i < rows of n floats,
/// rounded to nearest, ties to even: P' or dS as the A operand of P' V and dS K.
DCMHA_BF16_TARGET inline void pairs_of_float_rows(index_t rows, index_t n, const float* src,
                                                  index_t lds, std::uint32_t* dst, index_t ldd) {
  using namespace detail_bf16;
  for (index_t i = 0; i < rows; ++i) {
    const float* s = src + i * lds;
    std::uint32_t* d = dst + i * ldd;
    for (index_t e = 0; e < n; e += 32) {
      const __mmask16 lo = first_lanes(n - e), hi = first_lanes(std::max<index_t>(n - e - 16, 0));
      const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, s + e + 16),
                                             _mm512_maskz_loadu_ps(lo, s + e));
      _mm512_mask_storeu_epi32(d + e / 2, first_lanes(pair_count(n - e)), (__m512i)w);
    }
  }
}

/// dst[j * ldd + qp] = bf16 pairs of (src[2qp][j], src[2qp + 1][j]) for j < n columns of `rows`
/// float rows: P'^T or dS^T, as the A operand of P'^T dO and dS^T Q (rows: keys, depth: queries);
/// an odd row count's last row pairs with zeros.
DCMHA_BF16_TARGET inline void pairs_of_float_columns(index_t rows, index_t n, const float* src,
                                                     index_t lds, std::uint32_t* dst, index_t ldd) {
  using namespace detail_bf16;
  const index_t pairs = pair_count(rows);
  for (index_t j = 0; j < n; j += 16) {
    const index_t jn = std::min<index_t>(16, n - j);
    const __mmask16 mask = first_lanes(jn);
    for (index_t k = 0; k < pairs; k += 16) {
      __m512i r[16];
      for (index_t i = 0; i < 16; ++i) {
        const index_t q = 2 * (k + i);
        r[i] = k + i < pairs ? pair_words(src + q * lds + j,
                                          q + 1 < rows ? src + (q + 1) * lds + j : nullptr, mask)
                             : _mm512_setzero_si512();
      }
      transpose_words(r);
      const __mmask16 out = first_lanes(pairs - k);
      for (index_t c = 0; c < jn; ++c) _mm512_mask_storeu_epi32(dst + (j + c) * ldd + k, out, r[c]);
    }
  }
}
#endif

/// Where a product's rows of B are: n rows of bf16 values, `ld` apart.
struct Bf16Rows {
  const bf16* data = nullptr;
  index_t ld = 0;
};

/// A float matrix (P', dS: a panel's rows), `ld` apart.
struct FloatRows {
  const float* data = nullptr;
  index_t ld = 0;
};

/// The output of a product: C (+)= alpha (...), rows `ld` apart.
struct ProductOutput {
  float* data = nullptr;
  index_t ld = 0;
  float alpha = 1;
  bool accumulate = false;
};

/// pair_product of rows x cols over `pairs` words of A (lda apart) and B (ldb apart) into c.
inline void multiply_pairs(index_t rows, index_t cols, index_t pairs, const std::uint32_t* a,
                           index_t lda, const std::uint32_t* b, index_t ldb,
                           const ProductOutput& c) {
#ifdef DCMHA_HAS_BF16_PRODUCTS
  PairProduct p;
  p.rows = rows;
  p.cols = cols;
  p.pairs = pairs;
  p.a = a;
  p.lda = lda;
  p.b = b;
  p.ldb = ldb;
  p.c = c.data;
  p.ldc = c.ld;
  p.alpha = c.alpha;
  p.accumulate = c.accumulate;
  pair_product(p);
#else  // never called: bf16_products_available() is false
  (void)rows, (void)cols, (void)pairs, (void)a, (void)lda, (void)b, (void)ldb, (void)c;
#endif
}

/// C (+)= alpha A B^T, rows x n over `depth`: A as pairs (pairs_of_rows, `lda` words apart), B's
/// n rows transposed into `b_pairs` (pair_count(depth) x n words). The scores Q K^T, dP' = dO V^T.
inline void bf16_product_abt(index_t rows, index_t n, index_t depth, const std::uint32_t* a,
                             index_t lda, Bf16Rows b, ProductOutput c, std::uint32_t* b_pairs) {
#ifdef DCMHA_HAS_BF16_PRODUCTS
  pairs_transposed(n, depth, bf16_bits(b.data), b.ld, b_pairs, n);
  multiply_pairs(rows, n, pair_count(depth), a, lda, b_pairs, n, c);
#else  // never called: bf16_products_available() is false
  (void)rows, (void)n, (void)depth, (void)a, (void)lda, (void)b, (void)c, (void)b_pairs;
#endif
}

/// C (+)= alpha A B, rows x cols over `depth`: A float rows rounded to bf16 into `a_pairs`
/// (rows x pair_count(depth) words), B's `depth` rows interleaved into `b_pairs`
/// (pair_count(depth) x cols words). P' V, dQ = dS K.
inline void bf16_product_ab(index_t rows, index_t cols, index_t depth, FloatRows a, Bf16Rows b,
                            ProductOutput c, std::uint32_t* a_pairs, std::uint32_t* b_pairs) {
#ifdef DCMHA_HAS_BF16_PRODUCTS
  const index_t pairs = pair_count(depth);
  pairs_of_float_rows(rows, depth, a.data, a.ld, a_pairs, pairs);
  pairs_interleaved(depth, cols, bf16_bits(b.data), b.ld, b_pairs, cols);
  multiply_pairs(rows, cols, pairs, a_pairs, pairs, b_pairs, cols, c);
#else  // never called: bf16_products_available() is false
  (void)rows, (void)cols, (void)depth, (void)a, (void)b, (void)c, (void)a_pairs, (void)b_pairs;
#endif
}

/// C (+)= alpha A^T B, n x cols over `depth` rows of A (n floats each) and of B: A^T rounded to
/// bf16 into `a_pairs` (n x pair_count(depth) words), B already interleaved (pairs_interleaved,
/// `ldb` words apart). dV += P'^T dO, dK += dS^T Q.
inline void bf16_product_atb(index_t n, index_t cols, index_t depth, FloatRows a,
                             const std::uint32_t* b, index_t ldb, ProductOutput c,
                             std::uint32_t* a_pairs) {
#ifdef DCMHA_HAS_BF16_PRODUCTS
  const index_t pairs = pair_count(depth);
  pairs_of_float_columns(depth, n, a.data, a.ld, a_pairs, pairs);
  multiply_pairs(n, cols, pairs, a_pairs, pairs, b, ldb, c);
#else  // never called: bf16_products_available() is false
  (void)n, (void)cols, (void)depth, (void)a, (void)b, (void)ldb, (void)c, (void)a_pairs;
#endif
}

/// The packers' rows of a (B, heads, len, dim) bf16 view as pairs (Q, dO: the A of the scores and
/// of dP'), or interleaved (the B of dK, dV); both no-ops where the products are not compiled in.
inline void bf16_pairs_of_rows(index_t n, index_t depth, const bf16* src, index_t lds,
                               std::uint32_t* dst, index_t ldd) {
#ifdef DCMHA_HAS_BF16_PRODUCTS
  pairs_of_rows(n, depth, bf16_bits(src), lds, dst, ldd);
#else
  (void)n, (void)depth, (void)src, (void)lds, (void)dst, (void)ldd;
#endif
}
inline void bf16_pairs_interleaved(index_t n, index_t cols, const bf16* src, index_t lds,
                                   std::uint32_t* dst, index_t ldd) {
#ifdef DCMHA_HAS_BF16_PRODUCTS
  pairs_interleaved(n, cols, bf16_bits(src), lds, dst, ldd);
#else
  (void)n, (void)cols, (void)src, (void)lds, (void)dst, (void)ldd;
#endif
}

}  // namespace dcmha::cpu

#pragma once
// Narrow storage (bf16 and fp16 tensors) against float arithmetic: the conversions at the kernels'
// edges.
//
// With narrow storage the kernels' arithmetic is exactly the float kernels' on the widened values
// (bf16 -> float and fp16 -> float are exact): caller tensors are widened while packing the tile
// products' operands, which the float kernels pack anyway (key tiles, the backward's Q and dO
// rows), except where float reads them in place: the forward's Q (packed once per query block) and
// decode-sized blocks' K and V rows (copied in row order, so the few-rows products keep their
// arithmetic); results are accumulated in float buffers and rounded to the storage type (to
// nearest, ties to even) once, when written to the caller's tensors. So a bf16 or fp16 result is
// the float kernels' result on the same inputs, rounded once.
#include <Eigen/Core>
#include <type_traits>

#include "../config.hpp"
#include "../tensor.hpp"

#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace dcmha::cpu {

/// Whether the vector path for storage type S <-> float is compiled in (the scalar loops, which
/// round as Eigen does, are the fallback): AVX for float, AVX2 for bf16, AVX2 with F16C for fp16.
template <class S>
inline constexpr bool kVectorStorage = false;
#if defined(__AVX__)
template <>
inline constexpr bool kVectorStorage<float> = true;
inline __m256 load8_widened(const float* p) { return _mm256_loadu_ps(p); }
inline void store8_narrowed(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
#endif

#if defined(__AVX2__)
template <>
inline constexpr bool kVectorStorage<bf16> = true;

/// Eight bf16 values widened to float: a bf16 is the upper half of the float's bits.
inline __m256 load8_widened(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/// Eight floats rounded to bf16 as Eigen's bfloat16(float) rounds them (to nearest, ties to even;
/// a NaN keeps its sign and becomes the quiet NaN 0x7fc0), so that results do not depend on
/// which path wrote them.
inline void store8_narrowed(bf16* p, __m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32(int(0x80000000u))),
                                      _mm256_set1_epi32(0x7fc00000));
  r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  r = _mm256_srli_epi32(r, 16);
  // packus packs within 128-bit lanes: [r0..3 r0..3 | r4..7 r4..7]; qwords 0 and 2 hold the result.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

#if defined(__AVX512F__)
/// Sixteen bf16 values widened to float.
inline __m512 load16_widened(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  // the zero-masking form: GCC 12 warns of the unmasked one's undefined source (bug 105593)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
template <>
inline constexpr bool kVectorStorage<half> = true;

/// Eight fp16 values widened to float (exact).
inline __m256 load8_widened(const half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

/// Eight floats rounded to fp16 to nearest, ties to even: the instruction Eigen's half(float)
/// uses when F16C is compiled in, so that results do not depend on which path wrote them.
inline void store8_narrowed(half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

#if defined(__AVX512F__)
/// Sixteen fp16 values widened to float (exact).
inline __m512 load16_widened(const half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#endif

/// dst[e] = alpha * src[e] in the accumulator type A, for e < n.
template <class A, class S>
inline void widen_row(const S* src, A* dst, index_t n, A alpha) {
  index_t e = 0;
#if defined(__AVX512F__)
  // 16 at a time: decode widens every cached K and V row it reads this way.
  if constexpr (kVectorStorage<S> && std::is_same_v<A, float> && !std::is_same_v<S, float>) {
    if (alpha == A(1))
      for (; e + 16 <= n; e += 16) _mm512_storeu_ps(dst + e, load16_widened(src + e));
  }
#endif
#if defined(__AVX__)
  if constexpr (kVectorStorage<S> && std::is_same_v<A, float>) {
    const __m256 s = _mm256_set1_ps(alpha);
    for (; e + 8 <= n; e += 8) _mm256_storeu_ps(dst + e, _mm256_mul_ps(load8_widened(src + e), s));
  }
#endif
  for (; e < n; ++e) dst[e] = alpha * A(src[e]);
}

/// dst[e] = S(src[e]) for e < n: a result row written to the caller's tensor.
template <class S, class A>
inline void narrow_row(const A* src, S* dst, index_t n) {
  index_t e = 0;
#if defined(__AVX__)
  if constexpr (kVectorStorage<S> && std::is_same_v<A, float>)
    for (; e + 8 <= n; e += 8) store8_narrowed(dst + e, _mm256_loadu_ps(src + e));
#endif
  for (; e < n; ++e) dst[e] = S(src[e]);
}

}  // namespace dcmha::cpu

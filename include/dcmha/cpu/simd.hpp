#pragma once
// Portable fixed-width vectors (GCC/Clang vector extensions) as wide as the enabled ISA.
#include <cstring>
#include <type_traits>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "compose.hpp"  // kVectorBytes

#if defined(__GNUC__)
#define DCMHA_HAS_VECTOR_EXTENSIONS 1

namespace dcmha::cpu {

template <class A>
struct Simd;
template <>
struct Simd<float> {
  typedef float V __attribute__((vector_size(kVectorBytes)));
  static constexpr int L = kVectorBytes / 4;
};
template <>
struct Simd<double> {
  typedef double V __attribute__((vector_size(kVectorBytes)));
  static constexpr int L = kVectorBytes / 8;
};

/// a * b + c, rounded once where the target has FMA (as the vector loops' multiply-adds are
/// contracted), twice otherwise. Spelled out for the scalar tails of loops that read float or
/// narrow storage: GCC contracts `s += x * y` for one element type and not for another, and the
/// narrow kernels must compute exactly what the float kernels compute on the same values.
template <class A>
inline A multiply_add(A a, A b, A c) {
#if defined(__FMA__)
  if constexpr (std::is_same_v<A, float>) return __builtin_fmaf(a, b, c);
  if constexpr (std::is_same_v<A, double>) return __builtin_fma(a, b, c);
#endif
  return a * b + c;
}

#if defined(__FMA__)
/// One fused multiply-add per native vector type, so that vmultiply_add names the
/// instruction once and only chooses the type.
inline __m128 fused_multiply_add(__m128 a, __m128 b, __m128 c) { return _mm_fmadd_ps(a, b, c); }
inline __m128d fused_multiply_add(__m128d a, __m128d b, __m128d c) { return _mm_fmadd_pd(a, b, c); }
inline __m256 fused_multiply_add(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256d fused_multiply_add(__m256d a, __m256d b, __m256d c) {
  return _mm256_fmadd_pd(a, b, c);
}
#if defined(__AVX512F__)
inline __m512 fused_multiply_add(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512d fused_multiply_add(__m512d a, __m512d b, __m512d c) {
  return _mm512_fmadd_pd(a, b, c);
}
constexpr std::size_t kWidestNativeBytes = 64;
#else
constexpr std::size_t kWidestNativeBytes = 32;
#endif
#endif  // __FMA__

/// acc + a * b lane by lane, rounded once where the target has FMA: the vector loops that read
/// float or narrow storage spell it out, since whether GCC contracts `acc += a * b` depends on
/// the vector width and the target (AVX2 contracts one instantiation and not the other), and
/// the narrow kernels must compute exactly what the float kernels compute on the same values.
/// A vector wider than the target's (64 bytes on AVX2) goes in native pieces.
template <class V>
inline V vmultiply_add(const V& a, const V& b, const V& acc) {
#if defined(__FMA__)
  if constexpr (sizeof(V) % 16 == 0) {
    using E = std::decay_t<decltype(a[0])>;
    constexpr std::size_t piece = sizeof(V) % kWidestNativeBytes == 0 ? kWidestNativeBytes
                                  : sizeof(V) % 32 == 0               ? 32
                                                                      : 16;
    typedef E N __attribute__((vector_size(piece)));  // the native type, as the overloads take
    // By value where one piece is the whole vector: the pieces' copies through memory keep
    // GCC from holding a product's accumulators in registers (half the speed on AVX2).
    if constexpr (piece == sizeof(V)) return fused_multiply_add(N(a), N(b), N(acc));
    V r;
    for (std::size_t h = 0; h < sizeof(V); h += piece) {
      N x, y, z;
      std::memcpy(&x, reinterpret_cast<const char*>(&a) + h, piece);
      std::memcpy(&y, reinterpret_cast<const char*>(&b) + h, piece);
      std::memcpy(&z, reinterpret_cast<const char*>(&acc) + h, piece);
      x = fused_multiply_add(x, y, z);
      std::memcpy(reinterpret_cast<char*>(&r) + h, &x, piece);
    }
    return r;
  }
#endif
  return acc + a * b;
}

template <class A>
inline typename Simd<A>::V vload(const A* p) {
  typename Simd<A>::V v;
  std::memcpy(&v, p, sizeof(v));  // unaligned; compiles to one vector load
  return v;
}
template <class A>
inline void vstore(A* p, const typename Simd<A>::V& v) {
  std::memcpy(p, &v, sizeof(v));
}

/// out[k] += the sum of vector k's lanes, for `count` vectors at v (k-th at v + k * L).
/// Groups of eight float vectors go through a transposing reduction (eight sums per group in
/// about ten shuffles and adds instead of eight horizontal reductions); 16-float vectors are
/// first folded to eight lanes.
template <class A>
inline void add_lane_sums(const A* v, index_t count, A* out) {
  constexpr int L = Simd<A>::L;
  index_t k = 0;
#if defined(__AVX__)
  if constexpr (std::is_same_v<A, float> && (L == 8 || L == 16)) {
    for (; k + 8 <= count; k += 8) {
      __m256 x[8];
      for (int i = 0; i < 8; ++i) {
        const float* p = v + (k + i) * L;
        // A 16-float vector as two 8-float halves loaded apart: the same work as a 512-bit load
        // and an extract, without GCC 12.2's -Wmaybe-uninitialized false positive on the
        // extract intrinsics (their _mm256_undefined_pd), and the same code under
        // DCMHA_VECTOR_BYTES=64 on AVX2.
        x[i] =
            L == 8 ? _mm256_loadu_ps(p) : _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
      }
      // hadd pairs twice: lane half h of b0 holds the four sums of x0..x3's half h, b1 of x4..x7.
      const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
      const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(x[4], x[5]), _mm256_hadd_ps(x[6], x[7]));
      const __m256 s =
          _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
      _mm256_storeu_ps(out + k, _mm256_add_ps(_mm256_loadu_ps(out + k), s));
    }
  }
#endif
  for (; k < count; ++k) {
    A sum = 0;
    for (int l = 0; l < L; ++l) sum += v[k * L + l];
    out[k] += sum;
  }
}

#if defined(__AVX__)
/// col[l] = lane l of r[0..7]: an 8 x 8 float transpose in 24 shuffles.
inline void transpose8x8(const __m256 (&r)[8], __m256 (&col)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0x44);
      u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], 0xEE);
    }
  // u[0..3]: columns 0,1,2,3 in the low 128-bit lane and 4,5,6,7 in the high one, rows 0-3 in
  // u[q] and rows 4-7 in u[4 + q]; recombine the lanes.
  for (int q = 0; q < 4; ++q) {
    col[q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x20);
    col[4 + q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x31);
  }
}

/// The lane sums of eight float vectors, each vector's lanes added one by one in lane order from
/// zero: the order of a scalar loop `s += v[k][l]`, for eight vectors at once (bitwise the same
/// sums, at a fraction of the dependent adds). V: 8 or 16 floats.
template <class V>
inline __m256 ordered_lane_sums8(const V (&v)[8]) {
  constexpr int L = int(sizeof(V) / sizeof(float));
  static_assert(L % 8 == 0, "whole 8-lane halves");
  __m256 sums = _mm256_setzero_ps();
  for (int h = 0; h < L; h += 8) {
    __m256 r[8], col[8];
    for (int k = 0; k < 8; ++k)
      std::memcpy(&r[k], reinterpret_cast<const char*>(&v[k]) + h * sizeof(float), sizeof r[k]);
    transpose8x8(r, col);
    for (int l = 0; l < 8; ++l) sums = _mm256_add_ps(sums, col[l]);
  }
  return sums;
}
#endif

}  // namespace dcmha::cpu
#endif

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

}  // namespace dcmha::cpu
#endif

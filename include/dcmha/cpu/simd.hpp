#pragma once
// Portable fixed-width vectors (GCC/Clang vector extensions) as wide as the enabled ISA.
#include <cstring>

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

}  // namespace dcmha::cpu
#endif

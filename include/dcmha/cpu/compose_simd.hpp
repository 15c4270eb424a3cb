#pragma once
// Register-blocked Compose for the common case: no static W, ranks up to 3.
//
// compose_chunk (compose.hpp) keeps its hidden vectors in L1 scratch, so every multiply-add
// also loads and stores its accumulator. Here the 2R hidden vectors of one 32-byte column
// block stay in registers while the M heads stream through: per head and column block two
// passes of a few fused multiply-adds, instead of load-FMA-store chains. The ranks are template
// parameters so the accumulators are plain register variables.
#include <cstring>

#include "compose.hpp"

namespace dcmha::cpu {

#if defined(__GNUC__)
#define DCMHA_HAS_VECTOR_EXTENSIONS 1

template <class A>
struct Simd;
template <>
struct Simd<float> {
  typedef float V __attribute__((vector_size(32)));
  static constexpr int L = 8;
};
template <>
struct Simd<double> {
  typedef double V __attribute__((vector_size(32)));
  static constexpr int L = 4;
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

/// Compose on one row chunk like compose_chunk, for sides without static W and with Rq, Rk equal
/// to the template ranks (0 = term off). Column blocks of Simd<A>::L keys; the tail goes through
/// compose_chunk. in_scale (per head, or null) multiplies the input first: the forward folds the
/// softmax normalization 1/l into Compose_post this way instead of sweeping the panel once more.
template <class A, int RQ, int RK>
void compose_chunk_registers(const ComposeSide<A>& c, const ComposeRow<A>& q, index_t s, int n,
                             const A* src, index_t src_hs, A* dst, index_t dst_hs,
                             const A* in_scale, A* scratch) {
  using V = typename Simd<A>::V;
  constexpr int L = Simd<A>::L;
  const index_t M = c.M, ld = c.ld;
  const A* kw1 = RK ? c.kw1.data() + s : nullptr;
  const A* kw2 = RK ? c.kw2.data() + s : nullptr;
  const A* kdd = RK ? c.kdd.data() + s : nullptr;
  int j = 0;
  for (; j + L <= n; j += L) {
    V qh[RQ > 0 ? RQ : 1] = {}, kh[RK > 0 ? RK : 1] = {};
    for (index_t m = 0; m < M; ++m) {
      V a = vload(src + m * src_hs + j);
      if (in_scale) a *= in_scale[m];
      for (int r = 0; r < RQ; ++r) qh[r] += a * q.qw1[r * M + m];
      for (int r = 0; r < RK; ++r) kh[r] += a * vload(kw1 + (r * M + m) * ld + j);
    }
    for (index_t o = 0; o < M; ++o) {
      V a = vload(src + o * src_hs + j);
      if (in_scale) a *= in_scale[o];
      V gate = V{} + (A(1) + (RQ ? q.qdd[o] : A(0)));
      if (RK) gate += vload(kdd + o * ld + j);
      V d = a * gate;
      for (int r = 0; r < RQ; ++r) d += qh[r] * q.qw2[r * M + o];
      for (int r = 0; r < RK; ++r) d += kh[r] * vload(kw2 + (r * M + o) * ld + j);
      vstore(dst + o * dst_hs + j, d);
    }
  }
  if (j < n) {
    if (in_scale) {
      // The tail is narrower than a vector: scale a copy so the generic path sees P, not e.
      A* tmp = scratch + c.scratch_size() - M * kChunk;
      for (index_t m = 0; m < M; ++m)
        for (int i = j; i < n; ++i) tmp[m * kChunk + (i - j)] = src[m * src_hs + i] * in_scale[m];
      compose_chunk(c, q, s + j, n - j, tmp, kChunk, dst + j, dst_hs, scratch);
    } else {
      compose_chunk(c, q, s + j, n - j, src + j, src_hs, dst + j, dst_hs, scratch);
    }
  }
}
#endif

/// Compose on one row chunk with the fastest path the side allows; see compose_chunk.
template <class A>
struct ComposeFn {
  using Fn = void (*)(const ComposeSide<A>&, const ComposeRow<A>&, index_t, int, const A*, index_t,
                      A*, index_t, const A*, A*);
  Fn fn = nullptr;

  explicit ComposeFn(const ComposeSide<A>& c) {
#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
    if (!c.has_w && c.Rq <= 3 && c.Rk <= 3) fn = table[c.Rq][c.Rk];
#endif
    if (!fn) fn = &generic;
  }
  void operator()(const ComposeSide<A>& c, const ComposeRow<A>& q, index_t s, int n, const A* src,
                  index_t src_hs, A* dst, index_t dst_hs, const A* in_scale, A* scratch) const {
    fn(c, q, s, n, src, src_hs, dst, dst_hs, in_scale, scratch);
  }

 private:
  static void generic(const ComposeSide<A>& c, const ComposeRow<A>& q, index_t s, int n,
                      const A* src, index_t src_hs, A* dst, index_t dst_hs, const A* in_scale,
                      A* scratch) {
    if (!in_scale) return compose_chunk(c, q, s, n, src, src_hs, dst, dst_hs, scratch);
    A* tmp = scratch + c.scratch_size() - c.M * kChunk;
    for (index_t m = 0; m < c.M; ++m)
      for (int i = 0; i < n; ++i) tmp[m * kChunk + i] = src[m * src_hs + i] * in_scale[m];
    compose_chunk(c, q, s, n, tmp, kChunk, dst, dst_hs, scratch);
  }
#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
  static constexpr Fn table[4][4] = {
      {&compose_chunk_registers<A, 0, 0>, &compose_chunk_registers<A, 0, 1>,
       &compose_chunk_registers<A, 0, 2>, &compose_chunk_registers<A, 0, 3>},
      {&compose_chunk_registers<A, 1, 0>, &compose_chunk_registers<A, 1, 1>,
       &compose_chunk_registers<A, 1, 2>, &compose_chunk_registers<A, 1, 3>},
      {&compose_chunk_registers<A, 2, 0>, &compose_chunk_registers<A, 2, 1>,
       &compose_chunk_registers<A, 2, 2>, &compose_chunk_registers<A, 2, 3>},
      {&compose_chunk_registers<A, 3, 0>, &compose_chunk_registers<A, 3, 1>,
       &compose_chunk_registers<A, 3, 2>, &compose_chunk_registers<A, 3, 3>}};
#endif
};

}  // namespace dcmha::cpu

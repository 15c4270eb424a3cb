#pragma once
// Register-blocked Compose for the common case: no static W, ranks up to 3.
//
// compose_chunk (compose.hpp) keeps its hidden vectors in L1 scratch, so every multiply-add
// also loads and stores its accumulator. Here the 2R hidden vectors of one column
// block stay in registers while the M heads stream through: per head and column block two
// passes of a few fused multiply-adds, instead of load-FMA-store chains. The ranks are template
// parameters so the accumulators are plain register variables.
#include <algorithm>
#include <cstring>
#include <utility>

#include "compose.hpp"
#include "simd.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

#if defined(DCMHA_HAS_VECTOR_EXTENSIONS)

/// One row's query-wise terms and the key-wise terms from key s on, as plain pointers held by
/// value: the kernels' stores go through memcpy, which may alias anything, so members read
/// through KernelComposeTerms and ComposeRow would be reloaded after every store.
template <class A>
struct TermPointers {
  const A *qw1, *qw2, *qdd, *kw1, *kw2, *kdd;
  TermPointers(const KernelComposeTerms<A>& c, const ComposeRow<A>& q, index_t s)
      : qw1(q.qw1.data()),
        qw2(q.qw2.data()),
        qdd(q.qdd.data()),
        kw1(c.has_k ? c.k1 + s : nullptr),
        kw2(c.has_k ? c.k2 + s : nullptr),
        kdd(c.has_k ? c.kd + s : nullptr) {}
};

/// JB column vectors from column j of compose_chunk_registers. Each hidden accumulator gets one
/// multiply-add per head, so with one vector the first loop would wait on the multiply-add latency
/// (four chains, 4 cycles per head); JB vectors give JB times the independent chains.
/// `next`: the next row's src (null for none), whose same columns are asked for head by head.
template <class A, int RQ, int RK, int JB>
inline void compose_columns(index_t M, index_t ld, TermPointers<A> t, index_t j, const A* src,
                            index_t src_hs, A* dst, index_t dst_hs, const A* in_scale,
                            const A* next) {
  using V = typename Simd<A>::V;
  constexpr int L = Simd<A>::L;
  const A *qw1 = t.qw1, *qw2 = t.qw2, *qdd = t.qdd, *kw1 = t.kw1, *kw2 = t.kw2, *kdd = t.kdd;
  V qh[RQ > 0 ? RQ : 1][JB] = {}, kh[RK > 0 ? RK : 1][JB] = {};
  for (index_t m = 0; m < M; ++m) {
    V a[JB];
    if (next) prefetch_bytes(next + m * src_hs + j, JB * L * index_t(sizeof(A)));
    for (int b = 0; b < JB; ++b) a[b] = vload(src + m * src_hs + j + b * L);
    if (in_scale)
      for (int b = 0; b < JB; ++b) a[b] *= in_scale[m];
    for (int r = 0; r < RQ; ++r)
      for (int b = 0; b < JB; ++b) qh[r][b] += a[b] * qw1[r * M + m];
    for (int r = 0; r < RK; ++r)
      for (int b = 0; b < JB; ++b) kh[r][b] += a[b] * vload(kw1 + (r * M + m) * ld + j + b * L);
  }
  for (index_t o = 0; o < M; ++o) {
    const A gq = A(1) + (RQ ? qdd[o] : A(0));
    for (int b = 0; b < JB; ++b) {
      V a = vload(src + o * src_hs + j + b * L);
      if (in_scale) a *= in_scale[o];
      V gate = V{} + gq;
      if (RK) gate += vload(kdd + o * ld + j + b * L);
      V d = a * gate;
      for (int r = 0; r < RQ; ++r) d += qh[r][b] * qw2[r * M + o];
      for (int r = 0; r < RK; ++r) d += kh[r][b] * vload(kw2 + (r * M + o) * ld + j + b * L);
      vstore(dst + o * dst_hs + j + b * L, d);
    }
  }
}

/// Compose on one row chunk like compose_chunk, for sides without static W and with Rq, Rk equal
/// to the template ranks (0 = term off). Column blocks of Simd<A>::L keys; the tail goes through
/// compose_chunk. in_scale (per head, or null) multiplies the input first: the forward folds the
/// softmax normalization 1/l into Compose_post this way instead of sweeping the panel once more.
/// `next`: the next row's src (same layout, null for none), asked for a cache line per head as
/// this row reaches the same columns. The panels' rows come from L3 at M = 32 (a forward slab is 2
/// MiB); asking for all M lines of the next row at once, before the call, would stall on the
/// prefetch instructions themselves.
template <class A, int RQ, int RK>
void compose_chunk_registers(const KernelComposeTerms<A>& c, const ComposeRow<A>& q, index_t s,
                             int n, const A* src, index_t src_hs, A* dst, index_t dst_hs,
                             const A* in_scale, A* scratch, const A* next) {
  constexpr int L = Simd<A>::L;
  const index_t M = c.M, ld = c.ld;
  const TermPointers<A> t(c, q, s);
  int j = 0;
  for (; j + 2 * L <= n; j += 2 * L)
    compose_columns<A, RQ, RK, 2>(M, ld, t, j, src, src_hs, dst, dst_hs, in_scale, next);
  for (; j + L <= n; j += L)
    compose_columns<A, RQ, RK, 1>(M, ld, t, j, src, src_hs, dst, dst_hs, in_scale, next);
  if (j < n) {
    if (next) prefetch_rows(next + j, M, src_hs, (n - j) * index_t(sizeof(A)));
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

/// compose_chunk_backward for sides without static W and with Rq, Rk equal to the template ranks.
/// Per column block: the hidden vectors first (loop over heads), then each head's input gradient
/// and weight gradients with those vectors in registers. The query-wise gradients are summed per
/// head as lane vectors in L1 scratch and reduced into sinks.row once per call: per-row lane
/// accumulators (5 KiB a row at M = 32, Rq = 2) for a block's rows would not stay in cache, and
/// the post side's transpose would wait on them. Column blocks outer instead of heads outer keeps
/// the hidden vectors in registers rather than on the stack. `next`: the next row of one of the
/// inputs (head stride next_hs, null for none), asked for a line per head as this row reaches the
/// same columns (compose_chunk_registers).
template <class A, int RQ, int RK>
void compose_chunk_backward_registers(const KernelComposeTerms<A>& c, const ComposeRow<A>& q,
                                      const ComposeGradChunk<A>& x,
                                      const ComposeGradSinks<A>& sinks) {
  const index_t s = x.s, a_hs = x.input_hs, out_grad_hs = x.out_grad_hs, in_grad_hs = x.in_grad_hs;
  const index_t next_hs = x.next_hs;
  const int n = x.n;
  const A *a = x.input, *out_grad = x.out_grad, *next = x.next;
  A* in_grad = x.in_grad;
  ComposeKeyGrads<A>& kg = sinks.key;
  A* scratch = sinks.scratch;
  using V = typename Simd<A>::V;
  constexpr int L = Simd<A>::L;
  constexpr int RQ1 = RQ > 0 ? RQ : 1, RK1 = RK > 0 ? RK : 1;
  const index_t M = c.M, ld = c.ld;
  const int nb = n / L;
  const TermPointers<A> t(c, q, s);
  const A *qw1 = t.qw1, *qw2 = t.qw2, *qdd = t.qdd, *k1 = t.kw1, *k2 = t.kw2, *kd = t.kdd;
  // The gradients' pointers likewise.
  A* dk1 = RK ? kg.kw1.data() + s : nullptr;
  A* dk2 = RK ? kg.kw2.data() + s : nullptr;
  A* dkd = RK ? kg.kdd.data() + s : nullptr;
  // Lane vectors of qw1 [r][m], qw2 [r][m], qdd [m]: ComposeRowGrads' order.
  A* lanes1 = scratch;
  A* lanes2 = lanes1 + RQ * M * L;
  A* lanes_dd = lanes2 + RQ * M * L;
  if (RQ && nb > 0) std::fill(lanes1, lanes1 + (2 * RQ + 1) * M * L, A(0));
  for (int jb = 0; jb < nb; ++jb) {
    const index_t j = jb * L;
    V hq[RQ1] = {}, eq[RQ1] = {}, hk[RK1] = {}, ek[RK1] = {};
    for (index_t m = 0; m < M; ++m) {
      if (next) prefetch_bytes(next + m * next_hs + j, L * index_t(sizeof(A)));
      const V av = vload(a + m * a_hs + j), gv = vload(out_grad + m * out_grad_hs + j);
      for (int r = 0; r < RQ; ++r) {
        hq[r] += av * qw1[r * M + m];
        eq[r] += gv * qw2[r * M + m];
      }
      for (int r = 0; r < RK; ++r) {
        hk[r] += av * vload(k1 + (r * M + m) * ld + j);
        ek[r] += gv * vload(k2 + (r * M + m) * ld + j);
      }
    }
    // in_grad may alias out_grad: block j of head m is read above and here before it is written.
    for (index_t m = 0; m < M; ++m) {
      const V av = vload(a + m * a_hs + j), gv = vload(out_grad + m * out_grad_hs + j);
      V out = gv * (A(1) + (RQ ? qdd[m] : A(0)));
      for (int r = 0; r < RQ; ++r) {
        A* l1 = lanes1 + (r * M + m) * L;
        A* l2 = lanes2 + (r * M + m) * L;
        vstore(l1, vload(l1) + av * eq[r]);
        vstore(l2, vload(l2) + hq[r] * gv);
        out += eq[r] * qw1[r * M + m];
      }
      if (RQ) vstore(lanes_dd + m * L, vload(lanes_dd + m * L) + av * gv);
      for (int r = 0; r < RK; ++r) {
        A* g1 = dk1 + (r * M + m) * ld + j;
        A* g2 = dk2 + (r * M + m) * ld + j;
        vstore(g1, vload(g1) + av * ek[r]);
        vstore(g2, vload(g2) + hk[r] * gv);
        out += ek[r] * vload(k1 + (r * M + m) * ld + j);
      }
      if (RK) {
        A* gd = dkd + m * ld + j;
        vstore(gd, vload(gd) + av * gv);
        out += gv * vload(kd + m * ld + j);
      }
      vstore(in_grad + m * in_grad_hs + j, out);
    }
  }
  if (RQ && nb > 0) add_lane_sums(lanes1, (2 * RQ + 1) * M, sinks.row.sums);
  const int j = nb * L;
  if (j < n) {
    if (next) prefetch_rows(next + j, M, next_hs, (n - j) * index_t(sizeof(A)));
    compose_chunk_backward(c, q, x.from(j), sinks);
  }
}
#endif

#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
/// The register-blocked kernel for ranks rq, rk <= 3: pick(integral_constant<int, RQ>,
/// integral_constant<int, RK>) names the instance, for each of the 16 pairs.
template <class Fn, class Pick, int... Pair>
Fn ranked_kernel(index_t rq, index_t rk, Pick pick, std::integer_sequence<int, Pair...>) {
  const Fn instances[] = {
      pick(std::integral_constant<int, Pair / 4>{}, std::integral_constant<int, Pair % 4>{})...};
  return instances[rq * 4 + rk];
}
template <class Fn, class Pick>
Fn ranked_kernel(index_t rq, index_t rk, Pick pick) {
  return ranked_kernel<Fn>(rq, rk, pick, std::make_integer_sequence<int, 16>{});
}
#endif

/// compose_chunk_backward with the fastest path the side allows.
template <class A>
struct ComposeBackwardFn {
  using Fn = void (*)(const KernelComposeTerms<A>&, const ComposeRow<A>&,
                      const ComposeGradChunk<A>&, const ComposeGradSinks<A>&);
  Fn fn = &generic;

  explicit ComposeBackwardFn(const KernelComposeTerms<A>& c) {
#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
    if (!c.has_w && c.Rq <= 3 && c.Rk <= 3)
      fn = ranked_kernel<Fn>(c.Rq, c.Rk, [](auto rq, auto rk) -> Fn {
        return &compose_chunk_backward_registers<A, decltype(rq)::value, decltype(rk)::value>;
      });
#else
    (void)c;
#endif
  }
  void operator()(const KernelComposeTerms<A>& c, const ComposeRow<A>& q,
                  const ComposeGradChunk<A>& x, const ComposeGradSinks<A>& sinks) const {
    fn(c, q, x, sinks);
  }

 private:
  static void generic(const KernelComposeTerms<A>& c, const ComposeRow<A>& q,
                      const ComposeGradChunk<A>& x, const ComposeGradSinks<A>& sinks) {
    if (x.next) prefetch_rows(x.next, c.M, x.next_hs, x.n * index_t(sizeof(A)));
    compose_chunk_backward(c, q, x, sinks);
  }
};

/// Compose on one row chunk with the fastest path the side allows; see compose_chunk.
/// `next`: see compose_chunk_registers.
template <class A>
struct ComposeFn {
  using Fn = void (*)(const KernelComposeTerms<A>&, const ComposeRow<A>&, index_t, int, const A*,
                      index_t, A*, index_t, const A*, A*, const A*);
  Fn fn = nullptr;

  explicit ComposeFn(const KernelComposeTerms<A>& c) {
#ifdef DCMHA_HAS_VECTOR_EXTENSIONS
    if (!c.has_w && c.Rq <= 3 && c.Rk <= 3)
      fn = ranked_kernel<Fn>(c.Rq, c.Rk, [](auto rq, auto rk) -> Fn {
        return &compose_chunk_registers<A, decltype(rq)::value, decltype(rk)::value>;
      });
#endif
    if (!fn) fn = &generic;
  }
  void operator()(const KernelComposeTerms<A>& c, const ComposeRow<A>& q, index_t s, int n,
                  const A* src, index_t src_hs, A* dst, index_t dst_hs, const A* in_scale,
                  A* scratch, const A* next) const {
    fn(c, q, s, n, src, src_hs, dst, dst_hs, in_scale, scratch, next);
  }

 private:
  static void generic(const KernelComposeTerms<A>& c, const ComposeRow<A>& q, index_t s, int n,
                      const A* src, index_t src_hs, A* dst, index_t dst_hs, const A* in_scale,
                      A* scratch, const A* next) {
    if (next) prefetch_rows(next, c.M, src_hs, n * index_t(sizeof(A)));
    if (!in_scale) return compose_chunk(c, q, s, n, src, src_hs, dst, dst_hs, scratch);
    A* tmp = scratch + c.scratch_size() - c.M * kChunk;
    for (index_t m = 0; m < c.M; ++m)
      for (int i = 0; i < n; ++i) tmp[m * kChunk + i] = src[m * src_hs + i] * in_scale[m];
    compose_chunk(c, q, s, n, tmp, kChunk, dst, dst_hs, scratch);
  }
};

}  // namespace dcmha::cpu

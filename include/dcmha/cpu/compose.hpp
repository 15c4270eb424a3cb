#pragma once
// Compose (spec section 1) on chunks of score / probability rows, and its transpose.
//
// The kernels keep, for one query block, a panel [head m][row t][key s] of one group's M heads.
// Compose mixes the M values at one (t, s), so it runs on a row chunk: M vectors of n <= kChunk
// consecutive keys, one per head. Everything that depends on s (the key-wise terms) is held
// transposed as [r][m][s] so that a chunk reads contiguous memory; everything that depends only
// on t (the query-wise terms) is a handful of scalars per row.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/compose_terms.hpp"
#include "../compose_weights.hpp"
#include "../params.hpp"
#include "../tensor.hpp"
#include "convert.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

/// Keys per compose chunk: the chunk's key-wise terms ((2Rk + 1)·M·kChunk values) and its hidden
/// vectors stay in L1 while the chunk is applied to every row of a query block.
constexpr int kChunk = 32;

/// Calls f(s, n, i) for each chunk [s, s + n) of keys [cs, ce), kChunk keys at a time, and each
/// row i of [lo, hi): chunks outer, so that a chunk's key-wise terms stay in L1 while every row
/// of a query block uses them. The loop every Compose pass of the kernels runs.
template <class F>
inline void for_each_row_chunk(index_t cs, index_t ce, index_t lo, index_t hi, F&& f) {
  for (index_t s = cs; s < ce; s += kChunk) {
    const int n = int(std::min<index_t>(kChunk, ce - s));
    for (index_t i = lo; i < hi; ++i) f(s, n, i);
  }
}

/// Bytes per vector of the register-blocked kernels (compose_simd.hpp, gemm.hpp): the widest the
/// compiler was told it may use, so no vector crosses a function boundary in a wider ABI than
/// enabled. DCMHA_VECTOR_BYTES overrides it for testing: 64 on an AVX2 machine runs the code
/// paths of an AVX-512 build (16-float blocks, tails, 4-vector product strips), each vector
/// split in two by the compiler, so a machine without AVX-512 can check them.
#if defined(DCMHA_VECTOR_BYTES)
constexpr int kVectorBytes = DCMHA_VECTOR_BYTES;
static_assert(kVectorBytes == 16 || kVectorBytes == 32 || kVectorBytes == 64,
              "DCMHA_VECTOR_BYTES must be 16, 32 or 64");
#elif defined(__AVX512F__)
constexpr int kVectorBytes = 64;
#elif defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif

/// One side's compose inputs for one (b, g) in kernel layout.
template <class A>
struct KernelComposeTerms {
  bool on = false, has_w = false, has_q = false, has_k = false;
  bool borrowed = false;  // key-wise terms read in place from the caller's tensors
  index_t M = 0, Rq = 0, Rk = 0, ld = 0;
  Buffer<A> w;         // [m][n]
  Buffer<A> kw1, kw2;  // [r][m][ld], unless borrowed
  Buffer<A> kdd;       // [m][ld], unless borrowed
  // What the kernels read: the buffers above, or the caller's memory when it is already laid out
  // [r][m][s] with keys contiguous (the decode cache is): then nothing is copied per call.
  const A* k1 = nullptr;
  const A* k2 = nullptr;
  const A* kd = nullptr;

  /// `in_place_ok`: the caller's key positions are the kernel's (no ring buffer), so a matching
  /// layout may be read in place.
  template <class T>
  void init(const ComposeTerms<T>& c, index_t M_, index_t S, bool in_place_ok = false) {
    const detail::ComposeTermSet terms = detail::ComposeTermSet::of(c);
    on = terms.enabled();
    has_w = terms.static_w;
    has_q = terms.query_wise;
    has_k = terms.key_wise;
    M = M_;
    Rq = terms.query_rank;
    Rk = terms.key_rank;
    ld = S;
    if (has_w) w.assign(M * M, A(0));
    borrowed = false;
    if (has_k && in_place_ok && std::is_same_v<A, T> && kernel_layout(c)) {
      borrowed = true;
      ld = c.kdd.stride[3];
    } else if (has_k) {
      kw1.assign(Rk * M * ld, A(0));
      kw2.assign(Rk * M * ld, A(0));
      kdd.assign(M * ld, A(0));
      k1 = kw1.data();
      k2 = kw2.data();
      kd = kdd.data();
    }
  }

  /// Loads group g of batch b; key-wise terms for keys [s0, s1) only, so threads can share the
  /// work. What is not per key is written by the one caller whose non-empty share starts at key 0
  /// (with fewer keys than threads, several shares are empty and start there too).
  template <class T>
  void load(const ComposeTerms<T>& c, index_t b, index_t g, index_t s0, index_t s1,
            const detail::KeyRing& ring = {}) {
    const bool first = s0 == 0 && s1 > s0;
    if (has_w && first)
      for (index_t m = 0; m < M; ++m)
        for (index_t n = 0; n < M; ++n) w[m * M + n] = A(c.w(g, m, n));
    if (borrowed) {
      if constexpr (std::is_same_v<A, T>) {
        if (first) {  // one writer; the team syncs after load
          k1 = c.kw1.data + b * c.kw1.stride[0] + g * c.kw1.stride[2];
          k2 = c.kw2.data + b * c.kw2.stride[0] + g * c.kw2.stride[2];
          kd = c.kdd.data + b * c.kdd.stride[0] + g * c.kdd.stride[2];
        }
      }
      return;
    }
    if (has_k && ring.capacity == 0 && kernel_layout(c)) {
      // A narrow decode cache: each (r, m) row of keys is contiguous, widened as one run.
      const T* k1 = c.kw1.data + b * c.kw1.stride[0] + g * c.kw1.stride[2];
      const T* k2 = c.kw2.data + b * c.kw2.stride[0] + g * c.kw2.stride[2];
      const T* kd = c.kdd.data + b * c.kdd.stride[0] + g * c.kdd.stride[2];
      const index_t l = c.kdd.stride[3], n = s1 - s0;
      for (index_t row = 0; row < Rk * M; ++row) {
        widen_row(k1 + row * l + s0, kw1.data() + row * ld + s0, n, A(1));
        widen_row(k2 + row * l + s0, kw2.data() + row * ld + s0, n, A(1));
      }
      for (index_t m = 0; m < M; ++m) widen_row(kd + m * l + s0, kdd.data() + m * ld + s0, n, A(1));
      return;
    }
    if (has_k)
      for (index_t s = s0; s < s1; ++s) {
        // Plain pointer walks: this gather runs for every key of every decode step.
        const index_t p = ring.slot(b, s);
        const T* k1s = c.kw1.data + b * c.kw1.stride[0] + p * c.kw1.stride[1] + g * c.kw1.stride[2];
        const T* k2s = c.kw2.data + b * c.kw2.stride[0] + p * c.kw2.stride[1] + g * c.kw2.stride[2];
        const T* kds = c.kdd.data + b * c.kdd.stride[0] + p * c.kdd.stride[1] + g * c.kdd.stride[2];
        for (index_t r = 0; r < Rk; ++r)
          for (index_t m = 0; m < M; ++m) {
            kw1[(r * M + m) * ld + s] = A(k1s[r * c.kw1.stride[3] + m * c.kw1.stride[4]]);
            kw2[(r * M + m) * ld + s] = A(k2s[r * c.kw2.stride[3] + m * c.kw2.stride[4]]);
          }
        for (index_t m = 0; m < M; ++m) kdd[m * ld + s] = A(kds[m * c.kdd.stride[3]]);
      }
  }

 private:
  /// kw1 / kw2 element (b, s, g, r, m) at (r * M + m) * ld + s from the (b, g) origin, kdd (b, s,
  /// g, m) at m * ld + s, one ld for all three.
  template <class T>
  bool kernel_layout(const ComposeTerms<T>& c) const {
    const index_t l = c.kdd.stride[3];
    auto lowrank_ok = [&](const TensorView<const T, 5>& x) {
      return x.stride[1] == 1 && x.stride[4] == l && x.stride[3] == M * l;
    };
    return c.kdd.stride[1] == 1 && l >= c.kdd.shape[1] && lowrank_ok(c.kw1) && lowrank_ok(c.kw2);
  }

 public:
  /// Scratch a chunk needs: hidden vectors for every rank, one M x kChunk block for the static
  /// term and, last, one M x kChunk block where a scaled copy of the input may be staged; or the
  /// vectorized transpose's lane vectors of the query-wise gradients, if more.
  index_t scratch_size() const {
    const index_t lanes = (2 * Rq + 1) * M * index_t(kVectorBytes / sizeof(A));
    return std::max((2 * (Rq + Rk) + 2 * M) * kChunk, lanes);
  }
};

/// The query-wise terms of one row t.
template <class A>
struct ComposeRow {
  Buffer<A> qw1, qw2;  // [r][m]
  Buffer<A> qdd;       // [m]

  void init(const KernelComposeTerms<A>& side) {
    qw1.assign(side.Rq * side.M, A(0));
    qw2.assign(side.Rq * side.M, A(0));
    qdd.assign(side.M, A(0));
  }
  template <class T>
  void load(const KernelComposeTerms<A>& side, const ComposeTerms<T>& c, index_t b, index_t t,
            index_t g) {
    if (!side.has_q) return;
    for (index_t r = 0; r < side.Rq; ++r)
      for (index_t m = 0; m < side.M; ++m) {
        qw1[r * side.M + m] = A(c.qw1(b, t, g, r, m));
        qw2[r * side.M + m] = A(c.qw2(b, t, g, r, m));
      }
    for (index_t m = 0; m < side.M; ++m) qdd[m] = A(c.qdd(b, t, g, m));
  }
};

/// y[j] += x[j] * w for j < n: the generic Compose's one loop shape, with a scalar weight (the
/// query-wise and static terms) or one weight per key (the key-wise terms).
template <class A>
inline void add_scaled(A* y, const A* x, A w, int n) {
#pragma omp simd
  for (int j = 0; j < n; ++j) y[j] += x[j] * w;
}
template <class A>
inline void add_scaled(A* y, const A* x, const A* w, int n) {
#pragma omp simd
  for (int j = 0; j < n; ++j) y[j] += x[j] * w[j];
}

/// y[j] = x[j] * (gate + key_gate[j]) for j < n, or x[j] * gate without key-wise gates (null):
/// the gated identity term of Compose and of its transpose.
template <class A>
inline void set_gated(A* y, const A* x, A gate, const A* key_gate, int n) {
  if (key_gate) {
#pragma omp simd
    for (int j = 0; j < n; ++j) y[j] = x[j] * (gate + key_gate[j]);
  } else {
#pragma omp simd
    for (int j = 0; j < n; ++j) y[j] = x[j] * gate;
  }
}

/// dst[n][j] = Compose(src[:, j])_n for the n keys s .. s+n-1 of one row. src and dst hold head m
/// at src + m*src_hs (resp. dst + m*dst_hs) and may be the same memory.
template <class A>
inline void compose_chunk(const KernelComposeTerms<A>& c, const ComposeRow<A>& q, index_t s, int n,
                          const A* src, index_t src_hs, A* dst, index_t dst_hs, A* scratch) {
  const index_t M = c.M, Rq = c.Rq, Rk = c.Rk, ld = c.ld;
  A* qh = scratch;            // [Rq][kChunk]
  A* kh = qh + Rq * kChunk;   // [Rk][kChunk]
  A* mix = kh + Rk * kChunk;  // [M][kChunk], static term staged (dst may alias src)
  for (index_t i = 0; i < (Rq + Rk) * kChunk; ++i) qh[i] = A(0);
  for (index_t m = 0; m < M; ++m) {
    const A* a = src + m * src_hs;
    for (index_t r = 0; r < Rq; ++r) add_scaled(qh + r * kChunk, a, q.qw1[r * M + m], n);
    for (index_t r = 0; r < Rk; ++r) add_scaled(kh + r * kChunk, a, c.k1 + (r * M + m) * ld + s, n);
  }
  if (c.has_w) {
    for (index_t o = 0; o < M; ++o) {
      A* x = mix + o * kChunk;
      for (int j = 0; j < n; ++j) x[j] = A(0);
      for (index_t m = 0; m < M; ++m) add_scaled(x, src + m * src_hs, c.w[m * M + o], n);
    }
  }
  for (index_t o = 0; o < M; ++o) {
    A* d = dst + o * dst_hs;
    set_gated(d, src + o * src_hs, A(1) + (c.has_q ? q.qdd[o] : A(0)),
              c.has_k ? c.kd + o * ld + s : nullptr, n);
    for (index_t r = 0; r < Rq; ++r) add_scaled(d, qh + r * kChunk, q.qw2[r * M + o], n);
    for (index_t r = 0; r < Rk; ++r) add_scaled(d, kh + r * kChunk, c.k2 + (r * M + o) * ld + s, n);
    if (c.has_w) add_scaled(d, mix + o * kChunk, A(1), n);
  }
}

/// Gradient accumulators of one side's query-wise terms for one row (the backward keeps one per
/// row and key tile), a view of size() values owned by the caller: qw1 [r][m], then qw2 [r][m],
/// then qdd [m] (the order compose_chunk_backward_registers reduces its lane vectors in).
template <class A>
struct ComposeRowGrads {
  A* sums = nullptr;
  index_t n1 = 0;  // Rq * M
  index_t count = 0;
  static index_t size(const KernelComposeTerms<A>& c) { return c.has_q ? 2 * c.Rq * c.M + c.M : 0; }
  void init(const KernelComposeTerms<A>& c, A* memory) {
    n1 = c.Rq * c.M;
    count = size(c);
    sums = memory;
  }
  A* qw1() { return sums; }
  A* qw2() { return sums + n1; }
  A* qdd() { return sums + 2 * n1; }
  const A* qw1() const { return sums; }
  const A* qw2() const { return sums + n1; }
  const A* qdd() const { return sums + 2 * n1; }
};

/// Gradient accumulators of one side's key-wise terms for one (b, g), same layout as
/// KernelComposeTerms ([r][m][s]); each key is owned by one thread, so they are shared without
/// races.
template <class A>
struct ComposeKeyGrads {
  Buffer<A> kw1, kw2, kdd;
  void init(const KernelComposeTerms<A>& c) {
    kw1.assign(c.Rk * c.M * c.ld, A(0));
    kw2.assign(c.Rk * c.M * c.ld, A(0));
    kdd.assign(c.M * c.ld, A(0));
  }
};

/// One row chunk of the compose transpose: keys s .. s+n-1; head m of each operand at + m times
/// its head stride. `input`: Compose's input (L or P); `out_grad`: the gradient of its output;
/// `in_grad`: where the input's gradient goes (may alias out_grad). `next`: a row the caller
/// reads next (head stride next_hs), asked for ahead, or null.
template <class A>
struct ComposeGradChunk {
  index_t s = 0;
  int n = 0;
  const A* input = nullptr;
  index_t input_hs = 0;
  const A* out_grad = nullptr;
  index_t out_grad_hs = 0;
  A* in_grad = nullptr;
  index_t in_grad_hs = 0;
  const A* next = nullptr;
  index_t next_hs = 0;

  /// The same chunk from column j on (the first j keys done elsewhere).
  ComposeGradChunk from(int j) const {
    ComposeGradChunk x = *this;
    x.s += j;
    x.n -= j;
    x.input += j;
    x.out_grad += j;
    x.in_grad += j;
    if (x.next) x.next += j;
    return x;
  }
};

/// Where the transpose adds the weights' gradients: the row's query-wise ones, the key-wise ones
/// (at keys s .. s+n-1), the static one ([m][n], or null without W); and its scratch
/// (KernelComposeTerms::scratch_size() values).
template <class A>
struct ComposeGradSinks {
  ComposeRowGrads<A>& row;
  ComposeKeyGrads<A>& key;
  A* dw;
  A* scratch;
};

namespace detail_compose {

/// The transpose's per-chunk vectors, kChunk values per rank or head, carved from scratch.
template <class A>
struct TransposeVectors {
  A* qh;   // [Rq][kChunk]  sum_m a_m qw1_rm
  A* kh;   // [Rk][kChunk]  sum_m a_m kw1_rm
  A* gq;   // [Rq][kChunk]  sum_n qw2_rn out_grad_n
  A* gk;   // [Rk][kChunk]  sum_n kw2_rn out_grad_n
  A* mix;  // [M][kChunk]   static term staged (in_grad may alias out_grad)

  TransposeVectors(const KernelComposeTerms<A>& c, A* scratch)
      : qh(scratch),
        kh(qh + c.Rq * kChunk),
        gq(kh + c.Rk * kChunk),
        gk(gq + c.Rq * kChunk),
        mix(gk + c.Rk * kChunk) {}
};

template <class A>
inline void transpose_hidden(const KernelComposeTerms<A>& c, const ComposeRow<A>& q,
                             const ComposeGradChunk<A>& x, const TransposeVectors<A>& t) {
  const index_t M = c.M, Rq = c.Rq, Rk = c.Rk, ld = c.ld, s = x.s;
  const int n = x.n;
  for (index_t i = 0; i < 2 * (Rq + Rk) * kChunk; ++i) t.qh[i] = A(0);
  for (index_t m = 0; m < M; ++m) {
    const A* am = x.input + m * x.input_hs;
    const A* gm = x.out_grad + m * x.out_grad_hs;
    for (index_t r = 0; r < Rq; ++r) {
      const A w1 = q.qw1[r * M + m], w2 = q.qw2[r * M + m];
      A* h = t.qh + r * kChunk;
      A* e = t.gq + r * kChunk;
#pragma omp simd
      for (int j = 0; j < n; ++j) {
        h[j] += am[j] * w1;
        e[j] += gm[j] * w2;
      }
    }
    for (index_t r = 0; r < Rk; ++r) {
      const A* w1 = c.k1 + (r * M + m) * ld + s;
      const A* w2 = c.k2 + (r * M + m) * ld + s;
      A* h = t.kh + r * kChunk;
      A* e = t.gk + r * kChunk;
#pragma omp simd
      for (int j = 0; j < n; ++j) {
        h[j] += am[j] * w1[j];
        e[j] += gm[j] * w2[j];
      }
    }
  }
}

/// The low-rank terms' and gates' gradients of head m.
template <class A>
inline void transpose_weight_grads(const KernelComposeTerms<A>& c, const ComposeGradChunk<A>& x,
                                   const TransposeVectors<A>& t, const ComposeGradSinks<A>& out,
                                   index_t m) {
  const index_t M = c.M, ld = c.ld, s = x.s;
  const int n = x.n;
  const A* am = x.input + m * x.input_hs;
  const A* gm = x.out_grad + m * x.out_grad_hs;
  for (index_t r = 0; r < c.Rq; ++r) {
    const A* h = t.qh + r * kChunk;
    const A* e = t.gq + r * kChunk;
    A s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : s1, s2)
    for (int j = 0; j < n; ++j) {
      s1 += am[j] * e[j];  // d qw1[r][m]
      s2 += h[j] * gm[j];  // d qw2[r][m]
    }
    out.row.qw1()[r * M + m] += s1;
    out.row.qw2()[r * M + m] += s2;
  }
  for (index_t r = 0; r < c.Rk; ++r) {
    const A* h = t.kh + r * kChunk;
    const A* e = t.gk + r * kChunk;
    A* d1 = out.key.kw1.data() + (r * M + m) * ld + s;
    A* d2 = out.key.kw2.data() + (r * M + m) * ld + s;
#pragma omp simd
    for (int j = 0; j < n; ++j) {
      d1[j] += am[j] * e[j];
      d2[j] += h[j] * gm[j];
    }
  }
  if (c.has_q) {
    A sd = 0;
#pragma omp simd reduction(+ : sd)
    for (int j = 0; j < n; ++j) sd += am[j] * gm[j];
    out.row.qdd()[m] += sd;
  }
  if (c.has_k) {
    A* dd = out.key.kdd.data() + m * ld + s;
#pragma omp simd
    for (int j = 0; j < n; ++j) dd[j] += am[j] * gm[j];
  }
}

/// The static term's part of the input gradient, staged, and its weights' gradient.
template <class A>
inline void transpose_static(const KernelComposeTerms<A>& c, const ComposeGradChunk<A>& x,
                             const TransposeVectors<A>& t, A* dw) {
  const index_t M = c.M;
  const int n = x.n;
  for (index_t m = 0; m < M; ++m) {
    const A* am = x.input + m * x.input_hs;
    A* mixed = t.mix + m * kChunk;
    for (int j = 0; j < n; ++j) mixed[j] = A(0);
    for (index_t o = 0; o < M; ++o) {
      const A* go = x.out_grad + o * x.out_grad_hs;
      const A w = c.w[m * M + o];
      A sw = 0;
#pragma omp simd reduction(+ : sw)
      for (int j = 0; j < n; ++j) {
        mixed[j] += go[j] * w;
        sw += am[j] * go[j];
      }
      dw[m * M + o] += sw;
    }
  }
}

/// Head m's input gradient.
template <class A>
inline void transpose_input_grad(const KernelComposeTerms<A>& c, const ComposeRow<A>& q,
                                 const ComposeGradChunk<A>& x, const TransposeVectors<A>& t,
                                 index_t m) {
  const index_t M = c.M, ld = c.ld, s = x.s;
  const int n = x.n;
  A* out = x.in_grad + m * x.in_grad_hs;
  set_gated(out, x.out_grad + m * x.out_grad_hs, A(1) + (c.has_q ? q.qdd[m] : A(0)),
            c.has_k ? c.kd + m * ld + s : nullptr, n);
  for (index_t r = 0; r < c.Rq; ++r) add_scaled(out, t.gq + r * kChunk, q.qw1[r * M + m], n);
  for (index_t r = 0; r < c.Rk; ++r)
    add_scaled(out, t.gk + r * kChunk, c.k1 + (r * M + m) * ld + s, n);
  if (c.has_w) add_scaled(out, t.mix + m * kChunk, A(1), n);
}

}  // namespace detail_compose

/// The transpose of compose_chunk on one row chunk: the input's gradient into x.in_grad, the
/// weights' gradients added into `out`. Weight gradients read the input and out_grad, so they
/// come before in_grad (which may overwrite out_grad).
template <class A>
inline void compose_chunk_backward(const KernelComposeTerms<A>& c, const ComposeRow<A>& q,
                                   const ComposeGradChunk<A>& x, const ComposeGradSinks<A>& out) {
  using namespace detail_compose;
  const TransposeVectors<A> t(c, out.scratch);
  transpose_hidden(c, q, x, t);
  for (index_t m = 0; m < c.M; ++m) transpose_weight_grads(c, x, t, out, m);
  if (c.has_w) transpose_static(c, x, t, out.dw);
  for (index_t m = 0; m < c.M; ++m) transpose_input_grad(c, q, x, t, m);
}

}  // namespace dcmha::cpu

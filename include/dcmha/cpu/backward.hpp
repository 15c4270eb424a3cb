#pragma once
// Fused CPU backward of the attention core (MHA and DCMHA).
//
// For one (batch, group, query block) the team recomputes the scores of its keys and keeps three
// panels of M x Bq x S values: L (Compose_pre's input, needed for its weight gradients), P, and
// dP' = dO V^T, which turns into dP = Compose_post^T(dP') and then into dL. The softmax term needs
// D = sum_s P dP per row and head: unlike FlashAttention this is not rowsum(dO * O), because
// Compose_post mixes heads between P and O, so it is reduced across the team at a barrier.
//
// Each thread owns a contiguous share of the block's keys, so dK, dV and the key-wise compose
// gradients are accumulated without races or atomics; dQ and the query-wise gradients of a block
// are summed across threads in thread order. Results are deterministic for a fixed thread count.
#include <cmath>
#include <type_traits>
#include <vector>

#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../detail/dims.hpp"
#include "../tensor.hpp"
#include "compose.hpp"
#include "compose_simd.hpp"
#include "forward.hpp"
#include "gemm.hpp"
#include "mask.hpp"
#include "parallel.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

namespace detail_bwd {

/// Writes one side's key-wise gradient accumulators of group g to the caller's tensors, keys [s0, s1).
template <class A, class T>
void store_key_grads(const ComposeSide<A>& c, const ComposeKeyGrads<A>& kg,
                     const ComposeTermGrads<T>& out, index_t b, index_t g, index_t s0, index_t s1) {
  if (!c.has_k) return;
  const index_t M = c.M, ld = c.ld;
  for (index_t s = s0; s < s1; ++s)
    for (index_t m = 0; m < M; ++m) {
      for (index_t r = 0; r < c.Rk; ++r) {
        out.kw1(b, s, g, r, m) = T(kg.kw1[(r * M + m) * ld + s]);
        out.kw2(b, s, g, r, m) = T(kg.kw2[(r * M + m) * ld + s]);
      }
      out.kdd(b, s, g, m) = T(kg.kdd[m * ld + s]);
    }
}

/// Sums one row's query-wise gradients over the team (in thread order) into the caller's tensors.
template <class A, class T>
void store_row_grads(const ComposeSide<A>& c, const ComposeRowGrads<A>* parts,
                     index_t stride, int nth, index_t i, const ComposeTermGrads<T>& out, index_t b,
                     index_t t, index_t g) {
  if (!c.has_q) return;
  const index_t M = c.M;
  for (index_t r = 0; r < c.Rq; ++r)
    for (index_t m = 0; m < M; ++m) {
      A s1 = 0, s2 = 0;
      for (int j = 0; j < nth; ++j) {
        s1 += parts[j * stride + i].qw1[r * M + m];
        s2 += parts[j * stride + i].qw2[r * M + m];
      }
      out.qw1(b, t, g, r, m) = T(s1);
      out.qw2(b, t, g, r, m) = T(s2);
    }
  for (index_t m = 0; m < M; ++m) {
    A s = 0;
    for (int j = 0; j < nth; ++j) s += parts[j * stride + i].qdd[m];
    out.qdd(b, t, g, m) = T(s);
  }
}

template <class T>
void zero_rows(const TensorView<T, 4>& x, int tid, int nth) {
  const index_t rows = x.shape[0] * x.shape[1] * x.shape[2];
  index_t r0, r1;
  split_range(0, rows, tid, nth, 1, r0, r1);
  for (index_t r = r0; r < r1; ++r) {
    const index_t b = r / (x.shape[1] * x.shape[2]), h = r / x.shape[2] % x.shape[1], t = r % x.shape[2];
    T* p = x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2];
    for (index_t e = 0; e < x.shape[3]; ++e) p[e] = T(0);
  }
}

}  // namespace detail_bwd

/// Buffers one team shares while it works on one (batch, group).
template <class A>
struct BackwardWorkspace {
  index_t Bq = 0, ld = 0, hs = 0;
  ComposeSide<A> pre, post;
  ComposeKeyGrads<A> pre_kg, post_kg;
  Buffer<A> Lp, Pp, dPp;  // [m][row][key]
  Buffer<A> d_part;       // [rank][m][row]
  Buffer<A> dq_part;      // [rank][m][row][D]
  // Two sets, alternating by block: a thread may start the next block while others still sum
  // this block's query-wise gradients.
  std::vector<ComposeRowGrads<A>> pre_rg, post_rg;  // [set][rank][row]

  template <class T>
  void init(const detail::AttentionDims& d, const RowMask& mask, const ComposeWeights<T>& cw,
            int team_size) {
    const index_t M = d.M;
    // One team shares the three panels, so they get a larger budget than one forward panel.
    Bq = query_block_rows<A>(M, padded_stride<A>(mask.max_block_keys(64)), d.T, 3, index_t(48) << 20);
    ld = padded_stride<A>(mask.max_block_keys(Bq));  // panel row: one block's keys
    hs = padded_stride<A>(Bq * ld);
    pre.init(cw.pre, M, padded_stride<A>(d.S));  // key-wise terms of every key
    post.init(cw.post, M, padded_stride<A>(d.S));
    if (pre.has_k) pre_kg.init(pre);
    if (post.has_k) post_kg.init(post);
    Lp.assign(pre.on ? M * hs : 0, A(0));
    Pp.assign(M * hs, A(0));
    dPp.assign(M * hs, A(0));
    d_part.assign(team_size * M * Bq, A(0));
    dq_part.assign(team_size * M * Bq * d.D, A(0));
    pre_rg.resize(2 * team_size * Bq);
    post_rg.resize(2 * team_size * Bq);
    for (auto& r : pre_rg) r.init(pre);
    for (auto& r : post_rg) r.init(post);
  }
};

/// One (batch, group): every query block of it, the keys shared across the team. dK and dV of
/// the group's kv heads must be zero on entry. dw_pre / dw_post: this thread's accumulators of
/// the static weights' gradients for group g (M x M), or null.
template <class T, class A>
void backward_group(const Team& team, BackwardWorkspace<A>& ws, const RowMask& mask, A scale,
                    const detail::AttentionDims& d, index_t b, index_t g, TensorView<const T, 4> q,
                    TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<const A, 3> lse,
                    TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk,
                    TensorView<T, 4> dv, const ComposeWeights<T>& cw, const ComposeGrads<T>& dcw,
                    A* dw_pre, A* dw_post) {
  using namespace detail_bwd;
  const int tid = team.rank, nth = team.size;
  const index_t M = d.M, D = d.D, group_of_kv = d.H / d.Hk;
  const index_t Bq = ws.Bq, ld = ws.ld, hs = ws.hs;
  constexpr index_t kTile = 2 * kChunk;  // keys per P' tile feeding the dV product
  constexpr index_t kProductTile = 128;  // keys per packed K / V tile of the score products
  ComposeSide<A>& pre = ws.pre;
  ComposeSide<A>& post = ws.post;
  A* Lp = ws.Lp.data();
  A* Pp = ws.Pp.data();
  A* dPp = ws.dPp.data();

  std::vector<ComposeRow<A>> pre_rows(Bq), post_rows(Bq);
  for (auto& r : pre_rows) r.init(pre);
  for (auto& r : post_rows) r.init(post);
  Buffer<A> scratch(std::max(pre.scratch_size(), post.scratch_size()));
  const ComposeFn<A> pre_fn(pre), post_fn(post);
  const ComposeBackwardFn<A> pre_bwd(pre), post_bwd(post);
  const index_t ptile_hs = padded_stride<A>(Bq * kTile);
  Buffer<A> ptile(post.on ? M * ptile_hs : 0);
  // Packed operands of the tile products (gemm.hpp): a key tile of K or V, transposed or not,
  // and this block's rows of Q (scaled) and dO.
  const index_t DD = std::max(D, d.Dv);
  Buffer<A> kbuf(DD * kProductTile), qbuf(Bq * D), obuf(Bq * d.Dv), obuf_all(post.on ? M * Bq * d.Dv : 0);
  A* my_d = ws.d_part.data() + tid * M * Bq;

  index_t s0, s1;
  split_range(0, d.S, tid, nth, 1, s0, s1);
  if (pre.on || post.on) {
    if (pre.on) pre.load(cw.pre, b, g, s0, s1);
    if (post.on) post.load(cw.post, b, g, s0, s1);
    team.sync();
  }
  for (index_t t0 = 0; t0 < d.T; t0 += Bq) {
    const index_t t1 = std::min(d.T, t0 + Bq), nr = t1 - t0;
    const KeyRange keys = mask.rows(b, t0, t1);
    const index_t base = keys.begin;  // panel column 0 holds this key
    index_t lo, hi;
    mask.live_rows(b, t0, t1, lo, hi);
    index_t c0, c1;
    split_range(keys.begin, keys.end, tid, nth, 16, c0, c1);
    const index_t w = c1 - c0;
    const index_t set = (t0 / Bq) % 2 * nth * Bq;
    ComposeRowGrads<A>* my_pre_rg = ws.pre_rg.data() + set + tid * Bq;
    ComposeRowGrads<A>* my_post_rg = ws.post_rg.data() + set + tid * Bq;
    for (index_t i = 0; i < nr; ++i) {
      pre_rows[i].load(pre, cw.pre, b, t0 + i, g);
      post_rows[i].load(post, cw.post, b, t0 + i, g);
      if (pre.has_q) my_pre_rg[i].zero();
      if (post.has_q) my_post_rg[i].zero();
    }

    // 1. L, P (from the saved statistics), dP' = dO V^T, dV += P'^T dO, dP, D.
    A* Ls = pre.on ? Lp : Pp;
    for (index_t m = 0; m < M && w > 0; ++m) {
      const index_t h = g * M + m, hk = h / group_of_kv;
      for (index_t ts = c0; ts < c1; ts += kProductTile) {
        const index_t tw = std::min(kProductTile, c1 - ts);
        gemm_abt<A>(nr, tw, D, row_ptr(q, b, h, t0), q.stride[2], row_ptr(k, b, hk, ts), k.stride[2],
                    Ls + m * hs + (ts - base), ld, scale, kbuf.data());
        gemm_abt<A>(nr, tw, d.Dv, row_ptr(dout, b, h, t0), dout.stride[2], row_ptr(v, b, hk, ts),
                    v.stride[2], dPp + m * hs + (ts - base), ld, A(1), kbuf.data());
      }
    }
    if (pre.on)
      for (index_t cs = c0; cs < c1; cs += kChunk) {
        const int n = int(std::min<index_t>(kChunk, c1 - cs));
        for (index_t i = lo; i < hi; ++i)
          pre_fn(pre, pre_rows[i], cs, n, Lp + i * ld + (cs - base), hs, Pp + i * ld + (cs - base), hs, nullptr,
                 scratch.data());
      }
    for (index_t i = 0; i < nr; ++i) {
      const KeyRange r = mask.row(b, t0 + i);
      const index_t vb = std::max(r.begin, c0), ve = std::min(r.end, c1);
      for (index_t m = 0; m < M; ++m) {
        A* row = Pp + m * hs + i * ld;  // column s - base holds key s
        if (ve > vb) {
          Segment<A> p(row + (vb - base), ve - vb);
          p = (p - lse(b, g * M + m, t0 + i)).exp();
        }
        for (index_t s = c0; s < std::min(vb, c1); ++s) row[s - base] = A(0);
        for (index_t s = std::max(ve, c0); s < c1; ++s) row[s - base] = A(0);
      }
    }
    for (index_t m = 0; m < M && w > 0 && !post.on; ++m) {
      const index_t h = g * M + m, hk = h / group_of_kv;
      gemm_ab<A>(w, d.Dv, nr, Pp + m * hs + (c0 - base), 1, ld, row_ptr(dout, b, h, t0), dout.stride[2],
                 row_ptr(dv, b, hk, c0), dv.stride[2], true, obuf.data());
    }
    if (post.on) {
      for (index_t ts = c0; ts < c1; ts += kTile) {
        const index_t tw = std::min(kTile, c1 - ts);
        for (index_t cs = ts; cs < ts + tw; cs += kChunk) {
          const int n = int(std::min<index_t>(kChunk, ts + tw - cs));
          for (index_t i = lo; i < hi; ++i)
            post_fn(post, post_rows[i], cs, n, Pp + i * ld + (cs - base), hs,
                    ptile.data() + i * kTile + (cs - ts), ptile_hs, nullptr, scratch.data());
        }
        for (index_t m = 0; m < M && hi > lo; ++m) {
          const index_t h = g * M + m, hk = h / group_of_kv;
          // dO rows of this head, packed once per block and reused by every tile.
          A* om = obuf_all.data() + m * Bq * d.Dv;
          if (ts == c0) pack_rows<A>(hi - lo, d.Dv, row_ptr(dout, b, h, t0 + lo), dout.stride[2], om, d.Dv);
          gemm_nn<A>(tw, d.Dv, hi - lo, ptile.data() + m * ptile_hs + lo * kTile, 1, kTile, om, d.Dv,
                     row_ptr(dv, b, hk, ts), dv.stride[2], true);
        }
      }
      for (index_t cs = c0; cs < c1; cs += kChunk) {
        const int n = int(std::min<index_t>(kChunk, c1 - cs));
        for (index_t i = lo; i < hi; ++i) {
          A* gp = dPp + i * ld + (cs - base);
          post_bwd(post, post_rows[i], cs, n, Pp + i * ld + (cs - base), hs, gp, hs, gp, hs,
                                 my_post_rg[i], ws.post_kg, dw_post, scratch.data());
        }
      }
    }
    for (index_t m = 0; m < M; ++m)
      for (index_t i = 0; i < nr; ++i)
        my_d[m * Bq + i] = w > 0 ? (Segment<A>(Pp + m * hs + i * ld + (c0 - base), w) *
                                    Segment<A>(dPp + m * hs + i * ld + (c0 - base), w)).sum()
                                 : A(0);
    team.sync();

    // 2. dL' = P (dP - D), dL = Compose_pre^T(dL'), dK += dL^T Q, this thread's part of dQ.
    for (index_t m = 0; m < M && w > 0; ++m)
      for (index_t i = 0; i < nr; ++i) {
        A Dm = 0;
        for (int j = 0; j < nth; ++j) Dm += ws.d_part[(j * M + m) * Bq + i];
        Segment<A> dp(dPp + m * hs + i * ld + (c0 - base), w);
        dp = Segment<A>(Pp + m * hs + i * ld + (c0 - base), w) * (dp - Dm);
      }
    if (pre.on)
      for (index_t cs = c0; cs < c1; cs += kChunk) {
        const int n = int(std::min<index_t>(kChunk, c1 - cs));
        for (index_t i = lo; i < hi; ++i) {
          A* gp = dPp + i * ld + (cs - base);
          pre_bwd(pre, pre_rows[i], cs, n, Lp + i * ld + (cs - base), hs, gp, hs, gp, hs,
                                 my_pre_rg[i], ws.pre_kg, dw_pre, scratch.data());
        }
      }
    for (index_t m = 0; m < M; ++m) {
      const index_t h = g * M + m, hk = h / group_of_kv;
      const A* dL = dPp + m * hs + (c0 - base);
      if (w > 0)
        gemm_ab<A>(w, D, nr, dL, 1, ld, row_ptr(q, b, h, t0), q.stride[2], row_ptr(dk, b, hk, c0),
                   dk.stride[2], true, qbuf.data(), scale);
      // Alone on the group, a thread writes straight to the caller's gradient.
      A* dQ = nth == 1 ? row_ptr(dq, b, h, t0) : ws.dq_part.data() + (tid * M + m) * Bq * D;
      const index_t ldq = nth == 1 ? dq.stride[2] : D;
      if (w == 0)
        for (index_t i = 0; i < nr; ++i) std::fill(dQ + i * ldq, dQ + i * ldq + D, A(0));
      for (index_t ts = c0; ts < c1; ts += kProductTile) {
        const index_t tw = std::min(kProductTile, c1 - ts);
        gemm_ab<A>(nr, D, tw, dL + (ts - c0), ld, 1, row_ptr(k, b, hk, ts), k.stride[2], dQ, ldq,
                   ts > c0, kbuf.data(), scale);
      }
    }
    for (index_t i = 0; i < nr; ++i) {
      if (pre.has_q) my_pre_rg[i].fold_lanes();
      if (post.has_q) my_post_rg[i].fold_lanes();
    }
    team.sync();

    // 3. Sum dQ and the query-wise gradients over the team, a share of the rows each.
    index_t r0, r1;
    split_range(0, nr, tid, nth, 1, r0, r1);
    if (nth > 1) sum_team_parts<T, A>(team, ws.dq_part.data(), M, Bq, nr, D, dq, b, g * M, t0);
    for (index_t i = r0; i < r1; ++i) {
      store_row_grads(pre, ws.pre_rg.data() + set, Bq, nth, i, dcw.pre, b, t0 + i, g);
      store_row_grads(post, ws.post_rg.data() + set, Bq, nth, i, dcw.post, b, t0 + i, g);
    }
  }
  if (pre.has_k || post.has_k) {
    team.sync();  // every block of this group has added its key-wise gradients
    store_key_grads(pre, ws.pre_kg, dcw.pre, b, g, s0, s1);
    store_key_grads(post, ws.post_kg, dcw.post, b, g, s0, s1);
    const index_t kld = pre.ld;  // key-wise arrays: one row of every key per (r, m)
    for (auto* kg : {&ws.pre_kg, &ws.post_kg})
      for (auto* vec : {&kg->kw1, &kg->kw2, &kg->kdd})
        for (index_t r = 0; r < index_t(vec->size()) / kld; ++r)
          std::fill(vec->data() + r * kld + s0, vec->data() + r * kld + s1, A(0));
  }
  team.sync();  // the next group reloads the compose sides
}

inline index_t gcd_index(index_t a, index_t b) { return b == 0 ? a : gcd_index(b, a % b); }

template <class T>
void backward(const AttentionConfig& cfg, const detail::AttentionDims& d, TensorView<const T, 4> q,
              TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,
              TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk,
              TensorView<T, 4> dv, const ComposeWeights<T>& cw, const ComposeGrads<T>& dcw) {
  using A = acc_t<T>;
  static_assert(std::is_same_v<A, T>, "storage narrower than the accumulator is not supported yet");
  using namespace detail_bwd;
  const int nt = thread_count(cfg.num_threads);
  const RowMask mask(cfg, d.T, d.S);
  const A scale = default_scale<A>(cfg.scale, d.D);
  const index_t M = d.M, G = d.G, group_of_kv = d.H / d.Hk;
  // Groups that share kv heads (GQA with fewer kv heads than a group has heads... or more) go to
  // one owner together: a cluster spans lcm(M, H/Hk) heads, whose kv heads no other cluster reads.
  const index_t cluster_heads = M / gcd_index(M, group_of_kv) * group_of_kv;
  const index_t groups_per_item = cluster_heads / M;
  const index_t items = d.B * (G / groups_per_item);
  const bool independent = independent_items(items, nt);
  const int team_size_ = independent ? 1 : nt;

  // Static weights' gradients: one M x M accumulator per (batch, team rank, group), summed in a
  // fixed order at the end, so the result does not depend on which thread ran which item.
  const bool w_pre = cw.pre.static_w, w_post = cw.post.static_w;
  Buffer<A> dw_pre(w_pre ? d.B * team_size_ * G * M * M : 0, A(0));
  Buffer<A> dw_post(w_post ? d.B * team_size_ * G * M * M : 0, A(0));
  auto dw_slot = [&](Buffer<A>& buf, index_t b, int rank, index_t g) -> A* {
    return buf.empty() ? nullptr : buf.data() + ((b * team_size_ + rank) * G + g) * M * M;
  };

  if (independent) {
#pragma omp parallel num_threads(nt)
    {
      BackwardWorkspace<A> ws;
      ws.init(d, mask, cw, 1);
#pragma omp for schedule(dynamic, 1)
      for (index_t it = 0; it < items; ++it) {
        const index_t b = it / (G / groups_per_item), g0 = it % (G / groups_per_item) * groups_per_item;
        const index_t hk0 = g0 * M / group_of_kv, hk1 = (g0 + groups_per_item) * M / group_of_kv;
        for (index_t hk = hk0; hk < hk1; ++hk)
          for (index_t s = 0; s < d.S; ++s) {
            mutable_rows_of(dk, b, hk, s, 1).setZero();
            mutable_rows_of(dv, b, hk, s, 1).setZero();
          }
        for (index_t g = g0; g < g0 + groups_per_item; ++g)
          backward_group(Team{0, 1}, ws, mask, scale, d, b, g, q, k, v, lse, dout, dq, dk, dv, cw,
                         dcw, dw_slot(dw_pre, b, 0, g), dw_slot(dw_post, b, 0, g));
      }
    }
  } else {
    BackwardWorkspace<A> ws;
    ws.init(d, mask, cw, nt);
#pragma omp parallel num_threads(nt)
    {
      const Team team{thread_id(), team_size()};
      zero_rows(dk, team.rank, team.size);
      zero_rows(dv, team.rank, team.size);
      team.sync();
      for (index_t b = 0; b < d.B; ++b)
        for (index_t g = 0; g < G; ++g)
          backward_group(team, ws, mask, scale, d, b, g, q, k, v, lse, dout, dq, dk, dv, cw, dcw,
                         dw_slot(dw_pre, b, team.rank, g), dw_slot(dw_post, b, team.rank, g));
    }
  }

  for (int side = 0; side < 2; ++side) {
    Buffer<A>& parts = side ? dw_post : dw_pre;
    const TensorView<T, 3>& out = side ? dcw.post.w : dcw.pre.w;
    if (parts.empty()) continue;
    for (index_t g = 0; g < G; ++g)
      for (index_t m = 0; m < M; ++m)
        for (index_t n = 0; n < M; ++n) {
          A s = 0;
          for (index_t b = 0; b < d.B; ++b)
            for (int j = 0; j < team_size_; ++j) s += dw_slot(parts, b, j, g)[m * M + n];
          out(g, m, n) = T(s);
        }
  }
}

}  // namespace dcmha::cpu

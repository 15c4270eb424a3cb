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
#include "../workspace.hpp"
#include "compose.hpp"
#include "compose_simd.hpp"
#include "convert.hpp"
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
        s1 += parts[j * stride + i].qw1()[r * M + m];
        s2 += parts[j * stride + i].qw2()[r * M + m];
      }
      out.qw1(b, t, g, r, m) = T(s1);
      out.qw2(b, t, g, r, m) = T(s2);
    }
  for (index_t m = 0; m < M; ++m) {
    A s = 0;
    for (int j = 0; j < nth; ++j) s += parts[j * stride + i].qdd()[m];
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

/// Flattened rows [r0, r1) of a (B, H, L, D) view: x's rows rounded into out's (narrow storage).
template <class T, class A>
void narrow_rows(const TensorView<A, 4>& x, const TensorView<T, 4>& out, index_t r0, index_t r1) {
  const index_t H = x.shape[1], L = x.shape[2];
  for (index_t r = r0; r < r1; ++r) {
    const index_t b = r / (H * L), h = r / L % H, t = r % L;
    narrow_row(row_ptr(x, b, h, t), row_ptr(out, b, h, t), x.shape[3]);
  }
}

}  // namespace detail_bwd

/// Buffers one team shares while it works on one (batch, group). The three panels and the
/// partial dQ live in the call's Workspace (memory_size() values).
template <class A>
struct BackwardWorkspace : SlabLayout {
  index_t Bq = 0;
  ComposeSide<A> pre, post;
  ComposeKeyGrads<A> pre_kg, post_kg;
  A *Lp = nullptr, *Pp = nullptr, *dPp = nullptr;  // [rank][tile][row][m][key], see SlabLayout
  // dQ accumulates here and is written to the caller once per block (summed over a key-split
  // team, rounded once for narrow storage), as the forward's output does.
  A* dq_part = nullptr;  // [rank][m][row][D]
  Buffer<A> d_part;      // [rank][m][row]
  // Two sets, alternating by block: a thread may start the next block while others still sum
  // this block's query-wise gradients.
  std::vector<ComposeRowGrads<A>> pre_rg, post_rg;  // [set][rank][row]

  /// Values of Workspace memory one team of team_size threads needs, whole cache lines (see
  /// ForwardWorkspace::memory_size).
  template <class T>
  static index_t memory_size(const detail::AttentionDims& d, const RowMask& mask,
                             const ComposeWeights<T>& cw, int team_size) {
    BackwardWorkspace w;
    w.layout(d, mask, team_size);
    return round_up((cw.pre.enabled() ? 3 : 2) * w.panel_size(team_size) + w.dq_part_size(d, team_size),
                    64 / index_t(sizeof(A)));
  }

  /// `memory`: memory_size() values, written before they are read.
  template <class T>
  void init(const detail::AttentionDims& d, const RowMask& mask, const ComposeWeights<T>& cw,
            int team_size, A* memory) {
    const index_t M = d.M;
    layout(d, mask, team_size);
    pre.init(cw.pre, M, padded_stride<A>(d.S));  // key-wise terms of every key
    post.init(cw.post, M, padded_stride<A>(d.S));
    if (pre.has_k) pre_kg.init(pre);
    if (post.has_k) post_kg.init(post);
    const index_t panel = panel_size(team_size);
    Lp = memory;
    Pp = Lp + (pre.on ? panel : 0);
    dPp = Pp + panel;
    dq_part = dPp + panel;
    d_part.assign(team_size * M * Bq, A(0));
    pre_rg.resize(2 * team_size * Bq);
    post_rg.resize(2 * team_size * Bq);
    for (auto& r : pre_rg) r.init(pre);
    for (auto& r : post_rg) r.init(post);
  }
  A* slab_of(A* panel, int rank, index_t t) { return panel + slab_offset(rank, t); }

 private:
  void layout(const detail::AttentionDims& d, const RowMask& mask, int team_size) {
    const index_t M = d.M;
    // One team shares the three panels, so they get a larger budget than one forward panel.
    Bq = query_block_rows<A>(M, padded_stride<A>(mask.max_block_keys(64)), d.T, 3, index_t(48) << 20);
    // Keys per tile: the tile's slabs of the three panels (3 x M x Bq x tile values) are
    // produced and consumed while they are in L2, as in the forward. Whole-panel sweeps made
    // every Compose step of the backward wait on memory (perf: half of its time on the panel loads).
    init_slabs<A>(M, Bq, 3, index_t(1024) << 10, mask.max_block_keys(Bq), team_size);
  }
  index_t dq_part_size(const detail::AttentionDims& d, int team_size) const {
    return team_size * d.M * Bq * d.D;
  }
};

/// One (batch, group): every query block of it, the keys shared across the team. dk and dv: the
/// accumulators of dK and dV (the caller's tensors, or float ones for narrow storage), zero on
/// entry for the group's kv heads. dw_pre / dw_post: this thread's accumulators of
/// the static weights' gradients for group g (M x M), or null.
///
/// Per block, two passes over this thread's key tiles, as in the forward. Pass 1: L, P (from the
/// saved statistics), dP' = dO V^T, dV += P'^T dO, dP = Compose_post^T(dP'), and this thread's part
/// of D = sum_s P dP. Pass 2, once D is summed over the team: dL' = P (dP - D),
/// dL = Compose_pre^T(dL'), dK += dL^T Q, this thread's part of dQ = dL K.
template <class T, class A>
void backward_group(const Team& team, BackwardWorkspace<A>& ws, const RowMask& mask, A scale,
                    const detail::AttentionDims& d, index_t b, index_t g, TensorView<const T, 4> q,
                    TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<const A, 3> lse,
                    TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<A, 4> dk,
                    TensorView<A, 4> dv, const ComposeWeights<T>& cw, const ComposeGrads<T>& dcw,
                    A* dw_pre, A* dw_post, Workspace& mem) {
  using namespace detail_bwd;
  const int tid = team.rank, nth = team.size;
  const index_t M = d.M, D = d.D, Dv = d.Dv, group_of_kv = d.H / d.Hk;
  const index_t Bq = ws.Bq, tw = ws.tile, rs = ws.rs;
  ComposeSide<A>& pre = ws.pre;
  ComposeSide<A>& post = ws.post;

  std::vector<ComposeRow<A>> pre_rows(Bq), post_rows(Bq);
  for (auto& r : pre_rows) r.init(pre);
  for (auto& r : post_rows) r.init(post);
  Buffer<A> scratch(std::max(pre.scratch_size(), post.scratch_size()));
  const ComposeFn<A> pre_fn(pre), post_fn(post);
  const ComposeBackwardFn<A> pre_bwd(pre), post_bwd(post);
  // This thread's buffers in the Workspace: P' of one tile ([row][m][key]), and the packed
  // operands of the tile products (gemm.hpp): a key tile of K or V, and this block's rows of Q
  // (scaled) and dO for every head, packed once per block and shared by every tile.
  const int me = thread_id();
  A* ptile = post.on ? detail::WorkspaceAccess::per_thread<A>(mem, me, 0, ws.slab) : nullptr;
  A* kbuf = detail::WorkspaceAccess::per_thread<A>(mem, me, 1, std::max(D, Dv) * tw);
  A* qall = detail::WorkspaceAccess::per_thread<A>(mem, me, 2, M * Bq * D);
  A* oall = detail::WorkspaceAccess::per_thread<A>(mem, me, 3, M * Bq * Dv);
  Buffer<A> row_d(Bq * M);  // [row][m]: D summed over the team
  A* my_d = ws.d_part.data() + tid * M * Bq;
  // The same keys of the next kv head, for the packing routines to prefetch.
  auto next_head = [&](const TensorView<const T, 4>& x, index_t m, index_t p) {
    return next_kv_rows(x, b, g * M + m, g * M + M, group_of_kv, p);
  };

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
    index_t lo, hi;
    mask.live_rows(b, t0, t1, lo, hi);
    // Only rows [lo, hi) see keys. The others (padding, causal rows before the first key) get
    // zero gradients and are never read: the caller's Q and dO rows there may hold anything,
    // and a zero probability times a NaN is still NaN.
    const index_t nl = std::max<index_t>(hi - lo, 0);
    index_t c0, c1;
    split_range(keys.begin, keys.end, tid, nth, 16, c0, c1);
    const index_t set = (t0 / Bq) % 2 * nth * Bq;
    ComposeRowGrads<A>* my_pre_rg = ws.pre_rg.data() + set + tid * Bq;
    ComposeRowGrads<A>* my_post_rg = ws.post_rg.data() + set + tid * Bq;
    for (index_t i = 0; i < nr; ++i) {
      pre_rows[i].load(pre, cw.pre, b, t0 + i, g);
      post_rows[i].load(post, cw.post, b, t0 + i, g);
      if (pre.has_q) my_pre_rg[i].zero();
      if (post.has_q) my_post_rg[i].zero();
    }
    for (index_t j = 0; j < M * Bq; ++j) my_d[j] = A(0);
    // A head's packed Q and dO rows, for the product before theirs to ask for (null past the last head).
    auto q_rows = [&](index_t m) { return next_rows(m < M ? qall + (m * Bq + lo) * D : nullptr, nl, D, D); };
    auto dout_rows = [&](index_t m) { return next_rows(m < M ? oall + (m * Bq + lo) * Dv : nullptr, nl, Dv, Dv); };
    if (c1 > c0)
      for (index_t m = 0; m < M; ++m) {
        const index_t h = g * M + m;
        pack_rows<A>(nl, D, row_ptr(q, b, h, t0 + lo), q.stride[2], qall + (m * Bq + lo) * D, D, scale);
        pack_rows<A>(nl, Dv, row_ptr(dout, b, h, t0 + lo), dout.stride[2], oall + (m * Bq + lo) * Dv, Dv);
      }

    // Pass 1.
    for (index_t cs = c0, tile = 0; cs < c1; cs += tw, ++tile) {
      const index_t ce = std::min(c1, cs + tw), n = ce - cs;
      A* Ps = ws.slab_of(ws.Pp, tid, tile);  // Ps[i * rs + m * tw + (s - cs)] holds key s
      A* Ls = pre.on ? ws.slab_of(ws.Lp, tid, tile) : Ps;
      A* dPs = ws.slab_of(ws.dPp, tid, tile);
      for (index_t m = 0; m < M; ++m) {
        const index_t hk = (g * M + m) / group_of_kv;
        // Scores from the packed, scaled Q rows (contiguous) rather than the caller's (a page apart).
        gemm_abt<A>(nl, n, D, qall + (m * Bq + lo) * D, D, row_ptr(k, b, hk, cs), k.stride[2],
                    Ls + lo * rs + m * tw, rs, A(1), kbuf,
                    {next_rows(next_head(k, m, cs), n, k.stride[2], D), dout_rows(m)});
        gemm_abt<A>(nl, n, Dv, oall + (m * Bq + lo) * Dv, Dv, row_ptr(v, b, hk, cs), v.stride[2],
                    dPs + lo * rs + m * tw, rs, A(1), kbuf,
                    {next_rows(next_head(v, m, cs), n, v.stride[2], Dv), q_rows(m + 1)});
      }
      // Chunks outer: a chunk's key-wise terms stay in L1 while every row uses them.
      if (pre.on)
        for (index_t s = cs; s < ce; s += kChunk) {
          const int nc = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i)
            pre_fn(pre, pre_rows[i], s, nc, Ls + i * rs + (s - cs), tw, Ps + i * rs + (s - cs), tw,
                   nullptr, scratch.data(), i + 1 < hi ? Ls + (i + 1) * rs + (s - cs) : nullptr);
        }
      for (index_t i = 0; i < nr; ++i) {
        const KeyRange r = mask.row(b, t0 + i);
        const index_t vb = std::max(r.begin, cs), ve = std::min(r.end, ce);
        for (index_t m = 0; m < M; ++m) {
          A* row = Ps + i * rs + m * tw - cs;  // row[s] holds key s
          if (ve > vb) {
            Segment<A> p(row + vb, ve - vb);
            p = (p - lse(b, g * M + m, t0 + i)).exp();
          }
          for (index_t s = cs; s < std::min(vb, ce); ++s) row[s] = A(0);
          for (index_t s = std::max(ve, cs); s < ce; ++s) row[s] = A(0);
        }
      }
      // P' = Compose_post(P) (P itself without post compose), then dV += P'^T dO.
      const A* Pt = post.on ? ptile : Ps;
      if (post.on)
        for (index_t s = cs; s < ce; s += kChunk) {
          const int nc = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i)
            post_fn(post, post_rows[i], s, nc, Ps + i * rs + (s - cs), tw, ptile + i * rs + (s - cs),
                    tw, nullptr, scratch.data(), nullptr);
        }
      for (index_t m = 0; m < M; ++m)
        gemm_nn<A>(n, Dv, nl, Pt + lo * rs + m * tw, 1, rs, oall + (m * Bq + lo) * Dv, Dv,
                   row_ptr(dv, b, (g * M + m) / group_of_kv, cs), dv.stride[2], true, {{}, dout_rows(m + 1)});
      if (post.on) {
        for (index_t s = cs; s < ce; s += kChunk) {
          const int nc = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i) {
            A* gp = dPs + i * rs + (s - cs);
            post_bwd(post, post_rows[i], s, nc, Ps + i * rs + (s - cs), tw, gp, tw, gp, tw, my_post_rg[i],
                     ws.post_kg, dw_post, scratch.data(), i + 1 < hi ? gp + rs : nullptr, tw);
          }
        }
      }
      for (index_t i = lo; i < hi; ++i)
        for (index_t m = 0; m < M; ++m)
          my_d[m * Bq + i] += (Segment<A>(Ps + i * rs + m * tw, n) * Segment<A>(dPs + i * rs + m * tw, n)).sum();
    }
    team.sync();

    // Pass 2.
    for (index_t i = 0; i < nr; ++i)
      for (index_t m = 0; m < M; ++m) {
        A Dm = 0;
        for (int j = 0; j < nth; ++j) Dm += ws.d_part[(j * M + m) * Bq + i];
        row_d[i * M + m] = Dm;
      }
    auto dq_rows = [&](index_t m) { return ws.dq_part + (tid * M + m) * Bq * D; };
    for (index_t m = 0; m < M; ++m)
      for (index_t i = 0; i < nr; ++i)
        if (c1 == c0 || i < lo || i >= hi) std::fill(dq_rows(m) + i * D, dq_rows(m) + (i + 1) * D, A(0));
    for (index_t cs = c0, tile = 0; cs < c1; cs += tw, ++tile) {
      const index_t ce = std::min(c1, cs + tw), n = ce - cs;
      A* Ps = ws.slab_of(ws.Pp, tid, tile);
      A* Ls = pre.on ? ws.slab_of(ws.Lp, tid, tile) : Ps;
      A* dPs = ws.slab_of(ws.dPp, tid, tile);
      // The slabs were written in pass 1, long enough ago to have left the cache.
      for (index_t i = lo; i < hi; ++i) {
        for (index_t m = 0; m < M; ++m) {
          if (i + 1 < hi) {  // the next row's, head by head (in one burst per row they stalled)
            prefetch_bytes(Ps + (i + 1) * rs + m * tw, n * index_t(sizeof(A)));
            prefetch_bytes(dPs + (i + 1) * rs + m * tw, n * index_t(sizeof(A)));
          }
          Segment<A> dp(dPs + i * rs + m * tw, n);
          dp = Segment<A>(Ps + i * rs + m * tw, n) * (dp - row_d[i * M + m]);
        }
      }
      if (pre.on)
        for (index_t s = cs; s < ce; s += kChunk) {
          const int nc = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i) {
            A* gp = dPs + i * rs + (s - cs);
            pre_bwd(pre, pre_rows[i], s, nc, Ls + i * rs + (s - cs), tw, gp, tw, gp, tw, my_pre_rg[i],
                    ws.pre_kg, dw_pre, scratch.data(), i + 1 < hi ? Ls + (i + 1) * rs + (s - cs) : nullptr, tw);
          }
        }
      for (index_t m = 0; m < M; ++m)
        gemm_nn<A>(n, D, nl, dPs + lo * rs + m * tw, 1, rs, qall + (m * Bq + lo) * D, D,
                   row_ptr(dk, b, (g * M + m) / group_of_kv, cs), dk.stride[2], true, {{}, q_rows(m + 1)});
    }
    // dQ = dL K head by head, after the tiles: per tile, every head's dQ rows (M x Bq x D values,
    // more than L2) would be read and written again; this way one head's stay in L1 and the
    // tiles' dL and K rows, read once more, are asked for ahead (the next tile's, or the next
    // head's first).
    for (index_t m = 0; m < M; ++m) {
      const index_t hk = (g * M + m) / group_of_kv;
      for (index_t cs = c0, tile = 0; cs < c1; cs += tw, ++tile) {
        const index_t n = std::min(c1, cs + tw) - cs;
        const A* dL = ws.slab_of(ws.dPp, tid, tile) + lo * rs + m * tw;
        NextReads next;
        if (cs + tw < c1) {
          const index_t nn = std::min(tw, c1 - cs - tw);
          next = {next_rows(row_ptr(k, b, hk, cs + tw), nn, k.stride[2], D), next_rows(dL + ws.slab, nl, rs, nn)};
        } else if (m + 1 < M) {
          const index_t nn = std::min(tw, c1 - c0);
          next = {next_rows(row_ptr(k, b, (g * M + m + 1) / group_of_kv, c0), nn, k.stride[2], D),
                  next_rows(ws.slab_of(ws.dPp, tid, 0) + lo * rs + (m + 1) * tw, nl, rs, nn)};
        }
        gemm_ab<A>(nl, D, n, dL, rs, 1, row_ptr(k, b, hk, cs), k.stride[2], dq_rows(m) + lo * D, D, cs > c0,
                   kbuf, scale, next);
      }
    }
    team.sync();

    // 3. Sum dQ and the query-wise gradients over the team, a share of the rows each.
    index_t r0, r1;
    split_range(0, nr, tid, nth, 1, r0, r1);
    sum_team_parts<T, A>(team, ws.dq_part, M, Bq, nr, D, dq, b, g * M, t0);
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
              TensorView<T, 4> dv, const ComposeWeights<T>& cw, const ComposeGrads<T>& dcw,
              Workspace& mem) {
  using A = acc_t<T>;
  using namespace detail_bwd;
  constexpr bool narrow = !std::is_same_v<T, A>;
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

  detail::WorkspaceAccess::reserve_slots(mem, nt);
  // dK and dV sum over every query block: with narrow storage, in float accumulators, rounded
  // once at the end (bf16 sums over hundreds of blocks would lose the gradient's low bits).
  TensorView<A, 4> dk_acc, dv_acc;
  if constexpr (narrow) {
    const index_t nk = d.B * d.Hk * d.S;
    A* acc = detail::WorkspaceAccess::shared<A>(mem, 1, nk * (d.D + d.Dv));
    dk_acc = bhtd(acc, d.B, d.Hk, d.S, d.D);
    dv_acc = bhtd(acc + nk * d.D, d.B, d.Hk, d.S, d.Dv);
  } else {
    dk_acc = dk;
    dv_acc = dv;
  }
  if (independent) {
    // Every thread's panels in one Workspace block (shared with the forward's, see there).
    const index_t private_size = BackwardWorkspace<A>::memory_size(d, mask, cw, 1);
    A* panels = detail::WorkspaceAccess::shared<A>(mem, 0, nt * private_size);
#pragma omp parallel num_threads(nt)
    {
      BackwardWorkspace<A> ws;
      ws.init(d, mask, cw, 1, panels + thread_id() * private_size);
#pragma omp for schedule(dynamic, 1)
      for (index_t it = 0; it < items; ++it) {
        const index_t b = it / (G / groups_per_item), g0 = it % (G / groups_per_item) * groups_per_item;
        const index_t hk0 = g0 * M / group_of_kv, hk1 = (g0 + groups_per_item) * M / group_of_kv;
        for (index_t hk = hk0; hk < hk1; ++hk)
          for (index_t s = 0; s < d.S; ++s) {
            mutable_rows_of(dk_acc, b, hk, s, 1).setZero();
            mutable_rows_of(dv_acc, b, hk, s, 1).setZero();
          }
        for (index_t g = g0; g < g0 + groups_per_item; ++g)
          backward_group(Team{0, 1}, ws, mask, scale, d, b, g, q, k, v, lse, dout, dq, dk_acc, dv_acc,
                         cw, dcw, dw_slot(dw_pre, b, 0, g), dw_slot(dw_post, b, 0, g), mem);
        if constexpr (narrow) {
          narrow_rows(dk_acc, dk, (b * d.Hk + hk0) * d.S, (b * d.Hk + hk1) * d.S);
          narrow_rows(dv_acc, dv, (b * d.Hk + hk0) * d.S, (b * d.Hk + hk1) * d.S);
        }
      }
    }
  } else {
    BackwardWorkspace<A> ws;
    ws.init(d, mask, cw, nt, detail::WorkspaceAccess::shared<A>(mem, 0, BackwardWorkspace<A>::memory_size(d, mask, cw, nt)));
#pragma omp parallel num_threads(nt)
    {
      const Team team{thread_id(), team_size()};
      zero_rows(dk_acc, team.rank, team.size);
      zero_rows(dv_acc, team.rank, team.size);
      team.sync();
      for (index_t b = 0; b < d.B; ++b)
        for (index_t g = 0; g < G; ++g)
          backward_group(team, ws, mask, scale, d, b, g, q, k, v, lse, dout, dq, dk_acc, dv_acc, cw, dcw,
                         dw_slot(dw_pre, b, team.rank, g), dw_slot(dw_post, b, team.rank, g), mem);
      if constexpr (narrow) {  // backward_group ends at a barrier: every block has added its part
        index_t r0, r1;
        split_range(0, d.B * d.Hk * d.S, team.rank, team.size, 1, r0, r1);
        narrow_rows(dk_acc, dk, r0, r1);
        narrow_rows(dv_acc, dv, r0, r1);
      }
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

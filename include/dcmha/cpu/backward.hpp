#pragma once
// Fused CPU backward of the attention core (MHA and DCMHA).
//
// For one (batch, group, query block) the team recomputes the scores of its keys and keeps three
// panels of M x Bq x S values: L (Compose_pre's input, needed for its weight gradients), P, and
// dP' = dO V^T, which turns into dP = Compose_post^T(dP') and then into dL. The softmax term needs
// D = sum_s P dP per row and head: unlike FlashAttention this is not rowsum(dO * O), because
// Compose_post mixes heads between P and O, so it is summed over all keys at a barrier.
//
// The team takes a block's key tiles dynamically (TileQueue); one thread does all of a tile's
// work in a pass, so dK, dV and the key-wise compose gradients are accumulated without races or
// atomics. What sums over keys (D, the query-wise and static compose gradients) is kept per tile
// and summed in tile order, and dQ is summed over the tiles a head at a time by one thread: the
// results are the same for every thread count and schedule, bit for bit.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
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

/// Writes one side's key-wise gradient accumulators of group g to the caller's tensors, keys [s0,
/// s1).
template <class A, class T>
void store_key_grads(const KernelComposeTerms<A>& c, const ComposeKeyGrads<A>& kg,
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

/// Sums one row's query-wise gradients over `count` key tiles in tile order (the first tile's at
/// `parts`, the next `stride` values on) into the caller's tensors. `sum`:
/// ComposeRowGrads::size(c) values of scratch.
template <class A, class T>
void store_row_grads(const KernelComposeTerms<A>& c, const A* parts, index_t stride, index_t count,
                     const ComposeTermGrads<T>& out, index_t b, index_t t, index_t g, A* sum) {
  if (!c.has_q) return;
  const index_t M = c.M, n = ComposeRowGrads<A>::size(c);
  // Tiles outer: a tile's values are one contiguous run (tiles inner read a cache line per value).
  std::fill(sum, sum + n, A(0));
  for (index_t j = 0; j < count; ++j)
    for (index_t e = 0; e < n; ++e) sum[e] += parts[j * stride + e];
  ComposeRowGrads<A> total;
  total.init(c, sum);
  for (index_t r = 0; r < c.Rq; ++r)
    for (index_t m = 0; m < M; ++m) {
      out.qw1(b, t, g, r, m) = T(total.qw1()[r * M + m]);
      out.qw2(b, t, g, r, m) = T(total.qw2()[r * M + m]);
    }
  for (index_t m = 0; m < M; ++m) out.qdd(b, t, g, m) = T(total.qdd()[m]);
}

template <class T>
void zero_rows(const TensorView<T, 4>& x, int tid, int nth) {
  const index_t rows = x.shape[0] * x.shape[1] * x.shape[2];
  index_t r0, r1;
  split_range(0, rows, tid, nth, 1, r0, r1);
  for (index_t r = r0; r < r1; ++r) {
    const index_t b = r / (x.shape[1] * x.shape[2]), h = r / x.shape[2] % x.shape[1],
                  t = r % x.shape[2];
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

/// Which compose side a per-tile gradient sum belongs to; its value indexes the sides (pre: 0).
enum class ComposeStage { pre, post };

/// Buffers one team shares while it works on one (batch, group). The three panels and the packed
/// Q and dO rows live in the call's Workspace (memory_size() values).
///
/// The team takes a block's key tiles dynamically (TileQueue), so what sums over keys is kept per
/// tile and summed in tile order afterwards: D, the query-wise compose gradients and the static
/// weights' gradients. dQ, which sums over every tile, is computed head by head, each head by one
/// thread. So results do not depend on which thread took which tile, nor on the thread count.
template <class A>
struct BackwardWorkspace : SlabLayout {
  index_t Bq = 0;
  KernelComposeTerms<A> pre, post;
  ComposeKeyGrads<A> pre_kg, post_kg;
  // [tile][row][m][key], see SlabLayout. Scores: L, Compose_pre's input (pre only). Probs: L',
  // then P. Grads: dP' = dO V^T, overwritten in turn by dP, dL' and dL.
  A *scores_panel = nullptr, *probs_panel = nullptr, *grads_panel = nullptr;
  Buffer<A> d_tile;           // [tile][m][row]: D over the tile's keys
  Buffer<A> p_tile;           // [tile][m][row]: P over the tile's keys
  Buffer<A> pre_rg, post_rg;  // [tile][row][ComposeRowGrads::size]: query-wise gradient sums
  Buffer<A> dw_tile;          // [tile][side][m][n], sides with static W
  A *packed_q = nullptr, *packed_dout = nullptr;  // [m][row][D or Dv]: the block's Q (scaled), dO
  TileQueue pass1, pass2;
  std::atomic<index_t> heads_taken{0};  // dQ's heads: a ticket counter, never reset

  /// Values of Workspace memory one team needs, whole cache lines (see
  /// ForwardWorkspace::memory_size).
  /// `items`: the call's (batch, group) items (see backward()).
  template <class T>
  static index_t memory_size(const detail::AttentionDims& d, const RowMask& mask,
                             const ComposeWeights<T>& cw, index_t items) {
    BackwardWorkspace w;
    w.layout(d, mask, items);
    return round_up((cw.pre.enabled() ? 3 : 2) * w.panel_size(1) + w.Bq * d.M * (d.D + d.Dv),
                    64 / index_t(sizeof(A)));
  }

  /// `memory`: memory_size() values, written before they are read.
  template <class T>
  void init(const detail::AttentionDims& d, const RowMask& mask, const ComposeWeights<T>& cw,
            int team_size, index_t items, A* memory) {
    const index_t M = d.M;
    layout(d, mask, items);
    pre.init(cw.pre, M, padded_stride<A>(d.S));  // key-wise terms of every key
    post.init(cw.post, M, padded_stride<A>(d.S));
    if (pre.has_k) pre_kg.init(pre);
    if (post.has_k) post_kg.init(post);
    const index_t panel = panel_size(1);
    scores_panel = memory;
    probs_panel = scores_panel + (pre.on ? panel : 0);
    grads_panel = probs_panel + panel;
    packed_q = grads_panel + panel;
    packed_dout = packed_q + Bq * M * d.D;
    d_tile.assign(tiles * M * Bq, A(0));
    p_tile.assign(tiles * M * Bq, A(0));
    pre_rg.assign(tiles * Bq * ComposeRowGrads<A>::size(pre), A(0));
    post_rg.assign(tiles * Bq * ComposeRowGrads<A>::size(post), A(0));
    dw_tile.assign(pre.has_w || post.has_w ? tiles * 2 * M * M : 0, A(0));
    pass1.resize(team_size);
    pass2.resize(team_size);
  }
  A* slab_of(A* panel, index_t t) { return panel + slab_offset(0, t); }
  /// Row i of tile t's sums of one side's query-wise gradients; rows follow each other, tiles
  /// too.
  ComposeRowGrads<A> row_grads(const KernelComposeTerms<A>& side, ComposeStage stage, index_t t,
                               index_t i) {
    ComposeRowGrads<A> r;
    r.init(side, (stage == ComposeStage::post ? post_rg : pre_rg).data() +
                     (t * Bq + i) * ComposeRowGrads<A>::size(side));
    return r;
  }
  /// Tile t's accumulator of one side's static-weight gradient, or null without W.
  A* dw_of(const KernelComposeTerms<A>& side, ComposeStage stage, index_t t) {
    return side.has_w ? dw_tile.data() + (t * 2 + static_cast<int>(stage)) * side.M * side.M
                      : nullptr;
  }

 private:
  void layout(const detail::AttentionDims& d, const RowMask& mask, index_t items) {
    const index_t M = d.M;
    // Every query block reads K and V and updates dK and dV for all M heads over its keys
    // (K and V: 64 MiB at H32/D128/T2048, from DRAM), so fewer, larger blocks move less in all:
    // up to 128 rows, as many as the panel budget allows (docs/performance.md). Whole items per
    // thread each need a set (up to one per item): the sets stay within 256 MiB together, and
    // none gets less than 48 MiB. Windows keep 64 rows: each row of a block computes
    // W + Bq - 1 keys (see the forward's block_rows). Long sequences get fewer rows (40 at
    // H16/T16384: 126 MB of panels, about what the forward's two per-thread panels already take
    // from the same Workspace). The layout must not depend on the thread count: it fixes the
    // order of the per-tile sums, which keeps the gradients bitwise the same for every count.
    const index_t budget = std::clamp<index_t>((index_t(256) << 20) / std::max<index_t>(items, 1),
                                               index_t(48) << 20, index_t(128) << 20);
    const index_t max_rows = mask.window > 0 ? 64 : 128;
    Bq = query_block_rows<A>(M, padded_stride<A>(mask.max_block_keys(max_rows)), d.T, 3, budget,
                             max_rows);
    // Keys per tile: the tile's slabs of the three panels (3 x M x Bq x tile values, at least 32
    // keys: 1.5 MiB at H32 with 128-row blocks) are produced and consumed while they are in L2
    // or close to it, as in the forward. Sweeping whole panels instead would make every Compose
    // step of the backward wait on memory.
    // One run of tiles over all keys of a block: any rank may take any tile.
    init_slabs<A>(M, Bq, 3, index_t(1024) << 10, mask.max_block_keys(Bq), 1);
  }
};

/// One thread's buffers for backward_group, made once per call before the team starts, so that
/// no allocation can fail once outputs are being written.
template <class A>
struct BackwardThreadBuffers {
  std::vector<ComposeRow<A>> pre_rows, post_rows;  // query-wise terms of each row of a block
  Buffer<A> scratch;
  Buffer<A> row_d;    // [row][m]: D summed over the tiles
  Buffer<A> dq_rows;  // one head's dQ rows of the block, summed over the tiles
  // In the Workspace: P' of one tile ([row][m][key]) and a key tile of K or V packed for the
  // tile products (gemm.hpp).
  A* ptile = nullptr;
  A* kbuf = nullptr;

  /// For thread `thread` of a call whose team works with `ws` (initialized).
  BackwardThreadBuffers(const BackwardWorkspace<A>& ws, const detail::AttentionDims& d,
                        Workspace& mem, int thread)
      : pre_rows(ws.Bq),
        post_rows(ws.Bq),
        scratch(std::max(ws.pre.scratch_size(), ws.post.scratch_size())),
        row_d(ws.Bq * d.M),
        dq_rows(ws.Bq * d.D) {
    for (auto& r : pre_rows) r.init(ws.pre);
    for (auto& r : post_rows) r.init(ws.post);
    if (ws.post.on) ptile = detail::WorkspaceAccess::per_thread<A>(mem, thread, 0, ws.slab);
    kbuf = detail::WorkspaceAccess::per_thread<A>(mem, thread, 1, std::max(d.D, d.Dv) * ws.tile);
  }
};

/// One (batch, group): every query block of it, the keys shared across the team. dk and dv: the
/// accumulators of dK and dV (the caller's tensors, or float ones for narrow storage), zero on
/// entry for the group's kv heads. dw_pre / dw_post: the accumulators of the static weights'
/// gradients for (b, g) (M x M, the same for every rank; rank 0 adds the block's tile sums), or
/// null.
///
/// Per block, two passes over the block's key tiles, as in the forward, each tile taken by one
/// thread (TileQueue). Pass 1: L, P (from the saved statistics), dP' = dO V^T, dV += P'^T dO,
/// dP = Compose_post^T(dP'), and the tile's part of D = sum_s P dP. Pass 2, once D is summed over
/// the tiles: dL' = P (dP - D), dL = Compose_pre^T(dL'), dK += dL^T Q. Then dQ = dL K, a head at
/// a time, and the per-tile sums of the compose gradients.
template <class T, class A>
void backward_group(const Team& team, BackwardWorkspace<A>& ws, const RowMask& mask, A scale,
                    const detail::AttentionDims& d, index_t b, index_t g, TensorView<const T, 4> q,
                    TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<const A, 3> lse,
                    TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<A, 4> dk,
                    TensorView<A, 4> dv, const ComposeWeights<T>& cw, const ComposeGrads<T>& dcw,
                    A* dw_pre, A* dw_post, BackwardThreadBuffers<A>& buffers) {
  using namespace detail_bwd;
  const int tid = team.rank, nth = team.size;
  const index_t M = d.M, D = d.D, Dv = d.Dv, group_of_kv = d.H / d.Hk;
  const index_t Bq = ws.Bq, keys_per_tile = ws.tile, row_stride = ws.row_stride;
  KernelComposeTerms<A>& pre = ws.pre;
  KernelComposeTerms<A>& post = ws.post;

  std::vector<ComposeRow<A>>& pre_rows = buffers.pre_rows;
  std::vector<ComposeRow<A>>& post_rows = buffers.post_rows;
  Buffer<A>& scratch = buffers.scratch;
  const ComposeFn<A> pre_fn(pre), post_fn(post);
  const ComposeBackwardFn<A> pre_bwd(pre), post_bwd(post);
  A* const ptile = buffers.ptile;
  A* const kbuf = buffers.kbuf;
  // The team's: this block's rows of Q (scaled) and dO for every head, packed once per block and
  // shared by every tile.
  A* packed_q = ws.packed_q;
  A* packed_dout = ws.packed_dout;
  Buffer<A>& row_d = buffers.row_d;
  Buffer<A>& dq_rows = buffers.dq_rows;
  // The same keys of the next kv head, for the packing routines to prefetch.
  auto next_head = [&](const TensorView<const T, 4>& x, index_t m, index_t p) {
    return next_kv_rows(x, b, g * M + m, g * M + M, group_of_kv, p);
  };
  auto tiles_of = [&](index_t t0) {
    if (t0 >= d.T) return index_t(0);
    const KeyRange keys = mask.rows(b, t0, std::min(d.T, t0 + Bq));
    return (std::max<index_t>(keys.end - keys.begin, 0) + keys_per_tile - 1) / keys_per_tile;
  };
  // The rows of the block at t0 that enter the products: [lo, lo + n), none if it sees no keys.
  struct LiveRows {
    index_t lo = 0, n = 0;
  };
  auto live_rows_of = [&](index_t t0) {
    LiveRows r;
    if (tiles_of(t0) == 0) return r;
    index_t hi;
    mask.live_rows(b, t0, std::min(d.T, t0 + Bq), r.lo, hi);
    r.n = std::max<index_t>(hi - r.lo, 0);
    return r;
  };
  // Head m's live rows of the block at t0 into packed_q / packed_dout.
  auto pack_head = [&](index_t t0, const LiveRows& r, index_t m) {
    const index_t h = g * M + m;
    pack_rows<A>(r.n, D, row_ptr(q, b, h, t0 + r.lo), q.stride[2], packed_q + (m * Bq + r.lo) * D,
                 D, scale);
    pack_rows<A>(r.n, Dv, row_ptr(dout, b, h, t0 + r.lo), dout.stride[2],
                 packed_dout + (m * Bq + r.lo) * Dv, Dv);
  };

  index_t s0, s1;
  split_range(0, d.S, tid, nth, 1, s0, s1);
  if (pre.on) pre.load(cw.pre, b, g, s0, s1);
  if (post.on) post.load(cw.post, b, g, s0, s1);
  ws.pass1.reset(tid, nth, tiles_of(0));
  index_t m0, m1;
  split_range(0, M, tid, nth, 1, m0, m1);
  const LiveRows first = live_rows_of(0);
  for (index_t m = m0; m < m1; ++m)
    pack_head(0, first, m);  // later blocks' are packed in the dQ loop
  const index_t heads_base = ws.heads_taken.load(std::memory_order_relaxed);
  team.sync();
  for (index_t t0 = 0, block = 0; t0 < d.T; t0 += Bq, ++block) {
    const index_t t1 = std::min(d.T, t0 + Bq), nr = t1 - t0;
    const KeyRange keys = mask.rows(b, t0, t1);
    // Only rows [lo, hi) see keys (the rows whose Q and dO were packed). The others (padding,
    // causal rows before the first key) get zero gradients and are never read: the caller's Q
    // and dO rows there may hold anything, and a zero probability times a NaN is still NaN.
    const LiveRows live = live_rows_of(t0);
    const index_t lo = live.lo, block_live_rows = live.n, hi = lo + block_live_rows;
    const index_t c0 = keys.begin, ntiles = tiles_of(t0),
                  c1 = std::min(keys.end, c0 + ntiles * keys_per_tile);
    ws.pass2.reset(tid, nth, ntiles);  // its last take() was before the previous block's barrier
    for (index_t i = 0; i < nr; ++i) {
      pre_rows[i].load(pre, cw.pre, b, t0 + i, g);
      post_rows[i].load(post, cw.post, b, t0 + i, g);
    }
    // A head's packed Q and dO rows, for the product before theirs to ask for (null past the last
    // head).
    auto q_rows = [&](index_t m) {
      return next_rows(m < M ? packed_q + (m * Bq + lo) * D : nullptr, block_live_rows, D, D);
    };
    auto dout_rows = [&](index_t m) {
      return next_rows(m < M ? packed_dout + (m * Bq + lo) * Dv : nullptr, block_live_rows, Dv, Dv);
    };
    // Tile `tile`'s keys [cs, ce) and its slabs.
    struct TileKeys {
      index_t cs, ce, n;
      A *probs_slab, *scores_slab, *grads_slab;
    };
    auto tile_keys = [&](index_t tile) {
      TileKeys tk;
      tk.cs = c0 + tile * keys_per_tile;
      tk.ce = std::min(c1, tk.cs + keys_per_tile);
      tk.n = tk.ce - tk.cs;
      // probs_slab[i * row_stride + m * keys_per_tile + (s - cs)] holds key s
      tk.probs_slab = ws.slab_of(ws.probs_panel, tile);
      tk.scores_slab = pre.on ? ws.slab_of(ws.scores_panel, tile) : tk.probs_slab;
      tk.grads_slab = ws.slab_of(ws.grads_panel, tile);
      return tk;
    };

    // Zeroes tile `tile`'s sums of one side's query-wise gradients (its rows [lo, hi), one run)
    // and static-weight gradient; returns the latter.
    auto zero_tile_grads = [&](const KernelComposeTerms<A>& side, ComposeStage stage,
                               index_t tile) {
      if (side.has_q && hi > lo) {
        const ComposeRowGrads<A> r = ws.row_grads(side, stage, tile, lo);
        std::fill(r.sums, r.sums + (hi - lo) * r.count, A(0));
      }
      A* dw = ws.dw_of(side, stage, tile);
      if (dw) std::fill(dw, dw + M * M, A(0));
      return dw;
    };

    // Pass 1.
    for (index_t tile; (tile = ws.pass1.take(tid)) >= 0;) {
      const auto [cs, ce, n, probs_slab, scores_slab, grads_slab] = tile_keys(tile);
      A* const dw_post_tile = zero_tile_grads(post, ComposeStage::post, tile);
      for (index_t m = 0; m < M; ++m) {
        const index_t hk = (g * M + m) / group_of_kv;
        // Scores from the packed, scaled Q rows (contiguous) rather than the caller's (a page
        // apart).
        gemm_abt<A>(block_live_rows, n, D, packed_q + (m * Bq + lo) * D, D, row_ptr(k, b, hk, cs),
                    k.stride[2], scores_slab + lo * row_stride + m * keys_per_tile, row_stride,
                    A(1), kbuf, {next_rows(next_head(k, m, cs), n, k.stride[2], D), dout_rows(m)});
        gemm_abt<A>(block_live_rows, n, Dv, packed_dout + (m * Bq + lo) * Dv, Dv,
                    row_ptr(v, b, hk, cs), v.stride[2],
                    grads_slab + lo * row_stride + m * keys_per_tile, row_stride, A(1), kbuf,
                    {next_rows(next_head(v, m, cs), n, v.stride[2], Dv), q_rows(m + 1)});
      }
      // Chunks outer: a chunk's key-wise terms stay in L1 while every row uses them.
      if (pre.on)
        for (index_t s = cs; s < ce; s += kChunk) {
          const int nc = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i)
            pre_fn(pre, pre_rows[i], s, nc, scores_slab + i * row_stride + (s - cs), keys_per_tile,
                   probs_slab + i * row_stride + (s - cs), keys_per_tile, nullptr, scratch.data(),
                   i + 1 < hi ? scores_slab + (i + 1) * row_stride + (s - cs) : nullptr);
        }
      for (index_t i = 0; i < nr; ++i) {
        const KeyRange r = mask.row(b, t0 + i);
        const index_t vb = std::max(r.begin, cs), ve = std::min(r.end, ce);
        for (index_t m = 0; m < M; ++m) {
          A* row = probs_slab + i * row_stride + m * keys_per_tile - cs;  // row[s] holds key s
          if (ve > vb) {
            Segment<A> p(row + vb, ve - vb);
            p = (p - lse(b, g * M + m, t0 + i)).exp();
          }
          for (index_t s = cs; s < std::min(vb, ce); ++s) row[s] = A(0);
          for (index_t s = std::max(ve, cs); s < ce; ++s) row[s] = A(0);
        }
      }
      // P' = Compose_post(P) (P itself without post compose), then dV += P'^T dO.
      const A* Pt = post.on ? ptile : probs_slab;
      if (post.on)
        for (index_t s = cs; s < ce; s += kChunk) {
          const int nc = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i)
            post_fn(post, post_rows[i], s, nc, probs_slab + i * row_stride + (s - cs),
                    keys_per_tile, ptile + i * row_stride + (s - cs), keys_per_tile, nullptr,
                    scratch.data(), nullptr);
        }
      for (index_t m = 0; m < M; ++m)
        gemm_nn<A>(n, Dv, block_live_rows, Pt + lo * row_stride + m * keys_per_tile, 1, row_stride,
                   packed_dout + (m * Bq + lo) * Dv, Dv,
                   row_ptr(dv, b, (g * M + m) / group_of_kv, cs), dv.stride[2], true,
                   {{}, dout_rows(m + 1)});
      if (post.on) {
        for (index_t s = cs; s < ce; s += kChunk) {
          const int nc = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i) {
            A* grad_chunk = grads_slab + i * row_stride + (s - cs);
            ComposeRowGrads<A> rg = ws.row_grads(post, ComposeStage::post, tile, i);
            post_bwd(post, post_rows[i], s, nc, probs_slab + i * row_stride + (s - cs),
                     keys_per_tile, grad_chunk, keys_per_tile, grad_chunk, keys_per_tile, rg,
                     ws.post_kg, dw_post_tile, scratch.data(),
                     i + 1 < hi ? grad_chunk + row_stride : nullptr, keys_per_tile);
          }
        }
      }
      A* dt = ws.d_tile.data() + tile * M * Bq;
      A* pt = ws.p_tile.data() + tile * M * Bq;
      for (index_t i = lo; i < hi; ++i)
        for (index_t m = 0; m < M; ++m) {
          const Segment<A> p(probs_slab + i * row_stride + m * keys_per_tile, n);
          dt[m * Bq + i] =
              (p * Segment<A>(grads_slab + i * row_stride + m * keys_per_tile, n)).sum();
          pt[m * Bq + i] = p.sum();
        }
    }
    team.sync();

    // Pass 2.
    // D = sum P dP / sum P. P comes from the saved lse, a float off by up to 2^-24 |lse| from
    // the row's true log-sum: every probability of the row carries the same factor, so P sums
    // to 1 + e. Unnormalized, dS = P (dP - D) would sum to e D over the row instead of 0, and
    // gradients that add dS over keys with a common part (dQ through keys that share a direction,
    // the pre-compose weights through scores of 1e4) would lose all their digits at |lse| = 1e4.
    // Normalized, every gradient is off by the factor 1 + e alone.
    for (index_t i = lo; i < hi; ++i)
      for (index_t m = 0; m < M; ++m) {
        A Dm = 0, Pm = 0;
        for (index_t tile = 0; tile < ntiles; ++tile) {
          Dm += ws.d_tile[(tile * M + m) * Bq + i];
          Pm += ws.p_tile[(tile * M + m) * Bq + i];
        }
        row_d[i * M + m] = Pm > 0 ? Dm / Pm : A(0);
      }
    for (index_t tile; (tile = ws.pass2.take(tid)) >= 0;) {
      const auto [cs, ce, n, probs_slab, scores_slab, grads_slab] = tile_keys(tile);
      A* const dw_pre_tile = zero_tile_grads(pre, ComposeStage::pre, tile);
      // The slabs were written in pass 1, long enough ago to have left the cache.
      for (index_t i = lo; i < hi; ++i) {
        for (index_t m = 0; m < M; ++m) {
          if (i + 1 < hi) {  // the next row's, head by head (one burst per row would stall)
            prefetch_bytes(probs_slab + (i + 1) * row_stride + m * keys_per_tile,
                           n * index_t(sizeof(A)));
            prefetch_bytes(grads_slab + (i + 1) * row_stride + m * keys_per_tile,
                           n * index_t(sizeof(A)));
          }
          Segment<A> dp(grads_slab + i * row_stride + m * keys_per_tile, n);
          dp = Segment<A>(probs_slab + i * row_stride + m * keys_per_tile, n) *
               (dp - row_d[i * M + m]);
        }
      }
      if (pre.on)
        for (index_t s = cs; s < ce; s += kChunk) {
          const int nc = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i) {
            A* grad_chunk = grads_slab + i * row_stride + (s - cs);
            ComposeRowGrads<A> rg = ws.row_grads(pre, ComposeStage::pre, tile, i);
            pre_bwd(pre, pre_rows[i], s, nc, scores_slab + i * row_stride + (s - cs), keys_per_tile,
                    grad_chunk, keys_per_tile, grad_chunk, keys_per_tile, rg, ws.pre_kg,
                    dw_pre_tile, scratch.data(),
                    i + 1 < hi ? scores_slab + (i + 1) * row_stride + (s - cs) : nullptr,
                    keys_per_tile);
          }
        }
      for (index_t m = 0; m < M; ++m)
        gemm_nn<A>(n, D, block_live_rows, grads_slab + lo * row_stride + m * keys_per_tile, 1,
                   row_stride, packed_q + (m * Bq + lo) * D, D,
                   row_ptr(dk, b, (g * M + m) / group_of_kv, cs), dk.stride[2], true,
                   {{}, q_rows(m + 1)});
    }
    ws.pass1.reset(tid, nth, tiles_of(t1));  // every take() of this block's pass 1 is done
    team.sync();

    // dQ = dL K head by head, over every tile of the block in tile order, each head by one thread:
    // per tile, every head's dQ rows (M x Bq x D values, more than L2) would be read and written
    // again; this way one head's stay in L1 and the tiles' dL and K rows, read once more, are
    // asked for ahead (the next tile's; after the last, head m + 1's first, which another thread
    // may take, but its K rows are then on their way into L3).
    const index_t heads_ticket = heads_base + block * (M + nth);
    const LiveRows next_block = live_rows_of(t1);
    for (index_t m;
         (m = ws.heads_taken.fetch_add(1, std::memory_order_relaxed) - heads_ticket) < M;) {
      const index_t hk = (g * M + m) / group_of_kv;
      for (index_t tile = 0; tile < ntiles; ++tile) {
        const index_t cs = c0 + tile * keys_per_tile, n = std::min(c1, cs + keys_per_tile) - cs;
        const A* dL = ws.slab_of(ws.grads_panel, tile) + lo * row_stride + m * keys_per_tile;
        NextReads next;
        if (tile + 1 < ntiles) {
          const index_t nn = std::min(keys_per_tile, c1 - cs - keys_per_tile);
          next = {next_rows(row_ptr(k, b, hk, cs + keys_per_tile), nn, k.stride[2], D),
                  next_rows(dL + ws.slab, block_live_rows, row_stride, nn)};
        } else if (m + 1 < M) {
          const index_t nn = std::min(keys_per_tile, c1 - c0);
          next = {
              next_rows(row_ptr(k, b, (g * M + m + 1) / group_of_kv, c0), nn, k.stride[2], D),
              next_rows(ws.slab_of(ws.grads_panel, 0) + lo * row_stride + (m + 1) * keys_per_tile,
                        block_live_rows, row_stride, nn)};
        }
        gemm_ab<A>(block_live_rows, D, n, dL, row_stride, 1, row_ptr(k, b, hk, cs), k.stride[2],
                   dq_rows.data() + lo * D, D, tile > 0, kbuf, scale, next);
      }
      for (index_t i = 0; i < nr; ++i) {
        T* out = row_ptr(dq, b, g * M + m, t0 + i);
        if (ntiles == 0 || i < lo || i >= hi)
          std::fill(out, out + D, T(0));
        else
          narrow_row(dq_rows.data() + i * D, out, D);
      }
      // The next block's rows of this head: pass 2 has read this block's (dK), and the next
      // block's pass 1 starts after the barrier below. Shared, so packed once, not per thread.
      pack_head(t1, next_block, m);
    }
    // The query-wise gradients and the static weights', summed over the tiles in tile order.
    index_t r0, r1;
    split_range(0, nr, tid, nth, 1, r0, r1);
    for (index_t i = r0; i < r1; ++i) {
      const index_t count = i >= lo && i < hi ? ntiles : 0;
      store_row_grads(pre, ws.row_grads(pre, ComposeStage::pre, 0, i).sums,
                      Bq * ComposeRowGrads<A>::size(pre), count, dcw.pre, b, t0 + i, g,
                      scratch.data());
      store_row_grads(post, ws.row_grads(post, ComposeStage::post, 0, i).sums,
                      Bq * ComposeRowGrads<A>::size(post), count, dcw.post, b, t0 + i, g,
                      scratch.data());
    }
    if (tid == 0)
      for (int stage_index = 0; stage_index < 2; ++stage_index) {
        const ComposeStage stage = static_cast<ComposeStage>(stage_index);
        const KernelComposeTerms<A>& side = stage == ComposeStage::post ? post : pre;
        A* dw = stage == ComposeStage::post ? dw_post : dw_pre;
        if (!side.has_w || !dw || block_live_rows == 0) continue;
        for (index_t tile = 0; tile < ntiles; ++tile) {
          const A* part = ws.dw_of(side, stage, tile);
          for (index_t j = 0; j < M * M; ++j) dw[j] += part[j];
        }
      }
    team.sync();  // the next block overwrites the slabs and the per-tile sums read above
  }
  if (pre.has_k || post.has_k) {
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
  const index_t panel_set = BackwardWorkspace<A>::memory_size(d, mask, cw, items);

  // Static weights' gradients: one M x M accumulator per (batch, group), summed over the batch in
  // a fixed order at the end, so the result does not depend on which thread ran which item.
  const bool w_pre = cw.pre.static_w, w_post = cw.post.static_w;
  Buffer<A> dw_pre(w_pre ? d.B * G * M * M : 0, A(0));
  Buffer<A> dw_post(w_post ? d.B * G * M * M : 0, A(0));
  auto dw_slot = [&](Buffer<A>& buf, index_t b, index_t g) -> A* {
    return buf.empty() ? nullptr : buf.data() + (b * G + g) * M * M;
  };

  detail::WorkspaceAccess::reserve_slots(mem, nt);
  RegionErrors errors;
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
    A* panels = detail::WorkspaceAccess::shared<A>(mem, 0, nt * panel_set);
#pragma omp parallel num_threads(nt)
    {
      BackwardWorkspace<A> ws;
      std::optional<BackwardThreadBuffers<A>> buffers;
      errors.attempt([&] {
        ws.init(d, mask, cw, 1, items, panels + thread_id() * panel_set);
        buffers.emplace(ws, d, mem, thread_id());
      });
      barrier();
      if (!errors.failed()) {
#pragma omp for schedule(dynamic, 1)
        for (index_t it = 0; it < items; ++it) {
          const index_t b = it / (G / groups_per_item),
                        g0 = it % (G / groups_per_item) * groups_per_item;
          const index_t hk0 = g0 * M / group_of_kv, hk1 = (g0 + groups_per_item) * M / group_of_kv;
          for (index_t hk = hk0; hk < hk1; ++hk)
            for (index_t s = 0; s < d.S; ++s) {
              mutable_rows_of(dk_acc, b, hk, s, 1).setZero();
              mutable_rows_of(dv_acc, b, hk, s, 1).setZero();
            }
          for (index_t g = g0; g < g0 + groups_per_item; ++g)
            backward_group(Team{0, 1}, ws, mask, scale, d, b, g, q, k, v, lse, dout, dq, dk_acc,
                           dv_acc, cw, dcw, dw_slot(dw_pre, b, g), dw_slot(dw_post, b, g),
                           *buffers);
          if constexpr (narrow) {
            narrow_rows(dk_acc, dk, (b * d.Hk + hk0) * d.S, (b * d.Hk + hk1) * d.S);
            narrow_rows(dv_acc, dv, (b * d.Hk + hk0) * d.S, (b * d.Hk + hk1) * d.S);
          }
        }
      }
    }
  } else {
    BackwardWorkspace<A> ws;
    ws.init(d, mask, cw, nt, items, detail::WorkspaceAccess::shared<A>(mem, 0, panel_set));
#pragma omp parallel num_threads(nt)
    {
      const Team team{thread_id(), team_size()};
      std::optional<BackwardThreadBuffers<A>> buffers;
      errors.attempt([&] { buffers.emplace(ws, d, mem, thread_id()); });
      barrier();
      if (!errors.failed()) {
        zero_rows(dk_acc, team.rank, team.size);
        zero_rows(dv_acc, team.rank, team.size);
        team.sync();
        for (index_t b = 0; b < d.B; ++b)
          for (index_t g = 0; g < G; ++g)
            backward_group(team, ws, mask, scale, d, b, g, q, k, v, lse, dout, dq, dk_acc, dv_acc,
                           cw, dcw, dw_slot(dw_pre, b, g), dw_slot(dw_post, b, g), *buffers);
        if constexpr (narrow) {  // backward_group ends at a barrier: every block has added its part
          index_t r0, r1;
          split_range(0, d.B * d.Hk * d.S, team.rank, team.size, 1, r0, r1);
          narrow_rows(dk_acc, dk, r0, r1);
          narrow_rows(dv_acc, dv, r0, r1);
        }
      }
    }
  }
  errors.rethrow_first();

  for (int side = 0; side < 2; ++side) {
    Buffer<A>& parts = side ? dw_post : dw_pre;
    const TensorView<T, 3>& out = side ? dcw.post.w : dcw.pre.w;
    if (parts.empty()) continue;
    for (index_t g = 0; g < G; ++g)
      for (index_t m = 0; m < M; ++m)
        for (index_t n = 0; n < M; ++n) {
          A s = 0;
          for (index_t b = 0; b < d.B; ++b) s += dw_slot(parts, b, g)[m * M + n];
          out(g, m, n) = T(s);
        }
  }
}

}  // namespace dcmha::cpu

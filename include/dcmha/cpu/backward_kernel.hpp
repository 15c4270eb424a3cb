#pragma once
// The CPU backward kernel of the attention core (MHA and DCMHA): the work on one (batch, group),
// every query block of it, for one thread or a team. backward_launch.hpp decides who runs which.
//
// For one (batch, group, query block) the kernel recomputes the scores of its keys and keeps
// three panels of M x Bq x S values: L (Compose_pre's input, needed for its weight gradients),
// P, and dP' = dO V^T, which turns into dP = Compose_post^T(dP') and then into dL. The softmax
// term needs D = sum_s P dP per row and head: unlike FlashAttention this is not rowsum(dO * O),
// because Compose_post mixes heads between P and O, so it is summed over all keys at a barrier.
//
// Per block, two passes over the block's key tiles, as in the forward, each tile taken by one
// thread (TileQueue). Pass 1: L, P (from the saved statistics), dP' = dO V^T, dV += P'^T dO,
// dP = Compose_post^T(dP'), and the tile's part of D. Pass 2, once D is summed over the tiles:
// dL' = P (dP - D), dL = Compose_pre^T(dL'), dK += dL^T Q. Then dQ = dL K, a head at a time,
// and the per-tile sums of the compose gradients.
//
// One thread does all of a tile's work in a pass, so dK, dV and the key-wise compose gradients
// are accumulated without races or atomics. What sums over keys (D, the query-wise and static
// compose gradients) is kept per tile and summed in tile order, and dQ is summed over the tiles
// a head at a time by one thread: the results are the same for every thread count and schedule,
// bit for bit.
#include <algorithm>
#include <atomic>
#include <vector>

#include "../common/mask.hpp"
#include "../compose_weights.hpp"
#include "../detail/dims.hpp"
#include "../params.hpp"
#include "../tensor.hpp"
#include "../workspace.hpp"
#include "compose.hpp"
#include "compose_simd.hpp"
#include "convert.hpp"
#include "gemm.hpp"
#include "launch_plan.hpp"
#include "parallel.hpp"
#include "softmax.hpp"
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
  // bf16 products (bf16_products.hpp), in place of packed_q and packed_dout: the block's Q and dO
  // rows as pairs along D ([m][row][pair_count(D or Dv)], A of the scores and dP') and as pairs
  // of rows ([m][pair_count(Bq)][D or Dv], B of dK and dV). Q is not scaled here.
  bool bf16_products = false;
  Buffer<std::uint32_t> q_pairs, dout_pairs, q_interleaved, dout_interleaved;
  TileQueue pass1, pass2;
  std::atomic<index_t> heads_taken{0};  // dQ's heads: a ticket counter, never reset

  /// Values of Workspace memory one team needs, whole cache lines (see
  /// ForwardWorkspace::memory_size).
  /// `items`: the call's (batch, group) items (see backward()).
  template <class T>
  static index_t memory_size(const detail::AttentionDims& d, const detail::RowMask& mask,
                             const ComposeWeights<T>& cw, index_t items) {
    BackwardWorkspace w;
    w.layout(d, mask, items);
    return round_up((cw.pre.enabled() ? 3 : 2) * w.panel_size(1) + w.Bq * d.M * (d.D + d.Dv),
                    64 / index_t(sizeof(A)));
  }

  /// `memory`: memory_size() values, written before they are read.
  template <class T>
  void init(const detail::AttentionDims& d, const detail::RowMask& mask,
            const ComposeWeights<T>& cw, int team_size, index_t items, A* memory,
            bool use_bf16_products) {
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
    bf16_products = use_bf16_products;
    if (bf16_products) {
      q_pairs.assign(M * Bq * pair_count(d.D), 0);
      dout_pairs.assign(M * Bq * pair_count(d.Dv), 0);
      q_interleaved.assign(M * pair_count(Bq) * d.D, 0);
      dout_interleaved.assign(M * pair_count(Bq) * d.Dv, 0);
    }
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
  void layout(const detail::AttentionDims& d, const detail::RowMask& mask, index_t items) {
    Bq = backward_block_rows<A>(d, mask, items);
    // Keys per tile: the tile's slabs of the three panels (3 x M x Bq x tile values, at least 32
    // keys: 1.5 MiB at H32 with 128-row blocks) are produced and consumed while they are in L2
    // or close to it, as in the forward. Sweeping whole panels instead would make every Compose
    // step of the backward wait on memory. One run of tiles over all keys of a block: any rank
    // may take any tile.
    init_slabs<A>(d.M, Bq, 3, kBackwardSlabBytes, mask.max_block_keys(Bq), 1);
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
  // bf16 products: a tile's P' or dS (transposed or not) as pairs; a key tile of K or V as pairs.
  Buffer<std::uint32_t> a_pairs, b_pairs;

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
    if (ws.bf16_products) {
      const index_t width = std::max(d.D, d.Dv);
      a_pairs.assign(std::max(ws.Bq * pair_count(ws.tile), ws.tile * pair_count(ws.Bq)), 0);
      b_pairs.assign(std::max(pair_count(width) * ws.tile, pair_count(ws.tile) * width), 0);
    }
  }
};

/// dK and dV accumulators of a call: the caller's tensors, or float ones for narrow storage.
template <class A>
struct KeyValueGrads {
  TensorView<A, 4> dk, dv;
};

/// A query block of the current (batch, group): rows [t0, t0 + rows), of which [lo, hi) see keys
/// (the rows whose Q and dO were packed; the others, padding or causal rows before the first
/// key, get zero gradients and are never read: the caller's Q and dO rows there may hold
/// anything, and a zero probability times a NaN is still NaN), and `tiles` key tiles from
/// key_begin, the last ending at key_end.
struct BackwardBlock {
  index_t index = 0, t0 = 0, rows = 0;
  index_t lo = 0, hi = 0, live_rows = 0;
  index_t key_begin = 0, key_end = 0, tiles = 0;
};

/// A block's key tile: keys [begin, end), n of them, and its slabs of the three panels
/// (probs_slab[i * row_stride + m * tile + (s - begin)] holds key s of row i, head m).
template <class A>
struct BackwardTile {
  index_t index = 0, begin = 0, end = 0, n = 0;
  A *probs_slab = nullptr, *scores_slab = nullptr, *grads_slab = nullptr;
};

/// The rows of the block at t0 that enter the products: [lo, lo + n), none if it sees no keys.
struct LiveRows {
  index_t lo = 0, n = 0;
};

/// The backward of one (batch, group) at a time, every query block of it, for one thread
/// (Team{0, 1}) or a team sharing each block's key tiles. Holds references and the current
/// group's indices.
template <class T, class A>
class BackwardKernel {
 public:
  BackwardKernel(const detail::BackwardParams<T>& params, const detail::RowMask& mask,
                 const Team& team, BackwardWorkspace<A>& ws, BackwardThreadBuffers<A>& buffers,
                 const KeyValueGrads<A>& grads)
      : p_(params),
        mask_(mask),
        team_(team),
        ws_(ws),
        buf_(buffers),
        grads_(grads),
        pre_fn_(ws.pre),
        post_fn_(ws.post),
        pre_bwd_(ws.pre),
        post_bwd_(ws.post),
        M_(params.dims.M),
        group_of_kv_(params.dims.H / params.dims.Hk),
        bf16_products_(ws.bf16_products) {}

  /// Batch b, group g. The accumulators of dK and dV are zero on entry for the group's kv heads.
  /// dw_pre / dw_post: the accumulators of the static weights' gradients for (b, g) (M x M, the
  /// same for every rank; rank 0 adds the block's tile sums), or null.
  void run(index_t b, index_t g, A* dw_pre, A* dw_post) {
    b_ = b;
    g_ = g;
    dw_pre_ = dw_pre;
    dw_post_ = dw_post;
    start_group();
    for (index_t t0 = 0, index = 0; t0 < p_.dims.T; t0 += ws_.Bq, ++index) {
      const BackwardBlock block = start_block(t0, index);
      for (index_t tile; (tile = ws_.pass1.take(team_.rank)) >= 0;)
        pass1_tile(block, tile_at(block, tile));
      team_.sync();
      normalized_d(block);
      for (index_t tile; (tile = ws_.pass2.take(team_.rank)) >= 0;)
        pass2_tile(block, tile_at(block, tile));
      // every take() of this block's pass 1 is done
      ws_.pass1.reset(team_.rank, team_.size, tiles_of(t0 + block.rows));
      team_.sync();
      dq_heads(block);
      store_row_grads_of_block(block);
      if (team_.rank == 0) add_static_grads_of_block(block);
      team_.sync();  // the next block overwrites the slabs and the per-tile sums read above
    }
    store_key_grads_of_group();
    team_.sync();  // the next group reloads the compose sides
  }

 private:
  /// Loads the group's compose sides (a share of the keys per rank) and packs the first block's
  /// Q and dO rows (later blocks' are packed in the dQ loop).
  void start_group() {
    split_range(0, p_.dims.S, team_.rank, team_.size, 1, s0_, s1_);
    if (ws_.pre.on) ws_.pre.load(p_.compose.pre, b_, g_, s0_, s1_);
    if (ws_.post.on) ws_.post.load(p_.compose.post, b_, g_, s0_, s1_);
    ws_.pass1.reset(team_.rank, team_.size, tiles_of(0));
    index_t m0, m1;
    split_range(0, M_, team_.rank, team_.size, 1, m0, m1);
    const LiveRows first = live_rows_of(0);
    for (index_t m = m0; m < m1; ++m) pack_head(0, first, m);
    heads_base_ = ws_.heads_taken.load(std::memory_order_relaxed);
    team_.sync();
  }

  index_t tiles_of(index_t t0) const {
    if (t0 >= p_.dims.T) return 0;
    const detail::KeyRange keys = mask_.rows(b_, t0, std::min(p_.dims.T, t0 + ws_.Bq));
    return (std::max<index_t>(keys.end - keys.begin, 0) + ws_.tile - 1) / ws_.tile;
  }
  LiveRows live_rows_of(index_t t0) const {
    LiveRows r;
    if (tiles_of(t0) == 0) return r;
    index_t hi;
    mask_.live_rows(b_, t0, std::min(p_.dims.T, t0 + ws_.Bq), r.lo, hi);
    r.n = std::max<index_t>(hi - r.lo, 0);
    return r;
  }
  /// Head m's live rows of the block at t0 into packed_q (scaled) / packed_dout.
  void pack_head(index_t t0, const LiveRows& r, index_t m) {
    const index_t h = g_ * M_ + m, Bq = ws_.Bq, D = p_.dims.D, Dv = p_.dims.Dv;
    if constexpr (std::is_same_v<T, bf16>)
      if (bf16_products_) return pack_head_pairs(t0, r, m);
    pack_rows<A>(r.n, D, row_ptr(p_.q, b_, h, t0 + r.lo), p_.q.stride[2],
                 ws_.packed_q + (m * Bq + r.lo) * D, D, p_.scale);
    pack_rows<A>(r.n, Dv, row_ptr(p_.dout, b_, h, t0 + r.lo), p_.dout.stride[2],
                 ws_.packed_dout + (m * Bq + r.lo) * Dv, Dv);
  }

  /// pack_head for the bf16 products: head m's Q and dO rows both as pairs and interleaved.
  void pack_head_pairs(index_t t0, const LiveRows& r, index_t m) {
    const index_t h = g_ * M_ + m, Bq = ws_.Bq, D = p_.dims.D, Dv = p_.dims.Dv;
    const T* q = row_ptr(p_.q, b_, h, t0 + r.lo);
    const T* dout = row_ptr(p_.dout, b_, h, t0 + r.lo);
    bf16_pairs_of_rows(r.n, D, q, p_.q.stride[2], q_pairs(m, r.lo), pair_count(D));
    bf16_pairs_of_rows(r.n, Dv, dout, p_.dout.stride[2], dout_pairs(m, r.lo), pair_count(Dv));
    bf16_pairs_interleaved(r.n, D, q, p_.q.stride[2],
                           ws_.q_interleaved.data() + m * pair_count(Bq) * D, D);
    bf16_pairs_interleaved(r.n, Dv, dout, p_.dout.stride[2],
                           ws_.dout_interleaved.data() + m * pair_count(Bq) * Dv, Dv);
  }
  std::uint32_t* q_pairs(index_t m, index_t row) {
    return ws_.q_pairs.data() + (m * ws_.Bq + row) * pair_count(p_.dims.D);
  }
  std::uint32_t* dout_pairs(index_t m, index_t row) {
    return ws_.dout_pairs.data() + (m * ws_.Bq + row) * pair_count(p_.dims.Dv);
  }

  BackwardBlock start_block(index_t t0, index_t index) {
    BackwardBlock block;
    block.index = index;
    block.t0 = t0;
    block.rows = std::min(p_.dims.T, t0 + ws_.Bq) - t0;
    const detail::KeyRange keys = mask_.rows(b_, t0, t0 + block.rows);
    const LiveRows live = live_rows_of(t0);
    block.lo = live.lo;
    block.live_rows = live.n;
    block.hi = live.lo + live.n;
    block.key_begin = keys.begin;
    block.tiles = tiles_of(t0);
    block.key_end = std::min(keys.end, keys.begin + block.tiles * ws_.tile);
    // its last take() was before the previous block's barrier
    ws_.pass2.reset(team_.rank, team_.size, block.tiles);
    for (index_t i = 0; i < block.rows; ++i) {
      buf_.pre_rows[i].load(ws_.pre, p_.compose.pre, b_, t0 + i, g_);
      buf_.post_rows[i].load(ws_.post, p_.compose.post, b_, t0 + i, g_);
    }
    return block;
  }

  BackwardTile<A> tile_at(const BackwardBlock& block, index_t index) {
    BackwardTile<A> tile;
    tile.index = index;
    tile.begin = block.key_begin + index * ws_.tile;
    tile.end = std::min(block.key_end, tile.begin + ws_.tile);
    tile.n = tile.end - tile.begin;
    tile.probs_slab = ws_.slab_of(ws_.probs_panel, index);
    tile.scores_slab = ws_.pre.on ? ws_.slab_of(ws_.scores_panel, index) : tile.probs_slab;
    tile.grads_slab = ws_.slab_of(ws_.grads_panel, index);
    return tile;
  }

  /// Head m's packed Q and dO rows, for the product before theirs to ask for (null past the last
  /// head).
  NextRows q_rows(const BackwardBlock& block, index_t m) const {
    const index_t D = p_.dims.D;
    return next_rows(m < M_ ? ws_.packed_q + (m * ws_.Bq + block.lo) * D : nullptr, block.live_rows,
                     D, D);
  }
  NextRows dout_rows(const BackwardBlock& block, index_t m) const {
    const index_t Dv = p_.dims.Dv;
    return next_rows(m < M_ ? ws_.packed_dout + (m * ws_.Bq + block.lo) * Dv : nullptr,
                     block.live_rows, Dv, Dv);
  }
  /// The same keys of the next kv head, for the packing routines to prefetch.
  const T* next_head(const TensorView<const T, 4>& x, index_t m, index_t s) const {
    return next_kv_rows(x, b_, g_ * M_ + m, g_ * M_ + M_, group_of_kv_, s);
  }
  /// Head m's values of row i in a slab (the head's keys of the tile, contiguous).
  A* head_row(A* slab, index_t i, index_t m) const {
    return slab + i * ws_.row_stride + m * ws_.tile;
  }

  /// Zeroes the tile's sums of one side's query-wise gradients (its rows [lo, hi), one run) and
  /// static-weight gradient; returns the latter.
  A* zero_tile_grads(const KernelComposeTerms<A>& side, ComposeStage stage,
                     const BackwardBlock& block, index_t tile) {
    if (side.has_q && block.hi > block.lo) {
      const ComposeRowGrads<A> r = ws_.row_grads(side, stage, tile, block.lo);
      std::fill(r.sums, r.sums + (block.hi - block.lo) * r.count, A(0));
    }
    A* dw = ws_.dw_of(side, stage, tile);
    if (dw) std::fill(dw, dw + M_ * M_, A(0));
    return dw;
  }

  void pass1_tile(const BackwardBlock& block, const BackwardTile<A>& tile) {
    A* const dw_post_tile = zero_tile_grads(ws_.post, ComposeStage::post, block, tile.index);
    for (index_t m = 0; m < M_; ++m) scores_and_output_grads(block, tile, m);
    if (ws_.pre.on) compose_pre(block, tile);
    probabilities(block, tile);
    // P' = Compose_post(P) (P itself without post compose), then dV += P'^T dO.
    if (ws_.post.on) compose_post(block, tile);
    const A* probs = ws_.post.on ? buf_.ptile : tile.probs_slab;
    for (index_t m = 0; m < M_; ++m) value_grads(block, tile, probs, m);
    if (ws_.post.on) compose_post_backward(block, tile, dw_post_tile);
    tile_sums_of_d(block, tile);
  }

  /// Head m's scores (from the packed, scaled Q rows, contiguous, rather than the caller's, a
  /// page apart) and dP' = dO V^T.
  void scores_and_output_grads(const BackwardBlock& block, const BackwardTile<A>& tile, index_t m) {
    const index_t hk = (g_ * M_ + m) / group_of_kv_, D = p_.dims.D, Dv = p_.dims.Dv;
    const index_t Bq = ws_.Bq, lo = block.lo, row_stride = ws_.row_stride;
    const auto &k = p_.k, &v = p_.v;
    if constexpr (std::is_same_v<T, bf16>)
      if (bf16_products_) {
        bf16_product_abt(block.live_rows, tile.n, D, q_pairs(m, lo), pair_count(D),
                         {row_ptr(k, b_, hk, tile.begin), k.stride[2]},
                         {head_row(tile.scores_slab, lo, m), row_stride, p_.scale, false},
                         buf_.b_pairs.data());
        bf16_product_abt(block.live_rows, tile.n, Dv, dout_pairs(m, lo), pair_count(Dv),
                         {row_ptr(v, b_, hk, tile.begin), v.stride[2]},
                         {head_row(tile.grads_slab, lo, m), row_stride, 1.0f, false},
                         buf_.b_pairs.data());
        return;
      }
    gemm_abt<A>(
        block.live_rows, tile.n, D, ws_.packed_q + (m * Bq + lo) * D, D,
        row_ptr(k, b_, hk, tile.begin), k.stride[2], head_row(tile.scores_slab, lo, m), row_stride,
        A(1), buf_.kbuf,
        {next_rows(next_head(k, m, tile.begin), tile.n, k.stride[2], D), dout_rows(block, m)});
    gemm_abt<A>(
        block.live_rows, tile.n, Dv, ws_.packed_dout + (m * Bq + lo) * Dv, Dv,
        row_ptr(v, b_, hk, tile.begin), v.stride[2], head_row(tile.grads_slab, lo, m), row_stride,
        A(1), buf_.kbuf,
        {next_rows(next_head(v, m, tile.begin), tile.n, v.stride[2], Dv), q_rows(block, m + 1)});
  }

  /// The probabilities' input L' = Compose_pre(L), from the scores slab into the probs slab.
  void compose_pre(const BackwardBlock& block, const BackwardTile<A>& tile) {
    const index_t row_stride = ws_.row_stride, hi = block.hi;
    for_each_row_chunk(tile.begin, tile.end, block.lo, hi, [&](index_t s, int n, index_t i) {
      A* scores = tile.scores_slab + i * row_stride + (s - tile.begin);
      pre_fn_(ws_.pre, buf_.pre_rows[i], s, n, scores, ws_.tile,
              tile.probs_slab + i * row_stride + (s - tile.begin), ws_.tile, nullptr,
              buf_.scratch.data(), i + 1 < hi ? scores + row_stride : nullptr);
    });
  }

  /// P = exp(L' - lse) over each row's visible keys, 0 elsewhere.
  void probabilities(const BackwardBlock& block, const BackwardTile<A>& tile) {
    for (index_t i = 0; i < block.rows; ++i) {
      const detail::KeyRange r = mask_.row(b_, block.t0 + i);
      const index_t vb = std::max(r.begin, tile.begin), ve = std::min(r.end, tile.end);
      for (index_t m = 0; m < M_; ++m) {
        A* row = head_row(tile.probs_slab, i, m) - tile.begin;  // row[s] holds key s
        probabilities_from_lse(row, vb, ve, p_.lse(b_, g_ * M_ + m, block.t0 + i));
        zero_invisible_keys(row, tile.begin, tile.end, vb, ve);
      }
    }
  }

  /// P' = Compose_post(P) into the thread's tile buffer.
  void compose_post(const BackwardBlock& block, const BackwardTile<A>& tile) {
    const index_t row_stride = ws_.row_stride;
    for_each_row_chunk(tile.begin, tile.end, block.lo, block.hi, [&](index_t s, int n, index_t i) {
      post_fn_(ws_.post, buf_.post_rows[i], s, n,
               tile.probs_slab + i * row_stride + (s - tile.begin), ws_.tile,
               buf_.ptile + i * row_stride + (s - tile.begin), ws_.tile, nullptr,
               buf_.scratch.data(), nullptr);
    });
  }

  /// dV += P'^T dO for head m's kv head over the tile's keys.
  void value_grads(const BackwardBlock& block, const BackwardTile<A>& tile, const A* probs,
                   index_t m) {
    const index_t Dv = p_.dims.Dv, lo = block.lo;
    A* dv = row_ptr(grads_.dv, b_, (g_ * M_ + m) / group_of_kv_, tile.begin);
    if constexpr (std::is_same_v<T, bf16>)
      if (bf16_products_)
        return bf16_product_atb(tile.n, Dv, block.live_rows,
                                {probs + lo * ws_.row_stride + m * ws_.tile, ws_.row_stride},
                                ws_.dout_interleaved.data() + m * pair_count(ws_.Bq) * Dv, Dv,
                                {dv, grads_.dv.stride[2], 1.0f, true}, buf_.a_pairs.data());
    gemm_nn<A>(tile.n, Dv, block.live_rows, probs + lo * ws_.row_stride + m * ws_.tile, 1,
               ws_.row_stride, ws_.packed_dout + (m * ws_.Bq + lo) * Dv, Dv, dv,
               grads_.dv.stride[2], true, {{}, dout_rows(block, m + 1)});
  }

  /// dP = Compose_post^T(dP') in place, with the post side's weight gradients.
  void compose_post_backward(const BackwardBlock& block, const BackwardTile<A>& tile, A* dw) {
    // dP', written by the tile's first products, is the row asked for ahead.
    compose_backward(ws_.post, post_bwd_, ComposeStage::post, buf_.post_rows, ws_.post_kg, block,
                     tile, {tile.probs_slab, tile.grads_slab}, dw);
  }

  /// Compose's input slab (P for post, L for pre), and the slab whose next row is asked for ahead.
  struct TransposeSlabs {
    const A* inputs;
    const A* ahead;
  };

  /// The transpose of one side's Compose on the tile, in place in the grads slab.
  void compose_backward(const KernelComposeTerms<A>& side, const ComposeBackwardFn<A>& fn,
                        ComposeStage stage, const std::vector<ComposeRow<A>>& rows,
                        ComposeKeyGrads<A>& key_grads, const BackwardBlock& block,
                        const BackwardTile<A>& tile, TransposeSlabs slabs, A* dw) {
    const index_t row_stride = ws_.row_stride, hi = block.hi, keys = ws_.tile;
    for_each_row_chunk(tile.begin, tile.end, block.lo, hi, [&](index_t s, int n, index_t i) {
      A* grad_chunk = tile.grads_slab + i * row_stride + (s - tile.begin);
      const A* input = slabs.inputs + i * row_stride + (s - tile.begin);
      const A* ahead = slabs.ahead + (i + 1) * row_stride + (s - tile.begin);
      ComposeRowGrads<A> row_grads = ws_.row_grads(side, stage, tile.index, i);
      ComposeGradChunk<A> chunk;
      chunk.s = s;
      chunk.n = n;
      chunk.input = input;
      chunk.out_grad = chunk.in_grad = grad_chunk;
      chunk.input_hs = chunk.out_grad_hs = chunk.in_grad_hs = chunk.next_hs = keys;
      chunk.next = i + 1 < hi ? ahead : nullptr;
      fn(side, rows[i], chunk, {row_grads, key_grads, dw, buf_.scratch.data()});
    });
  }

  /// The tile's parts of D = sum_s P dP and of sum_s P, per row and head.
  void tile_sums_of_d(const BackwardBlock& block, const BackwardTile<A>& tile) {
    const index_t Bq = ws_.Bq;
    A* dt = ws_.d_tile.data() + tile.index * M_ * Bq;
    A* pt = ws_.p_tile.data() + tile.index * M_ * Bq;
    for (index_t i = block.lo; i < block.hi; ++i)
      for (index_t m = 0; m < M_; ++m) {
        const Segment<A> p(head_row(tile.probs_slab, i, m), tile.n);
        dt[m * Bq + i] = (p * Segment<A>(head_row(tile.grads_slab, i, m), tile.n)).sum();
        pt[m * Bq + i] = p.sum();
      }
  }

  /// D = sum P dP / sum P over the block's tiles. P comes from the saved lse, a float off by up
  /// to 2^-24 |lse| from the row's true log-sum: every probability of the row carries the same
  /// factor, so P sums to 1 + e. Unnormalized, dS = P (dP - D) would sum to e D over the row
  /// instead of 0, and gradients that add dS over keys with a common part (dQ through keys that
  /// share a direction, the pre-compose weights through scores of 1e4) would lose all their
  /// digits at |lse| = 1e4. Normalized, every gradient is off by the factor 1 + e alone.
  void normalized_d(const BackwardBlock& block) {
    const index_t Bq = ws_.Bq;
    for (index_t i = block.lo; i < block.hi; ++i)
      for (index_t m = 0; m < M_; ++m) {
        A d_sum = 0, p_sum = 0;
        for (index_t tile = 0; tile < block.tiles; ++tile) {
          d_sum += ws_.d_tile[(tile * M_ + m) * Bq + i];
          p_sum += ws_.p_tile[(tile * M_ + m) * Bq + i];
        }
        buf_.row_d[i * M_ + m] = p_sum > 0 ? d_sum / p_sum : A(0);
      }
  }

  void pass2_tile(const BackwardBlock& block, const BackwardTile<A>& tile) {
    A* const dw_pre_tile = zero_tile_grads(ws_.pre, ComposeStage::pre, block, tile.index);
    softmax_backward(block, tile);
    if (ws_.pre.on) compose_pre_backward(block, tile, dw_pre_tile);
    for (index_t m = 0; m < M_; ++m) key_grads(block, tile, m);
  }

  /// dL' = P (dP - D) in the grads slab. The slabs were written in pass 1, long enough ago to
  /// have left the cache: the next row's are asked for head by head (one burst per row would
  /// stall).
  void softmax_backward(const BackwardBlock& block, const BackwardTile<A>& tile) {
    const index_t bytes = tile.n * index_t(sizeof(A));
    for (index_t i = block.lo; i < block.hi; ++i)
      for (index_t m = 0; m < M_; ++m) {
        if (i + 1 < block.hi) {
          prefetch_bytes(head_row(tile.probs_slab, i + 1, m), bytes);
          prefetch_bytes(head_row(tile.grads_slab, i + 1, m), bytes);
        }
        Segment<A> dp(head_row(tile.grads_slab, i, m), tile.n);
        dp = Segment<A>(head_row(tile.probs_slab, i, m), tile.n) * (dp - buf_.row_d[i * M_ + m]);
      }
  }

  /// dL = Compose_pre^T(dL') in place, with the pre side's weight gradients.
  void compose_pre_backward(const BackwardBlock& block, const BackwardTile<A>& tile, A* dw) {
    compose_backward(ws_.pre, pre_bwd_, ComposeStage::pre, buf_.pre_rows, ws_.pre_kg, block, tile,
                     {tile.scores_slab, tile.scores_slab}, dw);
  }

  /// dK += dL^T Q for head m's kv head over the tile's keys.
  void key_grads(const BackwardBlock& block, const BackwardTile<A>& tile, index_t m) {
    const index_t D = p_.dims.D, lo = block.lo;
    if constexpr (std::is_same_v<T, bf16>)
      if (bf16_products_)
        return bf16_product_atb(tile.n, D, block.live_rows,
                                {head_row(tile.grads_slab, lo, m), ws_.row_stride},
                                ws_.q_interleaved.data() + m * pair_count(ws_.Bq) * D, D,
                                {row_ptr(grads_.dk, b_, (g_ * M_ + m) / group_of_kv_, tile.begin),
                                 grads_.dk.stride[2], p_.scale, true},
                                buf_.a_pairs.data());
    gemm_nn<A>(tile.n, D, block.live_rows, head_row(tile.grads_slab, lo, m), 1, ws_.row_stride,
               ws_.packed_q + (m * ws_.Bq + lo) * D, D,
               row_ptr(grads_.dk, b_, (g_ * M_ + m) / group_of_kv_, tile.begin),
               grads_.dk.stride[2], true, {{}, q_rows(block, m + 1)});
  }

  /// dQ = dL K head by head, over every tile of the block in tile order, each head by one thread:
  /// per tile, every head's dQ rows (M x Bq x D values, more than L2) would be read and written
  /// again; this way one head's stay in L1 and the tiles' dL and K rows, read once more, are
  /// asked for ahead. Then the head's rows of the next block are packed: pass 2 has read this
  /// block's (dK), and the next block's pass 1 starts after the barrier that follows.
  void dq_heads(const BackwardBlock& block) {
    const index_t heads_ticket = heads_base_ + block.index * (M_ + team_.size);
    const LiveRows next_block = live_rows_of(block.t0 + block.rows);
    for (index_t m;
         (m = ws_.heads_taken.fetch_add(1, std::memory_order_relaxed) - heads_ticket) < M_;) {
      for (index_t tile = 0; tile < block.tiles; ++tile) query_grads(block, tile, m);
      store_query_grads(block, m);
      pack_head(block.t0 + block.rows, next_block, m);
    }
  }

  /// Head m's dQ rows += (or =, for the first tile) dL K over one tile, asking for what the next
  /// product reads: the next tile's (after the last, head m + 1's first, which another thread
  /// may take, but its K rows are then on their way into L3).
  void query_grads(const BackwardBlock& block, index_t tile, index_t m) {
    const index_t D = p_.dims.D, keys = ws_.tile, row_stride = ws_.row_stride;
    const index_t hk = (g_ * M_ + m) / group_of_kv_, c0 = block.key_begin, c1 = block.key_end;
    const index_t cs = c0 + tile * keys, n = std::min(c1, cs + keys) - cs;
    const auto& k = p_.k;
    const A* dL = head_row(ws_.slab_of(ws_.grads_panel, tile), block.lo, m);
    NextReads next;
    if (tile + 1 < block.tiles) {
      const index_t nn = std::min(keys, c1 - cs - keys);
      next = {next_rows(row_ptr(k, b_, hk, cs + keys), nn, k.stride[2], D),
              next_rows(dL + ws_.slab, block.live_rows, row_stride, nn)};
    } else if (m + 1 < M_) {
      const index_t nn = std::min(keys, c1 - c0);
      next = {next_rows(row_ptr(k, b_, (g_ * M_ + m + 1) / group_of_kv_, c0), nn, k.stride[2], D),
              next_rows(head_row(ws_.slab_of(ws_.grads_panel, 0), block.lo, m + 1), block.live_rows,
                        row_stride, nn)};
    }
    if constexpr (std::is_same_v<T, bf16>)
      if (bf16_products_)
        return bf16_product_ab(block.live_rows, D, n, {dL, row_stride},
                               {row_ptr(k, b_, hk, cs), k.stride[2]},
                               {buf_.dq_rows.data() + block.lo * D, D, p_.scale, tile > 0},
                               buf_.a_pairs.data(), buf_.b_pairs.data());
    gemm_ab<A, T>(block.live_rows, D, n, {dL, row_stride}, {row_ptr(k, b_, hk, cs), k.stride[2]},
                  {buf_.dq_rows.data() + block.lo * D, D}, tile > 0, buf_.kbuf, p_.scale, next);
  }

  /// Head m's dQ rows of the block to the caller's tensor, zero where the row sees no key.
  void store_query_grads(const BackwardBlock& block, index_t m) {
    const index_t D = p_.dims.D;
    for (index_t i = 0; i < block.rows; ++i) {
      T* out = row_ptr(p_.dq, b_, g_ * M_ + m, block.t0 + i);
      if (block.tiles == 0 || i < block.lo || i >= block.hi)
        std::fill(out, out + D, T(0));
      else
        narrow_row(buf_.dq_rows.data() + i * D, out, D);
    }
  }

  /// The query-wise gradients of the block's rows, summed over the tiles in tile order; each rank
  /// stores a share of the rows.
  void store_row_grads_of_block(const BackwardBlock& block) {
    index_t r0, r1;
    split_range(0, block.rows, team_.rank, team_.size, 1, r0, r1);
    for (index_t i = r0; i < r1; ++i) {
      const index_t count = i >= block.lo && i < block.hi ? block.tiles : 0;
      for (const ComposeStage stage : {ComposeStage::pre, ComposeStage::post}) {
        const KernelComposeTerms<A>& side = stage == ComposeStage::post ? ws_.post : ws_.pre;
        const ComposeTermGrads<T>& out =
            stage == ComposeStage::post ? p_.dcompose.post : p_.dcompose.pre;
        detail_bwd::store_row_grads(side, ws_.row_grads(side, stage, 0, i).sums,
                                    ws_.Bq * ComposeRowGrads<A>::size(side), count, out, b_,
                                    block.t0 + i, g_, buf_.scratch.data());
      }
    }
  }

  /// The static weights' gradients of the block, summed over the tiles in tile order.
  void add_static_grads_of_block(const BackwardBlock& block) {
    for (const ComposeStage stage : {ComposeStage::pre, ComposeStage::post}) {
      const KernelComposeTerms<A>& side = stage == ComposeStage::post ? ws_.post : ws_.pre;
      A* dw = stage == ComposeStage::post ? dw_post_ : dw_pre_;
      if (!side.has_w || !dw || block.live_rows == 0) continue;
      for (index_t tile = 0; tile < block.tiles; ++tile) {
        const A* part = ws_.dw_of(side, stage, tile);
        for (index_t j = 0; j < M_ * M_; ++j) dw[j] += part[j];
      }
    }
  }

  /// The key-wise gradients of the rank's keys to the caller's tensors, and their accumulators
  /// zeroed for the next group.
  void store_key_grads_of_group() {
    if (!ws_.pre.has_k && !ws_.post.has_k) return;
    detail_bwd::store_key_grads(ws_.pre, ws_.pre_kg, p_.dcompose.pre, b_, g_, s0_, s1_);
    detail_bwd::store_key_grads(ws_.post, ws_.post_kg, p_.dcompose.post, b_, g_, s0_, s1_);
    const index_t kld = ws_.pre.ld;  // key-wise arrays: one row of every key per (r, m)
    for (auto* kg : {&ws_.pre_kg, &ws_.post_kg})
      for (auto* vec : {&kg->kw1, &kg->kw2, &kg->kdd})
        for (index_t r = 0; r < index_t(vec->size()) / kld; ++r)
          std::fill(vec->data() + r * kld + s0_, vec->data() + r * kld + s1_, A(0));
  }

  const detail::BackwardParams<T>& p_;
  const detail::RowMask& mask_;
  const Team& team_;
  BackwardWorkspace<A>& ws_;
  BackwardThreadBuffers<A>& buf_;
  const KeyValueGrads<A> grads_;
  const ComposeFn<A> pre_fn_, post_fn_;
  const ComposeBackwardFn<A> pre_bwd_, post_bwd_;
  const index_t M_, group_of_kv_;
  const bool bf16_products_;
  // The current group and the rank's share of its keys.
  index_t b_ = 0, g_ = 0, s0_ = 0, s1_ = 0;
  index_t heads_base_ = 0;  // heads_taken at the group's start
  A *dw_pre_ = nullptr, *dw_post_ = nullptr;
};

}  // namespace dcmha::cpu

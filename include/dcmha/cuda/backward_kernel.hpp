#pragma once
// The backward kernel bodies. Deterministic by construction: every gradient element is
// accumulated by one thread in a fixed order, and nothing uses atomics.
//
//   QueryGradKernel  one block per (query tile, group, sequence), two passes over the keys:
//                    D = rowsum(P * dP) first, then dQ, the query-wise terms' gradients and a
//                    per-block partial of the static W's; writes D for the key side.
//   KeyGradKernel    one block per (key tile, sequence), over every group and query tile:
//                    dK, dV (accumulated in a float workspace, rounded once at the end) and the
//                    key-wise terms' gradients.
//   StaticGradKernel one block per (side, group): the partials of W's gradient summed in order.
//
// Both grad kernels recompute a tile's chain the same way (tile_chain): scores L, Compose_pre,
// P from lse, dP' = dO V^T, dP = Compose_post^T(dP'), dS' = P (dP - D), dS = Compose_pre^T(dS').
#include "scores_tile.hpp"

namespace dcmha::cuda {

/// Device scratch of one backward call, in the accumulator type.
template <class A>
struct BackwardScratch {
  A* row_dot = nullptr;          // D (B, H, T)
  A* dk = nullptr;               // (B, Hk, S, D)
  A* dv = nullptr;               // (B, Hk, S, Dv)
  A* static_partials = nullptr;  // [query block][side][M][M]
};

/// The arrays of one tile's chain in shared memory.
template <class A>
struct ChainShared {
  A *scores, *probabilities, *upstream, *grads;  // [M][rows][keys]
  LowRankSums<A> sums;                           // [rank][positions] each
  A *lse, *row_dot;                              // [M][rows]
  TensorCoreStaging tensor_cores;                // bf16 with geo.tensor_warps: L and dP'

  DCMHA_HOST_DEVICE void carve(SharedArena<A>& arena, const TileGeometry& geo) {
    scores = arena.take(geo.scores());
    probabilities = arena.take(geo.scores());
    upstream = arena.take(geo.scores());
    grads = arena.take(geo.scores());
    sums.query_of_input = arena.take(geo.rank * geo.positions());
    sums.key_of_input = arena.take(geo.rank * geo.positions());
    sums.query_of_grad = arena.take(geo.rank * geo.positions());
    sums.key_of_grad = arena.take(geo.rank * geo.positions());
    lse = arena.take(geo.M * geo.rows);
    row_dot = arena.take(geo.M * geo.rows);
    if constexpr (std::is_same_v<A, float>) tensor_cores.carve(arena, geo);
  }
};

/// Which compose-weight gradients a kernel accumulates from a tile.
template <class A>
struct ComposeGradTargets {
  bool by_row = true;         // query-wise (true) or key-wise (false) terms
  LowRankGrads<A> pre, post;  // the low-rank terms' accumulators along that axis
  A *static_pre = nullptr, *static_post = nullptr;  // [M][M], or null: not this kernel's
};

template <class T, class Block>
class TileChain {
 public:
  using A = acc_t<T>;

  DCMHA_HOST_DEVICE TileChain(const Block& blk, const detail::BackwardParams<T>& p,
                              const TileGeometry& geo, const ChainShared<A>& sh)
      : blk_(blk), p_(p), geo_(geo), sh_(sh) {}

  /// Scores, P and dP of the tile at `at` (the first pass needs no more); ends synced.
  DCMHA_HOST_DEVICE void probabilities_and_grads(const TilePlace& at) {
    composed_score_tile(blk_, p_, geo_, at, sh_.tensor_cores, sh_.scores, sh_.probabilities,
                        sh_.sums);
    probabilities_tile(blk_, p_, geo_, at, sh_.lse, sh_.probabilities);
    output_grad_tile(at);
    blk_.sync();
    compose_transpose_tile(blk_, p_.compose.post, geo_, at, sh_.probabilities, sh_.upstream,
                           sh_.grads, sh_.sums);
    blk_.sync();
  }

  /// The rest of the chain after probabilities_and_grads: the post side's weight gradients,
  /// dS', the pre side's transpose and weight gradients. Leaves dS in sh.upstream; ends synced.
  DCMHA_HOST_DEVICE void score_grads(const TilePlace& at, const ComposeGradTargets<A>& targets) {
    accumulate_weight_grads(p_.compose.post, targets.post, targets.static_post, sh_.probabilities,
                            sh_.upstream, targets.by_row);
    softmax_grad_tile();
    blk_.sync();
    compose_transpose_tile(blk_, p_.compose.pre, geo_, at, sh_.scores, sh_.grads, sh_.upstream,
                           sh_.sums);
    blk_.sync();
    accumulate_weight_grads(p_.compose.pre, targets.pre, targets.static_pre, sh_.scores, sh_.grads,
                            targets.by_row);
    blk_.sync();
  }

 private:
  /// upstream[m][r][c] = dO_h[t] . v_kv(h)[s] inside the tile, 0 outside.
  DCMHA_HOST_DEVICE void output_grad_tile(const TilePlace& at) {
    if constexpr (std::is_same_v<T, bf16>)
      if (geo_.tensor_warps > 0)
        return output_grad_tile_on_tensor_cores(blk_, p_, geo_, at, sh_.tensor_cores, sh_.upstream);
    const index_t P = geo_.positions(), heads_per_kv = p_.dims.H / p_.dims.Hk;
    for_each_owned(blk_, geo_.scores(), [&](index_t i) {
      const index_t m = i / P, h = at.rows.g * geo_.M + m, b = at.rows.b;
      const Position q = position(geo_, at, i % P);
      A dot = 0;
      if (q.real)
        for (index_t e = 0; e < geo_.Dv; ++e)
          dot += A(p_.dout(b, h, q.t, e)) * A(p_.v(b, h / heads_per_kv, q.slot, e));
      sh_.upstream[i] = dot;
    });
  }

  /// grads = P (dP - D): the softmax's backward, in place over dP (P is 0 where a row does not
  /// see a key, so those positions get 0).
  DCMHA_HOST_DEVICE void softmax_grad_tile() {
    const index_t P = geo_.positions();
    for_each_owned(blk_, geo_.scores(), [&](index_t i) {
      const index_t m = i / P, r = i % P / geo_.keys;
      sh_.grads[i] = sh_.probabilities[i] * (sh_.grads[i] - sh_.row_dot[m * geo_.rows + r]);
    });
  }

  DCMHA_HOST_DEVICE void accumulate_weight_grads(const ComposeTerms<T>& side,
                                                 const LowRankGrads<A>& lowrank, A* static_w,
                                                 const A* x, const A* dy, bool by_row) {
    if (by_row && side.query_wise)
      accumulate_lowrank_grads(blk_, geo_, true, query_rank(side), x, dy, sh_.sums.query_of_input,
                               sh_.sums.query_of_grad, lowrank);
    if (!by_row && side.key_wise)
      accumulate_lowrank_grads(blk_, geo_, false, key_rank(side), x, dy, sh_.sums.key_of_input,
                               sh_.sums.key_of_grad, lowrank);
    if (static_w && side.static_w) accumulate_static_grads(blk_, geo_, x, dy, static_w);
  }

  const Block& blk_;
  const detail::BackwardParams<T>& p_;
  TileGeometry geo_;
  ChainShared<A> sh_;
};

/// The rows' lse (and D) of a query tile into shared memory.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void load_row_statistics(const Block& blk, const detail::BackwardParams<T>& p,
                                           const TileGeometry& geo, const QueryTile& rows,
                                           const A* row_dot, ChainShared<A>& sh) {
  for_each_owned(blk, geo.M * geo.rows, [&](index_t item) {
    const index_t m = item / geo.rows, r = item % geo.rows, h = rows.g * geo.M + m;
    const bool real = r < rows.rows && rows.t0 + r < rows.query_length;
    const index_t at = (rows.b * p.dims.H + h) * p.dims.T + rows.t0 + r;
    sh.lse[item] = real ? A(p.lse(rows.b, h, rows.t0 + r)) : negative_infinity<A>();
    if (row_dot) sh.row_dot[item] = real ? row_dot[at] : A(0);
  });
}

/// The query side's shared memory: dQ, D, the query-wise gradients, the static ones' partials.
template <class A>
struct QueryGradShared {
  using value_type = A;
  ChainShared<A> chain;
  A* dq;                        // [M][rows][D]
  LowRankGrads<A> pre, post;    // query-wise, along rows
  A *static_pre, *static_post;  // [M][M]

  DCMHA_HOST_DEVICE void carve(SharedArena<A>& arena, const TileGeometry& geo) {
    chain.carve(arena, geo);
    dq = arena.take(geo.M * geo.rows * geo.D);
    pre = take_lowrank_grads(arena, geo.rows, geo);
    post = take_lowrank_grads(arena, geo.rows, geo);
    static_pre = arena.take(geo.M * geo.M);
    static_post = arena.take(geo.M * geo.M);
  }
};

template <class T, class Block>
class QueryGradKernel {
 public:
  using A = acc_t<T>;

  DCMHA_HOST_DEVICE QueryGradKernel(const Block& blk, const detail::BackwardParams<T>& p,
                                    const TileGeometry& geo, const BackwardScratch<A>& scratch)
      : blk_(blk),
        p_(p),
        geo_(geo),
        scratch_(scratch),
        sh_(carve_shared<QueryGradShared<A>>(blk.shared(), geo)),
        chain_(blk, p, geo, sh_.chain) {
    at_.rows = query_tile(p, geo, blk.block(0), blk.block(1), blk.block(2));
  }

  DCMHA_HOST_DEVICE void run() {
    start();
    const KeyRange keys = tile_keys(p_.mask, at_.rows);
    for (index_t s0 = keys.begin; s0 < keys.end; s0 += geo_.keys) {
      step_to(s0, keys.end);
      chain_.probabilities_and_grads(at_);
      accumulate_row_dot();
      blk_.sync();
    }
    ComposeGradTargets<A> targets;
    targets.pre = sh_.pre;
    targets.post = sh_.post;
    targets.static_pre = sh_.static_pre;
    targets.static_post = sh_.static_post;
    for (index_t s0 = keys.begin; s0 < keys.end; s0 += geo_.keys) {
      step_to(s0, keys.end);
      chain_.probabilities_and_grads(at_);
      chain_.score_grads(at_, targets);
      accumulate_query_grad();
      blk_.sync();
    }
    store();
  }

 private:
  DCMHA_HOST_DEVICE void start() {
    load_row_statistics(blk_, p_, geo_, at_.rows, static_cast<const A*>(nullptr), sh_.chain);
    fill(blk_, sh_.chain.row_dot, geo_.M * geo_.rows, A(0));
    fill(blk_, sh_.dq, geo_.M * geo_.rows * geo_.D, A(0));
    zero_lowrank_grads(blk_, sh_.pre, geo_.rows, geo_);
    zero_lowrank_grads(blk_, sh_.post, geo_.rows, geo_);
    fill(blk_, sh_.static_pre, geo_.M * geo_.M, A(0));
    fill(blk_, sh_.static_post, geo_.M * geo_.M, A(0));
    blk_.sync();
  }

  DCMHA_HOST_DEVICE void step_to(index_t s0, index_t end) {
    at_.keys.s0 = s0;
    at_.keys.count = end - s0 < geo_.keys ? end - s0 : geo_.keys;
  }

  /// D[m][r] += sum_c P dP: item (m, r) is one thread's in every step.
  DCMHA_HOST_DEVICE void accumulate_row_dot() {
    for_each_owned(blk_, geo_.M * geo_.rows, [&](index_t item) {
      const index_t m = item / geo_.rows, r = item % geo_.rows;
      const index_t at = m * geo_.positions() + r * geo_.keys;
      A sum = 0;
      for (index_t c = 0; c < at_.keys.count; ++c)
        sum += sh_.chain.probabilities[at + c] * sh_.chain.grads[at + c];
      sh_.chain.row_dot[item] += sum;
    });
  }

  /// dq[m][r][d] += sum_c dS[m][r][c] k[s][d] (dS in the chain's upstream array).
  DCMHA_HOST_DEVICE void accumulate_query_grad() {
    const index_t heads_per_kv = p_.dims.H / p_.dims.Hk, b = at_.rows.b;
    for_each_owned(blk_, geo_.M * geo_.rows * geo_.D, [&](index_t item) {
      const index_t m = item / (geo_.rows * geo_.D), r = item / geo_.D % geo_.rows;
      const index_t d = item % geo_.D, kv = (at_.rows.g * geo_.M + m) / heads_per_kv;
      const A* row = sh_.chain.upstream + m * geo_.positions() + r * geo_.keys;
      A sum = 0;
      for (index_t c = 0; c < at_.keys.count; ++c)
        sum += row[c] * A(p_.k(b, kv, at_.keys.s0 + c, d));
      sh_.dq[item] += sum;
    });
  }

  DCMHA_HOST_DEVICE void store() {
    const QueryTile& q = at_.rows;
    for_each_owned(blk_, geo_.M * q.rows * geo_.D, [&](index_t item) {
      const index_t m = item / (q.rows * geo_.D), r = item / geo_.D % q.rows, d = item % geo_.D;
      p_.dq(q.b, q.g * geo_.M + m, q.t0 + r, d) =
          T(A(p_.scale) * sh_.dq[(m * geo_.rows + r) * geo_.D + d]);
    });
    for_each_owned(blk_, geo_.M * q.rows, [&](index_t item) {
      const index_t m = item / q.rows, r = item % q.rows;
      scratch_.row_dot[(q.b * p_.dims.H + q.g * geo_.M + m) * p_.dims.T + q.t0 + r] =
          sh_.chain.row_dot[m * geo_.rows + r];
    });
    store_query_grads(p_.compose.pre, p_.dcompose.pre, sh_.pre);
    store_query_grads(p_.compose.post, p_.dcompose.post, sh_.post);
    const index_t tiles = (p_.dims.T + geo_.rows - 1) / geo_.rows;
    const index_t block = (q.b * p_.dims.G + q.g) * tiles + blk_.block(0);
    A* partial = scratch_.static_partials + block * 2 * geo_.M * geo_.M;
    for_each_owned(blk_, geo_.M * geo_.M, [&](index_t item) {
      partial[item] = sh_.static_pre[item];
      partial[geo_.M * geo_.M + item] = sh_.static_post[item];
    });
  }

  DCMHA_HOST_DEVICE void store_query_grads(const ComposeTerms<T>& side,
                                           const ComposeTermGrads<T>& grads,
                                           const LowRankGrads<A>& acc) {
    if (!side.query_wise) return;
    const QueryTile& q = at_.rows;
    const index_t R = query_rank(side), M = geo_.M;
    for_each_owned(blk_, q.rows * R * M, [&](index_t item) {
      const index_t r = item / (R * M), k = item / M % R, m = item % M;
      const index_t at = (r * geo_.rank + k) * M + m;
      grads.qw1(q.b, q.t0 + r, q.g, k, m) = T(acc.w1[at]);
      grads.qw2(q.b, q.t0 + r, q.g, k, m) = T(acc.w2[at]);
    });
    for_each_owned(blk_, q.rows * M, [&](index_t item) {
      grads.qdd(q.b, q.t0 + item / M, q.g, item % M) = T(acc.dd[item]);
    });
  }

  const Block& blk_;
  const detail::BackwardParams<T>& p_;
  TileGeometry geo_;
  BackwardScratch<A> scratch_;
  QueryGradShared<A> sh_;
  TileChain<T, Block> chain_;
  TilePlace at_;
};

/// The key side's shared memory: the chain and the key-wise gradients of one group.
template <class A>
struct KeyGradShared {
  using value_type = A;
  ChainShared<A> chain;
  LowRankGrads<A> pre, post;  // key-wise, along keys

  DCMHA_HOST_DEVICE void carve(SharedArena<A>& arena, const TileGeometry& geo) {
    chain.carve(arena, geo);
    pre = take_lowrank_grads(arena, geo.keys, geo);
    post = take_lowrank_grads(arena, geo.keys, geo);
  }
};

template <class T, class Block>
class KeyGradKernel {
 public:
  using A = acc_t<T>;

  DCMHA_HOST_DEVICE KeyGradKernel(const Block& blk, const detail::BackwardParams<T>& p,
                                  const TileGeometry& geo, const BackwardScratch<A>& scratch)
      : blk_(blk),
        p_(p),
        geo_(geo),
        scratch_(scratch),
        sh_(carve_shared<KeyGradShared<A>>(blk.shared(), geo)),
        chain_(blk, p, geo, sh_.chain) {
    b_ = blk.block(1);
    at_.keys.s0 = blk.block(0) * geo.keys;
    at_.keys.count = p.dims.S - at_.keys.s0 < geo.keys ? p.dims.S - at_.keys.s0 : geo.keys;
  }

  DCMHA_HOST_DEVICE void run() {
    for_each_owned(blk_, kv_items(geo_.D), [&](index_t item) {
      if (key_of(item, geo_.D) < at_.keys.count) dk_at(item) = 0;
    });
    for_each_owned(blk_, kv_items(geo_.Dv), [&](index_t item) {
      if (key_of(item, geo_.Dv) < at_.keys.count) dv_at(item) = 0;
    });
    ComposeGradTargets<A> targets;
    targets.by_row = false;
    targets.pre = sh_.pre;
    targets.post = sh_.post;
    const index_t tiles = (p_.dims.T + geo_.rows - 1) / geo_.rows;
    for (index_t g = 0; g < p_.dims.G; ++g) {
      zero_lowrank_grads(blk_, sh_.pre, geo_.keys, geo_);
      zero_lowrank_grads(blk_, sh_.post, geo_.keys, geo_);
      blk_.sync();  // the stores below map items to threads differently
      for (index_t tile = 0; tile < tiles; ++tile) {
        at_.rows = query_tile(p_, geo_, tile, g, b_);
        const KeyRange keys = tile_keys(p_.mask, at_.rows);
        if (keys.end <= at_.keys.s0 || keys.begin >= at_.keys.s0 + at_.keys.count) continue;
        load_row_statistics(blk_, p_, geo_, at_.rows, static_cast<const A*>(scratch_.row_dot),
                            sh_.chain);
        blk_.sync();
        chain_.probabilities_and_grads(at_);
        chain_.score_grads(at_, targets);
        accumulate_key_grad();
        compose_tile(blk_, p_.compose.post, geo_, at_, sh_.chain.probabilities, sh_.chain.grads,
                     sh_.chain.sums);
        blk_.sync();
        accumulate_value_grad(sh_.chain.grads);
        blk_.sync();
      }
      store_key_grads(g, p_.compose.pre, p_.dcompose.pre, sh_.pre);
      store_key_grads(g, p_.compose.post, p_.dcompose.post, sh_.post);
      blk_.sync();
    }
    store_key_value_grads();
  }

 private:
  /// Items (kv head, key, column) over every kv head, so that each scratch element of the block
  /// is one thread's for the whole call, whichever group is at work.
  DCMHA_HOST_DEVICE index_t kv_items(index_t columns) const {
    return p_.dims.Hk * geo_.keys * columns;
  }
  DCMHA_HOST_DEVICE index_t key_of(index_t item, index_t columns) const {
    return item / columns % geo_.keys;
  }
  /// The scratch element of an item whose key is inside the tile (key_of < count).
  DCMHA_HOST_DEVICE A& scratch_at(A* base, index_t item, index_t columns) const {
    const index_t kv = item / (geo_.keys * columns), s = at_.keys.s0 + key_of(item, columns);
    return base[((b_ * p_.dims.Hk + kv) * p_.dims.S + s) * columns + item % columns];
  }
  DCMHA_HOST_DEVICE A& dk_at(index_t item) const { return scratch_at(scratch_.dk, item, geo_.D); }
  DCMHA_HOST_DEVICE A& dv_at(index_t item) const { return scratch_at(scratch_.dv, item, geo_.Dv); }

  /// sum over the group's heads of kv head `kv` and the tile's real rows of x[m][r][c] y(h, t).
  template <class F>
  DCMHA_HOST_DEVICE A sum_over_heads_and_rows(index_t kv, index_t c, const A* x, F&& y) const {
    const index_t heads_per_kv = p_.dims.H / p_.dims.Hk, g0 = at_.rows.g * geo_.M;
    const index_t h0 = kv * heads_per_kv > g0 ? kv * heads_per_kv : g0;
    const index_t h1 =
        (kv + 1) * heads_per_kv < g0 + geo_.M ? (kv + 1) * heads_per_kv : g0 + geo_.M;
    // Real rows only: a padding row's q and dO are never read.
    const index_t real_rows = at_.rows.query_length - at_.rows.t0 < at_.rows.rows
                                  ? at_.rows.query_length - at_.rows.t0
                                  : at_.rows.rows;
    A sum = 0;
    for (index_t h = h0; h < h1; ++h)
      for (index_t r = 0; r < real_rows; ++r)
        sum += x[(h - g0) * geo_.positions() + r * geo_.keys + c] * y(h, at_.rows.t0 + r);
    return sum;
  }

  /// dk[kv][s][d] += scale sum dS[m][r][c] q_h[t][d] (dS in the chain's upstream array).
  DCMHA_HOST_DEVICE void accumulate_key_grad() {
    for_each_owned(blk_, kv_items(geo_.D), [&](index_t item) {
      const index_t kv = item / (geo_.keys * geo_.D), c = item / geo_.D % geo_.keys;
      const index_t d = item % geo_.D;
      if (c >= at_.keys.count) return;
      dk_at(item) += A(p_.scale) * sum_over_heads_and_rows(
                                       kv, c, sh_.chain.upstream,
                                       [&](index_t h, index_t t) { return A(p_.q(b_, h, t, d)); });
    });
  }

  /// dv[kv][s][e] += sum P'[m][r][c] dO_h[t][e].
  DCMHA_HOST_DEVICE void accumulate_value_grad(const A* composed_probabilities) {
    for_each_owned(blk_, kv_items(geo_.Dv), [&](index_t item) {
      const index_t kv = item / (geo_.keys * geo_.Dv), c = item / geo_.Dv % geo_.keys;
      const index_t e = item % geo_.Dv;
      if (c >= at_.keys.count) return;
      dv_at(item) +=
          sum_over_heads_and_rows(kv, c, composed_probabilities,
                                  [&](index_t h, index_t t) { return A(p_.dout(b_, h, t, e)); });
    });
  }

  DCMHA_HOST_DEVICE void store_key_grads(index_t g, const ComposeTerms<T>& side,
                                         const ComposeTermGrads<T>& grads,
                                         const LowRankGrads<A>& acc) {
    if (!side.key_wise) return;
    const index_t R = key_rank(side), M = geo_.M, count = at_.keys.count, s0 = at_.keys.s0;
    for_each_owned(blk_, count * R * M, [&](index_t item) {
      const index_t c = item / (R * M), k = item / M % R, m = item % M;
      const index_t at = (c * geo_.rank + k) * M + m;
      grads.kw1(b_, s0 + c, g, k, m) = T(acc.w1[at]);
      grads.kw2(b_, s0 + c, g, k, m) = T(acc.w2[at]);
    });
    for_each_owned(blk_, count * M, [&](index_t item) {
      grads.kdd(b_, s0 + item / M, g, item % M) = T(acc.dd[item]);
    });
  }

  DCMHA_HOST_DEVICE void store_key_value_grads() {
    for_each_owned(blk_, kv_items(geo_.D), [&](index_t item) {
      const index_t kv = item / (geo_.keys * geo_.D), c = item / geo_.D % geo_.keys;
      if (c < at_.keys.count) p_.dk(b_, kv, at_.keys.s0 + c, item % geo_.D) = T(dk_at(item));
    });
    for_each_owned(blk_, kv_items(geo_.Dv), [&](index_t item) {
      const index_t kv = item / (geo_.keys * geo_.Dv), c = item / geo_.Dv % geo_.keys;
      if (c < at_.keys.count) p_.dv(b_, kv, at_.keys.s0 + c, item % geo_.Dv) = T(dv_at(item));
    });
  }

  const Block& blk_;
  const detail::BackwardParams<T>& p_;
  TileGeometry geo_;
  BackwardScratch<A> scratch_;
  KeyGradShared<A> sh_;
  TileChain<T, Block> chain_;
  TilePlace at_;
  index_t b_ = 0;
};

/// W's gradient of one (side, group): the query blocks' partials summed in a fixed order.
template <class T, class Block>
DCMHA_HOST_DEVICE void sum_static_grads(const Block& blk, const detail::BackwardParams<T>& p,
                                        const TileGeometry& geo,
                                        const BackwardScratch<acc_t<T>>& scratch) {
  using A = acc_t<T>;
  const index_t side = blk.block(0), g = blk.block(1), M = geo.M;
  const ComposeTerms<T>& terms = side == 0 ? p.compose.pre : p.compose.post;
  const TensorView<T, 3>& dw = side == 0 ? p.dcompose.pre.w : p.dcompose.post.w;
  if (!terms.static_w) return;
  const index_t tiles = (p.dims.T + geo.rows - 1) / geo.rows;
  for_each_owned(blk, M * M, [&](index_t item) {
    A sum = 0;
    for (index_t b = 0; b < p.dims.B; ++b)
      for (index_t tile = 0; tile < tiles; ++tile)
        sum += scratch.static_partials[((b * p.dims.G + g) * tiles + tile) * 2 * M * M +
                                       side * M * M + item];
    dw(g, item / M, item % M) = T(sum);
  });
}

}  // namespace dcmha::cuda

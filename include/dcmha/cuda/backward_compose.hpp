#pragma once
// The backward's chain at one compose item (compose_pass.hpp), from the scores L and the
// upstream dP' = dO V^T of all M heads:
//   L' = Compose_pre(L), P = exp(L' - lse), dP = Compose_post^T(dP'),
//   dL' = P (dP - D), dL = Compose_pre^T(dL'), and on the key side P' = Compose_post(P),
// each head's results written to its owner's tiles, and the projections the compose weights'
// gradients need (of each side's input and of its upstream gradient, along the kernel's axis)
// into the composing block's sums. In the query side's first pass only P * dP is wanted (the row
// dots D).
#include <cmath>

#include "backward_geometry.hpp"
#include "compose_pass.hpp"

namespace dcmha::cuda {

/// What a chain item reads and writes.
template <class T>
struct ChainContext {
  SideWeights<T> pre, post;
  ChainTiles tiles;  // this block's, [own head]...
  OperandTiles<T> dscores, values_probs;
  const float* lse = nullptr;  // this block's [own head][rows]
  const float* row_dot = nullptr;
  int own_heads = 1, statistics_rows = 0;  // the lse / row-dot arrays' rows
  ChainSums sums;
  ComposeRegion region;
  bool query_axis = true;  // the weight gradients summed along keys (query side) or rows
  bool row_dots_only = false;

  DCMHA_INLINE GroupTiles group(const ScoreTiles& t) const { return {t, own_heads}; }
};

/// The item's statistic (lse or D) of head n at its rows, from n's owner.
template <class Block, class T>
DCMHA_INLINE void load_statistic(const Block& blk, const ChainContext<T>& cx, const float* base,
                                 const ComposeItem& it, int n, float (&out)[kChainRows]) {
  const float* owner =
      blk.peer_shared(base, n / cx.own_heads) + index_t(n % cx.own_heads) * cx.statistics_rows;
  DCMHA_UNROLL
  for (int i = 0; i < kChainRows; ++i)
    out[i] = i < it.rows ? blk.load_shared(owner + it.row0 + i) : 0.0f;
}

/// Stores y[i] of head n at the item's rows into n's owner's tile.
template <class Block>
DCMHA_INLINE void store_item(const Block& blk, const ScoreTile& t, const ComposeItem& it,
                             const float (&y)[kChainRows]) {
  DCMHA_UNROLL
  for (int i = 0; i < kChainRows; ++i)
    if (i < it.rows) blk.store_shared(t.at(it.row0 + i, it.key), y[i]);
}
template <class Block, class T>
DCMHA_INLINE void store_operand(const Block& blk, const OperandTiles<T>& tiles, int own_heads,
                                const ComposeItem& it, int n, const float (&y)[kChainRows]) {
  const OperandTile<T> t = tiles.head(n % own_heads);
  DCMHA_UNROLL
  for (int i = 0; i < kChainRows; ++i)
    if (i < it.rows)
      blk.store_shared(blk.peer_shared(t.at(it.row0 + i, it.key), n / own_heads), T(y[i]));
}

/// The projections along the kernel's axis into the composing block's sums: side 0 pre, 1 post;
/// kind 0 of the input, 1 of the upstream gradient. One lane of the item's parts writes.
template <class Block, class T>
DCMHA_INLINE void store_sums(const Block& blk, const ChainContext<T>& cx, const ComposeItem& it,
                             int side, int kind, const Projections<kChainRows>& p) {
  if (it.part != 0) return;
  const SideWeights<T>& w = side == 0 ? cx.pre : cx.post;
  const int R = int(cx.query_axis ? w.terms.query_rank : w.terms.key_rank);
  DCMHA_UNROLL
  for (int i = 0; i < kChainRows; ++i)
    if (i < it.rows) DCMHA_UNROLL
  for (int r = 0; r < kMaxRank; ++r)
    if (r < R)
      blk.store_shared(cx.sums.at(side, kind, r, it.row0 + i - cx.region.row_begin,
                                  it.key - cx.region.key_begin),
                       cx.query_axis ? p.q[i][r] : p.k[i][r]);
}

/// One item's chain; the key side (kKeySide) also composes P' for dV. The sides' query-wise
/// weights come from pre_query and post_query (QueryWeights, or HeldQueryWeights where the
/// registers allow).
template <bool kKeySide, class Block, class T, class PreQuery, class PostQuery>
DCMHA_INLINE void chain_item(const Block& blk, const ChainContext<T>& cx, const ComposeItem& it,
                             const detail::KeyRange (&ranges)[kChainRows], index_t s,
                             const PreQuery& pre_query, const PostQuery& post_query) {
  using std::exp;
  const SideWeights<T>&pre = cx.pre, &post = cx.post;
  const GroupTiles scores = cx.group(cx.tiles.scores), upstream = cx.group(cx.tiles.upstream);
  const GroupTiles probs = cx.group(cx.tiles.probs), grads = cx.group(cx.tiles.softmax_grad);
  // The lane's heads' values in registers, in place: L, then P, then P'; dP', then dP, dL', dL.
  ItemValues<kChainRows> x, g;
  // 1. Projections of L (Compose_pre) and of dP' (Compose_post's transpose).
  Projections<kChainRows> pre_x, post_g;
  pre_x.zero();
  post_g.zero();
  if (it.valid) {
    for_item_heads(it, [&](int j) {
      load_item(blk, scores.head(blk, it.head(j)), it, x.v[j]);
      load_item(blk, upstream.head(blk, it.head(j)), it, g.v[j]);
    });
    pre_x.add(blk, pre, it, x, Direction::forward, pre_query);
    post_g.add(blk, post, it, g, Direction::transpose, post_query);
  }
  pre_x.reduce(blk, pre.terms, it.parts);
  post_g.reduce(blk, post.terms, it.parts);
  // 2. P = exp(Compose_pre(L) - lse) to its owner, and its projections (Compose_post).
  Projections<kChainRows> post_x;
  post_x.zero();
  if (it.valid) {
    compose_heads(blk, pre, it, pre_x, x, x, Direction::forward, pre_query);
    for_item_heads(it, [&](int j) {
      const int n = it.head(j);
      float lse[kChainRows];
      if (pre.terms.static_w) add_static_term(blk, pre, scores, it, n, x.v[j]);
      load_statistic(blk, cx, cx.lse, it, n, lse);
      DCMHA_UNROLL
      for (int i = 0; i < kChainRows; ++i)
        x.v[j][i] =
            i < it.rows && ranges[i].contains(s) && lse[i] > detail::negative_infinity<float>()
                ? exp(x.v[j][i] - lse[i])
                : 0.0f;
      blk.count_exp(it.rows);
      if (!cx.row_dots_only) store_item(blk, probs.head(blk, n), it, x.v[j]);
    });
    if (!cx.row_dots_only) post_x.add(blk, post, it, x, Direction::forward, post_query);
  }
  // The row dots need neither P in the tiles nor its projections (the weight gradients' terms).
  if (!cx.row_dots_only) post_x.reduce(blk, post.terms, it.parts);
  // Each projection goes to the sums after its last use (fewer live registers).
  const bool sums = it.valid && !cx.row_dots_only;
  if (sums) store_sums(blk, cx, it, 0, 0, pre_x);
  if (sums && !kKeySide) store_sums(blk, cx, it, 1, 0, post_x);
  // Static terms read the other parts' probabilities: the item's lanes are one warp.
  if (post.terms.static_w) blk.sync_warp();
  // 3. dP = Compose_post^T(dP'); dL' = P (dP - D), or P * dP; P' = Compose_post(P) for dV.
  Projections<kChainRows> pre_g;
  pre_g.zero();
  if (it.valid) {
    compose_heads(blk, post, it, post_g, g, g, Direction::transpose, post_query);
    for_item_heads(it, [&](int j) {
      const int m = it.head(j);
      float d[kChainRows] = {};
      if (post.terms.static_w)
        add_static_term(blk, post, upstream, it, m, g.v[j], Direction::transpose);
      if (!cx.row_dots_only) load_statistic(blk, cx, cx.row_dot, it, m, d);
      DCMHA_UNROLL
      for (int i = 0; i < kChainRows; ++i)
        g.v[j][i] = cx.row_dots_only ? x.v[j][i] * g.v[j][i] : x.v[j][i] * (g.v[j][i] - d[i]);
      blk.count_fma(it.rows);
      store_item(blk, grads.head(blk, m), it, g.v[j]);
    });
    if (!cx.row_dots_only) pre_g.add(blk, pre, it, g, Direction::transpose, pre_query);
    if constexpr (kKeySide) {
      compose_heads(blk, post, it, post_x, x, x, Direction::forward, post_query);
      for_item_heads(it, [&](int j) {
        const int m = it.head(j);
        if (post.terms.static_w) add_static_term(blk, post, probs, it, m, x.v[j]);
        DCMHA_UNROLL
        for (int i = 0; i < kChainRows; ++i) x.v[j][i] = ranges[i].contains(s) ? x.v[j][i] : 0.0f;
        store_operand(blk, cx.values_probs, cx.own_heads, it, m, x.v[j]);
      });
    }
  }
  if (sums && kKeySide) store_sums(blk, cx, it, 1, 0, post_x);
  if (sums) store_sums(blk, cx, it, 1, 1, post_g);
  if (cx.row_dots_only) return;
  pre_g.reduce(blk, pre.terms, it.parts);
  if (pre.terms.static_w) blk.sync_warp();
  // 4. dL = Compose_pre^T(dL') in the storage type, for dQ and dK.
  if (it.valid) {
    compose_heads(blk, pre, it, pre_g, g, g, Direction::transpose, pre_query);
    for_item_heads(it, [&](int j) {
      const int m = it.head(j);
      if (pre.terms.static_w) add_static_term(blk, pre, grads, it, m, g.v[j], Direction::transpose);
      store_operand(blk, cx.dscores, cx.own_heads, it, m, g.v[j]);
    });
  }
  if (sums) store_sums(blk, cx, it, 0, 1, pre_g);
}

}  // namespace dcmha::cuda

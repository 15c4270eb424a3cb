#pragma once
// The backward's chain at one compose item (compose_pass.hpp), from the scores L and the
// upstream dP' = dO V^T of all M heads:
//   L' = Compose_pre(L), P = exp(L' - lse), dP = Compose_post^T(dP'),
//   dL' = P (dP - D), dL = Compose_pre^T(dL'), and on the key side P' = Compose_post(P),
// each head's results written to its owner's tiles, and the projections the compose weights'
// gradients need (of each side's input and of its upstream gradient, along the kernel's axis)
// into the composing block's sums. In the query side's first pass only P * dP is wanted (the row
// dots D), summed by the composing lanes.
#include <cmath>

#include "backward_geometry.hpp"
#include "compose_pass.hpp"

namespace dcmha::cuda {

/// The query side's row dots' pass as a compose lane sees it. Its sums of P dP: in the block's
/// shared memory, [head of item][item] (item_sum), or, where the lane keeps its row in every round
/// (ComposeItem::rows_held), in its registers, one sum a head over all of its keys; there it also
/// holds its heads' lse at that row, read once rather than from the owners every key tile.
struct RowDotPass {
  float* shared_sums = nullptr;
  ItemValues<kChainRows>* lane_sums = nullptr;
  const ItemValues<kChainRows>* lane_lse = nullptr;
};

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
  // The query side's first pass (the row dots): P * dP added to the lane's sums, not sent to the
  // owners' tiles; none in every other pass.
  RowDotPass row_dots;

  DCMHA_INLINE GroupTiles group(const ScoreTiles& t) const { return {t, own_heads}; }
  DCMHA_INLINE bool row_dots_only() const { return row_dots.shared_sums != nullptr; }
};

/// Where an item keeps a sum of its j-th head in an array of the block's shared memory, [j][item]
/// with the region's items in the order dealt: a lane's items are the same in every tile, and
/// consecutive lanes take consecutive words. The array holds the region's positions times M floats.
DCMHA_INLINE int item_sum(const ComposeRegion& region, const ComposeItem& it, int j) {
  static_assert(kChainRows == 1, "an item's sums are one row's");
  return j * compose_items(region, it.parts, kChainRows) + it.index;
}

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

/// One item's chain in steps, its values and projections kept between them; the key side
/// (kKeySide) also composes P' for dV. The sides' query-wise weights come from pre_query and
/// post_query (QueryWeights, or HeldQueryWeights where the registers allow). Every lane runs
/// every step (the parts' shuffles need all lanes), an invalid item only the reductions.
template <bool kKeySide, class Block, class T, class PreQuery, class PostQuery>
struct ChainSteps {
  const Block& blk;
  const ChainContext<T>& cx;
  const ComposeItem& it;
  const PreQuery& pre_query;
  const PostQuery& post_query;
  // The lane's heads' values in registers, in place: L, then P, then P'; dP', then dP, dL', dL.
  ItemValues<kChainRows> x, g;
  // The projections of L and dL' (Compose_pre), of P and dP' (Compose_post).
  Projections<kChainRows> pre_x, pre_g, post_x, post_g;

  DCMHA_INLINE ChainSteps(const Block& b, const ChainContext<T>& c, const ComposeItem& i,
                          const PreQuery& pre, const PostQuery& post)
      : blk(b), cx(c), it(i), pre_query(pre), post_query(post) {}
  /// Whether the weight gradients' projections go to the sums (not in the row dots' pass).
  DCMHA_INLINE bool keeps_sums() const { return it.valid && !cx.row_dots_only(); }

  /// 1. Projections of L (Compose_pre) and of dP' (Compose_post's transpose).
  DCMHA_INLINE void project_inputs() {
    pre_x.zero();
    post_g.zero();
    if (it.valid) {
      for_item_heads(it, [&](int j) {
        load_item(blk, cx.group(cx.tiles.scores).head(blk, it.head(j)), it, x.v[j]);
        load_item(blk, cx.group(cx.tiles.upstream).head(blk, it.head(j)), it, g.v[j]);
      });
      pre_x.add(blk, cx.pre, it, x, Direction::forward, pre_query);
      post_g.add(blk, cx.post, it, g, Direction::transpose, post_query);
    }
    pre_x.reduce(blk, cx.pre.terms, it.parts);
    post_g.reduce(blk, cx.post.terms, it.parts);
  }

  /// 2. P = exp(Compose_pre(L) - lse) to its owner, and its projections (Compose_post). The row
  /// dots need neither P in the tiles nor its projections (the weight gradients' terms).
  DCMHA_INLINE void probabilities(const detail::KeyRange (&ranges)[kChainRows], index_t s) {
    using std::exp;
    post_x.zero();
    if (it.valid) {
      compose_heads(blk, cx.pre, it, pre_x, x, x, Direction::forward, pre_query);
      for_item_heads(it, [&](int j) {
        const int n = it.head(j);
        float lse[kChainRows];
        if (cx.pre.terms.static_w)
          add_static_term(blk, cx.pre, cx.group(cx.tiles.scores), it, n, x.v[j]);
        if (cx.row_dots.lane_lse) {
          DCMHA_UNROLL
          for (int i = 0; i < kChainRows; ++i) lse[i] = cx.row_dots.lane_lse->v[j][i];
        } else {
          load_statistic(blk, cx, cx.lse, it, n, lse);
        }
        DCMHA_UNROLL
        for (int i = 0; i < kChainRows; ++i)
          x.v[j][i] =
              i < it.rows && ranges[i].contains(s) && lse[i] > detail::negative_infinity<float>()
                  ? exp(x.v[j][i] - lse[i])
                  : 0.0f;
        blk.count_exp(it.rows);
        if (!cx.row_dots_only()) store_item(blk, cx.group(cx.tiles.probs).head(blk, n), it, x.v[j]);
      });
      if (!cx.row_dots_only()) post_x.add(blk, cx.post, it, x, Direction::forward, post_query);
    }
    if (!cx.row_dots_only()) post_x.reduce(blk, cx.post.terms, it.parts);
    // Each projection goes to the sums after its last use (fewer live registers).
    if (keeps_sums()) store_sums(blk, cx, it, 0, 0, pre_x);
    if (keeps_sums() && !kKeySide) store_sums(blk, cx, it, 1, 0, post_x);
  }

  /// 3. dP = Compose_post^T(dP'); dL' = P (dP - D) to the owners, or P * dP to the item's row-dot
  /// sums; its projections (Compose_pre's transpose).
  DCMHA_INLINE void softmax_gradient() {
    pre_g.zero();
    if (!it.valid) return;
    compose_heads(blk, cx.post, it, post_g, g, g, Direction::transpose, post_query);
    for_item_heads(it, [&](int j) {
      const int m = it.head(j);
      float d[kChainRows] = {};
      if (cx.post.terms.static_w)
        add_static_term(blk, cx.post, cx.group(cx.tiles.upstream), it, m, g.v[j],
                        Direction::transpose);
      if (!cx.row_dots_only()) load_statistic(blk, cx, cx.row_dot, it, m, d);
      DCMHA_UNROLL
      for (int i = 0; i < kChainRows; ++i)
        g.v[j][i] = cx.row_dots_only() ? x.v[j][i] * g.v[j][i] : x.v[j][i] * (g.v[j][i] - d[i]);
      blk.count_fma(it.rows);
      if (cx.row_dots_only()) return add_row_dot(j, g.v[j][0]);
      store_item(blk, cx.group(cx.tiles.softmax_grad).head(blk, m), it, g.v[j]);
    });
    if (!cx.row_dots_only()) pre_g.add(blk, cx.pre, it, g, Direction::transpose, pre_query);
  }

  /// P dP of head j to the item's row-dot sum: the lane's, in registers, or the item's, in the
  /// block's shared memory.
  DCMHA_INLINE void add_row_dot(int j, float y) const {
    if (cx.row_dots.lane_sums) {
      cx.row_dots.lane_sums->v[j][0] += y;
      return;
    }
    float* sum = cx.row_dots.shared_sums + item_sum(cx.region, it, j);
    blk.store_shared(sum, blk.load_shared(sum) + y);
  }

  /// The key side's P' = Compose_post(P) for dV, in the storage type (0 outside the rows' keys).
  DCMHA_INLINE void values_probs(const detail::KeyRange (&ranges)[kChainRows], index_t s) {
    if (!it.valid) return;
    compose_heads(blk, cx.post, it, post_x, x, x, Direction::forward, post_query);
    for_item_heads(it, [&](int j) {
      const int m = it.head(j);
      if (cx.post.terms.static_w)
        add_static_term(blk, cx.post, cx.group(cx.tiles.probs), it, m, x.v[j]);
      DCMHA_UNROLL
      for (int i = 0; i < kChainRows; ++i) x.v[j][i] = ranges[i].contains(s) ? x.v[j][i] : 0.0f;
      store_operand(blk, cx.values_probs, cx.own_heads, it, m, x.v[j]);
    });
  }

  /// 4. dL = Compose_pre^T(dL') in the storage type, for dQ and dK.
  DCMHA_INLINE void score_gradient() {
    pre_g.reduce(blk, cx.pre.terms, it.parts);
    if (cx.pre.terms.static_w) blk.sync_warp();
    if (it.valid) {
      compose_heads(blk, cx.pre, it, pre_g, g, g, Direction::transpose, pre_query);
      for_item_heads(it, [&](int j) {
        const int m = it.head(j);
        if (cx.pre.terms.static_w)
          add_static_term(blk, cx.pre, cx.group(cx.tiles.softmax_grad), it, m, g.v[j],
                          Direction::transpose);
        store_operand(blk, cx.dscores, cx.own_heads, it, m, g.v[j]);
      });
    }
    if (keeps_sums()) store_sums(blk, cx, it, 0, 1, pre_g);
  }
};

/// One item's chain (ChainSteps, in order).
template <bool kKeySide, class Block, class T, class PreQuery, class PostQuery>
DCMHA_INLINE void chain_item(const Block& blk, const ChainContext<T>& cx, const ComposeItem& it,
                             const detail::KeyRange (&ranges)[kChainRows], index_t s,
                             const PreQuery& pre_query, const PostQuery& post_query) {
  ChainSteps<kKeySide, Block, T, PreQuery, PostQuery> chain(blk, cx, it, pre_query, post_query);
  chain.project_inputs();
  chain.probabilities(ranges, s);
  // Static terms read the other parts' probabilities: the item's lanes are one warp.
  if (cx.post.terms.static_w) blk.sync_warp();
  chain.softmax_gradient();
  if constexpr (kKeySide) chain.values_probs(ranges, s);
  if (chain.keeps_sums() && kKeySide) store_sums(blk, cx, it, 1, 0, chain.post_x);
  if (chain.keeps_sums()) store_sums(blk, cx, it, 1, 1, chain.post_g);
  if (cx.row_dots_only()) return;
  chain.score_gradient();
}

}  // namespace dcmha::cuda

#pragma once
// The forward (and decode) kernel body. One cluster of `cluster` blocks per (query tile of `rows`
// rows, compose group, sequence); each block owns `own_heads` of the group's M heads and one warp
// per (own head, 16 rows): the warp's Q rows stay in shared memory, its output accumulators in
// registers, and it takes the key tiles' products on the tensor cores. MHA's registers mode gives
// a warp 32 rows instead (kRowTiles = 2, as FlashAttention-2's warps): its two m16 tiles share
// each K and V fragment, which halves the shared-memory reads of K and V per (query, key). Between
// the products the block composes its slice of the tile's positions (a share of the keys, and of
// the rows where the cluster has more blocks than a tile has slices of 8 keys) for all M heads
// (compose_pass.hpp), reading the other heads' scores from its cluster's blocks.
//
// Per key tile, while the next tile's K (and V) rows land by cp.async in the other stage:
//   registers  S = Q K^T, mask, online softmax, O += P V: FlashAttention-2, nothing in between
//   one_pass   S -> shared; [cluster barrier] Compose_pre; [barrier] online softmax, O += P V
//   two_pass   pass 1: S, Compose_pre, row statistics; pass 2: S, Compose_pre, P = exp(L' - lse),
//              Compose_post, P' (storage type) to each head's owner; [barrier] O += P' V
// Post-compose mixes the normalized probabilities of all heads, so it needs every row's lse
// first: hence the second pass, which recomputes the scores rather than keeping them.
//
// With few query tiles and many keys (decode) the keys of a tile are split across blocks: each
// split's statistics, their combination into the lse (in split order), each split's P'V with
// that lse, and the sum of the splits (in split order): four launches, deterministic. Where the
// composed scores are few (a decode step's rows) the statistics launch keeps them and the values
// launch reads them instead of walking K again (kKeptScores).
#include <cmath>

#include "../common/mask.hpp"
#include "../common/softmax_state.hpp"
#include "../params.hpp"
#include "compose_pass.hpp"
#include "forward_geometry.hpp"
#include "score_fragments.hpp"
#include "staging.hpp"
#include "warp_product.hpp"
#include "weight_staging.hpp"

namespace dcmha::cuda {

/// kKeptScores: the split launches of a forward that keeps its composed scores
/// (ForwardGeometry::scores_kept), a kernel of their own: the statistics launch stores them, the
/// values launch reads them. Either inside the whole forward makes ptxas spill its 255 registers
/// (sm_90, head dim 128).
/// kComposes: Compose's code is compiled in (every mode); without it the kernel runs the registers
/// mode only (dispatch_forward_warps), as warps of two row tiles always do.
template <class T, int kHeadDim, class Block, int kRowTiles = 1, bool kKeptScores = false,
          bool kComposes = kRowTiles == 1>
class ForwardKernel {
 public:
  static constexpr int kKeyTiles = kKeys / 8, kValueTiles = kHeadDim / 8;
  static constexpr int kWarpRows = 16 * kRowTiles;
  static constexpr int kItemRows = kForwardItemRows<T, kHeadDim>;
  static_assert(kRowTiles == 1 || kTensorCoreType<T>, "tall warps take P from registers");
  static_assert(kRowTiles == 1 || !kComposes, "tall warps run the registers mode only");
  static_assert(!kKeptScores || kComposes, "kept scores are composed");
  /// Whether the statistics pass can keep the row statistics by key column
  /// (statistics_by_columns()): only two-row items let a block's threads take its whole slice at
  /// once, as a lane holds at most kCachedHeads of the M heads.
  static constexpr bool kColumnStatistics = kComposes && !kKeptScores && kItemRows == 2;

  DCMHA_INLINE ForwardKernel(const Block& blk, const detail::ForwardParams<T>& p,
                             const ForwardGeometry& geo, const KeySplit& split)
      : blk_(blk), p_(p), geo_(geo), split_(split), mask_(p.mask, p.dims.T, p.dims.S) {
    cluster_block_ = blk.cluster_rank();
    tile_ = int(blk.block(0) / geo.cluster);
    g_ = blk.block(1);
    b_ = blk.block(2) % p.dims.B;
    t0_ = index_t(tile_) * geo.rows;
    rows_real_ = p.dims.T - t0_ < geo.rows ? int(p.dims.T - t0_) : geo.rows;
    const int w = warp_of(blk);
    own_ = w / (geo.rows / kWarpRows);
    row0_ = w % (geo.rows / kWarpRows) * kWarpRows;
    head_ = g_ * geo.M + cluster_block_ * geo.own_heads + own_;
    const index_t heads_per_kv = p.dims.H / p.dims.Hk;
    kv_first_ = int((g_ * geo.M + cluster_block_ * geo.own_heads) / heads_per_kv);
    kv_slot_ = int(head_ / heads_per_kv - kv_first_);
    slice_row_begin_ = cluster_block_ / geo.key_slices * geo.slice_rows;
    slice_key_begin_ = cluster_block_ % geo.key_slices * geo.slice_keys;
  }

  DCMHA_INLINE void run() {
    start();
    const detail::KeyRange keys = block_keys();
    if constexpr (kKeptScores) {
      if (geo_.phase == ForwardPhase::split_statistics) {
        statistics_pass(keys);
        store_split_statistics();
      } else {
        load_split_lse();
        kept_values_pass(keys);
        store_split_output();
      }
    } else {
      // Each pass has one call site, so that the kernel inlines its code once (the compose code
      // of a pass is most of the kernel's PTX, and ptxas's time grows with it).
      if (geo_.phase == ForwardPhase::split_values) {
        load_split_lse();
      } else if (!online()) {
        statistics_pass(keys);
        if (geo_.phase == ForwardPhase::split_statistics) {
          store_split_statistics();
          return;
        }
        finish_statistics();
      }
      values_pass(keys);
      if (geo_.phase == ForwardPhase::split_values) {
        store_split_output();
      } else {
        if (online()) finish_statistics();
        store_output(online());
      }
    }
    // No peer touches this block's shared memory after the last compose's cluster barrier: the
    // block may leave.
  }

 private:
  using Values = Accumulators<kValueTiles>;
  using Scores = Accumulators<kKeyTiles>;

  /// What a pass holds in registers across its key tiles. The statistics pass, where no output
  /// accumulates, holds the warp's Q fragments (tensor cores, 16-row warps) and the lane's
  /// query-wise weights of Compose_pre; the others read both from shared memory every tile
  /// (beside the outputs' accumulators even the weights make ptxas spill).
  struct NothingHeld {
    static constexpr bool kQueryRows = false;
    QueryWeights query_weights;
  };
  /// The online softmax of a compose lane's positions over the key tiles: its item's rows and
  /// heads at its key column (the statistics pass, where the block's slice is one round of items).
  struct ColumnStatistics {
    detail::RunningLse<float> lse[kCachedHeads][kItemRows];
  };
  struct StatisticsHeld {
    static constexpr bool kQueryRows = kTensorCoreType<T> && kRowTiles == 1;
    HeldRows<kQueryRows ? kHeadDim : 16> query_rows;
    HeldQueryWeights<kItemRows, T> query_weights;
    ColumnStatistics columns;
  };

  // --- setup -----------------------------------------------------------------------------------

  DCMHA_INLINE index_t query_length() const { return mask_.query_length(b_); }
  DCMHA_INLINE index_t key_length() const { return mask_.key_length(b_); }
  /// The block's key split, read again where used rather than held across the passes.
  DCMHA_INLINE int split_index() const { return int(blk_.block(2) / p_.dims.B); }

  /// The keys the block's rows see, and of those its split's share (whole key tiles).
  DCMHA_INLINE detail::KeyRange block_keys() const {
    const detail::KeyRange all = mask_.rows(b_, t0_, t0_ + rows_real_);
    if (split_.count == 1) return all;
    const index_t tiles = (all.size() + kKeys - 1) / kKeys;
    const index_t per_split = (tiles + split_.count - 1) / split_.count;
    const index_t begin = all.begin + split_index() * per_split * kKeys;
    const index_t end = begin + per_split * kKeys < all.end ? begin + per_split * kKeys : all.end;
    return begin < end ? detail::KeyRange{begin, end} : detail::KeyRange{0, 0};
  }

  DCMHA_INLINE void start() {
    const index_t qlen = query_length();
    for (int j = 0; j < (reads_kept_scores() ? 0 : geo_.own_heads); ++j) {  // no QK^T there
      const index_t h = g_ * geo_.M + cluster_block_ * geo_.own_heads + j;
      stage_rows(blk_, sh().q().head(j), geo_.D, geo_.chunked_q, p_.q.data, [&](int r) -> const T* {
        const index_t t = t0_ + r;
        return r < rows_real_ && t < qlen ? &p_.q(b_, h, t, 0) : nullptr;
      });
    }
    blk_.cp_async_commit();
    stage_query_weights(0, p_.compose.pre);
    if (geo_.mode == ForwardMode::two_pass) stage_query_weights(1, p_.compose.post);
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) {
      const int r0 = row0_ + 16 * m;
      rows_[m] = FragmentRows(blk_, mask_, b_, t0_ + r0, rows_real_ - r0);
      state_[m][0] = state_[m][1] = detail::SoftmaxState<float>{};
      out_[m].zero();
    }
  }

  /// Query-wise (and static) weights of the block's slice rows.
  DCMHA_INLINE void stage_query_weights(int side, const ComposeTerms<T>& c) {
    const index_t real_end =
        t0_ + (rows_real_ < int(query_length() - t0_) ? rows_real_ : query_length() - t0_);
    cuda::stage_query_weights(blk_, sh().side(side), c,
                              {b_, g_, t0_ + slice_row_begin_, geo_.slice_rows, real_end});
    stage_static_weights(blk_, sh().side(side), c, g_);
  }

  /// Key-wise weights of the block's slice of the tile's keys [s0, s0 + kKeys).
  DCMHA_INLINE void stage_key_weights(int side, const ComposeTerms<T>& c, index_t s0) {
    if (sh().side(side).terms.key_wise)
      cuda::stage_key_weights(blk_, sh().side(side), c,
                              {b_, g_, s0 + slice_key_begin_, geo_.slice_keys, key_length()},
                              p_.keys);
  }

  /// Rows [s0, s0 + kKeys) of x (K or V) of every kv slot into `tiles` (uncommitted).
  DCMHA_INLINE void stage_keys(const OperandTiles<T>& tiles, const TensorView<const T, 4>& x,
                               int width, bool chunked, index_t s0) {
    const index_t klen = key_length();
    for (int slot = 0; slot < geo_.kv_slots; ++slot) {
      const index_t kv = kv_first_ + slot;
      stage_rows(blk_, tiles.head(slot), width, chunked, x.data, [&](int r) -> const T* {
        const index_t s = s0 + r;
        return s < klen ? &x(b_, kv, p_.keys.slot(b_, s), 0) : nullptr;
      });
    }
  }

  /// The key tiles of [keys.begin, keys.end) as a loop:
  ///   for (index_t s0 = first_key_tile(keys, values), stage = 0; s0 < keys.end; s0 += kKeys,
  ///        stage ^= 1) { key_tile(s0, keys, stage, values); ... }
  /// key_tile() leaves the tile's K rows in stage `stage`, landed and visible to the block, the
  /// next tile's K rows landing in the other stage and, with `values`, this tile's V rows in the V
  /// tiles (wait_values() before reading them).
  DCMHA_INLINE index_t first_key_tile(const detail::KeyRange& keys) {
    if (keys.empty()) return keys.end;
    if (!reads_kept_scores()) stage_keys(sh().k(0), p_.k, geo_.D, geo_.chunked_k, keys.begin);
    blk_.cp_async_commit();
    return keys.begin;
  }
  DCMHA_INLINE void key_tile(index_t s0, const detail::KeyRange& keys, int stage, bool values) {
    blk_.template cp_async_wait<0>();
    // This tile's K landed for everyone; every warp is done with the other stage and with the V
    // tiles of the last tile.
    blk_.sync();
    if (values) stage_keys(sh().v(), p_.v, geo_.Dv, geo_.chunked_v, s0);
    blk_.cp_async_commit();
    if (!reads_kept_scores() && s0 + kKeys < keys.end)
      stage_keys(sh().k(stage ^ 1), p_.k, geo_.D, geo_.chunked_k, s0 + kKeys);
    blk_.cp_async_commit();
  }

  /// This tile's V rows, landed and visible; the next tile's K (the newest group) may still be
  /// in flight.
  DCMHA_INLINE void wait_values() const {
    blk_.template cp_async_wait<1>();
    blk_.sync();
  }

  // --- the passes ------------------------------------------------------------------------------

  /// Q K^T's depth: the head dim in whole k16 steps (the tiles hold zeros past it).
  DCMHA_INLINE int score_depth() const { return (geo_.D + 15) / 16 * 16; }

  /// S = Q K^T of the warp's head and rows (unscaled), a row tile each; Q's fragments from
  /// `held` where the pass holds them.
  template <class Held>
  DCMHA_INLINE void scores(int stage, Scores (&s)[kRowTiles], const Held& held) const {
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) s[m].zero();
    const int depth = score_depth();
    if constexpr (Held::kQueryRows)
      product_held_rows(blk_, held.query_rows, sh().k(stage).head(kv_slot_), 0, depth, s[0]);
    else
      product_rows_rows(blk_, sh().q().head(own_), row0_, sh().k(stage).head(kv_slot_), 0, depth,
                        s);
  }

  DCMHA_INLINE float scale() const { return float(p_.scale); }

  /// The scores of the tile at s0 into the block's score tiles, Compose_pre on the block's slice
  /// with its output in the own heads' tiles (composed_tiles()); ends with the cluster synced.
  template <class Held = NothingHeld>
  DCMHA_INLINE void composed_scores(index_t s0, int stage, bool post_keys, const Held& held = {}) {
    Scores s[1];
    scores(stage, s, held);
    store_fragments(blk_, s[0], sh().scores().head(own_), row0_, 0, scale());
    stage_key_weights(0, p_.compose.pre, s0);
    if (post_keys) stage_key_weights(1, p_.compose.post, s0);
    blk_.sync_cluster();
  }

  /// composed_scores() of a values launch reading kept scores: they are composed already.
  DCMHA_INLINE void kept_scores(index_t s0) {
    move_kept_scores(s0, sh().scores(), false);
    stage_key_weights(1, p_.compose.post, s0);
    blk_.sync_cluster();
  }

  DCMHA_INLINE ScoreTiles composed_tiles() const { return sh().composed(); }

  /// The warp's composed scores of the tile at s0, masked (-inf where a row does not see a key):
  /// in registers (registers mode), or through the score tiles and Compose_pre on the block's
  /// slice. `held`: what the pass holds in registers.
  template <class Held = NothingHeld>
  DCMHA_INLINE void composed_fragments(index_t s0, int stage, Scores (&s)[kRowTiles],
                                       Held&& held = {}) {
    if (!kComposes || geo_.mode == ForwardMode::registers) {
      scores(stage, s, held);
      DCMHA_UNROLL
      for (int m = 0; m < kRowTiles; ++m) DCMHA_UNROLL
      for (int j = 0; j < kKeyTiles; ++j) DCMHA_UNROLL
      for (int i = 0; i < 4; ++i) s[m].c[j][i] *= scale();
    } else if constexpr (kComposes) {
      composed_scores(s0, stage, false, held);
      if (geo_.composes()) compose_scores(s0, held.query_weights);
      blk_.sync_cluster();
      load_fragments(blk_, composed_tiles().head(own_), row0_, 0, s[0]);
    }
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m)
      mask_fragments(blk_, rows_[m], s0, s[m], detail::negative_infinity<float>());
  }

  /// The online softmax's step over a tile's composed fragments: s = exp(s - running maximum) of
  /// each row tile; earlier terms of row tile m's rows are to be multiplied by factor[m].
  DCMHA_INLINE void softmax_step(Scores (&s)[kRowTiles], float (&factor)[kRowTiles][2]) {
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) online_softmax(blk_, s[m], state_[m], factor[m]);
  }

  /// Pass 1: the rows' statistics of the composed scores.
  DCMHA_INLINE void statistics_pass(const detail::KeyRange& keys) {
    int stage = 0;
    StatisticsHeld held;
    const bool by_columns = statistics_by_columns();
    for (index_t s0 = first_key_tile(keys); s0 < keys.end; s0 += kKeys, stage ^= 1) {
      key_tile(s0, keys, stage, false);
      if constexpr (StatisticsHeld::kQueryRows)
        if (s0 == keys.begin)  // Q landed with the first key tile
          load_held_rows(blk_, sh().q().head(own_), row0_, score_depth(), held.query_rows);
      if constexpr (kColumnStatistics) {
        if (by_columns) {
          composed_scores(s0, stage, false, held);
          compose_scores(s0, held.query_weights, &held.columns);
          blk_.sync_cluster();  // the next tile's scores and weights overwrite what this one read
          continue;
        }
      }
      Scores s[kRowTiles];
      float factor[kRowTiles][2];
      composed_fragments(s0, stage, s, held);
      softmax_step(s, factor);
      if (keeps_scores()) move_kept_scores(s0, composed_tiles(), true);
    }
    if constexpr (kColumnStatistics)
      if (by_columns) gather_column_statistics(held.columns);
  }

  /// Whether the statistics pass keeps the row statistics where Compose_pre makes the composed
  /// scores, each lane for its item's rows and heads at its key column, rather than returning the
  /// scores to their owners' tiles for their warps' online softmax: the scores then skip the trip
  /// back across the cluster and into fragments. The lane's item must be the same in every key
  /// tile (the slice in one round), and the kept scores' kernel stores the composed scores anyway.
  DCMHA_INLINE bool statistics_by_columns() const {
    return kColumnStatistics && geo_.composes() && geo_.slice_in_one_round(kItemRows);
  }

  /// The statistics pass's end where the lanes kept them by key column: each lane's states go to
  /// its positions' owners as one log-sum-exp each, in the composed tiles, and each warp merges
  /// its rows' key columns in column order into its row statistics.
  DCMHA_INLINE void gather_column_statistics(const ColumnStatistics& columns) {
    const ComposeItem it = item_of(0);
    const GroupTiles out = group_tiles(composed_tiles());
    if (it.valid)
      for_item_heads(it, [&](int j) {
        const ScoreTile t = out.head(blk_, it.head(j));
        DCMHA_UNROLL
        for (int i = 0; i < kItemRows; ++i)
          if (i < it.rows) blk_.store_shared(t.at(it.row0 + i, it.key), columns.lse[j][i].value);
      });
    blk_.sync_cluster();
    const ScoreTile own = composed_tiles().head(own_);
    const FragmentPlace f(blk_);
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = row0_ + f.row(2 * h);
      if (r >= rows_real_) continue;  // rows past T are not composed
      state_[0][h] = detail::merge_states<float>(kKeys, [&](int c) {
        detail::RunningLse<float> column;
        column.value = blk_.load_shared(own.at(r, c));
        return column.state();
      });
    }
    blk_.count_exp(2 * kKeys);
  }

  /// Whether the launch runs the one pass (registers / one_pass modes): the online softmax with
  /// the outputs rescaled as the maxima rise.
  DCMHA_INLINE bool online() const {
    return geo_.phase == ForwardPhase::whole && !(kComposes && geo_.mode == ForwardMode::two_pass);
  }

  /// O += P V with P the warp's own fragments (after wait_values()).
  DCMHA_INLINE void accumulate_values(const Scores (&probabilities)[kRowTiles]) {
    wait_values();
    if constexpr (kTensorCoreType<T>) {
      product_fragments_cols(blk_, probabilities, sh().v().head(kv_slot_), 0, out_);
    } else {
      // Float storage takes P through the warp's own rows of the P' tile.
      const OperandTile<T> tile = sh().probs().head(own_);
      const FragmentPlace f(blk_);
      DCMHA_UNROLL
      for (int j = 0; j < kKeyTiles; ++j) DCMHA_UNROLL
      for (int i = 0; i < 4; ++i)
        blk_.store_shared(tile.at(row0_ + f.row(i), 8 * j + f.column(i)),
                          T(probabilities[0].c[j][i]));
      blk_.sync_warp();
      product_rows_cols(blk_, tile, row0_, sh().v().head(kv_slot_), 0, 0, kKeys, out_[0]);
    }
  }

  /// Pass 2: exact probabilities from the lse (or the one pass's online softmax, online()); with
  /// Compose_post, through the block's slice and each head's owner, else in the warp's fragments;
  /// O += P' V.
  DCMHA_INLINE void values_pass(const detail::KeyRange& keys) {
    int stage = 0;
    for (index_t s0 = first_key_tile(keys); s0 < keys.end; s0 += kKeys, stage ^= 1) {
      key_tile(s0, keys, stage, true);
      if constexpr (kComposes) {
        if (geo_.mode == ForwardMode::two_pass) {
          composed_scores(s0, stage, true);
          composed_values(s0);
          continue;
        }
      }
      Scores s[kRowTiles];
      composed_fragments(s0, stage, s);
      if (online()) {
        float factor[kRowTiles][2];
        softmax_step(s, factor);
        DCMHA_UNROLL
        for (int m = 0; m < kRowTiles; ++m) DCMHA_UNROLL
        for (int j = 0; j < kValueTiles; ++j) DCMHA_UNROLL
        for (int i = 0; i < 4; ++i) out_[m].c[j][i] *= factor[m][i / 2];
      } else {
        DCMHA_UNROLL
        for (int m = 0; m < kRowTiles; ++m) probabilities_of_fragments(m, s[m]);
      }
      accumulate_values(s);
    }
  }

  /// The values launch of kept scores: pass 2 without K, QK^T and Compose_pre.
  DCMHA_INLINE void kept_values_pass(const detail::KeyRange& keys) {
    for (index_t s0 = first_key_tile(keys); s0 < keys.end; s0 += kKeys) {
      key_tile(s0, keys, 0, true);
      kept_scores(s0);
      composed_values(s0);
    }
  }

  /// Pass 2's tile after its composed scores: P' of the block's slice to each head's owner, then
  /// O += P' V.
  DCMHA_INLINE void composed_values(index_t s0) {
    compose_probabilities(s0);
    blk_.sync_cluster();
    wait_values();
    product_rows_cols(blk_, sh().probs().head(own_), row0_, sh().v().head(kv_slot_), 0, 0, kKeys,
                      out_[0]);
  }

  /// exp(s - lse) of the warp's row tile m (lse in shared memory), 0 for rows that see no key.
  DCMHA_INLINE void probabilities_of_fragments(int m, Scores& s) const {
    using std::exp;
    const FragmentPlace f(blk_);
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float l = blk_.load_shared(sh().lse(own_, row0_ + 16 * m + f.row(2 * h)));
      DCMHA_UNROLL
      for (int j = 0; j < kKeyTiles; ++j) DCMHA_UNROLL
      for (int i = 2 * h; i < 2 * h + 2; ++i)
        s.c[j][i] = l > detail::negative_infinity<float>() ? exp(s.c[j][i] - l) : 0.0f;
    }
    blk_.count_exp(index_t(kKeyTiles) * 4);
  }

  // --- Compose on the block's slice --------------------------------------------------------------

  DCMHA_INLINE GroupTiles group_tiles(const ScoreTiles& t) const { return {t, geo_.own_heads}; }

  /// The block's slice: its rows and keys of the tile.
  DCMHA_INLINE ComposeRegion region() const {
    return {slice_row_begin_, geo_.slice_rows,  slice_key_begin_,
            geo_.slice_keys,  slice_row_begin_, slice_key_begin_};
  }

  /// A round's compose item of the slice, less its rows past T. Those only pad the tile (a
  /// decode step's tile is one real row of 16): their scores, statistics and outputs stay in
  /// their own rows of the products and are never stored, so they are not composed.
  DCMHA_INLINE ComposeItem item_of(int round) const {
    ComposeItem it = compose_item<kItemRows>(blk_, region(), geo_.M, geo_.compose_parts, round);
    const int real = rows_real_ - it.row0;
    if (real < it.rows) it.rows = real < 0 ? 0 : real;
    return it;
  }

  /// The keys the rows of an item see.
  DCMHA_INLINE void item_ranges(const ComposeItem& it, detail::KeyRange (&r)[kItemRows]) const {
    DCMHA_UNROLL
    for (int i = 0; i < kItemRows; ++i) {
      const int row = it.row0 + i;
      r[i] = i < it.rows && row < rows_real_ ? mask_.row(b_, t0_ + row) : detail::KeyRange{0, 0};
    }
  }

  /// Compose_pre of the slice's scores; invisible positions become -inf (the statistics skip
  /// them). Without Compose_pre (float MHA) the scores are only masked. The query-wise weights
  /// come from `query`: QueryWeights, or HeldQueryWeights where the registers allow. With
  /// `columns` the visible composed scores are added to the lane's statistics instead of stored.
  template <class Query>
  DCMHA_INLINE void compose_scores(index_t s0, Query& query, ColumnStatistics* columns = nullptr) {
    const SideWeights<T> w = sh().side(0);
    const GroupTiles in = group_tiles(sh().scores()), out = group_tiles(composed_tiles());
    const int rounds = compose_rounds<kItemRows>(blk_, region(), geo_.compose_parts);
    for (int round = 0; round < rounds; ++round) {
      const ComposeItem it = item_of(round);
      query.hold(blk_, w, it);
      Projections<kItemRows> proj;
      proj.zero();
      ItemValues<kItemRows> x;
      if (it.valid) {
        for_item_heads(it, [&](int j) { load_item(blk_, in.head(blk_, it.head(j)), it, x.v[j]); });
        proj.add(blk_, w, it, x, Direction::forward, query);
      }
      proj.reduce(blk_, w.terms, geo_.compose_parts);
      if (!it.valid) continue;
      detail::KeyRange ranges[kItemRows];
      item_ranges(it, ranges);
      compose_heads(blk_, w, it, proj, x, x, Direction::forward, query);
      for_item_heads(it, [&](int j) {
        const int n = it.head(j);
        if (w.terms.static_w) add_static_term(blk_, w, in, it, n, x.v[j]);
        if (columns) {
          DCMHA_UNROLL
          for (int i = 0; i < kItemRows; ++i)
            if (i < it.rows && ranges[i].contains(s0 + it.key)) columns->lse[j][i].add(x.v[j][i]);
          blk_.count_exp(2 * it.rows);  // an exponential and a logarithm
          return;
        }
        const ScoreTile t = out.head(blk_, n);
        DCMHA_UNROLL
        for (int i = 0; i < kItemRows; ++i)
          if (i < it.rows)
            blk_.store_shared(t.at(it.row0 + i, it.key), ranges[i].contains(s0 + it.key)
                                                             ? x.v[j][i]
                                                             : detail::negative_infinity<float>());
      });
    }
  }

  /// Compose_pre, P = exp(L' - lse) (0 where a row does not see the key or sees none at all),
  /// Compose_post, and P' in the storage type to each head's owner.
  DCMHA_INLINE void compose_probabilities(index_t s0) {
    const SideWeights<T> pre = sh().side(0), post = sh().side(1);
    const GroupTiles in = group_tiles(sh().scores()), probs = group_tiles(composed_tiles());
    for (int round = 0; round < compose_rounds<kItemRows>(blk_, region(), geo_.compose_parts);
         ++round) {
      const ComposeItem it = item_of(round);
      Projections<kItemRows> proj, post_proj;
      proj.zero();
      post_proj.zero();
      // The lane's heads' values, in place: scores, probabilities, P'.
      ItemValues<kItemRows> x;
      detail::KeyRange ranges[kItemRows];
      item_ranges(it, ranges);
      if (it.valid) {
        for_item_heads(it, [&](int j) { load_item(blk_, in.head(blk_, it.head(j)), it, x.v[j]); });
        proj.add(blk_, pre, it, x);
      }
      proj.reduce(blk_, pre.terms, geo_.compose_parts);
      // Probabilities and their projections for Compose_post; stored (in place of the scores)
      // only for a static W, which reads every head's.
      if (it.valid) {
        compose_heads(blk_, pre, it, proj, x, x);
        for_item_heads(it, [&](int j) {
          const int n = it.head(j);
          if (pre.terms.static_w) add_static_term(blk_, pre, in, it, n, x.v[j]);
          probabilities(it, n, ranges, s0, x.v[j]);
          if (!post.terms.static_w) return;
          const ScoreTile t = probs.head(blk_, n);
          DCMHA_UNROLL
          for (int i = 0; i < kItemRows; ++i)
            if (i < it.rows) blk_.store_shared(t.at(it.row0 + i, it.key), x.v[j][i]);
        });
        post_proj.add(blk_, post, it, x);
      }
      post_proj.reduce(blk_, post.terms, geo_.compose_parts);
      // A static W reads the other parts' probabilities: the item's lanes are one warp.
      if (post.terms.static_w) blk_.sync_warp();
      if (!it.valid) continue;
      compose_heads(blk_, post, it, post_proj, x, x);
      for_item_heads(it, [&](int j) {
        const int n = it.head(j);
        if (post.terms.static_w) add_static_term(blk_, post, probs, it, n, x.v[j]);
        const OperandTile<T> t = sh().probs().head(n % geo_.own_heads);
        DCMHA_UNROLL
        for (int i = 0; i < kItemRows; ++i)
          if (i < it.rows)
            blk_.store_shared(blk_.peer_shared(t.at(it.row0 + i, it.key), n / geo_.own_heads),
                              T(ranges[i].contains(s0 + it.key) ? x.v[j][i] : 0.0f));
      });
    }
  }

  /// y = exp(y - lse of head n) at the item's rows, 0 where invisible.
  DCMHA_INLINE void probabilities(const ComposeItem& it, int n,
                                  const detail::KeyRange (&ranges)[kItemRows], index_t s0,
                                  float (&y)[kItemRows]) const {
    using std::exp;
    const float* lse = blk_.peer_shared(sh().lse(n % geo_.own_heads, 0), n / geo_.own_heads);
    DCMHA_UNROLL
    for (int i = 0; i < kItemRows; ++i) {
      if (i >= it.rows) continue;
      const float l = blk_.load_shared(lse + it.row0 + i);
      y[i] = ranges[i].contains(s0 + it.key) && l > detail::negative_infinity<float>()
                 ? exp(y[i] - l)
                 : 0.0f;
    }
    blk_.count_exp(it.rows);
  }

  // --- statistics and outputs ----------------------------------------------------------------

  /// Each row's lse into shared memory (for pass 2: its compose reads every head's after the
  /// cluster barrier that starts each key tile's compose) and, for the block's real rows, the
  /// caller's lse.
  DCMHA_INLINE void finish_statistics() {
    const FragmentPlace f(blk_);
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = row0_ + 16 * m + f.row(2 * h);
      const float l = state_[m][h].lse();
      if (f.t == 0) {
        blk_.store_shared(sh().lse(own_, r), l);
        if (r < rows_real_ && !p_.lse.empty()) blk_.store_global(&p_.lse(b_, head_, t0_ + r), l);
      }
    }
  }

  /// The warp's rows of the output, divided by the row sums (the online pass) or as they are.
  DCMHA_INLINE void store_output(bool normalize) {
    const FragmentPlace f(blk_);
    const index_t qlen = query_length();
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) DCMHA_UNROLL
    for (int j = 0; j < kValueTiles; ++j) DCMHA_UNROLL
    for (int i = 0; i < 4; i += 2) {
      const int r = row0_ + 16 * m + f.row(i), e = 8 * j + f.column(i);
      if (r >= rows_real_ || e >= geo_.Dv) continue;
      const float sum = state_[m][i / 2].sum;
      const bool padding = t0_ + r >= qlen;  // padding rows: zero output
      const auto value = [&](float x) {
        if (normalize) x = sum > 0 ? x / sum : 0.0f;
        return T(padding ? 0.0f : x);
      };
      T* at = &p_.out(b_, head_, t0_ + r, e);
      store_column_pair(blk_, at, value(out_[m].c[j][i]), value(out_[m].c[j][i + 1]),
                        e + 1 < geo_.Dv);
    }
  }

  // --- split keys --------------------------------------------------------------------------------

  /// Kept scores (kKeptScores): the statistics launch stores the composed scores of the real
  /// rows, the values launch reads them in place of QK^T and Compose_pre.
  DCMHA_INLINE bool keeps_scores() const {
    return kKeptScores && geo_.phase == ForwardPhase::split_statistics;
  }
  DCMHA_INLINE bool reads_kept_scores() const {
    return kKeptScores && geo_.phase == ForwardPhase::split_values;
  }

  /// The warp's real rows of its head's tile at s0 to the kept scores (`store`) or back, a lane
  /// per key (kKeys lanes). Each split writes its own whole key tiles (-inf where no row sees a
  /// key).
  DCMHA_INLINE void move_kept_scores(index_t s0, const ScoreTiles& tiles, bool store) const {
    static_assert(kKeys == kWarpSize, "a lane per key of the tile");
    const ScoreTile t = tiles.head(own_);
    const int key = lane_of(blk_);
    for (int r = row0_; r < row0_ + kWarpRows && r < rows_real_; ++r) {
      float* kept = split_.scores + row_index(r) * kept_score_row(p_.dims.S) + s0 + key;
      if (store)
        blk_.store_global(kept, blk_.load_shared(t.at(r, key)));
      else
        blk_.store_shared(t.at(r, key), blk_.load_global(kept));
    }
  }

  DCMHA_INLINE index_t row_index(int r) const {
    return (b_ * p_.dims.H + head_) * p_.dims.T + t0_ + r;
  }
  DCMHA_INLINE index_t rows_total() const { return p_.dims.B * p_.dims.H * p_.dims.T; }

  DCMHA_INLINE void store_split_statistics() {
    const FragmentPlace f(blk_);
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = row0_ + 16 * m + f.row(2 * h);
      if (f.t != 0 || r >= rows_real_) continue;
      float* stats = split_.stats + 2 * (split_index() * rows_total() + row_index(r));
      blk_.store_global(stats, state_[m][h].max);
      blk_.store_global(stats + 1, state_[m][h].sum);
    }
  }

  DCMHA_INLINE void load_split_lse() {
    const FragmentPlace f(blk_);
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = row0_ + 16 * m + f.row(2 * h);
      if (f.t != 0) continue;
      const float l = r < rows_real_ ? blk_.load_global(split_.lse + row_index(r))
                                     : detail::negative_infinity<float>();
      blk_.store_shared(sh().lse(own_, r), l);
    }
  }

  DCMHA_INLINE void store_split_output() {
    const FragmentPlace f(blk_);
    DCMHA_UNROLL
    for (int m = 0; m < kRowTiles; ++m) DCMHA_UNROLL
    for (int j = 0; j < kValueTiles; ++j) DCMHA_UNROLL
    for (int i = 0; i < 4; i += 2) {
      const int r = row0_ + 16 * m + f.row(i), e = 8 * j + f.column(i);
      if (r >= rows_real_ || e >= geo_.Dv) continue;
      float* at = split_.out + (split_index() * rows_total() + row_index(r)) * p_.dims.Dv + e;
      store_column_pair(blk_, at, out_[m].c[j][i], out_[m].c[j][i + 1], e + 1 < geo_.Dv);
    }
  }

  DCMHA_INLINE ForwardTiles<T, kHeadDim> sh() const { return {geo_, blk_.shared()}; }

  const Block& blk_;
  const detail::ForwardParams<T>& p_;
  const ForwardGeometry& geo_;
  KeySplit split_;
  detail::RowMask mask_;
  int cluster_block_ = 0, tile_ = 0, own_ = 0, row0_ = 0, kv_slot_ = 0, slice_row_begin_ = 0,
      slice_key_begin_ = 0, rows_real_ = 0;
  int kv_first_ = 0;  // a head index fits 32 bits: a register less
  index_t g_ = 0, b_ = 0, t0_ = 0, head_ = 0;
  FragmentRows rows_[kRowTiles];
  detail::SoftmaxState<float> state_[kRowTiles][2];
  Values out_[kRowTiles];
};

/// A split forward's second launch, one block per (sequence, head): each row's lse from the
/// splits' statistics, merged in split order (and written to the caller's lse, if kept).
template <class Block, class T>
DCMHA_INLINE void combine_split_statistics(const Block& blk, const detail::ForwardParams<T>& p,
                                           const KeySplit& split) {
  const index_t b = blk.block(0), h = blk.block(1), T_ = p.dims.T;
  const index_t rows_total = p.dims.B * p.dims.H * T_;
  for (index_t t = blk.thread(); t < T_; t += blk.threads()) {
    const index_t row = (b * p.dims.H + h) * T_ + t;
    const detail::SoftmaxState<float> total = detail::merge_states<float>(split.count, [&](int s) {
      detail::SoftmaxState<float> st;
      st.max = blk.load_global(split.stats + 2 * (s * rows_total + row));
      st.sum = blk.load_global(split.stats + 2 * (s * rows_total + row) + 1);
      return st;
    });
    blk.store_global(split.lse + row, total.lse());
    if (!p.lse.empty()) blk.store_global(&p.lse(b, h, t), total.lse());
  }
}

/// A split forward's last launch, one block per (sequence, head): out = the splits' P'V summed
/// in split order, rounded once; padding rows are zeros.
template <class Block, class T>
DCMHA_INLINE void sum_split_outputs(const Block& blk, const detail::ForwardParams<T>& p,
                                    const KeySplit& split) {
  const index_t b = blk.block(0), h = blk.block(1), T_ = p.dims.T, Dv = p.dims.Dv;
  const index_t rows_total = p.dims.B * p.dims.H * T_, first_row = (b * p.dims.H + h) * T_;
  const index_t qlen = detail::sequence_length(p.mask.query_lengths, b, T_);
  for (index_t item = blk.thread(); item < T_ * Dv; item += blk.threads()) {
    const index_t t = item / Dv, e = item % Dv;
    float sum = 0;
    if (t < qlen)
      for (int s = 0; s < split.count; ++s)
        sum += blk.load_global(split.out + (s * rows_total + first_row + t) * Dv + e);
    blk.store_global(&p.out(b, h, t, e), T(sum));
  }
}

}  // namespace dcmha::cuda

#pragma once
// The backward kernel bodies. Deterministic by construction: every gradient element is summed by
// one thread in a fixed order, nothing uses atomics.
//
//   QueryGradKernel  a cluster per (query tile, group, sequence), two passes over the key tiles:
//                    the row dots D = rowsum(P dP) first (Compose_post sits between P and O, so
//                    D is not O . dO as in MHA, and the backward is not given O), then dQ, the
//                    query-wise terms' gradients and a per-block partial of W's; writes D for
//                    the key side.
//   KeyGradKernel    a cluster per (key tile, group, sequence), over the query tiles that see its
//                    keys: dK, dV and the key-wise terms' gradients.
//   sum_static_grads, sum_head_grads   W's partials in block order; dK, dV of the query heads of a
//                    kv head in head order (GQA).
//
// MHA on the tensor cores keeps the chain in fragments (FlashAttention-2's backward, split in a
// query side and a key side) and holds the rows a warp reuses every tile in registers (Q and dO on
// the query side; K and V on the key side, up to head dim 96); otherwise each key (query) tile
// goes: the products L = scale Q K^T and dP' = dO V^T into the chain tiles, [cluster barrier],
// the chain on the block's slice (backward_compose.hpp), [barrier], dQ += dL K (dK += dL^T Q,
// dV += P'^T dO), the compose weights' gradients.
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/mask.hpp"
#include "../common/softmax_state.hpp"
#include "../params.hpp"
#include "backward_compose.hpp"
#include "backward_geometry.hpp"
#include "score_fragments.hpp"
#include "staging.hpp"
#include "warp_product.hpp"
#include "weight_staging.hpp"

namespace dcmha::cuda {

/// Lane `part` of a quad's share of sum over d < width of out[d] dout[d] (rows with a contiguous
/// head dim): 16-byte loads where both rows allow them, so that a quad reads 64 contiguous bytes
/// of each per step, else one element at a time.
template <class T, class Block>
DCMHA_INLINE float row_dot_part(const Block& blk, const T* out, const T* dout, int width,
                                int part) {
  constexpr int kChunk = 16 / int(sizeof(T));
  struct alignas(16) Chunk {
    T x[kChunk];
  };
  const auto address = [](const T* x) { return reinterpret_cast<std::uintptr_t>(x); };
  float sum = 0;
  if (width % kChunk == 0 && (address(out) | address(dout)) % 16 == 0) {
    for (int c = part; c < width / kChunk; c += 4) {
      const Chunk o = blk.load_global(reinterpret_cast<const Chunk*>(out) + c);
      const Chunk g = blk.load_global(reinterpret_cast<const Chunk*>(dout) + c);
      DCMHA_UNROLL
      for (int e = 0; e < kChunk; ++e) sum += float(o.x[e]) * float(g.x[e]);
    }
    return sum;
  }
  for (int d = part; d < width; d += 4)
    sum += float(blk.load_global(out + d)) * float(blk.load_global(dout + d));
  return sum;
}

/// What both sides share: the block's place, its heads, the mask, staging, the compose weights'
/// gradients (a lane's sums of kHeadsPerLane heads).
template <class T, class Block, int kHeadsPerLane = 4>
class BackwardBlock {
 protected:
  DCMHA_INLINE BackwardBlock(const Block& blk, const detail::BackwardParams<T>& p,
                             const BackwardGeometry& geo)
      : blk_(blk), p_(p), geo_(geo) {
    cluster_block_ = blk.cluster_rank();
    tile_ = int(blk.block(0) / geo.cluster);
    g_ = blk.block(1);
    b_ = blk.block(2);
    const int w = warp_of(blk);
    own_ = w / (geo.rows / 16);
    row0_ = w % (geo.rows / 16) * 16;
    const index_t heads_per_kv = p.dims.H / p.dims.Hk;
    head_ = g_ * geo.M + cluster_block_ * geo.own_heads + own_;
    kv_first_ = (g_ * geo.M + cluster_block_ * geo.own_heads) / heads_per_kv;
    kv_slot_ = int(head_ / heads_per_kv - kv_first_);
  }

  DCMHA_INLINE index_t query_length() const { return mask().query_length(b_); }
  DCMHA_INLINE index_t key_length() const { return mask().key_length(b_); }
  DCMHA_INLINE index_t own_head(int j) const {
    return g_ * geo_.M + cluster_block_ * geo_.own_heads + j;
  }
  DCMHA_INLINE float scale() const { return float(p_.scale); }
  DCMHA_INLINE int depth_of(int width) const { return (width + 15) / 16 * 16; }

  /// Rows [t0, t0 + rows) of a query-side tensor (Q or dO) of every own head.
  DCMHA_INLINE void stage_query_rows(const OperandTiles<T>& tiles, const TensorView<const T, 4>& x,
                                     int width, bool chunked, index_t t0, int rows) {
    const index_t qlen = query_length();
    for (int j = 0; j < geo_.own_heads; ++j) {
      const index_t h = own_head(j);
      stage_rows(blk_, tiles.head(j), width, chunked, x.data, [&](int r) -> const T* {
        const index_t t = t0 + r;
        return r < rows && t < qlen ? &x(b_, h, t, 0) : nullptr;
      });
    }
  }

  /// Keys [s0, s0 + keys) of K or V of every kv slot.
  DCMHA_INLINE void stage_key_rows(const OperandTiles<T>& tiles, const TensorView<const T, 4>& x,
                                   int width, bool chunked, index_t s0, int keys) {
    const index_t klen = key_length();
    for (int slot = 0; slot < geo_.kv_slots; ++slot) {
      const index_t kv = kv_first_ + slot;
      stage_rows(blk_, tiles.head(slot), width, chunked, x.data, [&](int r) -> const T* {
        const index_t s = s0 + r;
        return r < keys && s < klen ? &x(b_, kv, s, 0) : nullptr;
      });
    }
  }

  /// The lse (and D) of every own head at rows [t0, t0 + rows) into shared memory [own][rows];
  /// rows that are not real get lse -inf.
  DCMHA_INLINE void load_row_statistics(float* lse, float* row_dot, const float* row_dots,
                                        index_t t0, int rows, int stride) {
    const index_t qlen = query_length();
    for_each_owned(blk_, geo_.own_heads * rows, [&](int i) {
      const int j = i / rows, r = i % rows;
      const index_t t = t0 + r, h = own_head(j);
      const bool real = t < qlen;
      blk_.store_shared(lse + j * stride + r, row_lse(h, t, qlen));
      if (row_dots)
        blk_.store_shared(
            row_dot + j * stride + r,
            real ? blk_.load_global(row_dots + (b_ * p_.dims.H + h) * p_.dims.T + t) : 0.0f);
    });
  }

  /// Row t's lse of head h from the forward; -inf past the query length.
  DCMHA_INLINE float row_lse(index_t h, index_t t, index_t qlen) const {
    return t < qlen ? blk_.load_global(&p_.lse(b_, h, t)) : detail::negative_infinity<float>();
  }

  /// The key side's walk: the first query tile (of geo_.tile_rows() rows) at or after `tile`
  /// whose rows see a key of the block's keys [s0, s0 + keys).
  DCMHA_INLINE index_t next_query_tile(index_t tile, index_t tiles, index_t s0, int keys) const {
    const int rows = geo_.tile_rows();
    for (; tile < tiles; ++tile) {
      const index_t t0 = tile * rows;
      const index_t t1 = t0 + rows < p_.dims.T ? t0 + rows : p_.dims.T;
      const detail::KeyRange r = mask().rows(b_, t0, t1);
      if (r.begin < s0 + keys && r.end > s0) return tile;
    }
    return tiles;
  }

  /// The key side's Q and dO rows of query tile `tile` into `stage`, one copy group.
  template <int kHeadDim>
  DCMHA_INLINE void stage_query_tile(const BackwardTiles<T, kHeadDim>& sh, index_t tile,
                                     int stage) {
    const index_t t0 = tile * geo_.tile_rows();
    const int rows = p_.dims.T - t0 < geo_.tile_rows() ? int(p_.dims.T - t0) : geo_.tile_rows();
    stage_query_rows(sh.q(stage), p_.q, geo_.D, geo_.chunked_q, t0, rows);
    stage_query_rows(sh.dout(stage), p_.dout, geo_.Dv, geo_.chunked_dout, t0, rows);
    blk_.cp_async_commit();
  }

  /// Elements (s, d) and (s, d + 1) of the head's dK (times the scale) and dV (a lane's column
  /// pair, d even), 0 past the key length (`real` false): into dk and dv, or with GQA into the
  /// per-head scratch.
  DCMHA_INLINE void store_key_grads(const BackwardScratch& scratch, index_t s, int d, bool real,
                                    FloatPair dk, FloatPair dv) const {
    dk = real ? FloatPair{scale() * dk.x, scale() * dk.y} : FloatPair{0.0f, 0.0f};
    dv = real ? dv : FloatPair{0.0f, 0.0f};
    const bool k_pair = d + 1 < geo_.D, v_pair = d + 1 < geo_.Dv;
    if (geo_.dkv_per_head) {
      const index_t row = (b_ * p_.dims.H + head_) * p_.dims.S + s;
      float* dk_at = scratch.dk + row * geo_.D + d;
      float* dv_at = scratch.dv + row * geo_.Dv + d;
      if (d < geo_.D) store_column_pair(blk_, dk_at, dk.x, dk.y, k_pair);
      if (d < geo_.Dv) store_column_pair(blk_, dv_at, dv.x, dv.y, v_pair);
      return;
    }
    const index_t kv = head_ / (p_.dims.H / p_.dims.Hk);
    T* dk_at = &p_.dk(b_, kv, s, d);
    T* dv_at = &p_.dv(b_, kv, s, d);
    if (d < geo_.D) store_column_pair(blk_, dk_at, T(dk.x), T(dk.y), k_pair);
    if (d < geo_.Dv) store_column_pair(blk_, dv_at, T(dv.x), T(dv.y), v_pair);
  }

  /// What the chain on the block's region reads and writes.
  template <int kHeadDim>
  DCMHA_INLINE ChainContext<T> chain_context(const BackwardTiles<T, kHeadDim>& sh,
                                             const ComposeRegion& region) const {
    ChainContext<T> cx;
    cx.pre = sh.side(0);
    cx.post = sh.side(1);
    cx.tiles = sh.chain();
    cx.dscores = sh.dscores();
    cx.values_probs = sh.values_probs();
    cx.lse = sh.lse();
    cx.row_dot = sh.row_dot();
    cx.own_heads = geo_.own_heads;
    cx.statistics_rows = geo_.tile_rows();
    cx.sums = sh.sums();
    cx.region = region;
    cx.query_axis = !geo_.key_side;
    return cx;
  }

  /// The A operands of a tile's first two products, the warp's 16 rows from row0_ (Q and dO on
  /// the query side, K and V on the key side): `scores` over D into the scores, `upstream` over
  /// Dv into dP'.
  struct OperandPair {
    OperandTile<T> scores, upstream;
  };
  /// The same rows held in registers as A fragments, up to head dim kDepth (MHA on the tensor
  /// cores), loaded once by hold_pair.
  template <int kDepth>
  struct HeldPair {
    HeldRows<kDepth> scores, upstream;
    bool loaded = false;
  };

  template <int kDepth>
  DCMHA_INLINE void hold_pair(const OperandPair& a, HeldPair<kDepth>& held) const {
    load_held_rows(blk_, a.scores, row0_, depth_of(geo_.D), held.scores);
    load_held_rows(blk_, a.upstream, row0_, depth_of(geo_.Dv), held.upstream);
    held.loaded = true;
  }

  /// scores = A.scores b.scores^T and upstream = A.upstream b.upstream^T, unscaled, A an
  /// OperandPair or a HeldPair.
  template <class Rows, int kTiles>
  DCMHA_INLINE void pair_products(const Rows& a, const OperandPair& b, Accumulators<kTiles>& scores,
                                  Accumulators<kTiles>& upstream) const {
    scores.zero();
    upstream.zero();
    multiply_rows(a.scores, b.scores, depth_of(geo_.D), scores);
    multiply_rows(a.upstream, b.upstream, depth_of(geo_.Dv), upstream);
  }
  template <int kTiles>
  DCMHA_INLINE void multiply_rows(const OperandTile<T>& a, const OperandTile<T>& b, int depth,
                                  Accumulators<kTiles>& acc) const {
    product_rows_rows(blk_, a, row0_, b, 0, depth, acc);
  }
  template <int kTiles, int kDepth>
  DCMHA_INLINE void multiply_rows(const HeldRows<kDepth>& a, const OperandTile<T>& b, int depth,
                                  Accumulators<kTiles>& acc) const {
    product_held_rows(blk_, a, b, 0, depth, acc);
  }

  /// The compose weights' gradients along the kernel's axis are summed per pair (resident line,
  /// own head): line a row (query side) or a key (key side) of the block. A warp takes one side's
  /// pairs of kHeadsPerLane heads (DCFormer's 4 own heads: all of them) and lines_per_warp()
  /// consecutive lines at a time, the rest of its lanes per line splitting the tile's other axis,
  /// so that a lane reads each projection sum once for its heads (the sums are the composer's,
  /// alike for every head, and most cross the cluster); the sides, not head groups, give every
  /// warp a unit. The sums sit in shared memory between tiles, [pair][side][w1 r, w2 r, dd]; a
  /// side's terms of the group's heads are the line's elements (LineElements), each owned by one
  /// of its lanes, which alone zeroes, adds to and stores it (no barrier between the three).
  /// Query side: 4 rows x 8 keys a step, key side: 8 keys x 4 rows, so that each step reads
  /// whole bank rows of the tiles.
  template <int kHeadDim>
  DCMHA_INLINE float* weight_grads(const BackwardTiles<T, kHeadDim>& sh, int pair, int side) const {
    return at_offset<float>(sh.base, geo_.layout.grads) +
           (index_t(pair) * 2 + side) * (2 * kMaxRank + 1);
  }
  DCMHA_INLINE int pairs() const { return geo_.registers ? 0 : geo_.rows * geo_.own_heads; }
  DCMHA_INLINE int pair_of(int line, int head) const { return head * geo_.rows + line; }
  DCMHA_INLINE int lines_per_warp() const { return geo_.key_side ? 8 : 4; }
  DCMHA_INLINE int lanes_per_line() const { return kWarpSize / lines_per_warp(); }
  /// R of a side's terms along the kernel's axis (0: the side has none).
  DCMHA_INLINE int axis_rank(int side) const {
    const detail::ComposeTermSet& t = side == 0 ? geo_.terms.pre : geo_.terms.post;
    return int(geo_.key_side ? t.key_rank : t.query_rank);
  }

  /// A side's sums of a line's group of heads as a list: element i is term i / kHeadsPerLane
  /// (w1 r < R, w2 r < R, dd) of head i % kHeadsPerLane, and belongs to the line's lane
  /// i % lanes_per_line(), the one scatter_sums_over_parts leaves its sum with.
  struct LineElements {
    /// None where the side has no terms along the axis (R = 0).
    static DCMHA_INLINE constexpr int count(int R) {
      return R > 0 ? kHeadsPerLane * (2 * R + 1) : 0;
    }
    static DCMHA_INLINE constexpr int head(int i) { return i % kHeadsPerLane; }
    /// The element's place in a pair's [w1 r, w2 r, dd].
    static DCMHA_INLINE constexpr int slot(int i, int R) {
      const int term = i / kHeadsPerLane;
      return term < R ? term : term < 2 * R ? kMaxRank + term - R : 2 * kMaxRank;
    }
  };
  /// Calls f(head, slot) for the elements of a side of rank R this lane owns, of `heads` heads.
  template <class F>
  DCMHA_INLINE void for_owned_elements(int R, int heads, F&& f) const {
    const int lanes = lanes_per_line();
    for (int i = unhoisted_lane_of(blk_) % lanes; i < LineElements::count(R); i += lanes)
      if (LineElements::head(i) < heads) f(LineElements::head(i), LineElements::slot(i, R));
  }

  /// Where this lane works on the weight gradients: f(line, first_head, heads, side) for each
  /// unit of lines, heads and side its warp takes (warp-uniform: every lane calls f; line < 0 past
  /// the lines), heads [first_head, first_head + heads) of the line, a side with terms along the
  /// axis.
  template <class F>
  DCMHA_INLINE void for_each_line_group(F&& f) const {
    const int lines = lines_per_warp(), lanes = lanes_per_line(), lane = lane_of(blk_);
    const int groups = (geo_.rows + lines - 1) / lines, warps = blk_.threads() / kWarpSize;
    const int head_groups = (geo_.own_heads + kHeadsPerLane - 1) / kHeadsPerLane;
    const int per_side = groups * head_groups, first_side = axis_rank(0) > 0 ? 0 : 1;
    const int sides = (axis_rank(0) > 0) + (axis_rank(1) > 0);
    for (int unit = warp_of(blk_); unit < per_side * sides; unit += warps) {
      const int side = first_side + unit / per_side, within = unit % per_side;
      const int first_head = within / groups * kHeadsPerLane;
      const int heads =
          geo_.own_heads - first_head < kHeadsPerLane ? geo_.own_heads - first_head : kHeadsPerLane;
      const int line = within % groups * lines + lane / lanes;
      f(line < geo_.rows ? line : -1, first_head, heads, side);
    }
  }

  /// Zeroes the elements this lane owns.
  template <int kHeadDim>
  DCMHA_INLINE void zero_weight_grads(const BackwardTiles<T, kHeadDim>& sh) const {
    if (pairs() == 0) return;
    for_each_line_group([&](int line, int first_head, int heads, int side) {
      if (line < 0) return;
      for_owned_elements(axis_rank(side), heads, [&](int h, int slot) {
        blk_.store_shared(weight_grads(sh, pair_of(line, first_head + h), side) + slot, 0.0f);
      });
    });
  }

  /// Adds the tile's terms to the pairs: x and dy from the own heads' chain tiles, the
  /// projections from the block that composed the line, summed over the tile's other axis (each
  /// lane its share in order, then the line's lanes by shuffles, each sum left with its owner).
  template <int kHeadDim>
  DCMHA_INLINE void accumulate_weight_grads(const BackwardTiles<T, kHeadDim>& sh) const {
    if (pairs() == 0) return;
    for_each_line_group([&](int line, int first_head, int heads, int side) {
      const int R = axis_rank(side);
      blk_.count_fma(index_t(geo_.key_side ? kStreamRows : kKeys) * (1 + 2 * R) * heads /
                     lanes_per_line());
      with_rank(R, [&](auto rank) {
        constexpr int kRank = decltype(rank)::value;
        const LineSums sums = line_sums<kRank>(sh, side, line, first_head, heads);
        add_line_lanes<kRank>(sums, [&](int h, int slot, float sum) {
          if (line < 0 || h >= heads) return;
          float* acc = weight_grads(sh, pair_of(line, first_head + h), side) + slot;
          blk_.store_shared(acc, blk_.load_shared(acc) + sum);
        });
      });
    });
  }

  /// One side's terms of a line's heads in this tile, [head][w1 r, w2 r, dd]: this lane's share.
  struct LineSums {
    float at[kHeadsPerLane][2 * kMaxRank + 1];
  };
  template <int kRank, int kHeadDim>
  DCMHA_INLINE LineSums line_sums(const BackwardTiles<T, kHeadDim>& sh, int side, int line,
                                  int first_head, int heads) const {
    const bool query_axis = !geo_.key_side;
    const int others = geo_.key_side ? kStreamRows : kKeys;
    const int lanes = lanes_per_line(), first = lane_of(blk_) % lanes;
    const ChainSums projections = sh.sums();
    const ChainTiles chain = sh.chain();
    LineSums sums = {};
    for (int o = first; o < others && line >= 0; o += lanes) {
      const int row = query_axis ? line : o, key = query_axis ? o : line;
      float p1[kRank], p2[kRank];  // the composer's projections, alike for every head
      composer_projections(projections, side, line, o, p1, p2);
      DCMHA_UNROLL
      for (int h = 0; h < kHeadsPerLane; ++h) {
        if (h >= heads) continue;
        const int j = first_head + h;
        const float xv =
            blk_.load_shared((side == 0 ? chain.scores : chain.probs).head(j).at(row, key));
        const float dyv = blk_.load_shared(
            (side == 0 ? chain.softmax_grad : chain.upstream).head(j).at(row, key));
        float* s = sums.at[h];
        s[2 * kMaxRank] += xv * dyv;
        DCMHA_UNROLL
        for (int k = 0; k < kRank; ++k) {
          s[k] += xv * p1[k];
          s[kMaxRank + k] += dyv * p2[k];
        }
      }
    }
    return sums;
  }
  /// The projections of one side at the line's position o of the tile's other axis, from the
  /// block that composed it: p1 of the upstream gradient (w1's terms), p2 of the input (w2's).
  template <int kRank>
  DCMHA_INLINE void composer_projections(const ChainSums& projections, int side, int line, int o,
                                         float (&p1)[kRank], float (&p2)[kRank]) const {
    const bool query_axis = !geo_.key_side;
    const int line_slice = line / geo_.slice, local = line - line_slice * geo_.slice;
    // The query side's rows are composed by key slices of geo_.slice_keys keys.
    const int key_slice = query_axis ? o / geo_.slice_keys : 0;
    const int composer = line_slice * geo_.key_slices + key_slice;
    const int sum_row = query_axis ? local : o;
    const int sum_key = query_axis ? o - key_slice * geo_.slice_keys : local;
    DCMHA_UNROLL
    for (int k = 0; k < kRank; ++k) {
      p1[k] = blk_.load_shared(
          blk_.peer_shared(projections.at(side, 1, k, sum_row, sum_key), composer));
      p2[k] = blk_.load_shared(
          blk_.peer_shared(projections.at(side, 0, k, sum_row, sum_key), composer));
    }
  }
  /// Calls f(std::integral_constant<int, R>{}) for a side's R (1 to kMaxRank), so that a line's
  /// sums hold the side's ranks only.
  template <class F>
  DCMHA_INLINE static void with_rank(int R, F&& f) {
    switch (R) {
      case 1:
        return f(std::integral_constant<int, 1>{});
      case 2:
        return f(std::integral_constant<int, 2>{});
      case 3:
        return f(std::integral_constant<int, 3>{});
      default:
        return f(std::integral_constant<int, kMaxRank>{});
    }
  }
  /// Adds up the line's lanes' shares of a side of rank kRank: add(head, slot, sum) at each
  /// element this lane owns, heads past the group's included (zeros; add skips them). The lane's
  /// part is unhoisted: kept in a register across the key side's tile loop, it made ptxas spill
  /// there at head dim 128.
  template <int kRank, class F>
  DCMHA_INLINE void add_line_lanes(const LineSums& sums, F&& add) const {
    static_assert(kRank <= kMaxRank, "ranks up to kMaxRank");
    constexpr int kElements = LineElements::count(kRank);
    float v[kElements];
    DCMHA_UNROLL
    for (int i = 0; i < kElements; ++i)
      v[i] = sums.at[LineElements::head(i)][LineElements::slot(i, kRank)];
    const int lanes = lanes_per_line(), part = unhoisted_lane_of(blk_) % lanes;
    scatter_sums_over_parts(blk_, v, lanes, [&](int k, float sum) {
      const int i = k * lanes + part;
      if (i < kElements) add(LineElements::head(i), LineElements::slot(i, kRank), sum);
    });
  }

  /// The pairs' sums to the caller: lines [first, first + real) of the block, past `length`
  /// padding (zeros), each element by its owner.
  template <int kHeadDim>
  DCMHA_INLINE void store_weight_grads(const BackwardTiles<T, kHeadDim>& sh, index_t first,
                                       int real, index_t length) const {
    if (pairs() == 0) return;
    for_each_line_group([&](int line, int first_head, int heads, int side) {
      if (line < 0 || line >= real) return;
      for_owned_elements(axis_rank(side), heads, [&](int h, int slot) {
        const int j = first_head + h;
        const float* acc = weight_grads(sh, pair_of(line, j), side);
        const T value = T(first + line < length ? blk_.load_shared(acc + slot) : 0.0f);
        store_weight_grad(side, first + line, j, slot, value);
      });
    });
  }
  /// One element of own head j's gradients at line `at` of the axis.
  DCMHA_INLINE void store_weight_grad(int side, index_t at, int j, int slot, T value) const {
    const bool query_axis = !geo_.key_side;
    const index_t m = cluster_block_ * geo_.own_heads + j;
    const ComposeTermGrads<T>& d = side == 0 ? p_.dcompose.pre : p_.dcompose.post;
    if (slot == 2 * kMaxRank)
      return blk_.store_global(&(query_axis ? d.qdd : d.kdd)(b_, at, g_, m), value);
    const TensorView<T, 5>& w =
        slot < kMaxRank ? (query_axis ? d.qw1 : d.kw1) : (query_axis ? d.qw2 : d.kw2);
    blk_.store_global(&w(b_, at, g_, slot % kMaxRank, m), value);
  }

  /// The chain on the block's slice, the sides' query-wise weights from pre_query, post_query.
  template <bool kKeySide, class PreQuery, class PostQuery>
  DCMHA_INLINE void run_chain(const ChainContext<T>& cx, index_t t0, index_t s0,
                              PreQuery& pre_query, PostQuery& post_query) {
    const int rounds = compose_rounds<kChainRows>(blk_, cx.region, geo_.compose_parts);
    for (int round = 0; round < rounds; ++round) {
      const ComposeItem it =
          compose_item<kChainRows>(blk_, cx.region, geo_.M, geo_.compose_parts, round);
      pre_query.hold(blk_, cx.pre, it);
      post_query.hold(blk_, cx.post, it);
      detail::KeyRange ranges[kChainRows];
      DCMHA_UNROLL
      for (int i = 0; i < kChainRows; ++i) {
        const index_t t = t0 + it.row0 + i;
        ranges[i] = i < it.rows && t < p_.dims.T ? mask().row(b_, t) : detail::KeyRange{0, 0};
      }
      chain_item<kKeySide>(blk_, cx, it, ranges, s0 + it.key, pre_query, post_query);
    }
  }

  const Block& blk_;
  const detail::BackwardParams<T>& p_;
  const BackwardGeometry& geo_;
  /// The mask, made from the kernel's parameters where used: a copy held across the tile loops
  /// would keep its fields in registers.
  DCMHA_INLINE detail::RowMask mask() const { return {p_.mask, p_.dims.T, p_.dims.S}; }
  int cluster_block_ = 0, tile_ = 0, own_ = 0, row0_ = 0, kv_slot_ = 0;
  index_t g_ = 0, b_ = 0, head_ = 0, kv_first_ = 0;
};

template <class T, int kHeadDim, class Block>
class QueryGradKernel : BackwardBlock<T, Block> {
  using Base = BackwardBlock<T, Block>;
  using Base::blk_, Base::p_, Base::geo_, Base::mask, Base::cluster_block_, Base::own_, Base::row0_,
      Base::kv_slot_, Base::g_, Base::b_, Base::head_;

 public:
  static constexpr int kKeyTiles = kKeys / 8, kDimTiles = kHeadDim / 8;
  /// MHA on the tensor cores holds the warp's Q and dO rows in registers across the key tiles
  /// (kHeadDim / 2 registers a lane, as many as dQ's accumulators), up to head dim 128.
  static constexpr bool kHoldRows = kTensorCoreType<T> && kHeadDim <= 128;

  DCMHA_INLINE QueryGradKernel(const Block& blk, const detail::BackwardParams<T>& p,
                               const BackwardGeometry& geo, const BackwardScratch& scratch)
      : Base(blk, p, geo), scratch_(scratch) {
    t0_ = index_t(this->tile_) * geo.rows;
    rows_real_ = p.dims.T - t0_ < geo.rows ? int(p.dims.T - t0_) : geo.rows;
    slice_row_begin_ = cluster_block_ / geo.key_slices * geo.slice;
    slice_key_begin_ = cluster_block_ % geo.key_slices * geo.slice_keys;
  }

  DCMHA_INLINE void run() {
    start();
    const detail::KeyRange keys = mask().rows(b_, t0_, t0_ + rows_real_);
    // A pass of its own, so that the held fragments are not live across the compose path.
    if constexpr (kHoldRows)
      if (geo_.registers) return passes<true>(keys);
    passes<false>(keys);
  }

 private:
  using Scores = Accumulators<kKeyTiles>;
  using OperandPair = typename Base::OperandPair;
  /// The warp's Q and dO rows as A fragments (kHoldRows), loaded by the first key tile.
  using HeldQueryRows = typename Base::template HeldPair<kHoldRows ? kHeadDim : 16>;
  /// The lane's query-wise weights of each side, loaded by the chain's first item and used
  /// through its steps (beside dQ's accumulators in the second pass, without a spill up to head
  /// dim 128): the query side's one-row items, two rounds of them or more a block, keep each
  /// lane's row (ComposeRegion::rows_held) where the rounds split the keys evenly.
  /// Float's weights, a register each, are read where used: held, they made its query side spill.
  using HeldWeights =
      std::conditional_t<kTensorCoreType<T>, HeldQueryWeights<kChainRows, T>, QueryWeights>;
  /// The lanes' row-dot sums stay in registers with the storage types' smaller kernels, where
  /// each lane keeps its row (ComposeItem::rows_held).
  static constexpr bool kRowDotsInRegisters = kTensorCoreType<T> && kHeadDim <= 128;
  /// Whether passes<kHeld> runs MHA's fragment path: where the rows can be held, run() takes
  /// passes<true> for the registers mode, so passes<false> compiles the compose chain only.
  template <bool kHeld>
  DCMHA_INLINE bool fragment_path() const {
    return kHeld || (!kHoldRows && geo_.registers);
  }

  /// The row dots, then dQ and the weight gradients; kHeld: MHA on the tensor cores with the
  /// warp's Q and dO rows held in registers.
  template <bool kHeld>
  DCMHA_INLINE void passes(const detail::KeyRange& keys) {
    HeldQueryRows held;
    HeldWeights weights[2];
    int stage = 0;
    // Without Compose_post, O = P V per head, so D = rowsum(dO O) (FlashAttention's row dots).
    if (p_.out.data != nullptr && !geo_.terms.post.enabled()) {
      output_row_dots();
    } else if (fragment_path<kHeld>()) {
      for (index_t s0 = first_key_tile<kHeld>(keys, held); s0 < keys.end; s0 += kKeys, stage ^= 1) {
        key_tile(s0, keys, stage);
        row_dots_step<kHeld>(s0, stage, keys, held);
      }
    } else if constexpr (!kHeld) {
      chain_row_dots(keys, held, weights);
    }
    finish_row_dots();
    stage = 0;
    for (index_t s0 = first_key_tile<kHeld>(keys, held); s0 < keys.end; s0 += kKeys, stage ^= 1) {
      key_tile(s0, keys, stage);
      gradients_step<kHeld>(s0, stage, keys, held, weights);
    }
    store();
    blk_.sync_cluster();  // peers read this block's shared memory until their last chain
  }

  DCMHA_INLINE void start() {
    this->stage_query_rows(sh().q(0), p_.q, geo_.D, geo_.chunked_q, t0_, rows_real_);
    this->stage_query_rows(sh().dout(0), p_.dout, geo_.Dv, geo_.chunked_dout, t0_, rows_real_);
    blk_.cp_async_commit();
    this->load_row_statistics(sh().lse(), sh().row_dot(), nullptr, t0_, geo_.rows, geo_.rows);
    const index_t real_end = std::min<index_t>(this->query_length(), t0_ + rows_real_);
    DCMHA_UNROLL
    for (int s = 0; s < 2; ++s) {
      const ComposeTerms<T>& c = s == 0 ? p_.compose.pre : p_.compose.post;
      if (sh().side(s).terms.query_wise)
        stage_query_weights(blk_, sh().side(s), c,
                            {b_, g_, t0_ + slice_row_begin_, geo_.slice, real_end});
      stage_static_weights(blk_, sh().side(s), c, g_);
    }
    rows_ = FragmentRows(blk_, mask(), b_, t0_ + row0_, rows_real_ - row0_);
    row_dot_[0] = row_dot_[1] = 0;
    dq_.zero();
    this->zero_weight_grads(sh());
  }

  /// The key tiles as a loop (for s0 = first_key_tile(keys); ...; key_tile(s0, ...)): each
  /// tile's K and V rows landed in `stage` and visible, the next tile's landing in the other.
  template <bool kHeld>
  DCMHA_INLINE index_t first_key_tile(const detail::KeyRange& keys, HeldQueryRows& held) {
    if (keys.empty()) return keys.end;
    this->stage_key_rows(sh().k(0), p_.k, geo_.D, geo_.chunked_k, keys.begin, kKeys);
    this->stage_key_rows(sh().v(0), p_.v, geo_.Dv, geo_.chunked_v, keys.begin, kKeys);
    blk_.cp_async_commit();
    next_ = keys.end;
    if constexpr (kHeld)
      if (!held.loaded) hold_rows(held);
    return keys.begin;
  }
  /// The warp's Q and dO fragments into registers: their copies (the group before the first key
  /// tile's) landed, every lane's visible.
  DCMHA_INLINE void hold_rows(HeldQueryRows& held) const {
    blk_.template cp_async_wait<1>();
    blk_.sync();
    this->hold_pair(query_rows(), held);
  }
  /// The tile's K and V rows landed and visible; the next tile's K landing in the other stage.
  DCMHA_INLINE void key_tile(index_t s0, const detail::KeyRange& keys, int stage) {
    blk_.template cp_async_wait<0>();
    blk_.sync();
    next_ = s0 + kKeys < keys.end ? s0 + kKeys : keys.end;
    if (next_ < keys.end)
      this->stage_key_rows(sh().k(stage ^ 1), p_.k, geo_.D, geo_.chunked_k, next_, kKeys);
    blk_.cp_async_commit();
  }
  /// The next tile's V rows, once every warp is done with this tile's (after a barrier).
  DCMHA_INLINE void prefetch_values(const detail::KeyRange& keys) {
    if (next_ < keys.end)
      this->stage_key_rows(sh().v(0), p_.v, geo_.Dv, geo_.chunked_v, next_, kKeys);
    blk_.cp_async_commit();
  }
  /// The warp's Q and dO rows in shared memory, and the key tile's K and V as the B operands.
  DCMHA_INLINE OperandPair query_rows() const {
    return {sh().q(0).head(own_), sh().dout(0).head(own_)};
  }
  DCMHA_INLINE OperandPair key_rows(int stage) const {
    return {sh().k(stage).head(kv_slot_), sh().v(0).head(kv_slot_)};
  }
  /// The warp's scores (unscaled) and dP' = dO V^T of the key tile.
  template <bool kHeld>
  DCMHA_INLINE void products(int stage, const HeldQueryRows& held, Scores& s, Scores& dp) const {
    if constexpr (kHeld)
      this->pair_products(held, key_rows(stage), s, dp);
    else
      this->pair_products(query_rows(), key_rows(stage), s, dp);
  }

  /// MHA in fragments: P = exp(scale S - lse), 0 where masked.
  DCMHA_INLINE void probabilities(index_t s0, Scores& s) const {
    using std::exp;
    const FragmentPlace f(blk_);
    mask_fragments(blk_, rows_, s0, s, detail::negative_infinity<float>());
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float l = blk_.load_shared(sh().lse() + own_ * geo_.rows + row0_ + f.row(2 * h));
      DCMHA_UNROLL
      for (int j = 0; j < kKeyTiles; ++j) DCMHA_UNROLL
      for (int i = 2 * h; i < 2 * h + 2; ++i)
        s.c[j][i] =
            l > detail::negative_infinity<float>() ? exp(this->scale() * s.c[j][i] - l) : 0.0f;
    }
    blk_.count_exp(kKeyTiles * 4);
  }

  /// The products into the chain tiles, the key-wise weights, the chain on the block's slice
  /// (the sides' query-wise weights from pre_query and post_query); given where to sum P dP
  /// (row_dots), the row dots' pass.
  template <class PreQuery, class PostQuery>
  DCMHA_INLINE void chain_step(index_t s0, int stage, const detail::KeyRange& keys,
                               const RowDotPass& row_dots, PreQuery& pre_query,
                               PostQuery& post_query) {
    Scores s, dp;
    this->pair_products(query_rows(), key_rows(stage), s, dp);
    store_fragments(blk_, s, sh().chain().scores.head(own_), row0_, 0, this->scale());
    store_fragments(blk_, dp, sh().chain().upstream.head(own_), row0_, 0, 1.0f);
    DCMHA_UNROLL
    for (int side = 0; side < 2; ++side)
      if (sh().side(side).terms.key_wise)
        stage_key_weights(blk_, sh().side(side), side == 0 ? p_.compose.pre : p_.compose.post,
                          {b_, g_, s0 + slice_key_begin_, geo_.slice_keys, this->key_length()},
                          detail::KeyRing{});
    blk_.sync_cluster();
    prefetch_values(keys);
    ChainContext<T> cx = this->chain_context(sh(), region());
    cx.row_dots = row_dots;
    this->template run_chain<false>(cx, t0_, s0, pre_query, post_query);
    blk_.sync_cluster();
  }
  /// The block's compose region: its slice of the tile's rows and keys.
  DCMHA_INLINE ComposeRegion region() const {
    return {slice_row_begin_, geo_.slice, slice_key_begin_, geo_.slice_keys, slice_row_begin_,
            slice_key_begin_, true};
  }
  /// Whether the row dots' sums stay in registers (kRowDotsInRegisters) for this plan.
  DCMHA_INLINE bool row_dots_in_registers() const {
    return kRowDotsInRegisters &&
           compose_item<kChainRows>(blk_, region(), geo_.M, geo_.compose_parts, 0).rows_held;
  }

  /// f(item) for each of the block's compose items (the same in every key tile).
  template <class F>
  DCMHA_INLINE void for_each_item(F&& f) const {
    const int rounds = compose_rounds<kChainRows>(blk_, region(), geo_.compose_parts);
    for (int round = 0; round < rounds; ++round) {
      const ComposeItem it =
          compose_item<kChainRows>(blk_, region(), geo_.M, geo_.compose_parts, round);
      if (it.valid) f(it);
    }
  }

  /// Pass 1 through the chain (Compose_post's P dP, or float): each compose lane adds P dP at its
  /// items' positions to sums of its own, in registers or in the block's P tiles (unused until
  /// pass 2; own heads x rows x kKeys floats, the region's positions times M), instead of sending
  /// it across the cluster to the owners' tiles every key tile for their warps to sum; each sum
  /// goes to its owner once, at the end.
  DCMHA_INLINE void chain_row_dots(const detail::KeyRange& keys, HeldQueryRows& held,
                                   HeldWeights (&weights)[2]) {
    ItemValues<kChainRows> lane = {}, lse = {};
    const bool in_registers = row_dots_in_registers();
    const RowDotPass pass = {sh().chain().probs.data, in_registers ? &lane : nullptr,
                             in_registers ? &lse : nullptr};
    if (in_registers) {
      hold_lse(lse);
    } else {
      for_each_item([&](const ComposeItem& it) {
        for_item_heads(it, [&](int j) {
          blk_.store_shared(pass.shared_sums + item_sum(region(), it, j), 0.0f);
        });
      });
    }
    int stage = 0;
    for (index_t s0 = first_key_tile<false>(keys, held); s0 < keys.end; s0 += kKeys, stage ^= 1) {
      key_tile(s0, keys, stage);
      chain_step(s0, stage, keys, pass, weights[0], weights[1]);
    }
    if (in_registers) store_lane_row_dots(lane, pass.shared_sums);
    gather_row_dots(pass.shared_sums);
  }
  /// The lse of the lane's heads at its row (kept in every round: row_dots_in_registers), from
  /// the forward's output: a block's lanes read it once, not from the owners every key tile.
  DCMHA_INLINE void hold_lse(ItemValues<kChainRows>& lse) const {
    const ComposeItem it = compose_item<kChainRows>(blk_, region(), geo_.M, geo_.compose_parts, 0);
    if (!it.valid) return;
    const index_t qlen = this->query_length();
    for_item_heads(it, [&](int j) {
      DCMHA_UNROLL
      for (int i = 0; i < kChainRows; ++i) {
        const index_t t = t0_ + it.row0 + i;
        lse.v[j][i] = i < it.rows ? this->row_lse(g_ * geo_.M + it.head(j), t, qlen)
                                  : detail::negative_infinity<float>();
      }
    });
  }
  /// The lane's sums, held in registers, into its items' shared ones (the gather reads those):
  /// each at its first round's item, zeros at the others'.
  DCMHA_INLINE void store_lane_row_dots(const ItemValues<kChainRows>& lane, float* sums) const {
    if constexpr (kRowDotsInRegisters) {
      for_each_item([&](const ComposeItem& it) {
        for_item_heads(it, [&](int j) {
          blk_.store_shared(sums + item_sum(region(), it, j), it.round == 0 ? lane.v[j][0] : 0.0f);
        });
      });
    }
  }

  /// The row dots' pass's end: each item's sums go to their owners' softmax-gradient tiles (no
  /// peer reads those after the last key tile's cluster barrier), and each warp adds its rows'
  /// key columns, a quad's lanes every fourth column from their own, in a fixed order.
  DCMHA_INLINE void gather_row_dots(const float* sums) {
    const GroupTiles to = {sh().chain().softmax_grad, geo_.own_heads};
    for_each_item([&](const ComposeItem& it) {
      for_item_heads(it, [&](int j) {
        blk_.store_shared(to.head(blk_, it.head(j)).at(it.row0, it.key),
                          blk_.load_shared(sums + item_sum(region(), it, j)));
      });
    });
    blk_.sync_cluster();
    const ScoreTile own = sh().chain().softmax_grad.head(own_);
    const FragmentPlace f(blk_);
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = row0_ + f.row(2 * h);
      float sum = 0;
      DCMHA_UNROLL
      for (int k = 0; k < kKeys / 4; ++k) sum += blk_.load_shared(own.at(r, 4 * k + f.t));
      row_dot_[h] = quad_sum(blk_, sum);
    }
  }

  /// MHA in fragments: the warp's P and dP' = dO V^T of the key tile, the next tile's V rows
  /// staged once every warp is done with this one's.
  template <bool kHeld>
  DCMHA_INLINE void fragment_probabilities(index_t s0, int stage, const detail::KeyRange& keys,
                                           const HeldQueryRows& held, Scores& s, Scores& dp) {
    products<kHeld>(stage, held, s, dp);
    blk_.sync();
    prefetch_values(keys);
    probabilities(s0, s);
  }

  /// Pass 1 of MHA in fragments: D = sum over keys of P dP per row.
  template <bool kHeld>
  DCMHA_INLINE void row_dots_step(index_t s0, int stage, const detail::KeyRange& keys,
                                  const HeldQueryRows& held) {
    Scores s, dp;
    fragment_probabilities<kHeld>(s0, stage, keys, held, s, dp);
    DCMHA_UNROLL
    for (int j = 0; j < kKeyTiles; ++j) DCMHA_UNROLL
    for (int i = 0; i < 4; ++i) s.c[j][i] *= dp.c[j][i];
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      float sum = 0;
      DCMHA_UNROLL
      for (int j = 0; j < kKeyTiles; ++j) sum += s.c[j][2 * h] + s.c[j][2 * h + 1];
      row_dot_[h] += quad_sum(blk_, sum);
    }
  }

  /// Pass 1 given the forward's output, without Compose_post: D = sum over d of dO O per row,
  /// which equals sum over keys of P dP (O = P V), read instead of a pass over the keys.
  DCMHA_INLINE void output_row_dots() {
    const FragmentPlace f(blk_);
    const index_t qlen = this->query_length();
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = row0_ + f.row(2 * h);
      const index_t t = t0_ + r;
      const bool real = r < rows_real_ && t < qlen;
      const float part = real ? row_dot_part(blk_, &p_.out(b_, head_, t, 0),
                                             &p_.dout(b_, head_, t, 0), geo_.Dv, f.t)
                              : 0.0f;
      row_dot_[h] = quad_sum(blk_, part);
    }
  }

  /// The rows' D into shared memory (the chain reads every head's, after the cluster barrier that
  /// starts each key tile's chain) and the scratch (the key side).
  DCMHA_INLINE void finish_row_dots() {
    const FragmentPlace f(blk_);
    DCMHA_UNROLL
    for (int h = 0; h < 2; ++h) {
      const int r = row0_ + f.row(2 * h);
      if (f.t != 0) continue;
      blk_.store_shared(sh().row_dot() + own_ * geo_.rows + r, row_dot_[h]);
      if (r < rows_real_)
        blk_.store_global(scratch_.row_dot + (b_ * p_.dims.H + head_) * p_.dims.T + t0_ + r,
                          row_dot_[h]);
    }
  }

  /// Pass 2: dS (dL) and dQ += dS K; the compose weights' gradients.
  template <bool kHeld>
  DCMHA_INLINE void gradients_step(index_t s0, int stage, const detail::KeyRange& keys,
                                   const HeldQueryRows& held, HeldWeights (&weights)[2]) {
    if (fragment_path<kHeld>()) {
      if constexpr (kTensorCoreType<T>) {
        Scores s, dp;
        fragment_probabilities<kHeld>(s0, stage, keys, held, s, dp);
        DCMHA_UNROLL
        for (int j = 0; j < kKeyTiles; ++j) DCMHA_UNROLL
        for (int i = 0; i < 4; ++i) s.c[j][i] *= dp.c[j][i] - row_dot_[i / 2];
        product_fragments_cols(blk_, s, sh().k(stage).head(kv_slot_), 0, dq_);
      }
      return;
    }
    chain_step(s0, stage, keys, {}, weights[0], weights[1]);
    product_rows_cols(blk_, sh().dscores().head(own_), row0_, sh().k(stage).head(kv_slot_), 0, 0,
                      kKeys, dq_);
    this->accumulate_weight_grads(sh());
    if (!geo_.terms.pre.static_w && !geo_.terms.post.static_w) return;
    accumulate_static_grads();
    // The static sums read the peers' tiles, which their next key tile overwrites.
    blk_.sync_cluster();
  }

  /// This block's partial of W's gradient: sum over the tile of x_m dy_n for every head m of the
  /// group and own head n, in the scratch (one thread per element, tile after tile).
  DCMHA_INLINE void accumulate_static_grads() {
    const int M = geo_.M, own = geo_.own_heads;
    DCMHA_UNROLL
    for (int side = 0; side < 2; ++side) {
      if (!sh().side(side).terms.static_w) continue;
      const GroupTiles x = {side == 0 ? sh().chain().scores : sh().chain().probs, own};
      const ScoreTiles dy = side == 0 ? sh().chain().softmax_grad : sh().chain().upstream;
      float* partial = static_partial(side);
      for_each_owned(blk_, M * own, [&](int i) {
        const int m = i / own, j = i % own;
        const ScoreTile xm = x.head(blk_, m), dyn = dy.head(j);
        float sum = 0;
        for (int r = 0; r < geo_.rows; ++r)
          for (int c = 0; c < kKeys; ++c)
            sum += blk_.load_shared(xm.at(r, c)) * blk_.load_shared(dyn.at(r, c));
        float* at = partial + index_t(m) * M + cluster_block_ * own + j;
        blk_.store_global(at, blk_.load_global(at) + sum);
        blk_.count_fma(index_t(geo_.rows) * kKeys);
      });
    }
  }

  DCMHA_INLINE float* static_partial(int side) const {
    const index_t tiles = (p_.dims.T + geo_.rows - 1) / geo_.rows;
    const index_t block = (b_ * p_.dims.G + g_) * tiles + this->tile_;
    return scratch_.static_partials + (block * 2 + side) * geo_.M * geo_.M;
  }

  DCMHA_INLINE void store() {
    const FragmentPlace f(blk_);
    const index_t qlen = this->query_length();
    DCMHA_UNROLL
    for (int j = 0; j < kDimTiles; ++j) DCMHA_UNROLL
    for (int i = 0; i < 4; i += 2) {
      const int r = row0_ + f.row(i), d = 8 * j + f.column(i);
      if (r >= rows_real_ || d >= geo_.D) continue;
      const float row_factor = t0_ + r < qlen ? this->scale() : 0.0f;  // padding rows: zero
      store_column_pair(blk_, &p_.dq(b_, head_, t0_ + r, d), T(row_factor * dq_.c[j][i]),
                        T(row_factor * dq_.c[j][i + 1]), d + 1 < geo_.D);
    }
    this->store_weight_grads(sh(), t0_, rows_real_, this->query_length());
  }

  const BackwardScratch& scratch_;  // the kernel's parameter: a copy would hold registers
  DCMHA_INLINE BackwardTiles<T, kHeadDim> sh() const { return {geo_, blk_.shared()}; }
  index_t t0_ = 0;
  int rows_real_ = 0, slice_row_begin_ = 0, slice_key_begin_ = 0;
  FragmentRows rows_;
  index_t next_ = 0;  // the next key tile's first key
  float row_dot_[2] = {0, 0};
  Accumulators<kDimTiles> dq_;
};

/// The heads a key-side lane sums the compose weights' gradients of (BackwardBlock): two at head
/// dim 128, where dK's and dV's accumulators leave too few registers for four heads' sums.
template <int kHeadDim>
constexpr int kKeySideHeadsPerLane = kHeadDim <= 96 ? 4 : 2;

template <class T, int kHeadDim, class Block>
class KeyGradKernel : BackwardBlock<T, Block, kKeySideHeadsPerLane<kHeadDim>> {
  using Base = BackwardBlock<T, Block, kKeySideHeadsPerLane<kHeadDim>>;
  using Base::blk_, Base::p_, Base::geo_, Base::mask, Base::cluster_block_, Base::own_, Base::row0_,
      Base::kv_slot_, Base::g_, Base::b_, Base::head_;

 public:
  static constexpr int kDimTiles = kHeadDim / 8;
  /// MHA on the tensor cores holds the warp's K and V rows in registers across the query tiles
  /// (kHeadDim / 2 registers a lane beside dK's and dV's kHeadDim) up to head dim 96; at 128
  /// even K alone makes ptxas spill.
  static constexpr bool kHoldKeys = kTensorCoreType<T> && kHeadDim <= 96;

  DCMHA_INLINE KeyGradKernel(const Block& blk, const detail::BackwardParams<T>& p,
                             const BackwardGeometry& geo, const BackwardScratch& scratch)
      : Base(blk, p, geo), scratch_(scratch) {
    s0_ = index_t(this->tile_) * geo.rows;
    keys_real_ = p.dims.S - s0_ < geo.rows ? int(p.dims.S - s0_) : geo.rows;
    slice_begin_ = cluster_block_ * geo.slice;
  }

  DCMHA_INLINE void run() {
    start();
    // Loops of their own, so that the fragments' registers are not live across the compose path.
    if constexpr (kTensorCoreType<T>)
      if (geo_.registers) return query_tiles<true, kHoldKeys>();
    query_tiles<false, false>();
  }

 private:
  /// S^T or dP'^T of a streamed tile: the warp's 16 keys x kRows query rows.
  template <int kRows>
  using Rows = Accumulators<kRows / 8>;
  using OperandPair = typename Base::OperandPair;
  /// The warp's K and V rows as A fragments (kHoldKeys), loaded once they landed.
  using HeldKeyRows = typename Base::template HeldPair<kHoldKeys ? kHeadDim : 16>;
  /// Query rows per streamed tile: MHA in fragments (kRegisters) or the compose chain.
  template <bool kRegisters>
  static constexpr int kRowsOf = kRegisters ? kFragmentStreamRows : kStreamRows;

  /// The query tiles that see the block's keys; kRegisters: MHA on the tensor cores, the chain
  /// in fragments; kHeld: with the warp's K and V rows held in registers.
  template <bool kRegisters, bool kHeld>
  DCMHA_INLINE void query_tiles() {
    constexpr int kRows = kRowsOf<kRegisters>;
    HeldKeyRows held;
    const index_t tiles = (p_.dims.T + kRows - 1) / kRows;
    int stage = 0;
    index_t next = this->next_query_tile(0, tiles, s0_, keys_real_);
    if (next < tiles) this->stage_query_tile(sh(), next, 0);
    for (index_t tile = next; tile < tiles; tile = next, stage ^= 1) {
      next = this->next_query_tile(tile + 1, tiles, s0_, keys_real_);
      blk_.template cp_async_wait<0>();
      blk_.sync();
      if constexpr (kHeld)
        if (!held.loaded) this->hold_pair(key_rows(), held);  // landed with the first query tile
      if (next < tiles) this->stage_query_tile(sh(), next, stage ^ 1);
      rows_step<kRegisters, kHeld>(tile * kRows, stage, held);
    }
    store();
    blk_.sync_cluster();
  }

  DCMHA_INLINE void start() {
    this->stage_key_rows(sh().k(0), p_.k, geo_.D, geo_.chunked_k, s0_, keys_real_);
    this->stage_key_rows(sh().v(0), p_.v, geo_.Dv, geo_.chunked_v, s0_, keys_real_);
    blk_.cp_async_commit();
    DCMHA_UNROLL
    for (int s = 0; s < 2; ++s) {
      const ComposeTerms<T>& c = s == 0 ? p_.compose.pre : p_.compose.post;
      if (sh().side(s).terms.key_wise)
        stage_key_weights(blk_, sh().side(s), c, {b_, g_, s0_, geo_.rows, this->key_length()},
                          detail::KeyRing{});
      stage_static_weights(blk_, sh().side(s), c, g_);
    }
    dk_.zero();
    dv_.zero();
    this->zero_weight_grads(sh());
  }

  /// The warp's K and V rows in shared memory.
  DCMHA_INLINE OperandPair key_rows() const {
    return {sh().k(0).head(kv_slot_), sh().v(0).head(kv_slot_)};
  }

  /// The query tile at t0: S^T = scale K Q^T and dP'^T = V dO^T of the warp's head and keys,
  /// then dK and dV.
  template <bool kRegisters, bool kHeld>
  DCMHA_INLINE void rows_step(index_t t0, int stage, const HeldKeyRows& held) {
    constexpr int kRows = kRowsOf<kRegisters>;
    this->load_row_statistics(sh().lse(), sh().row_dot(), scratch_.row_dot, t0, kRows, kRows);
    Rows<kRows> st, dpt;
    const OperandPair queries{sh().q(stage).head(own_), sh().dout(stage).head(own_)};
    if constexpr (kHeld)
      this->pair_products(held, queries, st, dpt);
    else
      this->pair_products(key_rows(), queries, st, dpt);
    if constexpr (kRegisters) {
      blk_.sync();  // the row statistics above, written by other warps
      registers_step(t0, stage, st, dpt);
    } else {
      chain_step(t0, stage, st, dpt);
    }
  }

  /// The compose chain on the block's slice of the tile, then dV += P'^T dO and dK += dL^T Q.
  DCMHA_INLINE void chain_step(index_t t0, int stage, const Rows<kStreamRows>& st,
                               const Rows<kStreamRows>& dpt) {
    const int rows = p_.dims.T - t0 < kStreamRows ? int(p_.dims.T - t0) : kStreamRows;
    const index_t real_end = std::min<index_t>(this->query_length(), t0 + rows);
    DCMHA_UNROLL
    for (int s = 0; s < 2; ++s)
      if (sh().side(s).terms.query_wise)
        stage_query_weights(blk_, sh().side(s), s == 0 ? p_.compose.pre : p_.compose.post,
                            {b_, g_, t0, kStreamRows, real_end});
    store_fragments_transposed(blk_, st, sh().chain().scores.head(own_), row0_, 0, this->scale());
    store_fragments_transposed(blk_, dpt, sh().chain().upstream.head(own_), row0_, 0, 1.0f);
    blk_.sync_cluster();
    const ChainContext<T> cx =
        this->chain_context(sh(), {0, kStreamRows, slice_begin_, geo_.slice, 0});
    QueryWeights pre, post;  // a streamed row's weights serve one tile
    this->template run_chain<true>(cx, t0, s0_, pre, post);
    blk_.sync_cluster();
    product_cols_cols(blk_, sh().values_probs().head(own_), row0_, sh().dout(stage).head(own_), 0,
                      kStreamRows, dv_);
    product_cols_cols(blk_, sh().dscores().head(own_), row0_, sh().q(stage).head(own_), 0,
                      kStreamRows, dk_);
    this->accumulate_weight_grads(sh());
  }

  /// MHA in fragments: P^T, dS^T = P^T (dP^T - D), dV += P^T dO, dK += dS^T Q.
  template <int kRowTiles>
  DCMHA_INLINE void registers_step(index_t t0, int stage, Accumulators<kRowTiles>& st,
                                   const Accumulators<kRowTiles>& dpt) {
    using std::exp;
    const FragmentPlace f(blk_);
    // The sequence's lengths once a tile: each element's mask.row() would read them again.
    const index_t qlen = this->query_length(), klen = this->key_length();
    DCMHA_UNROLL
    for (int j = 0; j < kRowTiles; ++j) {
      const FloatPair l = row_pair(sh().lse(), j);
      DCMHA_UNROLL
      for (int i = 0; i < 4; ++i) {
        const int r = 8 * j + f.column(i);
        const float lse = i % 2 == 0 ? l.x : l.y;
        const index_t s = s0_ + row0_ + f.row(i);
        const bool seen = detail::visible_keys(p_.mask, t0 + r, qlen, klen).contains(s);
        st.c[j][i] = seen && lse > detail::negative_infinity<float>()
                         ? exp(this->scale() * st.c[j][i] - lse)
                         : 0.0f;
      }
    }
    blk_.count_exp(kRowTiles * 4);
    product_fragments_cols(blk_, st, sh().dout(stage).head(own_), 0, dv_);
    DCMHA_UNROLL
    for (int j = 0; j < kRowTiles; ++j) {
      const FloatPair d = row_pair(sh().row_dot(), j);
      DCMHA_UNROLL
      for (int i = 0; i < 4; ++i) st.c[j][i] *= dpt.c[j][i] - (i % 2 == 0 ? d.x : d.y);
    }
    product_fragments_cols(blk_, st, sh().q(stage).head(own_), 0, dk_);
  }
  /// A statistic (lse or D) of the query rows of the lane's fragment columns in n8 tile j: rows
  /// 8 j + 2 t and + 1, adjacent in shared memory, so one 8-byte load serves the lane's four
  /// elements (x the even ones, y the odd ones).
  DCMHA_INLINE FloatPair row_pair(const float* statistic, int j) const {
    const FragmentPlace f(blk_);
    return blk_.load_shared(reinterpret_cast<const FloatPair*>(statistic + own_ * geo_.tile_rows() +
                                                               8 * j + f.column(0)));
  }

  DCMHA_INLINE void store() {
    const FragmentPlace f(blk_);
    const index_t klen = this->key_length();
    DCMHA_UNROLL
    for (int j = 0; j < kDimTiles; ++j) DCMHA_UNROLL
    for (int i = 0; i < 4; i += 2) {
      const int r = row0_ + f.row(i), d = 8 * j + f.column(i);
      if (r >= keys_real_) continue;
      const index_t s = s0_ + r;
      this->store_key_grads(scratch_, s, d, s < klen, {dk_.c[j][i], dk_.c[j][i + 1]},
                            {dv_.c[j][i], dv_.c[j][i + 1]});
    }
    this->store_weight_grads(sh(), s0_, keys_real_, this->key_length());
  }

  const BackwardScratch& scratch_;  // the kernel's parameter: a copy would hold registers
  DCMHA_INLINE BackwardTiles<T, kHeadDim> sh() const { return {geo_, blk_.shared()}; }
  index_t s0_ = 0;
  int keys_real_ = 0, slice_begin_ = 0;
  Accumulators<kDimTiles> dk_, dv_;
};

/// W's gradient of one (side, group): the query blocks' partials summed in block order.
template <class Block, class T>
DCMHA_INLINE void sum_static_grads(const Block& blk, const detail::BackwardParams<T>& p, int rows,
                                   const BackwardScratch& scratch) {
  const int side = int(blk.block(0)), M = int(p.dims.M);
  const index_t g = blk.block(1);
  const ComposeTerms<T>& terms = side == 0 ? p.compose.pre : p.compose.post;
  const TensorView<T, 3>& dw = side == 0 ? p.dcompose.pre.w : p.dcompose.post.w;
  if (!terms.static_w) return;
  const index_t tiles = (p.dims.T + rows - 1) / rows;
  for_each_owned(blk, M * M, [&](int item) {
    float sum = 0;
    for (index_t b = 0; b < p.dims.B; ++b)
      for (index_t tile = 0; tile < tiles; ++tile)
        sum += blk.load_global(scratch.static_partials +
                               (((b * p.dims.G + g) * tiles + tile) * 2 + side) * M * M + item);
    blk.store_global(&dw(g, item / M, item % M), T(sum));
  });
}

/// dK and dV of kv head kv of sequence b (grid (kv, b)): its query heads' scratch summed in head
/// order (GQA).
template <class Block, class T>
DCMHA_INLINE void sum_head_grads(const Block& blk, const detail::BackwardParams<T>& p,
                                 const BackwardScratch& scratch) {
  const index_t kv = blk.block(0), b = blk.block(1), S = p.dims.S, D = p.dims.D, Dv = p.dims.Dv;
  const index_t per_kv = p.dims.H / p.dims.Hk;
  for (index_t i = blk.thread(); i < S * (D + Dv); i += blk.threads()) {
    const bool key = i < S * D;
    const index_t width = key ? D : Dv, e = key ? i : i - S * D, s = e / width, d = e % width;
    const float* base = key ? scratch.dk : scratch.dv;
    float sum = 0;
    for (index_t h = kv * per_kv; h < (kv + 1) * per_kv; ++h)
      sum += blk.load_global(base + ((b * p.dims.H + h) * S + s) * width + d);
    blk.store_global(key ? &p.dk(b, kv, s, d) : &p.dv(b, kv, s, d), T(sum));
  }
}

}  // namespace dcmha::cuda

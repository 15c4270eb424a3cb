#pragma once
// The CPU forward kernel of the attention core (MHA and DCMHA): the work on one (batch, group)'s
// query blocks, for one thread or a team sharing each block's keys. forward_launch.hpp decides
// who runs which blocks.
//
// Why a panel and not an online softmax: Compose_post mixes *normalized* probabilities across
// the heads of a group, and each head's normalizer is only known once its whole row has been
// seen. So for one query block of Bq rows we keep the scores of all M heads of the group over
// the block's visible keys, a panel of M x Bq x S values in key tiles (never B*H*T*S), take an
// exact softmax, compose, and multiply by V. The matrix products are the same two as in MHA.
//
// Two passes over key tiles. Pass 1: scores, Compose_pre, and an online softmax: each tile's
// exponentials are taken against the row's running maximum, which is remembered per tile.
// Pass 2, once the row statistics are final (combined across the team): one factor per tile,
// row and head, exp(tile max - row max) / sum, turns the stored exponentials into P (folded into
// Compose_post's input scale), then P'V. Each panel value is written once and read once.
//
// A team shares a block's keys, each rank a contiguous share. Row statistics are combined across
// ranks at two barriers and partial outputs summed in rank order at a third, so results are
// deterministic for a fixed thread count.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/mask.hpp"
#include "../common/softmax_state.hpp"
#include "../compose_weights.hpp"
#include "../detail/dims.hpp"
#include "../params.hpp"
#include "../tensor.hpp"
#include "bf16_products.hpp"
#include "compose.hpp"
#include "compose_simd.hpp"
#include "convert.hpp"
#include "gemm.hpp"
#include "launch_plan.hpp"
#include "parallel.hpp"
#include "softmax.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

/// Buffers one team shares while it works on one (batch, group). The panel and the partial
/// outputs live in the call's Workspace (memory_size() values), the rest is small.
template <class A>
struct ForwardWorkspace : SlabLayout {
  index_t Bq = 0;
  A* panel = nullptr;  // [rank][tile][row][m][key], see SlabLayout
  // Outputs accumulate here, contiguous, and are written to the caller's tensor once per block
  // (summed over a key-split team, rounded once for narrow storage): the caller's rows are a page
  // apart in the (B, T, H, D) layout, too far apart to update tile after tile.
  A* o_part = nullptr;                        // [rank][m][row][Dv]
  Buffer<detail::SoftmaxState<A>> row_state;  // [rank][m][row]

  /// Values of Workspace memory one team of team_size threads needs: whole cache lines, so that
  /// panels carved one after another from a block keep its alignment, which the order of the
  /// reductions over them depends on (Buffer, tile.hpp). `rows`: forward_block_rows().
  static index_t memory_size(const detail::AttentionDims& d, const detail::RowMask& mask,
                             int team_size, index_t rows) {
    ForwardWorkspace w;
    w.layout(d, mask, team_size, rows);
    return round_up(w.panel_size(team_size) + w.o_part_size(d, team_size), 64 / index_t(sizeof(A)));
  }

  /// `memory`: memory_size() values, written before they are read.
  void init(const detail::AttentionDims& d, const detail::RowMask& mask, int team_size,
            index_t rows, A* memory) {
    layout(d, mask, team_size, rows);
    panel = memory;
    o_part = memory + panel_size(team_size);
    row_state.assign(team_size * d.M * Bq, {});
  }
  A* slab_of(int rank, index_t t) { return panel + slab_offset(rank, t); }

 private:
  /// A tile's slab, M x Bq x tile values, is produced and consumed tile by tile, about L2-sized
  /// (sweeping the whole panel once per step instead would make DCMHA memory-bound: tens of MiB
  /// at M = 32). At H32/D128 and 128-row blocks: 128-key tiles, so the P'V products update each
  /// head's output rows four times less often than with 32 and Compose and the softmax run on
  /// longer rows.
  void layout(const detail::AttentionDims& d, const detail::RowMask& mask, int team_size,
              index_t rows) {
    Bq = rows;
    init_slabs<A>(d.M, Bq, 1, kForwardSlabBytes, mask.max_block_keys(Bq), team_size);
  }
  index_t o_part_size(const detail::AttentionDims& d, int team_size) const {
    return team_size * d.M * Bq * d.Dv;
  }
};

/// Both sides' compose inputs of one (batch, group) in kernel layout; read-only once loaded.
template <class A>
struct ComposeSides {
  KernelComposeTerms<A> pre, post;

  template <class T>
  void init(const detail::AttentionDims& d, const ComposeWeights<T>& cw,
            const detail::KeyRing& ring) {
    // Through a ring buffer, kernel key s is not the caller's slot s: copy then.
    const bool in_place_ok = ring.capacity == 0;
    pre.init(cw.pre, d.M, padded_stride<A>(d.S), in_place_ok);
    post.init(cw.post, d.M, padded_stride<A>(d.S), in_place_ok);
  }
  /// The team loads group g of batch b, a share of the keys each.
  template <class T>
  void load(const Team& team, const ComposeWeights<T>& cw, index_t S, index_t b, index_t g,
            const detail::KeyRing& ring) {
    if (!pre.on && !post.on) return;
    index_t s0, s1;
    split_range(0, S, team.rank, team.size, 1, s0, s1);
    if (pre.on) pre.load(cw.pre, b, g, s0, s1, ring);
    if (post.on) post.load(cw.post, b, g, s0, s1, ring);
    team.sync();
  }
};

/// One thread's per-row state, allocated once per call and thread: the kernel runs block after
/// block with it.
template <class A>
struct ForwardRows {
  std::vector<ComposeRow<A>> pre, post;  // query-wise terms of each row of a block
  Buffer<A> scratch;
  Buffer<A> inv_sum;    // [row][m]: 1 / softmax denominator
  Buffer<A> final_max;  // [row][m]: the row maximum over all of its keys
  Buffer<A> tile_max;   // [tile][row][m]: the running maximum tile's exponentials were taken at
  Buffer<A> scale;      // [row][m]: what turns one tile's exponentials into probabilities
  Buffer<A> kt;         // one key tile of K (transposed, scaled) or of V, packed contiguous
  Buffer<A> q;          // narrow storage: a block's Q rows of every head, widened ([m][row][D])
  // bf16 products (bf16_products.hpp): a block's Q rows of every head as pairs
  // ([m][row][pair_count(D)]), a tile's P' rows as pairs, one key tile of K^T or V as pairs.
  Buffer<std::uint32_t> q_pairs, a_pairs, b_pairs;
  bool bf16_products = false;

  /// Sized for the blocks and tiles of `ws` (already initialized).
  ForwardRows(const ComposeSides<A>& sides, const ForwardWorkspace<A>& ws,
              const detail::AttentionDims& d, bool narrow, bool bf16_products)
      : pre(ws.Bq), post(ws.Bq) {
    const index_t Bq = ws.Bq, M = d.M;
    for (auto& r : pre) r.init(sides.pre);
    for (auto& r : post) r.init(sides.post);
    scratch.assign(std::max(sides.pre.scratch_size(), sides.post.scratch_size()), A(0));
    inv_sum.assign(Bq * M, A(0));
    final_max.assign(Bq * M, A(0));
    tile_max.assign(ws.tiles * M * Bq, A(0));
    scale.assign(Bq * M, A(0));
    kt.assign(std::max(d.D, d.Dv) * ws.tile, scratch_init<A>());
    this->bf16_products = bf16_products;
    if (bf16_products) {
      q_pairs.assign(M * Bq * pair_count(d.D), 0);
      a_pairs.assign(Bq * pair_count(ws.tile), 0);
      b_pairs.assign(std::max(pair_count(d.D) * ws.tile, pair_count(ws.tile) * d.Dv), 0);
    } else if (narrow) {
      q.assign(M * Bq * d.D, scratch_init<A>());
    }
  }
};

/// The query block a rank works on: rows [t0, t0 + rows) of (b, g), of which [lo, hi) see keys
/// and enter the products (the others' probabilities are zero and their outputs stay zero), and
/// the rank's share [key_begin, key_end) of the block's keys.
struct ForwardBlock {
  index_t b = 0, g = 0, t0 = 0, rows = 0;
  index_t lo = 0, hi = 0, live_rows = 0;
  index_t key_begin = 0, key_end = 0;
};

/// One key tile of a block: keys [begin, end), number `index` of the rank's tiles, and its slab
/// (slab[i * row_stride + m * tile + (s - begin)] holds key s of row i, head m).
template <class A>
struct ForwardTile {
  index_t index = 0, begin = 0, end = 0;
  A* slab = nullptr;
};

/// The forward on one (batch, group)'s query blocks for one thread (Team{0, 1}) or a team whose
/// ranks share each block's keys. Holds references only; run() may be called for block after
/// block with the same buffers.
template <class T, class A>
class ForwardKernel {
 public:
  ForwardKernel(const detail::ForwardParams<T>& params, const detail::RowMask& mask,
                const Team& team, ForwardWorkspace<A>& ws, ForwardRows<A>& rows,
                const ComposeSides<A>& sides)
      : p_(params),
        mask_(mask),
        team_(team),
        ws_(ws),
        rows_(rows),
        sides_(sides),
        pre_fn_(sides.pre),
        post_fn_(sides.post),
        M_(params.dims.M),
        group_of_kv_(params.dims.H / params.dims.Hk),
        bf16_products_(rows.bf16_products) {}

  /// Query blocks [first_block, end_block) of batch b, group g (compose inputs loaded in sides).
  void run(index_t b, index_t g, index_t first_block, index_t end_block) {
    const index_t rows_end = std::min(p_.dims.T, end_block * ws_.Bq);
    for (index_t t0 = first_block * ws_.Bq; t0 < rows_end; t0 += ws_.Bq) {
      const ForwardBlock block = start_block(b, g, t0);
      for (ForwardTile<A> tile = first_tile(block); tile.begin < block.key_end;
           next_tile(block, tile))
        pass1_tile(block, tile);
      team_.sync();
      finish_row_statistics(block);
      std::fill(out_rows(0), out_rows(M_), A(0));
      for (ForwardTile<A> tile = first_tile(block); tile.begin < block.key_end;
           next_tile(block, tile))
        pass2_tile(block, tile);
      team_.sync();
      // Sum the partial outputs in rank order into the caller's rows; each rank writes a share.
      sum_team_parts<T, A>(team_, ws_.o_part, M_, ws_.Bq, block.rows, p_.dims.Dv, p_.out, b, g * M_,
                           t0);
    }
  }

 private:
  static constexpr bool kNarrow = !std::is_same_v<T, A>;

  ForwardBlock start_block(index_t b, index_t g, index_t t0) {
    ForwardBlock block;
    block.b = b;
    block.g = g;
    block.t0 = t0;
    block.rows = std::min(p_.dims.T, t0 + ws_.Bq) - t0;
    const detail::KeyRange keys = mask_.rows(b, t0, t0 + block.rows);
    mask_.live_rows(b, t0, t0 + block.rows, block.lo, block.hi);
    block.live_rows = std::max<index_t>(block.hi - block.lo, 0);
    split_range(keys.begin, keys.end, team_.rank, team_.size, 16, block.key_begin, block.key_end);
    for (index_t i = 0; i < block.rows; ++i) {
      rows_.pre[i].load(sides_.pre, p_.compose.pre, b, t0 + i, g);
      rows_.post[i].load(sides_.post, p_.compose.post, b, t0 + i, g);
    }
    detail::SoftmaxState<A>* state = my_state();
    for (index_t j = 0; j < M_ * ws_.Bq; ++j) state[j] = {};
    // The score products read Q in place (float storage), widened once per block (narrow) or
    // as bf16 pairs (bf16 products).
    if constexpr (kNarrow)
      if (block.key_end > block.key_begin)
        for (index_t m = 0; m < M_; ++m) pack_q(block, m);
    return block;
  }

  void pack_q(const ForwardBlock& block, index_t m) {
    const index_t D = p_.dims.D, Bq = ws_.Bq;
    const T* q = row_ptr(p_.q, block.b, block.g * M_ + m, block.t0 + block.lo);
    if constexpr (std::is_same_v<T, bf16>)
      if (bf16_products_) {
        const index_t words = pair_count(D);
        return bf16_pairs_of_rows(block.live_rows, D, q, p_.q.stride[2],
                                  rows_.q_pairs.data() + (m * Bq + block.lo) * words, words);
      }
    pack_rows<A>(block.live_rows, D, q, p_.q.stride[2], rows_.q.data() + (m * Bq + block.lo) * D,
                 D);
  }

  ForwardTile<A> first_tile(const ForwardBlock& block) {
    ForwardTile<A> tile;
    tile.begin = block.key_begin;
    tile.end = std::min(block.key_end, tile.begin + ws_.tile);
    tile.slab = ws_.slab_of(team_.rank, 0);
    return tile;
  }
  void next_tile(const ForwardBlock& block, ForwardTile<A>& tile) {
    ++tile.index;
    tile.begin += ws_.tile;
    tile.end = std::min(block.key_end, tile.begin + ws_.tile);
    tile.slab = ws_.slab_of(team_.rank, tile.index);
  }

  /// Scores, Compose_pre, exponentials against the running maximum.
  void pass1_tile(const ForwardBlock& block, const ForwardTile<A>& tile) {
    for (index_t m = 0; m < M_; ++m) scores(block, tile, m);
    if (sides_.pre.on) compose(sides_.pre, pre_fn_, rows_.pre, block, tile, nullptr);
    exponentiate(block, tile);
  }

  /// Head m's scores of the tile: scale Q K^T into the slab.
  void scores(const ForwardBlock& block, const ForwardTile<A>& tile, index_t m) {
    const index_t h = block.g * M_ + m, Bq = ws_.Bq, D = p_.dims.D;
    const A* q;
    index_t ldq;
    if constexpr (kNarrow) {
      q = rows_.q.data() + (m * Bq + block.lo) * D;
      ldq = D;
    } else {
      q = row_ptr(p_.q, block.b, h, block.t0 + block.lo);
      ldq = p_.q.stride[2];
    }
    const auto& k = p_.k;
    if constexpr (std::is_same_v<T, bf16>)
      if (bf16_products_) {
        const index_t words = pair_count(D);
        return p_.keys.runs(block.b, tile.begin, tile.end, [&](index_t s, index_t slot, index_t n) {
          bf16_product_abt(block.live_rows, n, D,
                           rows_.q_pairs.data() + (m * Bq + block.lo) * words, words,
                           {row_ptr(k, block.b, h / group_of_kv_, slot), k.stride[2]},
                           {tile.slab + block.lo * ws_.row_stride + m * ws_.tile + (s - tile.begin),
                            ws_.row_stride, p_.scale, false},
                           rows_.b_pairs.data());
        });
      }
    p_.keys.runs(block.b, tile.begin, tile.end, [&](index_t s, index_t slot, index_t n) {
      gemm_abt<A>(block.live_rows, n, D, q, ldq, row_ptr(k, block.b, h / group_of_kv_, slot),
                  k.stride[2],
                  tile.slab + block.lo * ws_.row_stride + m * ws_.tile + (s - tile.begin),
                  ws_.row_stride, p_.scale, rows_.kt.data(),
                  {next_rows(next_head(k, block, m, slot), n, k.stride[2], D), {}});
    });
  }

  /// Compose on the tile's slab in place, row chunk by row chunk; `factors`: per row, the M heads'
  /// input scale (pass 2's probability factors), or null.
  void compose(const KernelComposeTerms<A>& side, const ComposeFn<A>& fn,
               const std::vector<ComposeRow<A>>& rows, const ForwardBlock& block,
               const ForwardTile<A>& tile, const A* factors) {
    const index_t row_stride = ws_.row_stride, lo = block.lo, hi = block.hi;
    for_each_row_chunk(tile.begin, tile.end, lo, hi, [&](index_t s, int n, index_t i) {
      A* chunk = tile.slab + i * row_stride + (s - tile.begin);
      // The slab left L2 since it was written (the products stream Q and K past it, or pass 1
      // ran long ago), so Compose asks for the next row as it goes.
      fn(side, rows[i], s, n, chunk, ws_.tile, chunk, ws_.tile,
         factors ? factors + i * M_ : nullptr, rows_.scratch.data(),
         i + 1 < hi ? chunk + row_stride : nullptr);
    });
  }

  /// The online softmax over the tile, every row and head; keys a row does not see become 0.
  void exponentiate(const ForwardBlock& block, const ForwardTile<A>& tile) {
    const index_t Bq = ws_.Bq;
    A* tile_max = rows_.tile_max.data() + tile.index * M_ * Bq;
    for (index_t i = 0; i < block.rows; ++i) {
      const detail::KeyRange r = mask_.row(block.b, block.t0 + i);
      const index_t vb = std::max(r.begin, tile.begin), ve = std::min(r.end, tile.end);
      for (index_t m = 0; m < M_; ++m) {
        A* row = tile.slab + i * ws_.row_stride + m * ws_.tile - tile.begin;  // row[s]: key s
        detail::SoftmaxState<A>& state = my_state()[m * Bq + i];
        if (ve > vb) exponentiate_online(row, vb, ve, state);
        tile_max[i * M_ + m] = state.max;
        zero_invisible_keys(row, tile.begin, tile.end, vb, ve);
      }
    }
  }

  /// Row statistics over the whole team: final maximum, 1 / sum and lse (rank 0 writes it).
  void finish_row_statistics(const ForwardBlock& block) {
    const index_t Bq = ws_.Bq;
    for (index_t i = 0; i < block.rows; ++i)
      for (index_t m = 0; m < M_; ++m) {
        const detail::SoftmaxState<A>* ranks = ws_.row_state.data() + m * Bq + i;
        const detail::SoftmaxState<A> row =
            detail::merge_states<A>(team_.size, [&](int j) { return ranks[j * M_ * Bq]; });
        rows_.inv_sum[i * M_ + m] = row.sum > 0 ? A(1) / row.sum : A(0);
        if (team_.rank == 0 && !p_.lse.empty())
          p_.lse(block.b, block.g * M_ + m, block.t0 + i) = row.lse();
        rows_.final_max[i * M_ + m] = row.max;
      }
  }

  /// Probability factors, Compose_post (or the factors alone), P'V.
  void pass2_tile(const ForwardBlock& block, const ForwardTile<A>& tile) {
    const index_t n = block.rows * M_;
    A* factors = rows_.scale.data();
    tile_probability_factors(rows_.tile_max.data() + tile.index * M_ * ws_.Bq,
                             rows_.final_max.data(), rows_.inv_sum.data(), n, factors);
    if (sides_.post.on) {
      compose(sides_.post, post_fn_, rows_.post, block, tile, factors);
    } else {
      for (index_t i = 0; i < block.rows; ++i)
        for (index_t m = 0; m < M_; ++m)
          Segment<A>(tile.slab + i * ws_.row_stride + m * ws_.tile, tile.end - tile.begin) *=
              factors[i * M_ + m];
    }
    for (index_t m = 0; m < M_; ++m) probabilities_times_values(block, tile, m);
  }

  /// Head m's output rows += P' V over the tile's keys.
  void probabilities_times_values(const ForwardBlock& block, const ForwardTile<A>& tile,
                                  index_t m) {
    const index_t h = block.g * M_ + m, Dv = p_.dims.Dv;
    const auto& v = p_.v;
    p_.keys.runs(block.b, tile.begin, tile.end, [&](index_t s, index_t slot, index_t n) {
      const A* probs = tile.slab + block.lo * ws_.row_stride + m * ws_.tile + (s - tile.begin);
      if constexpr (std::is_same_v<T, bf16>)
        if (bf16_products_)
          return bf16_product_ab(block.live_rows, Dv, n, {probs, ws_.row_stride},
                                 {row_ptr(v, block.b, h / group_of_kv_, slot), v.stride[2]},
                                 {out_rows(m) + block.lo * Dv, Dv, 1.0f, true},
                                 rows_.a_pairs.data(), rows_.b_pairs.data());
      gemm_ab<A, T>(block.live_rows, Dv, n, {probs, ws_.row_stride},
                    {row_ptr(v, block.b, h / group_of_kv_, slot), v.stride[2]},
                    {out_rows(m) + block.lo * Dv, Dv}, true, rows_.kt.data(), A(1),
                    {next_rows(next_head(v, block, m, slot), n, v.stride[2], Dv), {}});
    });
  }

  /// The same keys of the next kv head, for the packing routines to prefetch.
  const T* next_head(const TensorView<const T, 4>& x, const ForwardBlock& block, index_t m,
                     index_t slot) const {
    const index_t h0 = block.g * M_;
    return next_kv_rows(x, block.b, h0 + m, h0 + M_, group_of_kv_, slot);
  }
  detail::SoftmaxState<A>* my_state() { return ws_.row_state.data() + team_.rank * M_ * ws_.Bq; }
  A* out_rows(index_t m) { return ws_.o_part + (team_.rank * M_ + m) * ws_.Bq * p_.dims.Dv; }

  const detail::ForwardParams<T>& p_;
  const detail::RowMask& mask_;
  const Team& team_;
  ForwardWorkspace<A>& ws_;
  ForwardRows<A>& rows_;
  const ComposeSides<A>& sides_;
  const ComposeFn<A> pre_fn_, post_fn_;
  const index_t M_, group_of_kv_;
  const bool bf16_products_;
};

}  // namespace dcmha::cpu

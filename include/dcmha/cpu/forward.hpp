#pragma once
// Fused CPU forward of the attention core (MHA and DCMHA).
//
// Why a panel and not an online softmax: Compose_post mixes *normalized* probabilities across
// the heads of a group, and each head's normalizer is only known once its whole row has been
// seen. So for one query block of Bq rows we keep the scores of all M heads of the group over
// the block's visible keys, a panel of M x Bq x S values in key tiles (never B*H*T*S), take an
// exact softmax, compose, and multiply by V. The matrix products are the same two as in MHA.
//
// Parallelism: the whole team works on one (batch, group, query block) at a time, each thread on
// a contiguous share of its keys. Row statistics are combined across threads at two barriers and
// partial outputs summed in thread order at a third, so results are deterministic for a fixed
// thread count. The same split serves decoding, where one query row meets many keys; the
// backward hands out key tiles dynamically instead (backward.hpp).
#include <cmath>
#include <limits>
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
#include "gemm.hpp"
#include "mask.hpp"
#include "parallel.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

/// Rows per query block: as many as keep `panels` panels (each M x Bq x S values) within
/// `budget` bytes, between 32 and max_rows. More rows per block means fewer passes over K and V
/// (each block reads all of its keys for all M heads, from DRAM once M x S x D outgrows the cache)
/// and better reuse of each packed key tile; below 32 rows packing a key tile costs more than the
/// products it feeds, so long sequences get panels over budget, still O(S) per thread.
template <class A>
inline index_t query_block_rows(index_t M, index_t ld, index_t T, index_t panels = 1,
                                index_t budget = index_t(16) << 20, index_t max_rows = 64) {
  index_t rows = budget / index_t(sizeof(A)) / std::max<index_t>(panels * M * ld, 1);
  rows = std::max<index_t>(32, std::min<index_t>(max_rows, rows / 8 * 8));
  return std::min(rows, T);
}

template <class A>
inline A default_scale(double scale, index_t D) {
  return scale > 0 ? A(scale) : A(1) / std::sqrt(A(D));
}

/// Where forward and backward panels keep a block's values: one slab per key tile,
/// [row][m][key in tile], so that the M heads of one row, which Compose reads together, are one
/// contiguous run (M x tile values) and a tile's slab is one contiguous block; a rank's slabs
/// follow each other, ranks one after another. Head-major over the whole block ([m][row][key])
/// would put every head of a row in its own page, so that Compose's loads would miss the cache,
/// and later passes would read the panel back as M x Bq short streams.
struct SlabLayout {
  index_t tile = 0;        // keys per tile
  index_t row_stride = 0;  // one slab row: M x tile values, padded
  index_t slab = 0;        // Bq rows
  index_t tiles = 0;       // slabs per rank

  /// Tiles of as many keys as keep `panels` slabs within `budget` bytes (32..256 keys), for
  /// blocks of Bq rows that see at most `max_keys` keys, split across `team_size` ranks.
  template <class A>
  void init_slabs(index_t M, index_t Bq, index_t panels, index_t budget, index_t max_keys,
                  int team_size) {
    const index_t fit = budget / index_t(sizeof(A)) / (panels * M * Bq);
    tile = std::max<index_t>(32, std::min<index_t>(256, fit / 32 * 32));
    // off a power of two: the products write rows row_stride apart
    row_stride = padded_stride<A>(M * tile);
    slab = Bq * row_stride;
    // The most keys split_range gives one rank (shares are whole 16-key units).
    const index_t units = (max_keys + 15) / 16;
    tiles = ((units + team_size - 1) / team_size * 16 + tile - 1) / tile;
  }
  index_t panel_size(int team_size) const { return team_size * tiles * slab; }
  /// Offset of rank `rank`'s slab of tile number t; row i of it at + i * row_stride, head m's keys
  /// at + m * tile.
  index_t slab_offset(int rank, index_t t) const { return (rank * tiles + t) * slab; }
};

/// Buffers one team shares while it works on one (batch, group). The panel and the partial
/// outputs live in the call's Workspace (memory_size() values), the rest is small.
template <class A>
struct ForwardWorkspace : SlabLayout {
  index_t Bq = 0;
  A* panel = nullptr;  // [rank][tile][row][m][key], see SlabLayout
  // Outputs accumulate here, contiguous, and are written to the caller's tensor once per block
  // (summed over a key-split team, rounded once for narrow storage): the caller's rows are a page
  // apart in the (B, T, H, D) layout, too far apart to update tile after tile.
  A* o_part = nullptr;         // [rank][m][row][Dv]
  Buffer<A> row_max, row_sum;  // [rank][m][row]

  /// Rows per query block for a call on `threads` threads. The panel's cache footprint does not
  /// matter (slabs do), only its memory: 64 MiB. Up to 128 rows: DCMHA's query blocks read all M
  /// heads' K and V, from DRAM once they outgrow L3, and 128-row blocks halve those passes. But
  /// only with at least 8 blocks per thread (fewer leave the threads with causal blocks of unequal
  /// size to share) and no window (a window of W keys makes every row of a block compute
  /// W + Bq - 1 keys). See docs/performance.md.
  /// Long sequences stay below 64 rows (the budget: 56 at H16/T16384).
  static index_t block_rows(const detail::AttentionDims& d, const RowMask& mask, int threads) {
    const bool wide = mask.window == 0 && d.T >= 8 * 128 * index_t(threads);
    return query_block_rows<A>(d.M, padded_stride<A>(mask.max_block_keys(64)), d.T, 1,
                               index_t(64) << 20, wide ? 128 : 64);
  }

  /// Values of Workspace memory one team of team_size threads needs: whole cache lines, so that
  /// panels carved one after another from a block keep its alignment, which the order of the
  /// reductions over them depends on (Buffer, tile.hpp).
  /// `rows`: block_rows() of the call.
  static index_t memory_size(const detail::AttentionDims& d, const RowMask& mask, int team_size,
                             index_t rows) {
    ForwardWorkspace w;
    w.layout(d, mask, team_size, rows);
    return round_up(w.panel_size(team_size) + w.o_part_size(d, team_size), 64 / index_t(sizeof(A)));
  }

  /// `memory`: memory_size() values, written before they are read.
  void init(const detail::AttentionDims& d, const RowMask& mask, int team_size, index_t rows,
            A* memory) {
    layout(d, mask, team_size, rows);
    panel = memory;
    o_part = memory + panel_size(team_size);
    row_max.assign(team_size * d.M * Bq, A(0));
    row_sum.assign(team_size * d.M * Bq, A(0));
  }
  A* slab_of(int rank, index_t t) { return panel + slab_offset(rank, t); }

 private:
  /// A tile's slab, M x Bq x tile values, is produced and consumed tile by tile, about L2-sized
  /// (sweeping the whole panel once per step instead would make DCMHA memory-bound: tens of MiB
  /// at M = 32). 2 MiB: at H32/D128 and 128-row blocks, 128-key tiles instead of 32, so the P'V
  /// products update each head's output rows (64 KiB, from L3) four times less often and
  /// Compose and the softmax run on longer rows. Larger slabs (up to 4 MiB) perform the same
  /// (docs/performance.md).
  void layout(const detail::AttentionDims& d, const RowMask& mask, int team_size, index_t rows) {
    Bq = rows;
    init_slabs<A>(d.M, Bq, 1, index_t(2) << 20, mask.max_block_keys(Bq), team_size);
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
  void init(const detail::AttentionDims& d, const ComposeWeights<T>& cw, const KeyRing& ring) {
    // Through a ring buffer, kernel key s is not the caller's slot s: copy then.
    const bool in_place_ok = ring.capacity == 0;
    pre.init(cw.pre, d.M, padded_stride<A>(d.S), in_place_ok);
    post.init(cw.post, d.M, padded_stride<A>(d.S), in_place_ok);
  }
  /// The team loads group g of batch b, a share of the keys each.
  template <class T>
  void load(const Team& team, const ComposeWeights<T>& cw, index_t S, index_t b, index_t g,
            const KeyRing& ring) {
    if (!pre.on && !post.on) return;
    index_t s0, s1;
    split_range(0, S, team.rank, team.size, 1, s0, s1);
    if (pre.on) pre.load(cw.pre, b, g, s0, s1, ring);
    if (post.on) post.load(cw.post, b, g, s0, s1, ring);
    team.sync();
  }
};

/// One thread's per-row state, allocated once per call and thread: the query-blocks mode calls
/// forward_blocks once per block.
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

  /// Sized for the blocks and tiles of `ws` (already initialized).
  ForwardRows(const ComposeSides<A>& sides, const ForwardWorkspace<A>& ws,
              const detail::AttentionDims& d, bool narrow)
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
    if (narrow) q.assign(M * Bq * d.D, scratch_init<A>());
  }
};

/// Query blocks [blk0, blk1) of one (batch, group), the keys of each shared across the team.
///
/// Two passes over key tiles. Pass 1: scores, Compose_pre, and an online softmax: each tile's
/// exponentials are taken against the row's running maximum, which is remembered per tile.
/// Pass 2, once the row statistics are final (combined across the team): one factor per tile,
/// row and head, exp(tile max - row max) / sum, turns the stored exponentials into P (folded into
/// Compose_post's input scale), then P'V. Each panel value is written once and read once.
template <class T, class A>
void forward_blocks(const Team& team, ForwardWorkspace<A>& ws, ForwardRows<A>& rows,
                    const ComposeSides<A>& sides, const RowMask& mask, A scale,
                    const detail::AttentionDims& d, index_t b, index_t g, index_t blk0,
                    index_t blk1, TensorView<const T, 4> q, TensorView<const T, 4> k,
                    TensorView<const T, 4> v, TensorView<T, 4> out, TensorView<A, 3> lse,
                    const ComposeWeights<T>& cw, const KeyRing& ring) {
  const int tid = team.rank, nth = team.size;
  const index_t M = d.M, Dv = d.Dv, group_of_kv = d.H / d.Hk;
  const index_t Bq = ws.Bq, keys_per_tile = ws.tile, row_stride = ws.row_stride;
  const KernelComposeTerms<A>& pre = sides.pre;
  const KernelComposeTerms<A>& post = sides.post;
  constexpr A kNegInf = -std::numeric_limits<A>::infinity();

  std::vector<ComposeRow<A>>& pre_rows = rows.pre;
  std::vector<ComposeRow<A>>& post_rows = rows.post;
  A* scratch = rows.scratch.data();
  A* inv_sum = rows.inv_sum.data();
  A* final_max = rows.final_max.data();
  A* tile_max = rows.tile_max.data();
  A* tile_scale = rows.scale.data();
  A* kt = rows.kt.data();
  const ComposeFn<A> pre_fn(pre), post_fn(post);
  A* my_max = ws.row_max.data() + tid * M * Bq;
  A* my_sum = ws.row_sum.data() + tid * M * Bq;
  // The same keys of the next kv head, for the packing routines to prefetch.
  auto next_head = [&](const TensorView<const T, 4>& x, index_t m, index_t p) {
    return next_kv_rows(x, b, g * M + m, g * M + M, group_of_kv, p);
  };

  for (index_t t0 = blk0 * Bq; t0 < std::min(d.T, blk1 * Bq); t0 += Bq) {
    const index_t t1 = std::min(d.T, t0 + Bq), nr = t1 - t0;
    const KeyRange keys = mask.rows(b, t0, t1);
    index_t lo, hi;
    mask.live_rows(b, t0, t1, lo, hi);
    // Only rows [lo, hi) see keys and enter the products; the others' probabilities are set to
    // zero below and their output rows stay zero.
    const index_t block_live_rows = std::max<index_t>(hi - lo, 0);
    index_t c0, c1;
    split_range(keys.begin, keys.end, tid, nth, 16, c0, c1);
    for (index_t i = 0; i < nr; ++i) {
      pre_rows[i].load(pre, cw.pre, b, t0 + i, g);
      post_rows[i].load(post, cw.post, b, t0 + i, g);
    }
    for (index_t j = 0; j < M * Bq; ++j) {
      my_max[j] = kNegInf;
      my_sum[j] = A(0);
    }
    // The score products read Q in place (float storage) or widened once per block (narrow).
    constexpr bool narrow = !std::is_same_v<T, A>;
    if constexpr (narrow)
      if (c1 > c0)
        for (index_t m = 0; m < M; ++m)
          pack_rows<A>(block_live_rows, d.D, row_ptr(q, b, g * M + m, t0 + lo), q.stride[2],
                       rows.q.data() + (m * Bq + lo) * d.D, d.D);

    // Pass 1: scores, Compose_pre, exponentials against the running maximum.
    for (index_t cs = c0, tile = 0; cs < c1; cs += keys_per_tile, ++tile) {
      const index_t ce = std::min(c1, cs + keys_per_tile);
      // slab[i * row_stride + m * keys_per_tile + (s - cs)] holds key s
      A* slab = ws.slab_of(tid, tile);
      for (index_t m = 0; m < M; ++m) {
        const index_t h = g * M + m;
        const A* qm;
        index_t ldq;
        if constexpr (narrow) {
          qm = rows.q.data() + (m * Bq + lo) * d.D;
          ldq = d.D;
        } else {
          qm = row_ptr(q, b, h, t0 + lo);
          ldq = q.stride[2];
        }
        ring.runs(b, cs, ce, [&](index_t s, index_t p, index_t n) {
          gemm_abt<A>(block_live_rows, n, d.D, qm, ldq, row_ptr(k, b, h / group_of_kv, p),
                      k.stride[2], slab + lo * row_stride + m * keys_per_tile + (s - cs),
                      row_stride, scale, kt,
                      {next_rows(next_head(k, m, p), n, k.stride[2], d.D), {}});
        });
      }
      // Chunks outer: a chunk's key-wise terms stay in L1 while every row of the block uses them.
      if (pre.on)
        for (index_t s = cs; s < ce; s += kChunk) {
          const int n = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i) {
            A* p = slab + i * row_stride + (s - cs);
            // The products wrote the slab head by head, streaming Q and K past it: much of it has
            // left L2 by the time Compose reads it, so Compose asks for the next row as it goes.
            pre_fn(pre, pre_rows[i], s, n, p, keys_per_tile, p, keys_per_tile, nullptr, scratch,
                   i + 1 < hi ? p + row_stride : nullptr);
          }
        }
      A* tmax = tile_max + tile * M * Bq;
      for (index_t i = 0; i < nr; ++i) {
        const KeyRange r = mask.row(b, t0 + i);
        const index_t vb = std::max(r.begin, cs), ve = std::min(r.end, ce);
        for (index_t m = 0; m < M; ++m) {
          A* row = slab + i * row_stride + m * keys_per_tile - cs;  // row[s] holds key s
          A& mx = my_max[m * Bq + i];
          if (ve > vb) {
            Segment<A> e(row + vb, ve - vb);
            const A new_max = std::max(mx, e.maxCoeff());
            // Rescale the sum so far; mx = -inf means there is none yet (and exp would give NaN).
            A& sum = my_sum[m * Bq + i];
            if (mx != kNegInf && new_max != mx) sum *= std::exp(mx - new_max);
            mx = new_max;
            e = (e - mx).exp();
            sum += e.sum();
          }
          tmax[i * M + m] = mx;
          // Keys of the tile this row does not see are exactly 0, for Compose_post and P'V.
          for (index_t s = cs; s < std::min(vb, ce); ++s) row[s] = A(0);
          for (index_t s = std::max(ve, cs); s < ce; ++s) row[s] = A(0);
        }
      }
    }
    team.sync();

    // Row statistics over the whole team: final maximum and 1 / sum.
    for (index_t i = 0; i < nr; ++i)
      for (index_t m = 0; m < M; ++m) {
        A mx = kNegInf;
        for (int j = 0; j < nth; ++j) mx = std::max(mx, ws.row_max[(j * M + m) * Bq + i]);
        A l = 0;
        for (int j = 0; j < nth; ++j) {
          const A mj = ws.row_max[(j * M + m) * Bq + i];
          if (mj != kNegInf) l += ws.row_sum[(j * M + m) * Bq + i] * std::exp(mj - mx);
        }
        inv_sum[i * M + m] = l > 0 ? A(1) / l : A(0);
        if (tid == 0 && !lse.empty())
          lse(b, g * M + m, t0 + i) = l > 0 ? mx + std::log(l) : kNegInf;
        final_max[i * M + m] = mx;
      }

    // Pass 2: tile factors, Compose_post, P'V.
    auto out_rows = [&](index_t m) { return ws.o_part + (tid * M + m) * Bq * Dv; };
    std::fill(out_rows(0), out_rows(M), A(0));
    for (index_t cs = c0, tile = 0; cs < c1; cs += keys_per_tile, ++tile) {
      const index_t ce = std::min(c1, cs + keys_per_tile);
      A* slab = ws.slab_of(tid, tile);
      const A* tmax = tile_max + tile * M * Bq;
      // One factor per row and head, vectorized over the block's rows and heads rather than a
      // scalar exp each. No keys seen yet (tm = -inf) gives 0, also where the row sees none at
      // all (tm - final max would be NaN there).
      {
        using Row = Eigen::Map<const Eigen::Array<A, Eigen::Dynamic, 1>>;
        const Row tm(tmax, nr * M), fm(final_max, nr * M), inv(inv_sum, nr * M);
        Segment<A>(tile_scale, nr * M) = (tm == kNegInf).select(A(0), (tm - fm).exp() * inv);
      }
      if (post.on) {
        for (index_t s = cs; s < ce; s += kChunk) {
          const int n = int(std::min<index_t>(kChunk, ce - s));
          for (index_t i = lo; i < hi; ++i) {
            A* p = slab + i * row_stride + (s - cs);
            // The slab was written in pass 1, long enough ago to have left the cache.
            post_fn(post, post_rows[i], s, n, p, keys_per_tile, p, keys_per_tile,
                    tile_scale + i * M, scratch, i + 1 < hi ? p + row_stride : nullptr);
          }
        }
      } else {
        for (index_t i = 0; i < nr; ++i)
          for (index_t m = 0; m < M; ++m)
            Segment<A>(slab + i * row_stride + m * keys_per_tile, ce - cs) *= tile_scale[i * M + m];
      }
      for (index_t m = 0; m < M; ++m) {
        const index_t h = g * M + m;
        ring.runs(b, cs, ce, [&](index_t s, index_t p, index_t n) {
          gemm_ab<A>(block_live_rows, Dv, n, slab + lo * row_stride + m * keys_per_tile + (s - cs),
                     row_stride, 1, row_ptr(v, b, h / group_of_kv, p), v.stride[2],
                     out_rows(m) + lo * Dv, Dv, true, kt, A(1),
                     {next_rows(next_head(v, m, p), n, v.stride[2], Dv), {}});
        });
      }
    }
    team.sync();

    // Sum the partial outputs in thread order into the caller's rows; each thread writes a share.
    sum_team_parts<T, A>(team, ws.o_part, M, Bq, nr, Dv, out, b, g * M, t0);
  }
}

/// `mem`: where the panels go (a caller's Workspace kept between calls, or a fresh one).
template <class T>
void forward(const AttentionConfig& cfg, const detail::AttentionDims& d, TensorView<const T, 4> q,
             TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<T, 4> out,
             TensorView<acc_t<T>, 3> lse, const ComposeWeights<T>& cw, Workspace& mem,
             const KeyRing& ring = {}) {
  using A = acc_t<T>;
  const int nt = thread_count(cfg.num_threads);
  const RowMask mask(cfg, d.T, d.S);
  const A scale = default_scale<A>(cfg.scale, d.D);
  const index_t items = d.B * d.G;
  const index_t Bq = ForwardWorkspace<A>::block_rows(d, mask, nt);
  const index_t blocks = (d.T + Bq - 1) / Bq;
  // Threads with a private panel each: one Workspace block for all of them, so that forward
  // and backward calls share (and keep) one buffer for their panels.
  constexpr bool narrow = !std::is_same_v<T, A>;
  const index_t private_size = ForwardWorkspace<A>::memory_size(d, mask, 1, Bq);
  detail::WorkspaceAccess::reserve_slots(mem, nt);

  RegionErrors errors;
  if (independent_items(items, nt)) {
    // Many (batch, group) items: each thread takes whole ones and never waits on another.
    A* panels = detail::WorkspaceAccess::shared<A>(mem, 0, nt * private_size);
#pragma omp parallel num_threads(nt)
    {
      ForwardWorkspace<A> ws;
      ComposeSides<A> sides;
      std::optional<ForwardRows<A>> rows;
      errors.attempt([&] {
        ws.init(d, mask, 1, Bq, panels + thread_id() * private_size);
        sides.init(d, cw, ring);
        rows.emplace(sides, ws, d, narrow);
      });
      barrier();
      if (!errors.failed()) {
#pragma omp for schedule(dynamic, 1)
        for (index_t it = 0; it < items; ++it) {
          const index_t b = it / d.G, g = it % d.G;
          sides.load(Team{0, 1}, cw, d.S, b, g, ring);
          forward_blocks(Team{0, 1}, ws, *rows, sides, mask, scale, d, b, g, 0, blocks, q, k, v,
                         out, lse, cw, ring);
        }
      }
    }
    errors.rethrow_first();
    return;
  }
  ComposeSides<A> sides;
  sides.init(d, cw, ring);
  if (blocks >= 4 * index_t(nt)) {
    // Few items but many query blocks: the team loads an item's compose inputs together, then
    // each thread takes whole query blocks with a private panel (no barriers inside a block).
    // Largest causal blocks first, so the dynamic schedule ends on small ones.
    A* panels = detail::WorkspaceAccess::shared<A>(mem, 0, nt * private_size);
#pragma omp parallel num_threads(nt)
    {
      const Team team{thread_id(), team_size()};
      ForwardWorkspace<A> ws;
      std::optional<ForwardRows<A>> rows;
      errors.attempt([&] {
        ws.init(d, mask, 1, Bq, panels + team.rank * private_size);
        rows.emplace(sides, ws, d, narrow);
      });
      barrier();
      for (index_t it = 0; it < items && !errors.failed(); ++it) {
        const index_t b = it / d.G, g = it % d.G;
        sides.load(team, cw, d.S, b, g, ring);
#pragma omp for schedule(dynamic, 1)
        for (index_t blk = blocks - 1; blk >= 0; --blk)
          forward_blocks(Team{0, 1}, ws, *rows, sides, mask, scale, d, b, g, blk, blk + 1, q, k, v,
                         out, lse, cw, ring);
      }
    }
    errors.rethrow_first();
    return;
  }
  // Few rows (decoding, short prompts): the whole team shares each block's keys. The panel has
  // one run of slabs per rank, each long enough for a rank's share of the keys: sized for the
  // team OpenMP really gave (fewer threads than asked under OMP_THREAD_LIMIT or OMP_DYNAMIC).
  ForwardWorkspace<A> ws;
#pragma omp parallel num_threads(nt)
  {
    const Team team{thread_id(), team_size()};
#pragma omp single
    errors.attempt([&] {
      const index_t size = ForwardWorkspace<A>::memory_size(d, mask, team.size, Bq);
      ws.init(d, mask, team.size, Bq, detail::WorkspaceAccess::shared<A>(mem, 0, size));
    });
    std::optional<ForwardRows<A>> rows;
    if (!errors.failed()) errors.attempt([&] { rows.emplace(sides, ws, d, narrow); });
    barrier();
    for (index_t it = 0; it < items && !errors.failed(); ++it) {
      const index_t b = it / d.G, g = it % d.G;
      sides.load(team, cw, d.S, b, g, ring);
      forward_blocks(team, ws, *rows, sides, mask, scale, d, b, g, 0, blocks, q, k, v, out, lse, cw,
                     ring);
      team.sync();  // the next item reloads the shared compose inputs
    }
  }
  errors.rethrow_first();
}

}  // namespace dcmha::cpu

#pragma once
// How a CPU call is laid out before any thread starts: how the threads share the work, how tall
// a query block is, how many keys a tile holds and how the panels are carved. Every size here is
// a function of the problem and, where stated, the thread count; the budgets are measured
// choices (docs/performance.md).
#include <algorithm>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "../common/compose_terms.hpp"
#include "../common/mask.hpp"
#include "../compose_weights.hpp"
#include "../detail/dims.hpp"
#include "../error.hpp"
#include "../config.hpp"
#include "../tensor.hpp"
#include "../workspace.hpp"
#include "bf16_products.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

constexpr index_t kMiB = index_t(1) << 20;

// Query blocks: below 32 rows, packing a key tile costs more than the products it feeds.
constexpr index_t kMinBlockRows = 32;
constexpr index_t kBlockRows = 64;       // windowed layers, short or few-block calls
constexpr index_t kTallBlockRows = 128;  // long sequences without a window

// Forward: one panel per thread (or team) of at most 64 MiB; a key tile's slab (M x Bq x tile
// values) about L2-sized, 2 MiB.
constexpr index_t kForwardPanelBytes = 64 * kMiB;
constexpr index_t kForwardSlabBytes = 2 * kMiB;
// Tall blocks need this many blocks per thread, or causal blocks of unequal size leave threads
// idle at the end.
constexpr index_t kTallBlocksPerThread = 8;

// Backward: one set of three panels (L, P, dP) per thread taking whole items, or one for the
// team; the sets share 256 MiB, each between 48 and 128 MiB. A tile's three slabs: 1 MiB.
constexpr index_t kBackwardPanelSetsBytes = 256 * kMiB;
constexpr index_t kBackwardMinPanelSetBytes = 48 * kMiB;
constexpr index_t kBackwardMaxPanelSetBytes = 128 * kMiB;
constexpr index_t kBackwardSlabBytes = 1 * kMiB;

/// Rows per query block: as many as keep `panels` panels (each M x Bq x `row_length` values)
/// within `budget` bytes, between kMinBlockRows and max_rows (multiples of 8), at most T. Long
/// sequences get panels over budget, still O(S) per thread.
template <class A>
inline index_t query_block_rows(index_t M, index_t row_length, index_t T, index_t panels,
                                index_t budget, index_t max_rows) {
  index_t rows = budget / index_t(sizeof(A)) / std::max<index_t>(panels * M * row_length, 1);
  rows = std::max<index_t>(kMinBlockRows, std::min<index_t>(max_rows, rows / 8 * 8));
  return std::min(rows, T);
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

/// What every launch of a call knows: its parameters (ForwardParams or BackwardParams), which
/// keys each row sees, and its thread count.
template <class T, class Params>
struct LaunchBase {
  using A = acc_t<T>;
  static constexpr bool kNarrow = !std::is_same_v<T, A>;  // bf16 storage, float arithmetic

  const Params& params;
  detail::RowMask mask;
  int threads;
  bool bf16_products;  // the tile products on bf16 pairs (bf16_products.hpp)

  LaunchBase(const Params& p, int threads_)
      : params(p),
        mask(p.mask, p.dims.T, p.dims.S),
        threads(threads_),
        bf16_products(uses_bf16_products<T>(p.products)) {}

  /// One Workspace block for every thread's own panels, `per_thread` values each: forward and
  /// backward calls share (and keep) one buffer for their panels.
  A* thread_panels(Workspace& mem, index_t per_thread) const {
    return detail::WorkspaceAccess::shared<A>(mem, 0, threads * per_thread);
  }
};

/// How a call's threads share its (batch, group) items.
enum class LaunchMode {
  independent_items,  // each thread takes whole items and never waits on another
  private_blocks,     // forward: the team loads an item, then each thread takes whole blocks
  shared_keys,        // the team shares each block's keys, with barriers
};

/// Whole items per thread when there are enough to keep every thread busy with even shares.
inline bool independent_items(index_t items, int threads) {
  return threads == 1 || items % threads == 0 || items >= 4 * index_t(threads);
}

/// The forward's mode: few items but many query blocks go to threads block by block; few rows
/// (decoding, short prompts) split each block's keys.
inline LaunchMode forward_launch_mode(index_t items, index_t blocks, int threads) {
  if (independent_items(items, threads)) return LaunchMode::independent_items;
  if (blocks >= 4 * index_t(threads)) return LaunchMode::private_blocks;
  return LaunchMode::shared_keys;
}

/// Rows per forward query block. Up to 128: DCMHA's query blocks read all M heads' K and V, from
/// DRAM once they outgrow L3, and taller blocks halve those passes; but only with enough blocks
/// per thread and no window (a window of W keys makes every row of a block compute W + Bq - 1
/// keys). Long sequences stay below 64 rows (56 at H16/T16384).
template <class A>
index_t forward_block_rows(const detail::AttentionDims& d, const detail::RowMask& row_mask,
                           int threads) {
  const bool tall =
      row_mask.mask.window == 0 && d.T >= kTallBlocksPerThread * kTallBlockRows * threads;
  return query_block_rows<A>(d.M, padded_stride<A>(row_mask.max_block_keys(kBlockRows)), d.T, 1,
                             kForwardPanelBytes, tall ? kTallBlockRows : kBlockRows);
}

/// Rows per backward query block for a call of `items` (batch, group) items. Every block reads K
/// and V and updates dK and dV for all M heads over its keys, so fewer, larger blocks move less:
/// up to 128 rows as the panel set's budget allows, 64 with a window. The layout must not depend
/// on the thread count: it fixes the order of the per-tile sums, which keeps the gradients
/// bitwise the same for every count.
template <class A>
index_t backward_block_rows(const detail::AttentionDims& d, const detail::RowMask& row_mask,
                            index_t items) {
  const index_t budget = std::clamp<index_t>(kBackwardPanelSetsBytes / std::max<index_t>(items, 1),
                                             kBackwardMinPanelSetBytes, kBackwardMaxPanelSetBytes);
  const index_t max_rows = row_mask.mask.window > 0 ? kBlockRows : kTallBlockRows;
  return query_block_rows<A>(d.M, padded_stride<A>(row_mask.max_block_keys(max_rows)), d.T, 3,
                             budget, max_rows);
}

inline index_t gcd_index(index_t a, index_t b) { return b == 0 ? a : gcd_index(b, a % b); }

/// The backward's unit of independent work: groups that share kv heads (GQA with H / Hk not a
/// divisor or multiple of M) go to one owner together, a cluster of lcm(M, H / Hk) heads whose kv
/// heads no other cluster reads, so dK and dV are accumulated without races.
struct BackwardItems {
  index_t groups_per_item = 1;
  index_t count = 0;  // B x clusters

  explicit BackwardItems(const detail::AttentionDims& d) {
    const index_t group_of_kv = d.H / d.Hk;
    const index_t cluster_heads = d.M / gcd_index(d.M, group_of_kv) * group_of_kv;
    groups_per_item = cluster_heads / d.M;
    count = d.B * (d.G / groups_per_item);
  }
};

/// The kernels size their buffers by products of the problem's dims, and broadcast (zero-stride)
/// inputs let a caller pass dims no memory could hold. Before any size is computed: an upper
/// bound of all of them, with overflow checks, must fit comfortably in index_t; if it does not,
/// no allocation could succeed anyway, and the call fails as out of memory.
template <class T>
void check_buffer_sizes(const detail::AttentionDims& d, const ComposeWeights<T>& cw, int threads) {
  constexpr index_t lim = std::numeric_limits<index_t>::max() / 64;
  const index_t rank = detail::ComposeTermSets::of(cw).largest_rank();
  auto sum = [](std::initializer_list<index_t> xs) {  // saturates at lim + 1 (every x >= 0)
    index_t total = 0;
    for (index_t x : xs) total = x > lim - total ? lim + 1 : total + x;
    return total;
  };
  // Keys or rows per thread's panel, heads, values per (row, key) and per row, 16 bytes each.
  const index_t factors[] = {sum({d.S, d.T, 1024 * (index_t(threads) + 1)}), sum({d.H, 1}),
                             sum({d.D, d.Dv, rank, rank, rank, rank, 2048}), 16};
  index_t bound = 1;
  for (index_t f : factors) {
    if (f > lim / bound)
      throw AllocationError(detail::concat(
          "the kernels' working buffers for H = ", d.H, ", T = ", d.T, ", S = ", d.S, ", D = ", d.D,
          ", Dv = ", d.Dv, ", rank ", rank, " and ", threads, " threads exceed the address space"));
    bound *= f;
  }
}

}  // namespace dcmha::cpu

#pragma once
// How a call is cut into blocks: the head-dim class the kernels are compiled for, the tile
// geometry, each kernel's shared memory, cluster and grid. One plan serves the GPU launches
// (runtime.hpp) and the emulator (emulate.hpp), so both run the same tiles.
//
// The plan's choices, in order (docs/design.md says why):
//   - the head-dim class: the smallest of 32, 64, 96, 128, 256 holding D and Dv (padded with
//   zeros), among those compiled (DCMHA_CUDA_HEAD_DIMS);
//   - the cluster: the M heads of a compose group are split over `cluster` blocks of one cluster
//     (a divisor of M, at most the device's cluster size), each owning M / cluster heads;
//   - the rows: the most (up to 128) whose tiles fit the shared memory, with one warp per
//     (own head, 16 rows) and at most 8 warps; among equal rows, the smallest cluster; MHA's
//     registers mode gives a warp 32 rows where the type and head dim allow (kTallWarps);
//   - key splits where the query tiles are few and the keys many (decode).
#include <algorithm>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>

#include "../common/compose_terms.hpp"
#include "../error.hpp"
#include "../params.hpp"
#include "emulator/emulator.hpp"
#include "backward_geometry.hpp"
#include "forward_geometry.hpp"
#include "staging.hpp"

namespace dcmha::cuda {

/// What the device allows one block: shared memory after opting in, threads of a cluster.
struct DeviceLimits {
  index_t shared_bytes = 227 * 1024;  // sm_90 (sm_80: 163 KiB)
  int max_cluster = 8;                // portable cluster size on sm_90; 1 before
  int multiprocessors = 132;

  static DeviceLimits sm90() { return {}; }
  static DeviceLimits sm80() { return {163 * 1024, 1, 108}; }
};

/// What the values launch of a split two-pass forward (DCMHA decode) takes its composed scores
/// from: the statistics launch's, kept in the scratch, or QK^T and Compose_pre again over K.
enum class SplitScores : int {
  planned,     // kept where they take at most a quarter of K's bytes (a decode step's few rows)
  kept,        // always kept
  recomputed,  // never kept
};

/// Overrides for tests and tuning: 0 keeps the planned value.
struct LaunchOptions {
  index_t rows = 0;      // query rows per block (a multiple of 16): forward, backward query side
  index_t key_rows = 0;  // keys per block of the backward's key side (a multiple of 16)
  int cluster = 0;       // blocks sharing a group's heads
  // Blocks that share the keys of a query tile (forward) or of a head in one launch (the one-pass
  // backward, launched in rounds), their partial results summed in split order (1: no split).
  index_t key_splits = 0;
  DeviceLimits device;        // what the plan may use (an sm_90 unless device_given)
  bool device_given = false;  // on a GPU, false: the current device's limits
  // Backward: MHA in bf16 or fp16 (head dim up to 128, given the forward's output) runs in one
  // pass over the keys, as FlashAttention-2's does (rows, key_rows and cluster do not apply to
  // it); false keeps the two-sided backward, which adds no float sums.
  bool one_pass = true;
  // The one pass: true gives each key split its own dQ sums, added to in a fixed order, so that
  // the same call gives the same bits; false lets every key block add to one in a single launch
  // (FlashAttention-2's default: fewer launches, dQ's last bits varying from run to run).
  bool deterministic = true;
  SplitScores split_scores = SplitScores::planned;
};

/// Warps per block at most: each thread may then keep up to 255 registers (runtime.hpp's
/// __launch_bounds__).
constexpr int kMaxWarps = 8;

/// The fewest keys of a tile one block composes (forward, backward query side). A cluster
/// splits a tile's keys before its rows, so that each block stages the key-wise weights of its
/// own keys only; at 8 keys a warp's items (4 parts of DCFormer's 32 heads) still cover one
/// row's keys, whose score-tile words lie in distinct banks.
constexpr int kLeastSliceKeys = 8;
/// How many ways such a cluster splits a tile's keys; its rows go cluster / that many ways.
inline int key_slices_of(int cluster) { return std::min(cluster, kKeys / kLeastSliceKeys); }

// The head-dim classes the kernels are compiled for: all five unless the including code lists
// fewer, ascending (-DDCMHA_CUDA_HEAD_DIMS=64,128). Each class is a set of kernels that takes
// nvcc minutes per architecture; a call whose head dim needs a class left out is refused.
#ifndef DCMHA_CUDA_HEAD_DIMS
#define DCMHA_CUDA_HEAD_DIMS 32, 64, 96, 128, 256
#endif
#define DCMHA_CUDA_DETAIL_STRINGIZE_LIST(...) #__VA_ARGS__
#define DCMHA_CUDA_DETAIL_STRINGIZE(...) DCMHA_CUDA_DETAIL_STRINGIZE_LIST(__VA_ARGS__)

constexpr int kHeadDims[] = {DCMHA_CUDA_HEAD_DIMS};
constexpr int kHeadDimCount = int(std::size(kHeadDims));

constexpr bool head_dims_are_classes() {
  int previous = 0;
  for (int c : kHeadDims) {
    if (c <= previous || (c != 32 && c != 64 && c != 96 && c != 128 && c != 256)) return false;
    previous = c;
  }
  return true;
}
static_assert(head_dims_are_classes(),
              "DCMHA_CUDA_HEAD_DIMS: expected distinct classes among 32, 64, 96, 128, 256, "
              "ascending");

/// The smallest compiled class holding max(D, Dv) (padded with zeros).
inline int head_dim_class(const char* fn, index_t D, index_t Dv) {
  const index_t widest = std::max(D, Dv);
  for (int c : kHeadDims)
    if (widest <= c) return c;
  detail::fail(fn, ": head dim ", widest, " (max of D and Dv): expected at most ",
               kHeadDims[kHeadDimCount - 1], " (the head-dim classes compiled: ",
               DCMHA_CUDA_DETAIL_STRINGIZE(DCMHA_CUDA_HEAD_DIMS), ")");
  return 0;
}

/// Calls f(std::integral_constant<int, kHeadDim>) for the class, a compiled one
/// (head_dim_class's): only those are instantiated.
template <int kIndex = 0, class F>
decltype(auto) dispatch_head_dim(int head_dim, F&& f) {
  constexpr int kHeadDim = kHeadDims[kIndex];
  if constexpr (kIndex + 1 == kHeadDimCount) {
    return f(std::integral_constant<int, kHeadDim>{});
  } else {
    if (head_dim == kHeadDim) return f(std::integral_constant<int, kHeadDim>{});
    return dispatch_head_dim<kIndex + 1>(head_dim, std::forward<F>(f));
  }
}

/// One kernel launch: its shape (grid, threads, shared memory, cluster).
struct KernelLaunch {
  emulator::LaunchShape shape;
  index_t shared_bytes() const { return index_t(shape.shared_bytes); }
};

template <class T>
detail::ComposeTermSets checked_terms(const char* fn, const ComposeWeights<T>& c) {
  const detail::ComposeTermSets terms = detail::ComposeTermSets::of(c);
  if (terms.largest_rank() > kMaxRank)
    detail::fail(fn, ": compose rank R ", terms.largest_rank(), ": expected at most ", kMaxRank,
                 " on the CUDA backend");
  return terms;
}

/// The kernels index keys and rows of a sequence in 32 bits.
inline void check_lengths(const char* fn, const detail::AttentionDims& d) {
  constexpr index_t kLimit = index_t(1) << 31;
  if (d.T >= kLimit || d.S >= kLimit)
    detail::fail(fn, ": sequence lengths T = ", d.T, ", S = ", d.S,
                 ": expected below 2^31 on the CUDA backend");
}

/// The compose parts, dividing M: enough lanes per item that each keeps its heads' values in
/// registers (M / parts <= kCachedHeads) and that the block's threads are busy. A planned M is
/// a power-of-two cluster times its own heads, one warp each (at most kMaxWarps), so the cluster
/// size is such a divisor.
static_assert(kMaxWarps <= kCachedHeads, "a block's own heads must fit one compose lane");
inline int compose_parts(int M, int slice_rows, int slice_keys, int threads, int rows_per_item) {
  const int items = compose_items(ComposeRegion{0, slice_rows, 0, slice_keys, 0}, 1, rows_per_item);
  int parts = 1;
  while (parts < kWarpSize && M % (2 * parts) == 0 &&
         (M / parts > kCachedHeads || (parts < 8 && items * parts * 2 <= threads)))
    parts *= 2;
  return parts;
}

/// The largest cluster the device may use that divides M and is at most `limit`.
inline int cluster_candidates(int M, int limit, int (&out)[5]) {
  int n = 0;
  for (int c = 1; c <= limit && c <= M; c *= 2)
    if (M % c == 0) out[n++] = c;
  return n;
}

/// Picks cluster and rows for a block geometry whose shared bytes `bytes(geo)` gives: the most
/// rows that fit, then the smallest cluster. `max_rows` bounds the rows (the problem's T).
template <class Bytes, class Geometry>
bool fit_tiles(Geometry& geo, int M, index_t max_rows, index_t forced_rows,
               const LaunchOptions& opt, Bytes&& bytes) {
  int clusters[5];
  const int n = opt.cluster > 0 ? (clusters[0] = opt.cluster, 1)
                                : cluster_candidates(M, opt.device.max_cluster, clusters);
  const int row_options[] = {128, 64, 32, 16};
  for (int rows : row_options) {
    if (forced_rows > 0 && rows != forced_rows) continue;
    if (forced_rows == 0 && rows > 16 && rows / 2 >= max_rows) continue;  // taller than needed
    for (int i = 0; i < n; ++i) {
      const int c = clusters[i];
      if (M % c != 0) continue;
      const int own = M / c, warps = own * rows / 16;
      if (warps > kMaxWarps || rows < c) continue;
      geo.M = M, geo.cluster = c, geo.own_heads = own, geo.rows = rows, geo.warps = warps;
      if (bytes(geo) <= opt.device.shared_bytes) return true;
    }
  }
  return false;
}

/// The kv heads the own heads of one block read (GQA): the most of any block.
inline int kv_slots_of(index_t H, index_t Hk, int own_heads) {
  const index_t per_kv = H / Hk;
  int most = 1;
  for (index_t h0 = 0; h0 < H; h0 += own_heads) {
    const index_t first = h0 / per_kv, last = (h0 + own_heads - 1) / per_kv;
    most = std::max<int>(most, int(last - first + 1));
  }
  return most;
}

/// A forward: its blocks and, with split keys, the per-sequence launches that combine them.
struct ForwardLaunch {
  int head_dim = 128;
  ForwardGeometry geo;
  KernelLaunch blocks;
  // combine_split_statistics, sum_split_outputs: a block per (sequence, head), so that a decode
  // step's few rows spread over the machine (a block a sequence would be 8 blocks at B = 8, each
  // thread walking 32 elements one global latency after another).
  KernelLaunch per_head;

  index_t scratch_elements(const detail::AttentionDims& d) const {
    if (geo.splits == 1) return 0;
    const index_t kept = geo.scores_kept ? kept_score_row(d.S) : 0;
    return d.B * d.H * d.T * (2 * geo.splits + 1 + geo.splits * d.Dv + kept);
  }
  KeySplit carve(float* base, const detail::AttentionDims& d) const {
    KeySplit k;
    k.count = geo.splits;
    if (geo.splits == 1) return k;
    const index_t rows = d.B * d.H * d.T;
    k.stats = base;
    k.lse = k.stats + 2 * geo.splits * rows;
    k.out = k.lse + rows;
    if (geo.scores_kept) k.scores = k.out + geo.splits * rows * d.Dv;
    return k;
  }
  /// The blocks' geometry in one phase (the split launches run pass by pass); the layout stays
  /// the whole forward's, which holds every phase's arrays. A values launch that reads kept
  /// scores has no Compose_pre left to apply: they are composed already.
  ForwardGeometry phase(ForwardPhase p) const {
    ForwardGeometry g = geo;
    g.phase = p;
    if (p == ForwardPhase::split_values && g.scores_kept) g.terms.pre = {};
    return g;
  }
};

/// A forward whose query tiles are fewer than this splits its keys (two blocks per
/// multiprocessor), each split keeping at least kMinTilesPerSplit key tiles.
constexpr index_t kMinTilesPerSplit = 4;

/// Whether a split two-pass forward keeps its composed scores for the values launch. Kept, the
/// scores cost B H T kept_score_row(S) floats of scratch, written once and read once;
/// recomputed, K (B Hk S D elements) and the key-wise terms are read a second time, after the
/// whole cache has streamed past. Planned: kept where the floats are at most a quarter of K's
/// bytes.
template <class T>
bool keeps_split_scores(const detail::ForwardParams<T>& p, const ForwardGeometry& geo,
                        SplitScores choice) {
  if (geo.splits == 1 || geo.mode != ForwardMode::two_pass || choice == SplitScores::recomputed)
    return false;
  const index_t score_bytes = 4 * p.dims.H * p.dims.T * kept_score_row(p.dims.S);
  const index_t key_bytes = p.dims.Hk * p.dims.S * p.dims.D * index_t(sizeof(T));
  return choice == SplitScores::kept || 4 * score_bytes <= key_bytes;
}

template <class T>
ForwardLaunch forward_launch(const char* fn, const detail::ForwardParams<T>& p,
                             const LaunchOptions& opt = {}) {
  ForwardLaunch l;
  check_lengths(fn, p.dims);
  l.head_dim = head_dim_class(fn, p.dims.D, p.dims.Dv);
  ForwardGeometry& geo = l.geo;
  geo.terms = checked_terms(fn, p.compose);
  geo.mode = geo.terms.post.enabled()                           ? ForwardMode::two_pass
             : (geo.terms.pre.enabled() || !kTensorCoreType<T>) ? ForwardMode::one_pass
                                                                : ForwardMode::registers;
  geo.D = int(p.dims.D), geo.Dv = int(p.dims.Dv);
  geo.chunked_q = rows_are_chunked(p.q);
  geo.chunked_k = rows_are_chunked(p.k);
  geo.chunked_v = rows_are_chunked(p.v);
  const bool fits = dispatch_head_dim(l.head_dim, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    return fit_tiles(geo, int(p.dims.M), p.dims.T, opt.rows, opt, [&](ForwardGeometry& g) {
      const bool tall = kTallWarps<T, kHeadDim> && g.mode == ForwardMode::registers;
      g.warp_rows = tall && g.rows % 32 == 0 ? 32 : 16;
      g.warps = g.own_heads * g.rows / g.warp_rows;
      g.kv_slots = kv_slots_of(p.dims.H, p.dims.Hk, g.own_heads);
      g.key_slices = key_slices_of(g.cluster);
      g.slice_keys = kKeys / g.key_slices;
      g.slice_rows = g.rows / (g.cluster / g.key_slices);
      g.compose_parts = compose_parts(g.M, g.slice_rows, g.slice_keys, g.threads(),
                                      kForwardItemRows<T, kHeadDim>);
      g.template lay_out<T, kHeadDim>();
      return g.shared_bytes;
    });
  });
  if (!fits)
    detail::fail(fn, ": no tile of at least 16 rows fits ", opt.device.shared_bytes,
                 " bytes of shared memory per block with a cluster of at most ",
                 opt.device.max_cluster, " blocks (M = ", p.dims.M,
                 " heads per group, D = ", p.dims.D, ", Dv = ", p.dims.Dv, ")");
  const index_t tiles = (p.dims.T + geo.rows - 1) / geo.rows;
  const index_t clusters = tiles * p.dims.G * p.dims.B;
  const index_t key_tiles = (p.dims.S + kKeys - 1) / kKeys;
  const index_t target = 2 * opt.device.multiprocessors / geo.cluster;
  geo.splits =
      int(opt.key_splits > 0
              ? opt.key_splits
              : std::max<index_t>(1, std::min(target / clusters, key_tiles / kMinTilesPerSplit)));
  geo.splits = int(std::min<index_t>(geo.splits, 65535 / p.dims.B));
  geo.scores_kept = keeps_split_scores(p, geo, opt.split_scores);
  l.blocks.shape.shared_bytes = std::size_t(geo.shared_bytes);
  l.blocks.shape.x = tiles * geo.cluster;
  l.blocks.shape.y = p.dims.G;
  l.blocks.shape.z = p.dims.B * geo.splits;
  l.blocks.shape.threads = geo.threads();
  l.blocks.shape.cluster = geo.cluster;
  l.per_head.shape.x = p.dims.B;
  l.per_head.shape.y = p.dims.H;
  l.per_head.shape.threads = 128;
  return l;
}

/// A backward: the query side's launch, the key side's, and the sums after them.
struct BackwardLaunch {
  int head_dim = 128;
  bool one_pass = false;  // MHA in one pass (mha_backward_kernel.hpp): `key` is its geometry
  int key_rounds = 0;     // its launches, each over the next key.key_splits key blocks
  BackwardGeometry query, key;
  KernelLaunch query_blocks, key_blocks;
  KernelLaunch row_passes;   // one pass: the row dots before it, dQ after it
  KernelLaunch static_sums;  // one block per (side, group), where a side has a static W
  KernelLaunch head_sums;    // one block per (kv head, sequence), with GQA

  /// The one pass's geometry for round `round`: its first key block set.
  BackwardGeometry round_geometry(int round) const {
    BackwardGeometry g = key;
    g.first_key_block = round * g.key_splits;
    return g;
  }
};

/// Elements of each backward scratch array (floats).
struct BackwardScratchSizes {
  index_t row_dot = 0, static_partials = 0, dk = 0, dv = 0, dq_sum = 0;
  int dq_sums = 0;  // the one pass's arrays of dQ sums, in dq_sum
  index_t total() const { return row_dot + static_partials + dk + dv + dq_sum; }
};

inline BackwardScratchSizes backward_scratch_sizes(const detail::AttentionDims& d,
                                                   const BackwardLaunch& l) {
  BackwardScratchSizes s;
  s.row_dot = d.B * d.H * d.T;
  const bool any_static = l.query.terms.pre.static_w || l.query.terms.post.static_w;
  if (any_static)
    s.static_partials = d.B * d.G * ((d.T + l.query.rows - 1) / l.query.rows) * 2 * d.M * d.M;
  if (l.key.dkv_per_head) {
    s.dk = d.B * d.H * d.S * d.D;
    s.dv = d.B * d.H * d.S * d.Dv;
  }
  if (l.one_pass) {
    s.dq_sums = l.key.split_sums ? l.key.key_splits : 1;
    s.dq_sum = s.dq_sums * d.B * d.H * d.T * d.D;
  }
  return s;
}

/// The scratch's arrays; the static partials must start zeroed (the query side adds to them).
inline BackwardScratch carve_scratch(float* base, const BackwardScratchSizes& s) {
  BackwardScratch scratch;
  scratch.row_dot = base;
  scratch.static_partials = base + s.row_dot;
  scratch.dk = scratch.static_partials + s.static_partials;
  scratch.dv = scratch.dk + s.dk;
  scratch.dq_sum = scratch.dv + s.dv;
  scratch.dq_sums = s.dq_sums;
  return scratch;
}

/// Blocks a deterministic one pass aims for over all heads and sequences: an H100's or H200's
/// multiprocessors (one block each). Fixed rather than the device's count, so that the order of
/// dQ's sums, and so its bits, depend on the problem alone.
constexpr index_t kOnePassBlocks = 132;
/// Planned key splits at most: each split keeps a float dQ of its own in the workspace (16 of
/// them, 32 times a bf16 dQ), which few heads on long sequences would otherwise multiply.
constexpr index_t kMostOnePassSplits = 16;

/// Key splits of the one pass (the blocks of a head in one round): every key block (unordered:
/// one round), else as many as the heads and sequences fit in kOnePassBlocks blocks (a wave;
/// rounding up would add a partial second) up to kMostOnePassSplits, or as forced; at least 1,
/// at most the key blocks.
inline index_t one_pass_splits(const detail::AttentionDims& d, index_t key_blocks,
                               const LaunchOptions& opt) {
  index_t splits =
      opt.deterministic ? std::min(kOnePassBlocks / (d.B * d.H), kMostOnePassSplits) : key_blocks;
  if (opt.key_splits > 0) splits = opt.key_splits;
  return std::max<index_t>(1, std::min(splits, key_blocks));
}

/// MHA's one-pass backward where the call allows it and it fits: `l.key` its geometry,
/// `l.key_blocks` a round's launch (a block per key split, head and sequence), `l.row_passes`
/// a block per 64 rows.
template <class T>
void plan_one_pass(const detail::BackwardParams<T>& p, const BackwardGeometry& base,
                   const LaunchOptions& opt, BackwardLaunch& l) {
  if (!kTensorCoreType<T> || !opt.one_pass || !base.registers || p.out.data == nullptr ||
      l.head_dim > 128)
    return;
  BackwardGeometry g = base;
  g.one_pass = g.key_side = true;
  g.M = g.cluster = g.own_heads = g.kv_slots = 1;  // a block per head: groups do not mix them
  g.rows = kOnePassKeys, g.stream_rows = kOnePassRows, g.warps = kOnePassKeys / 16;
  dispatch_head_dim(l.head_dim, [&](auto head_dim) {
    g.template lay_out<T, decltype(head_dim)::value>();
    return 0;
  });
  if (g.shared_bytes > opt.device.shared_bytes) return;
  const index_t key_blocks = (p.dims.S + kOnePassKeys - 1) / kOnePassKeys;
  g.key_splits = int(one_pass_splits(p.dims, key_blocks, opt));
  g.split_sums = opt.deterministic;
  l.key_rounds = int((key_blocks + g.key_splits - 1) / g.key_splits);
  l.one_pass = true;
  l.key = g;
  l.key_blocks.shape = {
      g.key_splits, p.dims.H, p.dims.B, g.threads(), std::size_t(g.shared_bytes), 1};
  l.row_passes.shape.x = (p.dims.B * p.dims.H * p.dims.T + kRowPassRows - 1) / kRowPassRows;
  l.row_passes.shape.threads = 4 * kRowPassRows;
}

template <class T>
BackwardLaunch backward_launch(const char* fn, const detail::BackwardParams<T>& p,
                               const LaunchOptions& opt = {}) {
  BackwardLaunch l;
  check_lengths(fn, p.dims);
  l.head_dim = head_dim_class(fn, p.dims.D, p.dims.Dv);
  BackwardGeometry base;
  base.terms = checked_terms(fn, p.compose);
  base.registers = kTensorCoreType<T> && !base.terms.enabled();
  base.stream_rows = base.registers ? kFragmentStreamRows : kStreamRows;
  base.D = int(p.dims.D), base.Dv = int(p.dims.Dv);
  base.chunked_q = rows_are_chunked(p.q);
  base.chunked_k = rows_are_chunked(p.k);
  base.chunked_v = rows_are_chunked(p.v);
  base.chunked_dout = rows_are_chunked(p.dout);
  base.dkv_per_head = p.dims.H != p.dims.Hk;
  l.query = l.key = base;
  auto fit = [&](BackwardGeometry& geo, index_t extent, index_t forced_rows, auto&& bytes) {
    const bool ok =
        fit_tiles(geo, int(p.dims.M), extent, forced_rows, opt, [&](BackwardGeometry& g) {
          g.kv_slots = kv_slots_of(p.dims.H, p.dims.Hk, g.own_heads);
          g.key_slices = g.key_side ? 1 : key_slices_of(g.cluster);
          g.slice_keys = kKeys / g.key_slices;
          g.slice = g.rows / (g.cluster / g.key_slices);
          g.compose_parts = compose_parts(g.M, g.sum_rows(), g.sum_keys(), g.threads(), kChainRows);
          return bytes(g);
        });
    if (!ok)
      detail::fail(fn, ": no tile of at least 16 rows fits ", opt.device.shared_bytes,
                   " bytes of shared memory per block with a cluster of at most ",
                   opt.device.max_cluster, " blocks (M = ", p.dims.M,
                   " heads per group, D = ", p.dims.D, ", Dv = ", p.dims.Dv, ")");
  };
  l.key.key_side = true;
  dispatch_head_dim(l.head_dim, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    auto bytes = [](BackwardGeometry& g) {
      g.template lay_out<T, kHeadDim>();
      return g.shared_bytes;
    };
    fit(l.query, p.dims.T, opt.rows, bytes);
    fit(l.key, p.dims.S, opt.key_rows, bytes);
    return 0;
  });
  l.query_blocks.shape.shared_bytes = std::size_t(l.query.shared_bytes);
  l.key_blocks.shape.shared_bytes = std::size_t(l.key.shared_bytes);
  auto grid = [&](KernelLaunch& k, const BackwardGeometry& g, index_t extent) {
    k.shape.x = (extent + g.rows - 1) / g.rows * g.cluster;
    k.shape.y = p.dims.G;
    k.shape.z = p.dims.B;
    k.shape.threads = g.threads();
    k.shape.cluster = g.cluster;
  };
  grid(l.query_blocks, l.query, p.dims.T);
  grid(l.key_blocks, l.key, p.dims.S);
  l.static_sums.shape = {2, p.dims.G, 1, 256};
  l.head_sums.shape = {p.dims.Hk, p.dims.B, 1, 256};
  plan_one_pass(p, base, opt, l);
  return l;
}

}  // namespace dcmha::cuda

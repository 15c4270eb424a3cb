#pragma once
// How a call is cut into blocks: the tile geometry each kernel runs with, its shared memory and
// its grid. One plan serves the GPU launches (runtime.hpp) and the host execution (emulate.hpp),
// so both run the same tiles.
#include <algorithm>

#include "../error.hpp"
#include "backward_kernel.hpp"
#include "forward_kernel.hpp"

namespace dcmha::cuda {

/// Shared memory a block may use: within what sm_80 (164 KiB) and sm_90 (227 KiB) give one
/// block after opting in, leaving room for a second block per multiprocessor on sm_90.
constexpr index_t kSharedMemoryBudget = 96 * 1024;
/// Keys per step and threads per block unless the caller's LaunchOptions say otherwise.
constexpr index_t kDefaultKeysPerStep = 32;
constexpr int kDefaultThreads = 128;
/// A forward with fewer query blocks than this splits its keys across blocks (two blocks per
/// multiprocessor of an H100 / H200), each split keeping at least kMinStepsPerSplit key steps.
constexpr index_t kTargetBlocks = 264;
constexpr index_t kMinStepsPerSplit = 4;

/// Overrides for tests and tuning: 0 keeps the planned value.
struct LaunchOptions {
  int threads = 0;
  index_t rows = 0;          // query rows per block
  index_t keys = 0;          // keys per step
  index_t key_splits = 0;    // forward: blocks that share a query tile's keys (1: no split)
  bool tensor_cores = true;  // bf16: products on tensor cores where the shapes allow
};

struct Grid3 {
  index_t x = 1, y = 1, z = 1;
};

struct KernelLaunch {
  TileGeometry geo;
  int threads = kDefaultThreads;
  index_t shared_bytes = 0;
  Grid3 grid;
};

template <class T>
index_t largest_rank(const ComposeWeights<T>& c) {
  return std::max({query_rank(c.pre), key_rank(c.pre), query_rank(c.post), key_rank(c.post)});
}

/// The largest power-of-two row count up to 16 (and up to T) whose shared memory fits the
/// budget; throws when even one row does not.
template <class Shared>
TileGeometry fit_rows(const char* fn, TileGeometry geo, index_t T, const LaunchOptions& opt) {
  if (opt.rows > 0) {
    geo.rows = opt.rows;
    return geo;
  }
  index_t rows = 16;
  while (rows > 1 && rows / 2 >= T) rows /= 2;
  for (; rows >= 1; rows /= 2) {
    geo.rows = rows;
    if (shared_bytes<Shared>(geo) <= kSharedMemoryBudget) return geo;
  }
  detail::fail(fn, ": the problem needs ", shared_bytes<Shared>(geo),
               " bytes of shared memory per ", "block (M = ", geo.M,
               " heads per group, D = ", geo.D, ", Dv = ", geo.Dv, "), expected at most ",
               kSharedMemoryBudget);
  return geo;
}

template <class T>
TileGeometry base_geometry(const detail::QkvParams<T>& p, const LaunchOptions& opt) {
  TileGeometry geo;
  geo.M = p.dims.M;
  geo.D = p.dims.D;
  geo.Dv = p.dims.Dv;
  geo.rank = largest_rank(p.compose);
  geo.keys = opt.keys > 0 ? opt.keys : std::min<index_t>(kDefaultKeysPerStep, p.dims.S);
  return geo;
}

/// geo with as many warps staging for the tensor cores as the budget leaves room for (every warp
/// of the block first, halving down to one), or none where the shapes or the options rule them
/// out. The rows are the scalar plan's: the tensor cores take what memory the tile leaves.
template <class T, class... Shared>
TileGeometry with_tensor_cores(TileGeometry geo, const LaunchOptions& opt) {
  const int threads = opt.threads > 0 ? opt.threads : kDefaultThreads;
  if (!opt.tensor_cores || !tensor_core_shape<T>(geo, threads)) return geo;
  for (index_t warps = threads / kWarpSize; warps >= 1; warps /= 2) {
    geo.tensor_warps = warps;
    if (((shared_bytes<Shared>(geo) <= kSharedMemoryBudget) && ...)) return geo;
  }
  geo.tensor_warps = 0;
  return geo;
}

template <class Shared>
KernelLaunch finish_launch(const TileGeometry& geo, const LaunchOptions& opt, Grid3 grid) {
  KernelLaunch l;
  l.geo = geo;
  l.threads = opt.threads > 0 ? opt.threads : kDefaultThreads;
  l.shared_bytes = shared_bytes<Shared>(geo);
  l.grid = grid;
  return l;
}

/// Forward: one block per (query tile, group, sequence), times the key splits; with splits,
/// also the per-sequence launches that combine them (ForwardKernel, KeySplit).
struct ForwardLaunch {
  KernelLaunch blocks;
  index_t splits = 1;
  KernelLaunch per_sequence;  // combine_split_statistics, sum_split_outputs: one block each

  /// Elements of the split scratch (0 without splits).
  index_t scratch_elements(const detail::AttentionDims& d) const {
    return splits > 1 ? d.B * d.H * d.T * (2 * splits + 1 + splits * d.Dv) : 0;
  }
  template <class A>
  KeySplit<A> carve(A* base, const detail::AttentionDims& d) const {
    KeySplit<A> k;
    k.count = splits;
    if (splits == 1) return k;
    const index_t rows = d.B * d.H * d.T;
    k.stats = base;
    k.lse = k.stats + 2 * splits * rows;
    k.out = k.lse + rows;
    return k;
  }
};

template <class T>
ForwardLaunch forward_launch(const char* fn, const detail::ForwardParams<T>& p,
                             const LaunchOptions& opt = {}) {
  using Shared = ForwardShared<acc_t<T>>;
  const TileGeometry geo =
      with_tensor_cores<T, Shared>(fit_rows<Shared>(fn, base_geometry(p, opt), p.dims.T, opt), opt);
  const index_t tiles = (p.dims.T + geo.rows - 1) / geo.rows;
  const index_t blocks = tiles * p.dims.G * p.dims.B;
  const index_t steps = (p.dims.S + geo.keys - 1) / geo.keys;
  ForwardLaunch l;
  l.splits =
      opt.key_splits > 0
          ? opt.key_splits
          : std::max<index_t>(1, std::min(kTargetBlocks / blocks, steps / kMinStepsPerSplit));
  l.splits = std::min<index_t>(l.splits, 65535 / p.dims.B);  // grid z = splits * B
  l.blocks = finish_launch<Shared>(geo, opt, {tiles, p.dims.G, p.dims.B * l.splits});
  l.per_sequence = finish_launch<Shared>(geo, opt, {p.dims.B, 1, 1});
  l.per_sequence.shared_bytes = 0;
  return l;
}

/// Backward: the query side's launch (one block per query tile, group, sequence), the key
/// side's (one per key tile, sequence) and the static sums' (one per side, group), which share
/// one geometry so that the key side walks the query side's tiles.
struct BackwardLaunch {
  KernelLaunch query, key, static_sums;
};

template <class T>
BackwardLaunch backward_launch(const char* fn, const detail::BackwardParams<T>& p,
                               const LaunchOptions& opt = {}) {
  using A = acc_t<T>;
  const TileGeometry geo = with_tensor_cores<T, QueryGradShared<A>, KeyGradShared<A>>(
      fit_rows<QueryGradShared<A>>(fn, base_geometry(p, opt), p.dims.T, opt), opt);
  if (shared_bytes<KeyGradShared<A>>(geo) > kSharedMemoryBudget)
    detail::fail(fn, ": the key side needs ", shared_bytes<KeyGradShared<A>>(geo),
                 " bytes of shared memory per block, expected at most ", kSharedMemoryBudget);
  const index_t query_tiles = (p.dims.T + geo.rows - 1) / geo.rows;
  const index_t key_tiles = (p.dims.S + geo.keys - 1) / geo.keys;
  BackwardLaunch l;
  l.query = finish_launch<QueryGradShared<A>>(geo, opt, {query_tiles, p.dims.G, p.dims.B});
  l.key = finish_launch<KeyGradShared<A>>(geo, opt, {key_tiles, p.dims.B, 1});
  l.static_sums = finish_launch<QueryGradShared<A>>(geo, opt, {2, p.dims.G, 1});
  l.static_sums.shared_bytes = 0;
  return l;
}

/// Elements of each backward scratch array.
struct BackwardScratchSizes {
  index_t row_dot = 0, dk = 0, dv = 0, static_partials = 0;
  index_t total() const { return row_dot + dk + dv + static_partials; }
};

inline BackwardScratchSizes backward_scratch_sizes(const detail::AttentionDims& d,
                                                   const BackwardLaunch& l) {
  BackwardScratchSizes s;
  s.row_dot = d.B * d.H * d.T;
  s.dk = d.B * d.Hk * d.S * d.D;
  s.dv = d.B * d.Hk * d.S * d.Dv;
  s.static_partials = l.query.grid.x * l.query.grid.y * l.query.grid.z * 2 * d.M * d.M;
  return s;
}

template <class A>
BackwardScratch<A> carve_scratch(A* base, const BackwardScratchSizes& s) {
  BackwardScratch<A> scratch;
  scratch.row_dot = base;
  scratch.dk = scratch.row_dot + s.row_dot;
  scratch.dv = scratch.dk + s.dk;
  scratch.static_partials = scratch.dv + s.dv;
  return scratch;
}

}  // namespace dcmha::cuda

#pragma once
// The CUDA backend's kernels executed by the emulator (emulator/emulator.hpp), behind the CPU
// entry points' call shape: what the tests check against the reference on machines without a
// GPU. Memory is host memory; LaunchOptions choose tiles, clusters, splits and the device limits
// the plan assumes (an sm_90 by default).
#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "../decode/decode_params.hpp"
#include "../detail/validate.hpp"
#include "backward_kernel.hpp"
#include "mha_backward_kernel.hpp"
#include "forward_kernel.hpp"
#include "launch_sequence.hpp"

namespace dcmha::cuda::emulate {

using emulator::HostBlock;

/// The first 256-byte aligned address in `storage` with room for n elements after it (storage
/// holds 256 bytes more), as cudaMalloc and the device workspace align: the emulator's sector
/// counts must not depend on where the host's allocator put the memory.
template <class U>
U* aligned_as_on_device(std::vector<U>& storage, index_t n) {
  void* base = storage.data();
  std::size_t room = storage.size() * sizeof(U);
  return static_cast<U*>(std::align(256, static_cast<std::size_t>(n) * sizeof(U), base, room));
}

/// n zeroed floats of scratch in `storage`, aligned as on the device.
inline float* scratch_as_on_device(std::vector<float>& storage, index_t n) {
  storage.assign(static_cast<std::size_t>(n) + 256 / sizeof(float), 0.0f);
  return aligned_as_on_device(storage, n);
}

/// One of a forward's launches (for_each_launch), its kernels of head-dim class kHeadDim.
template <class T, int kHeadDim>
void run_forward_launch(const detail::ForwardParams<T>& p, const ForwardLaunch& l,
                        const KeySplit& split, Kernel kernel) {
  const char* name = kernel_name(kernel);
  if (kernel == Kernel::combine_split_statistics) {
    emulator::launch(name, l.per_head.shape,
                     [&](const HostBlock& blk) { combine_split_statistics(blk, p, split); });
    return;
  }
  if (kernel == Kernel::sum_split_outputs) {
    emulator::launch(name, l.per_head.shape,
                     [&](const HostBlock& blk) { sum_split_outputs(blk, p, split); });
    return;
  }
  const ForwardPhase phase = phase_of(kernel);
  const ForwardGeometry geo = l.phase(phase);
  emulator::launch(name, l.blocks.shape, [&](const HostBlock& blk) {
    dispatch_forward_warps<T, kHeadDim>(geo, [&](auto row_tiles, auto composes) {
      constexpr int kRowTiles = decltype(row_tiles)::value;
      constexpr bool kComposes = decltype(composes)::value;
      if constexpr (kComposes)
        if (runs_kept_scores(l, kernel)) {
          ForwardKernel<T, kHeadDim, HostBlock, 1, true>(blk, p, geo, split).run();
          return;
        }
      ForwardKernel<T, kHeadDim, HostBlock, kRowTiles, false, kComposes>(blk, p, geo, split).run();
    });
  });
}

/// The forward's launches (launch_forward's twin, on host memory).
template <class T>
void run_forward(const detail::ForwardParams<T>& p, const ForwardLaunch& l) {
  std::vector<float> storage;
  const KeySplit split =
      l.geo.splits == 1
          ? KeySplit{}
          : l.carve(scratch_as_on_device(storage, l.scratch_elements(p.dims)), p.dims);
  dispatch_head_dim(l.head_dim, [&](auto head_dim) {
    for_each_launch(l, [&](Kernel kernel, int) {
      run_forward_launch<T, decltype(head_dim)::value>(p, l, split, kernel);
    });
    return 0;
  });
}

template <class T>
void forward(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,
             TensorView<const T, 4> v, TensorView<T, 4> out, TensorView<acc_t<T>, 3> lse = {},
             const ComposeWeights<T>& compose = {}, const LaunchOptions& opt = {}) {
  const char* fn = "dcmha::cuda::emulate::forward";
  const detail::ForwardParams<T> p = detail::forward_params(fn, cfg, q, k, v, out, lse, compose);
  run_forward(p, forward_launch(fn, p, opt));
}

/// One of a backward's launches (for_each_launch).
template <class T>
void run_backward_launch(const detail::BackwardParams<T>& p, const BackwardLaunch& l,
                         const BackwardScratch& scratch, Kernel kernel, int round) {
  const char* name = kernel_name(kernel);
  switch (kernel) {
    case Kernel::backward_row_dots:
      emulator::launch(name, l.row_passes.shape,
                       [&](const HostBlock& blk) { sum_row_dots(blk, p, scratch); });
      return;
    case Kernel::backward_query_grads:
      emulator::launch(name, l.row_passes.shape,
                       [&](const HostBlock& blk) { store_query_grads(blk, p, scratch); });
      return;
    case Kernel::sum_static_grads:
      emulator::launch(name, l.static_sums.shape, [&](const HostBlock& blk) {
        sum_static_grads(blk, p, l.query.rows, scratch);
      });
      return;
    case Kernel::sum_head_grads:
      emulator::launch(name, l.head_sums.shape,
                       [&](const HostBlock& blk) { sum_head_grads(blk, p, scratch); });
      return;
    default:
      break;
  }
  dispatch_head_dim(l.head_dim, [&](auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    if (kernel == Kernel::backward_query) {
      emulator::launch(name, l.query_blocks.shape, [&](const HostBlock& blk) {
        QueryGradKernel<T, kHeadDim, HostBlock>(blk, p, l.query, scratch).run();
      });
    } else if (kernel == Kernel::backward_key) {
      emulator::launch(name, l.key_blocks.shape, [&](const HostBlock& blk) {
        KeyGradKernel<T, kHeadDim, HostBlock>(blk, p, l.key, scratch).run();
      });
    } else if constexpr (kOnePassHeadDim<T, kHeadDim>) {
      const BackwardGeometry geo = l.round_geometry(round);
      emulator::launch(name, l.key_blocks.shape, [&](const HostBlock& blk) {
        MhaBackwardKernel<T, kHeadDim, HostBlock>(blk, p, geo, scratch).run();
      });
    }
    return 0;
  });
}

/// The backward's launches (launch_backward's twin, on host memory).
template <class T>
void run_backward(const detail::BackwardParams<T>& p, const BackwardLaunch& l) {
  const BackwardScratchSizes sizes = backward_scratch_sizes(p.dims, l);
  std::vector<float> storage;
  const BackwardScratch scratch =
      carve_scratch(scratch_as_on_device(storage, sizes.total()), sizes);
  // dQ's sums start as whatever a reused workspace holds: the row-dots pass must zero them.
  std::fill(scratch.dq_sum, scratch.dq_sum + sizes.dq_sum, std::numeric_limits<float>::quiet_NaN());
  for_each_launch(l, sizes, [&](Kernel kernel, int round) {
    run_backward_launch(p, l, scratch, kernel, round);
  });
}

template <class T>
void backward(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,
              TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,
              TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk,
              TensorView<T, 4> dv, const ComposeWeights<T>& compose = {},
              const ComposeGrads<T>& dcompose = {}, const LaunchOptions& opt = {},
              TensorView<const T, 4> out = {}) {
  const char* fn = "dcmha::cuda::emulate::backward";
  const detail::BackwardParams<T> p =
      detail::backward_params(fn, cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, out);
  run_backward(p, backward_launch(fn, p, opt));
}

/// A decode step (decode/decode.hpp) over a host DecodeCache: the forward kernel on the
/// cache's slots, ring and lengths.
template <class T>
void decode(const AttentionConfig& cfg, TensorView<const T, 4> q_new, const DecodeCache<T>& cache,
            const ComposeWeights<T>& query_side, TensorView<T, 4> out,
            const LaunchOptions& opt = {}) {
  const char* fn = "dcmha::cuda::emulate::decode";
  detail::DecodeStepLengths lengths;
  const detail::ForwardParams<T> p =
      detail::decode_params(fn, cfg, q_new, cache, query_side, out, lengths);
  run_forward(p, forward_launch(fn, p, opt));
}

}  // namespace dcmha::cuda::emulate

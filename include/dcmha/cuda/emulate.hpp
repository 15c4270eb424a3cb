#pragma once
// The CUDA backend's kernels executed on the host (simt_host.hpp), behind the CPU entry points'
// call shape: what the tests check against the reference on machines without a GPU. Memory is
// host memory; LaunchOptions choose threads and tiles, so small problems still cross tiles.
#include <vector>

#include "../decode/decode_params.hpp"
#include "../detail/validate.hpp"
#include "launch_plan.hpp"
#include "simt_host.hpp"

namespace dcmha::cuda::emulate {

inline host::Grid grid_of(const KernelLaunch& l) { return {l.grid.x, l.grid.y, l.grid.z}; }

/// The forward's launches (launch_forward's twin, on host memory).
template <class T>
void run_forward(const detail::ForwardParams<T>& p, const ForwardLaunch& l) {
  using A = acc_t<T>;
  using Block = host::HostBlock;
  const KernelLaunch& b = l.blocks;
  if (l.splits == 1) {
    host::launch(grid_of(b), b.threads, std::size_t(b.shared_bytes),
                 [&](const Block& blk) { ForwardKernel<T, Block>(blk, p, b.geo).run(); });
    return;
  }
  std::vector<A> scratch(static_cast<std::size_t>(l.scratch_elements(p.dims)));
  const KeySplit<A> split = l.carve(scratch.data(), p.dims);
  host::launch(grid_of(b), b.threads, std::size_t(b.shared_bytes), [&](const Block& blk) {
    ForwardKernel<T, Block>(blk, p, b.geo, split).run_split_statistics();
  });
  host::launch(grid_of(l.per_sequence), l.per_sequence.threads, 0,
               [&](const Block& blk) { combine_split_statistics(blk, p, split); });
  host::launch(grid_of(b), b.threads, std::size_t(b.shared_bytes), [&](const Block& blk) {
    ForwardKernel<T, Block>(blk, p, b.geo, split).run_split_values();
  });
  host::launch(grid_of(l.per_sequence), l.per_sequence.threads, 0,
               [&](const Block& blk) { sum_split_outputs(blk, p, split); });
}

template <class T>
void forward(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,
             TensorView<const T, 4> v, TensorView<T, 4> out, TensorView<acc_t<T>, 3> lse = {},
             const ComposeWeights<T>& compose = {}, const LaunchOptions& opt = {}) {
  const char* fn = "dcmha::cuda::emulate::forward";
  const detail::ForwardParams<T> p = detail::forward_params(fn, cfg, q, k, v, out, lse, compose);
  run_forward(p, forward_launch(fn, p, opt));
}

template <class T>
void backward(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,
              TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,
              TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk,
              TensorView<T, 4> dv, const ComposeWeights<T>& compose = {},
              const ComposeGrads<T>& dcompose = {}, const LaunchOptions& opt = {}) {
  using A = acc_t<T>;
  const char* fn = "dcmha::cuda::emulate::backward";
  const detail::BackwardParams<T> p =
      detail::backward_params(fn, cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose);
  const BackwardLaunch l = backward_launch(fn, p, opt);
  const BackwardScratchSizes sizes = backward_scratch_sizes(p.dims, l);
  std::vector<A> memory(static_cast<std::size_t>(sizes.total()));
  const BackwardScratch<A> scratch = carve_scratch(memory.data(), sizes);
  host::launch(grid_of(l.query), l.query.threads, std::size_t(l.query.shared_bytes),
               [&](const host::HostBlock& blk) {
                 QueryGradKernel<T, host::HostBlock>(blk, p, l.query.geo, scratch).run();
               });
  host::launch(grid_of(l.key), l.key.threads, std::size_t(l.key.shared_bytes),
               [&](const host::HostBlock& blk) {
                 KeyGradKernel<T, host::HostBlock>(blk, p, l.key.geo, scratch).run();
               });
  host::launch(grid_of(l.static_sums), l.static_sums.threads, 0, [&](const host::HostBlock& blk) {
    sum_static_grads(blk, p, l.static_sums.geo, scratch);
  });
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

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

template <class T>
void run_forward(const detail::ForwardParams<T>& p, const KernelLaunch& l) {
  host::launch(
      {l.grid.x, l.grid.y, l.grid.z}, l.threads, std::size_t(l.shared_bytes),
      [&](const host::HostBlock& blk) { ForwardKernel<T, host::HostBlock>(blk, p, l.geo).run(); });
}

template <class T>
void forward(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,
             TensorView<const T, 4> v, TensorView<T, 4> out, TensorView<acc_t<T>, 3> lse = {},
             const ComposeWeights<T>& compose = {}, const LaunchOptions& opt = {}) {
  const char* fn = "dcmha::cuda::emulate::forward";
  const detail::ForwardParams<T> p = detail::forward_params(fn, cfg, q, k, v, out, lse, compose);
  const KernelLaunch l = forward_launch(fn, p, opt);
  host::launch(
      {l.grid.x, l.grid.y, l.grid.z}, l.threads, std::size_t(l.shared_bytes),
      [&](const host::HostBlock& blk) { ForwardKernel<T, host::HostBlock>(blk, p, l.geo).run(); });
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
  auto grid = [](const KernelLaunch& k) { return host::Grid{k.grid.x, k.grid.y, k.grid.z}; };
  host::launch(grid(l.query), l.query.threads, std::size_t(l.query.shared_bytes),
               [&](const host::HostBlock& blk) {
                 QueryGradKernel<T, host::HostBlock>(blk, p, l.query.geo, scratch).run();
               });
  host::launch(grid(l.key), l.key.threads, std::size_t(l.key.shared_bytes),
               [&](const host::HostBlock& blk) {
                 KeyGradKernel<T, host::HostBlock>(blk, p, l.key.geo, scratch).run();
               });
  host::launch(grid(l.static_sums), l.static_sums.threads, 0, [&](const host::HostBlock& blk) {
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

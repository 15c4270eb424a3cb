#pragma once
// The CUDA backend's entry points: the CPU entry points' call shapes (attention.hpp) on device
// memory, with a DeviceWorkspace and a stream. Include from a .cu file compiled by nvcc and link
// dcmha::cuda.
//
//   dcmha::cuda::forward (cfg, q, k, v, out, lse, compose, workspace, stream)
//   dcmha::cuda::backward(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, workspace,
//   stream)
//   dcmha::cuda::backward(cfg, q, k, v, out, lse, dout, ...)  the same, given the forward's
//   output: without Compose_post (MHA included) each row's D = sum(dout * out) is read from it
//   instead of summed in a pass over the keys
//
// Every tensor view points to device memory, except cfg.query_lengths / key_lengths, which are
// host memory (they are validated, then copied into the workspace). Arguments are validated
// exactly as on the CPU, before anything is launched, and bad ones throw dcmha::Error; a CUDA
// failure throws dcmha::Error naming the call and CUDA's message. The calls are asynchronous
// on `stream` like any kernel launch (cfg.num_threads is ignored). Scalar types: float, bf16 and
// fp16 storage (float arithmetic, float lse).
#include <cstring>
#include <vector>

#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../detail/validate.hpp"
#include "launch_sequence.hpp"
#include "runtime.hpp"

namespace dcmha::cuda {

namespace detail_cuda {

/// A call's device memory from the workspace: small index arrays staged from the host (the
/// per-sequence lengths, a decode step's ring starts), then the kernels' scratch.
class CallMemory {
 public:
  /// Room for `index_elements` staged values and `scratch_bytes` of scratch.
  CallMemory(const char* fn, DeviceWorkspace& ws, index_t index_elements, std::size_t scratch_bytes,
             cudaStream_t stream)
      : fn_(fn), stream_(stream) {
    const std::size_t index_bytes = (index_elements * sizeof(index_t) + 255) / 256 * 256;
    auto* base = static_cast<char*>(ws.reserve(fn, index_bytes + scratch_bytes, stream));
    next_index_ = reinterpret_cast<index_t*>(base);
    scratch_ = base + index_bytes;
  }

  /// A device copy of a host view (any stride), or an empty view for an empty one. The host
  /// values are read before this returns (cudaMemcpyAsync from pageable memory stages them), so
  /// they need not outlive the call.
  TensorView<const index_t, 1> stage(const TensorView<const index_t, 1>& host) {
    if (host.empty()) return {};
    const index_t n = host.shape[0];
    gathered_.resize(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) gathered_[static_cast<std::size_t>(i)] = host(i);
    check(fn_, "cudaMemcpyAsync",
          cudaMemcpyAsync(next_index_, gathered_.data(), n * sizeof(index_t),
                          cudaMemcpyHostToDevice, stream_));
    const TensorView<const index_t, 1> device =
        view<1>(static_cast<const index_t*>(next_index_), {n});
    next_index_ += n;
    return device;
  }
  void* scratch() const { return scratch_; }

 private:
  const char* fn_;
  cudaStream_t stream_;
  std::vector<index_t> gathered_;
  index_t* next_index_ = nullptr;
  char* scratch_ = nullptr;
};

/// The mask's per-sequence lengths, staged to the device.
inline void stage_lengths(CallMemory& mem, detail::MaskParams& mask) {
  mask.query_lengths = mem.stage(mask.query_lengths);
  mask.key_lengths = mem.stage(mask.key_lengths);
}

inline index_t length_elements(const detail::MaskParams& mask) {
  return (mask.query_lengths.empty() ? 0 : mask.query_lengths.shape[0]) +
         (mask.key_lengths.empty() ? 0 : mask.key_lengths.shape[0]);
}

}  // namespace detail_cuda

/// The plan's options with the current device's limits (unless the caller set them).
inline LaunchOptions with_device(const char* fn, LaunchOptions opt) {
  if (!opt.device_given) opt.device = current_device_limits(fn);
  return opt;
}

/// One of the forward's launches (for_each_launch), with warps of kRowTiles 16-row tiles,
/// Compose compiled in or not.
template <class T, int kHeadDim, int kRowTiles, bool kComposes>
void run_forward_launch(const char* fn, const detail::ForwardParams<T>& p, const ForwardLaunch& l,
                        const KeySplit& split, Kernel kernel, cudaStream_t stream) {
  if (kernel == Kernel::combine_split_statistics) {
    launch(fn, combine_statistics_kernel<T>, l.per_head, stream, p, split);
    return;
  }
  if (kernel == Kernel::sum_split_outputs) {
    launch(fn, sum_splits_kernel<T>, l.per_head, stream, p, split);
    return;
  }
  const ForwardPhase phase = phase_of(kernel);
  auto* blocks_kernel = forward_kernel<T, kHeadDim, kRowTiles, false, kComposes>;
  if constexpr (kComposes)
    if (runs_kept_scores(l, kernel)) blocks_kernel = forward_kernel<T, kHeadDim, 1, true>;
  launch(fn, blocks_kernel, l.blocks, stream, p, l.phase(phase), split);
}

/// The forward's kernels of one head-dim class on a planned, staged call: one launch, or a split
/// forward's four. A function of its own per (T, kHeadDim), so that a project can compile each
/// class in a translation unit of its own (tests/cuda/ does).
template <class T, int kHeadDim>
void run_forward_kernels(const char* fn, const detail::ForwardParams<T>& p, const ForwardLaunch& l,
                         const KeySplit& split, cudaStream_t stream) {
  dispatch_forward_warps<T, kHeadDim>(l.geo, [&](auto row_tiles, auto composes) {
    for_each_launch(l, [&](Kernel kernel, int) {
      run_forward_launch<T, kHeadDim, decltype(row_tiles)::value, decltype(composes)::value>(
          fn, p, l, split, kernel, stream);
    });
  });
}

/// One of the backward's launches (for_each_launch), its kernels of head-dim class kHeadDim.
template <class T, int kHeadDim>
void run_backward_launch(const char* fn, const detail::BackwardParams<T>& p,
                         const BackwardLaunch& l, const BackwardScratch& scratch, Kernel kernel,
                         int round, cudaStream_t stream) {
  switch (kernel) {
    case Kernel::backward_row_dots:
      launch(fn, row_dots_kernel<T>, l.row_passes, stream, p, scratch);
      return;
    case Kernel::backward_one_pass:
      if constexpr (kOnePassHeadDim<T, kHeadDim>)
        launch(fn, mha_backward_kernel<T, kHeadDim>, l.key_blocks, stream, p,
               l.round_geometry(round), scratch);
      return;
    case Kernel::backward_query_grads:
      launch(fn, query_grads_kernel<T>, l.row_passes, stream, p, scratch);
      return;
    case Kernel::backward_query:
      launch(fn, query_grad_kernel<T, kHeadDim>, l.query_blocks, stream, p, l.query, scratch);
      return;
    case Kernel::backward_key:
      launch(fn, key_grad_kernel<T, kHeadDim>, l.key_blocks, stream, p, l.key, scratch);
      return;
    case Kernel::sum_static_grads:
      launch(fn, static_grad_kernel<T>, l.static_sums, stream, p, l.query.rows, scratch);
      return;
    case Kernel::sum_head_grads:
      launch(fn, head_grad_kernel<T>, l.head_sums, stream, p, scratch);
      return;
    default:
      return;
  }
}

/// The backward's kernels of one head-dim class on a planned, staged call, every launch of it
/// (a function per (T, kHeadDim), as run_forward_kernels).
template <class T, int kHeadDim>
void run_backward_kernels(const char* fn, const detail::BackwardParams<T>& p,
                          const BackwardLaunch& l, const BackwardScratch& scratch,
                          cudaStream_t stream) {
  for_each_launch(l, backward_scratch_sizes(p.dims, l), [&](Kernel kernel, int round) {
    run_backward_launch<T, kHeadDim>(fn, p, l, scratch, kernel, round, stream);
  });
}

/// The backend seam (cpu::forward's twin): runs a validated call's ForwardParams, whose views
/// are device memory except the per-sequence lengths and ring starts (host memory, staged here).
/// `fn` names the entry point in errors.
template <class T>
void launch_forward(const char* fn, detail::ForwardParams<T> p, DeviceWorkspace& ws,
                    cudaStream_t stream, const LaunchOptions& opt) {
  const ForwardLaunch l = forward_launch(fn, p, with_device(fn, opt));
  const index_t ring = p.keys.capacity ? p.dims.B : 0;
  detail_cuda::CallMemory mem(fn, ws, detail_cuda::length_elements(p.mask) + ring,
                              l.scratch_elements(p.dims) * sizeof(float), stream);
  detail_cuda::stage_lengths(mem, p.mask);
  if (ring) p.keys.start = mem.stage(p.keys.start);
  const KeySplit split = l.carve(static_cast<float*>(mem.scratch()), p.dims);
  dispatch_head_dim(l.head_dim, [&](auto head_dim) {
    run_forward_kernels<T, decltype(head_dim)::value>(fn, p, l, split, stream);
    return 0;
  });
}

/// cpu::backward's twin: its launches (for_each_launch) in one stream.
template <class T>
void launch_backward(const char* fn, detail::BackwardParams<T> p, DeviceWorkspace& ws,
                     cudaStream_t stream, const LaunchOptions& opt) {
  const BackwardLaunch l = backward_launch(fn, p, with_device(fn, opt));
  const BackwardScratchSizes sizes = backward_scratch_sizes(p.dims, l);
  detail_cuda::CallMemory mem(fn, ws, detail_cuda::length_elements(p.mask),
                              sizes.total() * sizeof(float), stream);
  detail_cuda::stage_lengths(mem, p.mask);
  const BackwardScratch scratch = carve_scratch(static_cast<float*>(mem.scratch()), sizes);
  if (sizes.static_partials > 0)
    check(
        fn, "cudaMemsetAsync",
        cudaMemsetAsync(scratch.static_partials, 0, sizes.static_partials * sizeof(float), stream));
  dispatch_head_dim(l.head_dim, [&](auto head_dim) {
    run_backward_kernels<T, decltype(head_dim)::value>(fn, p, l, scratch, stream);
    return 0;
  });
}

// The entry points of one storage type. Each is a template over nothing but an unused int, its
// parameter types fixed (implicit conversions, as to const views, work as for a function): only
// a call instantiates its kernels, so a .cu file compiles the storage types it calls, not all
// three (each is minutes of nvcc per head-dim class and architecture).
#define DCMHA_DEFINE_CUDA_ENTRY_POINTS(T)                                                         \
  template <int = 0>                                                                              \
  void forward(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,    \
               TensorView<const T, 4> v, TensorView<T, 4> out, TensorView<acc_t<T>, 3> lse,       \
               const ComposeWeights<T>& compose, DeviceWorkspace& workspace,                      \
               cudaStream_t stream = 0, const LaunchOptions& launch = {}) {                       \
    const char* fn = "dcmha::cuda::forward";                                                      \
    launch_forward(fn, detail::forward_params(fn, cfg, q, k, v, out, lse, compose), workspace,    \
                   stream, launch);                                                               \
  }                                                                                               \
  template <int = 0>                                                                              \
  void backward(const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,   \
                TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,                      \
                TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk,            \
                TensorView<T, 4> dv, const ComposeWeights<T>& compose,                            \
                const ComposeGrads<T>& dcompose, DeviceWorkspace& workspace,                      \
                cudaStream_t stream = 0, const LaunchOptions& launch = {}) {                      \
    const char* fn = "dcmha::cuda::backward";                                                     \
    launch_backward(                                                                              \
        fn, detail::backward_params(fn, cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose),  \
        workspace, stream, launch);                                                               \
  }                                                                                               \
  template <int = 0>                                                                              \
  void backward(                                                                                  \
      const AttentionConfig& cfg, TensorView<const T, 4> q, TensorView<const T, 4> k,             \
      TensorView<const T, 4> v, TensorView<const T, 4> out, TensorView<const acc_t<T>, 3> lse,    \
      TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk, TensorView<T, 4> dv, \
      const ComposeWeights<T>& compose, const ComposeGrads<T>& dcompose,                          \
      DeviceWorkspace& workspace, cudaStream_t stream = 0, const LaunchOptions& launch = {}) {    \
    const char* fn = "dcmha::cuda::backward";                                                     \
    launch_backward(                                                                              \
        fn,                                                                                       \
        detail::backward_params(fn, cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, out), \
        workspace, stream, launch);                                                               \
  }

DCMHA_DEFINE_CUDA_ENTRY_POINTS(float)
DCMHA_DEFINE_CUDA_ENTRY_POINTS(bf16)
DCMHA_DEFINE_CUDA_ENTRY_POINTS(half)
#undef DCMHA_DEFINE_CUDA_ENTRY_POINTS

}  // namespace dcmha::cuda

#pragma once
// The CUDA runtime side of the backend: errors, the device's limits, the device workspace, and
// kernel launches (clusters included). nvcc only (include it from .cu files).
#if !defined(__CUDACC__)
#error "dcmha/cuda/runtime.hpp needs nvcc: include the CUDA backend from a .cu file"
#endif
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "../error.hpp"
#include "backward_kernel.hpp"
#include "mha_backward_kernel.hpp"
#include "forward_kernel.hpp"
#include "launch_plan.hpp"

namespace dcmha::cuda {

/// Throws dcmha::Error naming the entry point, the CUDA call and CUDA's message.
inline void check(const char* fn, const char* call, cudaError_t status) {
  if (status != cudaSuccess)
    detail::fail(fn, ": ", call, " failed: ", cudaGetErrorName(status), " (",
                 cudaGetErrorString(status), ")");
}

/// The current device's limits for the launch plan: its opt-in shared memory per block, whether
/// it has thread-block clusters (sm_90 and newer: up to 8 blocks, the portable size), and its
/// multiprocessors.
inline DeviceLimits current_device_limits(const char* fn) {
  int device = 0, major = 0, shared = 0, sms = 0;
  check(fn, "cudaGetDevice", cudaGetDevice(&device));
  check(fn, "cudaDeviceGetAttribute",
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  check(fn, "cudaDeviceGetAttribute",
        cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  check(fn, "cudaDeviceGetAttribute",
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  DeviceLimits l;
  l.shared_bytes = shared;
  l.max_cluster = major >= 9 ? 8 : 1;
  l.multiprocessors = sms;
  return l;
}

/// Device memory the kernels work in, kept between calls (the device twin of Workspace): the
/// backward's D, W partials and per-head dK / dV, a split forward's partials, the per-sequence
/// lengths. It grows to the largest call's needs on the device that was current when it grew;
/// bytes() tells, release() frees. One call at a time: concurrent streams keep one each.
class DeviceWorkspace {
 public:
  DeviceWorkspace() = default;
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;
  ~DeviceWorkspace() { release(); }

  std::size_t bytes() const { return bytes_; }
  void release() {
    if (data_) cudaFree(data_);  // no throw from a destructor; a failure here is a lost device
    data_ = nullptr;
    bytes_ = 0;
  }

  /// At least n bytes, 256-byte aligned. The stream is synchronized before old memory is freed,
  /// so a previous call's kernels never see their scratch disappear.
  void* reserve(const char* fn, std::size_t n, cudaStream_t stream) {
    if (n <= bytes_) return data_;
    check(fn, "cudaStreamSynchronize", cudaStreamSynchronize(stream));
    release();
    check(fn, "cudaMalloc", cudaMalloc(&data_, n));
    bytes_ = n;
    return data_;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// Every kernel runs at most 8 warps a block (the plans keep to it), so each thread may take
/// up to 255 registers.
constexpr int kMaxThreads = 256;

template <class T, int kHeadDim, int kRowTiles, bool kKeptScores = false,
          bool kComposes = kRowTiles == 1>
__global__ void __launch_bounds__(kMaxThreads, 1)
    forward_kernel(const __grid_constant__ detail::ForwardParams<T> p,
                   const __grid_constant__ ForwardGeometry geo, const KeySplit split) {
  const DeviceBlock blk;
  ForwardKernel<T, kHeadDim, DeviceBlock, kRowTiles, kKeptScores, kComposes>(blk, p, geo, split)
      .run();
}

template <class T>
__global__ void __launch_bounds__(kMaxThreads, 1)
    combine_statistics_kernel(const __grid_constant__ detail::ForwardParams<T> p,
                              const KeySplit split) {
  combine_split_statistics(DeviceBlock{}, p, split);
}

template <class T>
__global__ void __launch_bounds__(kMaxThreads, 1)
    sum_splits_kernel(const __grid_constant__ detail::ForwardParams<T> p, const KeySplit split) {
  sum_split_outputs(DeviceBlock{}, p, split);
}

template <class T, int kHeadDim>
__global__ void __launch_bounds__(kMaxThreads, 1)
    query_grad_kernel(const __grid_constant__ detail::BackwardParams<T> p,
                      const __grid_constant__ BackwardGeometry geo,
                      const __grid_constant__ BackwardScratch scratch) {
  const DeviceBlock blk;
  QueryGradKernel<T, kHeadDim, DeviceBlock>(blk, p, geo, scratch).run();
}

template <class T, int kHeadDim>
__global__ void __launch_bounds__(kMaxThreads, 1)
    key_grad_kernel(const __grid_constant__ detail::BackwardParams<T> p,
                    const __grid_constant__ BackwardGeometry geo,
                    const __grid_constant__ BackwardScratch scratch) {
  const DeviceBlock blk;
  KeyGradKernel<T, kHeadDim, DeviceBlock>(blk, p, geo, scratch).run();
}

template <class T, int kHeadDim>
__global__ void __launch_bounds__(kMaxThreads, 1)
    mha_backward_kernel(const __grid_constant__ detail::BackwardParams<T> p,
                        const __grid_constant__ BackwardGeometry geo,
                        const __grid_constant__ BackwardScratch scratch) {
  const DeviceBlock blk;
  MhaBackwardKernel<T, kHeadDim, DeviceBlock>(blk, p, geo, scratch).run();
}

template <class T>
__global__ void __launch_bounds__(kMaxThreads, 1)
    row_dots_kernel(const __grid_constant__ detail::BackwardParams<T> p,
                    const BackwardScratch scratch) {
  sum_row_dots(DeviceBlock{}, p, scratch);
}

template <class T>
__global__ void __launch_bounds__(kMaxThreads, 1)
    query_grads_kernel(const __grid_constant__ detail::BackwardParams<T> p,
                       const BackwardScratch scratch) {
  store_query_grads(DeviceBlock{}, p, scratch);
}

template <class T>
__global__ void __launch_bounds__(kMaxThreads, 1)
    static_grad_kernel(const __grid_constant__ detail::BackwardParams<T> p, const int rows,
                       const BackwardScratch scratch) {
  sum_static_grads(DeviceBlock{}, p, rows, scratch);
}

template <class T>
__global__ void __launch_bounds__(kMaxThreads, 1)
    head_grad_kernel(const __grid_constant__ detail::BackwardParams<T> p,
                     const BackwardScratch scratch) {
  sum_head_grads(DeviceBlock{}, p, scratch);
}

/// kernel<<<grid, threads, shared, stream>>>(args...) with the launch's cluster, the
/// shared-memory opt-in above the default 48 KiB, and the launch's error checked.
template <class... Params, class... Args>
void launch(const char* fn, void (*kernel)(Params...), const KernelLaunch& l, cudaStream_t stream,
            Args&&... args) {
  const emulator::LaunchShape& s = l.shape;
  if (s.x < 1 || s.y < 1 || s.z < 1) return;
  if (s.y > 65535 || s.z > 65535 || s.x > 2147483647)
    detail::fail(fn, ": grid (", s.x, ", ", s.y, ", ", s.z,
                 ") exceeds CUDA's limits (2^31 - 1, 65535, 65535)");
  const int shared = static_cast<int>(s.shared_bytes);
  if (shared > 48 * 1024)
    check(fn, "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)",
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  cudaLaunchConfig_t config = {};
  config.gridDim =
      dim3(static_cast<unsigned>(s.x), static_cast<unsigned>(s.y), static_cast<unsigned>(s.z));
  config.blockDim = dim3(static_cast<unsigned>(s.threads));
  config.dynamicSmemBytes = static_cast<std::size_t>(shared);
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  if (s.cluster > 1) {
    cluster[0].id = cudaLaunchAttributeClusterDimension;
    cluster[0].val.clusterDim.x = static_cast<unsigned>(s.cluster);
    cluster[0].val.clusterDim.y = 1;
    cluster[0].val.clusterDim.z = 1;
    config.attrs = cluster;
    config.numAttrs = 1;
  }
  check(fn, "cudaLaunchKernelEx", cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
  check(fn, "kernel launch", cudaGetLastError());
}

}  // namespace dcmha::cuda

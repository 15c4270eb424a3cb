#pragma once
// The CUDA runtime side of the backend: errors, the device workspace, and kernel launches. nvcc
// only (include it from .cu files).
#if !defined(__CUDACC__)
#error "dcmha/cuda/runtime.hpp needs nvcc: include the CUDA backend from a .cu file"
#endif
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "../error.hpp"
#include "launch_plan.hpp"

namespace dcmha::cuda {

/// Throws dcmha::Error naming the entry point, the CUDA call and CUDA's message.
inline void check(const char* fn, const char* call, cudaError_t status) {
  if (status != cudaSuccess)
    detail::fail(fn, ": ", call, " failed: ", cudaGetErrorName(status), " (",
                 cudaGetErrorString(status), ")");
}

/// Device memory the kernels work in, kept between calls (the device twin of Workspace): the
/// backward's D, dK/dV accumulators and W partials, and the per-sequence lengths. It grows to
/// the largest call's needs on the device that was current when it grew; bytes() tells,
/// release() frees. One call at a time: concurrent streams keep one each.
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

template <class T>
__global__ void forward_kernel(const detail::ForwardParams<T> p, const TileGeometry geo) {
  const DeviceBlock blk;
  ForwardKernel<T, DeviceBlock>(blk, p, geo).run();
}

template <class T>
__global__ void split_statistics_kernel(const detail::ForwardParams<T> p, const TileGeometry geo,
                                        const KeySplit<acc_t<T>> split) {
  const DeviceBlock blk;
  ForwardKernel<T, DeviceBlock>(blk, p, geo, split).run_split_statistics();
}

template <class T>
__global__ void combine_statistics_kernel(const detail::ForwardParams<T> p,
                                          const KeySplit<acc_t<T>> split) {
  combine_split_statistics(DeviceBlock{}, p, split);
}

template <class T>
__global__ void split_values_kernel(const detail::ForwardParams<T> p, const TileGeometry geo,
                                    const KeySplit<acc_t<T>> split) {
  const DeviceBlock blk;
  ForwardKernel<T, DeviceBlock>(blk, p, geo, split).run_split_values();
}

template <class T>
__global__ void sum_splits_kernel(const detail::ForwardParams<T> p,
                                  const KeySplit<acc_t<T>> split) {
  sum_split_outputs(DeviceBlock{}, p, split);
}

template <class T>
__global__ void query_grad_kernel(const detail::BackwardParams<T> p, const TileGeometry geo,
                                  const BackwardScratch<acc_t<T>> scratch) {
  const DeviceBlock blk;
  QueryGradKernel<T, DeviceBlock>(blk, p, geo, scratch).run();
}

template <class T>
__global__ void key_grad_kernel(const detail::BackwardParams<T> p, const TileGeometry geo,
                                const BackwardScratch<acc_t<T>> scratch) {
  const DeviceBlock blk;
  KeyGradKernel<T, DeviceBlock>(blk, p, geo, scratch).run();
}

template <class T>
__global__ void static_grad_kernel(const detail::BackwardParams<T> p, const TileGeometry geo,
                                   const BackwardScratch<acc_t<T>> scratch) {
  sum_static_grads(DeviceBlock{}, p, geo, scratch);
}

/// kernel<<<grid, threads, shared, stream>>>(args...), with the shared-memory opt-in above the
/// default 48 KiB, and the launch's error checked.
template <class... Params, class... Args>
void launch(const char* fn, void (*kernel)(Params...), const KernelLaunch& l, cudaStream_t stream,
            Args&&... args) {
  if (l.grid.x < 1 || l.grid.y < 1 || l.grid.z < 1) return;
  if (l.grid.y > 65535 || l.grid.z > 65535 || l.grid.x > 2147483647)
    detail::fail(fn, ": grid (", l.grid.x, ", ", l.grid.y, ", ", l.grid.z,
                 ") exceeds CUDA's limits (2^31 - 1, 65535, 65535)");
  const int shared = static_cast<int>(l.shared_bytes);
  if (shared > 48 * 1024)
    check(fn, "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize)",
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  const dim3 grid(static_cast<unsigned>(l.grid.x), static_cast<unsigned>(l.grid.y),
                  static_cast<unsigned>(l.grid.z));
  kernel<<<grid, static_cast<unsigned>(l.threads), static_cast<std::size_t>(shared), stream>>>(
      std::forward<Args>(args)...);
  check(fn, "kernel launch", cudaGetLastError());
}

}  // namespace dcmha::cuda

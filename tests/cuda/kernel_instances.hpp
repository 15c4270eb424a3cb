#pragma once
// The CUDA backend's kernels compiled once for the tests and benchmarks, one translation unit
// per (storage type, head-dim class) (kernel_instance.cu, built by CMakeLists.txt for each) so
// that they compile in parallel: each .cu that includes this header declares them extern and
// links dcmha_cuda_test_kernels.
#include <dcmha/cuda/attention.hpp>
#include <dcmha/cuda/decode.hpp>

#define DCMHA_CUDA_CLASS_INSTANCES(PREFIX, T, D)                                                \
  PREFIX void dcmha::cuda::run_forward_kernels<T, D>(                                           \
      const char*, const dcmha::detail::ForwardParams<T>&, const dcmha::cuda::ForwardLaunch&,   \
      const dcmha::cuda::KeySplit&, cudaStream_t);                                              \
  PREFIX void dcmha::cuda::run_backward_kernels<T, D>(                                          \
      const char*, const dcmha::detail::BackwardParams<T>&, const dcmha::cuda::BackwardLaunch&, \
      const dcmha::cuda::BackwardScratch&, cudaStream_t);

#define DCMHA_CUDA_TYPE_INSTANCES(PREFIX, T)                                                 \
  DCMHA_CUDA_CLASS_INSTANCES(PREFIX, T, 32)                                                  \
  DCMHA_CUDA_CLASS_INSTANCES(PREFIX, T, 64)                                                  \
  DCMHA_CUDA_CLASS_INSTANCES(PREFIX, T, 96)                                                  \
  DCMHA_CUDA_CLASS_INSTANCES(PREFIX, T, 128)                                                 \
  DCMHA_CUDA_CLASS_INSTANCES(PREFIX, T, 256)                                                 \
  PREFIX void dcmha::cuda::launch_forward<T>(const char*, dcmha::detail::ForwardParams<T>,   \
                                             dcmha::cuda::DeviceWorkspace&, cudaStream_t,    \
                                             const dcmha::cuda::LaunchOptions&);             \
  PREFIX void dcmha::cuda::launch_backward<T>(const char*, dcmha::detail::BackwardParams<T>, \
                                              dcmha::cuda::DeviceWorkspace&, cudaStream_t,   \
                                              const dcmha::cuda::LaunchOptions&);

#ifndef DCMHA_CUDA_DEFINE_INSTANCES
DCMHA_CUDA_TYPE_INSTANCES(extern template, float)
DCMHA_CUDA_TYPE_INSTANCES(extern template, dcmha::bf16)
DCMHA_CUDA_TYPE_INSTANCES(extern template, dcmha::half)
#endif

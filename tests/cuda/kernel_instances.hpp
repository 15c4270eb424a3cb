#pragma once
// The CUDA backend's entry points compiled once (kernel_instances.cu) for every CUDA target of
// the build: each .cu that includes this header declares them extern and links
// dcmha_cuda_test_kernels, instead of compiling every kernel for every architecture again.
#include <dcmha/cuda/attention.hpp>
#include <dcmha/cuda/decode.hpp>

#define DCMHA_CUDA_ATTENTION_INSTANCES(PREFIX, T)                                            \
  PREFIX void dcmha::cuda::launch_forward<T>(const char*, dcmha::detail::ForwardParams<T>,   \
                                             dcmha::cuda::DeviceWorkspace&, cudaStream_t,    \
                                             const dcmha::cuda::LaunchOptions&);             \
  PREFIX void dcmha::cuda::launch_backward<T>(const char*, dcmha::detail::BackwardParams<T>, \
                                              dcmha::cuda::DeviceWorkspace&, cudaStream_t,   \
                                              const dcmha::cuda::LaunchOptions&);

#ifndef DCMHA_CUDA_DEFINE_INSTANCES
DCMHA_CUDA_ATTENTION_INSTANCES(extern template, float)
DCMHA_CUDA_ATTENTION_INSTANCES(extern template, dcmha::bf16)
#endif

#pragma once
// The CUDA backend's kernels compiled once for the tests and benchmarks, one translation unit
// per (storage type, head-dim class, direction) (kernel_instance.cu, built by CMakeLists.txt for
// each, through dcmha/cuda/instances.hpp as a project would) so that they compile in parallel;
// the entry points' dispatch and the kernels outside the classes in kernel_instances.cu. Each .cu
// that includes this header declares them extern and links dcmha_cuda_test_kernels. A class left
// out of DCMHA_CUDA_HEAD_DIMS is declared but never used: the entry points dispatch to the
// listed ones only.
#include <dcmha/cuda/instances.hpp>

#define DCMHA_CUDA_TEST_LAUNCHES(PREFIX, T)                                                  \
  PREFIX void dcmha::cuda::launch_forward<T>(const char*, dcmha::detail::ForwardParams<T>,   \
                                             dcmha::cuda::DeviceWorkspace&, cudaStream_t,    \
                                             const dcmha::cuda::LaunchOptions&);             \
  PREFIX void dcmha::cuda::launch_backward<T>(const char*, dcmha::detail::BackwardParams<T>, \
                                              dcmha::cuda::DeviceWorkspace&, cudaStream_t,   \
                                              const dcmha::cuda::LaunchOptions&);

DCMHA_CUDA_KERNELS_ELSEWHERE(float)
DCMHA_CUDA_KERNELS_ELSEWHERE(dcmha::bf16)
DCMHA_CUDA_KERNELS_ELSEWHERE(dcmha::half)
DCMHA_CUDA_TEST_LAUNCHES(extern template, float)
DCMHA_CUDA_TEST_LAUNCHES(extern template, dcmha::bf16)
DCMHA_CUDA_TEST_LAUNCHES(extern template, dcmha::half)

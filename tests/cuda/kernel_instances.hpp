#pragma once
// The CUDA backend's entry points compiled once (kernel_instances.cu) for every CUDA target of
// the build: each .cu that includes this header declares them extern and links
// dcmha_cuda_test_kernels, instead of compiling every kernel for every architecture again.
#include <dcmha/cuda/attention.hpp>
#include <dcmha/cuda/decode.hpp>

#define DCMHA_CUDA_ATTENTION_INSTANCES(PREFIX, T)                                                  \
  PREFIX void dcmha::cuda::detail_cuda::forward_impl<T>(                                           \
      const dcmha::AttentionConfig&, dcmha::TensorView<const T, 4>, dcmha::TensorView<const T, 4>, \
      dcmha::TensorView<const T, 4>, dcmha::TensorView<T, 4>,                                      \
      dcmha::TensorView<dcmha::acc_t<T>, 3>, const dcmha::ComposeWeights<T>&,                      \
      dcmha::cuda::DeviceWorkspace&, cudaStream_t, const dcmha::cuda::LaunchOptions&);             \
  PREFIX void dcmha::cuda::detail_cuda::backward_impl<T>(                                          \
      const dcmha::AttentionConfig&, dcmha::TensorView<const T, 4>, dcmha::TensorView<const T, 4>, \
      dcmha::TensorView<const T, 4>, dcmha::TensorView<const dcmha::acc_t<T>, 3>,                  \
      dcmha::TensorView<const T, 4>, dcmha::TensorView<T, 4>, dcmha::TensorView<T, 4>,             \
      dcmha::TensorView<T, 4>, const dcmha::ComposeWeights<T>&, const dcmha::ComposeGrads<T>&,     \
      dcmha::cuda::DeviceWorkspace&, cudaStream_t, const dcmha::cuda::LaunchOptions&);             \
  PREFIX void dcmha::cuda::detail_cuda::decode_impl<T>(                                            \
      const dcmha::AttentionConfig&, dcmha::TensorView<const T, 4>,                                \
      const dcmha::cuda::DecodeCache<T>&, const dcmha::ComposeWeights<T>&,                         \
      dcmha::TensorView<T, 4>, dcmha::cuda::DeviceWorkspace&, cudaStream_t,                        \
      const dcmha::cuda::LaunchOptions&);

#ifndef DCMHA_CUDA_DEFINE_INSTANCES
DCMHA_CUDA_ATTENTION_INSTANCES(extern template, float)
DCMHA_CUDA_ATTENTION_INSTANCES(extern template, dcmha::bf16)
#endif

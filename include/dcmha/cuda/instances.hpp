#pragma once
// The CUDA kernels compiled in translation units of their own, side by side. A .cu file that
// calls the entry points compiles every head-dim class of each call it makes (storage type and
// direction), minutes of nvcc each per architecture, all in that one unit. A project with the
// cores for it can give each (type, class, direction) a unit:
//
//   // kernels_bf16_128_forward.cu: one unit's kernels
//   #include <dcmha/cuda/instances.hpp>
//   DCMHA_CUDA_INSTANTIATE_FORWARD(dcmha::bf16, 128)
//
//   // my_layer.cu: the calls, with every class of the type declared compiled elsewhere
//   #include <dcmha/cuda/instances.hpp>
//   DCMHA_CUDA_KERNELS_ELSEWHERE(dcmha::bf16)
//   ... dcmha::cuda::forward(cfg, q, k, v, out, lse, compose, workspace, stream);
//
// Every unit must see the same DCMHA_CUDA_HEAD_DIMS (launch_plan.hpp); a class that a call
// reaches but no unit instantiates fails to link.
#include "attention.hpp"
#include "decode.hpp"

#define DCMHA_CUDA_DETAIL_FORWARD_KERNELS(PREFIX, T, D)                                       \
  PREFIX void dcmha::cuda::run_forward_kernels<T, D>(                                         \
      const char*, const dcmha::detail::ForwardParams<T>&, const dcmha::cuda::ForwardLaunch&, \
      const dcmha::cuda::KeySplit&, cudaStream_t);
#define DCMHA_CUDA_DETAIL_BACKWARD_KERNELS(PREFIX, T, D)                                        \
  PREFIX void dcmha::cuda::run_backward_kernels<T, D>(                                          \
      const char*, const dcmha::detail::BackwardParams<T>&, const dcmha::cuda::BackwardLaunch&, \
      const dcmha::cuda::BackwardScratch&, cudaStream_t);
#define DCMHA_CUDA_DETAIL_CLASS_ELSEWHERE(T, D)            \
  DCMHA_CUDA_DETAIL_FORWARD_KERNELS(extern template, T, D) \
  DCMHA_CUDA_DETAIL_BACKWARD_KERNELS(extern template, T, D)

/// The forward's (decode's) kernels of storage type T and head-dim class D, in this unit.
#define DCMHA_CUDA_INSTANTIATE_FORWARD(T, D) DCMHA_CUDA_DETAIL_FORWARD_KERNELS(template, T, D)
/// The backward's kernels of storage type T and head-dim class D, in this unit.
#define DCMHA_CUDA_INSTANTIATE_BACKWARD(T, D) DCMHA_CUDA_DETAIL_BACKWARD_KERNELS(template, T, D)
/// Every class's kernels of storage type T, both directions, compiled in other units.
#define DCMHA_CUDA_KERNELS_ELSEWHERE(T)     \
  DCMHA_CUDA_DETAIL_CLASS_ELSEWHERE(T, 32)  \
  DCMHA_CUDA_DETAIL_CLASS_ELSEWHERE(T, 64)  \
  DCMHA_CUDA_DETAIL_CLASS_ELSEWHERE(T, 96)  \
  DCMHA_CUDA_DETAIL_CLASS_ELSEWHERE(T, 128) \
  DCMHA_CUDA_DETAIL_CLASS_ELSEWHERE(T, 256)

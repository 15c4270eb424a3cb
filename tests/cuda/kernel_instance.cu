// The kernels of one storage type and head-dim class, DCMHA_INSTANCE_TYPE and
// DCMHA_INSTANCE_HEAD_DIM (CMakeLists.txt compiles this file once for each).
#include "kernel_instances.hpp"

#if !defined(DCMHA_INSTANCE_TYPE) || !defined(DCMHA_INSTANCE_HEAD_DIM)
#error "kernel_instance.cu: define DCMHA_INSTANCE_TYPE and DCMHA_INSTANCE_HEAD_DIM"
#endif

template void dcmha::cuda::run_forward_kernels<DCMHA_INSTANCE_TYPE, DCMHA_INSTANCE_HEAD_DIM>(
    const char*, const dcmha::detail::ForwardParams<DCMHA_INSTANCE_TYPE>&,
    const dcmha::cuda::ForwardLaunch&, const dcmha::cuda::KeySplit&, cudaStream_t);
template void dcmha::cuda::run_backward_kernels<DCMHA_INSTANCE_TYPE, DCMHA_INSTANCE_HEAD_DIM>(
    const char*, const dcmha::detail::BackwardParams<DCMHA_INSTANCE_TYPE>&,
    const dcmha::cuda::BackwardLaunch&, const dcmha::cuda::BackwardScratch&, cudaStream_t);

// The kernels of one storage type, head-dim class and direction: DCMHA_INSTANCE_TYPE,
// DCMHA_INSTANCE_HEAD_DIM and DCMHA_INSTANCE_forward, DCMHA_INSTANCE_backward or
// DCMHA_INSTANCE_forward_backward (CMakeLists.txt compiles this file once for each).
#include "kernel_instances.hpp"

#if defined(DCMHA_INSTANCE_forward_backward)
#define DCMHA_INSTANCE_forward
#define DCMHA_INSTANCE_backward
#endif
#if !defined(DCMHA_INSTANCE_TYPE) || !defined(DCMHA_INSTANCE_HEAD_DIM) || \
    !(defined(DCMHA_INSTANCE_forward) || defined(DCMHA_INSTANCE_backward))
#error "kernel_instance.cu: define DCMHA_INSTANCE_TYPE, DCMHA_INSTANCE_HEAD_DIM and a direction"
#endif

#if defined(DCMHA_INSTANCE_forward)
DCMHA_CUDA_INSTANTIATE_FORWARD(DCMHA_INSTANCE_TYPE, DCMHA_INSTANCE_HEAD_DIM)
#endif
#if defined(DCMHA_INSTANCE_backward)
DCMHA_CUDA_INSTANTIATE_BACKWARD(DCMHA_INSTANCE_TYPE, DCMHA_INSTANCE_HEAD_DIM)
#endif

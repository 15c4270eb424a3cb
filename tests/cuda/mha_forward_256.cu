// The MHA forward at head dim 256 (16-row warps, compiled without Compose), which the class-256
// kernel units compile unoptimized under DCMHA_CUDA_COMPILE_CHECK: here alone and optimized,
// for its ptxas test (CMakeLists.txt), as the class runs it for bf16 and fp16.
#include <dcmha/cuda/runtime.hpp>

void* mha_forward_256_kernels[] = {
    reinterpret_cast<void*>(&dcmha::cuda::forward_kernel<dcmha::bf16, 256, 1, false, false>),
    reinterpret_cast<void*>(&dcmha::cuda::forward_kernel<dcmha::half, 256, 1, false, false>),
};

// The entry points' dispatch over head-dim classes, and the kernels outside the classes; the
// classes' kernels come from the kernel_instance.cu translation units.
#include "kernel_instances.hpp"

DCMHA_CUDA_TEST_LAUNCHES(template, float)
DCMHA_CUDA_TEST_LAUNCHES(template, dcmha::bf16)
DCMHA_CUDA_TEST_LAUNCHES(template, dcmha::half)

// The definitions kernel_instances.hpp declares.
#define DCMHA_CUDA_DEFINE_INSTANCES
#include "kernel_instances.hpp"

DCMHA_CUDA_ATTENTION_INSTANCES(template, float)
DCMHA_CUDA_ATTENTION_INSTANCES(template, dcmha::bf16)

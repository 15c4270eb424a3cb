// The bf16 instances of the CPU calls (one scalar type per translation unit: they compile in
// parallel).
#include "call_impl.hpp"

namespace dcmha_torch {
DCMHA_TORCH_INSTANTIATE(dcmha::bf16)
}  // namespace dcmha_torch

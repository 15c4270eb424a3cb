// The fp16 instances of the CPU calls (one scalar type per translation unit: they compile in
// parallel).
#include "call_impl.hpp"

namespace dcmha_torch {
DCMHA_TORCH_INSTANTIATE(dcmha::half)
}  // namespace dcmha_torch

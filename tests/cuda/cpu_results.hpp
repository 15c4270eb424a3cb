#pragma once
// The CPU kernels' forward + backward of a problem, compiled apart by the C++ compiler (with
// OpenMP), so that the GPU test compares against them without building them through nvcc.
#include <cstdint>
#include <vector>

#include "reference/reference.hpp"

namespace dcmha::test {

/// Every result (out, lse, gradients, in TypedProblem's order) of the bf16 CPU kernels on p with
/// upstream gradient dout; per-sequence lengths when the vectors are not empty.
std::vector<double> cpu_results_bf16(const reference::Problem& p, const std::vector<double>& dout,
                                     const std::vector<int64_t>& query_lengths,
                                     const std::vector<int64_t>& key_lengths);

}  // namespace dcmha::test

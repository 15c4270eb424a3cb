#pragma once
// The CUDA kernels' emulated launches (dcmha/cuda/emulate.hpp) compiled once for the test build
// instead of once per file: the emulated tests and the cost model include this header, whose
// explicit instantiation declarations keep each file from instantiating the launches, and link
// dcmha_emulated_kernels, which defines them (kernels/emulated_launches.cpp.in), one translation
// unit per storage type and direction so that they compile in parallel.
#include <dcmha/cuda/emulate.hpp>

#define DCMHA_TEST_EMULATED_FORWARD(PREFIX, T)                                             \
  PREFIX void dcmha::cuda::emulate::run_forward<T>(const dcmha::detail::ForwardParams<T>&, \
                                                   const dcmha::cuda::ForwardLaunch&);
#define DCMHA_TEST_EMULATED_BACKWARD(PREFIX, T)                                              \
  PREFIX void dcmha::cuda::emulate::run_backward<T>(const dcmha::detail::BackwardParams<T>&, \
                                                    const dcmha::cuda::BackwardLaunch&);

DCMHA_TEST_EMULATED_FORWARD(extern template, float)
DCMHA_TEST_EMULATED_FORWARD(extern template, dcmha::bf16)
DCMHA_TEST_EMULATED_BACKWARD(extern template, float)
DCMHA_TEST_EMULATED_BACKWARD(extern template, dcmha::bf16)
// dcmha::test::EmulatedHalf, the storage type of the emulated suite's fp16 cases: fp16, but in a
// sanitized build, which compiles no fp16 launches (tests/CMakeLists.txt) and runs them in bf16.
#if !defined(DCMHA_TEST_EMULATED_HALF) || DCMHA_TEST_EMULATED_HALF
DCMHA_TEST_EMULATED_FORWARD(extern template, dcmha::half)
DCMHA_TEST_EMULATED_BACKWARD(extern template, dcmha::half)
namespace dcmha::test {
using EmulatedHalf = dcmha::half;
}
#else
namespace dcmha::test {
using EmulatedHalf = dcmha::bf16;
}
#endif

// The CUDA kernels compiled for some head-dim classes only (DCMHA_CUDA_HEAD_DIMS, set for this
// test by tests/CMakeLists.txt to 64 and 128): a smaller head dim runs in the smallest compiled
// class holding it, with the reference's results, and one past the largest is refused with the
// classes named. Run by the emulator, as test_cuda_kernels is.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <dcmha/cuda/emulate.hpp>

#include "reference/reference.hpp"
#include "support/problem.hpp"

namespace {

using dcmha::test::ProblemSpec;
using dcmha::test::TypedProblem;

constexpr double kFloatTolerance = 2e-4;  // test_cuda_kernels' bound for float storage

ProblemSpec spec_of(int64_t D, int64_t Dv) {
  ProblemSpec s;
  s.B = 1, s.H = 4, s.Hk = 2, s.G = 2, s.T = 21, s.S = 37, s.D = D, s.Dv = Dv, s.causal = true;
  return s;
}

TEST(CudaHeadDims, OnlyTheListedClassesAreCompiled) {
  static_assert(sizeof(dcmha::cuda::kHeadDims) == 2 * sizeof(int));
  EXPECT_EQ(dcmha::cuda::head_dim_class("f", 5, 32), 64);
  EXPECT_EQ(dcmha::cuda::head_dim_class("f", 65, 64), 128);
  EXPECT_EQ(dcmha::cuda::head_dim_class("f", 128, 96), 128);
}

TEST(CudaHeadDims, SmallHeadDimsRunInTheNextCompiledClass) {
  for (const auto& [D, Dv] : {std::pair<int64_t, int64_t>{24, 32}, {80, 72}}) {
    SCOPED_TRACE("D=" + std::to_string(D) + " Dv=" + std::to_string(Dv));
    const dcmha::reference::Problem p = dcmha::test::random_problem(spec_of(D, Dv), 900 + D);
    const std::vector<double> dout = dcmha::test::random_dout(p, 901 + D);
    const auto [expected_out, expected] = dcmha::reference::forward_and_backward(p, dout);
    TypedProblem<float> tp(p);
    tp.set_dout(dout);
    dcmha::cuda::emulate::forward<float>(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(),
                                         tp.compose());
    EXPECT_LE(dcmha::test::max_rel_error(expected_out, tp.out_values()), kFloatTolerance);
    dcmha::cuda::emulate::backward<float>(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(),
                                          tp.dq(), tp.dk(), tp.dv(), tp.compose(), tp.dcompose(),
                                          {}, tp.out());
    for (const auto& e : dcmha::test::gradient_errors(expected, tp.gradients()))
      EXPECT_LE(e.rel, kFloatTolerance) << e.name;
  }
}

TEST(CudaHeadDims, HeadDimsPastTheLargestClassAreRefused) {
  const dcmha::reference::Problem p = dcmha::test::random_problem(spec_of(129, 64), 910);
  TypedProblem<float> tp(p);
  std::string message;
  try {
    dcmha::cuda::emulate::forward<float>(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(),
                                         tp.compose());
  } catch (const dcmha::Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("dcmha::cuda::emulate::forward: head dim 129 (max of D and Dv): "
                         "expected at most 128 (the head-dim classes compiled: 64,128)"),
            std::string::npos)
      << message;
}

}  // namespace

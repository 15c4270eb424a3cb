// The CUDA backend on a GPU: forward and backward on device memory against the test reference
// (float and bf16 storage, every compose switch, masks, windows, lengths, GQA, tile shapes),
// decode steps through a device DecodeCache, bitwise from run to run, and the errors.
// Without a CUDA device the program reports itself skipped (exit code 77, CTest's
// SKIP_RETURN_CODE for this test).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <dcmha/cuda/decode.hpp>

#include "cuda/kernel_instances.hpp"
#include "reference/reference.hpp"
#include "support/backend_cases.hpp"
#include "support/decode_steps.hpp"
#include "support/problem.hpp"

namespace {

using dcmha::index_t;
using dcmha::TensorView;
using dcmha::cuda::LaunchOptions;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;
using Case = dcmha::test::BackendCase;
using dcmha::test::tiled_spec;
using dcmha::test::with_launch;

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

/// Device copies of host views, same shape and strides; freed with the mirror.
class DeviceMirror {
 public:
  DeviceMirror() = default;
  DeviceMirror(const DeviceMirror&) = delete;
  DeviceMirror& operator=(const DeviceMirror&) = delete;
  ~DeviceMirror() {
    for (void* p : allocations_) cudaFree(p);
  }

  template <class U, int N>
  TensorView<U, N> of(const TensorView<U, N>& host) {
    if (host.empty()) return {};
    using Mutable = std::remove_const_t<U>;
    const std::size_t bytes = extent(host) * sizeof(U);
    void* device = nullptr;
    check_cuda(cudaMalloc(&device, bytes), "cudaMalloc");
    allocations_.push_back(device);
    check_cuda(cudaMemcpy(device, host.data, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    return {static_cast<Mutable*>(device), host.shape, host.stride};
  }

  template <class U, int N>
  static void copy_back(const TensorView<U, N>& device, const TensorView<U, N>& host) {
    if (host.empty()) return;
    check_cuda(cudaMemcpy(host.data, device.data, extent(host) * sizeof(U), cudaMemcpyDeviceToHost),
               "cudaMemcpy");
  }

  template <class T>
  dcmha::ComposeTerms<T> of(const dcmha::ComposeTerms<T>& c) {
    dcmha::ComposeTerms<T> d = c;
    d.w = of(c.w), d.qw1 = of(c.qw1), d.qw2 = of(c.qw2), d.kw1 = of(c.kw1), d.kw2 = of(c.kw2);
    d.qdd = of(c.qdd), d.kdd = of(c.kdd);
    return d;
  }
  template <class T>
  dcmha::ComposeTermGrads<T> of(const dcmha::ComposeTermGrads<T>& c) {
    return {of(c.w), of(c.qw1), of(c.qw2), of(c.kw1), of(c.kw2), of(c.qdd), of(c.kdd)};
  }
  template <class T>
  static void copy_back(const dcmha::ComposeTermGrads<T>& device,
                        const dcmha::ComposeTermGrads<T>& host) {
    copy_back(device.w, host.w), copy_back(device.qw1, host.qw1);
    copy_back(device.qw2, host.qw2), copy_back(device.kw1, host.kw1);
    copy_back(device.kw2, host.kw2), copy_back(device.qdd, host.qdd);
    copy_back(device.kdd, host.kdd);
  }

 private:
  template <class U, int N>
  static std::size_t extent(const TensorView<U, N>& v) {
    index_t last = 0;
    for (int d = 0; d < N; ++d) last += (v.shape[d] - 1) * v.stride[d];
    return static_cast<std::size_t>(last + 1);
  }
  std::vector<void*> allocations_;
};

/// The case's problem; with bf16_values every input rounded to a bf16 value.
dcmha::reference::Problem case_problem(const Case& c, uint64_t seed, bool bf16_values) {
  dcmha::reference::Problem p = dcmha::test::problem_of(c, seed);
  if (!bf16_values) return p;
  auto round = [](std::vector<double>& x) {
    for (double& e : x) e = double(float(dcmha::bf16(float(e))));
  };
  for (auto* x : {&p.q, &p.k, &p.v}) round(*x);
  for (auto* s : {&p.pre, &p.post})
    for (auto* x : {&s->w, &s->qw1, &s->qw2, &s->kw1, &s->kw2, &s->qdd, &s->kdd}) round(*x);
  return p;
}

/// A problem's forward and backward on the GPU; results land in tp's host buffers.
template <class T>
void run_on_gpu(const Case& c, TypedProblem<T>& tp, dcmha::cuda::DeviceWorkspace& ws,
                cudaStream_t stream = 0) {
  dcmha::AttentionConfig cfg = tp.config();
  if (!c.query_lengths.empty()) {
    cfg.query_lengths = dcmha::view<1>(c.query_lengths.data(), {index_t(c.query_lengths.size())});
    cfg.key_lengths = dcmha::view<1>(c.key_lengths.data(), {index_t(c.key_lengths.size())});
  }
  DeviceMirror dev;
  const auto q = dev.of(tp.q()), k = dev.of(tp.k()), v = dev.of(tp.v()), dout = dev.of(tp.dout());
  const auto out = dev.of(tp.out());
  const auto lse = dev.of(tp.lse());
  const auto dq = dev.of(tp.dq()), dk = dev.of(tp.dk()), dv = dev.of(tp.dv());
  const dcmha::ComposeWeights<T> compose{dev.of(tp.compose().pre), dev.of(tp.compose().post)};
  const dcmha::ComposeGrads<T> host_grads = tp.dcompose();
  const dcmha::ComposeGrads<T> dcompose{dev.of(host_grads.pre), dev.of(host_grads.post)};
  dcmha::cuda::forward(cfg, q, k, v, out, lse, compose, ws, stream, c.launch);
  dcmha::cuda::backward(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, ws, stream,
                        c.launch);
  check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  DeviceMirror::copy_back(out, tp.out()), DeviceMirror::copy_back(lse, tp.lse());
  DeviceMirror::copy_back(dq, tp.dq()), DeviceMirror::copy_back(dk, tp.dk());
  DeviceMirror::copy_back(dv, tp.dv());
  DeviceMirror::copy_back(dcompose.pre, host_grads.pre);
  DeviceMirror::copy_back(dcompose.post, host_grads.post);
}

/// Every result in a fixed order: out, lse, gradients.
template <class T>
std::vector<double> results(const TypedProblem<T>& tp) {
  std::vector<double> all = tp.out_values();
  const std::vector<double> lse = tp.lse_values();
  all.insert(all.end(), lse.begin(), lse.end());
  const dcmha::reference::Gradients grads = tp.gradients();
  for (auto& [name, values] : dcmha::test::named_gradients(grads))
    all.insert(all.end(), values->begin(), values->end());
  return all;
}

template <class T>
void check_against_reference(const Case& c, uint64_t seed, double tolerance) {
  SCOPED_TRACE(c.str() + " seed=" + std::to_string(seed));
  const bool bf16 = std::is_same_v<T, dcmha::bf16>;
  const dcmha::reference::Problem p = case_problem(c, seed, bf16);
  const std::vector<double> dout = dcmha::test::random_dout(p, seed);
  const auto [expected_out, expected] = dcmha::reference::forward_and_backward(p, dout);
  TypedProblem<T> tp(p);
  tp.set_dout(dout);
  dcmha::cuda::DeviceWorkspace ws;
  run_on_gpu(c, tp, ws);
  EXPECT_LE(dcmha::test::max_rel_error(expected_out, tp.out_values()), tolerance) << "out";
  for (const auto& e : dcmha::test::gradient_errors(expected, tp.gradients()))
    EXPECT_LE(e.rel, tolerance) << e.name;
}

TEST(CudaGpu, EverySwitchAgainstTheReference) {
  ProblemSpec s = tiled_spec();
  const SideSpec sides[] = {SideSpec::none(),     SideSpec::all(),      SideSpec::dynamic(),
                            {true, false, false}, {false, true, false}, {false, false, true}};
  uint64_t seed = 1;
  for (const SideSpec& pre : sides)
    for (const SideSpec& post : {SideSpec::none(), SideSpec::all()}) {
      s.pre = pre, s.post = post;
      check_against_reference<float>(with_launch(s), seed++, 2e-4);
      check_against_reference<float>(with_launch(s, {64, 2, 4, 3}), seed++, 2e-4);  // 3 splits
    }
}

TEST(CudaGpu, MasksWindowsLengthsAndLongerRows) {
  ProblemSpec s = tiled_spec();
  s.T = 150, s.S = 170, s.D = 32, s.Dv = 24;
  check_against_reference<float>(with_launch(s), 10, 2e-4);
  s.causal = false, s.window = 37;
  check_against_reference<float>(with_launch(s), 11, 2e-4);
  Case c = with_launch(tiled_spec());
  c.spec.B = 3;
  c.query_lengths = {7, 4, 0};
  c.key_lengths = {9, 6, 3};
  check_against_reference<float>(c, 12, 2e-4);
}

TEST(CudaGpu, OfficialShapeInBf16) {
  // 32 heads in one group, every term, D = 64: the reference's result within bf16's resolution,
  // with the products on tensor cores and without.
  ProblemSpec s;
  s.B = 1, s.H = 32, s.Hk = 32, s.G = 1, s.T = 40, s.S = 40, s.D = 64, s.Dv = 64;
  s.causal = true;
  check_against_reference<float>(with_launch(s), 20, 2e-4);
  check_against_reference<dcmha::bf16>(with_launch(s), 21, 2e-2);
  dcmha::cuda::LaunchOptions scalar;
  scalar.tensor_cores = false;
  check_against_reference<dcmha::bf16>(with_launch(s, scalar), 22, 2e-2);
}

TEST(CudaGpu, TensorCoresWithLengthsGqaAndSplits) {
  // bf16 tensor-core tiles over padded sequences, partial key steps, GQA and split keys.
  ProblemSpec s = tiled_spec();
  s.B = 3, s.T = 21, s.S = 75, s.D = 32, s.Dv = 64;
  Case c = with_launch(s, {64, 8, 32, 0});
  c.query_lengths = {21, 9, 0};
  c.key_lengths = {75, 40, 5};
  check_against_reference<dcmha::bf16>(c, 23, 2e-2);
  c.launch.key_splits = 2;
  check_against_reference<dcmha::bf16>(c, 24, 2e-2);
}

TEST(CudaGpu, BackwardIsBitwiseDeterministic) {
  const Case c = with_launch(tiled_spec());
  const dcmha::reference::Problem p = dcmha::test::problem_of(c, 40);
  const std::vector<double> dout = dcmha::test::random_dout(p, 40);
  TypedProblem<float> a(p), b(p);
  a.set_dout(dout), b.set_dout(dout);
  dcmha::cuda::DeviceWorkspace ws;
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  run_on_gpu(c, a, ws);
  run_on_gpu(c, b, ws, stream);  // the same workspace, another stream
  cudaStreamDestroy(stream);
  const std::vector<double> x = results(a), y = results(b);
  ASSERT_EQ(x.size(), y.size());
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], y[i]) << "element " << i;
}

/// Appends and decodes p's tokens through a device DecodeCache by `schedule`; the rows must be
/// the full causal forward's (with the window, if any).
void check_decode_steps(const ProblemSpec& s, uint64_t seed,
                        const dcmha::test::DecodeSchedule& schedule, index_t max_step,
                        const LaunchOptions& launch = {}) {
  SCOPED_TRACE(s.str());
  const dcmha::reference::Problem p = dcmha::test::random_problem(s, seed);
  dcmha::cuda::DecodeCache<float> cache(dcmha::test::cache_config(p, s.T, max_step));
  dcmha::cuda::DeviceWorkspace ws;
  dcmha::AttentionConfig cfg;
  cfg.mask = dcmha::Mask::causal;
  cfg.window = s.window;
  const auto outs = dcmha::test::decode_steps_with<
      float>(p, schedule, [&](const dcmha::test::DecodeStepTensors<float>& x) {
    DeviceMirror dev;
    const dcmha::ComposeWeights<float> key_side{dev.of(x.key_side.pre), dev.of(x.key_side.post)};
    const dcmha::ComposeWeights<float> query_side{dev.of(x.query_side.pre),
                                                  dev.of(x.query_side.post)};
    const auto out = dev.of(x.out);
    cache.append(dev.of(x.k), dev.of(x.v), key_side, x.counts);
    dcmha::cuda::decode(cfg, dev.of(x.q), cache, query_side, out, ws, 0, launch);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    DeviceMirror::copy_back(out, x.out);
  });
  int64_t padding_nonzero = 0;
  const std::vector<double> rows = dcmha::test::assemble_rows(p, schedule, outs, padding_nonzero);
  EXPECT_LE(dcmha::test::max_rel_error(dcmha::reference::forward(p), rows), 2e-4);
  EXPECT_EQ(padding_nonzero, 0);
}

TEST(CudaGpu, SmallCaseForTheSanitizers) {
  // scripts/gpu_check.sh runs compute-sanitizer's tools on this one: every kernel (forward, both
  // backward sides, the W sums, append, decode with split keys and their combination) on a tiny
  // problem with every term, GQA, two groups and per-sequence lengths.
  Case c = with_launch(tiled_spec());
  c.spec.pre.static_w = c.spec.post.static_w = true;
  c.query_lengths = {7, 5};
  c.key_lengths = {9, 6};
  check_against_reference<float>(c, 70, 2e-4);
  ProblemSpec s = tiled_spec();
  s.T = s.S = 9, s.window = 3;
  check_decode_steps(s, 71, {{4, 2}, {1, 3}, {4, 4}}, 4, {0, 0, 2, 3});
}

TEST(CudaGpu, DecodeStepsAreTheForwardRows) {
  // Uneven counts per step; the windowed layer's ring wraps.
  ProblemSpec s = tiled_spec();
  s.T = s.S = 40, s.D = 16, s.Dv = 16;
  dcmha::test::DecodeSchedule schedule = {{8, 5}};
  for (int64_t i = 0, done0 = 8, done1 = 5; done0 < 40 || done1 < 40; ++i) {
    const int64_t n0 = std::min<int64_t>(1 + i % 3, 40 - done0);
    const int64_t n1 = std::min<int64_t>(3 - i % 3, 40 - done1);
    schedule.push_back({n0, n1});
    done0 += n0, done1 += n1;
  }
  for (int64_t window : {int64_t(0), int64_t(6)}) {
    s.window = window;
    check_decode_steps(s, uint64_t(60 + window), schedule, 8);
    check_decode_steps(s, uint64_t(61 + window), schedule, 8, {0, 0, 4, 5});  // 5 key splits
  }
}

TEST(CudaGpu, ErrorsNameTheArgumentOrTheCudaCall) {
  const Case c = with_launch(tiled_spec(), {2048, 0, 0});  // more threads than a block may have
  const dcmha::reference::Problem p = dcmha::test::problem_of(c, 50);
  TypedProblem<float> tp(p);
  dcmha::cuda::DeviceWorkspace ws;
  try {
    run_on_gpu(c, tp, ws);
    FAIL() << "expected dcmha::Error";
  } catch (const dcmha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dcmha::cuda::forward: kernel launch failed: "),
              std::string::npos)
        << e.what();
  }
  dcmha::AttentionConfig cfg = tp.config();
  cfg.scale = std::nan("");
  try {
    dcmha::cuda::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose(), ws);
    FAIL() << "expected dcmha::Error";
  } catch (const dcmha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dcmha::cuda::forward: cfg.scale: expected a finite"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("test_cuda_gpu: no CUDA device, skipped\n");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

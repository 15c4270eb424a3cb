// The CUDA backend on a GPU: forward and backward on device memory against the test reference
// (float, bf16 and fp16 storage, every compose switch, masks, windows, lengths, GQA, clusters,
// head dims), bf16 against the CPU kernels, decode steps through a device DecodeCache, bitwise
// from run to run, and the errors.
// Without a CUDA device the program reports itself skipped (exit code 77, CTest's
// SKIP_RETURN_CODE for this test).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <dcmha/cuda/decode.hpp>

#include "cuda/cpu_results.hpp"
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
  dcmha::cuda::backward(cfg, q, k, v, out, lse, dout, dq, dk, dv, compose, dcompose, ws, stream,
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

/// The case on the GPU against the reference on the same inputs (rounded to T).
template <class T>
void check_against_reference(const Case& c, uint64_t seed, double tolerance) {
  SCOPED_TRACE(c.str() + " seed=" + std::to_string(seed));
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<T>(dcmha::test::problem_of(c, seed));
  std::vector<double> dout = dcmha::test::random_dout(p, seed);
  for (double& x : dout) x = dcmha::test::round_to<T>(x);
  const auto [expected_out, expected] = dcmha::reference::forward_and_backward(p, dout);
  TypedProblem<T> tp(p);
  tp.set_dout(dout);
  dcmha::cuda::DeviceWorkspace ws;
  run_on_gpu(c, tp, ws);
  EXPECT_LE(dcmha::test::max_rel_error(expected_out, tp.out_values()), tolerance) << "out";
  for (const auto& e : dcmha::test::gradient_errors(expected, tp.gradients()))
    EXPECT_LE(e.rel, tolerance) << e.name;
}

/// The case on the GPU against the CPU kernels on the same inputs (bf16 storage on both).
void check_against_cpu(const Case& c, uint64_t seed, double tolerance) {
  SCOPED_TRACE(c.str() + " seed=" + std::to_string(seed));
  using dcmha::bf16;
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<bf16>(dcmha::test::problem_of(c, seed));
  std::vector<double> dout = dcmha::test::random_dout(p, seed);
  for (double& x : dout) x = dcmha::test::round_to<bf16>(x);
  TypedProblem<bf16> gpu(p);
  gpu.set_dout(dout);
  dcmha::cuda::DeviceWorkspace ws;
  run_on_gpu(c, gpu, ws);
  const std::vector<double> expected =
      dcmha::test::cpu_results_bf16(p, dout, c.query_lengths, c.key_lengths);
  EXPECT_LE(dcmha::test::max_rel_error(expected, results(gpu)), tolerance);
}

constexpr double kFloat = 2e-4, kBf16 = 3e-2, kHalf = 4e-3;

TEST(CudaGpu, EverySwitchAgainstTheReference) {
  ProblemSpec s = tiled_spec();
  const SideSpec sides[] = {SideSpec::none(),     SideSpec::all(),      SideSpec::dynamic(),
                            {true, false, false}, {false, true, false}, {false, false, true}};
  uint64_t seed = 1;
  for (const SideSpec& pre : sides)
    for (const SideSpec& post : {SideSpec::none(), SideSpec::all()}) {
      s.pre = pre, s.post = post;
      check_against_reference<float>(with_launch(s), seed++, kFloat);
      check_against_reference<float>(with_launch(s, dcmha::test::tiles(0, 2, 3)), seed++, kFloat);
    }
}

TEST(CudaGpu, TensorCoresAgainstTheCpuAndTheReference) {
  // bf16 and fp16 on the tensor cores: MHA in fragments, DCMHA through the compose tiles, at the
  // checkpoints' head dims; bf16 against the CPU kernels too.
  ProblemSpec s = tiled_spec();
  s.T = 70, s.S = 90;
  uint64_t seed = 30;
  for (int64_t d : {64, 80, 128})
    for (const SideSpec& side : {SideSpec::none(), SideSpec::dynamic(), SideSpec::all()}) {
      s.D = s.Dv = d, s.pre = s.post = side;
      check_against_reference<dcmha::bf16>(with_launch(s), seed++, kBf16);
      check_against_reference<dcmha::half>(with_launch(s), seed++, kHalf);
      check_against_cpu(with_launch(s), seed++, kBf16);
    }
}

TEST(CudaGpu, MhaBackwardInOnePass) {
  // MHA's backward in one pass, dQ added on the device in rounds (deterministic: one key block
  // a round, or every one in one) or all in one (unordered), at the checkpoints' head dims,
  // with GQA, windows and per-sequence lengths.
  dcmha::cuda::LaunchOptions unordered;
  unordered.deterministic = false;
  const dcmha::cuda::LaunchOptions one_split = dcmha::test::tiles(0, 0, 1);
  ProblemSpec s = tiled_spec();
  s.T = 150, s.S = 170, s.pre = s.post = SideSpec::none();
  uint64_t seed = 80;
  for (int64_t d : {64, 80, 128}) {
    s.D = s.Dv = d;
    check_against_reference<dcmha::bf16>(with_launch(s), seed++, kBf16);
    check_against_reference<dcmha::half>(with_launch(s, one_split), seed++, kHalf);
    check_against_reference<dcmha::half>(with_launch(s, unordered), seed++, kHalf);
    check_against_cpu(with_launch(s), seed++, kBf16);
  }
  s.causal = false, s.window = 37;
  check_against_reference<dcmha::bf16>(with_launch(s, unordered), seed++, kBf16);
  Case c = with_launch(s, unordered);
  c.spec.B = 3;
  c.query_lengths = {150, 20, 0};
  c.key_lengths = {170, 131, 3};
  check_against_reference<dcmha::half>(c, seed++, kHalf);
}

TEST(CudaGpu, MasksWindowsLengthsAndLongerRows) {
  ProblemSpec s = tiled_spec();
  s.T = 150, s.S = 170, s.D = 32, s.Dv = 24;
  check_against_reference<float>(with_launch(s), 10, kFloat);
  s.causal = false, s.window = 37;
  check_against_reference<float>(with_launch(s), 11, kFloat);
  Case c = with_launch(tiled_spec());
  c.spec.B = 3;
  c.query_lengths = {37, 20, 0};
  c.key_lengths = {45, 30, 3};
  check_against_reference<float>(c, 12, kFloat);
  c.spec.D = c.spec.Dv = 64;
  check_against_reference<dcmha::bf16>(c, 13, kBf16);
}

TEST(CudaGpu, OfficialShapeOnClusters) {
  // 32 heads in one group, rank 2, every dynamic term: the cluster of 8 blocks reading each
  // other's shared memory; GQA and split keys on clusters too.
  ProblemSpec s;
  s.B = 1, s.H = 32, s.Hk = 32, s.G = 1, s.T = 100, s.S = 100, s.D = 128, s.Dv = 128;
  s.causal = true, s.pre = s.post = SideSpec::dynamic();
  check_against_reference<dcmha::bf16>(with_launch(s), 20, kBf16);
  check_against_reference<dcmha::half>(with_launch(s), 21, kHalf);
  s.H = 8, s.Hk = 4, s.T = 5, s.S = 300, s.D = s.Dv = 64;
  check_against_reference<dcmha::bf16>(with_launch(s, dcmha::test::tiles(0, 4, 3)), 22, kBf16);
}

/// Runs case c twice (the same workspace, another stream) and requires the same bits.
template <class T>
void expect_same_bits_twice(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.str());
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<T>(dcmha::test::problem_of(c, seed));
  const std::vector<double> dout = dcmha::test::random_dout(p, seed);
  TypedProblem<T> a(p), b(p);
  a.set_dout(dout), b.set_dout(dout);
  dcmha::cuda::DeviceWorkspace ws;
  cudaStream_t stream = nullptr;
  check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
  run_on_gpu(c, a, ws);
  run_on_gpu(c, b, ws, stream);
  cudaStreamDestroy(stream);
  const std::vector<double> x = results(a), y = results(b);
  ASSERT_EQ(x.size(), y.size());
  for (std::size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], y[i]) << "element " << i;
}

TEST(CudaGpu, BackwardIsBitwiseDeterministic) {
  ProblemSpec s = tiled_spec();
  s.H = 8, s.Hk = 4, s.G = 1;
  expect_same_bits_twice<float>(with_launch(s, dcmha::test::tiles(0, 4)), 40);
  // MHA's one pass: three key blocks in one round (each block its own dQ sums) or in three.
  s.T = s.S = 300, s.D = s.Dv = 64, s.pre = s.post = SideSpec::none();
  expect_same_bits_twice<dcmha::half>(with_launch(s), 41);
  expect_same_bits_twice<dcmha::half>(with_launch(s, dcmha::test::tiles(0, 0, 1)), 42);
}

/// Appends and decodes p's tokens through a device DecodeCache by `schedule`; the rows must be
/// the full causal forward's (with the window, if any).
template <class T>
void check_decode_steps(const ProblemSpec& s, uint64_t seed,
                        const dcmha::test::DecodeSchedule& schedule, index_t max_step,
                        double tolerance, const LaunchOptions& launch = {}) {
  SCOPED_TRACE(s.str());
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<T>(dcmha::test::random_problem(s, seed));
  dcmha::cuda::DecodeCache<T> cache(dcmha::test::cache_config(p, s.T, max_step));
  dcmha::cuda::DeviceWorkspace ws;
  dcmha::AttentionConfig cfg;
  cfg.mask = dcmha::Mask::causal;
  cfg.window = s.window;
  const auto outs = dcmha::test::decode_steps_with<
      T>(p, schedule, [&](const dcmha::test::DecodeStepTensors<T>& x) {
    DeviceMirror dev;
    const dcmha::ComposeWeights<T> key_side{dev.of(x.key_side.pre), dev.of(x.key_side.post)};
    const dcmha::ComposeWeights<T> query_side{dev.of(x.query_side.pre), dev.of(x.query_side.post)};
    const auto out = dev.of(x.out);
    cache.append(dev.of(x.k), dev.of(x.v), key_side, x.counts);
    dcmha::cuda::decode(cfg, dev.of(x.q), cache, query_side, out, ws, 0, launch);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    DeviceMirror::copy_back(out, x.out);
  });
  int64_t padding_nonzero = 0;
  const std::vector<double> rows = dcmha::test::assemble_rows(p, schedule, outs, padding_nonzero);
  EXPECT_LE(dcmha::test::max_rel_error(dcmha::reference::forward(p), rows), tolerance);
  EXPECT_EQ(padding_nonzero, 0);
}

TEST(CudaGpu, SmallCaseForTheSanitizersFloat) {
  // scripts/gpu_check.sh runs compute-sanitizer's tools on these: every kernel (forward, both
  // backward sides, the W and per-head sums, append, decode with split keys and their
  // combination) on tiny problems with every term, GQA, a cluster and per-sequence lengths.
  Case c = with_launch(tiled_spec(), dcmha::test::tiles(0, 2));
  c.query_lengths = {37, 20};
  c.key_lengths = {45, 30};
  check_against_reference<float>(c, 70, kFloat);
  ProblemSpec s = tiled_spec();
  s.T = s.S = 40, s.window = 9;
  check_decode_steps<float>(s, 71, {{20, 12}, {1, 3}, {19, 25}}, 25, kFloat,
                            dcmha::test::tiles(0, 0, 3));
}

TEST(CudaGpu, SmallCaseForTheSanitizersTensorCores) {
  // The same for bf16 on the tensor cores: MHA in fragments, DCMHA through the compose, and
  // MHA's one-pass backward.
  ProblemSpec s = tiled_spec();
  s.D = s.Dv = 64, s.pre = s.post = SideSpec::none();
  check_against_reference<dcmha::bf16>(with_launch(s), 72, kBf16);
  s.pre = s.post = SideSpec::dynamic();
  check_against_reference<dcmha::bf16>(with_launch(s, dcmha::test::tiles(0, 2)), 73, kBf16);
  dcmha::cuda::LaunchOptions unordered;  // MHA's one-pass backward, all its adds in one launch
  unordered.deterministic = false;
  s.pre = s.post = SideSpec::none();
  check_against_reference<dcmha::bf16>(with_launch(s, unordered), 74, kBf16);
  dcmha::cuda::LaunchOptions two_sided;  // and on two sides
  two_sided.one_pass = false;
  check_against_reference<dcmha::bf16>(with_launch(s, two_sided), 75, kBf16);
}

TEST(CudaGpu, DecodeStepsAreTheForwardRows) {
  // Uneven counts per step; the windowed layer's ring wraps.
  ProblemSpec s = tiled_spec();
  s.T = s.S = 80, s.D = 16, s.Dv = 16;
  dcmha::test::DecodeSchedule schedule = {{18, 25}};
  for (int64_t i = 0, done0 = 18, done1 = 25; done0 < 80 || done1 < 80; ++i) {
    const int64_t n0 = std::min<int64_t>(1 + i % 3, 80 - done0);
    const int64_t n1 = std::min<int64_t>(3 - i % 3, 80 - done1);
    schedule.push_back({n0, n1});
    done0 += n0, done1 += n1;
  }
  for (int64_t window : {int64_t(0), int64_t(36)}) {
    s.window = window;
    check_decode_steps<float>(s, uint64_t(60 + window), schedule, 25, kFloat);
    check_decode_steps<dcmha::bf16>(s, uint64_t(61 + window), schedule, 25, kBf16,
                                    dcmha::test::tiles(0, 0, 5));
  }
}

TEST(CudaGpu, ErrorsNameTheArgumentOrTheCudaCall) {
  // A cluster of 16 blocks is past the portable size the kernels are launched with.
  ProblemSpec s = tiled_spec();
  s.H = s.Hk = 16, s.G = 1;
  const Case c = with_launch(s, dcmha::test::tiles(16, 16));
  const dcmha::reference::Problem p = dcmha::test::problem_of(c, 50);
  TypedProblem<float> tp(p);
  dcmha::cuda::DeviceWorkspace ws;
  try {
    run_on_gpu(c, tp, ws);
    FAIL() << "expected dcmha::Error";
  } catch (const dcmha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dcmha::cuda::forward: cudaLaunchKernelEx failed: "),
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

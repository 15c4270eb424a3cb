// The CUDA backend's kernel source (include/dcmha/cuda/) executed on the host: each block's
// threads are host threads meeting at real barriers (cuda/simt_host.hpp). Every output and
// gradient is compared with the test reference over every compose switch, GQA, groups, masks,
// windows, per-sequence lengths, S != T and the tile edges; bf16 storage against the float
// kernels rounded; and the backward is checked bitwise from run to run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <dcmha/cuda/emulate.hpp>

#include "reference/reference.hpp"
#include "support/backend_cases.hpp"
#include "support/problem.hpp"
#include "support/runs.hpp"

namespace {

using dcmha::index_t;
using dcmha::cuda::LaunchOptions;
using dcmha::test::problem_of;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;
using Case = dcmha::test::BackendCase;
using dcmha::test::tiled_spec;
using dcmha::test::with_launch;

template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, double> ? 1e-9 : 2e-4;
}

template <class T>
struct EmulatedRun {
  TypedProblem<T> tp;
  dcmha::AttentionConfig cfg;

  EmulatedRun(const Case& c, const dcmha::reference::Problem& p, const std::vector<double>& dout)
      : tp(p), cfg(tp.config()) {
    tp.set_dout(dout);
    if (!c.query_lengths.empty()) {
      cfg.query_lengths = dcmha::view<1>(c.query_lengths.data(), {p.B});
      cfg.key_lengths = dcmha::view<1>(c.key_lengths.data(), {p.B});
    }
  }
  void forward(const LaunchOptions& launch) {
    dcmha::cuda::emulate::forward<T>(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose(),
                                     launch);
  }
  void backward(const LaunchOptions& launch) {
    dcmha::cuda::emulate::backward<T>(cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(),
                                      tp.dk(), tp.dv(), tp.compose(), tp.dcompose(), launch);
  }
};

/// NaN in every padding row and key of x, a (B, L, inner...) tensor of `inner` values per
/// position, beyond lengths[b] of L: what the kernels must never read.
void poison(std::vector<double>& x, int64_t B, int64_t heads, int64_t L, int64_t inner,
            const std::vector<int64_t>& lengths, bool heads_first) {
  if (x.empty()) return;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t l = lengths[size_t(b)]; l < L; ++l)
        for (int64_t i = 0; i < inner; ++i) {
          const int64_t at = heads_first ? ((b * heads + h) * L + l) * inner + i
                                         : ((b * L + l) * heads + h) * inner + i;
          x[size_t(at)] = NAN;
        }
}

/// p and dout with NaN wherever per-sequence lengths make padding.
void poison_padding(dcmha::reference::Problem& p, std::vector<double>& dout) {
  if (p.query_lengths.empty()) return;
  const int64_t M = p.H / p.G;
  poison(p.q, p.B, p.H, p.T, p.D, p.query_lengths, true);
  poison(dout, p.B, p.H, p.T, p.Dv, p.query_lengths, true);
  poison(p.k, p.B, p.Hk, p.S, p.D, p.key_lengths, true);
  poison(p.v, p.B, p.Hk, p.S, p.Dv, p.key_lengths, true);
  for (dcmha::reference::ComposeSide* c : {&p.pre, &p.post}) {
    for (auto* x : {&c->qw1, &c->qw2})
      poison(*x, p.B, 1, p.T, p.G * c->Rq * M, p.query_lengths, false);
    poison(c->qdd, p.B, 1, p.T, p.G * M, p.query_lengths, false);
    for (auto* x : {&c->kw1, &c->kw2})
      poison(*x, p.B, 1, p.S, p.G * c->Rk * M, p.key_lengths, false);
    poison(c->kdd, p.B, 1, p.S, p.G * M, p.key_lengths, false);
  }
}

template <class T>
void check_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.str() + " seed=" + std::to_string(seed));
  const dcmha::reference::Problem clean = problem_of(c, seed);
  const std::vector<double> clean_dout = dcmha::test::random_dout(clean, seed);
  const auto [expected_out, expected] = dcmha::reference::forward_and_backward(clean, clean_dout);
  // The kernels see NaN in the padding (with lengths); the reference never reads it either.
  dcmha::reference::Problem p = clean;
  std::vector<double> dout = clean_dout;
  poison_padding(p, dout);
  EmulatedRun<T> run(c, p, dout);
  run.forward(c.launch);
  EXPECT_LE(dcmha::test::max_rel_error(expected_out, run.tp.out_values()), tolerance<T>()) << "out";
  const std::vector<double> lse = dcmha::test::reference_lse(clean);
  const std::vector<double> got_lse = run.tp.lse_values();
  for (size_t i = 0; i < lse.size(); ++i)
    if (std::isinf(lse[i]))
      ASSERT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << "lse " << i;
    else
      ASSERT_NEAR(got_lse[i], lse[i], tolerance<T>() * (1 + std::abs(lse[i]))) << "lse " << i;
  run.backward(c.launch);
  for (const auto& e : dcmha::test::gradient_errors(expected, run.tp.gradients()))
    EXPECT_LE(e.rel, tolerance<T>()) << e.name;
}

Case small(const ProblemSpec& spec, int threads, int64_t rows, int64_t keys) {
  return dcmha::test::with_launch(spec, {threads, rows, keys, 0});
}

TEST(CudaKernelsEmulated, EverySwitchAgainstTheReference) {
  ProblemSpec s = tiled_spec();
  const SideSpec sides[] = {SideSpec::none(),     SideSpec::all(),      SideSpec::dynamic(),
                            {true, false, false}, {false, true, false}, {false, false, true}};
  uint64_t seed = 1;
  for (const SideSpec& pre : sides)
    for (const SideSpec& post : {SideSpec::none(), SideSpec::all(), pre}) {
      s.pre = pre;
      s.post = post;
      check_case<double>(small(s, 16, 2, 4), seed++);
    }
}

TEST(CudaKernelsEmulated, MasksAndWindows) {
  ProblemSpec s = tiled_spec();
  struct Mask {
    bool causal;
    int64_t window, T, S;
  };
  // S < T with causal: the first rows see no key (lse -inf, zero output and gradients).
  const Mask masks[] = {{false, 0, 7, 9}, {true, 0, 9, 6}, {true, 3, 7, 9},
                        {false, 2, 8, 8}, {true, 1, 5, 5}, {true, 20, 6, 11}};
  uint64_t seed = 100;
  for (const Mask& m : masks) {
    s.causal = m.causal, s.window = m.window, s.T = m.T, s.S = m.S;
    check_case<double>(small(s, 8, 2, 3), seed++);
    check_case<float>(small(s, 8, 3, 4), seed++);
  }
}

TEST(CudaKernelsEmulated, PerSequenceLengths) {
  ProblemSpec s = tiled_spec();
  s.B = 3;
  Case c = small(s, 12, 2, 4);
  // A full sequence, a padded one, and one with no query rows (all padding); padding holds NaN.
  c.query_lengths = {7, 4, 0};
  c.key_lengths = {9, 6, 3};
  check_case<double>(c, 200);
  c.spec.causal = false;
  c.spec.window = 2;
  c.query_lengths = {3, 7, 1};
  c.key_lengths = {0, 9, 2};  // a sequence without keys: every row sees none
  check_case<double>(c, 201);
  check_case<float>(c, 202);
}

TEST(CudaKernelsEmulated, TileShapesAndThreadCounts) {
  ProblemSpec s = tiled_spec();
  s.T = 10, s.S = 13;
  uint64_t seed = 300;
  // Rows and keys per tile from 1 to beyond the problem, odd thread counts (items a thread owns
  // wrap around unevenly), and the planned launch.
  const LaunchOptions launches[] = {{1, 1, 1, 0},   {3, 3, 5, 0},  {7, 16, 32, 0},
                                    {32, 4, 13, 0}, {64, 1, 2, 0}, {}};
  for (const LaunchOptions& l : launches) {
    Case c;
    c.spec = s;
    c.launch = l;
    check_case<double>(c, seed++);
  }
}

TEST(CudaKernelsEmulated, KeysSplitAcrossBlocks) {
  // The split forward (decode's shape: few query blocks, many keys): statistics per share,
  // combined, then P'V per share, summed. More splits than key steps leaves shares empty.
  ProblemSpec s = tiled_spec();
  s.T = 5, s.S = 23;
  uint64_t seed = 350;
  for (int64_t splits : {2, 7}) {
    for (bool window : {false, true}) {
      s.window = window ? 9 : 0;
      Case c = small(s, 16, 2, 3);
      c.launch.key_splits = splits;
      check_case<double>(c, seed++);
    }
  }
  Case c = small(tiled_spec(), 8, 2, 2);
  c.spec.B = 3;
  c.query_lengths = {7, 2, 0};
  c.key_lengths = {9, 9, 4};
  c.launch.key_splits = 4;
  check_case<float>(c, seed++);
}

TEST(CudaKernelsEmulated, LaunchPlanSplitsOnlyWhereBlocksAreFew) {
  // Decode of the official DCMHA (one group of 32 heads, B = 8, 4096 cached keys) has 8 query
  // blocks: its keys are split 32 ways (256 blocks); MHA's 256 head blocks are not split, nor is
  // a long forward.
  auto plan = [](index_t B, index_t H, index_t G, index_t T, index_t S) {
    dcmha::detail::ForwardParams<float> p;
    p.dims = {B, H, H, T, S, 128, 128, G, H / G};
    return dcmha::cuda::forward_launch("plan", p);
  };
  const dcmha::cuda::ForwardLaunch dcmha_decode = plan(8, 32, 1, 1, 4096);
  EXPECT_EQ(dcmha_decode.splits, 32);
  EXPECT_EQ(dcmha_decode.blocks.grid.z, 8 * 32);
  EXPECT_EQ(plan(8, 32, 32, 1, 4096).splits, 1);
  EXPECT_EQ(plan(4, 32, 1, 2048, 2048).splits, 1);
  EXPECT_EQ(plan(1, 32, 1, 1, 64).splits, 1);  // too few keys to share
}

TEST(CudaKernelsEmulated, LaunchPlanTakesTensorCoresForBf16) {
  // The official DCMHA in bf16 (32 heads in one group, D = Dv = 128, rank 2): all four warps
  // stage for the tensor cores and the blocks keep the scalar plan's 2 rows within the budget.
  // float, D = 100 and 48 threads stay scalar.
  auto plan = [](auto scalar, index_t D, int threads) {
    using T = decltype(scalar);
    dcmha::detail::ForwardParams<T> p;
    p.dims = {4, 32, 32, 2048, 2048, D, D, 1, 32};
    p.compose.pre.query_wise = p.compose.pre.key_wise = true;
    p.compose.pre.qw1.shape[3] = p.compose.pre.kw1.shape[3] = 2;
    LaunchOptions opt;
    opt.threads = threads;
    return dcmha::cuda::forward_launch("plan", p, opt).blocks;
  };
  const dcmha::cuda::KernelLaunch official = plan(dcmha::bf16(), 128, 0);
  EXPECT_EQ(official.geo.tensor_warps, 4);
  EXPECT_EQ(official.geo.rows, plan(float(), 128, 0).geo.rows);
  EXPECT_EQ(official.geo.rows, 2);
  EXPECT_LE(official.shared_bytes, dcmha::cuda::kSharedMemoryBudget);
  EXPECT_EQ(plan(float(), 128, 0).geo.tensor_warps, 0);
  EXPECT_EQ(plan(dcmha::bf16(), 100, 0).geo.tensor_warps, 0);
  EXPECT_EQ(plan(dcmha::bf16(), 128, 48).geo.tensor_warps, 0);
  // Its backward, with both sides' terms on, keeps the scalar plan's rows as well.
  dcmha::detail::BackwardParams<dcmha::bf16> b;
  b.dims = {4, 32, 32, 2048, 2048, 128, 128, 1, 32};
  for (auto* side : {&b.compose.pre, &b.compose.post}) {
    side->static_w = side->query_wise = side->key_wise = true;
    side->qw1.shape[3] = side->kw1.shape[3] = 2;
  }
  const dcmha::cuda::BackwardLaunch backward = dcmha::cuda::backward_launch("plan", b);
  // One of its four warps stages there: what the tile leaves of the budget.
  EXPECT_EQ(backward.query.geo.tensor_warps, 1);
  EXPECT_EQ(backward.query.geo.rows, 2);
  EXPECT_LE(backward.query.shared_bytes, dcmha::cuda::kSharedMemoryBudget);
  EXPECT_LE(backward.key.shared_bytes, dcmha::cuda::kSharedMemoryBudget);
}

TEST(CudaKernelsEmulated, ShapesOfTheHeads) {
  uint64_t seed = 400;
  ProblemSpec s = tiled_spec();
  s.G = 4, s.H = 4, s.Hk = 1;  // M = 1, MQA
  check_case<double>(small(s, 8, 2, 4), seed++);
  s = tiled_spec();
  s.H = 6, s.Hk = 3, s.G = 1, s.Rq = 4, s.Rk = 3, s.D = 7, s.Dv = 9;  // ranks above 2, Dv > D
  check_case<double>(small(s, 16, 4, 8), seed++);
  s = tiled_spec();
  s.H = 8, s.Hk = 8, s.G = 2, s.Rq = 1, s.Rk = 2, s.causal = false;
  s.scale = 0.7;
  check_case<float>(small(s, 32, 2, 5), seed++);
}

TEST(CudaKernelsEmulated, OfficialConfigurationShape) {
  // DCFormer's attention: 32 heads in one group, rank 2 on both sides, every term on.
  ProblemSpec s;
  s.B = 1, s.H = 32, s.Hk = 32, s.G = 1, s.T = 6, s.S = 6, s.D = 4, s.Dv = 4, s.Rq = 2, s.Rk = 2;
  s.causal = true;
  Case c;
  c.spec = s;
  check_case<double>(c, 500);
}

/// Every result of an emulated forward + backward, in a fixed order.
template <class T>
std::vector<double> emulated_results(const Case& c, const dcmha::reference::Problem& p,
                                     const std::vector<double>& dout) {
  EmulatedRun<T> run(c, p, dout);
  run.forward(c.launch);
  run.backward(c.launch);
  std::vector<double> all = run.tp.out_values();
  const std::vector<double> lse = run.tp.lse_values();
  all.insert(all.end(), lse.begin(), lse.end());
  return dcmha::test::with_gradients(std::move(all), run.tp.gradients());
}

TEST(CudaKernelsEmulated, BitwiseTheSameForEveryThreadCount) {
  // Each element's sums run in a fixed order whichever thread owns it and nothing is atomic: the
  // backward is deterministic, and the same for any block size. A missing barrier would show
  // as a difference between runs whose threads interleave differently.
  Case c = small(tiled_spec(), 1, 2, 4);
  const dcmha::reference::Problem p = problem_of(c, 600);
  const std::vector<double> dout = dcmha::test::random_dout(p, 600);
  const std::vector<double> one = emulated_results<float>(c, p, dout);
  for (int threads : {5, 32, 32}) {
    c.launch.threads = threads;
    const std::vector<double> again = emulated_results<float>(c, p, dout);
    EXPECT_EQ(dcmha::test::first_bitwise_difference(one, again), -1) << "threads=" << threads;
  }
}

TEST(CudaKernelsEmulated, Bf16StorageIsTheRoundedFloatResult) {
  // bf16 storage widens to float and rounds each result once, so on bf16-valued inputs its
  // results are exactly the float kernels' rounded (lse stays float).
  uint64_t seed = 700;
  ProblemSpec s = tiled_spec();
  for (bool window : {false, true}) {
    s.window = window ? 3 : 0;
    const Case c = small(s, 16, 2, 4);
    SCOPED_TRACE(c.str());
    const dcmha::reference::Problem p = dcmha::test::bf16_problem(problem_of(c, seed));
    std::vector<double> dout = dcmha::test::random_dout(p, seed++);
    dcmha::test::round_all(dout);
    const std::vector<double> f = emulated_results<float>(c, p, dout);
    const std::vector<double> h = emulated_results<dcmha::bf16>(c, p, dout);
    ASSERT_EQ(f.size(), h.size());
    const size_t n_out = size_t(p.B * p.H * p.T * p.Dv), n_lse = size_t(p.B * p.H * p.T);
    size_t mismatches = 0;
    for (size_t i = 0; i < f.size(); ++i) {
      const bool is_lse = i >= n_out && i < n_out + n_lse;
      mismatches += (is_lse ? f[i] : dcmha::test::round_to_bf16(f[i])) != h[i];
    }
    EXPECT_EQ(mismatches, 0u);
  }
}

TEST(CudaKernelsEmulated, WarpProductIsTheMatrixProduct) {
  // Small integers: every product and sum is exact in float, so C must be A B exactly, in both
  // layouts of B. Operands sit in padded rows holding NaN, which the product must not read.
  constexpr int kDepth = 32, kLd = 40, kLdc = 36;
  alignas(32) dcmha::bf16 a[8 * kLd], b[32 * kLd];
  alignas(32) float c[8 * kLdc];
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int i = 0; i < 8 * kLd; ++i) a[i] = dcmha::bf16(i % kLd < kDepth ? float(i % 7 - 3) : nan);
  for (int i = 0; i < 32 * kLd; ++i) b[i] = dcmha::bf16(i % kLd < 32 ? float(i % 5 - 2) : nan);
  for (auto layout : {dcmha::cuda::Layout::row_major, dcmha::cuda::Layout::column_major}) {
    const bool rows = layout == dcmha::cuda::Layout::row_major;
    std::fill(std::begin(c), std::end(c), nan);
    dcmha::cuda::host::launch({1, 1, 1}, 32, 0, [&](const dcmha::cuda::host::HostBlock& blk) {
      if (rows)
        dcmha::cuda::warp_product<dcmha::cuda::Layout::row_major>(blk, a, kLd, b, kLd, kDepth, c,
                                                                  kLdc);
      else
        dcmha::cuda::warp_product<dcmha::cuda::Layout::column_major>(blk, a, kLd, b, kLd, kDepth, c,
                                                                     kLdc);
    });
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 32; ++j) {
        double expected = 0;
        for (int d = 0; d < kDepth; ++d)
          expected += double(a[i * kLd + d]) * double(rows ? b[d * kLd + j] : b[j * kLd + d]);
        ASSERT_EQ(double(c[i * kLdc + j]), expected) << "rows=" << rows << " " << i << "," << j;
      }
  }
  // An operand the tensor cores could not load (not 32-byte aligned) is an error off the device.
  EXPECT_THROW(
      dcmha::cuda::host::launch({1, 1, 1}, 32, 0,
                                [&](const dcmha::cuda::host::HostBlock& blk) {
                                  dcmha::cuda::warp_product<dcmha::cuda::Layout::row_major>(
                                      blk, a + 1, kLd, b, kLd, kDepth, c, kLdc);
                                }),
      std::logic_error);
}

/// The warps that stage for the tensor cores in the planned forward of p (bf16).
index_t planned_tensor_warps(const dcmha::reference::Problem& p, const LaunchOptions& launch) {
  TypedProblem<dcmha::bf16> tp(p);
  const auto params = dcmha::detail::forward_params("plan", tp.config(), tp.q(), tp.k(), tp.v(),
                                                    tp.out(), tp.lse(), tp.compose());
  return dcmha::cuda::forward_launch("plan", params, launch).blocks.geo.tensor_warps;
}

/// bf16 with the products on tensor cores. On the host their sums run in the scalar path's
/// order, so the scores, and with them lse and the whole backward (which recomputes P from lse),
/// are bitwise the scalar path's; P'V takes P' rounded to bf16 and is checked against the
/// reference.
void check_tensor_core_case(Case c, uint64_t seed) {
  SCOPED_TRACE(c.str() + " seed=" + std::to_string(seed));
  const dcmha::reference::Problem clean = dcmha::test::bf16_problem(problem_of(c, seed));
  std::vector<double> clean_dout = dcmha::test::random_dout(clean, seed);
  dcmha::test::round_all(clean_dout);
  ASSERT_GT(planned_tensor_warps(clean, c.launch), 0);
  dcmha::reference::Problem p = clean;
  std::vector<double> dout = clean_dout;
  poison_padding(p, dout);
  EmulatedRun<dcmha::bf16> tensor(c, p, dout);
  tensor.forward(c.launch);
  tensor.backward(c.launch);
  EXPECT_LE(dcmha::test::max_rel_error(dcmha::reference::forward(clean), tensor.tp.out_values()),
            1e-2);
  c.launch.tensor_cores = false;
  EmulatedRun<dcmha::bf16> scalar(c, p, dout);
  scalar.forward(c.launch);
  scalar.backward(c.launch);
  EXPECT_EQ(dcmha::test::first_bitwise_difference(scalar.tp.lse_values(), tensor.tp.lse_values()),
            -1);
  const std::vector<double> none;
  EXPECT_EQ(dcmha::test::first_bitwise_difference(
                dcmha::test::with_gradients(none, scalar.tp.gradients()),
                dcmha::test::with_gradients(none, tensor.tp.gradients())),
            -1);
}

TEST(CudaKernelsEmulated, TensorCoreProducts) {
  // Two steps of 32 keys (the second partial), chunks of 8 rows with padding (3 rows), several
  // chunks (16 rows), GQA, two groups, S != T.
  ProblemSpec s = tiled_spec();
  s.T = 11, s.S = 36, s.D = 16, s.Dv = 64;
  uint64_t seed = 1100;
  for (const LaunchOptions& l :
       std::vector<LaunchOptions>{{64, 3, 32, 0}, {32, 16, 32, 0}, {96, 8, 32, 0}}) {
    check_tensor_core_case(dcmha::test::with_launch(s, l), seed++);
  }
  // A window, MHA, rows that see no key (S < T, causal), the official group of 32 heads.
  s.window = 5;
  check_tensor_core_case(small(s, 64, 4, 32), seed++);
  s.window = 0, s.pre = s.post = SideSpec::none(), s.T = 40, s.S = 21;
  check_tensor_core_case(small(s, 32, 8, 32), seed++);
  ProblemSpec official = s;
  official.B = 1, official.H = official.Hk = 32, official.G = 1, official.T = 5, official.S = 33;
  official.D = 32, official.Dv = 32, official.Rq = official.Rk = 2;
  official.pre = official.post = SideSpec::all();
  check_tensor_core_case(small(official, 64, 0, 0), seed++);
  // D = Dv = 512: the budget leaves staging for 2 of the block's 4 warps, which take every item.
  ProblemSpec wide = s;
  wide.B = 1, wide.H = 2, wide.Hk = 1, wide.G = 2, wide.T = 3, wide.S = 40, wide.D = wide.Dv = 512;
  const Case partial = with_launch(wide);
  check_tensor_core_case(partial, seed++);
  EXPECT_EQ(planned_tensor_warps(problem_of(partial, 0), partial.launch), 2);
}

TEST(CudaKernelsEmulated, TensorCoreProductsWithLengthsAndSplits) {
  ProblemSpec s = tiled_spec();
  s.B = 3, s.T = 9, s.S = 70, s.D = 16, s.Dv = 32;
  Case c = small(s, 32, 4, 32);
  c.query_lengths = {9, 5, 0};  // padding holds NaN, which staging must leave out
  c.key_lengths = {70, 33, 4};
  check_tensor_core_case(c, 1200);
  c.launch.key_splits = 2;
  c.spec.window = 6;
  check_tensor_core_case(c, 1201);
}

TEST(CudaKernelsEmulated, DecodeStepsAreTheForwardRows) {
  // The forward kernel over a DecodeCache's slots (a ring for the windowed layer, which wraps
  // here), step by step with uneven counts: its rows are the full causal forward's.
  ProblemSpec s = tiled_spec();
  s.T = s.S = 12;
  for (int64_t window : {int64_t(0), int64_t(4)}) {
    s.window = window;
    const Case c = small(s, 16, 2, 3);
    SCOPED_TRACE(c.str());
    const dcmha::reference::Problem p = problem_of(c, 1000 + window);
    dcmha::DecodeCache<double> cache(dcmha::test::cache_config(p, 12, 5));
    dcmha::AttentionConfig cfg;
    cfg.mask = dcmha::Mask::causal;
    cfg.window = window;
    const dcmha::test::DecodeSchedule schedule = {{5, 3}, {1, 4}, {3, 0}, {1, 5}, {2, 0}};
    // Odd steps split the keys across blocks, as decode's launch plan does for long caches.
    int64_t step = 0;
    const auto outs = dcmha::test::decode_steps_with<double>(
        p, schedule, [&](const dcmha::test::DecodeStepTensors<double>& x) {
          cache.append(x.k, x.v, x.key_side, x.counts);
          LaunchOptions launch = c.launch;
          launch.key_splits = step++ % 2 ? 3 : 1;
          dcmha::cuda::emulate::decode<double>(cfg, x.q, cache, x.query_side, x.out, launch);
        });
    int64_t padding_nonzero = 0;
    const std::vector<double> rows = dcmha::test::assemble_rows(p, schedule, outs, padding_nonzero);
    EXPECT_LE(dcmha::test::max_rel_error(dcmha::reference::forward(p), rows), 1e-9);
    EXPECT_EQ(padding_nonzero, 0);
  }
}

TEST(CudaKernelsEmulated, ArgumentsAreValidatedAsOnTheCpu) {
  const dcmha::reference::Problem p = problem_of(small(tiled_spec(), 4, 2, 4), 800);
  TypedProblem<float> tp(p);
  dcmha::AttentionConfig cfg = tp.config();
  cfg.window = -1;
  try {
    dcmha::cuda::emulate::forward<float>(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(),
                                         tp.compose());
    FAIL() << "expected dcmha::Error";
  } catch (const dcmha::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("dcmha::cuda::emulate::forward: cfg.window: expected >= 0"),
        std::string::npos)
        << e.what();
  }
}

TEST(CudaKernelsEmulated, TooLargeForSharedMemoryIsAClearError) {
  // 64 heads in one compose group with D = 1024: even one row of one block exceeds the budget.
  ProblemSpec s;
  s.B = 1, s.H = 64, s.Hk = 64, s.G = 1, s.T = 1, s.S = 1, s.D = 1024, s.Dv = 1024;
  s.pre = {true, false, false};
  s.post = SideSpec::none();
  const dcmha::reference::Problem p = dcmha::test::random_problem(s, 900);
  TypedProblem<float> tp(p);
  try {
    dcmha::cuda::emulate::forward<float>(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), {},
                                         tp.compose());
    FAIL() << "expected dcmha::Error";
  } catch (const dcmha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bytes of shared memory per block (M = 64 heads per "
                                         "group, D = 1024, Dv = 1024), expected at most"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace

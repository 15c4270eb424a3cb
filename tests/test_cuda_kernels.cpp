// The CUDA backend's kernel source (include/dcmha/cuda/) executed by the emulator
// (cuda/emulator/): every lane of every block run with the PTX lane layouts of mma, ldmatrix and
// shuffles, asynchronous copies landing at their waits, and every shared-memory access checked
// for races. Every output and gradient is compared with the test reference over every compose
// switch, GQA, groups, masks, windows, per-sequence lengths (NaN in all padding), S != T, tile
// shapes, clusters, split keys, head dims and the three storage types.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "support/emulated_kernels.hpp"

#include "reference/reference.hpp"
#include "support/backend_cases.hpp"
#include "support/decode_steps.hpp"
#include "support/problem.hpp"
#include "support/runs.hpp"
#include "support/sanitizer.hpp"

namespace {

using dcmha::bf16;
using half = dcmha::test::EmulatedHalf;  // bf16 in a sanitized build
using dcmha::index_t;
using dcmha::cuda::LaunchOptions;
using dcmha::test::problem_of;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;
using dcmha::test::tiled_spec;
using dcmha::test::tiles;
using dcmha::test::TypedProblem;
using Case = dcmha::test::BackendCase;

/// Relative error bounds: float arithmetic throughout; bf16 and fp16 round P' and dL to the
/// storage type for the tensor cores (as FlashAttention rounds P and dS) and every result once.
template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, float> ? 2e-4 : std::is_same_v<T, bf16> ? 3e-2 : 4e-3;
}

template <class T>
struct EmulatedRun {
  TypedProblem<T> tp;
  dcmha::AttentionConfig cfg;

  EmulatedRun(const Case& c, const dcmha::reference::Problem& p, const std::vector<double>& dout,
              dcmha::test::Layout layout = dcmha::test::Layout::bhtd)
      : tp(p, layout), cfg(tp.config()) {
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
  /// With `out` (the forward's output, as a FlashAttention user passes it) or without.
  void backward(const LaunchOptions& launch, dcmha::TensorView<const T, 4> out) {
    dcmha::cuda::emulate::backward<T>(cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(),
                                      tp.dk(), tp.dv(), tp.compose(), tp.dcompose(), launch, out);
  }
  void backward(const LaunchOptions& launch) { backward(launch, tp.out()); }
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

/// Forward and backward of the case in the emulator against the reference on the same (rounded)
/// inputs: out, lse and every gradient.
template <class T>
void check_case(const Case& c, uint64_t seed,
                dcmha::test::Layout layout = dcmha::test::Layout::bhtd, bool with_output = true) {
  SCOPED_TRACE(c.str() + " seed=" + std::to_string(seed));
  const dcmha::reference::Problem clean = dcmha::test::storage_problem<T>(problem_of(c, seed));
  std::vector<double> clean_dout = dcmha::test::random_dout(clean, seed);
  for (double& x : clean_dout) x = dcmha::test::round_to<T>(x);
  const auto [expected_out, expected] = dcmha::reference::forward_and_backward(clean, clean_dout);
  dcmha::reference::Problem p = clean;
  std::vector<double> dout = clean_dout;
  poison_padding(p, dout);
  EmulatedRun<T> run(c, p, dout, layout);
  run.forward(c.launch);
  EXPECT_LE(dcmha::test::max_rel_error(expected_out, run.tp.out_values()), tolerance<T>()) << "out";
  const std::vector<double> lse = dcmha::test::reference_lse(clean);
  const std::vector<double> got_lse = run.tp.lse_values();
  for (size_t i = 0; i < lse.size(); ++i)
    if (std::isinf(lse[i]))
      ASSERT_TRUE(std::isinf(got_lse[i]) && got_lse[i] < 0) << "lse " << i;
    else
      ASSERT_NEAR(got_lse[i], lse[i], tolerance<T>() * (1 + std::abs(lse[i]))) << "lse " << i;
  run.backward(c.launch, with_output ? run.tp.out() : dcmha::TensorView<const T, 4>{});
  for (const auto& e : dcmha::test::gradient_errors(expected, run.tp.gradients()))
    EXPECT_LE(e.rel, tolerance<T>()) << e.name;
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
      check_case<float>(dcmha::test::with_launch(s), seed++);
    }
}

TEST(CudaKernelsEmulated, TensorCoreStorageTypes) {
  // bf16 and fp16 storage: every product on the tensor cores (mma.m16n8k16, ldmatrix), P' and dL
  // rounded to the storage type; MHA keeps its chain in fragments.
  ProblemSpec s = tiled_spec();
  s.D = 16, s.Dv = 24;
  uint64_t seed = 50;
  for (const SideSpec& side : {SideSpec::none(), SideSpec::dynamic(), SideSpec::all()}) {
    s.pre = s.post = side;
    check_case<bf16>(dcmha::test::with_launch(s), seed++);
    check_case<half>(dcmha::test::with_launch(s), seed++);
  }
  s.pre = SideSpec::dynamic(), s.post = SideSpec::none();  // one pass: online softmax over tiles
  check_case<bf16>(dcmha::test::with_launch(s), seed++);
}

TEST(CudaKernelsEmulated, MhaWarpsOfThirtyTwoRows) {
  // MHA's registers mode in bf16 and fp16 gives a warp two 16-row tiles sharing each K and V
  // fragment: planned tiles (a second row tile past the last real row), forced tiles of 32 and
  // 128 rows, windows, per-sequence lengths, split keys, head dims 128 (tall) and 256 (16-row
  // warps of a kernel without Compose, split keys too).
  ProblemSpec s = tiled_spec();
  s.pre = s.post = SideSpec::none();
  s.D = 16, s.Dv = 24;
  uint64_t seed = 80;
  for (index_t rows : {0, 32, 128}) {
    check_case<bf16>(dcmha::test::with_launch(s, tiles(rows)), seed++);
    check_case<half>(dcmha::test::with_launch(s, tiles(rows)), seed++);
  }
  s.window = 5, s.T = 45, s.S = 40;
  check_case<bf16>(dcmha::test::with_launch(s), seed++);
  s.window = 0, s.T = 40, s.S = 300;
  check_case<bf16>(dcmha::test::with_launch(s, tiles(32, 0, 3)), seed++);
  Case c = dcmha::test::with_launch(s, tiles(64));
  c.spec.B = 3, c.spec.S = 45;
  c.query_lengths = {40, 17, 0};
  c.key_lengths = {45, 30, 3};
  check_case<half>(c, seed++);
  s.T = 33, s.S = 36, s.B = 1;
  for (int64_t d : {128, 256}) {
    s.D = s.Dv = d;
    check_case<bf16>(dcmha::test::with_launch(s), seed++);
  }
  check_case<half>(dcmha::test::with_launch(s), seed++);
  s.T = 20, s.S = 100;
  check_case<bf16>(dcmha::test::with_launch(s, tiles(0, 0, 3)), seed++);
}

TEST(CudaKernelsEmulated, BackwardWithoutTheOutput) {
  // Without the forward's output, the query side sums each row's D over the keys (pass 1);
  // every other case gives the output, from which MHA and pre-compose-only DCMHA read
  // D = sum(dO O) instead (with Compose_post on, pass 1 runs either way).
  ProblemSpec s = tiled_spec();
  s.pre = s.post = SideSpec::none();
  s.D = 16, s.Dv = 24;
  const auto bhtd = dcmha::test::Layout::bhtd;
  check_case<bf16>(dcmha::test::with_launch(s, tiles(32)), 90, bhtd, false);
  s.window = 5, s.T = 45, s.S = 40;
  check_case<half>(dcmha::test::with_launch(s), 91, bhtd, false);
  Case c = dcmha::test::with_launch(s, tiles(64));
  c.spec.B = 3;
  c.query_lengths = {40, 17, 0};
  c.key_lengths = {40, 30, 3};
  check_case<bf16>(c, 92, bhtd, false);
  s.pre = SideSpec::dynamic();  // pre-compose only: the chain's own pass 1
  check_case<float>(dcmha::test::with_launch(s), 93, bhtd, false);
}

/// D comes from `out`: an output that is not the forward's (halved) moves dQ and dK past three
/// times the tolerance (D enters dS = P (dP - D), which they are made of) and leaves dV exact.
template <class T>
void expect_row_dots_from_the_output(const Case& c, uint64_t seed) {
  SCOPED_TRACE(c.str());
  const dcmha::reference::Problem p = dcmha::test::storage_problem<T>(problem_of(c, seed));
  std::vector<double> dout = dcmha::test::random_dout(p, seed);
  for (double& x : dout) x = dcmha::test::round_to<T>(x);
  const auto expected = dcmha::reference::forward_and_backward(p, dout).grads;
  EmulatedRun<T> run(c, p, dout);
  run.forward(c.launch);
  const std::vector<double> out = run.tp.out_values();
  std::vector<T> halved(out.size());
  for (size_t i = 0; i < out.size(); ++i) halved[i] = T(float(out[i] / 2));
  run.backward(c.launch,
               dcmha::view<4>(static_cast<const T*>(halved.data()), {p.B, p.H, p.T, p.Dv}));
  for (const auto& e : dcmha::test::gradient_errors(expected, run.tp.gradients())) {
    if (e.name == "grad_v") {
      EXPECT_LE(e.rel, tolerance<T>()) << e.name;
    } else if (e.name == "grad_q" || e.name == "grad_k") {
      EXPECT_GT(e.rel, 3 * tolerance<T>()) << e.name;
    }
  }
}

TEST(CudaKernelsEmulated, BackwardReadsTheGivenOutput) {
  ProblemSpec s = tiled_spec();
  s.pre = s.post = SideSpec::none();
  s.D = 16, s.Dv = 24;
  expect_row_dots_from_the_output<bf16>(dcmha::test::with_launch(s, tiles(32)), 95);
  s.pre = SideSpec::all();  // the chain's mode, pre-compose only
  expect_row_dots_from_the_output<float>(dcmha::test::with_launch(s), 96);
}

LaunchOptions unordered() {
  LaunchOptions o;
  o.deterministic = false;
  return o;
}
LaunchOptions key_splits(index_t splits) {
  LaunchOptions o;
  o.key_splits = splits;
  return o;
}

TEST(CudaKernelsEmulated, MhaBackwardInOnePass) {
  // MHA in bf16 and fp16, given the output, runs in one pass (blocks of 128 keys over 64-row
  // query tiles): deterministic (rounds of one, two or every key block, each block of a round
  // its own dQ sums) and unordered (one round adding to one); several key blocks and query tiles,
  // GQA and groups, windows, per-sequence lengths, S != T, every head-dim class up to 128 (the dQ
  // warps' two layouts), strided views.
  ProblemSpec s = tiled_spec();
  s.pre = s.post = SideSpec::none();
  s.D = 16, s.Dv = 24, s.T = 150, s.S = 300;
  uint64_t seed = 140;
  check_case<bf16>(dcmha::test::with_launch(s), seed++);
  check_case<half>(dcmha::test::with_launch(s, key_splits(1)), seed++);
  check_case<bf16>(dcmha::test::with_launch(s, key_splits(2)), seed++, dcmha::test::Layout::bthd);
  check_case<bf16>(dcmha::test::with_launch(s, unordered()), seed++);
  s.S = 140, s.window = 37;
  check_case<half>(dcmha::test::with_launch(s, unordered()), seed++);
  check_case<bf16>(dcmha::test::with_launch(s, key_splits(1)), seed++);
  s.window = 0, s.causal = false, s.T = 70, s.S = 260;
  Case c = dcmha::test::with_launch(s, key_splits(1));
  c.spec.B = 3;
  c.query_lengths = {70, 17, 0};
  c.key_lengths = {260, 131, 3};
  check_case<bf16>(c, seed++);
  c.launch = unordered();
  check_case<half>(c, seed++);
  s.causal = true, s.B = 1, s.T = 80, s.S = 70;
  for (int64_t d : {64, 96, 128}) {
    s.D = s.Dv = d;
    check_case<bf16>(dcmha::test::with_launch(s), seed++);
  }
  s.D = 80, s.Dv = 72;
  check_case<half>(dcmha::test::with_launch(s), seed++);
  // Rows (B H T = 132) ending inside a warp of the row passes: its lanes past them must still
  // take part in the row dots' shuffles.
  s.T = s.S = 33;
  check_case<bf16>(dcmha::test::with_launch(s), seed++);
  // Odd head dims: a lane's pair of dQ columns may straddle two rows of the sums (added one by
  // one), and dK's, dV's and the output's pairs their rows' ends.
  s.D = 33, s.Dv = 31, s.T = 90, s.S = 150;
  check_case<half>(dcmha::test::with_launch(s), seed++);
}

/// The one pass's launch counts after an emulated backward of case c.
template <class T>
dcmha::cuda::emulator::Counters one_pass_counts(const Case& c, uint64_t seed) {
  const dcmha::reference::Problem p = dcmha::test::storage_problem<T>(problem_of(c, seed));
  EmulatedRun<T> run(c, p, dcmha::test::random_dout(p, seed));
  run.forward(c.launch);
  dcmha::cuda::emulator::LaunchLog::get().take();
  run.backward(c.launch);
  dcmha::cuda::emulator::Counters counts;
  for (const auto& [kernel, launch] : dcmha::cuda::emulator::LaunchLog::get().take())
    if (kernel == "backward_one_pass") counts += launch;
  return counts;
}

TEST(CudaKernelsEmulated, OnePassSumsInAFixedOrder) {
  // Deterministic, no block of a launch adds to a dQ sum another block added to (each element's
  // adds come from one thread a round, the rounds in stream order): the same call gives the same
  // bits on any schedule. Unordered, the key blocks of a head add to the same sums.
  ProblemSpec s = tiled_spec();
  s.pre = s.post = SideSpec::none();
  s.D = s.Dv = 32, s.T = s.S = 300;
  for (index_t splits : {0, 1, 2}) {
    const dcmha::cuda::emulator::Counters counts =
        one_pass_counts<bf16>(dcmha::test::with_launch(s, key_splits(splits)), 150);
    EXPECT_GT(counts.blocks, 0u) << splits;
    EXPECT_EQ(counts.unordered_adds, 0u) << splits;
  }
  EXPECT_GT(one_pass_counts<half>(dcmha::test::with_launch(s, unordered()), 151).unordered_adds,
            0u);
}

TEST(CudaKernelsEmulated, MhaTwoSidedBackward) {
  // LaunchOptions::one_pass false: MHA in bf16 and fp16 takes the query side and the key side
  // (the key side streaming 32 query rows), as it does without the output or at head dim 256.
  ProblemSpec s = tiled_spec();
  s.pre = s.post = SideSpec::none();
  s.D = 16, s.Dv = 24;
  LaunchOptions two_sided;
  two_sided.one_pass = false;
  uint64_t seed = 160;
  check_case<bf16>(dcmha::test::with_launch(s, two_sided), seed++);
  check_case<half>(dcmha::test::with_launch(s, two_sided), seed++);
  s.window = 5, s.T = 45, s.S = 40;
  check_case<bf16>(dcmha::test::with_launch(s, two_sided), seed++);
  s.window = 0, s.T = 40, s.S = 45;
  Case c = dcmha::test::with_launch(s, two_sided);
  c.launch.rows = 64;
  c.spec.B = 3;
  c.query_lengths = {40, 17, 0};
  c.key_lengths = {45, 30, 3};
  check_case<half>(c, seed++);
  s.T = 33, s.S = 36, s.B = 1, s.D = s.Dv = 128;
  check_case<bf16>(dcmha::test::with_launch(s, two_sided), seed++);
}

TEST(CudaKernelsEmulated, MasksAndWindows) {
  ProblemSpec s = tiled_spec();
  struct Mask {
    bool causal;
    int64_t window, T, S;
  };
  // S < T with causal: the first rows see no key (lse -inf, zero output and gradients).
  const Mask masks[] = {{false, 0, 17, 40}, {true, 0, 40, 21}, {true, 3, 37, 45},
                        {false, 2, 18, 18}, {true, 1, 35, 35}, {true, 40, 26, 71}};
  uint64_t seed = 100;
  for (const Mask& m : masks) {
    s.causal = m.causal, s.window = m.window, s.T = m.T, s.S = m.S;
    check_case<float>(dcmha::test::with_launch(s), seed++);
  }
  s.causal = true, s.window = 9, s.T = 40, s.S = 70;
  check_case<bf16>(dcmha::test::with_launch(s), seed++);
}

TEST(CudaKernelsEmulated, PerSequenceLengths) {
  ProblemSpec s = tiled_spec();
  s.B = 3;
  Case c = dcmha::test::with_launch(s);
  // A full sequence, a padded one, and one with no query rows (all padding); padding holds NaN.
  c.query_lengths = {37, 20, 0};
  c.key_lengths = {45, 30, 3};
  check_case<float>(c, 200);
  c.spec.causal = false;
  c.spec.window = 2;
  c.query_lengths = {3, 37, 1};
  c.key_lengths = {0, 45, 2};  // a sequence without keys: every row sees none
  check_case<float>(c, 201);
  c.spec.D = c.spec.Dv = 16;
  check_case<bf16>(c, 202);
}

TEST(CudaKernelsEmulated, TilesAndClusters) {
  // A group of 8 heads split over clusters of 1 to 8 blocks (each composing its slice of the
  // rows for all heads through its peers' shared memory), with tiles of 16 to 64 rows. Sanitized,
  // shorter (the suite's longest test there), with a partial last tile of rows and keys still.
  ProblemSpec s = tiled_spec();
  s.H = 8, s.Hk = 4, s.G = 1;
  s.T = dcmha::test::sanitized_or(40, 50), s.S = dcmha::test::sanitized_or(40, 66);
  uint64_t seed = 300;
  for (int cluster : {1, 2, 4, 8})
    for (index_t rows : {16, 32, 64}) {
      if (rows * 8 / cluster / 16 > 8) continue;  // more than 8 warps
      check_case<float>(dcmha::test::with_launch(s, tiles(rows, cluster)), seed++);
    }
  s.D = s.Dv = 32;
  check_case<bf16>(dcmha::test::with_launch(s, tiles(32, 4)), seed++);
}

/// What plan(config, problem) makes of case c's emulated run in storage type T.
template <class T, class Plan>
auto plan_of(const Case& c, Plan&& plan) {
  const dcmha::reference::Problem p = dcmha::test::storage_problem<T>(problem_of(c, 0));
  EmulatedRun<T> run(c, p, dcmha::test::random_dout(p, 0));
  return plan(run.cfg, run.tp);
}

/// The forward plan of case c in storage type T.
template <class T>
dcmha::cuda::ForwardLaunch forward_plan(const Case& c) {
  return plan_of<T>(c, [&](const auto& cfg, TypedProblem<T>& tp) {
    return dcmha::cuda::forward_launch(
        "plan",
        dcmha::detail::forward_params("plan", cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(),
                                      tp.compose()),
        c.launch);
  });
}

/// Tiles as given, split_scores as chosen.
LaunchOptions split_tiles(index_t splits, dcmha::cuda::SplitScores scores, index_t rows = 0,
                          int cluster = 0) {
  LaunchOptions o = tiles(rows, cluster, splits);
  o.split_scores = scores;
  return o;
}

TEST(CudaKernelsEmulated, StatisticsKeptByComposeLanes) {
  // Where a block's threads take all of its slice's compose items at once (bf16 and fp16, M = 8,
  // 16, 32, ...), the statistics pass keeps each lane's log-sum-exp by key column and merges them
  // at its end: a group of 8 heads over every cluster and tile, with partial tiles of rows and
  // keys, static W (composed out of place), a window, rows that see no key, split keys (more
  // splits than key tiles: empty shares).
  ProblemSpec s = tiled_spec();
  s.H = 8, s.Hk = 4, s.G = 1, s.D = s.Dv = 16;
  s.T = 40, s.S = 50;
  uint64_t seed = 320;
  const auto check = [&](bool half_storage, const Case& c) {
    const dcmha::cuda::ForwardLaunch l =
        half_storage ? forward_plan<half>(c) : forward_plan<bf16>(c);
    ASSERT_EQ(l.geo.mode, dcmha::cuda::ForwardMode::two_pass) << c.str();
    ASSERT_EQ(l.head_dim, 32) << c.str();
    ASSERT_TRUE(l.geo.slice_in_one_round(dcmha::cuda::kForwardItemRows<bf16, 32>)) << c.str();
    if (half_storage)
      check_case<half>(c, seed++);
    else
      check_case<bf16>(c, seed++);
  };
  bool half_storage = false;
  for (int cluster : {1, 2, 4, 8})
    for (index_t rows : {16, 32, 64}) {
      if (rows * 8 / cluster / 16 > 8) continue;  // more than 8 warps
      s.pre = half_storage ? SideSpec::all() : SideSpec::dynamic();
      s.post = SideSpec::dynamic();
      check(half_storage, dcmha::test::with_launch(s, tiles(rows, cluster)));
      half_storage = !half_storage;
    }
  s.window = 7;
  Case c = dcmha::test::with_launch(s, tiles(32, 8));
  c.query_lengths = {40, 0};
  c.key_lengths = {50, 9};
  check(true, c);
  s.window = 0, s.T = 20, s.S = 150;
  check(false,
        dcmha::test::with_launch(s, split_tiles(7, dcmha::cuda::SplitScores::recomputed, 16, 4)));
}

/// The backward plan of case c in storage type T, given the forward's output.
template <class T>
dcmha::cuda::BackwardLaunch backward_plan(const Case& c) {
  return plan_of<T>(c, [&](const auto& cfg, TypedProblem<T>& tp) {
    return dcmha::cuda::backward_launch(
        "plan",
        dcmha::detail::backward_params("plan", cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(),
                                       tp.dq(), tp.dk(), tp.dv(), tp.compose(), tp.dcompose(),
                                       dcmha::TensorView<const T, 4>(tp.out())),
        c.launch);
  });
}

TEST(CudaKernelsEmulated, RowDotsSummedByComposeLanes) {
  // With Compose_post (or without the forward's output) the query side's first pass sums P dP
  // where the compose lanes make it, over every key tile, and sends each sum to its owner once:
  // in the lanes' registers where each keeps its row in every round (bf16 and fp16, the rounds
  // splitting the keys evenly: ComposeRegion::rows_held), else in the block's shared memory.
  // Compose_post alone (W, query-wise, key-wise, all three) over every cluster of an 8-head group
  // (2 rounds), partial tiles of rows and keys, a window, rows that see no key, GQA; a group of 4
  // heads (4 rounds); of 6 (3 rounds over 16 keys: items dealt in order, the sums in shared
  // memory, the query-wise weights reloaded every round); float MHA without the output (16).
  ProblemSpec s = tiled_spec();
  s.H = 8, s.Hk = 4, s.G = 1, s.D = s.Dv = 16;
  s.T = 40, s.S = 50;
  s.pre = SideSpec::none();
  uint64_t seed = 340;
  const auto check = [&](auto storage, const Case& c, int rounds, bool with_output = true,
                         bool rows_held = true) {
    using T = decltype(storage);
    const dcmha::cuda::BackwardGeometry g = backward_plan<T>(c).query;
    ASSERT_FALSE(g.registers) << c.str();
    const dcmha::cuda::ComposeRegion region{0, g.slice, 0, g.slice_keys};
    const int items = dcmha::cuda::compose_items(region, g.compose_parts, 1);
    ASSERT_EQ((items + g.threads() - 1) / g.threads(), rounds) << c.str();
    ASSERT_EQ(g.slice_keys % rounds == 0, rows_held) << c.str();
    check_case<T>(c, seed++, dcmha::test::Layout::bhtd, with_output);
  };
  const SideSpec posts[] = {
      SideSpec::dynamic(), {true, false, false}, {false, true, false}, SideSpec::all()};
  int i = 0;
  for (int cluster : {1, 2, 4, 8}) {
    s.post = posts[i++ % 4];
    const Case c = dcmha::test::with_launch(s, tiles(cluster == 1 ? 16 : 32, cluster));
    if (cluster % 2 == 0)
      check(bf16{}, c, 2);
    else
      check(half{}, c, 2);
  }
  s.post = SideSpec::dynamic(), s.window = 7;
  Case c = dcmha::test::with_launch(s, tiles(16, 4));
  c.query_lengths = {40, 0};
  c.key_lengths = {50, 9};
  check(half{}, c, 2);
  s.window = 0, s.H = 4, s.Hk = 2;
  check(bf16{}, dcmha::test::with_launch(s, tiles(16, 2)), 4);
  s.H = 6, s.Hk = 3;
  check(bf16{}, dcmha::test::with_launch(s, tiles(16, 2)), 3, true, false);
  s.post = SideSpec::none(), s.H = 4, s.Hk = 4, s.T = 20;
  check(float{}, dcmha::test::with_launch(s, tiles(16)), 16, false);
}

TEST(CudaKernelsEmulated, KeysSplitAcrossBlocks) {
  // The split forward (decode's shape: few query tiles, many keys): statistics per share,
  // combined, then P'V per share, summed. More splits than key tiles leave shares empty. The
  // values launch recomputes the composed scores from K or reads those the statistics launch
  // kept (tiles whose rows and keys a cluster's blocks compose in slices, windows, static W).
  using dcmha::cuda::SplitScores;
  ProblemSpec s = tiled_spec();
  s.T = 5, s.S = 200;
  uint64_t seed = 350;
  for (index_t splits : {2, 9})
    for (bool window : {false, true})
      for (SplitScores scores : {SplitScores::recomputed, SplitScores::kept}) {
        s.window = window ? 70 : 0;
        check_case<float>(dcmha::test::with_launch(s, split_tiles(splits, scores)), seed++);
      }
  Case c = dcmha::test::with_launch(s, split_tiles(4, SplitScores::kept));
  c.spec.B = 3, c.spec.D = c.spec.Dv = 16;
  c.query_lengths = {5, 2, 0};
  c.key_lengths = {200, 150, 40};
  check_case<bf16>(c, seed++);
  c.launch.split_scores = SplitScores::recomputed;
  check_case<half>(c, seed++);
  s = tiled_spec();
  s.H = 8, s.Hk = 4, s.G = 1, s.T = 20, s.S = 150;
  check_case<float>(dcmha::test::with_launch(s, split_tiles(3, SplitScores::kept, 16, 4)), seed++);
}

/// The counts of the split forward's values launch of case c.
template <class T>
dcmha::cuda::emulator::Counters split_values_counts(const Case& c, uint64_t seed) {
  const dcmha::reference::Problem p = dcmha::test::storage_problem<T>(problem_of(c, seed));
  EmulatedRun<T> run(c, p, dcmha::test::random_dout(p, seed));
  dcmha::cuda::emulator::Counting::enabled() = true;
  dcmha::cuda::emulator::LaunchLog::get().take();
  run.forward(c.launch);
  dcmha::cuda::emulator::Counters counts;
  for (const auto& [kernel, launch] : dcmha::cuda::emulator::LaunchLog::get().take())
    if (kernel == "forward_split_values") counts += launch;
  dcmha::cuda::emulator::Counting::enabled() = false;
  return counts;
}

TEST(CudaKernelsEmulated, KeptScoresSpareTheValuesLaunchK) {
  // Kept scores: the values launch runs no QK^T (its tensor-core products are P'V's alone) and
  // reads at least K's bytes fewer, less the kept floats it reads instead.
  using dcmha::cuda::SplitScores;
  ProblemSpec s = tiled_spec();
  s.T = 1, s.S = 256, s.D = s.Dv = 32, s.Hk = s.H;
  const auto kept = split_values_counts<bf16>(
      dcmha::test::with_launch(s, split_tiles(2, SplitScores::kept)), 360);
  const auto recomputed = split_values_counts<bf16>(
      dcmha::test::with_launch(s, split_tiles(2, SplitScores::recomputed)), 360);
  ASSERT_GT(kept.mma, 0u);
  EXPECT_EQ(2 * kept.mma, recomputed.mma);  // QK^T and P'V of equal depth: D = Dv
  const std::uint64_t k_bytes = s.B * s.Hk * s.S * s.D * sizeof(bf16);
  EXPECT_LE(kept.global_load_bytes + k_bytes,
            recomputed.global_load_bytes + s.B * s.H * s.T * (s.S + dcmha::cuda::kKeys) * 4);
}

TEST(CudaKernelsEmulated, ShapesOfTheHeads) {
  uint64_t seed = 400;
  ProblemSpec s = tiled_spec();
  s.G = 4, s.H = 4, s.Hk = 1;  // M = 1, MQA
  check_case<float>(dcmha::test::with_launch(s), seed++);
  s = tiled_spec();
  s.H = 6, s.Hk = 3, s.G = 1, s.Rq = 4, s.Rk = 3, s.D = 7, s.Dv = 9;  // ranks above 2, Dv > D
  check_case<float>(dcmha::test::with_launch(s), seed++);
  s = tiled_spec();
  s.H = 8, s.Hk = 8, s.G = 2, s.Rq = 1, s.Rk = 2, s.causal = false;
  s.scale = 0.7;
  check_case<float>(dcmha::test::with_launch(s), seed++);
}

TEST(CudaKernelsEmulated, HeadDimClasses) {
  // The tensor-core path at the head dims of the official checkpoints and beyond: 64, 80
  // (DCFormer-2.8B, padded to 96), 96, 128, 256; D != Dv.
  ProblemSpec s = tiled_spec();
  s.T = 20, s.S = 36, s.B = 1;
  uint64_t seed = 450;
  for (int64_t d : {64, 80, 96, 128, 256}) {
    s.D = s.Dv = d;
    check_case<bf16>(dcmha::test::with_launch(s), seed++);
  }
  s.D = 80, s.Dv = 64;
  check_case<half>(dcmha::test::with_launch(s), seed++);
}

TEST(CudaKernelsEmulated, StridedViewsAndUnalignedRows) {
  // (B, T, H, D) views as a fused QKV projection leaves them: rows of 8 bf16 (16 bytes) go by
  // cp.async, rows of 5 (10 bytes) element by element; both read the caller's strides.
  ProblemSpec s = tiled_spec();
  s.D = 8, s.Dv = 16;
  check_case<bf16>(dcmha::test::with_launch(s), 500, dcmha::test::Layout::bthd);
  s.D = 5, s.Dv = 3;
  check_case<float>(dcmha::test::with_launch(s), 501, dcmha::test::Layout::bthd);
}

TEST(CudaKernelsEmulated, OfficialConfigurationShape) {
  // DCFormer's attention: 32 heads in one group, rank 2 on both sides, every dynamic term on,
  // bf16, the planned cluster (8 blocks of 4 heads each).
  ProblemSpec s;
  s.B = 1, s.H = 32, s.Hk = 32, s.G = 1, s.T = 20, s.S = 20, s.D = 32, s.Dv = 32, s.Rq = 2,
  s.Rk = 2;
  s.causal = true;
  s.pre = s.post = SideSpec::dynamic();
  check_case<bf16>(dcmha::test::with_launch(s), 550);
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

TEST(CudaKernelsEmulated, BitwiseTheSameFromRunToRun) {
  // Each element's sums run in a fixed order and nothing is atomic: the same launch gives the
  // same bits (the emulator's lanes also run in a fixed order, so this checks the kernels, not
  // the schedule).
  ProblemSpec s = tiled_spec();
  s.H = 8, s.Hk = 4, s.G = 1;
  const Case c = dcmha::test::with_launch(s, tiles(16, 4, 2));
  const dcmha::reference::Problem p = problem_of(c, 600);
  const std::vector<double> dout = dcmha::test::random_dout(p, 600);
  EXPECT_EQ(dcmha::test::first_bitwise_difference(emulated_results<float>(c, p, dout),
                                                  emulated_results<float>(c, p, dout)),
            -1);
}

/// The planned forward and backward of the official DCMHA (bf16, one group of 32 heads, D = Dv
/// = 128, rank 2) on a device with `limits`: B sequences of T rows over S keys (0: T).
dcmha::cuda::ForwardLaunch official_forward(const dcmha::cuda::DeviceLimits& limits,
                                            index_t T = 4096, index_t B = 4, index_t S = 0) {
  dcmha::detail::ForwardParams<bf16> p;
  p.dims = {B, 32, 32, T, S > 0 ? S : T, 128, 128, 1, 32};
  for (auto* side : {&p.compose.pre, &p.compose.post}) {
    side->query_wise = side->key_wise = true;
    side->qw1.shape[3] = side->kw1.shape[3] = 2;
  }
  LaunchOptions opt;
  opt.device = limits;
  return dcmha::cuda::forward_launch("plan", p, opt);
}

TEST(CudaKernelsEmulated, LaunchPlans) {
  using dcmha::cuda::DeviceLimits;
  // The official DCMHA on an sm_90: its 32 heads split over a cluster of 8 blocks (4 heads each),
  // two passes, within the shared memory.
  const dcmha::cuda::ForwardLaunch official = official_forward(DeviceLimits::sm90());
  EXPECT_EQ(official.geo.mode, dcmha::cuda::ForwardMode::two_pass);
  EXPECT_EQ(official.geo.cluster, 8);
  EXPECT_EQ(official.geo.own_heads, 4);
  EXPECT_GE(official.geo.rows, 16);
  EXPECT_LE(official.blocks.shared_bytes(), DeviceLimits::sm90().shared_bytes);
  EXPECT_EQ(official.geo.splits, 1);
  EXPECT_FALSE(official.geo.scores_kept);
  // Its compose lanes take a block's slice at once: they keep the row statistics by key column.
  EXPECT_TRUE(official.geo.slice_in_one_round(dcmha::cuda::kForwardItemRows<bf16, 128>));
  // Its decode step (B = 8, one new row over 4096 keys) splits the keys and keeps the composed
  // scores for the values launch (their floats a 64th of K's bytes); 64 new rows recompute them.
  const dcmha::cuda::ForwardLaunch step = official_forward(DeviceLimits::sm90(), 1, 8, 4096);
  EXPECT_GT(step.geo.splits, 1);
  EXPECT_TRUE(step.geo.scores_kept);
  const dcmha::cuda::ForwardLaunch chunk = official_forward(DeviceLimits::sm90(), 64, 8, 4096);
  EXPECT_GT(chunk.geo.splits, 1);
  EXPECT_FALSE(chunk.geo.scores_kept);
  // Without clusters (sm_80) 32 heads' tiles do not fit one block: a clear error.
  try {
    official_forward(DeviceLimits::sm80());
    FAIL() << "expected dcmha::Error";
  } catch (const dcmha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tile of at least 16 rows fits"), std::string::npos)
        << e.what();
  }
  // MHA in bf16: the registers path, the tallest tiles; its decode (T = 1, B = 8, 4096 keys)
  // splits the keys.
  dcmha::detail::ForwardParams<bf16> mha;
  mha.dims = {4, 32, 32, 4096, 4096, 128, 128, 32, 1};
  const dcmha::cuda::ForwardLaunch m = dcmha::cuda::forward_launch("plan", mha);
  EXPECT_EQ(m.geo.mode, dcmha::cuda::ForwardMode::registers);
  EXPECT_EQ(m.geo.cluster, 1);
  EXPECT_EQ(m.geo.rows, 128);
  EXPECT_EQ(m.geo.warp_rows, 32);  // FlashAttention-2's warps: 4 of 32 rows
  EXPECT_EQ(m.geo.warps, 4);
  EXPECT_EQ(official.geo.warp_rows, 16);  // compose items take the warps' rows 16 at a time
  mha.dims.D = mha.dims.Dv = 256;         // 32 rows' accumulators would not fit the registers
  EXPECT_EQ(dcmha::cuda::forward_launch("plan", mha).geo.warp_rows, 16);
  mha.dims.D = mha.dims.Dv = 128;
  mha.dims = {1, 32, 32, 1, 4096, 128, 128, 32, 1};
  EXPECT_GT(dcmha::cuda::forward_launch("plan", mha).geo.splits, 1);
  // The official backward fits both sides.
  dcmha::detail::BackwardParams<bf16> b;
  b.dims = {4, 32, 32, 4096, 4096, 128, 128, 1, 32};
  for (auto* side : {&b.compose.pre, &b.compose.post}) {
    side->query_wise = side->key_wise = true;
    side->qw1.shape[3] = side->kw1.shape[3] = 2;
  }
  const dcmha::cuda::BackwardLaunch bl = dcmha::cuda::backward_launch("plan", b);
  EXPECT_GT(bl.query.cluster, 1);
  EXPECT_GT(bl.key.cluster, 1);
  EXPECT_EQ(official.geo.compose_parts, 4);
}

TEST(CudaKernelsEmulated, ComposeItemsFitALane) {
  // Compose items: a lane keeps at most kCachedHeads heads' values (for every group a plan can
  // hold: up to 8 own heads times a cluster of up to 16 blocks), on parts dividing M and a warp.
  for (int M = 1; M <= 128; ++M)
    for (int cluster = 1; cluster <= 16; cluster *= 2) {
      if (M % cluster != 0 || M / cluster > dcmha::cuda::kMaxWarps) continue;
      for (int slice_rows : {1, 2, 4, 8, 16, 32, 64, 128})
        for (int item_rows : {1, 2}) {
          const int slice_keys = dcmha::cuda::kKeys / dcmha::cuda::key_slices_of(cluster);
          const int parts = dcmha::cuda::compose_parts(M, slice_rows, slice_keys, 256, item_rows);
          EXPECT_EQ(M % parts, 0) << M;
          EXPECT_EQ(dcmha::cuda::kWarpSize % parts, 0) << M;
          EXPECT_LE(M / parts, dcmha::cuda::kCachedHeads)
              << M << " heads, " << slice_rows << " rows";
        }
    }
}

/// The block as compose_item sees it.
struct ComposeLanes {
  int thread_index = 0, count = 0;
  int thread() const { return thread_index; }
  int threads() const { return count; }
};

/// The region's position and head part of a one-row item of 8 heads, -1 where it is none.
int position_of(const dcmha::cuda::ComposeItem& it, const dcmha::cuda::ComposeRegion& region,
                int parts) {
  const int row = it.row0 - region.row_begin, key = it.key - region.key_begin;
  const bool inside = row >= 0 && row < region.rows && key >= 0 && key < region.keys;
  if (!inside || it.part >= parts || it.rows != 1 || it.heads != 8) return -1;
  return (row * region.keys + key) * parts + it.part;
}

/// Deals a region's one-row items (8 heads a lane) to `threads` lanes and checks that every
/// position and head part is one lane's item in one round, at an index of its own below the
/// region's items; where rows are held, that each lane keeps its row and validity. Returns
/// whether they were.
bool check_items_dealt_once(int threads, int parts, const dcmha::cuda::ComposeRegion& region) {
  const int items = dcmha::cuda::compose_items(region, parts, 1);
  const int rounds = (items + threads - 1) / threads;
  const bool held = region.rows_held && rounds > 1 && region.keys % rounds == 0;
  const std::string plan = "threads " + std::to_string(threads) + ", parts " +
                           std::to_string(parts) + ", " + std::to_string(region.rows) + " x " +
                           std::to_string(region.keys) + (region.rows_held ? ", rows held" : "");
  std::vector<int> seen(items, 0), at_index(items, 0);
  for (int t = 0; t < threads; ++t) {
    const ComposeLanes lanes{t, threads};
    const auto first = dcmha::cuda::compose_item<1>(lanes, region, 8 * parts, parts, 0);
    for (int round = 0; round < rounds; ++round) {
      const auto it = dcmha::cuda::compose_item<1>(lanes, region, 8 * parts, parts, round);
      const std::string where =
          plan + ", round " + std::to_string(round) + ", thread " + std::to_string(t);
      EXPECT_EQ(it.rows_held, held || rounds == 1) << where;
      EXPECT_TRUE(!held || (it.valid == first.valid && it.row0 == first.row0)) << where;
      if (!it.valid) continue;
      const int position = position_of(it, region, parts);
      EXPECT_TRUE(position >= 0 && it.index >= 0 && it.index < items) << where;
      if (::testing::Test::HasFailure()) return held;
      ++seen[position];
      ++at_index[it.index];
    }
  }
  for (int i = 0; i < items; ++i)
    EXPECT_TRUE(seen[i] == 1 && at_index[i] == 1) << plan << ": item " << i;
  return held;
}

TEST(CudaKernelsEmulated, ComposeItemsDealtOnceWithRowsHeld) {
  // Either order deals every item once; with rows held (one-row items, the keys split evenly
  // among two rounds or more) each lane keeps its row from round to round.
  int held_plans = 0;
  for (int threads : {32, 64, 128, 256})
    for (int parts : {1, 2, 4, 8})
      for (int rows : {1, 3, 8, 16})
        for (int keys : {1, 4, 8, 12, 32})
          for (bool rows_held : {false, true})
            held_plans +=
                check_items_dealt_once(threads, parts, {2, rows, 5, keys, 0, 0, rows_held});
  EXPECT_GT(held_plans, 50);
}

TEST(CudaKernelsEmulated, OnePassPlans) {
  // MHA's one-pass backward: where the call allows it (one_pass, by default), the tensor cores
  // take the storage type, the forward's output is given, there is no compose term and the head
  // dim is at most 128. Deterministic, as many key splits as batch x heads fit in kOnePassBlocks
  // blocks, each split its own dQ sums; unordered, a block per (128 keys, head, sequence).
  static const bf16 given_output{};
  dcmha::detail::BackwardParams<bf16> b;
  b.dims = {4, 32, 32, 4096, 4096, 128, 128, 32, 1};
  b.out.data = &given_output;
  const dcmha::cuda::BackwardLaunch l = dcmha::cuda::backward_launch("plan", b);
  ASSERT_TRUE(l.one_pass);
  EXPECT_EQ(l.key.rows, dcmha::cuda::kOnePassKeys);
  EXPECT_EQ(l.key.stream_rows, dcmha::cuda::kOnePassRows);
  EXPECT_EQ(l.key_blocks.shape.x, 1);  // 128 heads and sequences fill a wave of 132 blocks
  EXPECT_EQ(l.key.key_splits, 1);
  EXPECT_EQ(l.key_rounds, 4096 / 128);  // a launch per key block
  EXPECT_TRUE(l.key.split_sums);
  EXPECT_EQ(l.key_blocks.shape.y, 32);
  EXPECT_EQ(l.key_blocks.shape.z, 4);
  EXPECT_EQ(l.key_blocks.shape.threads, 256);
  EXPECT_LE(l.key_blocks.shared_bytes(), dcmha::cuda::DeviceLimits::sm90().shared_bytes);
  EXPECT_EQ(l.row_passes.shape.x, 4 * 32 * 4096 / dcmha::cuda::kRowPassRows);
  EXPECT_EQ(dcmha::cuda::backward_scratch_sizes(b.dims, l).dq_sum, index_t(4) * 32 * 4096 * 128);
  LaunchOptions unordered;
  unordered.deterministic = false;
  const dcmha::cuda::BackwardLaunch u = dcmha::cuda::backward_launch("plan", b, unordered);
  ASSERT_TRUE(u.one_pass);
  EXPECT_EQ(u.key_blocks.shape.x, 4096 / 128);
  EXPECT_EQ(u.key_rounds, 1);
  EXPECT_FALSE(u.key.split_sums);
  EXPECT_EQ(dcmha::cuda::backward_scratch_sizes(b.dims, u).dq_sum, index_t(4) * 32 * 4096 * 128);
}

TEST(CudaKernelsEmulated, OnePassKeySplitsAndWhereItRuns) {
  // Splits: as forced, at most one per key block; few heads, 132 blocks' worth, at most 16 and
  // one per key block; more heads than 132, one. The one pass only where it applies.
  static const bf16 given_output{};
  dcmha::detail::BackwardParams<bf16> b;
  b.dims = {4, 32, 32, 4096, 4096, 128, 128, 32, 1};
  b.out.data = &given_output;
  LaunchOptions forced;
  forced.key_splits = 5;
  const dcmha::cuda::BackwardLaunch five = dcmha::cuda::backward_launch("plan", b, forced);
  EXPECT_EQ(five.key.key_splits, 5);
  EXPECT_EQ(five.key_rounds, 7);  // 32 key blocks
  dcmha::detail::BackwardParams<bf16> few = b;
  few.dims.B = 1, few.dims.H = few.dims.Hk = 4, few.dims.G = 4;
  EXPECT_EQ(dcmha::cuda::backward_launch("plan", few).key.key_splits, 16);  // the most
  few.dims.H = few.dims.Hk = few.dims.G = 12;
  EXPECT_EQ(dcmha::cuda::backward_launch("plan", few).key.key_splits, 11);  // 132 / 12 heads
  few.dims.T = few.dims.S = 1000;
  EXPECT_EQ(dcmha::cuda::backward_launch("plan", few).key.key_splits, 8);  // 1000 / 128 keys
  few.dims.H = few.dims.Hk = few.dims.G = 160;
  EXPECT_EQ(dcmha::cuda::backward_launch("plan", few).key.key_splits, 1);
  forced.key_splits = 1000;
  EXPECT_EQ(dcmha::cuda::backward_launch("plan", b, forced).key.key_splits, 32);
  auto without = [&](auto&& change, LaunchOptions opt = {}) {
    dcmha::detail::BackwardParams<bf16> c = b;
    change(c);
    return dcmha::cuda::backward_launch("plan", c, opt).one_pass;
  };
  LaunchOptions two_sided;
  two_sided.one_pass = false;
  EXPECT_FALSE(without([](auto&) {}, two_sided));
  EXPECT_FALSE(without([](auto& c) { c.out.data = nullptr; }));
  EXPECT_FALSE(without([](auto& c) { c.dims.D = c.dims.Dv = 256; }));
  EXPECT_FALSE(without([](auto& c) { c.compose.pre.query_wise = true; }));
  dcmha::detail::BackwardParams<float> f;
  f.dims = b.dims;
  static const float given_float_output = 0;
  f.out.data = &given_float_output;
  EXPECT_FALSE(dcmha::cuda::backward_launch("plan", f).one_pass);
}

TEST(CudaKernelsEmulated, DecodeStepsAreTheForwardRows) {
  // The forward kernel over a DecodeCache's slots (a ring for the windowed layer, which wraps
  // here), step by step with uneven counts: its rows are the full causal forward's.
  ProblemSpec s = tiled_spec();
  s.T = s.S = 40;
  for (int64_t window : {int64_t(0), int64_t(20)}) {
    s.window = window;
    const Case c = dcmha::test::with_launch(s);
    SCOPED_TRACE(c.str());
    const dcmha::reference::Problem p = problem_of(c, 1000 + window);
    dcmha::DecodeCache<float> cache(dcmha::test::cache_config(p, 40, 24));
    dcmha::AttentionConfig cfg;
    cfg.mask = dcmha::Mask::causal;
    cfg.window = window;
    const dcmha::test::DecodeSchedule schedule = {{17, 9}, {1, 14}, {3, 0}, {1, 5}, {18, 12}};
    // Odd steps split the keys across blocks, as decode's plan does for long caches, the first
    // of them keeping the composed scores for the values launch, the second recomputing them.
    int64_t step = 0;
    const auto outs = dcmha::test::decode_steps_with<float>(
        p, schedule, [&](const dcmha::test::DecodeStepTensors<float>& x) {
          cache.append(x.k, x.v, x.key_side, x.counts);
          LaunchOptions launch = c.launch;
          launch.key_splits = step % 2 ? 3 : 1;
          launch.split_scores = step++ % 4 == 1 ? dcmha::cuda::SplitScores::kept
                                                : dcmha::cuda::SplitScores::recomputed;
          dcmha::cuda::emulate::decode<float>(cfg, x.q, cache, x.query_side, x.out, launch);
        });
    int64_t padding_nonzero = 0;
    const std::vector<double> rows = dcmha::test::assemble_rows(p, schedule, outs, padding_nonzero);
    EXPECT_LE(dcmha::test::max_rel_error(dcmha::reference::forward(p), rows), 2e-4);
    EXPECT_EQ(padding_nonzero, 0);
  }
}

/// The message of the dcmha::Error a call throws, or "" if none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const dcmha::Error& e) {
    return e.what();
  }
  return "";
}

TEST(CudaKernelsEmulated, BadArgumentsAreClearErrors) {
  const dcmha::reference::Problem p = problem_of(dcmha::test::with_launch(tiled_spec()), 800);
  TypedProblem<float> tp(p);
  dcmha::AttentionConfig cfg = tp.config();
  cfg.window = -1;
  EXPECT_NE(error_of([&] {
              dcmha::cuda::emulate::forward<float>(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(),
                                                   tp.compose());
            }).find("dcmha::cuda::emulate::forward: cfg.window: expected >= 0"),
            std::string::npos);
  // Head dims past the largest class, ranks past kMaxRank.
  ProblemSpec s = tiled_spec();
  s.D = 300;
  TypedProblem<float> wide(dcmha::test::random_problem(s, 801));
  EXPECT_NE(error_of([&] {
              dcmha::cuda::emulate::forward<float>(wide.config(), wide.q(), wide.k(), wide.v(),
                                                   wide.out(), {}, wide.compose());
            }).find("head dim 300 (max of D and Dv): expected at most 256"),
            std::string::npos);
  s = tiled_spec();
  s.Rq = 5;
  TypedProblem<float> ranked(dcmha::test::random_problem(s, 802));
  EXPECT_NE(error_of([&] {
              dcmha::cuda::emulate::forward<float>(ranked.config(), ranked.q(), ranked.k(),
                                                   ranked.v(), ranked.out(), {}, ranked.compose());
            }).find("compose rank R 5: expected at most 4"),
            std::string::npos);
  // Sequences of 2^31 keys (planned only: the kernels index keys in 32 bits).
  dcmha::detail::ForwardParams<bf16> huge;
  huge.dims = {1, 1, 1, 16, index_t(1) << 31, 64, 64, 1, 1};
  EXPECT_NE(error_of([&] {
              dcmha::cuda::forward_launch("plan", huge);
            }).find("plan: sequence lengths T = 16, S = 2147483648: expected below 2^31"),
            std::string::npos);
  dcmha::detail::BackwardParams<bf16> huge_backward;
  huge_backward.dims = huge.dims;
  EXPECT_NE(error_of([&] {
              dcmha::cuda::backward_launch("plan", huge_backward);
            }).find("expected below 2^31 on the CUDA backend"),
            std::string::npos);
}

}  // namespace

// The production forward/backward (include/dcmha/cpu) against the test reference, on random
// problems over every switch and shape parameter, and on the edges of the kernels' tiling.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <dcmha/dcmha.hpp>

#include "reference/reference.hpp"
#include "support/problem.hpp"
#include "support/runs.hpp"

namespace {

using dcmha::test::Layout;
using dcmha::test::ProblemSpec;
using dcmha::test::round_to;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;
using dcmha::test::with_gradients;

template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, double> ? 1e-9 : 2e-4;
}

/// Runs forward and backward of the production path with each thread count and compares every
/// output and gradient with the reference, computed once.
template <class T>
void check_against_reference(const ProblemSpec& spec, uint64_t seed,
                             std::initializer_list<int> thread_counts,
                             Layout layout = Layout::bhtd) {
  const dcmha::reference::Problem p = dcmha::test::random_problem(spec, seed);
  const std::vector<double> dout = dcmha::test::random_dout(p, seed);
  const auto [expected_out, expected] = dcmha::reference::forward_and_backward(p, dout);
  for (int threads : thread_counts) {
    SCOPED_TRACE(spec.str() + " threads=" + std::to_string(threads) +
                 (layout == Layout::bthd ? " bthd" : " bhtd") + " seed=" + std::to_string(seed));
    TypedProblem<T> tp(p, layout);
    tp.num_threads = threads;
    tp.set_dout(dout);
    dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
    EXPECT_LE(dcmha::test::max_rel_error(expected_out, tp.out_values()), tolerance<T>()) << "out";
    dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                    tp.dv(), tp.compose(), tp.dcompose());
    for (const auto& e : dcmha::test::gradient_errors(expected, tp.gradients()))
      EXPECT_LE(e.rel, tolerance<T>()) << e.name;
  }
}

template <class T>
void check_against_reference(const ProblemSpec& spec, uint64_t seed, int threads,
                             Layout layout = Layout::bhtd) {
  check_against_reference<T>(spec, seed, {threads}, layout);
}

/// The first index at which a and b differ bit for bit (or where the shorter one ends), -1 if
/// they are the same.
int64_t first_bitwise_difference(const std::vector<double>& a, const std::vector<double>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) return int64_t(i);
  return a.size() == b.size() ? -1 : int64_t(n);
}

SideSpec side_from_bits(unsigned bits) { return {bool(bits & 1), bool(bits & 2), bool(bits & 4)}; }

/// Random shapes and switches, small enough for the reference. Sizes are drawn around the
/// kernels' internal boundaries (16-key thread split, 32-key compose chunk, 64-key dV tile).
ProblemSpec random_spec(dcmha::test::Rng& rng) {
  auto pick = [&](std::initializer_list<int64_t> xs) {
    return *(xs.begin() + int64_t(rng.uniform() * xs.size()));
  };
  ProblemSpec s;
  s.B = pick({1, 2});
  s.H = pick({1, 2, 4, 6, 8});
  std::vector<int64_t> divisors;
  for (int64_t x = 1; x <= s.H; ++x)
    if (s.H % x == 0) divisors.push_back(x);
  auto pick_div = [&] { return divisors[size_t(rng.uniform() * divisors.size())]; };
  s.Hk = pick_div();
  s.G = pick_div();
  s.T = pick({1, 2, 7, 16, 17, 31, 33, 40});
  s.S = rng.uniform() < 0.4 ? s.T : pick({1, 3, 15, 16, 17, 32, 33, 63, 65});
  s.D = pick({1, 4, 8, 12});
  s.Dv = rng.uniform() < 0.5 ? s.D : pick({2, 5, 8});
  s.Rq = pick({1, 2, 3});
  s.Rk = pick({1, 2, 3});
  s.causal = rng.uniform() < 0.6;
  s.window = rng.uniform() < 0.25 ? pick({1, 3, 8, 20}) : 0;
  s.pre = side_from_bits(unsigned(rng.uniform() * 8));
  s.post = side_from_bits(unsigned(rng.uniform() * 8));
  return s;
}

template <class T>
class AttentionVsReference : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(AttentionVsReference, Scalars);

TYPED_TEST(AttentionVsReference, RandomProblems) {
  dcmha::test::Rng rng(2024);
  for (int i = 0; i < 120; ++i) {
    const ProblemSpec s = random_spec(rng);
    const int threads = 1 + i % 3;
    check_against_reference<TypeParam>(s, 1000 + i, threads, i % 2 ? Layout::bthd : Layout::bhtd);
  }
}

TYPED_TEST(AttentionVsReference, OfficialDcformerConfiguration) {
  // G = 1, pre and post with query- and key-wise terms, R = 2, no static W: the official default.
  for (bool causal : {true, false}) {
    ProblemSpec s;
    s.B = 1;
    s.H = 8;
    s.Hk = 8;
    s.T = 70;
    s.S = 70;
    s.D = 16;
    s.Dv = 16;
    s.G = 1;
    s.causal = causal;
    s.pre = s.post = SideSpec::dynamic();
    check_against_reference<TypeParam>(s, 7, {1, 2}, Layout::bthd);
  }
}

TYPED_TEST(AttentionVsReference, QueryBlockEdges) {
  // Query blocks of 64 rows in the forward and 128 in the backward at these sizes: one block,
  // one row more, one row less, two blocks exactly, for both.
  for (int64_t T : {63, 64, 65, 127, 128, 129, 255, 256, 257}) {
    ProblemSpec s;
    s.B = 1;
    s.H = 2;
    s.Hk = 1;
    s.T = T;
    s.S = T;
    s.D = 4;
    s.Dv = 4;
    s.G = 1;
    s.Rq = 1;
    s.Rk = 2;
    s.causal = true;
    check_against_reference<TypeParam>(s, T, {1, 2});
  }
  // The forward's 128-row blocks, used from 8 blocks per thread on (cpu/forward.hpp): the last
  // block one row short, exact, one row long.
  for (auto [T, threads] : {std::pair<int64_t, int>{1151, 1}, {1152, 1}, {1153, 1}, {2049, 2}}) {
    ProblemSpec s;
    s.B = 1;
    s.H = 2;
    s.Hk = 1;
    s.T = T;
    s.S = T;
    s.D = 4;
    s.Dv = 4;
    s.G = 1;
    s.Rq = 1;
    s.Rk = 2;
    s.causal = true;
    s.pre = s.post = SideSpec::dynamic();
    dcmha::detail::AttentionDims d;
    d.B = 1;
    d.H = d.M = 2;
    d.Hk = d.G = 1;
    d.T = d.S = T;
    d.D = d.Dv = 4;
    const dcmha::detail::RowMask mask(dcmha::detail::MaskParams{true, 0, {}, {}}, T, T);
    ASSERT_EQ(dcmha::cpu::forward_block_rows<float>(d, mask, threads), 128)
        << "this case is meant to run 128-row blocks";
    check_against_reference<TypeParam>(s, T, threads);
  }
}

TYPED_TEST(AttentionVsReference, ManyQueryBlocksFewGroups) {
  // B * G = 1 and at least 4 query blocks per thread: the forward hands whole query blocks to
  // threads (private panels) instead of splitting keys.
  ProblemSpec s;
  s.B = 1;
  s.H = 2;
  s.Hk = 1;
  s.T = 530;
  s.S = 530;
  s.D = 4;
  s.Dv = 4;
  s.G = 1;
  s.Rq = 2;
  s.Rk = 1;
  s.pre = s.post = SideSpec::dynamic();
  for (bool causal : {true, false}) {
    s.causal = causal;
    check_against_reference<TypeParam>(s, 9, 2);
  }
}

TYPED_TEST(AttentionVsReference, KeyTileEdges) {
  // Thread shares are multiples of 16 keys, compose chunks 32, backward dV tiles 64.
  for (int64_t S : {1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 97}) {
    ProblemSpec s;
    s.B = 1;
    s.H = 4;
    s.Hk = 2;
    s.T = 3;
    s.S = S;
    s.D = 4;
    s.Dv = 6;
    s.G = 2;
    for (bool causal : {false, true}) {
      s.causal = causal;
      check_against_reference<TypeParam>(s, S, {1, 2, 3});
    }
  }
}

TYPED_TEST(AttentionVsReference, ProductTileEdges) {
  // The tile products (cpu/gemm.hpp): 8x8 transposes plus a scalar tail when D is not a multiple
  // of 8, 6-row blocks plus a remainder, 8-lane column strips plus scalar columns (Dv = 13), and
  // the few-rows path (T < 8). M = 8 and 64-row blocks give 256-key forward tiles: S = 255 / 256 /
  // 257 is one tile, exactly one, one plus a key; 600 crosses two tile boundaries, so the online
  // softmax rescales earlier tiles' sums (and their factors in pass 2). The backward's tiles hold
  // three panels: with T = S its 128-row blocks get 64-key tiles (float; 32 for double), so
  // S = 129 ends on a one-key tile for both and 600 crosses several boundaries (for every thread
  // count: the backward's tiles do not depend on it); T = 5 gives 256-key tiles.
  for (int64_t S : {129, 161, 255, 256, 257, 600}) {
    for (int64_t T : {int64_t(5), S}) {
      ProblemSpec s;
      s.B = 1;
      s.H = 8;
      s.Hk = 4;
      s.T = T;
      s.S = S;
      s.D = 20;
      s.Dv = 13;
      s.G = 1;
      s.Rq = 2;
      s.Rk = 1;
      s.pre = s.post = SideSpec::dynamic();
      s.causal = T == S;
      check_against_reference<TypeParam>(s, S + T, {1, 2});
    }
  }
}

TYPED_TEST(AttentionVsReference, SingleQueryAndSingleKey) {
  for (auto [T, S] : {std::pair<int64_t, int64_t>{1, 1}, {1, 40}, {40, 1}}) {
    for (bool causal : {false, true}) {
      ProblemSpec s;
      s.T = T;
      s.S = S;
      s.causal = causal;
      check_against_reference<TypeParam>(s, 3, {1, 2});
    }
  }
}

TYPED_TEST(AttentionVsReference, RowsThatSeeNoKeyGiveZeros) {
  // Causal with T > S: the first T - S query rows see no key.
  ProblemSpec s;
  s.B = 2;
  s.H = 4;
  s.T = 20;
  s.S = 6;
  s.causal = true;
  check_against_reference<TypeParam>(s, 11, {1, 2});

  const auto p = dcmha::test::random_problem(s, 11);
  TypedProblem<TypeParam> tp(p);
  tp.set_dout(dcmha::test::random_dout(p, 11));
  dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
  dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                  tp.dv(), tp.compose(), tp.dcompose());
  const auto out = tp.out_values();
  const auto g = tp.gradients();
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T - s.S; ++t)
        for (int64_t e = 0; e < s.D; ++e) {
          const size_t i = size_t(((b * s.H + h) * s.T + t) * s.D + e);
          EXPECT_EQ(out[i], 0.0);
          EXPECT_EQ(g.dq[i], 0.0);
        }
}

TYPED_TEST(AttentionVsReference, WindowedAttention) {
  for (int64_t W : {1, 5, 16, 17, 64}) {
    ProblemSpec s;
    s.B = 1;
    s.H = 4;
    s.Hk = 4;
    s.T = 80;
    s.S = 80;
    s.D = 8;
    s.Dv = 8;
    s.G = 1;
    s.causal = true;
    s.window = W;
    s.pre = s.post = SideSpec::dynamic();
    check_against_reference<TypeParam>(s, W, {1, 2});
  }
}

TYPED_TEST(AttentionVsReference, PaddedBatches) {
  // Per-sequence lengths: right-padded prefill (equal lengths), decode-like (fewer queries than
  // keys), and an all-padding sequence; with and without compose, window, GQA.
  struct Case {
    std::vector<int64_t> ql, kl;
    bool causal;
    int64_t window;
  };
  const Case cases[] = {{{20, 7, 0}, {20, 7, 0}, true, 0},
                        {{3, 1, 2}, {20, 5, 9}, true, 0},
                        {{20, 13, 1}, {25, 13, 4}, false, 0},
                        {{20, 18, 5}, {20, 18, 11}, true, 6}};
  for (const Case& c : cases)
    for (bool composed : {false, true}) {
      ProblemSpec s;
      s.B = 3;
      s.H = 4;
      s.Hk = 2;
      s.T = 20;
      s.S = 25;
      s.D = 8;
      s.Dv = 8;
      s.G = 2;
      s.causal = c.causal;
      s.window = c.window;
      if (!composed) s.pre = s.post = SideSpec::none();
      auto p = dcmha::test::random_problem(s, 21);
      p.query_lengths = c.ql;
      p.key_lengths = c.kl;
      SCOPED_TRACE(s.str());
      const auto dout = dcmha::test::random_dout(p, 21);
      const auto expected_out = dcmha::reference::forward(p);
      const auto expected = dcmha::reference::backward(p, dout);
      for (int threads : {1, 2}) {
        TypedProblem<TypeParam> tp(p);
        tp.num_threads = threads;
        tp.set_dout(dout);
        dcmha::AttentionConfig cfg = tp.config();
        cfg.query_lengths = dcmha::view<1>(c.ql.data(), {3});
        cfg.key_lengths = dcmha::view<1>(c.kl.data(), {3});
        dcmha::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
        EXPECT_LE(dcmha::test::max_rel_error(expected_out, tp.out_values()),
                  tolerance<TypeParam>());
        dcmha::backward(cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(), tp.dv(),
                        tp.compose(), tp.dcompose());
        for (const auto& e : dcmha::test::gradient_errors(expected, tp.gradients()))
          EXPECT_LE(e.rel, tolerance<TypeParam>()) << e.name;
      }
      // Padding rows are whatever the caller's buffers hold: NaN in their Q, K, V, dO rows and
      // query-wise terms must not reach any output or gradient (0 * NaN is NaN, so a kernel
      // that multiplies a padding row by a zero probability still fails here).
      auto poisoned = p;
      auto poisoned_dout = dout;
      for (int64_t b = 0; b < s.B; ++b) {
        for (int64_t h = 0; h < s.H; ++h)
          for (int64_t t = c.ql[size_t(b)]; t < s.T; ++t) {
            for (int64_t e = 0; e < s.D; ++e)
              poisoned.q[size_t(((b * s.H + h) * s.T + t) * s.D + e)] = NAN;
            for (int64_t e = 0; e < s.Dv; ++e)
              poisoned_dout[size_t(((b * s.H + h) * s.T + t) * s.Dv + e)] = NAN;
          }
        for (int64_t h = 0; h < s.Hk; ++h)
          for (int64_t t = c.kl[size_t(b)]; t < s.S; ++t) {
            for (int64_t e = 0; e < s.D; ++e)
              poisoned.k[size_t(((b * s.Hk + h) * s.S + t) * s.D + e)] = NAN;
            for (int64_t e = 0; e < s.Dv; ++e)
              poisoned.v[size_t(((b * s.Hk + h) * s.S + t) * s.Dv + e)] = NAN;
          }
      }
      const int64_t M = s.H / s.G;
      for (auto* side : {&poisoned.pre, &poisoned.post})
        for (int64_t b = 0; b < s.B && composed; ++b)
          for (int64_t t = c.ql[size_t(b)]; t < s.T; ++t) {
            for (int64_t i = 0; i < s.G * s.Rq * M; ++i) {
              side->qw1[size_t((b * s.T + t) * s.G * s.Rq * M + i)] = NAN;
              side->qw2[size_t((b * s.T + t) * s.G * s.Rq * M + i)] = NAN;
            }
            for (int64_t i = 0; i < s.G * M; ++i)
              side->qdd[size_t((b * s.T + t) * s.G * M + i)] = NAN;
          }
      TypedProblem<TypeParam> tp(poisoned);
      tp.num_threads = 2;
      tp.set_dout(poisoned_dout);
      dcmha::AttentionConfig cfg = tp.config();
      cfg.query_lengths = dcmha::view<1>(c.ql.data(), {3});
      cfg.key_lengths = dcmha::view<1>(c.kl.data(), {3});
      dcmha::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
      EXPECT_LE(dcmha::test::max_rel_error(expected_out, tp.out_values()), tolerance<TypeParam>())
          << "NaN padding";
      dcmha::backward(cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(), tp.dv(),
                      tp.compose(), tp.dcompose());
      for (const auto& e : dcmha::test::gradient_errors(expected, tp.gradients()))
        EXPECT_LE(e.rel, tolerance<TypeParam>()) << e.name << " NaN padding";
    }
}

TEST(AttentionApi, LengthsAreValidated) {
  const auto p = dcmha::test::random_problem(ProblemSpec{}, 1);
  TypedProblem<float> tp(p);
  std::vector<int64_t> bad = {6};  // T = 5
  dcmha::AttentionConfig cfg = tp.config();
  cfg.query_lengths = dcmha::view<1>(bad.data(), {1});
  try {
    dcmha::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
    FAIL() << "no error";
  } catch (const dcmha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cfg.query_lengths[0]: expected a length in [0, 5]"),
              std::string::npos)
        << e.what();
  }
  std::vector<int64_t> two = {1, 1};
  cfg.query_lengths = {};
  cfg.key_lengths = dcmha::view<1>(two.data(), {2});
  EXPECT_THROW(dcmha::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose()),
               dcmha::Error);
}

/// Same inputs, same thread count: bitwise the same outputs and gradients.
TYPED_TEST(AttentionVsReference, DeterministicForAFixedThreadCount) {
  for (int64_t B : {1, 2}) {  // B = 1: one key-split team; B = 2: whole items per thread
    ProblemSpec s;
    s.B = B;
    s.H = 4;
    s.T = 50;
    s.S = 50;
    s.causal = true;
    const auto p = dcmha::test::random_problem(s, 5);
    std::vector<double> first;
    for (int run = 0; run < 3; ++run) {
      TypedProblem<TypeParam> tp(p);
      tp.num_threads = 2;
      tp.set_dout(dcmha::test::random_dout(p, 5));
      dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
      dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                      tp.dv(), tp.compose(), tp.dcompose());
      const std::vector<double> all = with_gradients(tp.out_values(), tp.gradients());
      if (run == 0)
        first = all;
      else
        ASSERT_EQ(first_bitwise_difference(first, all), -1)
            << "B=" << B << " of " << all.size() << " values";
    }
  }
}

/// The backward hands a block's key tiles to whichever thread is free (cpu::TileQueue) and sums
/// per tile in tile order: from the same forward, its gradients are bitwise the same for every
/// thread count, with one team (B = 1) or whole items per thread, with several tiles per block
/// (M = 32: 32-key tiles), static W (generic Compose) or not (register paths), GQA.
TYPED_TEST(AttentionVsReference, BackwardBitwiseTheSameForEveryThreadCount) {
  for (int64_t B : {1, 2})
    for (bool with_w : {true, false}) {
      ProblemSpec s;
      s.B = B;
      s.H = 32;
      s.Hk = with_w ? 32 : 8;
      s.T = 150;
      s.S = 150;
      s.D = 8;
      s.Dv = 8;
      s.causal = true;
      if (!with_w) s.pre = s.post = SideSpec::dynamic();
      const auto p = dcmha::test::random_problem(s, 17);
      TypedProblem<TypeParam> tp(p);
      tp.set_dout(dcmha::test::random_dout(p, 17));
      tp.num_threads = 2;
      dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
      std::vector<double> first;
      for (int threads : {2, 1, 3}) {
        tp.num_threads = threads;
        dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                        tp.dv(), tp.compose(), tp.dcompose());
        const std::vector<double> all = with_gradients({}, tp.gradients());
        if (threads == 2) {
          first = all;
          // Not all zero: a backward that wrote nothing would compare equal too.
          ASSERT_GT(std::count_if(all.begin(), all.end(), [](double x) { return x != 0; }),
                    int64_t(all.size() / 2));
        } else {
          ASSERT_EQ(first_bitwise_difference(first, all), -1)
              << s.str() << " threads=" << threads << " of " << all.size() << " values";
        }
      }
    }
}

/// The backward's tile queue where blocks start past key 0 (window), see no keys at all (padded
/// and all-padding sequences, between blocks that do), with T != S and GQA: 32-key tiles
/// (M = 32), several per block. Against the reference, and bitwise across thread counts.
TYPED_TEST(AttentionVsReference, BackwardKeyTilesWithWindowsAndPadding) {
  for (int64_t window : {0, 40}) {
    ProblemSpec s;
    s.B = 3;
    s.H = 32;
    s.Hk = 8;
    s.T = 150;
    s.S = 170;
    s.D = 8;
    s.Dv = 8;
    s.causal = true;
    s.window = window;
    s.pre.static_w = false;  // one side generic (static W), one on the register path
    auto p = dcmha::test::random_problem(s, 23);
    std::vector<int64_t> ql = {150, 97, 0}, kl = {170, 61, 0};
    p.query_lengths = ql;
    p.key_lengths = kl;
    SCOPED_TRACE(s.str());
    const auto dout = dcmha::test::random_dout(p, 23);
    const auto expected = dcmha::reference::backward(p, dout);
    TypedProblem<TypeParam> tp(p);
    tp.set_dout(dout);
    dcmha::AttentionConfig cfg = tp.config();
    cfg.query_lengths = dcmha::view<1>(ql.data(), {3});
    cfg.key_lengths = dcmha::view<1>(kl.data(), {3});
    cfg.num_threads = 2;
    dcmha::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
    std::vector<double> first;
    for (int threads : {2, 1, 3}) {
      cfg.num_threads = threads;
      dcmha::backward(cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(), tp.dv(),
                      tp.compose(), tp.dcompose());
      const dcmha::reference::Gradients g = tp.gradients();
      for (const auto& e : dcmha::test::gradient_errors(expected, g))
        EXPECT_LE(e.rel, tolerance<TypeParam>()) << e.name << " threads=" << threads;
      const std::vector<double> all = with_gradients({}, g);
      if (threads == 2)
        first = all;
      else
        ASSERT_EQ(first_bitwise_difference(first, all), -1) << "threads=" << threads;
    }
  }
}

/// Outputs may interleave in one buffer (detail/checks.hpp): dK and dV side by side in rows of
/// D + Dv get bitwise the gradients of separate buffers, and every element of the rows is written.
TYPED_TEST(AttentionVsReference, GradientsInterleavedInOneBuffer) {
  ProblemSpec s;
  s.B = 2;
  s.H = 4;
  s.Hk = 2;
  s.T = 70;
  s.S = 70;
  s.D = 8;
  s.Dv = 12;
  s.G = 2;
  s.causal = true;
  s.pre = s.post = SideSpec::dynamic();
  const auto p = dcmha::test::random_problem(s, 5);
  TypedProblem<TypeParam> tp(p);
  tp.set_dout(dcmha::test::random_dout(p, 5));
  dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
  dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                  tp.dv(), tp.compose(), tp.dcompose());
  const int64_t row = s.D + s.Dv;
  std::vector<TypeParam> both(static_cast<size_t>(s.B * s.Hk * s.S * row), TypeParam(0.5));
  const dcmha::Shape<4> stride{s.Hk * s.S * row, s.S * row, row, 1};
  dcmha::TensorView<TypeParam, 4> dk(both.data(), {s.B, s.Hk, s.S, s.D}, stride);
  dcmha::TensorView<TypeParam, 4> dv(both.data() + s.D, {s.B, s.Hk, s.S, s.Dv}, stride);
  dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), dk, dv,
                  tp.compose(), tp.dcompose());
  EXPECT_EQ(
      first_bitwise_difference(dcmha::test::to_canonical(tp.dk()), dcmha::test::to_canonical(dk)),
      -1);
  EXPECT_EQ(
      first_bitwise_difference(dcmha::test::to_canonical(tp.dv()), dcmha::test::to_canonical(dv)),
      -1);
}

/// A Workspace kept across calls of different shapes (growing, then smaller again; one team and
/// whole items per thread; MHA and DCMHA) gives bitwise the results of calls without one, and
/// grows no further when shapes it has seen come again.
TYPED_TEST(AttentionVsReference, WorkspaceKeptBetweenCalls) {
  using T = TypeParam;
  struct Case {
    int64_t B, H, G, T, S;
    bool compose;
  };
  const Case cases[] = {{1, 4, 1, 9, 9, true},   {1, 8, 1, 150, 150, true},
                        {2, 4, 2, 40, 70, true}, {1, 4, 4, 150, 150, false},
                        {1, 4, 1, 9, 9, true},   {1, 8, 1, 150, 150, true}};
  dcmha::Workspace ws;
  for (size_t c = 0; c < std::size(cases); ++c) {
    const std::size_t held_before = ws.bytes();
    const Case& k = cases[c];
    SCOPED_TRACE("case " + std::to_string(c));
    ProblemSpec s;
    s.B = k.B;
    s.H = k.H;
    s.Hk = k.H;
    s.G = k.G;
    s.T = k.T;
    s.S = k.S;
    s.causal = true;
    if (!k.compose) s.pre = s.post = SideSpec::none();
    const auto p = dcmha::test::random_problem(s, 30 + c);
    const auto dout = dcmha::test::random_dout(p, 30 + c);
    TypedProblem<T> fresh(p), kept(p);
    for (auto* tp : {&fresh, &kept}) {
      tp->num_threads = 2;
      tp->set_dout(dout);
    }
    dcmha::forward(fresh.config(), fresh.q(), fresh.k(), fresh.v(), fresh.out(), fresh.lse(),
                   fresh.compose());
    dcmha::backward(fresh.config(), fresh.q(), fresh.k(), fresh.v(), fresh.lse(), fresh.dout(),
                    fresh.dq(), fresh.dk(), fresh.dv(), fresh.compose(), fresh.dcompose());
    dcmha::forward(kept.config(), kept.q(), kept.k(), kept.v(), kept.out(), kept.lse(),
                   kept.compose(), ws);
    dcmha::backward(kept.config(), kept.q(), kept.k(), kept.v(), kept.lse(), kept.dout(), kept.dq(),
                    kept.dk(), kept.dv(), kept.compose(), kept.dcompose(), ws);
    const std::vector<double> a = with_gradients(fresh.out_values(), fresh.gradients());
    const std::vector<double> b = with_gradients(kept.out_values(), kept.gradients());
    ASSERT_EQ(a.size(), b.size());
    ASSERT_EQ(first_bitwise_difference(a, b), -1) << "of " << a.size() << " values";
    EXPECT_GT(ws.bytes(), 0u);
    if (c >= 4) {  // shapes seen before: everything reused, nothing grown
      EXPECT_EQ(ws.bytes(), held_before);
    }
  }
  ws.release();
  EXPECT_EQ(ws.bytes(), 0u);
}

// ---------------------------------------------------------------------------------------------
// bf16 and fp16 storage: float arithmetic on the widened values, results rounded once
// (config.hpp). So on inputs that are values of the storage type, every output and gradient must
// be exactly the float kernels' result rounded to that type: a stricter check than a tolerance,
// and one that covers every switch and tile edge the float tests cover.

/// Every output (out, lse, gradients) of forward + backward, in a fixed order.
template <class T>
std::vector<double> run_all(const dcmha::reference::Problem& p, const std::vector<double>& dout,
                            int threads, Layout layout) {
  TypedProblem<T> tp(p, layout);
  tp.num_threads = threads;
  tp.set_dout(dout);
  dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
  dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                  tp.dv(), tp.compose(), tp.dcompose());
  std::vector<double> all = tp.out_values();
  const std::vector<double> lse = tp.lse_values();
  all.insert(all.end(), lse.begin(), lse.end());
  return with_gradients(std::move(all), tp.gradients());
}

/// Storage type against float storage on the same (Storage-valued) inputs: equal after rounding the
/// float results to Storage (lse is float in both).
template <class Storage>
void check_storage_is_rounded_float(const ProblemSpec& spec, uint64_t seed, int threads,
                                    Layout layout = Layout::bhtd) {
  SCOPED_TRACE(spec.str() + " threads=" + std::to_string(threads) +
               (layout == Layout::bthd ? " bthd" : " bhtd") + " seed=" + std::to_string(seed));
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<Storage>(dcmha::test::random_problem(spec, seed));
  std::vector<double> dout = dcmha::test::random_dout(p, seed);
  for (double& x : dout) x = round_to<Storage>(x);
  const std::vector<double> f = run_all<float>(p, dout, threads, layout);
  const std::vector<double> h = run_all<Storage>(p, dout, threads, layout);
  ASSERT_EQ(f.size(), h.size());
  const size_t n_out = size_t(p.B * p.H * p.T * p.Dv), n_lse = size_t(p.B * p.H * p.T);
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    const bool is_lse = i >= n_out && i < n_out + n_lse;
    const double want = is_lse ? f[i] : round_to<Storage>(f[i]);
    const bool same = want == h[i];  // -inf == -inf for rows without keys
    if (!same && mismatches++ == 0) first = i;
  }
  EXPECT_EQ(mismatches, 0u) << "first at element " << first << " of " << f.size()
                            << " (out: " << n_out << ", lse: " << n_lse << "): float " << f[first]
                            << " storage " << h[first];
}

template <class Storage>
void check_random_problems(uint64_t seed0, int count) {
  dcmha::test::Rng rng(77);
  for (int i = 0; i < count; ++i) {
    const ProblemSpec s = random_spec(rng);
    check_storage_is_rounded_float<Storage>(s, seed0 + uint64_t(i), 1 + i % 3,
                                            i % 2 ? Layout::bthd : Layout::bhtd);
  }
}

template <class Storage>
void check_tile_edges() {
  // Query blocks of 64 rows +-1 (forward) and 128 +-1 (backward), key tiles and thread splits
  // (S around 16, 32, 64 multiples), decode-sized blocks (T < 8: the few-rows products), one team
  // and whole items per thread.
  for (int64_t T : {1, 3, 63, 65, 127, 129}) {
    for (int64_t S : {T, int64_t(97)}) {
      ProblemSpec s;
      s.B = 1;
      s.H = 4;
      s.Hk = 2;
      s.T = T;
      s.S = std::max(S, T);
      s.D = 24;
      s.Dv = 17;
      s.G = 1;
      s.causal = T % 2 == 1;
      s.pre = s.post = SideSpec::dynamic();
      for (int threads : {1, 2})
        check_storage_is_rounded_float<Storage>(s, uint64_t(T * 1000 + S), threads, Layout::bthd);
    }
  }
  ProblemSpec wide;  // one item, whole query blocks per thread, 128-row blocks (QueryBlockEdges)
  wide.B = 1;
  wide.H = 4;
  wide.Hk = 2;
  wide.G = 1;
  wide.T = 2049;
  wide.S = 2049;
  wide.D = 8;
  wide.Dv = 8;
  wide.causal = true;
  wide.pre = wide.post = SideSpec::dynamic();
  check_storage_is_rounded_float<Storage>(wide, 6, 2);
  ProblemSpec many;  // many groups: each thread takes whole (batch, group) items
  many.B = 2;
  many.H = 8;
  many.Hk = 8;
  many.G = 4;
  many.T = 70;
  many.S = 70;
  many.D = 16;
  many.Dv = 16;
  many.causal = true;
  check_storage_is_rounded_float<Storage>(many, 5, 2);
}

/// The official configuration in a storage type against the float64 reference: within its
/// resolution (one rounding of the result, plus the float arithmetic's error).
template <class Storage>
void check_against_reference(double tolerance) {
  ProblemSpec s;
  s.B = 1;
  s.H = 8;
  s.Hk = 8;
  s.T = 70;
  s.S = 70;
  s.D = 16;
  s.Dv = 16;
  s.G = 1;
  s.causal = true;
  s.pre = s.post = SideSpec::dynamic();
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<Storage>(dcmha::test::random_problem(s, 11));
  std::vector<double> dout = dcmha::test::random_dout(p, 11);
  for (double& x : dout) x = round_to<Storage>(x);
  TypedProblem<Storage> tp(p, Layout::bthd);
  tp.num_threads = 2;
  tp.set_dout(dout);
  dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
  dcmha::backward(tp.config(), tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(),
                  tp.dv(), tp.compose(), tp.dcompose());
  EXPECT_LE(dcmha::test::max_rel_error(dcmha::reference::forward(p), tp.out_values()), tolerance)
      << "out";
  for (const auto& e :
       dcmha::test::gradient_errors(dcmha::reference::backward(p, dout), tp.gradients()))
    EXPECT_LE(e.rel, tolerance) << e.name;
}

/// The vector paths of the kernels' edges against Eigen's scalar conversions, both ways.
template <class Storage>
void check_conversions_round_as_eigen_does(const std::vector<uint32_t>& bits) {
  const size_t n = bits.size();
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) std::memcpy(&x[i], &bits[i], 4);
  std::vector<Storage> narrowed(n);
  dcmha::cpu::narrow_row(x.data(), narrowed.data(), dcmha::index_t(n));
  for (size_t i = 0; i < n; ++i) {
    const Storage want(x[i]);
    EXPECT_EQ(Eigen::numext::bit_cast<uint16_t>(narrowed[i]),
              Eigen::numext::bit_cast<uint16_t>(want))
        << "value " << i << " bits " << std::hex << bits[i];
  }
  std::vector<float> widened(n);
  dcmha::cpu::widen_row(narrowed.data(), widened.data(), dcmha::index_t(n), 1.0f);
  for (size_t i = 0; i < n; ++i) {
    const float want = static_cast<float>(narrowed[i]);
    EXPECT_EQ(std::memcmp(&widened[i], &want, 4), 0) << "value " << i;
  }
}

TEST(Bf16Storage, RandomProblemsAreTheRoundedFloatResults) {
  check_random_problems<dcmha::bf16>(3000, 60);
}

TEST(Bf16Storage, TileEdgesAreTheRoundedFloatResults) { check_tile_edges<dcmha::bf16>(); }

TEST(Bf16Storage, OfficialConfigurationAgainstTheReference) {
  check_against_reference<dcmha::bf16>(4e-3);  // 2^-9 relative rounding
}

TEST(Bf16Storage, ConversionsRoundAsEigenDoes) {
  // Ties to even both ways, values that round up into the exponent or to infinity, subnormals,
  // signed zeros, infinities and NaNs of either sign; 37 values, so that the scalar tails run too.
  check_conversions_round_as_eigen_does<dcmha::bf16>(
      {0x3f808000u, 0x3f818000u, 0x3f807fffu, 0x3f808001u, 0x3fffffffu, 0x7f7fffffu, 0xff7fffffu,
       0x00000001u, 0x80008000u, 0x00018000u, 0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
       0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff812345u, 0x3eaaaaabu, 0xbeaaaaabu, 0x40490fdbu,
       0xc0490fdbu, 0x3f7fff80u, 0x3f7fff7fu, 0x3f7fff81u, 0x477fe000u, 0x477ff000u, 0x00800000u,
       0x007fffffu, 0x4b000001u, 0x3dcccccdu, 0xbdcccccdu, 0x42f6e979u, 0xc2f6e979u, 0x3f000080u,
       0x3f000180u, 0x33d6bf95u});
}

TEST(HalfStorage, RandomProblemsAreTheRoundedFloatResults) {
  check_random_problems<dcmha::half>(5000, 30);
}

TEST(HalfStorage, TileEdgesAreTheRoundedFloatResults) { check_tile_edges<dcmha::half>(); }

TEST(HalfStorage, OfficialConfigurationAgainstTheReference) {
  check_against_reference<dcmha::half>(1e-3);  // 2^-11 relative rounding
}

TEST(HalfStorage, ConversionsRoundAsEigenDoes) {
  // Ties to even at fp16's 13 dropped bits (1 + 2^-11, 1 + 3 * 2^-11), just below and above a
  // tie, rounding up into the next exponent, 65504 and the values that round to it or overflow to
  // infinity, the smallest normal, subnormals and the halfway point below the smallest one, signed
  // zeros, infinities and NaNs; 37 values, so that the scalar tails run too.
  check_conversions_round_as_eigen_does<dcmha::half>(
      {0x3f801000u, 0x3f803000u, 0x3f800fffu, 0x3f801001u, 0x3fffffffu, 0x477fe000u, 0x477fefffu,
       0x477ff000u, 0xc77ff000u, 0x7f7fffffu, 0x38800000u, 0x38000000u, 0x33800000u, 0x33000000u,
       0x33000001u, 0x337fffffu, 0x00000001u, 0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
       0x7fc00000u, 0xffc00000u, 0x3eaaaaabu, 0xbeaaaaabu, 0x40490fdbu, 0xc0490fdbu, 0x3dcccccdu,
       0xbdcccccdu, 0x42f6e979u, 0xc2f6e979u, 0x387fc000u, 0x387fe000u, 0x3f7ff000u, 0x3f7ff800u,
       0x461c4000u, 0x4b000001u});
}

TEST(AttentionApi, MhaIsDcmhaWithComposeOff) {
  // The drop-in contract: the same call without compose weights is plain softmax attention.
  ProblemSpec s;
  s.B = 2;
  s.H = 4;
  s.Hk = 2;
  s.T = 9;
  s.S = 12;
  s.causal = true;
  s.pre = s.post = SideSpec::none();
  const auto p = dcmha::test::random_problem(s, 1);
  TypedProblem<double> tp(p);
  dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), tp.lse());
  const auto out = tp.out_values();
  // Softmax attention spelled out: head h reads kv head h / (H / Hk).
  double worst = 0;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        const int64_t hk = h / (s.H / s.Hk), last = std::min(s.S - 1, t + s.S - s.T);
        std::vector<double> l(size_t(last + 1));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= last; ++j) {
          double x = 0;
          for (int64_t e = 0; e < s.D; ++e)
            x += p.q[size_t(((b * s.H + h) * s.T + t) * s.D + e)] *
                 p.k[size_t(((b * s.Hk + hk) * s.S + j) * s.D + e)];
          l[size_t(j)] = x / std::sqrt(double(s.D));
          mx = std::max(mx, l[size_t(j)]);
        }
        for (auto& x : l) sum += (x = std::exp(x - mx));
        for (int64_t e = 0; e < s.Dv; ++e) {
          double o = 0;
          for (int64_t j = 0; j <= last; ++j)
            o += l[size_t(j)] / sum * p.v[size_t(((b * s.Hk + hk) * s.S + j) * s.Dv + e)];
          worst = std::max(worst, std::abs(o - out[size_t(((b * s.H + h) * s.T + t) * s.Dv + e)]));
        }
      }
  EXPECT_LE(worst, 1e-12);
}

}  // namespace

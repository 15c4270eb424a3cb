// Numerics at the edges: scores of magnitude 1e4, a NaN or Inf confined to its own sequence,
// rows that see no key, rows of 65536 keys, and lengths and sizes of zero.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "dcmha/dcmha.hpp"
#include "reference/reference.hpp"
#include "support/problem.hpp"
#include "support/runs.hpp"
#include "support/sanitizer.hpp"

namespace {

using dcmha::index_t;
using dcmha::reference::Problem;
using dcmha::test::NamedResult;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;
namespace ref = dcmha::reference;
namespace dt = dcmha::test;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// The suite's tolerances: float and double kernels against the reference, and bf16 storage
/// (one rounding of the result to 8 bits plus the float error).
template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, double> ? 1e-9 : std::is_same_v<T, float> ? 2e-4 : 4e-3;
}

double round_to_bf16(double x) {
  return double(static_cast<float>(dcmha::bf16(static_cast<float>(x))));
}

void round_to_bf16(std::vector<double>& x) {
  for (double& e : x) e = round_to_bf16(e);
}

SideSpec side_from_bits(unsigned bits) { return {bool(bits & 1), bool(bits & 2), bool(bits & 4)}; }

/// Every compose tensor of p (empty where a term is off).
std::vector<std::vector<double>*> compose_tensors(Problem& p) {
  std::vector<std::vector<double>*> all;
  for (ref::ComposeSide* c : {&p.pre, &p.post})
    for (auto* x : {&c->w, &c->qw1, &c->qw2, &c->qdd, &c->kw1, &c->kw2, &c->kdd}) all.push_back(x);
  return all;
}

/// Forward + backward of p (with its per-sequence lengths, if any) in storage T.
template <class T>
std::vector<NamedResult> run_all(const Problem& p, const std::vector<double>& dout, int threads) {
  TypedProblem<T> tp(p);
  tp.num_threads = threads;
  tp.set_dout(dout);
  dcmha::AttentionConfig cfg = tp.config();
  const Problem& kept = tp.problem();
  if (!kept.query_lengths.empty())
    cfg.query_lengths = dcmha::view<1>(kept.query_lengths.data(), {p.B});
  if (!kept.key_lengths.empty()) cfg.key_lengths = dcmha::view<1>(kept.key_lengths.data(), {p.B});
  dt::forward_backward(tp, cfg);
  return dt::named_results(tp);
}

/// The reference's results, named and ordered as named_results() orders the library's.
std::vector<NamedResult> reference_results(const Problem& p, const std::vector<double>& dout) {
  std::vector<NamedResult> r{{"out", ref::forward(p)}, {"lse", dt::reference_lse(p)}};
  const ref::Gradients g = ref::backward(p, dout);
  for (const auto& [name, vec] : dt::named_gradients(g)) r.push_back({name, *vec});
  return r;
}

double max_abs_finite(const std::vector<double>& x) {
  double m = 0;
  for (double v : x)
    if (std::isfinite(v)) m = std::max(m, std::abs(v));
  return m;
}

/// max_rel_error for lse, where a row without keys must be -inf in both.
double lse_error(const std::vector<double>& want, const std::vector<double>& got) {
  if (want.size() != got.size()) return kInf;
  std::vector<double> w, g;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == -kInf || got[i] == -kInf) {
      if (!(want[i] == got[i])) return kInf;
      continue;
    }
    w.push_back(want[i]);
    g.push_back(got[i]);
  }
  return dt::max_rel_error(w, g);
}

/// Worst relative errors seen by a test, printed for the record.
struct Worst {
  double out = 0, lse = 0, grad = 0;
  void print(const char* what) const {
    std::printf("[ measured ] %s: out %.3g, lse %.3g, gradients %.3g\n", what, out, lse, grad);
  }
};

/// Every result of got against want (same problem): out within out_tol, lse within lse_tol,
/// every gradient within grad_tol.
void expect_close(const std::vector<NamedResult>& want, const std::vector<NamedResult>& got,
                  double out_tol, double lse_tol, double grad_tol, Worst* worst = nullptr) {
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_EQ(want[i].name, got[i].name);
    const bool is_out = want[i].name == "out", is_lse = want[i].name == "lse";
    const double err = is_lse ? lse_error(want[i].values, got[i].values)
                              : dt::max_rel_error(want[i].values, got[i].values);
    EXPECT_LE(err, is_out ? out_tol : is_lse ? lse_tol : grad_tol) << want[i].name;
    if (worst) {
      double& w = is_out ? worst->out : is_lse ? worst->lse : worst->grad;
      w = std::max(w, err);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 1. Scores of magnitude 1e4
//
// With random inputs, float rounds a score of 1e4 by up to 2^-11 (its ulp is 2^-10): a relative
// error of ~5e-4 on the probabilities, so no 2e-4 check of the output would be honest. These
// inputs make every score and composed score exact in float instead: integer q and k, a
// power-of-two scale, compose weights that are multiples of 1/16 with |w| <= 1/8. Every product
// and partial sum of Compose is then a multiple of 2^-8 below 2^15 (of 2 below 2^16 with the
// large scale): at most 24 significant bits, exact in any order. What is left to round is what
// every other test rounds (exp, the softmax sums, P'V), plus lse: see check_large_scores().

enum class LargeScores {
  offset,  ///< q = (+-100, x), k = (100, y), x, y in {-1, 0, 1}^7, scale 1: +-10^4 + x.y
  scale,   ///< q, k in {-2..2}^8, scale 512: up to 16384 in steps of 512 (one-hot rows, ties)
};

/// A multiple of 1/16 in [-1/8, 1/8].
double sixteenths(dt::Rng& rng) { return std::floor(rng.uniform() * 5) / 16 - 0.125; }

Problem large_score_problem(LargeScores kind, bool composed, bool causal, uint64_t seed) {
  ProblemSpec s;
  s.B = 2;
  s.H = 4;
  s.Hk = 2;
  s.T = 19;
  s.S = 19;
  s.D = 8;
  s.Dv = 8;
  s.G = 1;
  s.Rq = 2;
  s.Rk = 2;
  s.causal = causal;
  s.pre = s.post = composed ? SideSpec::all() : SideSpec::none();
  Problem p = dt::random_problem(s, seed);
  dt::Rng rng(seed + 101);
  auto small_int = [&](int lo, int hi) { return double(lo + int(rng.uniform() * (hi - lo + 1))); };
  const bool offset = kind == LargeScores::offset;
  p.scale = offset ? 1.0 : 512.0;
  // Rows near +10^4 and rows near -10^4: exp without the row maximum subtracted overflows on the
  // first and gives 0/0 on the second.
  for (size_t row = 0; row < p.q.size() / size_t(s.D); ++row)
    for (size_t d = 0; d < size_t(s.D); ++d)
      p.q[row * size_t(s.D) + d] =
          offset ? (d == 0 ? (rng.uniform() < 0.5 ? -100.0 : 100.0) : small_int(-1, 1))
                 : small_int(-2, 2);
  for (size_t row = 0; row < p.k.size() / size_t(s.D); ++row)
    for (size_t d = 0; d < size_t(s.D); ++d)
      p.k[row * size_t(s.D) + d] = offset ? (d == 0 ? 100.0 : small_int(-1, 1)) : small_int(-2, 2);
  for (std::vector<double>* x : compose_tensors(p))
    for (double& w : *x) w = sixteenths(rng);
  round_to_bf16(p.v);  // so that bf16 storage holds the same values as float
  return p;
}

/// lse itself against the reference: its own rounding (2^-24 relative in float) and the log's
/// (of a sum of at most S terms: absolutely tiny next to |lse| = 10^4).
template <class T>
constexpr double lse_tolerance() {
  return std::is_same_v<T, double> ? 1e-12 : 4 * 0x1p-24;
}

/// The gradients at large scores, and what tolerance is honest for them. The backward recomputes
/// P = exp(L' - lse) from the lse the forward wrote, one float per row (float and bf16 storage),
/// rounded by up to 2^-24 |lse| (6e-4 at 10^4): every probability of a row carries one common
/// factor 1 + e. The kernels divide D = sum P dP by the row's sum of P, so sum_s dS_s stays 0 and
/// every gradient is off by that factor alone: 2^-24 |lse| relative, on top of the usual
/// tolerance. (Without that division, dq and the pre-compose weights' gradients, which add dS
/// over keys with a common part of 100 or scores of 10^4, were off by several times their size.)
///
/// One more term remains at the usual tolerance's scale: every dS carries a rounding of about
/// 2^-24 of its size, and the pre-compose gradients sum L dS over a row's keys, where the exact
/// sum cancels (sum_s dS_s = 0) and L is nearly the same 10^4 for every key. The rounding
/// survives the cancellation as 2^-24 |L| sum_s |dS_s|, with sum_s |dS_s| of the size of the
/// gradient's own terms: a relative error of up to about 2^-24 |L| per row, taken as twice that.
template <class T>
double large_score_gradient_slack(double max_abs_score) {
  return 3 * max_abs_score * (std::is_same_v<T, double> ? 0x1p-53 : 0x1p-24);
}

template <class T>
void check_large_scores(const Problem& p, const std::vector<double>& dout,
                        const std::vector<NamedResult>& exact, int threads, Worst& worst) {
  SCOPED_TRACE(std::string(std::is_same_v<T, float>    ? "float"
                           : std::is_same_v<T, double> ? "double"
                                                       : "bf16") +
               " threads=" + std::to_string(threads));
  const std::vector<NamedResult> got = run_all<T>(p, dout, threads);
  for (const NamedResult& r : got) EXPECT_TRUE(dt::all_finite(r.values)) << r.name;
  // lse: the row's largest score + log(sum)
  const double max_score = max_abs_finite(exact[1].values);
  expect_close(exact, got, tolerance<T>(), lse_tolerance<T>(),
               tolerance<T>() + large_score_gradient_slack<T>(max_score), &worst);
}

/// bf16 storage gives exactly the float kernels' results rounded once (lse is float in both).
void check_bf16_is_rounded_float(const Problem& p, const std::vector<double>& dout, int threads) {
  const std::vector<NamedResult> f = run_all<float>(p, dout, threads);
  const std::vector<NamedResult> h = run_all<dcmha::bf16>(p, dout, threads);
  ASSERT_EQ(f.size(), h.size());
  for (size_t i = 0; i < f.size(); ++i) {
    size_t mismatches = 0;
    for (size_t j = 0; j < f[i].values.size(); ++j) {
      const double want = f[i].name == "lse" ? f[i].values[j] : round_to_bf16(f[i].values[j]);
      mismatches += want == h[i].values[j] ? 0 : 1;
    }
    EXPECT_EQ(mismatches, 0u) << f[i].name << " threads=" << threads;
  }
}

TEST(LargeScores, ExactScoresOfMagnitude1e4MatchTheReference) {
  Worst worst_float, worst_bf16, worst_double;
  double largest_lse = 0;
  uint64_t seed = 1;
  for (LargeScores kind : {LargeScores::offset, LargeScores::scale})
    for (bool composed : {false, true})
      for (bool causal : {true, false}) {
        const Problem p = large_score_problem(kind, composed, causal, ++seed);
        std::vector<double> dout = dt::random_dout(p, seed);
        round_to_bf16(dout);
        SCOPED_TRACE(std::string(kind == LargeScores::offset ? "offset" : "scale 512") +
                     (composed ? " composed" : " MHA") + (causal ? " causal" : " full"));
        const std::vector<NamedResult> exact = reference_results(p, dout);
        const double max_lse = max_abs_finite(exact[1].values);
        largest_lse = std::max(largest_lse, max_lse);
        ASSERT_GE(max_lse, 5e3) << "the case is meant to have scores of magnitude 1e4";
        for (int threads : {1, 2}) {
          check_large_scores<float>(p, dout, exact, threads, worst_float);
          check_large_scores<dcmha::bf16>(p, dout, exact, threads, worst_bf16);
          check_bf16_is_rounded_float(p, dout, threads);
        }
        check_large_scores<double>(p, dout, exact, 2, worst_double);
      }
  std::printf("[ measured ] largest |lse| %.0f\n", largest_lse);
  worst_float.print("scores 1e4, float");
  worst_bf16.print("scores 1e4, bf16");
  worst_double.print("scores 1e4, double");
}

// Row t of head h has one target key: q = 100 e_target, k_s = 100 e_s, scale 1, so the target
// scores 10^4 and every other key 0. A gap of 10^4 makes the softmax exactly one-hot (exp(-10^4)
// is 0 even in double), and lse is exactly the target's score.
int64_t one_hot_target(int64_t b, int64_t h, int64_t t) { return (5 * t + 3 * h + b) % (t + 1); }

Problem one_hot_problem(bool composed, uint64_t seed) {
  ProblemSpec s;
  s.B = 2;
  s.H = 4;
  s.Hk = 4;
  s.T = 12;
  s.S = 12;
  s.D = 16;
  s.Dv = 8;
  s.G = 1;
  s.Rq = 2;
  s.Rk = 2;
  s.causal = true;  // target <= t: visible
  s.pre = s.post = composed ? SideSpec::all() : SideSpec::none();
  Problem p = dt::random_problem(s, seed);
  p.scale = 1.0;
  std::fill(p.q.begin(), p.q.end(), 0.0);
  std::fill(p.k.begin(), p.k.end(), 0.0);
  using ref::detail::at_bhtx;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) {
        p.q[size_t(at_bhtx(s.H, s.T, s.D, b, h, t, one_hot_target(b, h, t)))] = 100.0;
        p.k[size_t(at_bhtx(s.Hk, s.S, s.D, b, h, t, t))] = 100.0;
      }
  dt::Rng rng(seed);
  for (std::vector<double>* x : compose_tensors(p))
    for (double& w : *x) w = sixteenths(rng);
  round_to_bf16(p.v);
  return p;
}

template <class T>
class OneHotRows : public ::testing::Test {};
using AllStorage = ::testing::Types<float, double, dcmha::bf16>;
TYPED_TEST_SUITE(OneHotRows, AllStorage);

TYPED_TEST(OneHotRows, ExactResultsAndFiniteGradients) {
  using T = TypeParam;
  for (bool composed : {false, true})
    for (int threads : {1, 2}) {
      SCOPED_TRACE(std::string(composed ? "composed" : "MHA") +
                   " threads=" + std::to_string(threads));
      const Problem p = one_hot_problem(composed, 5);
      std::vector<double> dout = dt::random_dout(p, 5);
      round_to_bf16(dout);
      const std::vector<NamedResult> want = reference_results(p, dout);
      const std::vector<NamedResult> got = run_all<T>(p, dout, threads);
      for (const NamedResult& r : got) EXPECT_TRUE(dt::all_finite(r.values)) << r.name;
      // lse = the target's composed score + log(1): exact.
      EXPECT_EQ(dt::first_bitwise_difference(want[1].values, got[1].values), -1) << "lse";
      expect_close(want, got, tolerance<T>(), 0.0, tolerance<T>());
      if (composed) continue;
      // Without compose, out is the target's value row itself: 1 * v + 0 * (every other row).
      const std::vector<double>& out = got[0].values;
      int64_t differing = 0;
      for (int64_t b = 0; b < p.B; ++b)
        for (int64_t h = 0; h < p.H; ++h)
          for (int64_t t = 0; t < p.T; ++t)
            for (int64_t e = 0; e < p.Dv; ++e)
              differing += out[size_t(ref::detail::at_bhtx(p.H, p.T, p.Dv, b, h, t, e))] !=
                           p.v[size_t(ref::detail::at_bhtx(p.Hk, p.S, p.Dv, b, h,
                                                           one_hot_target(b, h, t), e))];
      EXPECT_EQ(differing, 0);
      EXPECT_EQ(want[1].values[0], 1e4);
    }
}

// ---------------------------------------------------------------------------------------------
// 2. A NaN or Inf in one sequence stays there
//
// Sequences share nothing but the call: threads, panels and the static W. So a non-finite value
// in one sequence's inputs must leave every other sequence's out, lse and gradients bitwise as a
// clean run (same thread count) has them. The exception is the static W gradient: it is a sum
// over the batch, so the poisoned sequence's NaN necessarily reaches it; it is not compared.

/// Writes `value` into sequence b's `tensor` at a position its rows depend on: key 0 (seen by
/// every causal row), the last query row, or their compose terms.
void poison(Problem& p, std::vector<double>& dout, const std::string& tensor, int64_t b,
            double value) {
  using ref::detail::at_bhtx;
  using ref::detail::at_gate;
  using ref::detail::at_lowrank;
  const int64_t last = p.T - 1;
  auto at = [&](std::vector<double>& x, int64_t i) { x.at(size_t(i)) = value; };
  if (tensor == "q")
    at(p.q, at_bhtx(p.H, p.T, p.D, b, 1, last, 0));
  else if (tensor == "k")
    at(p.k, at_bhtx(p.Hk, p.S, p.D, b, 0, 0, 1));
  else if (tensor == "v")
    at(p.v, at_bhtx(p.Hk, p.S, p.Dv, b, p.Hk - 1, 0, 2));
  else if (tensor == "dout")
    at(dout, at_bhtx(p.H, p.T, p.Dv, b, 2, last, 3));
  else if (tensor == "pre.qw1")
    at(p.pre.qw1, at_lowrank(p, p.T, p.pre.Rq, b, last, 0, 0, 1));
  else if (tensor == "pre.kdd")
    at(p.pre.kdd, at_gate(p, p.S, b, 0, 0, 0));
  else if (tensor == "post.qdd")
    at(p.post.qdd, at_gate(p, p.T, b, last, 0, 2));
  else if (tensor == "post.kw2")
    at(p.post.kw2, at_lowrank(p, p.S, p.post.Rk, b, 0, 0, 1, 3));
  else
    FAIL() << "unknown tensor " << tensor;
}

/// B sequences of 9 tokens, causal, every compose term on (static W too), G = 1: B items, so
/// that B = 2 and 3 with 1-3 threads run both thread modes (whole items per thread when the
/// items divide among the threads, the key-split team otherwise).
ProblemSpec isolation_spec(int64_t B) {
  ProblemSpec s;
  s.B = B;
  s.H = 4;
  s.Hk = 2;
  s.T = 9;
  s.S = 9;
  s.D = 8;
  s.Dv = 8;
  s.G = 1;
  s.Rq = 2;
  s.Rk = 2;
  s.causal = true;
  return s;
}

const double kPoisons[] = {kNaN, kInf, -kInf};

template <class T>
class PoisonedSequence : public ::testing::Test {};
using FloatAndDouble = ::testing::Types<float, double>;
TYPED_TEST_SUITE(PoisonedSequence, FloatAndDouble);

TYPED_TEST(PoisonedSequence, OtherSequencesForwardAndBackwardUnchanged) {
  const std::string tensors[] = {"q",       "k",       "v",        "dout",
                                 "pre.qw1", "pre.kdd", "post.qdd", "post.kw2"};
  int cases = 0;
  for (int64_t B : {2, 3}) {
    const Problem clean_p = dt::random_problem(isolation_spec(B), 40 + B);
    const std::vector<double> clean_dout = dt::random_dout(clean_p, 40 + B);
    for (int threads : {1, 2, 3}) {
      const std::vector<NamedResult> clean = run_all<TypeParam>(clean_p, clean_dout, threads);
      for (const NamedResult& r : clean) ASSERT_TRUE(dt::all_finite(r.values)) << r.name;
      for (const std::string& tensor : tensors) {
        const int64_t bad = cases % B;
        const double value = kPoisons[cases++ % 3];
        SCOPED_TRACE("B=" + std::to_string(B) + " threads=" + std::to_string(threads) + " " +
                     tensor + "[" + std::to_string(bad) + "] = " + std::to_string(value));
        Problem p = clean_p;
        std::vector<double> dout = clean_dout;
        poison(p, dout, tensor, bad, value);
        const std::vector<NamedResult> got = run_all<TypeParam>(p, dout, threads);
        bool poison_shows = false;
        for (size_t i = 0; i < got.size(); ++i) {
          if (!got[i].per_sequence) continue;  // the static W gradient: a sum over the batch
          for (int64_t b = 0; b < B; ++b) {
            const std::vector<double> part = dt::sequence_part(got[i].values, B, b);
            if (b == bad)
              poison_shows = poison_shows || !dt::all_finite(part);
            else
              EXPECT_EQ(
                  dt::first_bitwise_difference(dt::sequence_part(clean[i].values, B, b), part), -1)
                  << got[i].name << " of sequence " << b;
          }
        }
        EXPECT_TRUE(poison_shows) << "the poisoned value never reached its own sequence's results";
      }
    }
  }
}

TYPED_TEST(PoisonedSequence, OtherSequencesDecodeUnchanged) {
  using T = TypeParam;
  const std::string tensors[] = {"q", "k", "v", "pre.qw1", "pre.kdd", "post.qdd", "post.kw2"};
  std::vector<double> unused_dout;
  int cases = 0;
  for (int64_t B : {2, 3}) {
    const Problem clean_p = dt::random_problem(isolation_spec(B), 50 + B);
    const dt::DecodeSchedule schedule = dt::uniform_schedule(B, clean_p.T, 4, 2);
    dcmha::DecodeCache<T> cache(dt::cache_config(clean_p, clean_p.T, 4));
    for (int threads : {1, 2, 3}) {
      dcmha::AttentionConfig cfg;
      cfg.num_threads = threads;
      int64_t padding_nonzero = 0;
      const std::vector<double> clean = dt::assemble_rows(
          clean_p, schedule, dt::decode_steps(clean_p, cache, schedule, cfg), padding_nonzero);
      ASSERT_TRUE(dt::all_finite(clean));
      for (const std::string& tensor : tensors) {
        const int64_t bad = cases % B;
        const double value = kPoisons[cases++ % 3];
        SCOPED_TRACE("B=" + std::to_string(B) + " threads=" + std::to_string(threads) + " " +
                     tensor + "[" + std::to_string(bad) + "] = " + std::to_string(value));
        Problem p = clean_p;
        unused_dout.assign(size_t(p.B * p.H * p.T * p.Dv), 0.0);
        poison(p, unused_dout, tensor, bad, value);
        const std::vector<double> got = dt::assemble_rows(
            p, schedule, dt::decode_steps(p, cache, schedule, cfg), padding_nonzero);
        EXPECT_FALSE(dt::all_finite(dt::sequence_part(got, B, bad)))
            << "the poisoned value never showed";
        for (int64_t b = 0; b < B; ++b) {
          if (b == bad) continue;
          EXPECT_EQ(dt::first_bitwise_difference(dt::sequence_part(clean, B, b),
                                                 dt::sequence_part(got, B, b)),
                    -1)
              << "sequence " << b;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// 3. Rows that see no key
//
// Such a row has no softmax: its output, its dq and its query-wise compose gradients are exactly
// 0 and its lse is -inf, whatever compose does. Three ways to get one: causal with T > S (rows
// before the first key), per-sequence lengths (a sequence without keys, padding rows), and a
// window over per-sequence lengths (the spec's window always keeps a row's own diagonal key, so
// it never empties a row alone; with causal alignment of a short sequence it runs the windowed
// kernels' path over rows that see nothing).

struct NoKeyCase {
  const char* cause;
  int64_t T, S;
  bool causal;
  int64_t window;
  std::vector<int64_t> query_lengths, key_lengths;
};

const NoKeyCase kNoKeyCases[] = {
    {"causal T > S", 7, 3, true, 0, {}, {}},
    {"lengths", 5, 6, false, 0, {5, 3}, {0, 4}},
    {"window", 6, 6, true, 2, {6, 4}, {3, 6}},
};

bool sees_no_key(const Problem& p, int64_t b, int64_t t) {
  for (int64_t s = 0; s < p.S; ++s)
    if (ref::detail::visible(p, b, t, s)) return false;
  return true;
}

/// The values of row (b, t) of x, a (B, X, T, Y) tensor (heads_dim) or a (B, T, Y...) one.
std::vector<double> row_of(const std::vector<double>& x, const Problem& p, int64_t b, int64_t t,
                           bool heads_dim) {
  std::vector<double> r;
  const int64_t X = heads_dim ? p.H : 1, Y = int64_t(x.size()) / (p.B * X * p.T);
  for (int64_t h = 0; h < X; ++h)
    for (int64_t y = 0; y < Y; ++y) r.push_back(x[size_t(((b * X + h) * p.T + t) * Y + y)]);
  return r;
}

bool all_exactly_zero(const std::vector<double>& x) {
  return std::all_of(x.begin(), x.end(), [](double v) { return v == 0.0; });
}

bool is_query_wise_gradient(const std::string& name) {
  for (const char* end : {"qw1", "qw2", "qdd"})
    if (name.size() >= 3 && name.compare(name.size() - 3, 3, end) == 0) return true;
  return false;
}

/// Checks the rows of p that see no key in got; returns how many there are.
int64_t expect_rows_without_keys_zero(const Problem& p, const std::vector<NamedResult>& got) {
  int64_t rows = 0;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t t = 0; t < p.T; ++t) {
      if (!sees_no_key(p, b, t)) continue;
      ++rows;
      for (const NamedResult& r : got) {
        if (r.name == "lse") {
          for (double x : row_of(r.values, p, b, t, true))
            EXPECT_EQ(x, -kInf) << "lse b=" << b << " t=" << t;
        } else if (r.name == "out" || r.name == "grad_q") {
          EXPECT_TRUE(all_exactly_zero(row_of(r.values, p, b, t, true)))
              << r.name << " b=" << b << " t=" << t;
        } else if (is_query_wise_gradient(r.name)) {
          EXPECT_TRUE(all_exactly_zero(row_of(r.values, p, b, t, false)))
              << r.name << " b=" << b << " t=" << t;
        }
      }
    }
  return rows;
}

template <class T>
class RowsWithoutKeys : public ::testing::Test {};
TYPED_TEST_SUITE(RowsWithoutKeys, FloatAndDouble);

TYPED_TEST(RowsWithoutKeys, ExactlyZeroUnderEveryComposeSwitch) {
  for (const NoKeyCase& c : kNoKeyCases)
    for (unsigned bits = 0; bits < 64; ++bits) {
      ProblemSpec s;
      s.B = 2;
      s.H = 4;
      s.Hk = 2;
      s.G = 2;
      s.T = c.T;
      s.S = c.S;
      s.D = 4;
      s.Dv = 4;
      s.Rq = 2;
      s.Rk = 1;
      s.causal = c.causal;
      s.window = c.window;
      s.pre = side_from_bits(bits & 7);
      s.post = side_from_bits(bits >> 3);
      SCOPED_TRACE(std::string(c.cause) + " " + s.str());
      Problem p = dt::random_problem(s, 100 + bits);
      p.query_lengths = c.query_lengths;
      p.key_lengths = c.key_lengths;
      const std::vector<double> dout = dt::random_dout(p, 100 + bits);
      const std::vector<NamedResult> got = run_all<TypeParam>(p, dout, 1 + int(bits % 3));
      expect_close(reference_results(p, dout), got, tolerance<TypeParam>(), tolerance<TypeParam>(),
                   tolerance<TypeParam>());
      EXPECT_GT(expect_rows_without_keys_zero(p, got), 0)
          << "the case is meant to have rows without keys";
    }
}

/// Decode steps where one sequence appends nothing at all (it never has a key) and another
/// sometimes appends nothing (it has keys but no new query): every such row is exactly 0 (never
/// NaN), and the other rows are the forward's.
TYPED_TEST(RowsWithoutKeys, DecodeWithCountsOfZero) {
  const dt::DecodeSchedule schedule = {{3, 0, 2}, {1, 0, 0}, {2, 0, 1}};
  const std::vector<int64_t> lengths = {6, 0, 3};
  for (unsigned bits = 0; bits < 64; ++bits) {
    ProblemSpec s;
    s.B = 3;
    s.H = 4;
    s.Hk = 2;
    s.G = 2;
    s.T = 6;
    s.S = 6;
    s.D = 4;
    s.Dv = 4;
    s.Rq = 2;
    s.Rk = 1;
    s.causal = true;
    s.pre = side_from_bits(bits & 7);
    s.post = side_from_bits(bits >> 3);
    SCOPED_TRACE(s.str());
    Problem p = dt::random_problem(s, 200 + bits);
    dcmha::DecodeCache<TypeParam> cache(dt::cache_config(p, s.T, 3));
    dcmha::AttentionConfig cfg;
    cfg.num_threads = 1 + int(bits % 2);
    int64_t padding_nonzero = 0;
    const std::vector<double> rows =
        dt::assemble_rows(p, schedule, dt::decode_steps(p, cache, schedule, cfg), padding_nonzero);
    EXPECT_EQ(padding_nonzero, 0) << "rows beyond a sequence's count must be exactly 0";
    p.query_lengths = p.key_lengths = lengths;
    EXPECT_LE(dt::max_rel_error(ref::forward(p), rows), tolerance<TypeParam>());
  }
}

// ---------------------------------------------------------------------------------------------
// 4. Rows of 65536 keys
//
// The softmax sums 65536 exponentials and P'V as many products per output, in float. The values
// are v = 1 + N(0, 1), so that outputs are ~1: with zero-mean values the average of 65536 of
// them is ~0.004, and any error would hide below the max(1, |ref|) of the relative error. The
// reference materializes B*H*T*S values per intermediate: H = 4, D = 8 keep that at 32 MiB.

const int64_t kLongS = dt::sanitized_or<int64_t>(4096, 65536);
constexpr double kLongRowTolerance = 1e-4;

ProblemSpec long_row_spec(int64_t T, bool dcmha) {
  ProblemSpec s;
  s.B = 1;
  s.H = 4;
  s.Hk = 4;
  s.T = T;
  s.S = kLongS;
  s.D = 8;
  s.Dv = 8;
  s.G = 1;
  s.Rq = 2;
  s.Rk = 2;
  s.causal = true;
  s.pre = s.post = dcmha ? SideSpec::dynamic() : SideSpec::none();  // DCMHA: the official config
  return s;
}

Problem long_row_problem(int64_t T, bool dcmha, uint64_t seed) {
  Problem p = dt::random_problem(long_row_spec(T, dcmha), seed);
  for (double& x : p.v) x += 1.0;
  return p;
}

TEST(LongRows, ForwardAndBackwardOver65536Keys) {
  for (bool dcmha : {true, false}) {
    SCOPED_TRACE(dcmha ? "DCMHA" : "MHA");
    const Problem p = long_row_problem(16, dcmha, 61);
    const std::vector<double> dout = dt::random_dout(p, 61);
    const std::vector<double> want_out = ref::forward(p);
    const ref::Gradients want = ref::backward(p, dout);
    TypedProblem<float> tp(p);
    tp.num_threads = 2;
    tp.set_dout(dout);
    dt::forward_backward(tp, tp.config());
    const double out_err = dt::max_rel_error(want_out, tp.out_values());
    EXPECT_LE(out_err, kLongRowTolerance) << "out";
    double grad_err = 0;
    for (const dt::TensorError& e : dt::gradient_errors(want, tp.gradients())) {
      EXPECT_LE(e.rel, kLongRowTolerance) << e.name;
      grad_err = std::max(grad_err, e.rel);
    }
    std::printf("[ measured ] S=%lld T=16 %s float: out %.3g, gradients %.3g\n", (long long)kLongS,
                dcmha ? "DCMHA" : "MHA", out_err, grad_err);
  }
}

/// A global layer's cache filled with S - 1 tokens in chunks (appended only: no query of the
/// prompt is decoded, as for a prompt whose outputs are not needed), then one token decoded.
TEST(LongRows, DecodeOneTokenAfter65535) {
  const index_t chunk = dt::sanitized_or<index_t>(1024, 8192);
  for (bool dcmha : {true, false}) {
    SCOPED_TRACE(dcmha ? "DCMHA" : "MHA");
    const Problem p = long_row_problem(1, dcmha, 62);
    TypedProblem<float> tp(p);
    const dcmha::ComposeWeights<float> cw = tp.compose();
    dcmha::DecodeCache<float> cache(dt::cache_config(p, kLongS, chunk));
    for (index_t s0 = 0; s0 < kLongS - 1; s0 += chunk) {
      const index_t n = std::min(chunk, kLongS - 1 - s0);
      cache.append(dt::slice(tp.k(), 2, s0, n), dt::slice(tp.v(), 2, s0, n),
                   dt::key_side_of(cw, s0, n));
    }
    cache.append(dt::slice(tp.k(), 2, kLongS - 1, 1), dt::slice(tp.v(), 2, kLongS - 1, 1),
                 dt::key_side_of(cw, kLongS - 1, 1));
    ASSERT_EQ(cache.length(0), kLongS);
    dcmha::AttentionConfig cfg;
    cfg.num_threads = 2;
    dcmha::decode(cfg, tp.q(), cache, dt::query_side_of(cw, 0, 1), tp.out());
    const double err = dt::max_rel_error(ref::forward(p), tp.out_values());
    EXPECT_LE(err, kLongRowTolerance);
    std::printf("[ measured ] S=%lld decode %s float: out %.3g\n", (long long)kLongS,
                dcmha ? "DCMHA" : "MHA", err);
  }
}

// ---------------------------------------------------------------------------------------------
// 5. Lengths and sizes of zero

template <class T>
class ZeroLengths : public ::testing::Test {};
TYPED_TEST_SUITE(ZeroLengths, FloatAndDouble);

ProblemSpec zero_length_spec(int64_t B, bool composed, bool causal) {
  ProblemSpec s;
  s.B = B;
  s.H = 4;
  s.Hk = 2;
  s.G = 2;
  s.T = 5;
  s.S = 6;
  s.D = 4;
  s.Dv = 4;
  s.Rq = 2;
  s.Rk = 1;
  s.causal = causal;
  s.pre = s.post = composed ? SideSpec::all() : SideSpec::none();
  return s;
}

/// Every sequence without queries, or without keys: every output and gradient (the static W
/// gradients too, a sum of nothing) is exactly 0 and every lse -inf.
TYPED_TEST(ZeroLengths, EverySequenceEmpty) {
  for (bool composed : {false, true})
    for (bool causal : {true, false})
      for (bool no_queries : {true, false}) {
        const ProblemSpec s = zero_length_spec(2, composed, causal);
        SCOPED_TRACE(s.str() + (no_queries ? " query_lengths 0" : " key_lengths 0"));
        Problem p = dt::random_problem(s, 7);
        p.query_lengths = {no_queries ? 0 : s.T, no_queries ? 0 : s.T};
        p.key_lengths = {no_queries ? s.S : 0, no_queries ? s.S : 0};
        const std::vector<NamedResult> got = run_all<TypeParam>(p, dt::random_dout(p, 7), 2);
        for (const NamedResult& r : got) {
          if (r.name == "lse")
            for (double x : r.values) EXPECT_EQ(x, -kInf);
          else
            EXPECT_TRUE(all_exactly_zero(r.values)) << r.name;
        }
      }
}

/// A sequence without queries and one without keys beside one with both: the empty ones give
/// exact zeros (-inf lse), the other the reference's results.
TYPED_TEST(ZeroLengths, MixedWithNonEmptySequences) {
  for (bool composed : {false, true}) {
    const ProblemSpec s = zero_length_spec(3, composed, true);
    SCOPED_TRACE(s.str());
    Problem p = dt::random_problem(s, 8);
    p.query_lengths = {0, 5, 3};
    p.key_lengths = {4, 0, 6};
    const std::vector<double> dout = dt::random_dout(p, 8);
    const std::vector<NamedResult> got = run_all<TypeParam>(p, dout, 2);
    expect_close(reference_results(p, dout), got, tolerance<TypeParam>(), tolerance<TypeParam>(),
                 tolerance<TypeParam>());
    for (const NamedResult& r : got) {
      if (!r.per_sequence) continue;
      for (int64_t b : {0, 1}) {
        const std::vector<double> part = dt::sequence_part(r.values, p.B, b);
        if (r.name == "lse")
          for (double x : part) EXPECT_EQ(x, -kInf) << "sequence " << b;
        else
          EXPECT_TRUE(all_exactly_zero(part)) << r.name << " of sequence " << b;
      }
    }
  }
}

/// Throws dcmha::Error with exactly `message`, or fails.
template <class F>
void expect_error(const std::string& message, F&& call) {
  try {
    call();
    ADD_FAILURE() << "no dcmha::Error, expected: " << message;
  } catch (const dcmha::Error& e) {
    EXPECT_EQ(std::string(e.what()), message);
  }
}

struct Sizes {
  index_t B = 1, H = 2, Hk = 2, T = 3, S = 3, D = 4, Dv = 4;
};

/// forward and backward with one size 0: rejected, naming the first tensor dimension that holds
/// it, before any output is written.
TEST(ZeroSizes, AttentionRejectsThemNamingTheArgument) {
  struct Case {
    const char* what;
    Sizes sizes;
    const char* argument;
  };
  auto with = [](index_t Sizes::*dim) {
    Sizes s;
    s.*dim = 0;
    return s;
  };
  const Case cases[] = {
      {"T", with(&Sizes::T), "q.shape[2] (T)"},    {"S", with(&Sizes::S), "k.shape[2] (S)"},
      {"B", with(&Sizes::B), "q.shape[0] (B)"},    {"H", with(&Sizes::H), "q.shape[1] (H)"},
      {"Hk", with(&Sizes::Hk), "k.shape[1] (Hk)"}, {"D", with(&Sizes::D), "q.shape[3] (D)"},
      {"Dv", with(&Sizes::Dv), "v.shape[3] (Dv)"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string("size 0: ") + c.what);
    const Sizes& z = c.sizes;
    std::vector<float> in(64, 1.0f), out(64, kNaN), grads(3 * 64, kNaN);
    std::vector<float> lse(64, kNaN);
    auto q = dcmha::view<4>(static_cast<const float*>(in.data()), {z.B, z.H, z.T, z.D});
    auto k = dcmha::view<4>(static_cast<const float*>(in.data()), {z.B, z.Hk, z.S, z.D});
    auto v = dcmha::view<4>(static_cast<const float*>(in.data()), {z.B, z.Hk, z.S, z.Dv});
    auto o = dcmha::view<4>(out.data(), {z.B, z.H, z.T, z.Dv});
    auto l = dcmha::view<3>(lse.data(), {z.B, z.H, z.T});
    const dcmha::AttentionConfig cfg;
    expect_error(std::string("dcmha::forward: ") + c.argument + ": expected >= 1, got 0",
                 [&] { dcmha::forward(cfg, q, k, v, o, l); });
    expect_error(std::string("dcmha::backward: ") + c.argument + ": expected >= 1, got 0", [&] {
      dcmha::backward(cfg, q, k, v, l, q, dcmha::view<4>(grads.data(), q.shape),
                      dcmha::view<4>(grads.data() + 64, k.shape),
                      dcmha::view<4>(grads.data() + 128, v.shape));
    });
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return std::isnan(x); }))
        << "out written";
    EXPECT_TRUE(std::all_of(grads.begin(), grads.end(), [](float x) { return std::isnan(x); }))
        << "grads written";
  }
}

TEST(ZeroSizes, DecodeRejectsThemNamingTheArgument) {
  dcmha::DecodeCacheConfig empty_batch;
  empty_batch.B = 0;
  empty_batch.capacity = 4;
  expect_error("dcmha::DecodeCache: config.B: expected >= 1, got 0",
               [&] { dcmha::DecodeCache<float> cache(empty_batch); });

  dcmha::DecodeCacheConfig cc;
  cc.B = 1;
  cc.H = 2;
  cc.Hk = 2;
  cc.D = 4;
  cc.Dv = 4;
  cc.capacity = 4;
  cc.max_step = 2;
  dcmha::DecodeCache<float> cache(cc);
  std::vector<float> in(64, 1.0f), out(64, kNaN);
  auto tokens = [&](index_t heads, index_t n) {
    return dcmha::view<4>(static_cast<const float*>(in.data()), {1, heads, n, 4});
  };
  expect_error("dcmha::DecodeCache::append: k_new.shape[2] (n): expected >= 1, got 0",
               [&] { cache.append(tokens(2, 0), tokens(2, 0)); });
  EXPECT_EQ(cache.length(0), 0);
  cache.append(tokens(2, 1), tokens(2, 1));
  expect_error(
      "dcmha::decode: q_new.shape[2] (n): expected 1 (the n of the last DecodeCache::append), got "
      "0",
      [&] {
        dcmha::decode({}, tokens(2, 0), cache, dcmha::view<4>(out.data(), {1, 2, 0, 4}));
      });
  EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](float x) { return std::isnan(x); }))
      << "out written";
}

}  // namespace

// Incremental decoding: DecodeCache + dcmha::decode against the reference forward.
//
// Every equivalence test runs a whole sequence through the cache: a prefill step (the prompt's
// tokens appended and decoded at once), then the rest n tokens at a time, and compares the rows
// each step produced with the rows of the double-precision reference over all tokens (and with
// the production forward, which shares the kernels: a bug common to both fails only the first).
// Padded batches give every sequence its own length and its own count per step, so the
// sequences sit at different positions (and, for window layers, at different ring offsets) in
// the same call. After every append the cache must hold exactly the tokens it reports.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dcmha/dcmha.hpp"
#include "support/decode_steps.hpp"
#include "support/problem.hpp"

namespace {

using dcmha::index_t;
using dcmha::TensorView;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;
using dcmha::test::TypedProblem;

template <class T>
double tolerance() {
  return std::is_same_v<T, float> ? 2e-4 : 1e-9;
}

/// One decode run: the prompt length of each sequence, then n tokens per step, or an explicit
/// plan of counts per step and sequence.
struct Schedule {
  std::vector<int64_t> prefill;  // per sequence; empty: prefill_all for every sequence
  int64_t prefill_all = 7;
  int64_t step = 1;
  std::vector<int64_t> lengths;  // total tokens per sequence; empty: spec.T for every sequence
  // plan[i][b]: tokens sequence b appends in step i. Non-empty: replaces prefill, step and
  // lengths (sequence b's length is the sum of its column).
  std::vector<std::vector<int64_t>> plan;
  bool bthd = false;           // new-token tensors kept (B, n, H, D) in memory
  bool caller_memory = false;  // the cache in a caller-provided buffer
  bool workspace = false;      // one Workspace kept across the steps
  bool check_cache = true;     // expect_cached_tokens after every append
};

/// The counts of every step of sch: its plan, or the prompts then `step` tokens at a time until
/// every sequence has its length. A step in which no sequence appends is left out (append needs
/// n >= 1).
std::vector<std::vector<int64_t>> step_counts(const Schedule& sch, int64_t B, int64_t T) {
  std::vector<std::vector<int64_t>> plan;
  for (const std::vector<int64_t>& counts : sch.plan)
    if (*std::max_element(counts.begin(), counts.end()) > 0) plan.push_back(counts);
  if (!sch.plan.empty()) return plan;
  const std::vector<int64_t> len =
      sch.lengths.empty() ? std::vector<int64_t>(size_t(B), T) : sch.lengths;
  const std::vector<int64_t> pre =
      sch.prefill.empty() ? std::vector<int64_t>(size_t(B), sch.prefill_all) : sch.prefill;
  std::vector<int64_t> done(size_t(B), 0);
  for (int step = 0;; ++step) {
    std::vector<int64_t> count(static_cast<size_t>(B));
    for (size_t b = 0; b < size_t(B); ++b)
      count[b] = std::min(step == 0 ? pre[b] : sch.step, len[b] - done[b]);
    if (*std::max_element(count.begin(), count.end()) == 0) {
      if (step == 0) continue;  // no sequence has a prompt: start with the first step
      return plan;
    }
    for (size_t b = 0; b < size_t(B); ++b) done[b] += count[b];
    plan.push_back(count);
  }
}

/// Tokens per sequence after the whole schedule.
std::vector<int64_t> sequence_lengths(const std::vector<std::vector<int64_t>>& plan, int64_t B) {
  std::vector<int64_t> len(size_t(B), 0);
  for (const std::vector<int64_t>& counts : plan)
    for (size_t b = 0; b < size_t(B); ++b) len[b] += counts[b];
  return len;
}

std::string describe(const Schedule& sch) {
  std::string r = sch.plan.empty() ? "prefill " + std::to_string(sch.prefill_all) + " step " +
                                         std::to_string(sch.step)
                                   : std::string("plan");
  if (!sch.lengths.empty() || !sch.plan.empty()) r += " padded";
  if (sch.bthd) r += " bthd";
  if (sch.caller_memory) r += " caller memory";
  if (sch.workspace) r += " workspace";
  return r;
}

/// (B, X, n, Y) buffer as a (B, X, n, Y) view, or, when it was gathered as (B, n, X, Y), as bthd.
template <class T>
TensorView<T, 4> act_view(std::vector<T>& buf, int64_t B, int64_t X, int64_t n, int64_t Y,
                          bool bthd) {
  return bthd ? dcmha::bthd(buf.data(), B, n, X, Y) : dcmha::bhtd(buf.data(), B, X, n, Y);
}

/// Canonical (B, X, L, Y) -> (B, L, X, Y), for the bthd runs.
inline std::vector<double> to_btxy(const std::vector<double>& x, int64_t B, int64_t X, int64_t L,
                                   int64_t Y) {
  std::vector<double> out(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < X; ++h)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t y = 0; y < Y; ++y)
          out[size_t(((b * L + l) * X + h) * Y + y)] = x[size_t(((b * X + h) * L + l) * Y + y)];
  return out;
}

dcmha::DecodeCacheConfig cache_config(const ProblemSpec& s, int64_t max_step) {
  dcmha::DecodeCacheConfig c;
  c.B = s.B;
  c.H = s.H;
  c.Hk = s.Hk;
  c.D = s.D;
  c.Dv = s.Dv;
  c.G = s.G;
  c.pre_key_wise = s.pre.key_wise;
  c.post_key_wise = s.post.key_wise;
  c.Rk = (c.pre_key_wise || c.post_key_wise) ? s.Rk : 0;
  c.window = s.window;
  c.capacity = s.window > 0 ? 0 : s.T;
  c.max_step = max_step;
  return c;
}

/// Counts the cache entries that differ from what was appended; keeps the first for the message.
struct Mismatches {
  int64_t count = 0;
  std::string first;
  template <class T>
  void check(const std::string& what, int64_t b, int64_t token, double appended, T cached) {
    if (cached == T(appended)) return;  // append copies: bit for bit, and a NaN never matches
    if (count++ == 0)
      first = what + " of sequence " + std::to_string(b) + " token " + std::to_string(token) +
              ": cached " + std::to_string(double(cached)) + ", appended " +
              std::to_string(appended);
  }
};

/// K and V of token j of sequence b in slot `slot` against the problem's (B, Hk, T, D) values.
template <class T>
void check_cached_kv(const dcmha::DecodeCache<T>& cache, const dcmha::reference::Problem& p,
                     int64_t b, int64_t j, index_t slot, Mismatches& bad) {
  const auto k = cache.k_slots(), v = cache.v_slots();
  for (int64_t h = 0; h < p.Hk; ++h) {
    for (int64_t d = 0; d < p.D; ++d)
      bad.check("K", b, j, p.k[size_t(((b * p.Hk + h) * p.T + j) * p.D + d)], k(b, h, slot, d));
    for (int64_t e = 0; e < p.Dv; ++e)
      bad.check("V", b, j, p.v[size_t(((b * p.Hk + h) * p.T + j) * p.Dv + e)], v(b, h, slot, e));
  }
}

/// The key-wise terms (kw1, kw2, kdd, pre and post where cached) of token j of sequence b.
template <class T>
void check_cached_key_wise(const dcmha::DecodeCache<T>& cache, const dcmha::reference::Problem& p,
                           int64_t b, int64_t j, index_t slot, Mismatches& bad) {
  const int64_t G = p.G, M = p.H / p.G;
  for (bool post : {false, true}) {
    const dcmha::reference::ComposeSide& c = post ? p.post : p.pre;
    if (!c.key_wise) continue;
    const std::string side = post ? "post " : "pre ";
    const auto kw1 = cache.kw1_slots(post), kw2 = cache.kw2_slots(post);
    const auto kdd = cache.kdd_slots(post);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t r = 0; r < c.Rk; ++r) {
          const size_t at = size_t((((b * p.S + j) * G + g) * c.Rk + r) * M + m);
          bad.check(side + "kw1", b, j, c.kw1[at], kw1(b, slot, g, r, m));
          bad.check(side + "kw2", b, j, c.kw2[at], kw2(b, slot, g, r, m));
        }
        bad.check(side + "kdd", b, j, c.kdd[size_t(((b * p.S + j) * G + g) * M + m)],
                  kdd(b, slot, g, m));
      }
  }
}

/// The cache holds exactly the tokens it reports: the last kept(b) tokens of every sequence b,
/// token j in slot j % capacity(). A padding token written over a kept one shows here even
/// where no query would read it (a full sequence with count 0, an old slot of a window ring).
template <class T>
void expect_cached_tokens(const dcmha::DecodeCache<T>& cache, const dcmha::reference::Problem& p,
                          int step) {
  Mismatches bad;
  for (index_t b = 0; b < cache.batch(); ++b)
    for (index_t j = cache.length(b) - cache.kept(b); j < cache.length(b); ++j) {
      check_cached_kv(cache, p, b, j, j % cache.capacity(), bad);
      check_cached_key_wise(cache, p, b, j, j % cache.capacity(), bad);
    }
  EXPECT_EQ(bad.count, 0) << "step " << step << ": " << bad.first;
}

/// Called after each append with the cache and the step number (0 = prefill).
template <class T>
using AfterAppend = std::function<void(dcmha::DecodeCache<T>&, int)>;

/// Runs the schedule; returns the rows of all steps assembled as (B, H, T, Dv) (padding rows 0).
template <class T>
std::vector<double> run_decode(const dcmha::reference::Problem& p, const ProblemSpec& spec,
                               const Schedule& sch, const AfterAppend<T>& after_append = {}) {
  const int64_t B = p.B, H = p.H, Hk = p.Hk, T_ = p.T, D = p.D, Dv = p.Dv, G = p.G, M = H / G;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::vector<int64_t>> plan = step_counts(sch, B, T_);
  int64_t max_step = 1;
  for (const std::vector<int64_t>& counts : plan)
    max_step = std::max(max_step, *std::max_element(counts.begin(), counts.end()));
  for (int64_t len : sequence_lengths(plan, B))
    if (len > T_)
      throw std::invalid_argument("run_decode: a schedule of " + std::to_string(len) +
                                  " tokens for T = " + std::to_string(T_));

  const dcmha::DecodeCacheConfig cc = cache_config(spec, max_step);
  std::vector<T> memory;
  std::unique_ptr<dcmha::DecodeCache<T>> owned;
  if (sch.caller_memory) {
    // NaN, not zero: the cache must never read a slot it has not written.
    memory.assign(size_t(dcmha::DecodeCache<T>::required_elements(cc)), T(nan));
    owned = std::make_unique<dcmha::DecodeCache<T>>(cc, memory.data(), index_t(memory.size()));
  } else {
    owned = std::make_unique<dcmha::DecodeCache<T>>(cc);
  }
  dcmha::DecodeCache<T>& cache = *owned;
  dcmha::Workspace workspace;

  const std::vector<double> q_src = sch.bthd ? to_btxy(p.q, B, H, T_, D) : p.q;
  const std::vector<double> k_src = sch.bthd ? to_btxy(p.k, B, Hk, T_, D) : p.k;
  const std::vector<double> v_src = sch.bthd ? to_btxy(p.v, B, Hk, T_, Dv) : p.v;
  const std::vector<int64_t> q_shape =
      sch.bthd ? std::vector<int64_t>{B, T_, H, D} : std::vector<int64_t>{B, H, T_, D};
  const std::vector<int64_t> k_shape =
      sch.bthd ? std::vector<int64_t>{B, T_, Hk, D} : std::vector<int64_t>{B, Hk, T_, D};
  const std::vector<int64_t> v_shape =
      sch.bthd ? std::vector<int64_t>{B, T_, Hk, Dv} : std::vector<int64_t>{B, Hk, T_, Dv};
  const int td = sch.bthd ? 1 : 2;

  std::vector<double> result(size_t(B * H * T_ * Dv), 0.0);
  std::vector<int64_t> done(static_cast<size_t>(B), 0);
  for (int step = 0; step < int(plan.size()); ++step) {
    const std::vector<int64_t>& count = plan[size_t(step)];
    const int64_t n = *std::max_element(count.begin(), count.end());

    std::vector<T> q = dcmha::test::gather_tokens<T>(q_src, q_shape, td, done, count, n, nan);
    std::vector<T> k = dcmha::test::gather_tokens<T>(k_src, k_shape, td, done, count, n, nan);
    std::vector<T> v = dcmha::test::gather_tokens<T>(v_src, v_shape, td, done, count, n, nan);
    std::vector<T> out(static_cast<size_t>(B * H * n * Dv), T(nan));
    std::vector<std::vector<T>> keep;  // compose buffers of this step
    dcmha::ComposeWeights<T> query_side, key_side;
    // Padding tokens: NaN where the cache must never store or read them (K, V, key-wise terms
    // and q), finite for query-wise terms (the kernel multiplies the zero probabilities of a
    // padding row by them, and 0 * NaN is NaN).
    auto lowrank = [&](const std::vector<double>& x, int64_t R, double fill) {
      keep.push_back(dcmha::test::gather_tokens<T>(x, {B, T_, G, R, M}, 1, done, count, n, fill));
      return dcmha::view<5>(static_cast<const T*>(keep.back().data()), {B, n, G, R, M});
    };
    auto gate = [&](const std::vector<double>& x, double fill) {
      keep.push_back(dcmha::test::gather_tokens<T>(x, {B, T_, G, M}, 1, done, count, n, fill));
      return dcmha::view<4>(static_cast<const T*>(keep.back().data()), {B, n, G, M});
    };
    const dcmha::reference::ComposeSide* ref_sides[2] = {&p.pre, &p.post};
    for (int s = 0; s < 2; ++s) {
      const dcmha::reference::ComposeSide& c = *ref_sides[s];
      dcmha::ComposeTerms<T>& qs = s == 0 ? query_side.pre : query_side.post;
      dcmha::ComposeTerms<T>& ks = s == 0 ? key_side.pre : key_side.post;
      if (c.static_w) {
        qs.static_w = true;
        keep.emplace_back(c.w.begin(), c.w.end());
        qs.w = dcmha::view<3>(static_cast<const T*>(keep.back().data()), {G, M, M});
      }
      if (c.query_wise) {
        qs.query_wise = true;
        qs.qw1 = lowrank(c.qw1, c.Rq, 0.25);
        qs.qw2 = lowrank(c.qw2, c.Rq, 0.25);
        qs.qdd = gate(c.qdd, 0.25);
      }
      if (c.key_wise) {
        ks.key_wise = true;
        ks.kw1 = lowrank(c.kw1, c.Rk, nan);
        ks.kw2 = lowrank(c.kw2, c.Rk, nan);
        ks.kdd = gate(c.kdd, nan);
      }
    }

    const bool padded = std::any_of(count.begin(), count.end(), [&](int64_t x) { return x != n; });
    cache.append(act_view(k, B, Hk, n, D, sch.bthd), act_view(v, B, Hk, n, Dv, sch.bthd), key_side,
                 padded ? dcmha::view<1>(static_cast<const index_t*>(count.data()), {B})
                        : TensorView<const index_t, 1>{});
    if (sch.check_cache) expect_cached_tokens(cache, p, step);
    if (after_append) after_append(cache, step);
    dcmha::AttentionConfig cfg;
    if (sch.workspace)
      dcmha::decode(cfg, act_view(q, B, H, n, D, sch.bthd), cache, query_side,
                    dcmha::bhtd(out.data(), B, H, n, Dv), workspace);
    else
      dcmha::decode(cfg, act_view(q, B, H, n, D, sch.bthd), cache, query_side,
                    dcmha::bhtd(out.data(), B, H, n, Dv));

    for (int64_t b = 0; b < B; ++b) {
      EXPECT_EQ(cache.length(b), done[size_t(b)] + count[size_t(b)]);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t e = 0; e < Dv; ++e) {
            const double x = double(out[size_t(((b * H + h) * n + i) * Dv + e)]);
            if (i < count[size_t(b)])
              result[size_t(((b * H + h) * T_ + done[size_t(b)] + i) * Dv + e)] = x;
            else if (x != 0.0)  // a padding row: exactly zero, never NaN
              ADD_FAILURE() << "step " << step << " b " << b << " padding row " << i << " = " << x;
          }
    }
    for (int64_t b = 0; b < B; ++b) done[size_t(b)] += count[size_t(b)];
  }
  return result;
}

/// The lengths a forward over the whole schedule takes: empty where every sequence has all T
/// tokens, so that unpadded runs compare with the unpadded forward.
std::vector<int64_t> padded_lengths(const Schedule& sch, int64_t B, int64_t T) {
  const std::vector<int64_t> len = sequence_lengths(step_counts(sch, B, T), B);
  const bool full = std::all_of(len.begin(), len.end(), [T](int64_t x) { return x == T; });
  return full ? std::vector<int64_t>{} : len;
}

/// The reference's causal forward over every sequence's tokens (padding rows 0): sequence b's
/// row t sees its keys s <= t within the window, which is what decode's row for token t must be.
std::vector<double> reference_rows(dcmha::reference::Problem p,
                                   const std::vector<int64_t>& lengths) {
  p.query_lengths = p.key_lengths = lengths;
  return dcmha::reference::forward(p);
}

/// The production forward over the same tokens.
template <class T>
std::vector<double> forward_rows(dcmha::reference::Problem p, const std::vector<int64_t>& lengths) {
  p.query_lengths = p.key_lengths = lengths;
  TypedProblem<T> tp(p);
  dcmha::AttentionConfig cfg = tp.config();
  if (!lengths.empty()) {
    cfg.query_lengths =
        dcmha::view<1>(static_cast<const index_t*>(tp.problem().query_lengths.data()), {p.B});
    cfg.key_lengths =
        dcmha::view<1>(static_cast<const index_t*>(tp.problem().key_lengths.data()), {p.B});
  }
  dcmha::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), {}, tp.compose());
  return tp.out_values();
}

ProblemSpec decode_spec(int64_t window = 0) {
  ProblemSpec s;
  s.B = 1;
  s.H = 4;
  s.Hk = 4;
  s.T = s.S = 23;
  s.D = 8;
  s.Dv = 6;
  s.G = 1;
  s.Rq = 2;
  s.Rk = 2;
  s.causal = true;
  s.window = window;
  s.pre = s.post = SideSpec::dynamic();
  return s;
}

/// Decode's rows against the reference and against the production forward.
template <class T>
void check_decode(const ProblemSpec& spec, const Schedule& sch, uint64_t seed = 7) {
  SCOPED_TRACE(spec.str() + " " + describe(sch));
  const dcmha::reference::Problem p = dcmha::test::random_problem(spec, seed);
  const std::vector<int64_t> lengths = padded_lengths(sch, p.B, p.T);
  const std::vector<double> got = run_decode<T>(p, spec, sch);
  EXPECT_LE(dcmha::test::max_rel_error(reference_rows(p, lengths), got), tolerance<T>())
      << "against the reference";
  EXPECT_LE(dcmha::test::max_rel_error(forward_rows<T>(p, lengths), got), tolerance<T>())
      << "against forward";
}

/// Token by token and three at a time, each after a 7-token prefill (a 1-token one for window
/// layers too, so the ring is as small as it gets: W + max_step - 1 slots).
template <class T>
void check_schedules(const ProblemSpec& spec, Schedule base = {}) {
  for (int64_t step : {1, 3})
    for (int64_t prefill : {int64_t(7), int64_t(1)}) {
      if (prefill == 1 && spec.window == 0 && step == 3) continue;
      Schedule s = base;
      s.step = step;
      s.prefill_all = prefill;
      check_decode<T>(spec, s);
    }
}

template <class T>
class Decode : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Decode, Scalars);

// ---------------------------------------------------------------------------------------------
// Equivalence with the full forward

TYPED_TEST(Decode, GlobalLayer) { check_schedules<TypeParam>(decode_spec()); }
// Prefill then steps, all through one Workspace: the prefill's larger buffers serve the steps.
TYPED_TEST(Decode, WorkspaceKeptAcrossSteps) {
  Schedule s;
  s.workspace = true;
  check_schedules<TypeParam>(decode_spec(), s);
  check_schedules<TypeParam>(decode_spec(5), s);
}

// T = 23 with window 5: a ring of 5 + max_step - 1 slots wraps several times.
TYPED_TEST(Decode, WindowLayer) { check_schedules<TypeParam>(decode_spec(5)); }

TYPED_TEST(Decode, StaticW) {
  for (int64_t window : {0, 5}) {
    ProblemSpec s = decode_spec(window);
    s.pre = s.post = SideSpec::all();
    check_schedules<TypeParam>(s);
  }
}

// Official query_wise=True: no key-wise terms, so the cache holds K and V only.
TYPED_TEST(Decode, QueryWiseOnly) {
  for (int64_t window : {0, 5})
    for (bool static_w : {false, true}) {
      ProblemSpec s = decode_spec(window);
      s.pre = s.post = SideSpec{static_w, true, false};
      check_schedules<TypeParam>(s);
    }
}

// Key-wise state cached for one side only; the other side has none, or no compose at all.
TYPED_TEST(Decode, KeyWiseOnOneSide) {
  ProblemSpec s = decode_spec(5);
  s.pre = SideSpec::dynamic();
  s.post = SideSpec{false, true, false};
  check_schedules<TypeParam>(s);
  s.pre = SideSpec::none();
  s.post = SideSpec{false, false, true};
  check_schedules<TypeParam>(s);
}

TYPED_TEST(Decode, MultiHeadAttention) {
  for (int64_t window : {0, 5}) {
    ProblemSpec s = decode_spec(window);
    s.pre = s.post = SideSpec::none();
    check_schedules<TypeParam>(s);
  }
}

TYPED_TEST(Decode, GroupedQueryAttention) {
  for (int64_t Hk : {2, 1})
    for (int64_t window : {0, 5}) {
      ProblemSpec s = decode_spec(window);
      s.Hk = Hk;
      check_schedules<TypeParam>(s);
    }
}

TYPED_TEST(Decode, TwoComposeGroups) {
  for (int64_t window : {0, 5}) {
    ProblemSpec s = decode_spec(window);
    s.H = 6;
    s.G = 2;
    s.Hk = 3;
    s.pre = SideSpec::all();
    check_schedules<TypeParam>(s);
  }
}

// Sequences of different lengths and prompts (one without a prompt at all): every step has a
// different count per sequence, and the shorter ones run out while the others continue.
TYPED_TEST(Decode, PaddedBatch) {
  for (int64_t window : {0, 5}) {
    ProblemSpec s = decode_spec(window);
    s.B = 3;
    s.pre = SideSpec::all();
    Schedule sch;
    sch.lengths = {23, 17, 9};
    sch.prefill = {7, 2, 0};
    for (int64_t step : {1, 3}) {
      sch.step = step;
      check_decode<TypeParam>(s, sch);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Padded batches whose longest sequence is not the first

/// Sequences of 3, 11 and 7 tokens in steps of varying counts, some 0 (the middle one has no
/// prompt): the first sequence is never the longest, so the keys decode hands the kernel must
/// reach as far as whichever sequence holds most. In a global layer (capacity 11) sequence 1
/// fills the cache in the last step while sequence 2 appends 4 tokens.
Schedule longest_in_the_middle() {
  Schedule s;
  s.plan = {{2, 0, 1}, {0, 4, 1}, {1, 3, 0}, {0, 3, 1}, {0, 1, 4}};
  return s;
}

/// B 3, T = S = 11 (the longest sequence, so the capacity of a global layer), one problem per
/// compose switch group.
std::vector<ProblemSpec> switch_groups(int64_t window) {
  ProblemSpec base = decode_spec(window);
  base.B = 3;
  base.T = base.S = 11;
  std::vector<ProblemSpec> specs;
  auto add = [&](auto edit) {
    specs.push_back(base);
    edit(specs.back());
  };
  add([](ProblemSpec& s) { s.pre = s.post = SideSpec::none(); });              // MHA
  add([](ProblemSpec& s) { s.pre = s.post = SideSpec{false, true, false}; });  // query-wise only
  add([](ProblemSpec& s) {                                                     // key-wise post only
    s.pre = SideSpec::none();
    s.post = SideSpec{false, false, true};
  });
  add([](ProblemSpec& s) { s.post = SideSpec{false, true, false}; });  // key-wise pre only
  add([](ProblemSpec& s) { s.pre = s.post = SideSpec::all(); });       // static W
  add([](ProblemSpec& s) {                                             // two compose groups
    s.H = 6;
    s.G = 2;
    s.Hk = 3;
    s.pre = SideSpec::all();
  });
  add([](ProblemSpec& s) { s.Hk = 2; });  // GQA
  add([](ProblemSpec& s) { s.Hk = 1; });  // MQA
  return specs;
}

// Window 4 with steps of up to 4 tokens: a ring of 7 slots that sequence 1 wraps, sequence 2
// fills exactly and sequence 0 never reaches.
TYPED_TEST(Decode, PaddedBatchLongestNotFirst) {
  for (int64_t window : {0, 4})
    for (const ProblemSpec& s : switch_groups(window))
      check_decode<TypeParam>(s, longest_in_the_middle());
}

// bf16 and fp16 caches: the float kernels on the widened values, each output rounded once. On a
// problem whose inputs are values of the storage type, every row of every step must be the float
// decode's row rounded, bitwise: every switch group, global and window layers, a padded batch
// whose ring wraps, and token-by-token steps into caller memory.
template <class Storage>
void check_decode_is_rounded_float(const ProblemSpec& spec, const Schedule& sch) {
  SCOPED_TRACE(spec.str() + " " + describe(sch));
  const dcmha::reference::Problem p =
      dcmha::test::storage_problem<Storage>(dcmha::test::random_problem(spec, 7));
  const std::vector<double> f = run_decode<float>(p, spec, sch);
  const std::vector<double> h = run_decode<Storage>(p, spec, sch);
  ASSERT_EQ(f.size(), h.size());
  size_t mismatches = 0, first = 0;
  for (size_t i = 0; i < f.size(); ++i)
    if (dcmha::test::round_to<Storage>(f[i]) != h[i] && mismatches++ == 0) first = i;
  EXPECT_EQ(mismatches, 0u) << "first at " << first << ": float " << f[first] << ", storage "
                            << h[first];
}

/// Head dims of several vectors and a tail, and tens of keys: the kernels' vector paths (the
/// eight-key blocks of narrow few-row scores among them) set the order of the sums.
ProblemSpec wide_decode_spec(int64_t window) {
  ProblemSpec s = decode_spec(window);
  s.B = 2;
  s.T = s.S = 40;
  s.D = 72;
  s.Dv = 40;
  s.pre = SideSpec::all();
  return s;
}

template <class Storage>
void check_decode_storage() {
  Schedule token_by_token;
  token_by_token.prefill_all = 3;
  token_by_token.caller_memory = true;
  for (int64_t window : {0, 4})
    for (const ProblemSpec& s : switch_groups(window)) {
      check_decode_is_rounded_float<Storage>(s, longest_in_the_middle());
      check_decode_is_rounded_float<Storage>(s, token_by_token);
    }
  Schedule long_decode;
  long_decode.prefill_all = 20;
  for (int64_t window : {0, 12})
    check_decode_is_rounded_float<Storage>(wide_decode_spec(window), long_decode);
}

TEST(DecodeStorage, Bf16IsTheRoundedFloatDecode) { check_decode_storage<dcmha::bf16>(); }
TEST(DecodeStorage, Fp16IsTheRoundedFloatDecode) { check_decode_storage<dcmha::half>(); }

// ---------------------------------------------------------------------------------------------
// A global cache that sequences fill

/// Capacity 10 (T), key-wise state on both sides, G 2 and GQA.
ProblemSpec filling_spec() {
  ProblemSpec s = decode_spec();
  s.B = 3;
  s.T = s.S = 10;
  s.H = 6;
  s.G = 2;
  s.Hk = 3;
  s.pre = SideSpec::all();
  return s;
}

/// Sequence 1 fills the cache in step 2, where sequence 2 appends one token more, then appends
/// nothing in steps 3 and 4 while the others go on; sequence 0 fills it in step 4, where sequence
/// 2 appends two. A full sequence's padding tokens have nowhere to go but its own first slots.
Schedule filling_schedule() {
  Schedule s;
  s.plan = {{3, 4, 1}, {2, 4, 2}, {1, 2, 3}, {3, 0, 1}, {1, 0, 2}};
  return s;
}

template <class T>
bool some_sequence_full(const dcmha::DecodeCache<T>& c) {
  for (index_t b = 0; b < c.batch(); ++b)
    if (c.length(b) == c.capacity()) return true;
  return false;
}

// The slot check after every append (run_decode) sees a padding token written over the full
// sequence's first keys even in the steps where that sequence has no row to show it.
TYPED_TEST(Decode, SequenceFillsCacheWhileOthersAppend) {
  const ProblemSpec s = filling_spec();
  const dcmha::reference::Problem p = dcmha::test::random_problem(s, 7);
  for (bool caller_memory : {false, true}) {
    SCOPED_TRACE(caller_memory ? "caller memory" : "owned memory");
    Schedule sch = filling_schedule();
    sch.caller_memory = caller_memory;
    bool filled_beside_more = false, full_beside_others = false;
    const std::vector<double> got =
        run_decode<TypeParam>(p, s, sch, [&](dcmha::DecodeCache<TypeParam>& c, int) {
          for (index_t b = 0; b < c.batch(); ++b) {
            if (c.length(b) != c.capacity()) continue;
            filled_beside_more |= c.last_count(b) > 0 && c.last_count(b) < c.last_step();
            full_beside_others |= c.last_count(b) == 0;
          }
        });
    EXPECT_TRUE(filled_beside_more && full_beside_others)
        << "the schedule no longer fills the cache as intended";
    const std::vector<double> expected = reference_rows(p, padded_lengths(sch, s.B, s.T));
    EXPECT_LE(dcmha::test::max_rel_error(expected, got), tolerance<TypeParam>());
  }
}

/// Expects call to throw a dcmha::Error from fn whose message has every needle.
template <class F>
void expect_rejected(const std::string& fn, F&& call, std::initializer_list<std::string> needles) {
  try {
    call();
  } catch (const dcmha::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(fn + ": ", 0), 0u) << msg;
    for (const std::string& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << "message lacks \"" << n << "\": " << msg;
    return;
  }
  ADD_FAILURE() << "no dcmha::Error thrown";
}

/// Everything a DecodeCache holds, bit for bit: every slot of K, V and the key-wise state, and the
/// counters of every sequence.
template <class T>
struct CacheState {
  std::vector<T> slots;
  std::vector<index_t> counters;

  explicit CacheState(const dcmha::DecodeCache<T>& c) {
    auto add = [&](auto v) {
      if (!v.empty())
        dcmha::test::detail::for_each_logical(v, [&](index_t, T& x) { slots.push_back(x); });
    };
    add(c.k_slots());
    add(c.v_slots());
    for (bool post : {false, true}) {
      add(c.kw1_slots(post));
      add(c.kw2_slots(post));
      add(c.kdd_slots(post));
    }
    counters.push_back(c.last_step());
    for (index_t b = 0; b < c.batch(); ++b)
      counters.insert(counters.end(), {c.length(b), c.kept(b), c.last_count(b)});
  }
  bool operator==(const CacheState& o) const {  // memcmp: a NaN slot equals itself
    return counters == o.counters && slots.size() == o.slots.size() &&
           std::memcmp(slots.data(), o.slots.data(), slots.size() * sizeof(T)) == 0;
  }
};

/// Appends one token to every sequence of a global cache that one sequence has filled: the call
/// must throw and leave the cache as it was. The token's values (1000) are unlike every real one,
/// so a partial write, e.g. of the sequences that still had room, shows.
template <class T>
void expect_overflow_rejected(dcmha::DecodeCache<T>& cache) {
  const dcmha::DecodeCacheConfig& c = cache.config();
  const index_t B = c.B, M = c.H / c.G;
  const std::vector<T> k(size_t(B * c.Hk * c.D), T(1000)), v(size_t(B * c.Hk * c.Dv), T(1000));
  const std::vector<T> lowrank(size_t(B * c.G * c.Rk * M), T(1000)),
      gate(size_t(B * c.G * M), T(1000));
  dcmha::ComposeWeights<T> key_side;
  for (bool post : {false, true}) {
    if (!(post ? c.post_key_wise : c.pre_key_wise)) continue;
    dcmha::ComposeTerms<T>& side = post ? key_side.post : key_side.pre;
    side.key_wise = true;
    side.kw1 = side.kw2 = dcmha::view<5>(lowrank.data(), {B, 1, c.G, c.Rk, M});
    side.kdd = dcmha::view<4>(gate.data(), {B, 1, c.G, M});
  }
  const std::vector<index_t> ones(size_t(B), 1);
  const CacheState<T> before(cache);
  // Rejected for the capacity, not for a shape this helper got wrong.
  expect_rejected("dcmha::DecodeCache::append",
                  [&] {
                    cache.append(dcmha::view<4>(k.data(), {B, c.Hk, 1, c.D}),
                                 dcmha::view<4>(v.data(), {B, c.Hk, 1, c.Dv}), key_side,
                                 dcmha::view<1>(ones.data(), {B}));
                  },
                  {"config.capacity"});
  EXPECT_TRUE(CacheState<T>(cache) == before) << "a rejected append changed the cache";
}

// After every append that leaves a sequence full, an append past the capacity is tried: the cache
// stays bit for bit, and the run's rows are bit for bit those of the same run without the tries.
TYPED_TEST(Decode, RejectedAppendChangesNothing) {
  const ProblemSpec s = filling_spec();
  const dcmha::reference::Problem p = dcmha::test::random_problem(s, 7);
  const Schedule sch = filling_schedule();
  int tries = 0;
  const std::vector<double> plain = run_decode<TypeParam>(p, s, sch);
  const std::vector<double> tried =
      run_decode<TypeParam>(p, s, sch, [&](dcmha::DecodeCache<TypeParam>& c, int) {
        if (!some_sequence_full(c)) return;
        expect_overflow_rejected(c);
        ++tries;
      });
  EXPECT_GT(tries, 0);
  EXPECT_TRUE(plain == tried) << "rows differ after a rejected append";
  const std::vector<double> expected = reference_rows(p, padded_lengths(sch, s.B, s.T));
  EXPECT_LE(dcmha::test::max_rel_error(expected, tried), tolerance<TypeParam>());
}

TYPED_TEST(Decode, StridedNewTokensAndCallerMemory) {
  for (int64_t window : {0, 5}) {
    ProblemSpec s = decode_spec(window);
    s.B = 2;
    s.Hk = 2;
    Schedule sch;
    sch.step = 3;
    sch.bthd = true;
    check_decode<TypeParam>(s, sch);
    sch.bthd = false;
    sch.caller_memory = true;
    check_decode<TypeParam>(s, sch);
  }
}

// Larger than one 32-key compose chunk and one 16-key thread share, with a window that spans
// several of each.
TYPED_TEST(Decode, LongerSequences) {
  ProblemSpec s = decode_spec();
  s.T = s.S = 90;
  s.H = 8;
  s.Hk = 2;
  s.G = 2;
  Schedule sch;
  sch.prefill_all = 40;
  sch.step = 4;
  check_decode<TypeParam>(s, sch);
  s.window = 37;
  check_decode<TypeParam>(s, sch);
}

// ---------------------------------------------------------------------------------------------
// The cache state is what decode uses

/// Corrupts the cache right after the prefill and returns the error the decode rows then have.
double corrupted_error(const ProblemSpec& spec,
                       const std::function<void(dcmha::DecodeCache<double>&)>& corrupt) {
  const dcmha::reference::Problem p = dcmha::test::random_problem(spec, 11);
  Schedule sch;
  sch.check_cache = false;  // the corrupted entry is the point
  const std::vector<double> expected = reference_rows(p, {});
  const std::vector<double> got =
      run_decode<double>(p, spec, sch, [&](dcmha::DecodeCache<double>& c, int step) {
        if (step == 0) corrupt(c);
      });
  return dcmha::test::max_rel_error(expected, got);
}

TEST(DecodeCacheState, ZeroingOneKeyWiseEntryChangesTheResult) {
  for (int64_t window : {0, 5}) {
    SCOPED_TRACE("window " + std::to_string(window));
    const ProblemSpec s = decode_spec(window);
    // Token 6 (the last of the prompt) is seen by every later query, also under the window.
    const double err = corrupted_error(
        s, [](dcmha::DecodeCache<double>& c) { c.kw1_slots(false)(0, 6, 0, 1, 2) = 0.0; });
    EXPECT_GT(err, 1e-4);
    EXPECT_LE(corrupted_error(s, [](dcmha::DecodeCache<double>&) {}), 1e-9);
  }
}

TEST(DecodeCacheState, DroppingKddChangesTheResult) {
  const ProblemSpec s = decode_spec();
  const double err = corrupted_error(s, [](dcmha::DecodeCache<double>& c) {
    auto kdd = c.kdd_slots(true);
    for (index_t p = 0; p < c.capacity(); ++p)
      for (index_t m = 0; m < kdd.shape[3]; ++m) kdd(0, p, 0, m) = 0.0;
  });
  EXPECT_GT(err, 1e-3);
}

TEST(DecodeCacheState, CorruptingCachedKeysChangesTheResult) {
  const ProblemSpec s = decode_spec(5);
  const double err =
      corrupted_error(s, [](dcmha::DecodeCache<double>& c) { c.k_slots()(0, 0, 6, 0) += 1.0; });
  EXPECT_GT(err, 1e-3);
}

// Decode may be called again for the same step (e.g. a benchmark); reset() starts over. The
// weights come split by decode_query_side / decode_key_side, as from a projection's output.
TEST(DecodeCacheState, RepeatedDecodeAndReset) {
  ProblemSpec s = decode_spec(5);
  const dcmha::reference::Problem p = dcmha::test::random_problem(s, 3);
  TypedProblem<double> tp(p);
  dcmha::DecodeCache<double> cache(cache_config(s, s.T));
  const dcmha::ComposeWeights<double> cw = tp.compose();
  dcmha::DynamicWeights<const double> dw;
  dw.pre = {cw.pre.qw1, cw.pre.qw2, cw.pre.kw1, cw.pre.kw2, cw.pre.qdd, cw.pre.kdd};
  dw.post = {cw.post.qw1, cw.post.qw2, cw.post.kw1, cw.post.kw2, cw.post.qdd, cw.post.kdd};
  const auto query_side = dcmha::decode_query_side(dw), key_side = dcmha::decode_key_side(dw);

  std::vector<double> out1(size_t(s.H * s.T * s.Dv)), out2(out1.size()), out3(out1.size());
  auto O = [&](std::vector<double>& o) { return dcmha::bhtd(o.data(), 1, s.H, s.T, s.Dv); };
  dcmha::AttentionConfig cfg;
  cache.append(tp.k(), tp.v(), key_side);
  dcmha::decode(cfg, tp.q(), cache, query_side, O(out1));
  dcmha::decode(cfg, tp.q(), cache, query_side, O(out2));
  EXPECT_EQ(out1, out2);
  cache.reset();
  EXPECT_EQ(cache.length(0), 0);
  cache.append(tp.k(), tp.v(), key_side);
  dcmha::decode(cfg, tp.q(), cache, query_side, O(out3));
  EXPECT_EQ(out1, out3);
  // The whole sequence in one step is the forward itself.
  dcmha::forward(tp.config(), tp.q(), tp.k(), tp.v(), tp.out(), {}, cw);
  EXPECT_LE(dcmha::test::max_rel_error(tp.out_values(), out1), 1e-12);
}

// Memory accounting the library documents: per token, key-wise state is 2 (2R + 1) M values.
TEST(DecodeCacheState, RequiredElements) {
  dcmha::DecodeCacheConfig c;
  c.B = 2;
  c.H = 32;
  c.Hk = 32;
  c.D = 128;
  c.Dv = 128;
  c.G = 1;
  c.Rk = 2;
  c.pre_key_wise = c.post_key_wise = true;
  c.capacity = 100;
  const index_t kv = 2 * 32 * 100 * 256, kw = 2 * 100 * 2 * (2 * 2 + 1) * 32;
  EXPECT_EQ(dcmha::DecodeCache<float>::required_elements(c), kv + kw);
  EXPECT_LT(double(kw) / double(kv), 0.04);
  c.window = 256;
  c.capacity = 0;
  c.max_step = 8;
  dcmha::DecodeCache<float> local(c);
  EXPECT_EQ(local.capacity(), 256 + 8 - 1);
}

// ---------------------------------------------------------------------------------------------
// Misuse

/// A small layer (B 2, H 4, Hk 2, G 2, Rk 2, key-wise on both sides) with every buffer one
/// append / decode of n tokens needs.
struct Misuse {
  static constexpr index_t B = 2, H = 4, Hk = 2, D = 8, Dv = 6, G = 2, M = 2, R = 2;
  dcmha::DecodeCacheConfig cc;
  std::vector<std::vector<float>> bufs;

  Misuse() {
    cc.B = B;
    cc.H = H;
    cc.Hk = Hk;
    cc.D = D;
    cc.Dv = Dv;
    cc.G = G;
    cc.Rk = R;
    cc.pre_key_wise = cc.post_key_wise = true;
    cc.capacity = 10;
    cc.max_step = 4;
  }
  template <int N>
  TensorView<float, N> alloc(const dcmha::Shape<N>& shape) {
    index_t n = 1;
    for (index_t s : shape) n *= s;
    bufs.emplace_back(size_t(n), 0.5f);
    return dcmha::view<N>(bufs.back().data(), shape);
  }
  TensorView<float, 4> k(index_t n) { return alloc<4>({B, Hk, n, D}); }
  TensorView<float, 4> v(index_t n) { return alloc<4>({B, Hk, n, Dv}); }
  TensorView<float, 4> q(index_t n) { return alloc<4>({B, H, n, D}); }
  TensorView<float, 4> out(index_t n) { return alloc<4>({B, H, n, Dv}); }
  dcmha::ComposeWeights<float> key_side(index_t n) {
    dcmha::ComposeWeights<float> w;
    for (auto* t : {&w.pre, &w.post}) {
      t->key_wise = true;
      t->kw1 = alloc<5>({B, n, G, R, M});
      t->kw2 = alloc<5>({B, n, G, R, M});
      t->kdd = alloc<4>({B, n, G, M});
    }
    return w;
  }
  dcmha::ComposeWeights<float> query_side(index_t n) {
    dcmha::ComposeWeights<float> w;
    for (auto* t : {&w.pre, &w.post}) {
      t->query_wise = true;
      t->qw1 = alloc<5>({B, n, G, R, M});
      t->qw2 = alloc<5>({B, n, G, R, M});
      t->qdd = alloc<4>({B, n, G, M});
    }
    return w;
  }
};

const std::string kCtor = "dcmha::DecodeCache";
const std::string kAppend = "dcmha::DecodeCache::append";
const std::string kDecode = "dcmha::decode";

TEST(DecodeMisuse, BadConfig) {
  auto rejected = [](auto edit, std::initializer_list<std::string> needles) {
    Misuse m;
    edit(m.cc);
    expect_rejected(
        kCtor, [&] { dcmha::DecodeCache<float> c(m.cc); }, needles);
    expect_rejected(
        kCtor + "::required_elements", [&] { dcmha::DecodeCache<float>::required_elements(m.cc); },
        needles);
  };
  rejected([](auto& c) { c.Hk = 3; }, {"config.Hk", "divisor of H = 4", "got 3"});
  rejected([](auto& c) { c.G = 3; }, {"config.G", "divisor of H = 4", "got 3"});
  rejected([](auto& c) { c.D = 0; }, {"config.D", ">= 1", "got 0"});
  rejected([](auto& c) { c.max_step = 0; }, {"config.max_step", ">= 1", "got 0"});
  rejected([](auto& c) { c.Rk = 0; }, {"config.Rk", ">= 1", "got 0"});
  rejected([](auto& c) { c.pre_key_wise = c.post_key_wise = false; },
           {"config.Rk", "expected 0", "got 2"});
  rejected([](auto& c) { c.capacity = 0; }, {"config.capacity", ">= 1", "got 0"});
  rejected([](auto& c) { c.window = 4; }, {"config.capacity", "expected 0", "got 10"});
  rejected([](auto& c) { c.window = -1; }, {"config.window", ">= 0", "got -1"});
  rejected([](auto& c) { c.capacity = index_t(1) << 62; }, {"config", "overflows"});
}

TEST(DecodeMisuse, CallerBuffer) {
  Misuse m;
  const index_t need = dcmha::DecodeCache<float>::required_elements(m.cc);
  std::vector<float> buf(static_cast<size_t>(need));
  expect_rejected(kCtor, [&] { dcmha::DecodeCache<float> c(m.cc, nullptr, need); },
                  {"buffer", "nullptr"});
  expect_rejected(kCtor, [&] { dcmha::DecodeCache<float> c(m.cc, buf.data(), need - 1); },
                  {"buffer_elements", std::to_string(need), std::to_string(need - 1)});
  dcmha::DecodeCache<float> ok(m.cc, buf.data(), need);
  EXPECT_EQ(ok.capacity(), 10);
}

TEST(DecodeMisuse, AppendStepAndCapacity) {
  Misuse m;
  dcmha::DecodeCache<float> c(m.cc);
  expect_rejected(kAppend, [&] { c.append(m.k(5), m.v(5), m.key_side(5)); },
                  {"k_new.shape[2] (n)", "<= 4", "config.max_step", "got 5"});
  c.append(m.k(4), m.v(4), m.key_side(4));
  c.append(m.k(4), m.v(4), m.key_side(4));
  // 8 + 3 > 10: rejected as a whole, nothing written.
  expect_rejected(kAppend, [&] { c.append(m.k(3), m.v(3), m.key_side(3)); },
                  {"sequence 0", "at most 10", "config.capacity", "8 cached + 3 appended = 11"});
  EXPECT_EQ(c.length(0), 8);
  EXPECT_EQ(c.length(1), 8);
  // With counts, only the sequences that really overflow do.
  std::vector<index_t> counts{2, 3};
  expect_rejected(kAppend,
                  [&] {
                    c.append(m.k(3), m.v(3), m.key_side(3),
                             dcmha::view<1>(static_cast<const index_t*>(counts.data()), {2}));
                  },
                  {"sequence 1", "8 cached + 3 appended"});
  counts = {2, 1};
  c.append(m.k(3), m.v(3), m.key_side(3),
           dcmha::view<1>(static_cast<const index_t*>(counts.data()), {2}));
  EXPECT_EQ(c.length(0), 10);
  EXPECT_EQ(c.length(1), 9);
  expect_rejected(kCtor, [&] { c.length(2); }, {"b", "[0, 2)", "got 2"});

  // A local layer never fills up.
  Misuse w;
  w.cc.window = 3;
  w.cc.capacity = 0;
  dcmha::DecodeCache<float> local(w.cc);
  for (int i = 0; i < 20; ++i) local.append(w.k(4), w.v(4), w.key_side(4));
  EXPECT_EQ(local.length(0), 80);
  EXPECT_EQ(local.kept(0), 3 + 4 - 1);
}

TEST(DecodeMisuse, AppendShapes) {
  Misuse m;
  dcmha::DecodeCache<float> c(m.cc);
  const index_t B = m.B, Hk = m.Hk, D = m.D, Dv = m.Dv, G = m.G, M = m.M, R = m.R;
  expect_rejected(kAppend, [&] { c.append({}, m.v(2), m.key_side(2)); }, {"k_new", "empty view"});
  expect_rejected(kAppend,
                  [&] {
                    c.append(m.alloc<4>({B, Hk, 2, D + 1}), m.v(2), m.key_side(2));
                  },
                  {"k_new.shape[3] (D)", "expected 8", "config.D", "got 9"});
  expect_rejected(kAppend,
                  [&] {
                    c.append(m.alloc<4>({B, 1, 2, D}), m.v(2), m.key_side(2));
                  },
                  {"k_new.shape[1] (Hk)", "expected 2", "config.Hk", "got 1"});
  expect_rejected(kAppend,
                  [&] {
                    c.append(m.alloc<4>({B + 1, Hk, 2, D}), m.v(2), m.key_side(2));
                  },
                  {"k_new.shape[0] (B)", "config.B", "got 3"});
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(3), m.key_side(2)); },
                  {"v_new.shape[2] (n)", "expected 2", "got 3"});
  expect_rejected(kAppend,
                  [&] {
                    c.append(m.k(2), m.alloc<4>({B, Hk, 2, Dv + 2}), m.key_side(2));
                  },
                  {"v_new.shape[3]", "config.Dv", "got 8"});
  auto ks = m.key_side(2);
  ks.pre.kw1 = m.alloc<5>({B, 2, G, R + 1, M});
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); },
                  {"key_side.pre.kw1.shape[3] (R)", "config.Rk", "got 3"});
  ks = m.key_side(2);
  ks.post.kdd = m.alloc<4>({B, 3, G, M});
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); },
                  {"key_side.post.kdd.shape[1] (n)", "expected 2", "got 3"});
  ks = m.key_side(2);
  ks.post.kw2 = m.alloc<5>({B, 2, 1, R, Misuse::H});
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); },
                  {"key_side.post.kw2.shape[2] (G)", "config.G", "got 1"});
  std::vector<index_t> counts{1, 3};
  expect_rejected(kAppend,
                  [&] {
                    c.append(m.k(2), m.v(2), m.key_side(2),
                             dcmha::view<1>(static_cast<const index_t*>(counts.data()), {2}));
                  },
                  {"counts[1]", "[0, 2]", "got 3"});
  expect_rejected(kAppend,
                  [&] {
                    c.append(m.k(2), m.v(2), m.key_side(2),
                             dcmha::view<1>(static_cast<const index_t*>(counts.data()), {1}));
                  },
                  {"counts.shape[0] (B)", "expected 2", "got 1"});
  EXPECT_EQ(c.length(0), 0);
  EXPECT_EQ(c.last_step(), 0);
}

TEST(DecodeMisuse, AppendSwitches) {
  Misuse m;
  dcmha::DecodeCache<float> c(m.cc);
  auto ks = m.key_side(2);
  ks.post = {};
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); },
                  {"key_side.post.key_wise", "expected on", "config.post_key_wise", "got off"});
  ks = m.key_side(2);
  ks.pre.kdd = {};
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); },
                  {"key_side.pre.kdd", "empty view"});
  ks = m.key_side(2);
  ks.pre.query_wise = true;
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); },
                  {"key_side.pre.query_wise", "query_side"});
  ks = m.key_side(2);
  ks.post.static_w = true;
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); },
                  {"key_side.post.static_w", "query_side"});

  Misuse q;
  q.cc.pre_key_wise = false;
  dcmha::DecodeCache<float> post_only(q.cc);
  expect_rejected(kAppend, [&] { post_only.append(q.k(2), q.v(2), q.key_side(2)); },
                  {"key_side.pre.key_wise", "expected off", "config.pre_key_wise", "got on"});
  ks = q.key_side(2);
  ks.pre.key_wise = false;
  expect_rejected(kAppend, [&] { post_only.append(q.k(2), q.v(2), ks); },
                  {"key_side.pre.kw1", "key_wise is off", "expected an empty view"});
}

TEST(DecodeMisuse, DecodeOrderAndShapes) {
  Misuse m;
  dcmha::DecodeCache<float> c(m.cc);
  dcmha::AttentionConfig cfg;
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(1), c, m.query_side(1), m.out(1)); },
                  {"cache", "call DecodeCache::append before decode"});
  c.append(m.k(3), m.v(3), m.key_side(3));
  dcmha::decode(cfg, m.q(3), c, m.query_side(3), m.out(3));  // the matching call is fine
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(1), c, m.query_side(1), m.out(1)); },
                  {"q_new.shape[2] (n)", "expected 3", "last DecodeCache::append", "got 1"});
  expect_rejected(kDecode,
                  [&] {
                    dcmha::decode(cfg, m.alloc<4>({m.B, 8, 3, m.D}), c, m.query_side(3), m.out(3));
                  },
                  {"q_new.shape[1] (H)", "expected 4", "cache.config().H", "got 8"});
  expect_rejected(kDecode,
                  [&] {
                    dcmha::decode(cfg, m.alloc<4>({m.B, m.H, 3, 4}), c, m.query_side(3), m.out(3));
                  },
                  {"q_new.shape[3] (D)", "expected 8", "got 4"});
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(3), c, m.query_side(3), m.out(2)); },
                  {"out.shape[2] (T)", "expected 3", "got 2"});
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(3), c, m.query_side(2), m.out(3)); },
                  {"compose.pre.qw1.shape[1] (T)", "expected 3", "got 2"});
  c.reset();
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(3), c, m.query_side(3), m.out(3)); },
                  {"cache", "reset()"});
}

TEST(DecodeMisuse, DecodeSwitchesAndConfig) {
  Misuse m;
  dcmha::DecodeCache<float> c(m.cc);
  c.append(m.k(2), m.v(2), m.key_side(2));
  auto qs = m.query_side(2);
  qs.post.key_wise = true;
  expect_rejected(kDecode, [&] { dcmha::decode({}, m.q(2), c, qs, m.out(2)); },
                  {"query_side.post.key_wise", "expected off", "from the cache", "got on"});
  qs = m.query_side(2);
  qs.pre.qw1 = m.alloc<5>({m.B, 2, 1, m.R, 4});
  qs.pre.qw2 = m.alloc<5>({m.B, 2, 1, m.R, 4});
  qs.pre.qdd = m.alloc<4>({m.B, 2, 1, 4});
  expect_rejected(kDecode, [&] { dcmha::decode({}, m.q(2), c, qs, m.out(2)); },
                  {"query_side.pre.qw1.shape[2] (G)", "expected 2", "cache.config().G", "got 1"});
  qs = m.query_side(2);
  qs.pre.query_wise = false;  // tensors given for a switched-off term
  expect_rejected(kDecode, [&] { dcmha::decode({}, m.q(2), c, qs, m.out(2)); },
                  {"compose.pre.qw1", "query_wise is off"});

  dcmha::AttentionConfig cfg;
  cfg.mask = dcmha::Mask::full;
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(2), c, m.query_side(2), m.out(2)); },
                  {"cfg.mask", "Mask::causal"});
  cfg = {};
  cfg.window = 4;
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(2), c, m.query_side(2), m.out(2)); },
                  {"cfg.window", "expected 0 or 0", "got 4"});
  cfg = {};
  std::vector<index_t> lens{2, 2};
  cfg.key_lengths = dcmha::view<1>(static_cast<const index_t*>(lens.data()), {2});
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(2), c, m.query_side(2), m.out(2)); },
                  {"cfg.key_lengths", "empty view"});
  cfg = {};
  cfg.query_lengths = cfg.key_lengths = {};
  cfg.query_lengths = dcmha::view<1>(static_cast<const index_t*>(lens.data()), {2});
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.q(2), c, m.query_side(2), m.out(2)); },
                  {"cfg.query_lengths", "empty view"});
  // The output may not live inside the cache.
  auto kslots = c.k_slots();
  expect_rejected(kDecode,
                  [&] {
                    dcmha::decode({}, m.q(2), c, m.query_side(2),
                                  dcmha::view<4>(kslots.data, {m.B, m.H, 2, m.Dv}));
                  },
                  {"out"});
}

}  // namespace

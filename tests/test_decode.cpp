// Incremental decoding: DecodeCache + dcmha::decode against the full causal dcmha::forward.
//
// Every equivalence test runs a whole sequence through the cache: a prefill step (the prompt's
// tokens appended and decoded at once), then the rest n tokens at a time, and compares the rows
// each step produced with the rows of one forward over all tokens. Padded batches give every
// sequence its own length and its own count per step, so the sequences sit at different
// positions (and, for window layers, at different ring offsets) in the same call.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "dcmha/dcmha.hpp"
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

/// One decode run: the prompt length of each sequence, then n tokens per step.
struct Schedule {
  std::vector<int64_t> prefill;  // per sequence; empty: prefill_all for every sequence
  int64_t prefill_all = 7;
  int64_t step = 1;
  std::vector<int64_t> lengths;  // total tokens per sequence; empty: spec.T for every sequence
  bool bthd = false;             // new-token tensors kept (B, n, H, D) in memory
  bool caller_memory = false;    // the cache in a caller-provided buffer
  bool workspace = false;        // one Workspace kept across the steps
};

/// Copies tokens [start[b], start[b] + count[b]) of every sequence b out of a canonical tensor
/// whose dim `td` is the token dim, into a dense buffer whose token dim has n entries; the rest
/// is `fill` (NaN for everything the cache or kernel must never read).
template <class T>
std::vector<T> gather(const std::vector<double>& src, std::vector<int64_t> shape, int td,
                      const std::vector<int64_t>& start, const std::vector<int64_t>& count,
                      int64_t n, double fill) {
  std::vector<int64_t> out_shape = shape;
  out_shape[size_t(td)] = n;
  int64_t total = 1;
  for (int64_t s : out_shape) total *= s;
  std::vector<T> out(static_cast<size_t>(total), T(fill));
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t flat = 0; flat < total; ++flat) {
    const int64_t b = idx[0], i = idx[size_t(td)];
    if (i < count[size_t(b)]) {
      int64_t off = 0;
      for (size_t d = 0; d < shape.size(); ++d)
        off = off * shape[d] + (int(d) == td ? start[size_t(b)] + i : idx[d]);
      out[size_t(flat)] = T(src[size_t(off)]);
    }
    for (int d = int(shape.size()) - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < out_shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  return out;
}

/// (B, X, n, Y) buffer as a (B, X, n, Y) view, or, when it was gathered as (B, n, X, Y), as bthd.
template <class T>
TensorView<T, 4> act_view(std::vector<T>& buf, int64_t B, int64_t X, int64_t n, int64_t Y, bool bthd) {
  return bthd ? dcmha::bthd(buf.data(), B, n, X, Y) : dcmha::bhtd(buf.data(), B, X, n, Y);
}

/// Canonical (B, X, L, Y) -> (B, L, X, Y), for the bthd runs.
inline std::vector<double> to_btxy(const std::vector<double>& x, int64_t B, int64_t X, int64_t L, int64_t Y) {
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
  c.B = s.B; c.H = s.H; c.Hk = s.Hk; c.D = s.D; c.Dv = s.Dv; c.G = s.G;
  c.pre_key_wise = s.pre.key_wise;
  c.post_key_wise = s.post.key_wise;
  c.Rk = (c.pre_key_wise || c.post_key_wise) ? s.Rk : 0;
  c.window = s.window;
  c.capacity = s.window > 0 ? 0 : s.T;
  c.max_step = max_step;
  return c;
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
  std::vector<int64_t> len(static_cast<size_t>(B), T_), pre(static_cast<size_t>(B), sch.prefill_all);
  if (!sch.lengths.empty()) len = sch.lengths;
  if (!sch.prefill.empty()) pre = sch.prefill;
  const int64_t max_step = std::max(*std::max_element(pre.begin(), pre.end()), sch.step);

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
  const std::vector<int64_t> q_shape = sch.bthd ? std::vector<int64_t>{B, T_, H, D} : std::vector<int64_t>{B, H, T_, D};
  const std::vector<int64_t> k_shape = sch.bthd ? std::vector<int64_t>{B, T_, Hk, D} : std::vector<int64_t>{B, Hk, T_, D};
  const std::vector<int64_t> v_shape = sch.bthd ? std::vector<int64_t>{B, T_, Hk, Dv} : std::vector<int64_t>{B, Hk, T_, Dv};
  const int td = sch.bthd ? 1 : 2;

  std::vector<double> result(size_t(B * H * T_ * Dv), 0.0);
  std::vector<int64_t> done(static_cast<size_t>(B), 0);
  for (int step = 0;; ++step) {
    std::vector<int64_t> count(static_cast<size_t>(B));
    for (int64_t b = 0; b < B; ++b)
      count[size_t(b)] = std::min(step == 0 ? pre[size_t(b)] : sch.step, len[size_t(b)] - done[size_t(b)]);
    const int64_t n = *std::max_element(count.begin(), count.end());
    if (n == 0) {
      if (step == 0) continue;  // no sequence has a prompt: start with the first step
      break;
    }

    std::vector<T> q = gather<T>(q_src, q_shape, td, done, count, n, nan);
    std::vector<T> k = gather<T>(k_src, k_shape, td, done, count, n, nan);
    std::vector<T> v = gather<T>(v_src, v_shape, td, done, count, n, nan);
    std::vector<T> out(static_cast<size_t>(B * H * n * Dv), T(nan));
    std::vector<std::vector<T>> keep;  // compose buffers of this step
    dcmha::ComposeWeights<T> query_side, key_side;
    // Padding tokens: NaN where the cache must never store or read them (K, V, key-wise terms
    // and q), finite for query-wise terms (the kernel multiplies the zero probabilities of a
    // padding row by them, and 0 * NaN is NaN).
    auto lowrank = [&](const std::vector<double>& x, int64_t R, double fill) {
      keep.push_back(gather<T>(x, {B, T_, G, R, M}, 1, done, count, n, fill));
      return dcmha::view<5>(static_cast<const T*>(keep.back().data()), {B, n, G, R, M});
    };
    auto gate = [&](const std::vector<double>& x, double fill) {
      keep.push_back(gather<T>(x, {B, T_, G, M}, 1, done, count, n, fill));
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
    if (after_append) after_append(cache, step);
    dcmha::AttentionConfig cfg;
    if (sch.workspace)
      dcmha::decode(cfg, act_view(q, B, H, n, D, sch.bthd), cache, query_side, dcmha::bhtd(out.data(), B, H, n, Dv),
                    workspace);
    else
      dcmha::decode(cfg, act_view(q, B, H, n, D, sch.bthd), cache, query_side, dcmha::bhtd(out.data(), B, H, n, Dv));

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

/// The full causal forward over every sequence's tokens (padding rows zero).
template <class T>
std::vector<double> full_forward(dcmha::reference::Problem p, const Schedule& sch) {
  if (!sch.lengths.empty()) p.query_lengths = p.key_lengths = sch.lengths;
  TypedProblem<T> tp(p);
  dcmha::AttentionConfig cfg = tp.config();
  if (!sch.lengths.empty()) {
    cfg.query_lengths = dcmha::view<1>(static_cast<const index_t*>(tp.problem().query_lengths.data()), {p.B});
    cfg.key_lengths = dcmha::view<1>(static_cast<const index_t*>(tp.problem().key_lengths.data()), {p.B});
  }
  dcmha::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), {}, tp.compose());
  return tp.out_values();
}

ProblemSpec decode_spec(int64_t window = 0) {
  ProblemSpec s;
  s.B = 1; s.H = 4; s.Hk = 4; s.T = s.S = 23; s.D = 8; s.Dv = 6; s.G = 1; s.Rq = 2; s.Rk = 2;
  s.causal = true;
  s.window = window;
  s.pre = s.post = SideSpec::dynamic();
  return s;
}

template <class T>
void check_decode(const ProblemSpec& spec, const Schedule& sch, uint64_t seed = 7) {
  SCOPED_TRACE(spec.str() + " prefill " + std::to_string(sch.prefill_all) + " step " +
               std::to_string(sch.step) + (sch.lengths.empty() ? "" : " padded") +
               (sch.bthd ? " bthd" : "") + (sch.caller_memory ? " caller memory" : "") +
               (sch.workspace ? " workspace" : ""));
  const dcmha::reference::Problem p = dcmha::test::random_problem(spec, seed);
  const std::vector<double> expected = full_forward<T>(p, sch);
  const std::vector<double> got = run_decode<T>(p, spec, sch);
  EXPECT_LE(dcmha::test::max_rel_error(expected, got), tolerance<T>());
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
double corrupted_error(const ProblemSpec& spec, const std::function<void(dcmha::DecodeCache<double>&)>& corrupt) {
  const dcmha::reference::Problem p = dcmha::test::random_problem(spec, 11);
  Schedule sch;
  const std::vector<double> expected = full_forward<double>(p, sch);
  const std::vector<double> got = run_decode<double>(p, spec, sch, [&](dcmha::DecodeCache<double>& c, int step) {
    if (step == 0) corrupt(c);
  });
  return dcmha::test::max_rel_error(expected, got);
}

TEST(DecodeCacheState, ZeroingOneKeyWiseEntryChangesTheResult) {
  for (int64_t window : {0, 5}) {
    SCOPED_TRACE("window " + std::to_string(window));
    const ProblemSpec s = decode_spec(window);
    // Token 6 (the last of the prompt) is seen by every later query, also under the window.
    const double err = corrupted_error(s, [](dcmha::DecodeCache<double>& c) {
      c.kw1_slots(false)(0, 6, 0, 1, 2) = 0.0;
    });
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
  const double err = corrupted_error(s, [](dcmha::DecodeCache<double>& c) { c.k_slots()(0, 0, 6, 0) += 1.0; });
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
  c.B = 2; c.H = 32; c.Hk = 32; c.D = 128; c.Dv = 128; c.G = 1; c.Rk = 2;
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

/// A small layer (B 2, H 4, Hk 2, G 2, Rk 2, key-wise on both sides) with every buffer one
/// append / decode of n tokens needs.
struct Misuse {
  static constexpr index_t B = 2, H = 4, Hk = 2, D = 8, Dv = 6, G = 2, M = 2, R = 2;
  dcmha::DecodeCacheConfig cc;
  std::vector<std::vector<float>> bufs;

  Misuse() {
    cc.B = B; cc.H = H; cc.Hk = Hk; cc.D = D; cc.Dv = Dv; cc.G = G; cc.Rk = R;
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
    expect_rejected(kCtor, [&] { dcmha::DecodeCache<float> c(m.cc); }, needles);
    expect_rejected(kCtor + "::required_elements",
                    [&] { dcmha::DecodeCache<float>::required_elements(m.cc); }, needles);
  };
  rejected([](auto& c) { c.Hk = 3; }, {"config.Hk", "divisor of H = 4", "got 3"});
  rejected([](auto& c) { c.G = 3; }, {"config.G", "divisor of H = 4", "got 3"});
  rejected([](auto& c) { c.D = 0; }, {"config.D", ">= 1", "got 0"});
  rejected([](auto& c) { c.max_step = 0; }, {"config.max_step", ">= 1", "got 0"});
  rejected([](auto& c) { c.Rk = 0; }, {"config.Rk", ">= 1", "got 0"});
  rejected([](auto& c) { c.pre_key_wise = c.post_key_wise = false; }, {"config.Rk", "expected 0", "got 2"});
  rejected([](auto& c) { c.capacity = 0; }, {"config.capacity", ">= 1", "got 0"});
  rejected([](auto& c) { c.window = 4; }, {"config.capacity", "expected 0", "got 10"});
  rejected([](auto& c) { c.window = -1; }, {"config.window", ">= 0", "got -1"});
  rejected([](auto& c) { c.capacity = index_t(1) << 62; }, {"config", "overflows"});
}

TEST(DecodeMisuse, CallerBuffer) {
  Misuse m;
  const index_t need = dcmha::DecodeCache<float>::required_elements(m.cc);
  std::vector<float> buf(static_cast<size_t>(need));
  expect_rejected(kCtor, [&] { dcmha::DecodeCache<float> c(m.cc, nullptr, need); }, {"buffer", "nullptr"});
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
                  [&] { c.append(m.k(3), m.v(3), m.key_side(3), dcmha::view<1>(static_cast<const index_t*>(counts.data()), {2})); },
                  {"sequence 1", "8 cached + 3 appended"});
  counts = {2, 1};
  c.append(m.k(3), m.v(3), m.key_side(3), dcmha::view<1>(static_cast<const index_t*>(counts.data()), {2}));
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
  expect_rejected(kAppend, [&] { c.append(m.alloc<4>({B, Hk, 2, D + 1}), m.v(2), m.key_side(2)); },
                  {"k_new.shape[3] (D)", "expected 8", "config.D", "got 9"});
  expect_rejected(kAppend, [&] { c.append(m.alloc<4>({B, 1, 2, D}), m.v(2), m.key_side(2)); },
                  {"k_new.shape[1] (H)", "expected 2", "config.Hk", "got 1"});
  expect_rejected(kAppend, [&] { c.append(m.alloc<4>({B + 1, Hk, 2, D}), m.v(2), m.key_side(2)); },
                  {"k_new.shape[0] (B)", "config.B", "got 3"});
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(3), m.key_side(2)); },
                  {"v_new.shape[2] (n)", "expected 2", "got 3"});
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.alloc<4>({B, Hk, 2, Dv + 2}), m.key_side(2)); },
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
                  [&] { c.append(m.k(2), m.v(2), m.key_side(2), dcmha::view<1>(static_cast<const index_t*>(counts.data()), {2})); },
                  {"counts[1]", "[0, 2]", "got 3"});
  expect_rejected(kAppend,
                  [&] { c.append(m.k(2), m.v(2), m.key_side(2), dcmha::view<1>(static_cast<const index_t*>(counts.data()), {1})); },
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
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); }, {"key_side.pre.kdd", "empty view"});
  ks = m.key_side(2);
  ks.pre.query_wise = true;
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); }, {"key_side.pre.query_wise", "query_side"});
  ks = m.key_side(2);
  ks.post.static_w = true;
  expect_rejected(kAppend, [&] { c.append(m.k(2), m.v(2), ks); }, {"key_side.post.static_w", "query_side"});

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
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.alloc<4>({m.B, 8, 3, m.D}), c, m.query_side(3), m.out(3)); },
                  {"q_new.shape[1] (H)", "expected 4", "cache.config().H", "got 8"});
  expect_rejected(kDecode, [&] { dcmha::decode(cfg, m.alloc<4>({m.B, m.H, 3, 4}), c, m.query_side(3), m.out(3)); },
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
                  [&] { dcmha::decode({}, m.q(2), c, m.query_side(2), dcmha::view<4>(kslots.data, {m.B, m.H, 2, m.Dv})); },
                  {"out"});
}

}  // namespace

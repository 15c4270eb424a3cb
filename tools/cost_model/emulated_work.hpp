#pragma once
// Our kernels' work at a benchmark shape, from the emulator's counts on small problems.
//
// Each launch is emulated at three short sequence lengths with the launch plan of the benchmark
// shape (its rows, keys, cluster and splits forced), so every block does what it would do there.
// Under a causal mask a launch's counts are then a quadratic polynomial of T: blocks grow with
// T, (block, tile) pairs with T², and a diagonal tile's masking with T. The polynomial through
// the three points gives the counts at the benchmark's T; a fourth length checks it, and the
// first length run again on other random inputs checks that no count follows the data. Blocks
// are independent across sequences and compose groups, so the counts of one sequence (and, for
// MHA, a few heads) scale linearly to B and H.
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "support/emulated_kernels.hpp"

#include "work.hpp"

namespace dcmha::cost_model {

using Counts = std::map<std::string, cuda::emulator::Counters>;  // per kernel, summed over calls

/// The inputs' draw the model's counts come from; the data check counts a second one.
constexpr unsigned kInputDraw = 7;

/// bf16 tensors of one emulated problem, random (drawn from `seed`) and never zero, in the
/// benchmark's layouts.
class EmulatedProblem {
 public:
  EmulatedProblem(const BenchmarkShape& s, unsigned seed) : s_(s), rng_(seed) {
    const index_t B = s.B, H = s.H, T = s.T, D = s.D;
    q = tensor<4>({B, H, T, D}, 1), k = tensor<4>({B, H, T, D}, 1);
    v = tensor<4>({B, H, T, D}, 1), dout = tensor<4>({B, H, T, D}, 1);
    out = tensor<4>({B, H, T, D}, 0), dq = tensor<4>({B, H, T, D}, 0);
    dk = tensor<4>({B, H, T, D}, 0), dv = tensor<4>({B, H, T, D}, 0);
    lse_storage_.assign(std::size_t(B * H * T) + 64, 0.0f);
    lse = view<3>(cuda::emulate::aligned_as_on_device(lse_storage_, B * H * T), {B, H, T});
    if (s.dcmha)
      for (int side = 0; side < 2; ++side) add_terms(side);
  }

  TensorView<bf16, 4> q, k, v, dout, out, dq, dk, dv;
  TensorView<float, 3> lse;
  ComposeWeights<bf16> compose;
  ComposeGrads<bf16> dcompose;

 private:
  template <int N>
  TensorView<bf16, N> tensor(const Shape<N>& shape, float scale) {
    index_t n = 1;
    for (index_t e : shape) n *= e;
    storage_.emplace_back(std::size_t(n) + 128);
    bf16* data = cuda::emulate::aligned_as_on_device(storage_.back(), n);
    std::normal_distribution<float> normal(0.0f, scale);
    for (index_t i = 0; i < n; ++i) data[i] = bf16(scale > 0 ? normal(rng_) : 0.0f);
    return view<N>(data, shape);
  }

  void add_terms(int side) {
    const index_t B = s_.B, T = s_.T, R = s_.R, H = s_.H;
    ComposeTerms<bf16>& w = side == 0 ? compose.pre : compose.post;
    ComposeTermGrads<bf16>& g = side == 0 ? dcompose.pre : dcompose.post;
    w.query_wise = w.key_wise = true;
    w.qw1 = tensor<5>({B, T, 1, R, H}, 0.1f), w.qw2 = tensor<5>({B, T, 1, R, H}, 0.1f);
    w.kw1 = tensor<5>({B, T, 1, R, H}, 0.1f), w.kw2 = tensor<5>({B, T, 1, R, H}, 0.1f);
    w.qdd = tensor<4>({B, T, 1, H}, 0.3f), w.kdd = tensor<4>({B, T, 1, H}, 0.3f);
    g.qw1 = tensor<5>({B, T, 1, R, H}, 0), g.qw2 = tensor<5>({B, T, 1, R, H}, 0);
    g.kw1 = tensor<5>({B, T, 1, R, H}, 0), g.kw2 = tensor<5>({B, T, 1, R, H}, 0);
    g.qdd = tensor<4>({B, T, 1, H}, 0), g.kdd = tensor<4>({B, T, 1, H}, 0);
  }

  BenchmarkShape s_;
  std::mt19937 rng_;
  std::vector<std::vector<bf16>> storage_;
  std::vector<float> lse_storage_;
};

inline AttentionConfig causal() {
  AttentionConfig cfg;
  cfg.mask = Mask::causal;
  return cfg;
}

/// The launch plans of the benchmark shape, as options that force them on a smaller problem.
struct Plans {
  cuda::ForwardLaunch forward;
  cuda::BackwardLaunch backward;
  int forward_launches = 0, backward_launches = 0;  // at the benchmark shape

  cuda::LaunchOptions forward_options() const {
    cuda::LaunchOptions o;
    o.rows = forward.geo.rows, o.cluster = forward.geo.cluster, o.key_splits = forward.geo.splits;
    o.split_scores =
        forward.geo.scores_kept ? cuda::SplitScores::kept : cuda::SplitScores::recomputed;
    return o;
  }
  cuda::LaunchOptions backward_options() const {
    cuda::LaunchOptions o;
    o.rows = backward.query.rows, o.key_rows = backward.key.rows;
    o.cluster = backward.query.cluster;
    o.one_pass = backward.one_pass;
    if (backward.one_pass) o.key_splits = backward.key.key_splits;
    return o;
  }
};

/// The plans for shape s on an sm_90. Only the views' shapes, strides and alignment matter to
/// a plan, and that they do not overlap, so each view gets its own far-apart address that
/// nothing dereferences.
inline Plans plans_of(const BenchmarkShape& s) {
  std::uintptr_t next = std::uintptr_t(1) << 44;
  auto address = [&next](auto* type) {
    next += std::uintptr_t(1) << 38;  // 256 GiB apart, 256-byte aligned
    return reinterpret_cast<decltype(type)>(next);
  };
  const index_t B = s.B, H = s.H, T = s.T, D = s.D, R = s.R;
  auto act = [&] { return view<4>(address((bf16*)nullptr), {B, H, T, D}); };
  auto per_rank = [&] { return view<5>(address((bf16*)nullptr), {B, T, 1, R, H}); };
  auto per_head = [&] { return view<4>(address((bf16*)nullptr), {B, T, 1, H}); };
  ComposeWeights<bf16> c;
  ComposeGrads<bf16> g;
  for (int side = 0; side < 2 && s.dcmha; ++side) {
    ComposeTerms<bf16>& w = side == 0 ? c.pre : c.post;
    ComposeTermGrads<bf16>& d = side == 0 ? g.pre : g.post;
    w.query_wise = w.key_wise = true;
    w.qw1 = per_rank(), w.qw2 = per_rank(), w.kw1 = per_rank(), w.kw2 = per_rank();
    w.qdd = per_head(), w.kdd = per_head();
    d.qw1 = per_rank(), d.qw2 = per_rank(), d.kw1 = per_rank(), d.kw2 = per_rank();
    d.qdd = per_head(), d.kdd = per_head();
  }
  const auto q = act(), k = act(), v = act(), out = act(), dout = act();
  const auto dq = act(), dk = act(), dv = act();
  const auto lse = view<3>(address((float*)nullptr), {B, H, T});
  const char* fn = "dcmha::cost_model";
  Plans p;
  p.forward =
      cuda::forward_launch(fn, detail::forward_params<bf16>(fn, causal(), q, k, v, out, lse, c));
  cuda::LaunchOptions backward;
  backward.one_pass = !s.two_sided;
  const detail::BackwardParams<bf16> b =
      detail::backward_params<bf16>(fn, causal(), q, k, v, lse, dout, dq, dk, dv, c, g, out);
  p.backward = cuda::backward_launch(fn, b, backward);
  p.forward_launches = cuda::launch_count(p.forward);
  p.backward_launches =
      cuda::launch_count(p.backward, cuda::backward_scratch_sizes(b.dims, p.backward));
  return p;
}

/// One emulated forward then backward of shape s with the plans forced, on inputs drawn from
/// `seed`: each one's launches' counts per kernel.
inline std::array<Counts, 2> emulate(const BenchmarkShape& s, const Plans& plans,
                                     unsigned seed = kInputDraw) {
  EmulatedProblem p(s, seed);
  auto counts = [] {
    Counts c;
    for (auto& [kernel, launch] : cuda::emulator::LaunchLog::get().take()) c[kernel] += launch;
    return c;
  };
  cuda::emulator::Counting::enabled() = true;
  cuda::emulator::LaunchLog::get().take();
  cuda::emulate::forward<bf16>(causal(), p.q, p.k, p.v, p.out, p.lse, p.compose,
                               plans.forward_options());
  std::array<Counts, 2> result;
  result[0] = counts();
  // Given the forward's output, as FlashAttention's backward is (MHA reads D from it).
  cuda::emulate::backward<bf16>(causal(), p.q, p.k, p.v, p.lse, p.dout, p.dq, p.dk, p.dv, p.compose,
                                p.dcompose, plans.backward_options(), p.out);
  result[1] = counts();
  cuda::emulator::Counting::enabled() = false;
  return result;
}

/// Lagrange's quadratic through (x[i], y[i]), at t.
inline double quadratic_at(const std::array<double, 3>& x, const std::array<double, 3>& y,
                           double t) {
  double sum = 0;
  for (int i = 0; i < 3; ++i) {
    double term = y[i];
    for (int j = 0; j < 3; ++j)
      if (j != i) term *= (t - x[j]) / (x[i] - x[j]);
    sum += term;
  }
  return sum;
}

/// Each kernel's Work in the three runs of the fit.
inline std::map<std::string, std::array<Work, 3>> per_kernel(const std::array<Counts, 3>& runs) {
  std::map<std::string, std::array<Work, 3>> w;
  for (int i = 0; i < 3; ++i)
    for (const auto& [kernel, c] : runs[i]) w[kernel][i] = work_of(c);
  return w;
}

/// Each field of the three Works' quadratic at t.
inline Work extrapolated(const std::array<double, 3>& x, const std::array<Work, 3>& w, double t) {
  auto at = [&](double Work::*field) {
    return quadratic_at(x, {w[0].*field, w[1].*field, w[2].*field}, t);
  };
  Work r;
  for (double Work::*field : kCountedFields) r.*field = at(field);
  return r;
}

/// Our kernels' work for one operation at the benchmark shape, per kernel, the largest
/// relative error of the fit's prediction of a fourth length's counts (the scaling check), and
/// the largest relative difference of one length's counts on two draws of the inputs (the data
/// check: a kernel that re-reads where the data says so would make every count unreliable).
struct OperationWork {
  std::map<std::string, Work> kernels;
  Work total;
  double fit_error = 0, data_error = 0;
};

/// The emulated problem for length t: one sequence, one compose group (DCMHA) or two heads
/// (MHA), which the scale below multiplies up to the benchmark's B and H.
inline BenchmarkShape emulated_shape(const BenchmarkShape& s, index_t t) {
  BenchmarkShape e = s;
  e.B = 1, e.T = t;
  if (!s.dcmha) e.H = 2;
  return e;
}

inline double largest_relative_error(const Work& predicted, const Work& counted) {
  double worst = 0;
  for (double Work::*field : kCountedFields) {
    const double want = counted.*field;
    if (want != 0) worst = std::max(worst, std::abs(predicted.*field - want) / want);
  }
  return worst;
}

/// The largest relative difference between two runs' counts, kernel by kernel (1 where a
/// kernel ran in one only).
inline double counts_difference(const Counts& a, const Counts& b) {
  double worst = 0;
  for (const auto& [kernel, c] : a) {
    const auto other = b.find(kernel);
    worst = std::max(
        worst, other == b.end() ? 1.0 : largest_relative_error(work_of(c), work_of(other->second)));
  }
  for (const auto& [kernel, c] : b)
    if (a.find(kernel) == a.end()) worst = 1;
  return worst;
}

/// One operation's work at length `target` from its counts at lengths[0..2] (each count a
/// quadratic, or affine, function of the length), checked at lengths[3], times `scale` (the
/// benchmark's heads and sequences over the emulated ones). HBM bytes are left to the caller.
inline OperationWork fitted_operation(const std::array<index_t, 4>& lengths,
                                      const std::array<Counts, 4>& runs, index_t target,
                                      double scale) {
  OperationWork result;
  const std::array<double, 3> x = {double(lengths[0]), double(lengths[1]), double(lengths[2])};
  for (const auto& [kernel, w] : per_kernel({runs[0], runs[1], runs[2]})) {
    const auto counted = runs[3].find(kernel);
    if (counted != runs[3].end())
      result.fit_error = std::max(
          result.fit_error,
          largest_relative_error(extrapolated(x, w, double(lengths[3])), work_of(counted->second)));
    Work at = extrapolated(x, w, double(target));
    for (double Work::*field : kCountedFields) at.*field *= scale;
    result.kernels[kernel] = at;
    result.total += at;
  }
  return result;
}

/// One operation's work at s.T, with the HBM bytes it cannot avoid.
inline OperationWork extrapolated_operation(const BenchmarkShape& s,
                                            const std::array<index_t, 4>& lengths,
                                            const std::array<Counts, 4>& runs) {
  const double scale = double(s.B) * double(s.H) / double(emulated_shape(s, s.T).H);
  OperationWork result = fitted_operation(lengths, runs, s.T, scale);
  result.total.hbm_bytes = compulsory_bytes(s);
  return result;
}

/// The tile extents' least common multiple, at least 64: sequence lengths that are multiples of
/// it make every count an exact quadratic of T.
inline index_t length_unit(const Plans& p) {
  index_t unit = 64;
  for (index_t e : {index_t(p.forward.geo.rows), index_t(cuda::kKeys),
                    index_t(p.backward.query.rows), index_t(p.backward.key.rows)})
    unit = std::lcm(unit, e);
  return unit;
}

/// The emulated runs of one launch plan: forward and backward counts at four lengths, and at
/// the first length again on a second draw of the inputs.
struct EmulatedRuns {
  Plans plans;
  std::array<index_t, 4> lengths{};
  std::array<std::array<Counts, 2>, 4> counts;
  std::array<Counts, 2> redrawn;
};

inline EmulatedRuns emulated_runs(const BenchmarkShape& s, const Plans& plans) {
  EmulatedRuns r;
  r.plans = plans;
  const index_t unit = length_unit(plans);
  r.lengths = {unit, 2 * unit, 3 * unit, 4 * unit};
  for (int i = 0; i < 4; ++i) r.counts[i] = emulate(emulated_shape(s, r.lengths[i]), plans);
  r.redrawn = emulate(emulated_shape(s, r.lengths[0]), plans, kInputDraw + 1);
  return r;
}

/// Whether two shapes' plans launch the same blocks (then one set of runs serves both).
inline bool same_blocks(const Plans& a, const Plans& b) {
  const cuda::LaunchOptions f = a.forward_options(), g = b.forward_options();
  const cuda::LaunchOptions p = a.backward_options(), q = b.backward_options();
  return f.rows == g.rows && f.cluster == g.cluster && f.key_splits == g.key_splits &&
         p.rows == q.rows && p.key_rows == q.key_rows && p.cluster == q.cluster &&
         p.one_pass == q.one_pass && p.key_splits == q.key_splits;
}

/// Our kernels' forward and backward at shape s (s.backward is ignored).
struct EmulatedWork {
  Plans plans;  // shape s's (its runs may be another shape's that launches the same blocks)
  std::array<index_t, 4> lengths{};
  OperationWork forward, backward;
  std::array<Counts, 2> longest;  // forward and backward counts at lengths[3], not extrapolated
};

inline EmulatedWork emulated_work(BenchmarkShape s, const EmulatedRuns& runs, const Plans& plans) {
  EmulatedWork result;
  result.plans = plans;
  result.lengths = runs.lengths;
  const auto& c = runs.counts;
  result.longest = c[3];
  for (int op = 0; op < 2; ++op) {
    s.backward = op == 1;
    OperationWork& w = op == 0 ? result.forward : result.backward;
    w = extrapolated_operation(s, runs.lengths, {c[0][op], c[1][op], c[2][op], c[3][op]});
    w.data_error = counts_difference(c[0][op], runs.redrawn[op]);
  }
  const cuda::BackwardLaunch& b = plans.backward;
  if (b.one_pass) {  // O read for the row dots (as FA2's), dQ's float sums zeroed and read back
    const double tokens = double(s.B) * double(s.H) * double(s.T),
                 sums = b.key.split_sums ? b.key.key_splits : 1;
    result.backward.total.hbm_bytes += tokens * double(s.D) * (2 + 2 * 4 * sums);
  }
  return result;
}

}  // namespace dcmha::cost_model

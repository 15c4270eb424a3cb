#pragma once
// The dynamic weight projection against reference/reference_projection.hpp: forward, backward
// (recomputing or from kept activations, which must give the same bits), every tensor in its
// own layout; and its invalid calls.
#include <array>
#include <limits>
#include <string>
#include <vector>

#include "any_view.hpp"
#include "attention_check.hpp"
#include "decode_input.hpp"
#include "dcmha/dynamic_weights.hpp"
#include "reference/reference_projection.hpp"
#include "report.hpp"
#include "values.hpp"

namespace dcmha::fuzz {

/// The reference problem: values at the projection tests' scales, where every nonlinearity is
/// exercised away from saturation.
struct ProjectionValues {
  reference::ProjectionShape s;
  std::vector<double> x;
  reference::ProjectionParams p;
  reference::ProjectionOutputs dout;

  ProjectionValues(const ProjectionCase& pc, std::uint64_t seed) {
    s.B = pc.B;
    s.L = pc.L;
    s.E = pc.E;
    s.G = pc.G;
    s.K = pc.K;
    s.R = pc.R;
    s.M = pc.M;
    s.tanh_gelu = pc.tanh_gelu;
    s.eps = pc.eps;
    Rng rng(seed);
    x = rng.normal(size_t(s.x_size()), 1.0);
    p = {rng.normal(size_t(s.dw1_size()), 0.5), rng.normal(size_t(s.qkw_size()), 0.5),
         rng.normal(size_t(s.dd_size()), 0.3)};
    for (int c = 0; c < 4; ++c) {
      dout.w1[size_t(c)] = rng.normal(size_t(s.w_size()), 1.0);
      dout.w2[size_t(c)] = rng.normal(size_t(s.w_size()), 1.0);
      dout.dd[size_t(c)] = rng.normal(size_t(s.gate_size()), 1.0);
    }
  }
};

/// How much the RMS norm of w1 amplifies rounding. The rounding error of one raw w1 element is
/// about u times the sum over the hidden units k of |qkw| times the error scale of unit k's
/// activation: |h| (GELU as h (1 + erf) / 2 cancels for negative h, leaving an absolute error of
/// u |h|) plus |GELU'(h)| times the sum of |x dw1| that h was summed from. Divided by the row's
/// rms, that is the relative error of the normalized row: large where w1 is tiny next to those
/// scales (with eps dominating the rms, or with M = 1, where w1 / rms is a sign function). Float's
/// results there may differ from the reference by far more than 2e-4 without any bug, so the
/// tolerance grows with this number.
inline double rms_norm_condition(const ProjectionValues& v) {
  const reference::ProjectionShape& s = v.s;
  const std::int64_t G = s.G, K = s.K, R = s.R, M = s.M, E = s.E;
  double kappa = 1;
  std::vector<double> scale(size_t(G * 4 * K));
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t l = 0; l < s.L; ++l) {
      const reference::PositionState st = reference::position_state(s, v.x, v.p, b, l);
      for (std::int64_t j = 0; j < G * 4 * K; ++j) {  // j = (g * 4 + c) * K + k, dw1's column
        double summed = 0;
        for (std::int64_t e = 0; e < E; ++e)
          summed +=
              std::abs(v.x[size_t((b * s.L + l) * E + e)] * v.p.dw1[size_t(e * G * 4 * K + j)]);
        const double h = st.hpre[size_t(j)];
        scale[size_t(j)] = std::abs(h) + std::abs(reference::gelu_grad(h, s.tanh_gelu)) * summed;
      }
      for (std::int64_t gc = 0; gc < G * 4; ++gc)
        for (std::int64_t r = 0; r < R; ++r) {
          double ms = 0, err = 0;
          for (std::int64_t m = 0; m < M; ++m) {
            const double w = st.w[size_t((gc * 2 * R + r) * M + m)];
            ms += w * w;
            double a = 0;
            for (std::int64_t k = 0; k < K; ++k)
              a += scale[size_t(gc * K + k)] *
                   std::abs(v.p.qkw[size_t(((gc * K + k) * 2 * R + r) * M + m)]);
            err = std::max(err, a);
          }
          kappa = std::max(kappa, err / std::sqrt(ms / double(M) + s.eps));
        }
    }
  return kappa;
}

/// The tests' tolerance, or more for an ill-conditioned problem (rms_norm_condition).
template <class T>
double projection_tolerance(double kappa) {
  return std::max(tolerance<T>(), kappa * (std::is_same_v<T, double> ? 1e-14 : 5e-6));
}

/// Twelve dynamic tensors indexed by split c (pre/query, pre/key, post/query, post/key).
template <class T>
struct SplitBuffers {
  std::array<Strided<T, 5>, 4> w1, w2;
  std::array<Strided<T, 4>, 4> dd;

  SplitBuffers(const ProjectionCase& pc, Rng& rng, std::uint8_t kind) {
    for (size_t c = 0; c < 4; ++c) {
      w1[c] = Strided<T, 5>({pc.B, pc.L, pc.G, pc.R, pc.M}, seeded_layout<5>(rng, kind));
      w2[c] = Strided<T, 5>({pc.B, pc.L, pc.G, pc.R, pc.M}, seeded_layout<5>(rng, kind));
      dd[c] = Strided<T, 4>({pc.B, pc.L, pc.G, pc.M}, seeded_layout<4>(rng, kind));
    }
  }
  void set(const reference::ProjectionOutputs& o) {
    for (size_t c = 0; c < 4; ++c) w1[c].set(o.w1[c]), w2[c].set(o.w2[c]), dd[c].set(o.dd[c]);
  }
  template <class U>
  DynamicWeights<U> views() const {
    auto side = [&](size_t q, size_t k) {
      return DynamicWeightsSide<U>{w1[q].view(), w2[q].view(), w1[k].view(),
                                   w2[k].view(), dd[q].view(), dd[k].view()};
    };
    return {side(0, 1), side(2, 3)};
  }
  template <class F>
  void for_each(F&& f) const {
    static const char* const split[4] = {"pre.q", "pre.k", "post.q", "post.k"};
    for (size_t c = 0; c < 4; ++c) {
      f(std::string(split[c]) + "w1", w1[c], &reference::ProjectionOutputs::w1, c);
      f(std::string(split[c]) + "w2", w2[c], &reference::ProjectionOutputs::w2, c);
      f(std::string(split[c]) + "dd", dd[c], &reference::ProjectionOutputs::dd, c);
    }
  }
};

template <class T>
struct ProjectionTensors {
  Rng rng;
  Strided<T, 3> x, dx;
  Strided<T, 4> dw1, gdw1;
  Strided<T, 5> qkw, gqkw;
  Strided<T, 3> dd, gdd;
  SplitBuffers<T> out, dout;

  ProjectionTensors(const ProjectionCase& pc, const ProjectionValues& v, std::uint64_t seed)
      : rng(seed ^ 0x960ull),
        x({pc.B, pc.L, pc.E}, seeded_layout<3>(rng, pc.in_layout)),
        dx({pc.B, pc.L, pc.E}, seeded_layout<3>(rng, pc.out_layout)),
        dw1({pc.E, pc.G, 4, pc.K}, seeded_layout<4>(rng, pc.in_layout)),
        gdw1({pc.E, pc.G, 4, pc.K}, seeded_layout<4>(rng, pc.out_layout)),
        qkw({pc.G, 4, pc.K, 2 * pc.R, pc.M}, seeded_layout<5>(rng, pc.in_layout)),
        gqkw({pc.G, 4, pc.K, 2 * pc.R, pc.M}, seeded_layout<5>(rng, pc.out_layout)),
        dd({pc.E, pc.G, 4 * pc.M}, seeded_layout<3>(rng, pc.in_layout)),
        gdd({pc.E, pc.G, 4 * pc.M}, seeded_layout<3>(rng, pc.out_layout)),
        out(pc, rng, pc.out_layout),
        dout(pc, rng, pc.in_layout) {
    x.set(v.x);
    dw1.set(v.p.dw1);
    qkw.set(v.p.qkw);
    dd.set(v.p.dd);
    dout.set(v.dout);
  }
  DynamicWeightProjection<T> params() const { return {dw1.cview(), qkw.cview(), dd.cview()}; }
  DynamicWeightProjectionGrads<T> grads() const { return {gdw1.view(), gqkw.view(), gdd.view()}; }

  std::vector<std::vector<unsigned char>> output_bytes(bool backward) const {
    std::vector<std::vector<unsigned char>> all;
    if (backward) return {dx.bytes(), gdw1.bytes(), gqkw.bytes(), gdd.bytes()};
    out.for_each(
        [&](const std::string&, const auto& b, auto, size_t) { all.push_back(b.bytes()); });
    return all;
  }
  std::vector<std::vector<double>> gradients() const {
    return {dx.get(), gdw1.get(), gqkw.get(), gdd.get()};
  }
};

template <class T>
struct ProjectionForwardCall {
  ProjectionConfig cfg;
  TensorView<const T, 3> x;
  DynamicWeightProjection<T> p;
  DynamicWeights<T> out;
  ProjectionActivations<T>* keep = nullptr;

  void run() const {
    if (keep)
      dynamic_weights_forward(cfg, x, p, out, *keep);
    else
      dynamic_weights_forward(cfg, x, p, out);
  }
};

template <class T>
struct ProjectionBackwardCall {
  ProjectionConfig cfg;
  TensorView<const T, 3> x;
  DynamicWeightProjection<T> p;
  DynamicWeights<const T> dout;
  TensorView<T, 3> dx;
  DynamicWeightProjectionGrads<T> grads;
  const ProjectionActivations<T>* kept = nullptr;

  void run() const {
    if (kept)
      dynamic_weights_backward(cfg, x, p, *kept, dout, dx, grads);
    else
      dynamic_weights_backward(cfg, x, p, dout, dx, grads);
  }
};

inline ProjectionConfig projection_config(const FuzzCase& c) {
  ProjectionConfig cfg;
  cfg.gelu = c.proj.tanh_gelu ? Gelu::tanh : Gelu::erf;
  cfg.eps = c.proj.eps;
  cfg.num_threads = c.threads;
  return cfg;
}

template <class T>
void check_projection_valid(const FuzzCase& c) {
  const ProjectionValues v(c.proj, c.seed);
  reference::ProjectionOutputs want;
  reference::projection_forward(v.s, v.x, v.p, want);
  ProjectionTensors<T> t(c.proj, v, c.seed);
  ProjectionActivations<T> act;
  const ProjectionConfig cfg = projection_config(c);
  const double kappa = rms_norm_condition(v), tol = projection_tolerance<T>(kappa);
  current_problem() += " (rms-norm condition " + num(kappa) + ")";
  const ProjectionForwardCall<T> fwd{cfg, t.x.cview(), t.params(), t.out.template views<T>(),
                                     c.proj.keep ? &act : nullptr};
  expect_success("dynamic_weights_forward", [&] { fwd.run(); });
  t.out.for_each([&](const std::string& name, const auto& b, auto field, size_t split) {
    expect_close("out." + name, (want.*field)[split], b.get(), tol);
    expect_untouched_outside("out." + name, b);
  });
  if (!c.proj.backward) return;

  std::vector<double> want_dx;
  reference::ProjectionParams want_g;
  reference::projection_backward(v.s, v.x, v.p, v.dout, want_dx, want_g);
  ProjectionBackwardCall<T> bwd{cfg,
                                t.x.cview(),
                                t.params(),
                                t.dout.template views<const T>(),
                                t.dx.view(),
                                t.grads(),
                                c.proj.keep ? &act : nullptr};
  expect_success("dynamic_weights_backward", [&] { bwd.run(); });
  const std::vector<std::vector<double>> got = t.gradients();
  const std::vector<double>* wants[4] = {&want_dx, &want_g.dw1, &want_g.qkw, &want_g.dd};
  const char* names[4] = {"dx", "grads.dw1", "grads.qkw", "grads.dd"};
  for (int i = 0; i < 4; ++i) expect_close(names[i], *wants[i], got[size_t(i)], tol);
  expect_untouched_outside("dx", t.dx);
  expect_untouched_outside("grads.dw1", t.gdw1);
  expect_untouched_outside("grads.qkw", t.gqkw);
  expect_untouched_outside("grads.dd", t.gdd);
  if (c.proj.keep) {  // recomputing the activations runs the same products: the same bits
    bwd.kept = nullptr;
    expect_success("dynamic_weights_backward (recomputing)", [&] { bwd.run(); });
    if (t.gradients() != got)
      mismatch("backward from kept activations differs from the recomputing one");
  }
}

// --- invalid calls ------------------------------------------------------------------------------

enum class ProjectionBreak {
  input_shape,            // one dim of x, dw1, qkw or dd off by one
  output_shape,           // one dim of an output off by one
  missing_output,         // an output not given
  bad_config,             // eps < 0 or non-finite, negative thread count, unknown GELU
  output_overlaps_input,  // an output inside an input's memory
  outputs_same_address,   // two outputs starting at the same address
  dout_shape,             // backward: one dim of an upstream gradient off by one
  kept_mismatch,          // backward: activations never kept, released, or of another problem
  zero_size,              // a zero dim in an input
  count
};
static_assert(int(ProjectionBreak::count) == kProjectionBreakKinds, "decode_input.hpp's count");

template <class W>
void add_split_views(std::vector<AnyView>& v, W& w, const std::string& prefix, bool output) {
  for (auto* s : {&w.pre, &w.post}) {
    const std::string p = prefix + (s == &w.pre ? "pre." : "post.");
    v.push_back(any_view(p + "qw1", s->qw1, output, "BLGRM"));
    v.push_back(any_view(p + "qw2", s->qw2, output, "BLGRM"));
    v.push_back(any_view(p + "kw1", s->kw1, output, "BLGRM"));
    v.push_back(any_view(p + "kw2", s->kw2, output, "BLGRM"));
    v.push_back(any_view(p + "qdd", s->qdd, output, "BLGM"));
    v.push_back(any_view(p + "kdd", s->kdd, output, "BLGM"));
  }
}

template <class T>
std::vector<AnyView> projection_inputs(TensorView<const T, 3>& x, DynamicWeightProjection<T>& p) {
  return {any_view("x", x, false, "BLE"), any_view("dw1", p.dw1, false, "EGCK"),
          any_view("qkw", p.qkw, false, "GCKRM"), any_view("dd", p.dd, false, "EGM")};
}

template <class T>
class ProjectionBreaker {
 public:
  ProjectionBreaker(ProjectionConfig& cfg, std::vector<AnyView>& views, Arena& arena)
      : cfg_(cfg), views_(views), arena_(arena) {}

  /// Breaks one argument; returns what it did (kept_mismatch is done by the caller).
  std::string apply(ProjectionBreak kind, unsigned x, unsigned y) {
    std::vector<AnyView*> ins = given(views_, false), outs = given(views_, true);
    std::vector<AnyView*> params(ins.begin(), ins.begin() + 4), douts(ins.begin() + 4, ins.end());
    switch (kind) {
      case ProjectionBreak::input_shape:
        return resize_some(params, x, y);
      case ProjectionBreak::output_shape:
        return resize_some(outs, x, y);
      case ProjectionBreak::missing_output: {
        AnyView* v = choose(outs, x);
        v->set_data(nullptr);
        return v->name + " not given";
      }
      case ProjectionBreak::output_overlaps_input:
        return overlap(*choose(ins, y), *choose(outs, x), arena_, y & 128);
      case ProjectionBreak::outputs_same_address: {
        AnyView* a = outs[x % outs.size()];
        AnyView* b = outs[(x % outs.size() + 1 + y % (outs.size() - 1)) % outs.size()];
        return overlap(*a, *b, arena_, true);
      }
      case ProjectionBreak::dout_shape:
        return douts.empty() ? resize_some(params, x, y) : resize_some(douts, x, y);
      case ProjectionBreak::zero_size: {
        AnyView* v = choose(params, x);
        const int d = int(y % unsigned(v->rank));
        v->shape[d] = 0;
        return v->name + ".shape[" + std::to_string(d) + "] = 0";
      }
      default:
        return bad_config(x);
    }
  }

 private:
  static std::string resize_some(const std::vector<AnyView*>& c, unsigned x, unsigned y) {
    AnyView* v = choose(c, x);
    return resize_dim(*v, int(y % unsigned(v->rank)));
  }
  std::string bad_config(unsigned x) {
    switch (x % 6) {
      case 0:
        cfg_.eps = -1e-3;
        return "cfg.eps = -1e-3";
      case 1:
        cfg_.eps = std::numeric_limits<double>::quiet_NaN();
        return "cfg.eps = NaN";
      case 2:
        cfg_.eps = std::numeric_limits<double>::infinity();
        return "cfg.eps = inf";
      case 3:
        cfg_.num_threads = -1;
        return "cfg.num_threads = -1";
      default:
        cfg_.gelu = static_cast<Gelu>(2 + x % 5);
        return "cfg.gelu = " + std::to_string(2 + x % 5);
    }
  }

  ProjectionConfig& cfg_;
  std::vector<AnyView>& views_;
  Arena& arena_;
};

/// Activations that do not belong to the backward's x: never filled, released, or kept by a
/// valid forward over the first L - 1 positions only.
template <class T>
std::string wrong_activations(const FuzzCase& c, ProjectionTensors<T>& t,
                              ProjectionActivations<T>& act, unsigned x) {
  const unsigned variant = c.proj.L > 1 ? x % 3 : x % 2;
  if (variant == 0) return "kept activations never filled";
  ProjectionForwardCall<T> fwd{projection_config(c), t.x.cview(), t.params(),
                               t.out.template views<T>(), &act};
  if (variant == 2) {
    fwd.x.shape[1] -= 1;
    for (auto* s : {&fwd.out.pre, &fwd.out.post})
      for (auto* w : {&s->qw1, &s->qw2, &s->kw1, &s->kw2}) w->shape[1] -= 1;
    for (auto* s : {&fwd.out.pre, &fwd.out.post})
      for (auto* w : {&s->qdd, &s->kdd}) w->shape[1] -= 1;
  }
  expect_success("dynamic_weights_forward (keeping activations)", [&] { fwd.run(); });
  if (variant == 1) act.release();
  return variant == 1 ? "kept activations released"
                      : "activations kept by a forward over L - 1 positions";
}

template <class T>
void check_projection_invalid(const FuzzCase& c) {
  const ProjectionValues v(c.proj, c.seed);
  ProjectionTensors<T> t(c.proj, v, c.seed);
  const ProjectionBreak kind = ProjectionBreak(c.brk.kind);
  const bool backward = c.proj.backward || kind == ProjectionBreak::dout_shape ||
                        kind == ProjectionBreak::kept_mismatch;
  ProjectionActivations<T> act;
  Arena arena;
  if (!backward) {
    ProjectionForwardCall<T> fwd{projection_config(c), t.x.cview(), t.params(),
                                 t.out.template views<T>(), c.proj.keep ? &act : nullptr};
    std::vector<AnyView> views = projection_inputs(fwd.x, fwd.p);
    add_split_views(views, fwd.out, "out.", true);
    const std::string what =
        ProjectionBreaker<T>(fwd.cfg, views, arena).apply(kind, c.brk.a, c.brk.b);
    const auto before = t.output_bytes(false);
    const auto moved = arena.snapshot();
    expect_error("dynamic_weights_forward with " + what, [&] { fwd.run(); });
    if (t.output_bytes(false) != before || !arena.same_as(moved))
      mismatch(what + ": the rejected call wrote to an output");
    return;
  }
  ProjectionBackwardCall<T> bwd{
      projection_config(c), t.x.cview(), t.params(), t.dout.template views<const T>(),
      t.dx.view(),          t.grads(),   nullptr};
  std::string what;
  if (kind == ProjectionBreak::kept_mismatch) {
    what = wrong_activations(c, t, act, c.brk.a);
    bwd.kept = &act;
  } else {
    std::vector<AnyView> views = projection_inputs(bwd.x, bwd.p);
    add_split_views(views, bwd.dout, "dout.", false);
    views.push_back(any_view("dx", bwd.dx, true, "BLE"));
    views.push_back(any_view("grads.dw1", bwd.grads.dw1, true, "EGCK"));
    views.push_back(any_view("grads.qkw", bwd.grads.qkw, true, "GCKRM"));
    views.push_back(any_view("grads.dd", bwd.grads.dd, true, "EGM"));
    what = ProjectionBreaker<T>(bwd.cfg, views, arena).apply(kind, c.brk.a, c.brk.b);
  }
  const auto before = t.output_bytes(true);
  const auto moved = arena.snapshot();
  expect_error("dynamic_weights_backward with " + what, [&] { bwd.run(); });
  if (t.output_bytes(true) != before || !arena.same_as(moved))
    mismatch(what + ": the rejected call wrote to an output");
}

inline void check_projection(const FuzzCase& c) {
  const bool f64 = c.scalar == Scalar::f64;
  if (c.brk.on())
    f64 ? check_projection_invalid<double>(c) : check_projection_invalid<float>(c);
  else
    f64 ? check_projection_valid<double>(c) : check_projection_valid<float>(c);
}

}  // namespace dcmha::fuzz

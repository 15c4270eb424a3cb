// The dynamic weight projection: the reference against finite differences and the official
// conformance case, the production path against the reference (strided views, float and
// double, thread counts), and every argument check.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "dcmha/dynamic_weights.hpp"
#include "reference/reference_projection.hpp"
#include "support/case_file.hpp"

namespace {

using dcmha::Gelu;
using dcmha::index_t;
using dcmha::ProjectionConfig;
using dcmha::Shape;
using dcmha::TensorView;
namespace ref = dcmha::reference;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

const char* const kSplitName[4] = {"pre_q", "pre_k", "post_q", "post_k"};

std::vector<double> random_vector(std::mt19937_64& rng, std::int64_t n, double scale) {
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& e : v) e = dist(rng);
  return v;
}

/// Random parameters at scales where every nonlinearity is exercised away from saturation.
ref::ProjectionParams random_params(std::mt19937_64& rng, const ref::ProjectionShape& s) {
  return {random_vector(rng, s.dw1_size(), 0.5), random_vector(rng, s.qkw_size(), 0.5),
          random_vector(rng, s.dd_size(), 0.3)};
}

ref::ProjectionOutputs random_douts(std::mt19937_64& rng, const ref::ProjectionShape& s) {
  ref::ProjectionOutputs d;
  for (int c = 0; c < 4; ++c) {
    d.w1[c] = random_vector(rng, s.w_size(), 1.0);
    d.w2[c] = random_vector(rng, s.w_size(), 1.0);
    d.dd[c] = random_vector(rng, s.gate_size(), 1.0);
  }
  return d;
}

double loss(const ref::ProjectionShape& s, const std::vector<double>& x,
            const ref::ProjectionParams& p, const ref::ProjectionOutputs& dout) {
  ref::ProjectionOutputs out;
  ref::projection_forward(s, x, p, out);
  double f = 0.0;
  for (int c = 0; c < 4; ++c) {
    for (size_t i = 0; i < out.w1[c].size(); ++i)
      f += out.w1[c][i] * dout.w1[c][i] + out.w2[c][i] * dout.w2[c][i];
    for (size_t i = 0; i < out.dd[c].size(); ++i) f += out.dd[c][i] * dout.dd[c][i];
  }
  return f;
}

/// max |a - b| / max(1, max |b|), the error measure of every comparison here.
double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double err = 0.0, scale = 1.0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    err = std::max(err, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  if (std::isnan(err)) return std::numeric_limits<double>::infinity();
  for (double v : a)
    if (!std::isfinite(v)) return std::numeric_limits<double>::infinity();
  return err / scale;
}

enum class Layout {
  contiguous,  // row-major
  padded,      // every dim padded by one element: batch-blocked rows, packed parameters
  reversed,    // first logical dim innermost: no unit column stride anywhere
};

template <int N, class F>
void for_each_offset(const Shape<N>& shape, const Shape<N>& stride, F&& f) {
  index_t total = 1;
  for (int d = 0; d < N; ++d) total *= shape[d];
  Shape<N> idx{};
  for (index_t i = 0; i < total; ++i) {
    index_t off = 0;
    for (int d = 0; d < N; ++d) off += idx[d] * stride[d];
    f(i, off);
    for (int d = N - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

/// A tensor owning its memory, laid out as asked, with a view over it. Memory outside the
/// view holds a sentinel so that stray writes are caught.
template <class T, int N>
struct Owned {
  static inline const T kSentinel = T(777.25);  // exact in bf16 and fp16 too
  std::vector<T> mem;
  TensorView<T, N> v;

  Owned() = default;
  Owned(const Shape<N>& shape, Layout layout) {
    Shape<N> stride{};
    index_t run = 1;
    const index_t pad = layout == Layout::padded ? 1 : 0;
    for (int i = N - 1; i >= 0; --i) {
      const int d = layout == Layout::reversed ? N - 1 - i : i;
      stride[d] = run;
      run *= shape[d] + pad;
    }
    mem.assign(static_cast<size_t>(run + 2 * pad), kSentinel);
    v = TensorView<T, N>(mem.data() + pad, shape, stride);
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  Owned(Owned&&) = default;  // the vector's buffer moves with it, so the view stays valid
  Owned& operator=(Owned&&) = default;

  Owned(const Shape<N>& shape, Layout layout, const std::vector<double>& values)
      : Owned(shape, layout) {
    set(values);
  }
  void set(const std::vector<double>& values) {
    ASSERT_EQ(static_cast<index_t>(values.size()), v.numel());
    for_each_offset<N>(v.shape, v.stride,
                       [&](index_t i, index_t off) { v.data[off] = static_cast<T>(values[i]); });
  }
  std::vector<double> get() const {
    std::vector<double> out(static_cast<size_t>(v.numel()));
    for_each_offset<N>(v.shape, v.stride,
                       [&](index_t i, index_t off) { out[i] = static_cast<double>(v.data[off]); });
    return out;
  }
  bool outside_untouched() const {
    std::vector<char> inside(mem.size(), 0);
    const index_t base = v.data - mem.data();
    for_each_offset<N>(v.shape, v.stride, [&](index_t, index_t off) { inside[base + off] = 1; });
    for (size_t i = 0; i < mem.size(); ++i)
      if (!inside[i] && mem[i] != kSentinel) return false;
    return true;
  }
  TensorView<const T, N> c() const { return v; }
};

struct Dims {
  index_t B, L, E, G, K, R, M;
  ref::ProjectionShape shape(bool tanh_gelu = false) const {
    ref::ProjectionShape s;
    s.B = B;
    s.L = L;
    s.E = E;
    s.G = G;
    s.K = K;
    s.R = R;
    s.M = M;
    s.tanh_gelu = tanh_gelu;
    return s;
  }
};

/// The twelve dynamic tensors, owned, indexed by split like the reference.
template <class T>
struct OwnedWeights {
  std::array<Owned<T, 5>, 4> w1, w2;
  std::array<Owned<T, 4>, 4> dd;

  OwnedWeights(const Dims& d, Layout layout) {
    for (int c = 0; c < 4; ++c) {
      w1[c] = Owned<T, 5>({d.B, d.L, d.G, d.R, d.M}, layout);
      w2[c] = Owned<T, 5>({d.B, d.L, d.G, d.R, d.M}, layout);
      dd[c] = Owned<T, 4>({d.B, d.L, d.G, d.M}, layout);
    }
  }
  void set(const ref::ProjectionOutputs& o) {
    for (int c = 0; c < 4; ++c) {
      w1[c].set(o.w1[c]);
      w2[c].set(o.w2[c]);
      dd[c].set(o.dd[c]);
    }
  }
  ref::ProjectionOutputs get() const {
    ref::ProjectionOutputs o;
    for (int c = 0; c < 4; ++c) {
      o.w1[c] = w1[c].get();
      o.w2[c] = w2[c].get();
      o.dd[c] = dd[c].get();
    }
    return o;
  }
  bool outside_untouched() const {
    for (int c = 0; c < 4; ++c)
      if (!w1[c].outside_untouched() || !w2[c].outside_untouched() || !dd[c].outside_untouched())
        return false;
    return true;
  }
  dcmha::DynamicWeights<T> views() const {
    dcmha::DynamicWeights<T> w;
    w.pre = {w1[0].v, w2[0].v, w1[1].v, w2[1].v, dd[0].v, dd[1].v};
    w.post = {w1[2].v, w2[2].v, w1[3].v, w2[3].v, dd[2].v, dd[3].v};
    return w;
  }
};

/// A whole problem in the production API's types: x, parameters, outputs, upstream
/// gradients, and gradients.
template <class T>
struct Problem {
  Dims d;
  Owned<T, 3> x, dx;
  Owned<T, 4> dw1, gdw1;
  Owned<T, 5> qkw, gqkw;
  Owned<T, 3> dd, gdd;
  OwnedWeights<T> out, dout;

  Problem(const Dims& dims, Layout in_layout, Layout out_layout)
      : d(dims),
        x({d.B, d.L, d.E}, in_layout),
        dx({d.B, d.L, d.E}, out_layout),
        dw1({d.E, d.G, 4, d.K}, in_layout),
        gdw1({d.E, d.G, 4, d.K}, out_layout),
        qkw({d.G, 4, d.K, 2 * d.R, d.M}, in_layout),
        gqkw({d.G, 4, d.K, 2 * d.R, d.M}, out_layout),
        dd({d.E, d.G, 4 * d.M}, in_layout),
        gdd({d.E, d.G, 4 * d.M}, out_layout),
        out(d, out_layout),
        dout(d, in_layout) {}

  void set(const std::vector<double>& xv, const ref::ProjectionParams& p,
           const ref::ProjectionOutputs& douts) {
    x.set(xv);
    dw1.set(p.dw1);
    qkw.set(p.qkw);
    dd.set(p.dd);
    dout.set(douts);
  }
  dcmha::DynamicWeightProjection<T> params() const { return {dw1.v, qkw.v, dd.v}; }
  dcmha::DynamicWeightProjectionGrads<T> grads() const { return {gdw1.v, gqkw.v, gdd.v}; }

  void forward(const ProjectionConfig& cfg) {
    dcmha::dynamic_weights_forward(cfg, x.v, params(), out.views());
  }
  void backward(const ProjectionConfig& cfg) {
    dcmha::dynamic_weights_backward(cfg, x.v, params(), dout.views(), dx.v, grads());
  }
  void forward(const ProjectionConfig& cfg, dcmha::ProjectionActivations<T>& keep) {
    dcmha::dynamic_weights_forward(cfg, x.v, params(), out.views(), keep);
  }
  void backward(const ProjectionConfig& cfg, const dcmha::ProjectionActivations<T>& kept) {
    dcmha::dynamic_weights_backward(cfg, x.v, params(), kept, dout.views(), dx.v, grads());
  }
  /// Every result: dx, the parameter gradients, then the outputs split by split.
  std::vector<std::vector<double>> results() const {
    std::vector<std::vector<double>> all{dx.get(), gdw1.get(), gqkw.get(), gdd.get()};
    const ref::ProjectionOutputs o = out.get();
    for (int c = 0; c < 4; ++c) {
      all.push_back(o.w1[c]);
      all.push_back(o.w2[c]);
      all.push_back(o.dd[c]);
    }
    return all;
  }
  bool outputs_outside_untouched() const {
    return out.outside_untouched() && dx.outside_untouched() && gdw1.outside_untouched() &&
           gqkw.outside_untouched() && gdd.outside_untouched();
  }
};

double max_rel_error(const ref::ProjectionOutputs& a, const ref::ProjectionOutputs& b) {
  double e = 0.0;
  for (int c = 0; c < 4; ++c)
    e = std::max(
        {e, rel_error(a.w1[c], b.w1[c]), rel_error(a.w2[c], b.w2[c]), rel_error(a.dd[c], b.dd[c])});
  return e;
}

// ---------------------------------------------------------------------------------------------
// (1) The reference against central finite differences
// ---------------------------------------------------------------------------------------------

struct FdCase {
  bool tanh_gelu;
  index_t G, R;
};

class ReferenceFiniteDifferences : public ::testing::TestWithParam<FdCase> {};

TEST_P(ReferenceFiniteDifferences, AllGradients) {
  const FdCase fc = GetParam();
  const Dims d{2, 3, 5, fc.G, 4, fc.R, 3};
  const ref::ProjectionShape s = d.shape(fc.tanh_gelu);
  std::mt19937_64 rng(1000 + 10 * fc.G + fc.R + (fc.tanh_gelu ? 100 : 0));
  std::vector<double> x = random_vector(rng, s.x_size(), 1.0);
  ref::ProjectionParams p = random_params(rng, s);
  const ref::ProjectionOutputs dout = random_douts(rng, s);

  std::vector<double> dx;
  ref::ProjectionParams g;
  ref::projection_backward(s, x, p, dout, dx, g);

  const double h = 1e-6;
  auto check = [&](const char* name, std::vector<double>& param, const std::vector<double>& grad) {
    ASSERT_EQ(param.size(), grad.size());
    std::vector<double> fd(param.size());
    for (size_t i = 0; i < param.size(); ++i) {
      const double keep = param[i];
      param[i] = keep + h;
      const double fp = loss(s, x, p, dout);
      param[i] = keep - h;
      const double fm = loss(s, x, p, dout);
      param[i] = keep;
      fd[i] = (fp - fm) / (2 * h);
    }
    EXPECT_LT(rel_error(grad, fd), 1e-7) << name;
  };
  check("x", x, dx);
  check("dw1", p.dw1, g.dw1);
  check("qkw", p.qkw, g.qkw);
  check("dd", p.dd, g.dd);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ReferenceFiniteDifferences,
                         ::testing::Values(FdCase{false, 1, 1}, FdCase{false, 1, 2},
                                           FdCase{false, 2, 3}, FdCase{true, 1, 1},
                                           FdCase{true, 2, 2}, FdCase{true, 1, 3},
                                           FdCase{false, 2, 1}, FdCase{true, 2, 3}),
                         [](const ::testing::TestParamInfo<FdCase>& i) {
                           return std::string(i.param.tanh_gelu ? "tanh" : "erf") + "_G" +
                                  std::to_string(i.param.G) + "_R" + std::to_string(i.param.R);
                         });

// ---------------------------------------------------------------------------------------------
// (2) The official conformance case
// ---------------------------------------------------------------------------------------------

struct ConformanceCase {
  Dims d{};
  ref::ProjectionShape shape;
  std::vector<double> x;
  ref::ProjectionParams params, grads;
  ref::ProjectionOutputs out, dout;
  std::vector<double> dx;
};

ConformanceCase load_conformance() {
  const dcmha::test::CaseFile cf =
      dcmha::test::read_case_file(std::string(DCMHA_CONFORMANCE_DIR) + "/proj_b2_t5_e16_n4.txt");
  if (cf.meta("kind") != "projection") cf.fail("expected `meta kind projection`");
  if (cf.meta_or("gelu", "erf") != "erf") cf.fail("this test expects `meta gelu erf`");
  ConformanceCase k;
  const index_t B = cf.meta_int("B"), L = cf.meta_int("T"), E = cf.meta_int("E");
  const index_t M = cf.meta_int("N"), R = cf.meta_int("R"), K = cf.meta_int("K");
  const index_t G = cf.meta_int_or("G", 1);
  if (G != 1) cf.fail("projection cases are G = 1 (spec section 4)");
  k.d = Dims{B, L, E, G, K, R, M};
  k.shape = k.d.shape(false);
  k.x = cf.tensor("x", {B, L, E}).values;
  k.params.dw1 = cf.tensor("dw1", {E, G, 4, K}).values;
  k.params.qkw = cf.tensor("qkw", {G, 4, K, 2 * R, M}).values;
  k.params.dd = cf.tensor("dd", {E, G, 4 * M}).values;
  // The file's (B, L, R, N) and (B, L, N) are our (B, L, G, R, M) and (B, L, G, M) at G = 1.
  for (int c = 0; c < 4; ++c) {
    const std::string n = kSplitName[c];
    k.out.w1[c] = cf.tensor(n + "w1", {B, L, R, M}).values;
    k.out.w2[c] = cf.tensor(n + "w2", {B, L, R, M}).values;
    k.out.dd[c] = cf.tensor(n + "dd", {B, L, M}).values;
    k.dout.w1[c] = cf.tensor("d" + n + "w1", {B, L, R, M}).values;
    k.dout.w2[c] = cf.tensor("d" + n + "w2", {B, L, R, M}).values;
    k.dout.dd[c] = cf.tensor("d" + n + "dd", {B, L, M}).values;
  }
  k.dx = cf.tensor("grad_x", {B, L, E}).values;
  k.grads.dw1 = cf.tensor("grad_dw1", {E, G, 4, K}).values;
  k.grads.qkw = cf.tensor("grad_qkw", {G, 4, K, 2 * R, M}).values;
  k.grads.dd = cf.tensor("grad_dd", {E, G, 4 * M}).values;
  return k;
}

void expect_matches_case(const ConformanceCase& k, const ref::ProjectionOutputs& out,
                         const std::vector<double>& dx, const ref::ProjectionParams& g, double tol,
                         const char* who) {
  for (int c = 0; c < 4; ++c) {
    const std::string n = kSplitName[c];
    EXPECT_LT(rel_error(out.w1[c], k.out.w1[c]), tol) << who << " " << n << "w1";
    EXPECT_LT(rel_error(out.w2[c], k.out.w2[c]), tol) << who << " " << n << "w2";
    EXPECT_LT(rel_error(out.dd[c], k.out.dd[c]), tol) << who << " " << n << "dd";
  }
  EXPECT_LT(rel_error(dx, k.dx), tol) << who << " grad_x";
  EXPECT_LT(rel_error(g.dw1, k.grads.dw1), tol) << who << " grad_dw1";
  EXPECT_LT(rel_error(g.qkw, k.grads.qkw), tol) << who << " grad_qkw";
  EXPECT_LT(rel_error(g.dd, k.grads.dd), tol) << who << " grad_dd";
}

TEST(ProjectionConformance, Reference) {
  const ConformanceCase k = load_conformance();
  ref::ProjectionOutputs out;
  ref::projection_forward(k.shape, k.x, k.params, out);
  std::vector<double> dx;
  ref::ProjectionParams g;
  ref::projection_backward(k.shape, k.x, k.params, k.dout, dx, g);
  expect_matches_case(k, out, dx, g, 1e-9, "reference");
}

template <class T>
void production_conformance(double tol, const char* who) {
  const ConformanceCase k = load_conformance();
  Problem<T> pr(k.d, Layout::contiguous, Layout::contiguous);
  pr.set(k.x, k.params, k.dout);
  ProjectionConfig cfg;
  pr.forward(cfg);
  pr.backward(cfg);
  expect_matches_case(k, pr.out.get(), pr.dx.get(),
                      ref::ProjectionParams{pr.gdw1.get(), pr.gqkw.get(), pr.gdd.get()}, tol, who);
}

TEST(ProjectionConformance, ProductionDouble) { production_conformance<double>(1e-9, "double"); }
TEST(ProjectionConformance, ProductionFloat) { production_conformance<float>(2e-4, "float"); }

// ---------------------------------------------------------------------------------------------
// (3) Production against the reference
// ---------------------------------------------------------------------------------------------

struct ProdCase {
  Dims d;
  bool tanh_gelu;
  Layout in, out;
};

std::string layout_name(Layout l) {
  return l == Layout::contiguous ? "contiguous" : l == Layout::padded ? "padded" : "reversed";
}

template <class T>
void production_vs_reference(const ProdCase& pc, double tol) {
  const ref::ProjectionShape s = pc.d.shape(pc.tanh_gelu);
  std::mt19937_64 rng(42 + pc.d.E + 7 * pc.d.R + 13 * pc.d.G);
  const std::vector<double> x = random_vector(rng, s.x_size(), 1.0);
  const ref::ProjectionParams p = random_params(rng, s);
  const ref::ProjectionOutputs dout = random_douts(rng, s);
  ref::ProjectionOutputs want;
  ref::projection_forward(s, x, p, want);
  std::vector<double> want_dx;
  ref::ProjectionParams want_g;
  ref::projection_backward(s, x, p, dout, want_dx, want_g);

  ProjectionConfig cfg;
  cfg.gelu = pc.tanh_gelu ? Gelu::tanh : Gelu::erf;
  std::vector<std::vector<double>> first_run;
  for (int threads : {1, 2, 2}) {
    SCOPED_TRACE("threads " + std::to_string(threads) + ", in " + layout_name(pc.in) + ", out " +
                 layout_name(pc.out));
    cfg.num_threads = threads;
    Problem<T> pr(pc.d, pc.in, pc.out);
    pr.set(x, p, dout);
    pr.forward(cfg);
    pr.backward(cfg);
    const ref::ProjectionOutputs got = pr.out.get();
    EXPECT_LT(max_rel_error(got, want), tol);
    EXPECT_LT(rel_error(pr.dx.get(), want_dx), tol);
    EXPECT_LT(rel_error(pr.gdw1.get(), want_g.dw1), tol);
    EXPECT_LT(rel_error(pr.gqkw.get(), want_g.qkw), tol);
    EXPECT_LT(rel_error(pr.gdd.get(), want_g.dd), tol);
    EXPECT_TRUE(pr.outputs_outside_untouched());

    // Same thread count, same bits.
    const std::vector<std::vector<double>> all = pr.results();
    // Activations kept by the forward instead of recomputed: the same products, so the same
    // bits, and the activations are still intact for a second backward.
    {
      Problem<T> kept(pc.d, pc.in, pc.out);
      kept.set(x, p, dout);
      dcmha::ProjectionActivations<T> act;
      EXPECT_EQ(act.bytes(), 0u);
      kept.forward(cfg, act);
      EXPECT_GT(act.bytes(), 0u);
      kept.backward(cfg, act);
      EXPECT_TRUE(kept.results() == all) << "backward from kept activations differs";
      kept.backward(cfg, act);
      EXPECT_TRUE(kept.results() == all) << "a second backward from the same activations differs";
      EXPECT_TRUE(kept.outputs_outside_untouched());
    }
    if (threads == 2) {
      if (!first_run.empty()) {
        EXPECT_TRUE(all == first_run) << "not deterministic";
      }
      first_run = all;
    }
  }
}

class ProductionVsReference : public ::testing::TestWithParam<ProdCase> {};

TEST_P(ProductionVsReference, Double) { production_vs_reference<double>(GetParam(), 1e-11); }
TEST_P(ProductionVsReference, Float) { production_vs_reference<float>(GetParam(), 2e-4); }

INSTANTIATE_TEST_SUITE_P(
    Shapes, ProductionVsReference,
    ::testing::Values(
        ProdCase{{2, 5, 16, 1, 16, 2, 4}, false, Layout::contiguous, Layout::contiguous},
        ProdCase{{1, 7, 24, 2, 8, 1, 3}, true, Layout::contiguous, Layout::padded},
        ProdCase{{3, 4, 9, 2, 5, 3, 2}, false, Layout::padded, Layout::reversed},
        ProdCase{{2, 3, 12, 1, 6, 2, 5}, true, Layout::reversed, Layout::padded},
        ProdCase{{1, 1, 1, 1, 1, 1, 1}, false, Layout::reversed, Layout::reversed},
        ProdCase{{2, 33, 40, 3, 12, 2, 4}, false, Layout::padded, Layout::contiguous},
        ProdCase{{1, 64, 64, 1, 16, 2, 8}, true, Layout::contiguous, Layout::contiguous}),
    [](const ::testing::TestParamInfo<ProdCase>& i) {
      const Dims& d = i.param.d;
      return "B" + std::to_string(d.B) + "_L" + std::to_string(d.L) + "_E" + std::to_string(d.E) +
             "_G" + std::to_string(d.G) + "_K" + std::to_string(d.K) + "_R" + std::to_string(d.R) +
             "_M" + std::to_string(d.M) + (i.param.tanh_gelu ? "_tanh_" : "_erf_") +
             layout_name(i.param.in) + "_" + layout_name(i.param.out);
    });

// The view of a longer sequence buffer: rows of x (and dx) are L per batch, then a gap.
TEST(ProductionVsReferenceStrided, BatchStrideWithGap) {
  const Dims d{3, 4, 8, 1, 4, 2, 4};
  const ref::ProjectionShape s = d.shape(false);
  std::mt19937_64 rng(7);
  const std::vector<double> x = random_vector(rng, s.x_size(), 1.0);
  const ref::ProjectionParams p = random_params(rng, s);
  const ref::ProjectionOutputs dout = random_douts(rng, s);
  ref::ProjectionOutputs want;
  ref::projection_forward(s, x, p, want);
  std::vector<double> want_dx;
  ref::ProjectionParams want_g;
  ref::projection_backward(s, x, p, dout, want_dx, want_g);

  Problem<double> pr(d, Layout::contiguous, Layout::contiguous);
  pr.set(x, p, dout);
  const index_t Lmax = 6;
  std::vector<double> xbuf(d.B * Lmax * d.E, 0.0), dxbuf(d.B * Lmax * d.E, -5.0);
  TensorView<double, 3> xv(xbuf.data(), {d.B, d.L, d.E}, {Lmax * d.E, d.E, 1});
  TensorView<double, 3> dxv(dxbuf.data(), {d.B, d.L, d.E}, {Lmax * d.E, d.E, 1});
  for_each_offset<3>(xv.shape, xv.stride, [&](index_t i, index_t off) { xv.data[off] = x[i]; });
  ProjectionConfig cfg;
  dcmha::dynamic_weights_forward(cfg, xv, pr.params(), pr.out.views());
  dcmha::dynamic_weights_backward(cfg, xv, pr.params(), pr.dout.views(), dxv, pr.grads());
  EXPECT_LT(max_rel_error(pr.out.get(), want), 1e-12);
  std::vector<double> got_dx(want_dx.size());
  for_each_offset<3>(dxv.shape, dxv.stride,
                     [&](index_t i, index_t off) { got_dx[i] = dxv.data[off]; });
  EXPECT_LT(rel_error(got_dx, want_dx), 1e-12);
  for (index_t b = 0; b < d.B; ++b)
    for (index_t i = d.L * d.E; i < Lmax * d.E; ++i) EXPECT_EQ(dxbuf[b * Lmax * d.E + i], -5.0);
  EXPECT_LT(rel_error(pr.gdw1.get(), want_g.dw1), 1e-12);
}

// Outputs may interleave in one buffer: qw1 and qw2 as the halves of (B, L, G, 2R, M).
TEST(ProductionVsReferenceStrided, InterleavedOutputsShareABuffer) {
  const Dims d{2, 3, 8, 1, 4, 2, 3};
  const ref::ProjectionShape s = d.shape(false);
  std::mt19937_64 rng(8);
  const std::vector<double> x = random_vector(rng, s.x_size(), 1.0);
  const ref::ProjectionParams p = random_params(rng, s);
  ref::ProjectionOutputs want;
  ref::projection_forward(s, x, p, want);

  Problem<double> pr(d, Layout::contiguous, Layout::contiguous);
  pr.set(x, p, random_douts(rng, s));
  std::vector<double> both(d.B * d.L * d.G * 2 * d.R * d.M, 0.0);
  const Shape<5> sh{d.B, d.L, d.G, d.R, d.M};
  const Shape<5> st{d.L * d.G * 2 * d.R * d.M, d.G * 2 * d.R * d.M, 2 * d.R * d.M, d.M, 1};
  dcmha::DynamicWeights<double> w = pr.out.views();
  w.pre.qw1 = TensorView<double, 5>(both.data(), sh, st);
  w.pre.qw2 = TensorView<double, 5>(both.data() + d.R * d.M, sh, st);
  dcmha::dynamic_weights_forward(ProjectionConfig{}, pr.x.v, pr.params(), w);
  std::vector<double> qw1(want.w1[0].size()), qw2(want.w2[0].size());
  for_each_offset<5>(sh, st, [&](index_t i, index_t off) {
    qw1[i] = both[off];
    qw2[i] = both[d.R * d.M + off];
  });
  EXPECT_LT(rel_error(qw1, want.w1[0]), 1e-12);
  EXPECT_LT(rel_error(qw2, want.w2[0]), 1e-12);
}

// Upstream gradients in mutable views (as compose_grads() hands them out) are accepted.
TEST(ProductionVsReferenceStrided, MutableUpstreamGradients) {
  const Dims d{1, 3, 6, 1, 4, 1, 2};
  Problem<float> pr(d, Layout::contiguous, Layout::contiguous);
  std::mt19937_64 rng(9);
  const ref::ProjectionShape s = d.shape(false);
  pr.set(random_vector(rng, s.x_size(), 1.0), random_params(rng, s), random_douts(rng, s));
  const dcmha::DynamicWeights<float> dout = pr.dout.views();
  dcmha::dynamic_weights_backward(ProjectionConfig{}, pr.x.v, pr.params(), dout, pr.dx.v,
                                  pr.grads());
  const dcmha::DynamicWeights<const float> ro = dcmha::read_only(dout);
  EXPECT_EQ(ro.post.kdd.data, dout.post.kdd.data);
}

// bf16 and fp16 storage: the float kernels on widened contiguous copies, each result rounded
// once. On inputs that are values of the storage type, every output and gradient is the float
// projection's on contiguous inputs, rounded, bitwise, whatever the narrow tensors' layouts, with
// recomputed and with kept (float) activations. (The float kernels' own results depend on the
// input layout in the last bits: a batch gap splits the GEMMs.)
template <class S>
double round_to(double x) {
  return double(static_cast<float>(S(static_cast<float>(x))));
}

template <class S>
std::vector<double> rounded(std::vector<double> v) {
  for (double& e : v) e = round_to<S>(e);
  return v;
}

template <class S>
void narrow_is_rounded_float(const ProdCase& pc) {
  SCOPED_TRACE("in " + layout_name(pc.in) + ", out " + layout_name(pc.out));
  const ref::ProjectionShape s = pc.d.shape(pc.tanh_gelu);
  std::mt19937_64 rng(99 + pc.d.E);
  const std::vector<double> x = rounded<S>(random_vector(rng, s.x_size(), 1.0));
  ref::ProjectionParams p = random_params(rng, s);
  for (std::vector<double>* v : {&p.dw1, &p.qkw, &p.dd}) *v = rounded<S>(*v);
  ref::ProjectionOutputs dout = random_douts(rng, s);
  for (int c = 0; c < 4; ++c)
    for (std::vector<double>* v : {&dout.w1[c], &dout.w2[c], &dout.dd[c]}) *v = rounded<S>(*v);
  ProjectionConfig cfg;
  cfg.gelu = pc.tanh_gelu ? Gelu::tanh : Gelu::erf;
  cfg.num_threads = 2;

  Problem<float> f(pc.d, Layout::contiguous, pc.out);
  f.set(x, p, dout);
  f.forward(cfg);
  f.backward(cfg);
  std::vector<std::vector<double>> want = f.results();
  for (std::vector<double>& v : want) v = rounded<S>(v);

  Problem<S> h(pc.d, pc.in, pc.out);
  h.set(x, p, dout);
  h.forward(cfg);
  h.backward(cfg);
  EXPECT_TRUE(h.results() == want) << "recomputed activations";
  EXPECT_TRUE(h.outputs_outside_untouched());

  Problem<S> kept(pc.d, pc.in, pc.out);
  kept.set(x, p, dout);
  dcmha::ProjectionActivations<S> act;
  kept.forward(cfg, act);
  EXPECT_EQ(act.bytes() % sizeof(float), 0u);
  kept.backward(cfg, act);
  EXPECT_TRUE(kept.results() == want) << "kept activations";
}

TEST_P(ProductionVsReference, Bf16IsTheRoundedFloatResult) {
  narrow_is_rounded_float<dcmha::bf16>(GetParam());
}
TEST_P(ProductionVsReference, Fp16IsTheRoundedFloatResult) {
  narrow_is_rounded_float<dcmha::half>(GetParam());
}

// ---------------------------------------------------------------------------------------------
// (4) Argument checks
// ---------------------------------------------------------------------------------------------

template <class F>
void expect_error(F&& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no dcmha::Error; expected one containing: " << fragment;
  } catch (const dcmha::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << fragment;
  }
}

const char kFwd[] = "dcmha::dynamic_weights_forward: ";
const char kBwd[] = "dcmha::dynamic_weights_backward: ";

class ProjectionValidation : public ::testing::Test {
 protected:
  const Dims d{2, 3, 5, 2, 4, 2, 3};
  Problem<float> pr{d, Layout::contiguous, Layout::contiguous};
  ProjectionConfig cfg;
  TensorView<const float, 3> x = pr.x.c();
  dcmha::DynamicWeightProjection<float> p = pr.params();
  dcmha::DynamicWeights<float> out = pr.out.views();
  dcmha::DynamicWeights<float> dout = pr.dout.views();
  TensorView<float, 3> dx = pr.dx.v;
  dcmha::DynamicWeightProjectionGrads<float> grads = pr.grads();

  void fwd() { dcmha::dynamic_weights_forward(cfg, x, p, out); }
  void bwd() { dcmha::dynamic_weights_backward(cfg, x, p, dcmha::read_only(dout), dx, grads); }
  /// Both entry points, since both check the config, x and the parameters.
  void both(const std::string& what) {
    expect_error([&] { fwd(); }, kFwd + what);
    expect_error([&] { bwd(); }, kBwd + what);
  }
};

/// Every dynamic tensor of one side struct, by its name in messages.
template <class U>
std::vector<std::pair<std::string, TensorView<U, 5>*>> low_rank_fields(
    dcmha::DynamicWeights<U>& w) {
  return {{"pre.qw1", &w.pre.qw1},   {"pre.qw2", &w.pre.qw2},   {"pre.kw1", &w.pre.kw1},
          {"pre.kw2", &w.pre.kw2},   {"post.qw1", &w.post.qw1}, {"post.qw2", &w.post.qw2},
          {"post.kw1", &w.post.kw1}, {"post.kw2", &w.post.kw2}};
}
template <class U>
std::vector<std::pair<std::string, TensorView<U, 4>*>> gate_fields(dcmha::DynamicWeights<U>& w) {
  return {{"pre.qdd", &w.pre.qdd},
          {"pre.kdd", &w.pre.kdd},
          {"post.qdd", &w.post.qdd},
          {"post.kdd", &w.post.kdd}};
}

TEST_F(ProjectionValidation, ValidCallsPass) {
  EXPECT_NO_THROW(fwd());
  EXPECT_NO_THROW(bwd());
}

TEST_F(ProjectionValidation, Config) {
  cfg.gelu = static_cast<Gelu>(7);
  both("cfg.gelu: expected Gelu::erf or Gelu::tanh, got 7");
  cfg = {};
  cfg.eps = -1.0;
  both("cfg.eps: expected a finite value >= 0, got -1");
  cfg.eps = std::numeric_limits<double>::quiet_NaN();
  both("cfg.eps: expected a finite value >= 0, got nan");
  cfg = {};
  cfg.num_threads = -2;
  both("cfg.num_threads: expected >= 0 (0 = OpenMP default), got -2");
}

TEST_F(ProjectionValidation, EmptyInputs) {
  auto x0 = x;
  x.data = nullptr;
  both("x: expected a tensor (B, L, E), got an empty view");
  x = x0;
  auto p0 = p;
  p.dw1.data = nullptr;
  both("dw1: expected a tensor (E, G, 4, K), got an empty view");
  p = p0;
  p.qkw.data = nullptr;
  both("qkw: expected a tensor (G, 4, K, 2R, M), got an empty view");
  p = p0;
  p.dd.data = nullptr;
  both("dd: expected a tensor (E, G, 4M), got an empty view");
}

TEST_F(ProjectionValidation, EmptyOutputsAndUpstreamGradients) {
  for (auto& [name, f] : low_rank_fields(out)) {
    auto keep = *f;
    f->data = nullptr;
    expect_error([&] { fwd(); },
                 kFwd + ("out." + name + ": expected a tensor (B, L, G, R, M), got an empty view"));
    *f = keep;
  }
  for (auto& [name, f] : gate_fields(out)) {
    auto keep = *f;
    f->data = nullptr;
    expect_error([&] { fwd(); },
                 kFwd + ("out." + name + ": expected a tensor (B, L, G, M), got an empty view"));
    *f = keep;
  }
  for (auto& [name, f] : low_rank_fields(dout)) {
    auto keep = *f;
    f->data = nullptr;
    expect_error([&] { bwd(); }, kBwd + ("dout." + name +
                                         ": expected a tensor (B, L, G, R, M), got an empty view"));
    *f = keep;
  }
  for (auto& [name, f] : gate_fields(dout)) {
    auto keep = *f;
    f->data = nullptr;
    expect_error([&] { bwd(); },
                 kBwd + ("dout." + name + ": expected a tensor (B, L, G, M), got an empty view"));
    *f = keep;
  }
  auto dx0 = dx;
  dx.data = nullptr;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "dx: expected a tensor (B, L, E), got an empty view");
  dx = dx0;
  auto g0 = grads;
  grads.dw1.data = nullptr;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "grads.dw1: expected a tensor (E, G, 4, K), got an empty view");
  grads = g0;
  grads.qkw.data = nullptr;
  expect_error(
      [&] { bwd(); },
      std::string(kBwd) + "grads.qkw: expected a tensor (G, 4, K, 2R, M), got an empty view");
  grads = g0;
  grads.dd.data = nullptr;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "grads.dd: expected a tensor (E, G, 4M), got an empty view");
}

TEST_F(ProjectionValidation, NonPositiveDims) {
  auto x0 = x;
  const char* x_what[3] = {"B", "L", "E"};
  for (int k = 0; k < 3; ++k) {
    x.shape[k] = 0;
    both("x.shape[" + std::to_string(k) + "] (" + x_what[k] + "): expected >= 1, got 0");
    x = x0;
  }
  auto p0 = p;
  p.dw1.shape[3] = -1;
  both("dw1.shape[3] (K): expected >= 1, got -1");
  p = p0;
  p.qkw.shape[4] = 0;
  both("qkw.shape[4] (M): expected >= 1, got 0");
  p = p0;
  p.dd.shape[1] = 0;
  both("dd.shape[1] (G): expected >= 1, got 0");
  p = p0;
  // Every other size must equal one fixed by x and the parameters, which the message names.
  out.post.kw2.shape[3] = 0;
  expect_error(
      [&] { fwd(); },
      std::string(kFwd) + "out.post.kw2.shape[3] (R): expected 2 (qkw.shape[3] / 2), got 0");
  dout.pre.kdd.shape[0] = 0;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "dout.pre.kdd.shape[0] (B): expected 2 (x.shape[0]), got 0");
  dout = pr.dout.views();
  dx.shape[2] = 0;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "dx.shape[2] (E): expected 5 (x.shape[2]), got 0");
  dx = pr.dx.v;
  grads.qkw.shape[0] = 0;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "grads.qkw.shape[0] (G): expected 2 (qkw.shape[0]), got 0");
}

TEST_F(ProjectionValidation, ParameterShapes) {
  auto p0 = p;
  p.dw1.shape[0] = 6;
  both("dw1.shape[0] (E): expected 5 (x.shape[2]), got 6");
  p = p0;
  p.dw1.shape[2] = 3;
  both("dw1.shape[2] (splits): expected 4, got 3");
  p = p0;
  p.qkw.shape[0] = 1;
  both("qkw.shape[0] (G): expected 2 (dw1.shape[1]), got 1");
  p = p0;
  p.qkw.shape[1] = 2;
  both("qkw.shape[1] (splits): expected 4, got 2");
  p = p0;
  p.qkw.shape[2] = 5;
  both("qkw.shape[2] (K): expected 4 (dw1.shape[3]), got 5");
  p = p0;
  p.qkw.shape[3] = 3;
  both("qkw.shape[3] (2R): expected an even number, got 3");
  p = p0;
  p.dd.shape[0] = 4;
  both("dd.shape[0] (E): expected 5 (x.shape[2]), got 4");
  p = p0;
  p.dd.shape[1] = 1;
  both("dd.shape[1] (G): expected 2 (dw1.shape[1]), got 1");
  p = p0;
  p.dd.shape[2] = 11;
  both("dd.shape[2] (4M): expected 12 (4 * qkw.shape[4]), got 11");
}

TEST_F(ProjectionValidation, DynamicTensorShapes) {
  const char* what[5] = {"B", "L", "G", "R", "M"};
  const index_t want[5] = {2, 3, 2, 2, 3};
  const char* src[5] = {"x.shape[0]", "x.shape[1]", "dw1.shape[1]", "qkw.shape[3] / 2",
                        "qkw.shape[4]"};
  const char* gate_what[4] = {"B", "L", "G", "M"};
  const index_t gate_want[4] = {2, 3, 2, 3};
  const char* gate_src[4] = {"x.shape[0]", "x.shape[1]", "dw1.shape[1]", "qkw.shape[4]"};
  auto msg = [](const std::string& name, int k, const char* w, index_t e, const char* s) {
    return name + ".shape[" + std::to_string(k) + "] (" + w + "): expected " + std::to_string(e) +
           " (" + s + "), got " + std::to_string(e + 1);
  };
  for (auto [prefix, w, fn, call] :
       {std::tuple<std::string, dcmha::DynamicWeights<float>*, const char*, int>{"out.", &out, kFwd,
                                                                                 0},
        {"dout.", &dout, kBwd, 1}}) {
    auto run = [&, call = call] {
      if (call == 0)
        fwd();
      else
        bwd();
    };
    for (auto& [name, f] : low_rank_fields(*w))
      for (int k = 0; k < 5; ++k) {
        auto keep = *f;
        f->shape[k] += 1;
        expect_error(run, fn + msg(prefix + name, k, what[k], want[k], src[k]));
        *f = keep;
      }
    for (auto& [name, f] : gate_fields(*w))
      for (int k = 0; k < 4; ++k) {
        auto keep = *f;
        f->shape[k] += 1;
        expect_error(run, fn + msg(prefix + name, k, gate_what[k], gate_want[k], gate_src[k]));
        *f = keep;
      }
  }
}

TEST_F(ProjectionValidation, GradientShapes) {
  dx.shape[0] = 1;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "dx.shape[0] (B): expected 2 (x.shape[0]), got 1");
  dx = pr.dx.v;
  dx.shape[1] = 4;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "dx.shape[1] (L): expected 3 (x.shape[1]), got 4");
  dx = pr.dx.v;
  dx.shape[2] = 4;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "dx.shape[2] (E): expected 5 (x.shape[2]), got 4");
  dx = pr.dx.v;
  const char* dw1_what[4] = {"E", "G", "splits", "K"};
  for (int k = 0; k < 4; ++k) {
    auto g0 = grads;
    grads.dw1.shape[k] += 1;
    expect_error([&] { bwd(); },
                 std::string(kBwd) + "grads.dw1.shape[" + std::to_string(k) + "] (" + dw1_what[k] +
                     "): expected " + std::to_string(p.dw1.shape[k]) + " (dw1.shape[" +
                     std::to_string(k) + "]), got " + std::to_string(p.dw1.shape[k] + 1));
    grads = g0;
  }
  const char* qkw_what[5] = {"G", "splits", "K", "2R", "M"};
  for (int k = 0; k < 5; ++k) {
    auto g0 = grads;
    grads.qkw.shape[k] += 1;
    expect_error([&] { bwd(); },
                 std::string(kBwd) + "grads.qkw.shape[" + std::to_string(k) + "] (" + qkw_what[k] +
                     "): expected " + std::to_string(p.qkw.shape[k]) + " (qkw.shape[" +
                     std::to_string(k) + "]), got " + std::to_string(p.qkw.shape[k] + 1));
    grads = g0;
  }
  const char* dd_what[3] = {"E", "G", "4M"};
  for (int k = 0; k < 3; ++k) {
    auto g0 = grads;
    grads.dd.shape[k] += 1;
    expect_error([&] { bwd(); }, std::string(kBwd) + "grads.dd.shape[" + std::to_string(k) + "] (" +
                                     dd_what[k] + "): expected " + std::to_string(p.dd.shape[k]) +
                                     " (dd.shape[" + std::to_string(k) + "]), got " +
                                     std::to_string(p.dd.shape[k] + 1));
    grads = g0;
  }
}

TEST_F(ProjectionValidation, OutputsMustNotAliasInputs) {
  // An output view placed inside x's memory.
  Owned<float, 1> big({100}, Layout::contiguous);
  x = TensorView<const float, 3>(big.v.data, {2, 3, 5}, {15, 5, 1});
  out.post.qdd = TensorView<float, 4>(big.v.data + 29, {2, 3, 2, 3}, {18, 6, 3, 1});
  expect_error([&] { fwd(); }, std::string(kFwd) +
                                   "out.post.qdd: expected memory disjoint from input x "
                                   "(out.post.qdd is written), got overlapping byte ranges [0x");
  x = pr.x.c();
  out = pr.out.views();
  // Overlapping only at the last element of dw1, with negative strides: the lowest address
  // the output reaches is 71 elements below its data pointer.
  Owned<float, 1> shared({400}, Layout::contiguous);
  p.dw1 = TensorView<const float, 4>(shared.v.data, pr.dw1.v.shape, pr.dw1.v.stride);
  const index_t last = pr.dw1.v.numel() - 1;
  out.pre.kw1 =
      TensorView<float, 5>(shared.v.data + last + 71, {2, 3, 2, 2, 3}, {-36, -12, -6, -3, -1});
  expect_error([&] { fwd(); },
               std::string(kFwd) + "out.pre.kw1: expected memory disjoint from input dw1");
  out.pre.kw1.data += 1;  // one element further: disjoint
  EXPECT_NO_THROW(fwd());
  p = pr.params();
  out = pr.out.views();
  out.post.kw2 = TensorView<float, 5>(pr.qkw.v.data, {2, 3, 2, 2, 3}, {0, 0, 0, 0, 0});
  expect_error([&] { fwd(); },
               std::string(kFwd) + "out.post.kw2: expected memory disjoint from input qkw");
  out = pr.out.views();
  out.pre.qdd.data = pr.dd.v.data;
  expect_error([&] { fwd(); },
               std::string(kFwd) + "out.pre.qdd: expected memory disjoint from input dd");
  out = pr.out.views();

  dx = pr.dx.v;
  dx.data = pr.x.v.data;
  expect_error([&] { bwd(); }, std::string(kBwd) + "dx: expected memory disjoint from input x");
  dx = pr.dx.v;
  // An output larger than the input it starts at would also run into whichever buffer the
  // allocator put next; one pool holding both keeps the overlap to the named pair.
  Owned<float, 1> pool({400}, Layout::contiguous);
  dout.post.kw1 = TensorView<float, 5>(pool.v.data, dout.post.kw1.shape, dout.post.kw1.stride);
  grads.dw1 = TensorView<float, 4>(pool.v.data, grads.dw1.shape, grads.dw1.stride);
  expect_error([&] { bwd(); },
               std::string(kBwd) + "grads.dw1: expected memory disjoint from input dout.post.kw1");
  dout = pr.dout.views();
  grads = pr.grads();
  grads.dd.data = pr.qkw.v.data;
  expect_error([&] { bwd(); },
               std::string(kBwd) + "grads.dd: expected memory disjoint from input qkw");
  grads = pr.grads();
  dout.pre.kdd = TensorView<float, 4>(pool.v.data, dout.pre.kdd.shape, dout.pre.kdd.stride);
  grads.qkw = TensorView<float, 5>(pool.v.data, grads.qkw.shape, grads.qkw.stride);
  expect_error([&] { bwd(); },
               std::string(kBwd) + "grads.qkw: expected memory disjoint from input dout.pre.kdd");
}

TEST_F(ProjectionValidation, OutputsMustBeDistinct) {
  // Outputs are checked in order, each against the ones after it.
  out.post.kw2 = out.pre.qw1;
  expect_error([&] { fwd(); }, std::string(kFwd) +
                                   "out.pre.qw1: expected memory disjoint from output "
                                   "out.post.kw2 (both are written");
  expect_error([&] { fwd(); }, ", both starting at 0x");
  Owned<float, 1> pool({400}, Layout::contiguous);
  dx = TensorView<float, 3>(pool.v.data, dx.shape, dx.stride);
  grads.dd = TensorView<float, 3>(pool.v.data, grads.dd.shape, grads.dd.stride);
  expect_error([&] { bwd(); }, std::string(kBwd) +
                                   "dx: expected memory disjoint from output grads.dd (both are "
                                   "written");
  expect_error([&] { bwd(); }, ", both starting at 0x");
}

// Two outputs may share a buffer only where their strides keep every element apart.
TEST_F(ProjectionValidation, OutputsMayInterleaveWithoutSharedElements) {
  const Shape<5> w{d.B, d.L, d.G, d.R, d.M};
  const Shape<4> g{d.B, d.L, d.G, d.M};
  // One (B, L, G, 2R + 1, M) buffer holding qw1, qw2 and qdd: rows of different shapes.
  const index_t row = (2 * d.R + 1) * d.M;
  const Shape<5> ws{d.L * d.G * row, d.G * row, row, d.M, 1};
  const Shape<4> gs{d.L * d.G * row, d.G * row, row, 1};
  Owned<float, 1> packed({d.B * d.L * d.G * row}, Layout::contiguous);
  out.pre.qw1 = TensorView<float, 5>(packed.v.data, w, ws);
  out.pre.qw2 = TensorView<float, 5>(packed.v.data + d.R * d.M, w, ws);
  out.pre.qdd = TensorView<float, 4>(packed.v.data + 2 * d.R * d.M, g, gs);
  EXPECT_NO_THROW(fwd());
  // Shifted by one element, qw2's last column falls on qdd's first.
  out.pre.qw2.data += 1;
  expect_error([&] { fwd(); },
               std::string(kFwd) + "out.pre.qw2: expected memory disjoint from output out.pre.qdd");
  out = pr.out.views();
  // Overlapping without the same start: rejected as well.
  Owned<float, 1> both({2 * d.B * d.L * d.G * d.R * d.M}, Layout::contiguous);
  out.post.kw1 = TensorView<float, 5>(both.v.data, w, dcmha::contiguous_strides<5>(w));
  out.post.kw2 = TensorView<float, 5>(both.v.data + 5, w, dcmha::contiguous_strides<5>(w));
  expect_error(
      [&] { fwd(); },
      std::string(kFwd) + "out.post.kw1: expected memory disjoint from output out.post.kw2");
}

TEST_F(ProjectionValidation, OutputsMustNotOverlapThemselves) {
  out.pre.qdd.stride[1] = 0;
  expect_error([&] { fwd(); }, std::string(kFwd) +
                                   "out.pre.qdd.stride[1]: expected >= 1 (out.pre.qdd is written, "
                                   "its elements must not overlap), got 0");
  out = pr.out.views();
  grads.dw1.stride[0] = 8;  // (5, 2, 4, 4): E rows 8 apart, inside one (splits, K) block of 16
  expect_error([&] { bwd(); }, std::string(kBwd) +
                                   "grads.dw1.stride[0]: expected >= 16 (grads.dw1 is "
                                   "written, its elements must not overlap), got 8");
}

TEST_F(ProjectionValidation, KeptActivations) {
  auto bwd_kept = [&](const dcmha::ProjectionActivations<float>& kept) {
    dcmha::dynamic_weights_backward(cfg, x, p, kept, dcmha::read_only(dout), dx, grads);
  };
  dcmha::ProjectionActivations<float> act;
  expect_error([&] { bwd_kept(act); },
               std::string(kBwd) +
                   "kept: expected the activations a dynamic_weights_forward kept, "
                   "got empty ones");
  dcmha::dynamic_weights_forward(cfg, x, p, out, act);
  bwd_kept(act);

  // The activations of another shape: L = 2 positions instead of 3.
  const Dims d2{2, 2, 5, 2, 4, 2, 3};
  Problem<float> other(d2, Layout::contiguous, Layout::contiguous);
  dcmha::ProjectionActivations<float> act2;
  dcmha::dynamic_weights_forward(cfg, other.x.c(), other.params(), other.out.views(), act2);
  expect_error([&] { bwd_kept(act2); },
               std::string(kBwd) +
                   "kept: expected the activations of a forward with (B, L, E, G, "
                   "K, R, M) = (2, 3, 5, 2, 4, 2, 3) as x and the parameters here, "
                   "got those of (2, 2, 5, 2, 4, 2, 3)");

  // Released, then moved from: empty again; a forward fills a moved-from one anew.
  act.release();
  EXPECT_EQ(act.bytes(), 0u);
  expect_error([&] { bwd_kept(act); }, std::string(kBwd) + "kept: expected the activations");
  dcmha::dynamic_weights_forward(cfg, x, p, out, act);
  dcmha::ProjectionActivations<float> moved(std::move(act));
  bwd_kept(moved);
  expect_error([&] { bwd_kept(act); }, std::string(kBwd) + "kept: expected the activations");
  dcmha::dynamic_weights_forward(cfg, x, p, out, act);
  bwd_kept(act);

  // A forward that fails validation leaves kept activations as they were.
  dcmha::DynamicWeights<float> bad = out;
  bad.pre.qdd.shape[3] += 1;
  expect_error([&] { dcmha::dynamic_weights_forward(cfg, x, p, bad, act); }, kFwd);
  bwd_kept(act);
}

}  // namespace

// dcmha_conformance FILE...
//
// Runs the production path of dcmha on conformance case files (spec section 4) in float64 and
// float32 and compares every output and gradient with the file. Everything about a case (sizes,
// mask, scale, which compose terms are on, GELU form) comes from its meta lines and from which
// tensors it holds, so new cases need no code. Exit status: 0 if every case passes, 1 if any
// tensor is out of tolerance, a kernel throws, or a file is malformed; 2 on bad usage.
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "dcmha/dcmha.hpp"
#include "support/case_file.hpp"
#include "support/problem.hpp"

namespace {

using dcmha::index_t;
using dcmha::test::CaseFile;
using dcmha::test::CaseTensor;

// Relative to max(1, max|expected|). float32 inputs are rounded before the kernel sees them,
// so its bound covers that rounding through softmax and compose, not just kernel error.
template <class T>
constexpr double tolerance() {
  return sizeof(T) == sizeof(double) ? 1e-9 : 2e-4;
}
template <class T>
const char* type_name() {
  return sizeof(T) == sizeof(double) ? "float64" : "float32";
}

/// Tally of one file; printing happens as results come in, so a crash still leaves a trail.
struct Report {
  int checked = 0, failed = 0;

  template <class T>
  void compare(const std::string& name, const std::vector<double>& expected,
               const std::vector<double>& got) {
    const double abs = dcmha::test::max_abs_error(expected, got);
    const double rel = dcmha::test::max_rel_error(expected, got);
    const bool ok = rel <= tolerance<T>();
    ++checked;
    failed += !ok;
    std::printf("  %-7s %-16s max_abs %-10.3g rel %-10.3g tol %-7.0e %s\n", type_name<T>(),
                name.c_str(), abs, rel, tolerance<T>(), ok ? "ok" : "FAIL");
  }
  template <class T>
  void exception(const char* what, const std::exception& e) {
    ++failed;
    std::printf("  %-7s FAIL: %s threw: %s\n", type_name<T>(), what, e.what());
  }
};

// ---------------------------------------------------------------------------------------------
// kind core: dcmha::forward / dcmha::backward
// ---------------------------------------------------------------------------------------------

template <class T>
void run_core(const CaseFile& cf, const dcmha::reference::Problem& p, Report& r) {
  dcmha::test::TypedProblem<T> tp(p);
  const dcmha::AttentionConfig cfg = tp.config();
  const dcmha::ComposeWeights<T> compose = tp.compose();
  try {
    dcmha::forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), compose);
  } catch (const std::exception& e) {
    r.exception<T>("dcmha::forward", e);
    return;
  }
  r.compare<T>("out", cf.tensor("out").values, tp.out_values());

  if (!cf.has("dout")) return;
  tp.set_dout(cf.tensor("dout").values);
  try {
    dcmha::backward(cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(), tp.dv(),
                    compose, tp.dcompose());
  } catch (const std::exception& e) {
    r.exception<T>("dcmha::backward", e);
    return;
  }
  const dcmha::reference::Gradients expected = dcmha::test::gradients_from_case(cf, p);
  const dcmha::reference::Gradients got = tp.gradients();
  const auto e = dcmha::test::named_gradients(expected);
  const auto g = dcmha::test::named_gradients(got);
  for (size_t i = 0; i < e.size(); ++i)
    if (!e[i].second->empty()) r.compare<T>(e[i].first, *e[i].second, *g[i].second);
}

void check_core(const CaseFile& cf, Report& r, std::set<std::string>& used) {
  const dcmha::reference::Problem p = dcmha::test::problem_from_case(cf);
  cf.tensor("out", {p.B, p.H, p.T, p.Dv});
  if (cf.has("dout")) cf.tensor("dout", {p.B, p.H, p.T, p.Dv});
  // Validates the grad_* tensors before any kernel runs, so a bad file is reported as such.
  const dcmha::reference::Gradients expected = dcmha::test::gradients_from_case(cf, p);
  bool any_grad = false;
  for (const auto& [name, x] : dcmha::test::named_gradients(expected)) {
    if (!x->empty()) any_grad = true;
    used.insert(name);
    used.insert(name.substr(5));  // the input itself
  }
  if (any_grad && !cf.has("dout")) cf.fail("grad_* tensors but no tensor dout");
  used.insert({"out", "dout"});

  auto terms = [](const dcmha::reference::ComposeSide& c) {
    std::string s;
    if (c.static_w) s += " W";
    if (c.query_wise) s += " query";
    if (c.key_wise) s += " key";
    return s.empty() ? std::string("off") : s.substr(1);
  };
  const std::string window = p.window > 0 ? " window " + std::to_string(p.window) : "";
  std::printf(
      "  core: B %lld H %lld Hk %lld T %lld S %lld D %lld Dv %lld G %lld, %s%s, "
      "scale %.17g, pre [%s] post [%s]\n",
      (long long)p.B, (long long)p.H, (long long)p.Hk, (long long)p.T, (long long)p.S,
      (long long)p.D, (long long)p.Dv, (long long)p.G, p.causal ? "causal" : "full", window.c_str(),
      p.scale > 0 ? p.scale : 1.0 / std::sqrt(double(p.D)), terms(p.pre).c_str(),
      terms(p.post).c_str());
  run_core<double>(cf, p, r);
  run_core<float>(cf, p, r);
}

// ---------------------------------------------------------------------------------------------
// kind projection: dcmha::dynamic_weights_forward / dcmha::dynamic_weights_backward
// ---------------------------------------------------------------------------------------------

struct ProjectionCase {
  index_t B = 0, L = 0, E = 0, G = 1, K = 0, R = 0, M = 0;
  dcmha::ProjectionConfig cfg;
  bool spelled_g = false;  // outputs given as (B, L, G, R, M) rather than (B, L, R, N)
};

const char* const kSides[] = {"pre", "post"};
const char* const kOutputs[] = {"qw1", "qw2", "kw1", "kw2", "qdd", "kdd"};

ProjectionCase projection_case(const CaseFile& cf) {
  ProjectionCase c;
  const CaseTensor& x = cf.tensor("x");
  const CaseTensor& qkw = cf.tensor("qkw");
  if (x.dims.size() != 3) cf.fail("tensor x " + x.dims_string() + ": expected (B, L, E)", x.line);
  if (qkw.dims.size() != 5 || qkw.dims[1] != 4 || qkw.dims[3] % 2 != 0)
    cf.fail("tensor qkw " + qkw.dims_string() + ": expected (G, 4, K, 2R, M)", qkw.line);
  c.B = x.dims[0];
  c.L = x.dims[1];
  c.E = x.dims[2];
  c.G = qkw.dims[0];
  c.K = qkw.dims[2];
  c.R = qkw.dims[3] / 2;
  c.M = qkw.dims[4];
  cf.tensor("dw1", {c.E, c.G, 4, c.K});
  cf.tensor("dd", {c.E, c.G, 4 * c.M});
  auto meta_size = [&](const char* key, index_t v) {
    if (cf.has_meta(key) && cf.meta_int(key) != v)
      cf.fail(std::string("meta ") + key + " " + cf.meta(key) + " disagrees with the tensors (" +
                  std::to_string(v) + ")",
              cf.meta_line(key));
  };
  meta_size("B", c.B);
  meta_size("T", c.L);
  meta_size("L", c.L);
  meta_size("E", c.E);
  meta_size("G", c.G);
  meta_size("K", c.K);
  meta_size("R", c.R);
  meta_size("N", c.G * c.M);
  c.spelled_g = c.G != 1;

  const std::string gelu = cf.meta_or("gelu", "erf");
  if (gelu == "erf")
    c.cfg.gelu = dcmha::Gelu::erf;
  else if (gelu == "tanh")
    c.cfg.gelu = dcmha::Gelu::tanh;
  else
    cf.fail("meta gelu '" + gelu + "': expected erf or tanh", cf.meta_line("gelu"));

  // The norm's epsilon is only given inside a descriptive line ("... eps=1e-6").
  const std::string norm = cf.meta_or("w1_norm", "");
  if (const size_t at = norm.find("eps="); at != std::string::npos) {
    try {
      c.cfg.eps = std::stod(norm.substr(at + 4));
    } catch (const std::exception&) {
      cf.fail("meta w1_norm: cannot read eps in '" + norm + "'", cf.meta_line("w1_norm"));
    }
  }
  if (cf.has_meta("eps")) c.cfg.eps = cf.meta_double("eps");
  auto expect = [&](const char* key, const std::string& value) {
    if (cf.has_meta(key) && cf.meta(key) != value)
      cf.fail(std::string("meta ") + key + " '" + cf.meta(key) + "' is not supported (expected '" +
                  value + "')",
              cf.meta_line(key));
  };
  expect("split_order", "pre_q,pre_k,post_q,post_k");
  expect("dd_activation", "tanh");
  expect("layout_dw1", "E,G,C=4,K");
  expect("layout_qkw", "G,C=4,K,2R,N");
  expect("layout_dd", "E,G,4N");
  return c;
}

/// File dims of a dynamic output or its upstream gradient.
std::vector<int64_t> output_dims(const ProjectionCase& c, const std::string& out) {
  const bool lowrank = out.find("dd") == std::string::npos;
  if (c.spelled_g)
    return lowrank ? std::vector<int64_t>{c.B, c.L, c.G, c.R, c.M}
                   : std::vector<int64_t>{c.B, c.L, c.G, c.M};
  return lowrank ? std::vector<int64_t>{c.B, c.L, c.R, c.M} : std::vector<int64_t>{c.B, c.L, c.M};
}

/// Owned dense buffers of the twelve dynamic tensors in our (B, L, G, R, M) / (B, L, G, M)
/// layouts, which share memory order with the files' (B, L, R, N) / (B, L, N) when G = 1.
template <class T>
struct DynBuffers {
  std::vector<T> buf[2][6];

  DynBuffers(const ProjectionCase& c, T fill) {
    for (auto& side : buf)
      for (int i = 0; i < 6; ++i) side[i].assign(c.B * c.L * c.G * (i < 4 ? c.R : 1) * c.M, fill);
  }
  dcmha::DynamicWeights<T> views(const ProjectionCase& c) {
    dcmha::DynamicWeights<T> w;
    for (int s = 0; s < 2; ++s) {
      dcmha::DynamicWeightsSide<T>& side = s == 0 ? w.pre : w.post;
      auto lr = [&](int i) { return dcmha::view<5>(buf[s][i].data(), {c.B, c.L, c.G, c.R, c.M}); };
      auto gate = [&](int i) { return dcmha::view<4>(buf[s][i].data(), {c.B, c.L, c.G, c.M}); };
      side.qw1 = lr(0);
      side.qw2 = lr(1);
      side.kw1 = lr(2);
      side.kw2 = lr(3);
      side.qdd = gate(4);
      side.kdd = gate(5);
    }
    return w;
  }
};

template <class T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}
template <class T>
std::vector<double> widen(const std::vector<T>& x) {
  return std::vector<double>(x.begin(), x.end());
}

template <class T>
void run_projection(const CaseFile& cf, const ProjectionCase& c, Report& r) {
  const T nan = std::numeric_limits<T>::quiet_NaN();
  std::vector<T> x = cast<T>(cf.tensor("x").values);
  std::vector<T> dw1 = cast<T>(cf.tensor("dw1").values);
  std::vector<T> qkw = cast<T>(cf.tensor("qkw").values);
  std::vector<T> dd = cast<T>(cf.tensor("dd").values);
  dcmha::DynamicWeightProjection<T> params;
  params.dw1 = dcmha::view<4>(static_cast<const T*>(dw1.data()), {c.E, c.G, 4, c.K});
  params.qkw = dcmha::view<5>(static_cast<const T*>(qkw.data()), {c.G, 4, c.K, 2 * c.R, c.M});
  params.dd = dcmha::view<3>(static_cast<const T*>(dd.data()), {c.E, c.G, 4 * c.M});
  const auto xv = dcmha::view<3>(static_cast<const T*>(x.data()), {c.B, c.L, c.E});

  DynBuffers<T> out(c, nan);
  try {
    dcmha::dynamic_weights_forward(c.cfg, xv, params, out.views(c));
  } catch (const std::exception& e) {
    r.exception<T>("dcmha::dynamic_weights_forward", e);
    return;
  }
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < 6; ++i) {
      const std::string name = std::string(kSides[s]) + "_" + kOutputs[i];
      if (cf.has(name)) r.compare<T>(name, cf.tensor(name).values, widen(out.buf[s][i]));
    }

  bool any_dout = false;
  for (const char* side : kSides)
    for (const char* o : kOutputs) any_dout |= cf.has(std::string("d") + side + "_" + o);
  if (!any_dout) return;
  // An upstream gradient the file leaves out is zero: that output does not enter the loss.
  DynBuffers<T> dout(c, T(0));
  for (int s = 0; s < 2; ++s)
    for (int i = 0; i < 6; ++i)
      if (const CaseTensor* t = cf.find(std::string("d") + kSides[s] + "_" + kOutputs[i]))
        dout.buf[s][i] = cast<T>(t->values);
  std::vector<T> dx(x.size(), nan), ddw1(dw1.size(), nan), dqkw(qkw.size(), nan),
      ddd(dd.size(), nan);
  dcmha::DynamicWeightProjectionGrads<T> grads;
  grads.dw1 = dcmha::view<4>(ddw1.data(), {c.E, c.G, 4, c.K});
  grads.qkw = dcmha::view<5>(dqkw.data(), {c.G, 4, c.K, 2 * c.R, c.M});
  grads.dd = dcmha::view<3>(ddd.data(), {c.E, c.G, 4 * c.M});
  try {
    dcmha::dynamic_weights_backward(c.cfg, xv, params, dcmha::read_only(dout.views(c)),
                                    dcmha::view<3>(dx.data(), {c.B, c.L, c.E}), grads);
  } catch (const std::exception& e) {
    r.exception<T>("dcmha::dynamic_weights_backward", e);
    return;
  }
  const std::pair<const char*, const std::vector<T>*> results[] = {
      {"grad_x", &dx}, {"grad_dw1", &ddw1}, {"grad_qkw", &dqkw}, {"grad_dd", &ddd}};
  for (const auto& [name, got] : results)
    if (cf.has(name)) r.compare<T>(name, cf.tensor(name).values, widen(*got));
}

void check_projection(const CaseFile& cf, Report& r, std::set<std::string>& used) {
  const ProjectionCase c = projection_case(cf);
  used.insert({"x", "dw1", "qkw", "dd", "grad_x", "grad_dw1", "grad_qkw", "grad_dd"});
  bool any_dout = false;
  for (const char* side : kSides)
    for (const char* o : kOutputs) {
      const std::string name = std::string(side) + "_" + o;
      if (cf.has(name)) cf.tensor(name, output_dims(c, name));
      if (cf.has("d" + name)) {
        cf.tensor("d" + name, output_dims(c, name));
        any_dout = true;
      }
      used.insert(name);
      used.insert("d" + name);
    }
  for (const char* g : {"grad_x", "grad_dw1", "grad_qkw", "grad_dd"})
    if (cf.has(g) && !any_dout) cf.fail(std::string(g) + " but no upstream gradient d<output>");
  if (cf.has("grad_x")) cf.tensor("grad_x", cf.tensor("x").dims);
  if (cf.has("grad_dw1")) cf.tensor("grad_dw1", cf.tensor("dw1").dims);
  if (cf.has("grad_qkw")) cf.tensor("grad_qkw", cf.tensor("qkw").dims);
  if (cf.has("grad_dd")) cf.tensor("grad_dd", cf.tensor("dd").dims);

  std::printf("  projection: B %lld L %lld E %lld G %lld K %lld R %lld M %lld, gelu %s, eps %g\n",
              (long long)c.B, (long long)c.L, (long long)c.E, (long long)c.G, (long long)c.K,
              (long long)c.R, (long long)c.M, c.cfg.gelu == dcmha::Gelu::erf ? "erf" : "tanh",
              c.cfg.eps);
  run_projection<double>(cf, c, r);
  run_projection<float>(cf, c, r);
}

// ---------------------------------------------------------------------------------------------

/// 0 on pass, 1 on failure.
int run_file(const std::string& path) {
  std::printf("%s\n", path.c_str());
  Report r;
  try {
    const CaseFile cf = dcmha::test::read_case_file(path);
    const std::string kind = cf.meta("kind");
    std::set<std::string> used;
    if (kind == "core")
      check_core(cf, r, used);
    else if (kind == "projection")
      check_projection(cf, r, used);
    else
      cf.fail("meta kind '" + kind + "': expected core or projection", cf.meta_line("kind"));
    // Not an error (a newer generator may add extras), but nothing may go unchecked unnoticed.
    for (const CaseTensor& t : cf.tensors)
      if (!used.count(t.name))
        std::printf("  note: tensor %s (line %d) is not used by this runner\n", t.name.c_str(),
                    t.line);
    if (r.checked == 0 && r.failed == 0) cf.fail("no expected tensor to compare against");
  } catch (const dcmha::test::CaseFileError& e) {
    std::printf("  MALFORMED: %s\n", e.what());
    ++r.failed;
  } catch (const std::exception& e) {
    std::printf("  FAIL: %s\n", e.what());
    ++r.failed;
  }
  std::printf("  => %s (%d tensors checked, %d failures)\n", r.failed ? "FAIL" : "PASS", r.checked,
              r.failed);
  return r.failed ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s FILE...\n"
                 "Runs dcmha's kernels on conformance case files (kind core or projection) in\n"
                 "float64 (tolerance 1e-9) and float32 (2e-4), errors relative to\n"
                 "max(1, max|expected|); exits non-zero if any case fails.\n",
                 argv[0]);
    return 2;
  }
  int failed = 0;
  for (int i = 1; i < argc; ++i) failed += run_file(argv[i]);
  std::printf("%d of %d case files passed\n", argc - 1 - failed, argc - 1);
  return failed ? 1 : 0;
}

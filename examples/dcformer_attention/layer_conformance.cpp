// dcformer_layer_conformance FILE...          check the layer against `kind layer` case files
// dcformer_layer_conformance --self-test      check its backward against finite differences
//
// Each case file (dcmha spec, section 4) gives the inputs and parameters of one DCFormer attention
// layer, its output y, an upstream gradient dy and the gradients of sum(y · dy) computed by the
// official code in float64. The layer runs in float64, float32, bf16 and fp16 (inputs rounded to
// each); the error of each tensor is max|ours - ref| / max(1, max|ref|), within the tolerances of
// kPrecisions, and the half-precision runs are also held against the float32 run. One line per
// precision and file; --verbose adds every tensor's error. Exit status 0 when everything passes,
// 1 on any failure or malformed file, 2 on bad usage.
#include "dcformer_layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "case_file.hpp"
#include "layer_self_test.hpp"

namespace {

using dcformer::conformance::CaseError;
using dcformer::conformance::CaseFile;
using dcformer::conformance::CaseTensor;
using dcmha::index_t;
using Dims = std::vector<std::int64_t>;

const char* const kParameters[] = {"wqkv", "wo", "dw1", "qkw", "dd", "q_norm", "k_norm"};

/// A parsed `kind layer` case: the layer's config and the expected dims of every tensor.
struct LayerCase {
  const CaseFile* file = nullptr;
  dcformer::LayerConfig cfg;
  index_t B = 0, T = 0;
  std::map<std::string, Dims> dims;  // every tensor the case may hold
};

double meta_scale(const CaseFile& cf, index_t D) {
  if (!cf.has_meta("scale")) return 0.0;
  const std::string s = cf.meta_string("scale");
  if (s == "1/sqrt(D)") return 0.0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (*end != '\0' || !(v > 0.0))
    cf.fail("meta scale: expected 1/sqrt(D) or a positive number, got '" + s + "'",
            cf.meta_line.at("scale"));
  return std::fabs(v - 1.0 / std::sqrt(double(D))) < 1e-15 ? 0.0 : v;
}

dcformer::LayerConfig meta_config(const CaseFile& cf) {
  dcformer::LayerConfig c;
  c.E = cf.meta_int("E");
  c.H = cf.meta_int("H");
  c.Hk = cf.meta_int("Hk", false, c.H);
  c.D = cf.meta_int("D");
  c.compose = cf.meta_int("compose", false, 1) != 0;
  c.G = cf.meta_int("G", false, 1);
  c.R = cf.meta_int("R", false, 2);
  c.K = cf.meta_int("K", c.compose);
  c.qk_norm = cf.meta_int("qk_norm", false, 0) != 0;
  c.window = cf.meta_int("window", false, 0);
  c.scale = meta_scale(cf, c.D);
  const std::string gelu = cf.has_meta("gelu") ? cf.meta_string("gelu") : "erf";
  if (gelu != "erf" && gelu != "tanh")
    cf.fail("meta gelu: expected erf or tanh, got '" + gelu + "'", cf.meta_line.at("gelu"));
  c.gelu = gelu == "erf" ? dcmha::Gelu::erf : dcmha::Gelu::tanh;
  if (cf.meta_int("causal", false, 1) != 1)
    cf.fail("meta causal: the layer is causal, expected 1", cf.meta_line.at("causal"));
  if (c.E <= 0 || c.H <= 0 || c.Hk <= 0 || c.D <= 0 || c.D % 2 || c.H % c.Hk ||
      (c.compose && (c.G <= 0 || c.H % c.G || c.R <= 0 || c.K <= 0)))
    cf.fail("meta: expected E, H, Hk, D > 0, D even, Hk | H and with compose G | H, R, K > 0");
  return c;
}

LayerCase layer_case(const CaseFile& cf) {
  if (cf.meta_string("kind") != "layer")
    cf.fail("meta kind: expected layer, got '" + cf.meta_string("kind") + "'",
            cf.meta_line.at("kind"));
  LayerCase lc;
  lc.file = &cf;
  lc.cfg = meta_config(cf);
  lc.B = cf.meta_int("B");
  lc.T = cf.meta_int("T");
  if (lc.B <= 0 || lc.T <= 0) cf.fail("meta B, T: expected > 0");
  const dcformer::LayerConfig& c = lc.cfg;
  const index_t M = c.compose ? c.H / c.G : 0;
  lc.dims = {{"x", {lc.B, lc.T, c.E}},      {"y", {lc.B, lc.T, c.E}},
             {"dy", {lc.B, lc.T, c.E}},     {"rope_cos", {lc.T, c.D / 2}},
             {"rope_sin", {lc.T, c.D / 2}}, {"wqkv", {c.qkv_width(), c.E}},
             {"wo", {c.E, c.H * c.D}}};
  if (c.compose) {
    lc.dims["dw1"] = {c.E, c.G, 4, c.K};
    lc.dims["qkw"] = {c.G, 4, c.K, 2 * c.R, M};
    lc.dims["dd"] = {c.E, c.G, 4 * M};
  }
  if (c.qk_norm) lc.dims["q_norm"] = lc.dims["k_norm"] = {c.D};
  lc.dims["grad_x"] = lc.dims["x"];
  for (const char* p : kParameters)
    if (lc.dims.count(p)) lc.dims[std::string("grad_") + p] = lc.dims[p];
  return lc;
}

/// The tensors the layer reads must be there; every tensor present must have its dims.
void check_case_tensors(const LayerCase& lc) {
  const CaseFile& cf = *lc.file;
  for (const auto& [name, dims] : lc.dims)
    if (cf.find(name) || name.rfind("grad_", 0) != 0) cf.tensor(name, dims);
  bool any_grad = false;
  for (const CaseTensor& t : cf.tensors) any_grad |= t.name.rfind("grad_", 0) == 0;
  if (!any_grad) cf.fail("no grad_* tensor to compare against");
}

/// y and the gradients, by name, widened to double.
using Outputs = std::map<std::string, std::vector<double>>;

struct Result {
  std::string worst = "-";
  double worst_error = 0.0;
  std::vector<std::pair<std::string, double>> errors;
};

double relative_error(const std::vector<double>& ref, const std::vector<double>& got) {
  double diff = 0.0, scale = 1.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double d = std::fabs(got[i] - ref[i]);
    diff = std::isnan(d) ? INFINITY : std::max(diff, d);
    scale = std::max(scale, std::fabs(ref[i]));
  }
  return diff / scale;
}

/// The case's tensors in precision T (rounded from float64 to Input, then to T), gradients zero.
template <class T, class Input = T>
struct Buffers {
  std::map<std::string, std::vector<T>> t;

  explicit Buffers(const LayerCase& lc) {
    for (const auto& [name, dims] : lc.dims) {
      const CaseTensor* ct = lc.file->find(name);
      if (ct && name.rfind("grad_", 0) != 0 && name != "y")
        for (double v : ct->values) t[name].push_back(static_cast<T>(static_cast<Input>(v)));
      else
        t[name].assign(static_cast<std::size_t>(count(dims)), T(0));
    }
  }
  static std::int64_t count(const Dims& d) {
    std::int64_t n = 1;
    for (std::int64_t x : d) n *= x;
    return n;
  }
  template <int N, class U = T>
  dcmha::TensorView<U, N> view(const LayerCase& lc, const std::string& name) {
    if (!lc.dims.count(name)) return {};
    dcmha::Shape<N> s{};
    std::copy(lc.dims.at(name).begin(), lc.dims.at(name).end(), s.begin());
    return dcmha::view<N>(static_cast<U*>(t.at(name).data()), s);
  }
};

template <class T, class Input>
dcformer::LayerWeights<T> case_weights(const LayerCase& lc, Buffers<T, Input>& b) {
  dcformer::LayerWeights<T> w;
  w.wqkv = b.template view<2, const T>(lc, "wqkv");
  w.wo = b.template view<2, const T>(lc, "wo");
  w.dw1 = b.template view<4, const T>(lc, "dw1");
  w.qkw = b.template view<5, const T>(lc, "qkw");
  w.dd = b.template view<3, const T>(lc, "dd");
  w.q_norm = b.template view<1, const T>(lc, "q_norm");
  w.k_norm = b.template view<1, const T>(lc, "k_norm");
  return w;
}

template <class T, class Input>
dcformer::LayerGrads<T> case_grads(const LayerCase& lc, Buffers<T, Input>& b) {
  dcformer::LayerGrads<T> g;
  g.wqkv = b.template view<2>(lc, "grad_wqkv");
  g.wo = b.template view<2>(lc, "grad_wo");
  g.dw1 = b.template view<4>(lc, "grad_dw1");
  g.qkw = b.template view<5>(lc, "grad_qkw");
  g.dd = b.template view<3>(lc, "grad_dd");
  g.q_norm = b.template view<1>(lc, "grad_q_norm");
  g.k_norm = b.template view<1>(lc, "grad_k_norm");
  return g;
}

/// Runs the layer forward and backward in precision T on inputs rounded to Input.
template <class T, class Input = T>
Outputs run_layer(const LayerCase& lc) {
  Buffers<T, Input> b(lc);
  const dcformer::Rope<T> rope{b.template view<2, const T>(lc, "rope_cos"),
                               b.template view<2, const T>(lc, "rope_sin")};
  const dcformer::LayerWeights<T> w = case_weights(lc, b);
  const auto x = b.template view<3, const T>(lc, "x");
  dcformer::LayerCache<T> cache;
  dcformer::forward(lc.cfg, x, rope, w, b.template view<3>(lc, "y"), cache);
  dcformer::backward(lc.cfg, x, rope, w, cache, b.template view<3, const T>(lc, "dy"),
                     b.template view<3>(lc, "grad_x"), case_grads(lc, b));
  Outputs out;
  for (const auto& [name, buf] : b.t)
    if (lc.file->find(name) && (name == "y" || name.rfind("grad_", 0) == 0))
      for (const T& v : buf) out[name].push_back(static_cast<double>(v));
  return out;
}

/// The case's own y and gradients.
Outputs case_outputs(const LayerCase& lc) {
  Outputs out;
  for (const CaseTensor& t : lc.file->tensors)
    if (t.name == "y" || t.name.rfind("grad_", 0) == 0) out[t.name] = t.values;
  return out;
}

/// Each tensor's error of `got` against `want`, and the worst.
Result compare(const Outputs& want, const Outputs& got) {
  Result r;
  for (const auto& [name, values] : want) {
    const double e = relative_error(values, got.at(name));
    r.errors.push_back({name, e});
    if (!(e <= r.worst_error)) r.worst = name, r.worst_error = e;
  }
  return r;
}

/// A precision the layer runs in, its tolerance against the case and, for bf16 and fp16, the
/// float32 layer on the same rounded inputs with the tolerance against it.
struct Precision {
  const char* name;
  double tolerance;
  Outputs (*run)(const LayerCase&);
  Outputs (*float_run)(const LayerCase&);
  double tolerance_against_float;
};

/// bf16 and fp16: every tensor stored in the type, float arithmetic, each result rounded once
/// (dcformer_layer.hpp). Against the case their error is mostly the inputs' rounding (the float32
/// layer on the same rounded inputs errs about as much); against that float32 run it is what the
/// layer's own roundings add. Tolerances are 2-4x the errors measured on the cases.
const Precision kPrecisions[] = {
    {"float64", 1e-9, run_layer<double>, nullptr, 0.0},
    {"float32", 2e-4, run_layer<float>, nullptr, 0.0},
    {"bf16", 1e-1, run_layer<dcmha::bf16>, run_layer<float, dcmha::bf16>, 5e-2},
    {"fp16", 2e-2, run_layer<dcmha::half>, run_layer<float, dcmha::half>, 1e-2},
};

struct Options {
  bool verbose = false, self_test = false;
  std::vector<std::string> files;
};

/// Runs one precision on a case; prints its line. Returns true when it passes.
bool run_precision(const std::string& path, const LayerCase& lc, const Precision& p,
                   const Options& opt) {
  const Outputs got = p.run(lc);
  const Result r = compare(case_outputs(lc), got);
  bool ok = r.worst_error <= p.tolerance;
  std::string against_float;
  Result f;
  if (p.float_run) {
    f = compare(p.float_run(lc), got);
    ok = ok && f.worst_error <= p.tolerance_against_float;
    char line[160];
    std::snprintf(line, sizeof line,
                  "; against float32 on the same inputs: worst %s %.3g (tol %.0e)", f.worst.c_str(),
                  f.worst_error, p.tolerance_against_float);
    against_float = line;
  }
  std::printf("%s %s: %s worst %s %.3g (tol %.0e)%s\n", ok ? "PASS" : "FAIL", path.c_str(), p.name,
              r.worst.c_str(), r.worst_error, p.tolerance, against_float.c_str());
  for (std::size_t i = 0; opt.verbose && i < r.errors.size(); ++i) {
    std::printf("  %-14s %.3g", r.errors[i].first.c_str(), r.errors[i].second);
    if (!f.errors.empty())
      std::printf("  against float32 on the same inputs %.3g", f.errors[i].second);
    std::printf("\n");
  }
  return ok;
}

/// Runs one file in every precision. Returns true when all pass.
bool run_file(const std::string& path, const Options& opt) {
  try {
    const CaseFile cf = dcformer::conformance::read_case_file(path);
    const LayerCase lc = layer_case(cf);
    check_case_tensors(lc);
    std::string unused;
    for (const CaseTensor& t : cf.tensors)
      if (!lc.dims.count(t.name)) unused += (unused.empty() ? "" : ",") + t.name;
    if (!unused.empty()) std::printf("%s: unused tensors: %s\n", path.c_str(), unused.c_str());
    bool ok = true;
    for (const Precision& p : kPrecisions) ok = run_precision(path, lc, p, opt) && ok;
    return ok;
  } catch (const CaseError& e) {
    std::printf("FAIL %s: malformed case: %s\n", path.c_str(), e.what());
  } catch (const std::exception& e) {
    std::printf("FAIL %s: the layer threw: %s\n", path.c_str(), e.what());
  }
  return false;
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--verbose] FILE...\n"
               "       %s --self-test\n"
               "Checks the DCFormer attention layer against `kind layer` conformance files\n"
               "(float64 within 1e-9, float32 2e-4, bf16 1e-1, fp16 2e-2, relative to\n"
               "max(1, max|ref|)), or\n"
               "its backward against central finite differences (--self-test).\n",
               argv0, argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--verbose" || a == "-v")
      opt.verbose = true;
    else if (a == "--self-test")
      opt.self_test = true;
    else if (a.rfind("--", 0) == 0)
      return usage(argv[0]);
    else
      opt.files.push_back(a);
  }
  if (opt.self_test == !opt.files.empty()) return usage(argv[0]);
  if (opt.self_test) return dcformer::self_test::run() ? 0 : 1;
  int passed = 0;
  for (const std::string& f : opt.files) passed += run_file(f, opt);
  std::printf("%d of %zu case files passed\n", passed, opt.files.size());
  return passed == static_cast<int>(opt.files.size()) ? 0 : 1;
}

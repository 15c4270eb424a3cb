// Checks of the test reference itself (tests/reference/reference.hpp), so that every other test
// can trust it: its backward against central finite differences of its forward, its forward and
// backward against the official conformance cases, and the support code the other tests share.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "reference/reference.hpp"
#include "support/case_file.hpp"
#include "support/problem.hpp"

namespace {

using dcmha::reference::Gradients;
using dcmha::reference::Problem;
using dcmha::test::ProblemSpec;
using dcmha::test::SideSpec;

double loss(const Problem& p, const std::vector<double>& dout) {
  const std::vector<double> out = dcmha::reference::forward(p);
  double l = 0;
  for (size_t i = 0; i < out.size(); ++i) l += out[i] * dout[i];
  return l;
}

/// Every input of p with the name its gradient has in named_gradients() minus "grad_".
std::vector<std::pair<std::string, std::vector<double>*>> named_inputs(Problem& p) {
  std::vector<std::pair<std::string, std::vector<double>*>> out = {
      {"q", &p.q}, {"k", &p.k}, {"v", &p.v}};
  for (auto [side, c] :
       {std::pair<std::string, dcmha::reference::ComposeSide*>{"pre", &p.pre}, {"post", &p.post}}) {
    if (c->static_w) out.emplace_back(side + "_w", &c->w);
    if (c->query_wise) {
      out.emplace_back(side + "_qw1", &c->qw1);
      out.emplace_back(side + "_qw2", &c->qw2);
      out.emplace_back(side + "_qdd", &c->qdd);
    }
    if (c->key_wise) {
      out.emplace_back(side + "_kw1", &c->kw1);
      out.emplace_back(side + "_kw2", &c->kw2);
      out.emplace_back(side + "_kdd", &c->kdd);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Finite differences
// ---------------------------------------------------------------------------------------------

struct FdCase {
  std::string name;
  ProblemSpec spec;
};

// Without it gtest prints a failing case as a hex dump.
void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name << " (" << c.spec.str() << ")"; }

ProblemSpec make(int64_t B, int64_t H, int64_t Hk, int64_t T, int64_t S, int64_t D, int64_t Dv,
                 int64_t G, int64_t Rq, int64_t Rk, bool causal, int64_t window, SideSpec pre,
                 SideSpec post) {
  ProblemSpec s;
  s.B = B;
  s.H = H;
  s.Hk = Hk;
  s.T = T;
  s.S = S;
  s.D = D;
  s.Dv = Dv;
  s.G = G;
  s.Rq = Rq;
  s.Rk = Rk;
  s.causal = causal;
  s.window = window;
  s.pre = pre;
  s.post = post;
  return s;
}

const SideSpec kAll = SideSpec::all();
const SideSpec kNone = SideSpec::none();
const SideSpec kQueryOnly{false, true, false};
const SideSpec kKeyOnly{false, false, true};
const SideSpec kStaticOnly{true, false, false};
const SideSpec kDynamic = SideSpec::dynamic();

std::vector<FdCase> fd_cases() {
  //                       B  H  Hk T  S  D  Dv G  Rq Rk causal win  pre  post
  return {
      {"full_all", make(2, 4, 4, 5, 5, 3, 3, 1, 2, 2, false, 0, kAll, kAll)},
      {"causal_TltS_gqa_dv", make(1, 4, 2, 4, 7, 3, 5, 1, 1, 3, true, 0, kAll, kAll)},
      {"causal_G2_pre_only", make(1, 4, 4, 5, 5, 2, 2, 2, 3, 1, true, 0, kAll, kNone)},
      {"full_TgtS_post_only", make(1, 4, 1, 6, 3, 2, 3, 1, 2, 2, false, 0, kNone, kDynamic)},
      {"query_wise_only", make(1, 4, 4, 4, 6, 3, 2, 2, 2, 1, true, 0, kQueryOnly, kQueryOnly)},
      {"key_wise_only", make(1, 4, 2, 5, 4, 2, 3, 1, 1, 3, false, 0, kKeyOnly, kKeyOnly)},
      {"static_only_G2_gqa", make(1, 6, 3, 4, 5, 2, 2, 2, 1, 1, true, 0, kStaticOnly, kStaticOnly)},
      {"causal_window", make(1, 4, 4, 7, 7, 2, 2, 1, 2, 2, true, 3, kAll, kAll)},
      {"window_no_causal_TgtS", make(1, 4, 2, 6, 4, 2, 2, 1, 2, 1, false, 2, kAll, kDynamic)},
      {"causal_TgtS_masked_rows", make(1, 4, 4, 6, 3, 2, 2, 2, 2, 2, true, 0, kAll, kAll)},
      {"mha_no_compose", make(2, 2, 1, 4, 5, 3, 2, 1, 1, 1, true, 0, kNone, kNone)},
      {"mixed_pre_static_post_query",
       make(1, 4, 4, 5, 6, 2, 2, 1, 2, 2, false, 0, kStaticOnly, kQueryOnly)},
      {"one_head_per_group", make(1, 2, 1, 4, 4, 2, 2, 2, 2, 2, true, 0, kAll, kAll)},
  };
}

class ReferenceFiniteDifferences : public ::testing::TestWithParam<FdCase> {};

TEST_P(ReferenceFiniteDifferences, BackwardMatchesCentralDifferencesForEveryInput) {
  const ProblemSpec& spec = GetParam().spec;
  SCOPED_TRACE(spec.str());
  Problem p = dcmha::test::random_problem(spec, 1234);
  const std::vector<double> dout = dcmha::test::random_dout(p, 99);
  const Gradients g = dcmha::reference::backward(p, dout);
  const auto grads = dcmha::test::named_gradients(g);
  auto inputs = named_inputs(p);
  ASSERT_EQ(grads.size(), inputs.size());

  // Step and tolerance: O(1) inputs, so truncation ~h^2 and rounding ~1e-16/h are both ~1e-10.
  const double h = 1e-5;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& [name, x] = inputs[i];
    ASSERT_EQ(grads[i].first, "grad_" + name);
    const std::vector<double>& analytic = *grads[i].second;
    ASSERT_EQ(analytic.size(), x->size()) << name;
    std::vector<double> fd(x->size());
    for (size_t j = 0; j < x->size(); ++j) {
      const double x0 = (*x)[j];
      (*x)[j] = x0 + h;
      const double lp = loss(p, dout);
      (*x)[j] = x0 - h;
      const double lm = loss(p, dout);
      (*x)[j] = x0;
      fd[j] = (lp - lm) / (2 * h);
    }
    const double err = dcmha::test::max_rel_error(fd, analytic);
    EXPECT_LT(err, 1e-6) << "d/d" << name;
    // A gradient that is zero everywhere would make the comparison above vacuous.
    double mx = 0;
    for (double a : analytic) mx = std::max(mx, std::abs(a));
    EXPECT_GT(mx, 1e-3) << "d/d" << name << " is (nearly) zero: the check above proves nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, ReferenceFiniteDifferences, ::testing::ValuesIn(fd_cases()),
                         [](const auto& info) { return info.param.name; });

// ---------------------------------------------------------------------------------------------
// Masked rows
// ---------------------------------------------------------------------------------------------

bool all_finite(const std::vector<double>& x) {
  return std::all_of(x.begin(), x.end(), [](double v) { return std::isfinite(v); });
}

TEST(ReferenceMasking, RowsThatSeeNoKeyGiveZerosNotNaN) {
  // Causal with T > S: query t sees s <= t - 3, so t = 0, 1, 2 see nothing.
  for (int64_t window : {0, 2}) {
    ProblemSpec spec = make(2, 4, 2, 6, 3, 3, 2, 2, 2, 1, true, window, kAll, kAll);
    SCOPED_TRACE(spec.str());
    const Problem p = dcmha::test::random_problem(spec, 7);
    const int64_t M = p.H / p.G;
    const std::vector<double> out = dcmha::reference::forward(p);
    const Gradients g = dcmha::reference::backward(p, dcmha::test::random_dout(p, 8));
    ASSERT_TRUE(all_finite(out));
    for (const auto& [name, x] : dcmha::test::named_gradients(g))
      ASSERT_TRUE(all_finite(*x)) << name;

    const int64_t blind = p.T - p.S;  // rows 0 .. blind-1 see no key
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t t = 0; t < p.T; ++t) {
        double row_out = 0, row_dq = 0, row_q_terms = 0;
        for (int64_t h = 0; h < p.H; ++h) {
          for (int64_t e = 0; e < p.Dv; ++e)
            row_out += std::abs(out[((b * p.H + h) * p.T + t) * p.Dv + e]);
          for (int64_t d = 0; d < p.D; ++d)
            row_dq += std::abs(g.dq[((b * p.H + h) * p.T + t) * p.D + d]);
        }
        for (const dcmha::reference::ComposeSide* c : {&g.dpre, &g.dpost}) {
          for (int64_t i = 0; i < p.G * c->Rq * M; ++i) {
            row_q_terms += std::abs(c->qw1[(b * p.T + t) * p.G * c->Rq * M + i]);
            row_q_terms += std::abs(c->qw2[(b * p.T + t) * p.G * c->Rq * M + i]);
          }
          for (int64_t i = 0; i < p.G * M; ++i)
            row_q_terms += std::abs(c->qdd[(b * p.T + t) * p.G * M + i]);
        }
        if (t < blind) {
          EXPECT_EQ(row_out, 0.0) << "b " << b << " t " << t;
          EXPECT_EQ(row_dq, 0.0) << "b " << b << " t " << t;
          EXPECT_EQ(row_q_terms, 0.0) << "b " << b << " t " << t;
        } else {
          EXPECT_GT(row_out, 0.0) << "b " << b << " t " << t;
          // A row with a single visible key has softmax 1 whatever its score: dq is rightly 0.
          if (t > blind) {
            EXPECT_GT(row_dq, 0.0) << "b " << b << " t " << t;
          }
        }
      }
  }
}

TEST(ReferenceMasking, WindowCountsTheQueryItself) {
  // Window 1 with causal and S = T: each query sees only its own key, so P' = Compose_post(I)
  // and without post compose the output is exactly v at the same position.
  ProblemSpec spec = make(1, 2, 2, 4, 4, 2, 3, 1, 1, 1, true, 1, kAll, kNone);
  const Problem p = dcmha::test::random_problem(spec, 3);
  const std::vector<double> out = dcmha::reference::forward(p);
  EXPECT_LT(dcmha::test::max_rel_error(p.v, out), 1e-15);
}

TEST(ReferenceMasking, VisibleKeysPerRow) {
  // Spelled out by hand from spec section 1, so the rule itself is checked, not just its use.
  Problem p;
  p.T = 6;
  p.S = 6;
  p.causal = true;
  p.window = 3;
  const std::vector<std::vector<int>> causal_w3 = {{0},       {0, 1},    {0, 1, 2},
                                                   {1, 2, 3}, {2, 3, 4}, {3, 4, 5}};
  Problem q;
  q.T = 3;
  q.S = 5;
  q.causal = false;
  q.window = 2;  // last = t + 2; keys after it stay visible
  const std::vector<std::vector<int>> full_w2 = {{1, 2, 3, 4}, {2, 3, 4}, {3, 4}};
  Problem r;
  r.T = 4;
  r.S = 2;
  r.causal = true;  // last = t - 2
  const std::vector<std::vector<int>> causal_TgtS = {{}, {}, {0}, {0, 1}};
  for (const auto& [prob, want] :
       {std::pair{&p, causal_w3}, std::pair{&q, full_w2}, std::pair{&r, causal_TgtS}})
    for (int64_t t = 0; t < prob->T; ++t) {
      std::vector<int> got;
      for (int s = 0; s < prob->S; ++s)
        if (dcmha::reference::detail::visible(*prob, 0, t, s)) got.push_back(s);
      EXPECT_EQ(got, want[t]) << "T " << prob->T << " S " << prob->S << " t " << t;
    }
}

// Finite differences cannot see which kv head a query head reads, and the conformance cases
// have Hk = H: pin the GQA convention (head h reads kv head h / (H / Hk)) against MHA with the
// kv heads repeated, whose dk/dv summed over each group of repeats must equal GQA's.
TEST(ReferenceGqa, EqualsMhaWithRepeatedKvHeads) {
  ProblemSpec spec = make(2, 6, 2, 4, 5, 3, 2, 2, 2, 1, true, 0, kAll, kDynamic);
  const Problem gqa = dcmha::test::random_problem(spec, 11);
  Problem mha = gqa;
  mha.Hk = gqa.H;
  const int64_t rep = gqa.H / gqa.Hk;
  mha.k.clear();
  mha.v.clear();
  for (int64_t b = 0; b < gqa.B; ++b)
    for (int64_t h = 0; h < gqa.H; ++h) {
      const int64_t j = h / rep;
      auto k0 = gqa.k.begin() + (b * gqa.Hk + j) * gqa.S * gqa.D;
      auto v0 = gqa.v.begin() + (b * gqa.Hk + j) * gqa.S * gqa.Dv;
      mha.k.insert(mha.k.end(), k0, k0 + gqa.S * gqa.D);
      mha.v.insert(mha.v.end(), v0, v0 + gqa.S * gqa.Dv);
    }
  EXPECT_LT(
      dcmha::test::max_rel_error(dcmha::reference::forward(mha), dcmha::reference::forward(gqa)),
      1e-14);

  const std::vector<double> dout = dcmha::test::random_dout(gqa, 12);
  const Gradients gg = dcmha::reference::backward(gqa, dout);
  const Gradients gm = dcmha::reference::backward(mha, dout);
  std::vector<double> dk(gqa.k.size(), 0.0), dv(gqa.v.size(), 0.0);
  for (int64_t b = 0; b < gqa.B; ++b)
    for (int64_t h = 0; h < gqa.H; ++h) {
      const int64_t j = h / rep;
      for (int64_t i = 0; i < gqa.S * gqa.D; ++i)
        dk[(b * gqa.Hk + j) * gqa.S * gqa.D + i] += gm.dk[(b * gqa.H + h) * gqa.S * gqa.D + i];
      for (int64_t i = 0; i < gqa.S * gqa.Dv; ++i)
        dv[(b * gqa.Hk + j) * gqa.S * gqa.Dv + i] += gm.dv[(b * gqa.H + h) * gqa.S * gqa.Dv + i];
    }
  EXPECT_LT(dcmha::test::max_rel_error(gm.dq, gg.dq), 1e-13);
  EXPECT_LT(dcmha::test::max_rel_error(dk, gg.dk), 1e-13);
  EXPECT_LT(dcmha::test::max_rel_error(dv, gg.dv), 1e-13);
  EXPECT_LT(dcmha::test::max_rel_error(gm.dpre.kw1, gg.dpre.kw1), 1e-13);
}

// ---------------------------------------------------------------------------------------------
// Conformance cases (kind core) computed by the official implementation
// ---------------------------------------------------------------------------------------------

std::vector<std::string> core_case_files() {
  std::vector<std::string> files;
  namespace fs = std::filesystem;
  if (!fs::is_directory(DCMHA_CONFORMANCE_DIR)) return files;
  for (const auto& e : fs::directory_iterator(DCMHA_CONFORMANCE_DIR)) {
    if (e.path().extension() != ".txt") continue;
    // Peek at the kind only; a malformed file must fail in the test, not here.
    try {
      if (dcmha::test::read_case_file(e.path().string()).meta_or("kind", "") != "core") continue;
    } catch (const std::exception&) {
    }
    files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string stem_name(const std::string& path) {
  std::string s = std::filesystem::path(path).stem().string();
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

TEST(ReferenceConformance, DirectoryHasCoreCases) {
  EXPECT_GE(core_case_files().size(), 1u) << "no kind core case in " << DCMHA_CONFORMANCE_DIR;
}

class ReferenceConformance : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceConformance, MatchesOfficialOutputAndGradients) {
  const dcmha::test::CaseFile cf = dcmha::test::read_case_file(GetParam());
  const Problem p = dcmha::test::problem_from_case(cf);
  const double tol = 1e-9;

  const std::vector<double> out = dcmha::reference::forward(p);
  EXPECT_LT(dcmha::test::max_rel_error(cf.tensor("out").values, out), tol) << "out";

  ASSERT_TRUE(cf.has("dout"));
  const Gradients got = dcmha::reference::backward(p, cf.tensor("dout").values);
  const Gradients expected = dcmha::test::gradients_from_case(cf, p);
  // Every gradient must be in the file here: an empty expected tensor compares as +inf.
  for (const dcmha::test::TensorError& e : dcmha::test::gradient_errors(expected, got))
    EXPECT_LT(e.rel, tol) << e.name << " (abs " << e.abs << ")";
}

INSTANTIATE_TEST_SUITE_P(Files, ReferenceConformance, ::testing::ValuesIn(core_case_files()),
                         [](const auto& info) { return stem_name(info.param); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(ReferenceConformance);

// The measurement behind kCaseStaticWIncludesIdentity (see support/case_file.hpp): of the two
// readings of the files' static W, exactly one reproduces the official output.
TEST(ReferenceConformance, StaticWInFilesExcludesIdentity) {
  int static_cases = 0;
  for (const std::string& path : core_case_files()) {
    const dcmha::test::CaseFile cf = dcmha::test::read_case_file(path);
    if (!cf.has("pre_w") && !cf.has("post_w")) continue;
    ++static_cases;
    SCOPED_TRACE(path);
    const std::vector<double>& expected = cf.tensor("out").values;
    const double verbatim = dcmha::test::max_rel_error(
        expected, dcmha::reference::forward(dcmha::test::problem_from_case(cf, false)));
    const double minus_identity = dcmha::test::max_rel_error(
        expected, dcmha::reference::forward(dcmha::test::problem_from_case(cf, true)));
    EXPECT_LT(verbatim, 1e-9);
    EXPECT_GT(minus_identity, 1e-2);
    EXPECT_FALSE(dcmha::test::kCaseStaticWIncludesIdentity);
  }
  EXPECT_GE(static_cases, 1) << "no case with a static W to measure on";
}

// ---------------------------------------------------------------------------------------------
// Support code
// ---------------------------------------------------------------------------------------------

dcmha::test::CaseFile parse(const std::string& text) {
  std::istringstream in(text);
  return dcmha::test::parse_case_file(in, "inline.txt");
}

/// The parser's message for text, or "" if it parsed.
std::string parse_error(const std::string& text) {
  try {
    parse(text);
  } catch (const dcmha::test::CaseFileError& e) {
    return e.what();
  }
  return "";
}

TEST(CaseFile, ParsesMetaTensorsAndComments) {
  const dcmha::test::CaseFile cf = parse(
      "# header\n"
      "meta kind core\n"
      "meta causal_rule query t sees key s iff s <= t + (S - T)\n"
      "\n"
      "tensor a 2 3\n"
      "1 2.5 -3e-2\n"
      "  # a comment between value lines\n"
      "+4 5 6\r\n"
      "tensor b 1\n"
      "-0.125\n");
  EXPECT_EQ(cf.meta("kind"), "core");
  EXPECT_EQ(cf.meta("causal_rule"), "query t sees key s iff s <= t + (S - T)");
  ASSERT_TRUE(cf.has("a"));
  EXPECT_EQ(cf.tensor("a").dims, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(cf.tensor("a").values, (std::vector<double>{1, 2.5, -3e-2, 4, 5, 6}));
  EXPECT_EQ(cf.tensor("b").values, (std::vector<double>{-0.125}));
  EXPECT_EQ(cf.tensor("b").line, 9);
}

TEST(CaseFile, ErrorsNameFileAndLine) {
  EXPECT_NE(parse_error("tensor a 2\n1\nmeta x 1\n").find("inline.txt:3:"), std::string::npos);
  EXPECT_NE(parse_error("tensor a 2\n1\n").find("expected 2 values, got 1"), std::string::npos);
  EXPECT_NE(parse_error("tensor a 2\n1 2 3\n").find("inline.txt:2:"), std::string::npos);
  EXPECT_NE(parse_error("tensor a 2\n1 x\n").find("'x' is not a number"), std::string::npos);
  EXPECT_NE(parse_error("tensor a 1\nnan\n").find("non-finite"), std::string::npos);
  EXPECT_NE(parse_error("tensor a 0\n").find("positive integer"), std::string::npos);
  EXPECT_NE(parse_error("tensor a 1\n1\ntensor a 1\n2\n").find("duplicate tensor a"),
            std::string::npos);
  EXPECT_NE(parse_error("meta k 1\nmeta k 2\n").find("inline.txt:2: duplicate meta k"),
            std::string::npos);
  EXPECT_NE(parse_error("meta k\n").find("meta KEY VALUE"), std::string::npos);
  EXPECT_NE(parse_error("1 2 3\n").find("values outside of a tensor"), std::string::npos);
  EXPECT_NE(parse_error("tensr a 1\n").find("unknown line"), std::string::npos);
  EXPECT_NE(parse_error("").find("not a case file"), std::string::npos);
  EXPECT_THROW(dcmha::test::read_case_file("/nonexistent/case.txt"), dcmha::test::CaseFileError);
}

TEST(CaseFile, CoreCaseConsistencyIsChecked) {
  const std::string qkv = "tensor q 1 2 1 1\n1 2\ntensor k 1 2 1 1\n1 2\ntensor v 1 2 1 1\n1 2\n";
  EXPECT_NO_THROW(dcmha::test::problem_from_case(parse("meta kind core\n" + qkv)));
  auto err = [&](const std::string& text) {
    try {
      dcmha::test::problem_from_case(parse(text));
    } catch (const dcmha::test::CaseFileError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err("meta kind projection\n" + qkv).find("kind core"), std::string::npos);
  EXPECT_NE(err("meta kind core\nmeta N 3\n" + qkv).find("meta N 3 disagrees"), std::string::npos);
  EXPECT_NE(err("meta kind core\nmeta pre 1\n" + qkv).find("meta pre 1"), std::string::npos);
  EXPECT_NE(err("meta kind core\n" + qkv + "tensor pre_qw1 1 1 1 2\n1 2\n").find("together"),
            std::string::npos);
  EXPECT_NE(err("meta kind core\nmeta causal_rule s <= t\n" + qkv).find("causal_rule"),
            std::string::npos);
}

TEST(TypedProblem, ViewsHoldTheProblemInBothLayouts) {
  ProblemSpec spec = make(2, 4, 2, 3, 5, 3, 2, 2, 2, 1, true, 0, kAll, kDynamic);
  const Problem p = dcmha::test::random_problem(spec, 5);
  for (auto layout : {dcmha::test::Layout::bhtd, dcmha::test::Layout::bthd}) {
    dcmha::test::TypedProblem<double> tp(p, layout);
    EXPECT_EQ(dcmha::test::to_canonical(tp.q()), p.q);
    EXPECT_EQ(dcmha::test::to_canonical(tp.k()), p.k);
    EXPECT_EQ(dcmha::test::to_canonical(tp.v()), p.v);
    const auto c = tp.compose();
    EXPECT_TRUE(c.pre.static_w && c.pre.query_wise && c.pre.key_wise);
    EXPECT_TRUE(!c.post.static_w && c.post.query_wise && c.post.key_wise);
    EXPECT_TRUE(c.post.w.empty());
    EXPECT_EQ(dcmha::test::to_canonical(c.pre.w), p.pre.w);
    EXPECT_EQ(dcmha::test::to_canonical(c.post.kw2), p.post.kw2);
    EXPECT_EQ(c.pre.qw1.shape, (dcmha::Shape<5>{2, 3, 2, 2, 2}));
    EXPECT_EQ(c.pre.kdd.shape, (dcmha::Shape<4>{2, 5, 2, 2}));
    EXPECT_TRUE(tp.dcompose().post.w.empty());
    EXPECT_EQ(tp.config().mask, dcmha::Mask::causal);
    if (layout == dcmha::test::Layout::bthd) {
      EXPECT_EQ(tp.q().stride[1], 3);
    }
    // Outputs start poisoned, so an untouched output always fails a comparison.
    EXPECT_EQ(dcmha::test::max_rel_error(p.q, tp.gradients().dq),
              std::numeric_limits<double>::infinity());
  }
  // float storage keeps float accumulators for lse
  dcmha::test::TypedProblem<float> tf(p, dcmha::test::Layout::bthd);
  static_assert(std::is_same_v<decltype(tf.lse().data), float*>);
  EXPECT_LT(dcmha::test::max_rel_error(p.v, dcmha::test::to_canonical(tf.v())), 1e-7);
}

}  // namespace

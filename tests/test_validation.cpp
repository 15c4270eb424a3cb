// Argument validation of dcmha::forward / dcmha::backward.
//
// "Rejected" tests go through the public entry points: validation runs before the kernels, so
// they hold whatever the kernels do, and they check that the message names the argument and the
// expected value. "Accepted" tests call detail::validate_forward / validate_backward directly
// and check the dims the kernels will receive.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <list>
#include <string>
#include <vector>

#include "dcmha/attention.hpp"

namespace {

using dcmha::index_t;
using dcmha::Shape;
using dcmha::TensorView;

/// Every argument of one forward/backward call in its own allocation, so that nothing aliases
/// unless a test makes it. Sizes are small and pairwise distinct where possible so that a
/// message quoting the wrong dim is caught.
template <class T>
struct Problem {
  using A = dcmha::acc_t<T>;

  index_t B = 2, H = 4, Hk = 2, T_ = 3, S = 5, D = 8, Dv = 6;
  index_t G = 2, M = 2, Rq = 2, Rk = 3;  // compose, when switched on

  dcmha::AttentionConfig cfg;
  TensorView<T, 4> q, k, v, out, dout, dq, dk, dv;
  TensorView<A, 3> lse;
  dcmha::ComposeWeights<T> cw;
  dcmha::ComposeGrads<T> cg;

  Problem() {
    q = alloc<4>({B, H, T_, D});
    k = alloc<4>({B, Hk, S, D});
    v = alloc<4>({B, Hk, S, Dv});
    out = alloc<4>({B, H, T_, Dv});
    dout = alloc<4>({B, H, T_, Dv});
    dq = alloc<4>({B, H, T_, D});
    dk = alloc<4>({B, Hk, S, D});
    dv = alloc<4>({B, Hk, S, Dv});
    as_.emplace_back(static_cast<std::size_t>(B * H * T_), A(0));
    lse = dcmha::view<3>(as_.back().data(), {B, H, T_});
  }

  template <int N>
  TensorView<T, N> alloc(const Shape<N>& shape) {
    index_t n = 1;
    for (index_t s : shape) n *= s;
    ts_.emplace_back(static_cast<std::size_t>(n), T(0));
    return dcmha::view<N>(ts_.back().data(), shape);
  }

  /// Switches one side's terms and gives exactly the tensors (and gradients) they need.
  void set_side(bool post, bool static_w, bool query_wise, bool key_wise) {
    dcmha::ComposeTerms<T>& c = post ? cw.post : cw.pre;
    dcmha::ComposeTermGrads<T>& g = post ? cg.post : cg.pre;
    c = {};
    g = {};
    c.static_w = static_w;
    c.query_wise = query_wise;
    c.key_wise = key_wise;
    if (static_w) {
      c.w = alloc<3>({G, M, M});
      g.w = alloc<3>({G, M, M});
    }
    if (query_wise) {
      c.qw1 = alloc<5>({B, T_, G, Rq, M});
      c.qw2 = alloc<5>({B, T_, G, Rq, M});
      c.qdd = alloc<4>({B, T_, G, M});
      g.qw1 = alloc<5>({B, T_, G, Rq, M});
      g.qw2 = alloc<5>({B, T_, G, Rq, M});
      g.qdd = alloc<4>({B, T_, G, M});
    }
    if (key_wise) {
      c.kw1 = alloc<5>({B, S, G, Rk, M});
      c.kw2 = alloc<5>({B, S, G, Rk, M});
      c.kdd = alloc<4>({B, S, G, M});
      g.kw1 = alloc<5>({B, S, G, Rk, M});
      g.kw2 = alloc<5>({B, S, G, Rk, M});
      g.kdd = alloc<4>({B, S, G, M});
    }
  }
  void compose_all() {
    set_side(false, true, true, true);
    set_side(true, true, true, true);
  }

  void forward() { dcmha::forward(cfg, q, k, v, out, lse, cw); }
  void backward() { dcmha::backward(cfg, q, k, v, lse, dout, dq, dk, dv, cw, cg); }
  dcmha::detail::AttentionDims check_forward() {
    return dcmha::detail::validate_forward<T>("dcmha::forward", cfg, q, k, v, out, lse, cw);
  }
  dcmha::detail::AttentionDims check_backward() {
    return dcmha::detail::validate_backward<T>("dcmha::backward", cfg, q, k, v, lse, dout, dq, dk,
                                               dv, cw, cg);
  }

  void expect_dims(const dcmha::detail::AttentionDims& d, index_t g) const {
    EXPECT_EQ(d.B, B);
    EXPECT_EQ(d.H, H);
    EXPECT_EQ(d.Hk, Hk);
    EXPECT_EQ(d.T, T_);
    EXPECT_EQ(d.S, S);
    EXPECT_EQ(d.D, D);
    EXPECT_EQ(d.Dv, Dv);
    EXPECT_EQ(d.G, g);
    EXPECT_EQ(d.M, H / g);
  }

 private:
  std::list<std::vector<T>> ts_;  // std::list: views keep pointing at stable storage
  std::list<std::vector<A>> as_;
};

/// The call must throw dcmha::Error from validation (not from a kernel) whose message contains
/// the function name and every needle.
template <class F>
void expect_rejected(const char* fn, F&& call, std::initializer_list<std::string> needles) {
  try {
    call();
  } catch (const dcmha::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(std::string(fn) + ": ", 0), 0u) << msg;
    EXPECT_EQ(msg.find("not implemented"), std::string::npos) << msg;
    for (const std::string& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << "message lacks \"" << n << "\": " << msg;
    return;
  }
  ADD_FAILURE() << "no dcmha::Error thrown";
}

template <class T>
void expect_forward_rejected(Problem<T>& p, std::initializer_list<std::string> needles) {
  expect_rejected(
      "dcmha::forward", [&] { p.forward(); }, needles);
}
template <class T>
void expect_backward_rejected(Problem<T>& p, std::initializer_list<std::string> needles) {
  expect_rejected(
      "dcmha::backward", [&] { p.backward(); }, needles);
}

template <class T>
class Validation : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(Validation, Scalars);

// ---------------------------------------------------------------------------------------------
// Accepted calls

TYPED_TEST(Validation, AcceptsContiguousMha) {
  Problem<TypeParam> p;
  p.expect_dims(p.check_forward(), p.H);
  p.expect_dims(p.check_backward(), p.H);
}

TYPED_TEST(Validation, AcceptsForwardWithoutLse) {
  Problem<TypeParam> p;
  p.lse = {};
  p.expect_dims(p.check_forward(), p.H);
}

TYPED_TEST(Validation, AcceptsMhaThroughEmptyComposeWeights) {
  Problem<TypeParam> p;
  const dcmha::ComposeWeights<TypeParam> none{};
  const dcmha::ComposeGrads<TypeParam> no_grads{};
  const auto f = dcmha::detail::validate_forward<TypeParam>("dcmha::forward", p.cfg, p.q, p.k, p.v,
                                                            p.out, p.lse, none);
  p.expect_dims(f, p.H);
  EXPECT_EQ(f.M, 1);
  const auto b = dcmha::detail::validate_backward<TypeParam>(
      "dcmha::backward", p.cfg, p.q, p.k, p.v, p.lse, p.dout, p.dq, p.dk, p.dv, none, no_grads);
  p.expect_dims(b, p.H);
}

TYPED_TEST(Validation, AcceptsBthdStrides) {
  Problem<TypeParam> p;
  p.q = dcmha::bthd(p.q.data, p.B, p.T_, p.H, p.D);
  p.k = dcmha::bthd(p.k.data, p.B, p.S, p.Hk, p.D);
  p.v = dcmha::bthd(p.v.data, p.B, p.S, p.Hk, p.Dv);
  p.out = dcmha::bthd(p.out.data, p.B, p.T_, p.H, p.Dv);
  p.dout = dcmha::bthd(p.dout.data, p.B, p.T_, p.H, p.Dv);
  p.dq = dcmha::bthd(p.dq.data, p.B, p.T_, p.H, p.D);
  p.dk = dcmha::bthd(p.dk.data, p.B, p.S, p.Hk, p.D);
  p.dv = dcmha::bthd(p.dv.data, p.B, p.S, p.Hk, p.Dv);
  p.expect_dims(p.check_forward(), p.H);
  p.expect_dims(p.check_backward(), p.H);
}

TYPED_TEST(Validation, AcceptsPaddedAndPermutedOutputs) {
  Problem<TypeParam> p;
  // out kept as (T, B, H, Dv) inside rows padded to 8 elements: the buffer is large enough.
  p.out = p.template alloc<4>({p.T_, p.B, p.H, 8});
  p.out.shape = {p.B, p.H, p.T_, p.Dv};
  p.out.stride = {p.H * 8, 8, p.B * p.H * 8, 1};
  p.expect_dims(p.check_forward(), p.H);
}

TYPED_TEST(Validation, AcceptsGqa) {
  for (index_t hk : {1, 2, 4}) {
    SCOPED_TRACE(hk);
    Problem<TypeParam> p;
    p.Hk = hk;
    p.k = p.template alloc<4>({p.B, hk, p.S, p.D});
    p.v = p.template alloc<4>({p.B, hk, p.S, p.Dv});
    p.dk = p.template alloc<4>({p.B, hk, p.S, p.D});
    p.dv = p.template alloc<4>({p.B, hk, p.S, p.Dv});
    p.expect_dims(p.check_forward(), p.H);
    p.expect_dims(p.check_backward(), p.H);
  }
}

TYPED_TEST(Validation, AcceptsComposeOn) {
  Problem<TypeParam> p;
  p.compose_all();
  p.expect_dims(p.check_forward(), p.G);
  p.expect_dims(p.check_backward(), p.G);
}

TYPED_TEST(Validation, AcceptsEveryCombinationOfComposeSwitches) {
  for (int mask = 0; mask < 64; ++mask) {
    SCOPED_TRACE(mask);
    Problem<TypeParam> p;
    p.set_side(false, mask & 1, mask & 2, mask & 4);
    p.set_side(true, mask & 8, mask & 16, mask & 32);
    const index_t g = mask == 0 ? p.H : p.G;
    p.expect_dims(p.check_forward(), g);
    p.expect_dims(p.check_backward(), g);
  }
}

TYPED_TEST(Validation, AcceptsOneGroupOfAllHeads) {
  Problem<TypeParam> p;
  p.G = 1;
  p.M = p.H;
  p.compose_all();
  const auto d = p.check_forward();
  EXPECT_EQ(d.G, 1);
  EXPECT_EQ(d.M, p.H);
}

TYPED_TEST(Validation, AcceptsDifferentRanksPerSideAndTerm) {
  Problem<TypeParam> p;
  p.set_side(false, false, true, true);  // Rq = 2, Rk = 3
  p.Rq = 1;
  p.Rk = 4;
  p.set_side(true, false, true, true);
  p.expect_dims(p.check_forward(), p.G);
  p.expect_dims(p.check_backward(), p.G);
}

TYPED_TEST(Validation, AcceptsQueryLongerOrShorterThanKeys) {
  for (index_t s : {1, 3, 7}) {
    SCOPED_TRACE(s);
    Problem<TypeParam> p;
    p.S = s;
    p.k = p.template alloc<4>({p.B, p.Hk, s, p.D});
    p.v = p.template alloc<4>({p.B, p.Hk, s, p.Dv});
    p.dk = p.template alloc<4>({p.B, p.Hk, s, p.D});
    p.dv = p.template alloc<4>({p.B, p.Hk, s, p.Dv});
    p.compose_all();
    p.expect_dims(p.check_forward(), p.G);
    p.expect_dims(p.check_backward(), p.G);
  }
}

TYPED_TEST(Validation, AcceptsAliasedInputs) {
  Problem<TypeParam> p;
  p.k.data = p.q.data;  // q == k, as in a tied self-attention test
  p.v.data = p.q.data;
  p.dout.data = p.out.data;  // backward reads out's buffer as dout: both inputs there
  p.compose_all();
  p.cw.pre.qw2 = p.cw.pre.qw1;
  p.expect_dims(p.check_forward(), p.G);
  p.expect_dims(p.check_backward(), p.G);
}

TYPED_TEST(Validation, AcceptsOutputsAdjacentInOneBuffer) {
  Problem<TypeParam> p;
  // dq, dk, dv packed back to back: touching ranges, no shared byte.
  auto all = p.template alloc<1>({p.dq.numel() + p.dk.numel() + p.dv.numel()});
  p.dq.data = all.data;
  p.dk.data = p.dq.data + p.dq.numel();
  p.dv.data = p.dk.data + p.dk.numel();
  p.expect_dims(p.check_backward(), p.H);
}

TYPED_TEST(Validation, AcceptsOutputsInterleavedInOneBuffer) {
  Problem<TypeParam> p;
  // dk and dv side by side in rows of D + Dv: overlapping ranges, no shared element.
  const index_t row = p.D + p.Dv;
  auto both = p.template alloc<4>({p.B, p.Hk, p.S, row});
  p.dk = TensorView<TypeParam, 4>(both.data, {p.B, p.Hk, p.S, p.D}, both.stride);
  p.dv = TensorView<TypeParam, 4>(both.data + p.D, {p.B, p.Hk, p.S, p.Dv}, both.stride);
  p.expect_dims(p.check_backward(), p.H);
  // One element further left, each dv row covers the last element of a dk row.
  p.dv.data -= 1;
  expect_backward_rejected(p, {"dk: expected memory disjoint from output dv (both are written",
                               "got overlapping byte ranges"});
}

TYPED_TEST(Validation, AcceptsConfigVariants) {
  Problem<TypeParam> p;
  p.cfg.mask = dcmha::Mask::full;
  p.cfg.scale = -1.0;  // <= 0: the default 1/sqrt(D)
  p.cfg.window = 2;
  p.cfg.num_threads = 3;
  p.expect_dims(p.check_forward(), p.H);
  p.cfg.scale = 0.125;
  p.expect_dims(p.check_backward(), p.H);
}

TYPED_TEST(Validation, AcceptsAnyStrideOnSizeOneDims) {
  Problem<TypeParam> p;
  p.B = 1;
  p.D = 1;
  p.q = p.template alloc<4>({1, p.H, p.T_, 1});
  p.k = p.template alloc<4>({1, p.Hk, p.S, 1});
  p.v = p.template alloc<4>({1, p.Hk, p.S, p.Dv});
  p.out = p.template alloc<4>({1, p.H, p.T_, p.Dv});
  p.lse = {};
  p.q.stride[3] = 7;    // a head dim of one element is contiguous whatever its stride
  p.out.stride[0] = 0;  // a broadcast over a dim of size 1 writes nothing twice
  p.expect_dims(p.check_forward(), p.H);
}

// ---------------------------------------------------------------------------------------------
// Config

TYPED_TEST(Validation, RejectsNegativeWindow) {
  Problem<TypeParam> p;
  p.cfg.window = -1;
  expect_forward_rejected(p, {"cfg.window", "expected >= 0", "got -1"});
  expect_backward_rejected(p, {"cfg.window", "expected >= 0", "got -1"});
}

TYPED_TEST(Validation, RejectsNegativeNumThreads) {
  Problem<TypeParam> p;
  p.cfg.num_threads = -2;
  expect_forward_rejected(p, {"cfg.num_threads", "expected >= 0", "got -2"});
  expect_backward_rejected(p, {"cfg.num_threads", "expected >= 0", "got -2"});
}

TYPED_TEST(Validation, RejectsNonFiniteScale) {
  for (double s :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity()}) {
    Problem<TypeParam> p;
    p.cfg.scale = s;
    expect_forward_rejected(p, {"cfg.scale", "expected a finite value"});
    expect_backward_rejected(p, {"cfg.scale", "expected a finite value"});
  }
}

// ---------------------------------------------------------------------------------------------
// Presence

TYPED_TEST(Validation, ForwardRequiresQKVOut) {
  const std::pair<const char*, const char*> cases[] = {{"q", "(B, H, T, D)"},
                                                       {"k", "(B, Hk, S, D)"},
                                                       {"v", "(B, Hk, S, Dv)"},
                                                       {"out", "(B, H, T, Dv)"}};
  for (const auto& [name, shape] : cases) {
    SCOPED_TRACE(name);
    Problem<TypeParam> p;
    const std::string n = name;
    if (n == "q") p.q = {};
    if (n == "k") p.k = {};
    if (n == "v") p.v = {};
    if (n == "out") p.out = {};
    expect_forward_rejected(p, {n + ": expected a tensor " + shape, "got an empty view"});
  }
}

TYPED_TEST(Validation, BackwardRequiresAllTensors) {
  const std::pair<const char*, const char*> cases[] = {
      {"q", "(B, H, T, D)"},   {"k", "(B, Hk, S, D)"},    {"v", "(B, Hk, S, Dv)"},
      {"lse", "(B, H, T)"},    {"dout", "(B, H, T, Dv)"}, {"dq", "(B, H, T, D)"},
      {"dk", "(B, Hk, S, D)"}, {"dv", "(B, Hk, S, Dv)"}};
  for (const auto& [name, shape] : cases) {
    SCOPED_TRACE(name);
    Problem<TypeParam> p;
    const std::string n = name;
    if (n == "q") p.q = {};
    if (n == "k") p.k = {};
    if (n == "v") p.v = {};
    if (n == "lse") p.lse = {};
    if (n == "dout") p.dout = {};
    if (n == "dq") p.dq = {};
    if (n == "dk") p.dk = {};
    if (n == "dv") p.dv = {};
    expect_backward_rejected(p, {n + ": expected a tensor " + shape, "got an empty view"});
  }
}

// ---------------------------------------------------------------------------------------------
// Dims and shapes

TYPED_TEST(Validation, RejectsNonPositiveDims) {
  struct Case {
    int tensor;  // 0 q, 1 k, 2 v
    int dim;
    const char* needle;
  };
  const Case cases[] = {{0, 0, "q.shape[0] (B)"},  {0, 1, "q.shape[1] (H)"},
                        {0, 2, "q.shape[2] (T)"},  {0, 3, "q.shape[3] (D)"},
                        {1, 1, "k.shape[1] (Hk)"}, {1, 2, "k.shape[2] (S)"},
                        {2, 3, "v.shape[3] (Dv)"}};
  for (const Case& c : cases) {
    for (index_t bad : {0, -3}) {
      SCOPED_TRACE(c.needle);
      Problem<TypeParam> p;
      TensorView<TypeParam, 4>& t = c.tensor == 0 ? p.q : c.tensor == 1 ? p.k : p.v;
      t.shape[c.dim] = bad;
      const std::string got = "got " + std::to_string(bad);
      expect_forward_rejected(p, {c.needle, "expected >= 1", got});
      expect_backward_rejected(p, {c.needle, "expected >= 1", got});
    }
  }
}

TYPED_TEST(Validation, RejectsKeyShapeMismatch) {
  Problem<TypeParam> p;
  p.k.shape[3] = 4;
  expect_forward_rejected(p, {"k.shape[3] (D): expected 8 (q.shape[3]), got 4"});
  p.k.shape[3] = p.D;
  p.k.shape[0] = 3;
  expect_backward_rejected(p, {"k.shape[0] (B): expected 2 (q.shape[0]), got 3"});
}

TYPED_TEST(Validation, RejectsValueShapeMismatch) {
  const std::pair<int, const char*> cases[] = {
      {0, "v.shape[0] (B): expected 2 (q.shape[0]), got 9"},
      {1, "v.shape[1] (Hk): expected 2 (k.shape[1]), got 9"},
      {2, "v.shape[2] (S): expected 5 (k.shape[2]), got 9"}};
  for (const auto& [dim, needle] : cases) {
    Problem<TypeParam> p;
    p.v.shape[dim] = 9;
    expect_forward_rejected(p, {needle});
    expect_backward_rejected(p, {needle});
  }
}

TYPED_TEST(Validation, RejectsOutAndDoutShapeMismatch) {
  const std::pair<int, const char*> cases[] = {
      {0, ".shape[0] (B): expected 2 (q.shape[0]), got 9"},
      {1, ".shape[1] (H): expected 4 (q.shape[1]), got 9"},
      {2, ".shape[2] (T): expected 3 (q.shape[2]), got 9"},
      {3, ".shape[3] (Dv): expected 6 (v.shape[3]), got 9"}};
  for (const auto& [dim, needle] : cases) {
    Problem<TypeParam> p;
    p.out.shape[dim] = 9;
    expect_forward_rejected(p, {std::string("out") + needle});
    p.dout.shape[dim] = 9;
    expect_backward_rejected(p, {std::string("dout") + needle});
  }
}

TYPED_TEST(Validation, BackwardChecksTheGivenOutput) {
  // out is optional in backward; given, it is checked as the forward's: shape, strides, aliasing.
  const std::pair<int, const char*> cases[] = {
      {0, "out.shape[0] (B): expected 2 (q.shape[0]), got 9"},
      {3, "out.shape[3] (Dv): expected 6 (v.shape[3]), got 9"}};
  auto backward_with_output = [](Problem<TypeParam>& p) {
    return [&p] {
      dcmha::backward(p.cfg, p.q, p.k, p.v, p.out, p.lse, p.dout, p.dq, p.dk, p.dv, p.cw, p.cg);
    };
  };
  for (const auto& [dim, needle] : cases) {
    Problem<TypeParam> p;
    p.out.shape[dim] = 9;
    expect_rejected("dcmha::backward", backward_with_output(p), {needle});
  }
  {
    Problem<TypeParam> p;
    p.out.stride[3] = 2;
    expect_rejected("dcmha::backward", backward_with_output(p),
                    {"out.stride[3]: expected 1 (head dim must be contiguous), got 2"});
  }
  {
    Problem<TypeParam> p;
    p.out.data = p.dq.data;
    expect_rejected("dcmha::backward", backward_with_output(p),
                    {"dq: expected memory disjoint from input out"});
  }
  {
    Problem<TypeParam> p;
    p.compose_all();
    p.cg.pre.qdd.data = p.out.data;  // (B, T, G, M): inside out's (B, H, T, Dv)
    expect_rejected("dcmha::backward", backward_with_output(p),
                    {"dcompose.pre.qdd: expected memory disjoint from input out"});
  }
  Problem<TypeParam> p;
  EXPECT_NO_THROW(backward_with_output(p)());
}

TYPED_TEST(Validation, RejectsLseShapeMismatch) {
  const std::pair<int, const char*> cases[] = {
      {0, "lse.shape[0] (B): expected 2 (q.shape[0]), got 9"},
      {1, "lse.shape[1] (H): expected 4 (q.shape[1]), got 9"},
      {2, "lse.shape[2] (T): expected 3 (q.shape[2]), got 9"}};
  for (const auto& [dim, needle] : cases) {
    Problem<TypeParam> p;
    p.lse.shape[dim] = 9;
    expect_forward_rejected(p, {needle});
    expect_backward_rejected(p, {needle});
  }
}

TYPED_TEST(Validation, RejectsGradientShapeMismatch) {
  struct Case {
    int tensor;  // 0 dq, 1 dk, 2 dv
    int dim;
    const char* needle;
  };
  const Case cases[] = {{0, 0, "dq.shape[0] (B): expected 2 (q.shape[0]), got 9"},
                        {0, 3, "dq.shape[3] (D): expected 8 (q.shape[3]), got 9"},
                        {1, 1, "dk.shape[1] (Hk): expected 2 (k.shape[1]), got 9"},
                        {1, 2, "dk.shape[2] (S): expected 5 (k.shape[2]), got 9"},
                        {2, 2, "dv.shape[2] (S): expected 5 (v.shape[2]), got 9"},
                        {2, 3, "dv.shape[3] (Dv): expected 6 (v.shape[3]), got 9"}};
  for (const Case& c : cases) {
    Problem<TypeParam> p;
    TensorView<TypeParam, 4>& t = c.tensor == 0 ? p.dq : c.tensor == 1 ? p.dk : p.dv;
    t.shape[c.dim] = 9;
    expect_backward_rejected(p, {c.needle});
  }
}

TYPED_TEST(Validation, RejectsHeadsNotDivisibleByKvHeads) {
  Problem<TypeParam> p;
  p.k.shape[1] = p.v.shape[1] = 3;
  p.dk.shape[1] = p.dv.shape[1] = 3;
  expect_forward_rejected(p, {"k.shape[1] (Hk): expected a divisor of H = 4", "got 3"});
  expect_backward_rejected(p, {"k.shape[1] (Hk): expected a divisor of H = 4", "got 3"});
}

// ---------------------------------------------------------------------------------------------
// Strides

TYPED_TEST(Validation, RejectsNegativeStrides) {
  {
    Problem<TypeParam> p;
    p.k.stride[2] = -8;
    expect_forward_rejected(p, {"k.stride[2]: expected >= 0, got -8"});
    expect_backward_rejected(p, {"k.stride[2]: expected >= 0, got -8"});
  }
  {
    Problem<TypeParam> p;
    p.lse.stride[1] = -3;
    expect_forward_rejected(p, {"lse.stride[1]: expected >= 0, got -3"});
    expect_backward_rejected(p, {"lse.stride[1]: expected >= 0, got -3"});
  }
  {
    Problem<TypeParam> p;
    p.dv.stride[0] = -1;
    expect_backward_rejected(p, {"dv.stride[0]: expected >= 0, got -1"});
  }
}

TYPED_TEST(Validation, RejectsOverflowingExtent) {
  Problem<TypeParam> p;
  p.q.stride[0] = std::numeric_limits<index_t>::max() / 2;
  expect_forward_rejected(p, {"q: expected shape and strides addressing at most", "overflows"});
  expect_backward_rejected(p, {"q: expected shape and strides addressing at most", "overflows"});
}

TYPED_TEST(Validation, RejectsNonContiguousHeadDim) {
  for (const char* name : {"q", "k", "v", "out", "dout", "dq", "dk", "dv"}) {
    SCOPED_TRACE(name);
    Problem<TypeParam> p;
    const std::string n = name;
    TensorView<TypeParam, 4>* t = n == "q"      ? &p.q
                                  : n == "k"    ? &p.k
                                  : n == "v"    ? &p.v
                                  : n == "out"  ? &p.out
                                  : n == "dout" ? &p.dout
                                  : n == "dq"   ? &p.dq
                                  : n == "dk"   ? &p.dk
                                                : &p.dv;
    t->stride[3] = 2;
    const std::string needle = n + ".stride[3]: expected 1 (head dim must be contiguous), got 2";
    if (n != "dout" && n[0] != 'd') expect_forward_rejected(p, {needle});
    if (n != "out") expect_backward_rejected(p, {needle});
  }
}

TYPED_TEST(Validation, RejectsBroadcastOutput) {
  Problem<TypeParam> p;
  p.out.stride[2] = 0;
  expect_forward_rejected(p, {"out.stride[2]: expected >= 1", "must not overlap", "got 0"});
  p.dq.stride[1] = 0;
  expect_backward_rejected(p, {"dq.stride[1]: expected >= 1", "must not overlap", "got 0"});
}

TYPED_TEST(Validation, RejectsSelfOverlappingOutputs) {
  {
    // out (2, 4, 3, 6): heads and rows share stride 6, so head h row t+1 is head h+1 row t.
    Problem<TypeParam> p;
    p.out.stride[1] = 6;
    expect_forward_rejected(p, {"out.stride[2]: expected >= 24", "got 6"});
  }
  {
    Problem<TypeParam> p;
    p.lse.stride = {1, 1, 1};
    expect_forward_rejected(p, {"lse.stride[1]: expected >= 2", "must not overlap", "got 1"});
  }
  {
    Problem<TypeParam> p;
    p.dk.stride[0] = 20;  // (2, 2, 5, 8): batch 1 starts inside batch 0's first head
    expect_backward_rejected(p, {"dk.stride[0]: expected >= 40", "got 20"});
  }
  {
    Problem<TypeParam> p;
    p.dv.stride[2] = 3;  // rows of 6 elements 3 apart
    expect_backward_rejected(p, {"dv.stride[2]: expected >= 6", "got 3"});
  }
}

// ---------------------------------------------------------------------------------------------
// Compose

TYPED_TEST(Validation, RejectsMissingComposeTensorOfTermThatIsOn) {
  struct Case {
    const char* name;
    const char* shape;
    const char* sw;
  };
  const Case cases[] = {
      {"w", "(G, M, M)", "static_w"},           {"qw1", "(B, T, G, R, M)", "query_wise"},
      {"qw2", "(B, T, G, R, M)", "query_wise"}, {"qdd", "(B, T, G, M)", "query_wise"},
      {"kw1", "(B, S, G, R, M)", "key_wise"},   {"kw2", "(B, S, G, R, M)", "key_wise"},
      {"kdd", "(B, S, G, M)", "key_wise"}};
  for (const char* side : {"pre", "post"}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(std::string(side) + "." + c.name);
      Problem<TypeParam> p;
      p.compose_all();
      auto& t = std::string(side) == "pre" ? p.cw.pre : p.cw.post;
      const std::string n = c.name;
      if (n == "w") t.w = {};
      if (n == "qw1") t.qw1 = {};
      if (n == "qw2") t.qw2 = {};
      if (n == "qdd") t.qdd = {};
      if (n == "kw1") t.kw1 = {};
      if (n == "kw2") t.kw2 = {};
      if (n == "kdd") t.kdd = {};
      const std::string needle = std::string("compose.") + side + "." + n + ": expected a tensor " +
                                 c.shape + " because compose." + side + "." + c.sw + " is on";
      expect_forward_rejected(p, {needle});
      expect_backward_rejected(p, {needle});
    }
  }
}

TYPED_TEST(Validation, RejectsComposeTensorOfTermThatIsOff) {
  Problem<TypeParam> p;
  p.compose_all();
  p.cw.pre.query_wise = false;
  expect_forward_rejected(
      p, {"compose.pre.qw1: given but query_wise is off", "expected an empty view"});

  Problem<TypeParam> r;
  r.compose_all();
  r.cw.post.key_wise = false;
  expect_backward_rejected(
      r, {"compose.post.kw1: given but key_wise is off", "expected an empty view"});

  Problem<TypeParam> s;  // compose entirely off but a W given: must not silently become MHA
  s.cw.post.w = s.template alloc<3>({s.G, s.M, s.M});
  expect_forward_rejected(s,
                          {"compose.post.w: given but static_w is off", "expected an empty view"});
}

TYPED_TEST(Validation, RejectsStaticWeightShapeMismatch) {
  Problem<TypeParam> p;
  p.compose_all();
  p.cw.pre.w.shape[1] = 3;
  expect_forward_rejected(p, {"compose.pre.w.shape[1] (M): expected 2 (H / G), got 3"});
  p.cw.pre.w.shape[1] = 2;
  p.cw.post.w.shape[2] = 1;
  expect_backward_rejected(p, {"compose.post.w.shape[2] (M): expected 2 (H / G), got 1"});
}

TYPED_TEST(Validation, RejectsGroupCountNotDividingHeads) {
  Problem<TypeParam> p;
  p.set_side(false, true, false, false);
  p.cw.pre.w.shape = {3, 1, 1};
  expect_forward_rejected(p, {"compose.pre.w.shape[0] (G): expected a divisor of H = 4", "got 3"});
  p.cw.pre.w.shape = {0, 1, 1};
  expect_backward_rejected(p, {"compose.pre.w.shape[0] (G): expected >= 1", "got 0"});
}

TYPED_TEST(Validation, RejectsInconsistentGroupCount) {
  Problem<TypeParam> p;
  p.compose_all();
  p.cw.post.qw1.shape[2] = 4;
  expect_forward_rejected(
      p, {"compose.post.qw1.shape[2] (G): expected 2 (compose.pre.w.shape[0]), got 4"});
  p.cw.post.qw1.shape[2] = 2;
  p.cw.pre.kdd.shape[2] = 1;
  expect_backward_rejected(
      p, {"compose.pre.kdd.shape[2] (G): expected 2 (compose.pre.w.shape[0]), got 1"});

  Problem<TypeParam> r;  // pre off: G comes from the first tensor of the post side
  r.set_side(true, false, false, true);
  r.cw.post.kdd.shape[2] = 4;
  expect_forward_rejected(
      r, {"compose.post.kdd.shape[2] (G): expected 2 (compose.post.kw1.shape[2]), got 4"});
}

TYPED_TEST(Validation, RejectsQueryWiseShapeMismatch) {
  struct Case {
    const char* tensor;
    int dim;
    const char* needle;
  };
  const Case cases[] = {{"qw1", 0, "compose.pre.qw1.shape[0] (B): expected 2 (q.shape[0]), got 9"},
                        {"qw1", 1, "compose.pre.qw1.shape[1] (T): expected 3 (q.shape[2]), got 9"},
                        {"qw2", 4, "compose.pre.qw2.shape[4] (M): expected 2 (H / G), got 9"},
                        {"qdd", 1, "compose.pre.qdd.shape[1] (T): expected 3 (q.shape[2]), got 9"},
                        {"qdd", 3, "compose.pre.qdd.shape[3] (M): expected 2 (H / G), got 9"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.needle);
    Problem<TypeParam> p;
    p.compose_all();
    const std::string n = c.tensor;
    if (n == "qw1") p.cw.pre.qw1.shape[c.dim] = 9;
    if (n == "qw2") p.cw.pre.qw2.shape[c.dim] = 9;
    if (n == "qdd") p.cw.pre.qdd.shape[c.dim] = 9;
    expect_forward_rejected(p, {c.needle});
    expect_backward_rejected(p, {c.needle});
  }
}

TYPED_TEST(Validation, RejectsKeyWiseShapeMismatch) {
  struct Case {
    const char* tensor;
    int dim;
    const char* needle;
  };
  const Case cases[] = {
      {"kw1", 1, "compose.post.kw1.shape[1] (S): expected 5 (k.shape[2]), got 3"},
      {"kw2", 0, "compose.post.kw2.shape[0] (B): expected 2 (q.shape[0]), got 3"},
      {"kw2", 4, "compose.post.kw2.shape[4] (M): expected 2 (H / G), got 3"},
      {"kdd", 1, "compose.post.kdd.shape[1] (S): expected 5 (k.shape[2]), got 3"}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.needle);
    Problem<TypeParam> p;
    p.compose_all();
    const std::string n = c.tensor;
    if (n == "kw1") p.cw.post.kw1.shape[c.dim] = 3;
    if (n == "kw2") p.cw.post.kw2.shape[c.dim] = 3;
    if (n == "kdd") p.cw.post.kdd.shape[c.dim] = 3;
    expect_forward_rejected(p, {c.needle});
    expect_backward_rejected(p, {c.needle});
  }
}

TYPED_TEST(Validation, RejectsBadRank) {
  {
    Problem<TypeParam> p;
    p.compose_all();
    p.cw.pre.qw1.shape[3] = 0;
    p.cw.pre.qw2.shape[3] = 0;
    expect_forward_rejected(p, {"compose.pre.qw1.shape[3] (R): expected >= 1, got 0"});
  }
  {
    Problem<TypeParam> p;
    p.compose_all();
    p.cw.post.qw2.shape[3] = 1;
    expect_forward_rejected(
        p, {"compose.post.qw2.shape[3] (R): expected 2 (compose.post.qw1.shape[3]), got 1"});
  }
  {
    Problem<TypeParam> p;
    p.compose_all();
    p.cw.pre.kw2.shape[3] = 2;
    expect_backward_rejected(
        p, {"compose.pre.kw2.shape[3] (R): expected 3 (compose.pre.kw1.shape[3]), got 2"});
  }
}

TYPED_TEST(Validation, RejectsNegativeComposeStrides) {
  Problem<TypeParam> p;
  p.compose_all();
  p.cw.post.kw2.stride[4] = -1;
  expect_forward_rejected(p, {"compose.post.kw2.stride[4]: expected >= 0, got -1"});
  expect_backward_rejected(p, {"compose.post.kw2.stride[4]: expected >= 0, got -1"});
}

// ---------------------------------------------------------------------------------------------
// Compose gradients

TYPED_TEST(Validation, RejectsMissingComposeGrad) {
  Problem<TypeParam> p;
  p.compose_all();
  p.cg.pre.qdd = {};
  expect_backward_rejected(
      p, {"dcompose.pre.qdd: expected a tensor (B, T, G, M) because compose.pre.query_wise is on"});
  p.compose_all();
  p.cg.post.w = {};
  expect_backward_rejected(
      p, {"dcompose.post.w: expected a tensor (G, M, M) because compose.post.static_w is on"});
}

TYPED_TEST(Validation, RejectsComposeGradOfTermThatIsOff) {
  Problem<TypeParam> p;
  p.set_side(false, true, true, false);
  p.cg.pre.kdd = p.template alloc<4>({p.B, p.S, p.G, p.M});
  expect_backward_rejected(
      p, {"dcompose.pre.kdd: given but key_wise is off", "expected an empty view"});

  Problem<TypeParam> r;  // MHA call with a stray gradient
  r.cg.post.w = r.template alloc<3>({r.G, r.M, r.M});
  expect_backward_rejected(
      r, {"dcompose.post.w: given but static_w is off", "expected an empty view"});
}

TYPED_TEST(Validation, RejectsComposeGradShapeMismatch) {
  Problem<TypeParam> p;
  p.compose_all();
  p.cg.pre.kw1.shape[3] = 2;
  expect_backward_rejected(
      p, {"dcompose.pre.kw1.shape[3] (R): expected 3 (compose.pre.kw1.shape[3]), got 2"});
  p.compose_all();
  p.cg.post.w.shape[0] = 1;
  expect_backward_rejected(
      p, {"dcompose.post.w.shape[0] (G): expected 2 (compose.post.w.shape[0]), got 1"});
}

TYPED_TEST(Validation, RejectsBadComposeGradStrides) {
  Problem<TypeParam> p;
  p.compose_all();
  p.cg.post.qw2.stride[0] = -5;
  expect_backward_rejected(p, {"dcompose.post.qw2.stride[0]: expected >= 0, got -5"});
  p.compose_all();
  p.cg.pre.kdd.stride[2] = 0;
  expect_backward_rejected(
      p, {"dcompose.pre.kdd.stride[2]: expected >= 1", "must not overlap", "got 0"});
}

// ---------------------------------------------------------------------------------------------
// Aliasing

TYPED_TEST(Validation, RejectsOutputOverlappingInput) {
  {
    Problem<TypeParam> p;
    p.out.data = p.q.data;  // in-place attention is not supported
    expect_forward_rejected(
        p, {"out: expected memory disjoint from input q", "overlapping byte ranges"});
  }
  {
    // out starts inside v and runs past its end; one buffer keeps that range away from the
    // other inputs so only v can be reported.
    Problem<TypeParam> p;
    auto buf = p.template alloc<1>({p.v.numel() + p.out.numel()});
    p.v.data = buf.data;
    p.out.data = buf.data + 7;
    expect_forward_rejected(p, {"out: expected memory disjoint from input v"});
  }
  {
    Problem<TypeParam> p;
    p.lse.data = reinterpret_cast<typename Problem<TypeParam>::A*>(p.k.data) + 3;
    expect_forward_rejected(p, {"lse: expected memory disjoint from input k"});
  }
  {
    Problem<TypeParam> p;
    p.compose_all();
    auto buf = p.template alloc<1>({p.cw.post.kdd.numel() + p.out.numel()});
    p.cw.post.kdd.data = buf.data + p.out.numel() - 1;
    p.out.data = buf.data;
    expect_forward_rejected(p, {"out: expected memory disjoint from input compose.post.kdd"});
  }
}

TYPED_TEST(Validation, RejectsOutputsOverlappingEachOther) {
  Problem<TypeParam> p;
  p.lse.data = reinterpret_cast<typename Problem<TypeParam>::A*>(p.out.data + p.out.numel() - 1);
  expect_forward_rejected(p, {"out: expected memory disjoint from output lse"});

  Problem<TypeParam> r;
  r.dv.data = r.dk.data + 4;
  expect_backward_rejected(r, {"dk: expected memory disjoint from output dv"});
}

TYPED_TEST(Validation, RejectsGradientOverlappingBackwardInput) {
  using A = typename Problem<TypeParam>::A;
  {
    Problem<TypeParam> p;
    p.dq.data = p.q.data;
    expect_backward_rejected(p, {"dq: expected memory disjoint from input q"});
  }
  {
    Problem<TypeParam> p;
    p.dk.data = p.k.data;
    expect_backward_rejected(p, {"dk: expected memory disjoint from input k"});
  }
  {
    Problem<TypeParam> p;
    p.dv.data = p.dout.data;
    expect_backward_rejected(p, {"dv: expected memory disjoint from input dout"});
  }
  {
    Problem<TypeParam> p;
    p.lse.data = reinterpret_cast<A*>(p.dk.data) + 5;
    expect_backward_rejected(p, {"dk: expected memory disjoint from input lse"});
  }
}

TYPED_TEST(Validation, RejectsComposeGradOverlapping) {
  {
    Problem<TypeParam> p;
    p.compose_all();
    p.cg.pre.w.data = const_cast<TypeParam*>(p.cw.pre.w.data);  // gradient over its own input
    expect_backward_rejected(p,
                             {"dcompose.pre.w: expected memory disjoint from input compose.pre.w"});
  }
  {
    Problem<TypeParam> p;
    p.compose_all();
    p.cg.post.qdd.data = p.cg.pre.qdd.data;
    expect_backward_rejected(
        p, {"dcompose.pre.qdd: expected memory disjoint from output dcompose.post.qdd"});
  }
  {
    Problem<TypeParam> p;
    p.compose_all();
    p.cg.pre.kw1.data = p.dk.data;
    expect_backward_rejected(p, {"dk: expected memory disjoint from output dcompose.pre.kw1"});
  }
  {
    Problem<TypeParam> p;
    p.compose_all();
    p.cg.post.kw2.data = p.dout.data;
    expect_backward_rejected(p, {"dcompose.post.kw2: expected memory disjoint from input dout"});
  }
}

// A Workspace that another call holds (simulated by holding it here) is refused, not shared;
// once released it serves again.
TYPED_TEST(Validation, RejectsWorkspaceInUse) {
  Problem<TypeParam> p;
  p.compose_all();
  dcmha::Workspace ws;
  {
    const dcmha::detail::WorkspaceAccess::Use other_call("test", ws);
    const char* needle = "workspace: expected a Workspace no other call is using";
    expect_rejected("dcmha::forward",
                    [&] { dcmha::forward(p.cfg, p.q, p.k, p.v, p.out, p.lse, p.cw, ws); },
                    {needle});
    expect_rejected("dcmha::backward",
                    [&] {
                      dcmha::backward(p.cfg, p.q, p.k, p.v, p.lse, p.dout, p.dq, p.dk, p.dv, p.cw,
                                      p.cg, ws);
                    },
                    {needle});
  }
  EXPECT_NO_THROW(dcmha::forward(p.cfg, p.q, p.k, p.v, p.out, p.lse, p.cw, ws));
  EXPECT_NO_THROW(
      dcmha::backward(p.cfg, p.q, p.k, p.v, p.lse, p.dout, p.dq, p.dk, p.dv, p.cw, p.cg, ws));
  EXPECT_GT(ws.bytes(), 0u);
}

}  // namespace

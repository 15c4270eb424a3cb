#pragma once
// Helpers shared by the attention tests: random problems for the reference, the same problem in
// the production API's types and views, and error measures.
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dcmha/compose_weights.hpp"
#include "dcmha/config.hpp"
#include "dcmha/tensor.hpp"
#include "reference/reference.hpp"

namespace dcmha::test {

// ---------------------------------------------------------------------------------------------
// Random problems
// ---------------------------------------------------------------------------------------------

/// Which compose terms one side has.
struct SideSpec {
  bool static_w = false, query_wise = false, key_wise = false;
  static SideSpec all() { return {true, true, true}; }
  static SideSpec none() { return {false, false, false}; }
  static SideSpec dynamic() { return {false, true, true}; }
};

struct ProblemSpec {
  int64_t B = 1, H = 4, Hk = 4, T = 5, S = 5, D = 8, Dv = 8, G = 1, Rq = 2, Rk = 2;
  bool causal = false;
  int64_t window = 0;
  double scale = 0;  // <= 0: 1/sqrt(D)
  SideSpec pre = SideSpec::all(), post = SideSpec::all();

  /// For SCOPED_TRACE and test output.
  std::string str() const {
    auto side = [](const SideSpec& s) {
      std::string r;
      if (s.static_w) r += "W";
      if (s.query_wise) r += "q";
      if (s.key_wise) r += "k";
      return r.empty() ? std::string("-") : r;
    };
    return "B" + std::to_string(B) + " H" + std::to_string(H) + " Hk" + std::to_string(Hk) + " T" +
           std::to_string(T) + " S" + std::to_string(S) + " D" + std::to_string(D) + " Dv" +
           std::to_string(Dv) + " G" + std::to_string(G) + " Rq" + std::to_string(Rq) + " Rk" +
           std::to_string(Rk) + (causal ? " causal" : " full") +
           (window > 0 ? " window" + std::to_string(window) : std::string()) + " pre=" + side(pre) +
           " post=" + side(post);
  }
};

/// Deterministic on every platform: std::mt19937_64's output is fixed by the standard, the
/// std:: distributions are not.
class Rng {
 public:
  explicit Rng(uint64_t seed) : gen_(seed) {}
  double uniform() { return static_cast<double>(gen_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1], log stays finite
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  std::vector<double> normal(size_t n, double stddev) {
    std::vector<double> x(n);
    for (double& v : x) v = stddev * normal();
    return x;
  }

 private:
  std::mt19937_64 gen_;
};

/// q, k, v ~ N(0, 1), so with the default scale the scores are O(1) and the softmax is neither
/// flat nor one-hot. Compose weights are scaled so that each term changes a head's value by
/// roughly 0.3 of its size: large enough that a wrong term shows, small enough that Compose
/// stays well conditioned.
inline reference::Problem random_problem(const ProblemSpec& s, uint64_t seed) {
  reference::Problem p;
  p.B = s.B;
  p.H = s.H;
  p.Hk = s.Hk;
  p.T = s.T;
  p.S = s.S;
  p.D = s.D;
  p.Dv = s.Dv;
  p.G = s.G;
  p.causal = s.causal;
  p.window = s.window;
  p.scale = s.scale;
  if (s.H % s.Hk != 0 || s.H % s.G != 0)
    throw std::invalid_argument("random_problem: Hk and G must divide H (" + s.str() + ")");
  const int64_t M = s.H / s.G;
  Rng rng(seed);
  p.q = rng.normal(s.B * s.H * s.T * s.D, 1.0);
  p.k = rng.normal(s.B * s.Hk * s.S * s.D, 1.0);
  p.v = rng.normal(s.B * s.Hk * s.S * s.Dv, 1.0);
  auto side = [&](const SideSpec& spec) {
    reference::ComposeSide c;
    c.static_w = spec.static_w;
    c.query_wise = spec.query_wise;
    c.key_wise = spec.key_wise;
    // (sum_m a_m w1_m) w2_n has size ~ sqrt(M) * sd^2 * |a| per rank: pick sd to make it ~0.3/R.
    auto lowrank_sd = [&](int64_t R) { return std::sqrt(0.3 / (R * std::sqrt(double(M)))); };
    if (spec.static_w) c.w = rng.normal(s.G * M * M, 0.3 / std::sqrt(double(M)));
    if (spec.query_wise) {
      c.Rq = s.Rq;
      c.qw1 = rng.normal(s.B * s.T * s.G * s.Rq * M, lowrank_sd(s.Rq));
      c.qw2 = rng.normal(s.B * s.T * s.G * s.Rq * M, lowrank_sd(s.Rq));
      c.qdd = rng.normal(s.B * s.T * s.G * M, 0.3);
    }
    if (spec.key_wise) {
      c.Rk = s.Rk;
      c.kw1 = rng.normal(s.B * s.S * s.G * s.Rk * M, lowrank_sd(s.Rk));
      c.kw2 = rng.normal(s.B * s.S * s.G * s.Rk * M, lowrank_sd(s.Rk));
      c.kdd = rng.normal(s.B * s.S * s.G * M, 0.3);
    }
    return c;
  };
  p.pre = side(s.pre);
  p.post = side(s.post);
  return p;
}

/// An upstream gradient for out (B, H, T, Dv).
inline std::vector<double> random_dout(const reference::Problem& p, uint64_t seed) {
  return Rng(seed ^ 0x9e3779b97f4a7c15ull).normal(p.B * p.H * p.T * p.Dv, 1.0);
}

/// x rounded to a value of storage type T (bf16, fp16, float).
template <class T>
double round_to(double x) {
  return double(static_cast<float>(T(static_cast<float>(x))));
}

/// p with every input rounded to a value of T: the reference then sees what a kernel storing T
/// reads, and what is left of the error is the kernel's own arithmetic.
template <class T>
dcmha::reference::Problem storage_problem(dcmha::reference::Problem p) {
  auto round = [](std::vector<double>& x) {
    for (double& e : x) e = round_to<T>(e);
  };
  for (auto* x : {&p.q, &p.k, &p.v}) round(*x);
  for (auto* c : {&p.pre, &p.post})
    for (auto* x : {&c->w, &c->qw1, &c->qw2, &c->kw1, &c->kw2, &c->qdd, &c->kdd}) round(*x);
  return p;
}

// ---------------------------------------------------------------------------------------------
// Canonical (row-major) <-> strided views
// ---------------------------------------------------------------------------------------------

namespace detail {
/// Calls f(flat, view element) for every logical index of v, in row-major order.
template <class T, int N, class F>
void for_each_logical(const TensorView<T, N>& v, F&& f) {
  const index_t n = v.numel();
  std::array<index_t, N> i{};
  for (index_t flat = 0; flat < n; ++flat) {
    index_t off = 0;
    for (int d = 0; d < N; ++d) off += i[d] * v.stride[d];
    f(flat, v.data[off]);
    for (int d = N - 1; d >= 0; --d) {
      if (++i[d] < v.shape[d]) break;
      i[d] = 0;
    }
  }
}
}  // namespace detail

/// A view's contents as a dense row-major double vector (the reference's layout).
template <class T, int N>
std::vector<double> to_canonical(const TensorView<T, N>& v) {
  if (v.empty()) return {};
  std::vector<double> out(v.numel());
  detail::for_each_logical(v, [&](index_t flat, T& x) { out[flat] = static_cast<double>(x); });
  return out;
}

/// Writes dense row-major values into a (possibly strided) view.
template <class T, int N>
void from_canonical(const TensorView<T, N>& v, const std::vector<double>& values) {
  if (static_cast<index_t>(values.size()) != v.numel())
    throw std::invalid_argument("from_canonical: " + std::to_string(values.size()) +
                                " values for a view of " + std::to_string(v.numel()));
  detail::for_each_logical(v, [&](index_t flat, T& x) { x = static_cast<T>(values[flat]); });
}

// ---------------------------------------------------------------------------------------------
// The same problem in the production API's types
// ---------------------------------------------------------------------------------------------

/// Where the (B, H, T, D)-shaped activations (q, k, v, out, dout, dq, dk, dv) live in memory.
enum class Layout {
  bhtd,  ///< contiguous in the logical order
  bthd,  ///< (B, T, H, D) in memory, as after a fused QKV projection: exercises strides
};

/// A reference::Problem copied into buffers of scalar T, with the views the production entry
/// points take. Output and gradient buffers start as NaN, so a kernel that skips an element or
/// adds into a gradient instead of overwriting it cannot pass.
template <class T>
class TypedProblem {
 public:
  using Acc = acc_t<T>;

  explicit TypedProblem(const reference::Problem& p, Layout layout = Layout::bhtd)
      : p_(p), layout_(layout) {
    reference::detail::check(p);
    auto alloc4 = [](std::vector<T>& buf, index_t n, double fill) { buf.assign(n, T(fill)); };
    const double nan = std::numeric_limits<double>::quiet_NaN();
    alloc4(q_, p.B * p.H * p.T * p.D, 0);
    alloc4(k_, p.B * p.Hk * p.S * p.D, 0);
    alloc4(v_, p.B * p.Hk * p.S * p.Dv, 0);
    alloc4(dout_, p.B * p.H * p.T * p.Dv, 0);
    from_canonical(q_mut(), p.q);
    from_canonical(view4(k_.data(), p.Hk, p.S, p.D), p.k);
    from_canonical(view4(v_.data(), p.Hk, p.S, p.Dv), p.v);
    alloc4(out_, p.B * p.H * p.T * p.Dv, nan);
    alloc4(dq_, q_.size(), nan);
    alloc4(dk_, k_.size(), nan);
    alloc4(dv_, v_.size(), nan);
    lse_.assign(p.B * p.H * p.T, std::numeric_limits<Acc>::quiet_NaN());
    copy_side(p.pre, pre_, dpre_);
    copy_side(p.post, post_, dpost_);
  }

  const reference::Problem& problem() const { return p_; }
  Layout layout() const { return layout_; }

  /// OpenMP threads passed in config(); 0 = all.
  int num_threads = 0;
  Products products = Products::exact;

  AttentionConfig config() const {
    AttentionConfig c;
    c.mask = p_.causal ? Mask::causal : Mask::full;
    c.scale = p_.scale;
    c.window = p_.window;
    c.num_threads = num_threads;
    c.products = products;
    return c;
  }

  TensorView<const T, 4> q() const { return view4(q_.data(), p_.H, p_.T, p_.D); }
  TensorView<const T, 4> k() const { return view4(k_.data(), p_.Hk, p_.S, p_.D); }
  TensorView<const T, 4> v() const { return view4(v_.data(), p_.Hk, p_.S, p_.Dv); }
  TensorView<T, 4> out() { return view4(out_.data(), p_.H, p_.T, p_.Dv); }
  TensorView<Acc, 3> lse() { return view<3>(lse_.data(), {p_.B, p_.H, p_.T}); }
  TensorView<const T, 4> dout() const { return view4(dout_.data(), p_.H, p_.T, p_.Dv); }
  TensorView<T, 4> dq() { return view4(dq_.data(), p_.H, p_.T, p_.D); }
  TensorView<T, 4> dk() { return view4(dk_.data(), p_.Hk, p_.S, p_.D); }
  TensorView<T, 4> dv() { return view4(dv_.data(), p_.Hk, p_.S, p_.Dv); }

  /// The upstream gradient for backward, (B, H, T, Dv) row-major.
  void set_dout(const std::vector<double>& dout) {
    from_canonical(view4(dout_.data(), p_.H, p_.T, p_.Dv), dout);
  }

  ComposeWeights<T> compose() const { return {terms(p_.pre, pre_), terms(p_.post, post_)}; }
  ComposeGrads<T> dcompose() { return {term_grads(p_.pre, dpre_), term_grads(p_.post, dpost_)}; }

  /// Results read back in the reference's layouts.
  std::vector<double> out_values() const {
    return to_canonical(view4(out_.data(), p_.H, p_.T, p_.Dv));
  }
  std::vector<double> lse_values() const {
    return to_canonical(view<3>(lse_.data(), {p_.B, p_.H, p_.T}));
  }
  reference::Gradients gradients() const {
    reference::Gradients g;
    g.dq = to_canonical(view4(dq_.data(), p_.H, p_.T, p_.D));
    g.dk = to_canonical(view4(dk_.data(), p_.Hk, p_.S, p_.D));
    g.dv = to_canonical(view4(dv_.data(), p_.Hk, p_.S, p_.Dv));
    g.dpre = read_side(p_.pre, dpre_);
    g.dpost = read_side(p_.post, dpost_);
    return g;
  }

 private:
  struct SideBuffers {
    std::vector<T> w, qw1, qw2, kw1, kw2, qdd, kdd;
  };

  template <class U>
  TensorView<U, 4> view4(U* data, index_t H, index_t L, index_t D) const {
    return layout_ == Layout::bthd ? bthd(data, p_.B, L, H, D) : bhtd(data, p_.B, H, L, D);
  }
  TensorView<T, 4> q_mut() { return view4(q_.data(), p_.H, p_.T, p_.D); }

  index_t M() const { return p_.H / p_.G; }
  Shape<3> w_shape() const { return {p_.G, M(), M()}; }
  Shape<5> lowrank_shape(index_t L, index_t R) const { return {p_.B, L, p_.G, R, M()}; }
  Shape<4> gate_shape(index_t L) const { return {p_.B, L, p_.G, M()}; }

  static std::vector<T> cast(const std::vector<double>& x) {
    return std::vector<T>(x.begin(), x.end());
  }

  static void copy_side(const reference::ComposeSide& c, SideBuffers& in, SideBuffers& grad) {
    const T nan = std::numeric_limits<T>::quiet_NaN();
    auto both = [&](std::vector<T> SideBuffers::*field, const std::vector<double>& src) {
      in.*field = cast(src);
      (grad.*field).assign(src.size(), nan);
    };
    if (c.static_w) both(&SideBuffers::w, c.w);
    if (c.query_wise) {
      both(&SideBuffers::qw1, c.qw1);
      both(&SideBuffers::qw2, c.qw2);
      both(&SideBuffers::qdd, c.qdd);
    }
    if (c.key_wise) {
      both(&SideBuffers::kw1, c.kw1);
      both(&SideBuffers::kw2, c.kw2);
      both(&SideBuffers::kdd, c.kdd);
    }
  }

  /// Views of one side's buffers (compose inputs or their gradients: the same fields).
  template <class Terms, class Buffers>
  Terms side_views(const reference::ComposeSide& c, Buffers& b) const {
    Terms t;
    if (c.static_w) t.w = view<3>(b.w.data(), w_shape());
    if (c.query_wise) {
      t.qw1 = view<5>(b.qw1.data(), lowrank_shape(p_.T, c.Rq));
      t.qw2 = view<5>(b.qw2.data(), lowrank_shape(p_.T, c.Rq));
      t.qdd = view<4>(b.qdd.data(), gate_shape(p_.T));
    }
    if (c.key_wise) {
      t.kw1 = view<5>(b.kw1.data(), lowrank_shape(p_.S, c.Rk));
      t.kw2 = view<5>(b.kw2.data(), lowrank_shape(p_.S, c.Rk));
      t.kdd = view<4>(b.kdd.data(), gate_shape(p_.S));
    }
    return t;
  }

  ComposeTerms<T> terms(const reference::ComposeSide& c, const SideBuffers& b) const {
    ComposeTerms<T> t = side_views<ComposeTerms<T>>(c, b);
    t.static_w = c.static_w;
    t.query_wise = c.query_wise;
    t.key_wise = c.key_wise;
    return t;
  }

  ComposeTermGrads<T> term_grads(const reference::ComposeSide& c, SideBuffers& b) {
    return side_views<ComposeTermGrads<T>>(c, b);
  }

  static reference::ComposeSide read_side(const reference::ComposeSide& c, const SideBuffers& b) {
    reference::ComposeSide r = reference::detail::zeros_like(c);
    auto rd = [](const std::vector<T>& x) { return std::vector<double>(x.begin(), x.end()); };
    if (c.static_w) r.w = rd(b.w);
    if (c.query_wise) {
      r.qw1 = rd(b.qw1);
      r.qw2 = rd(b.qw2);
      r.qdd = rd(b.qdd);
    }
    if (c.key_wise) {
      r.kw1 = rd(b.kw1);
      r.kw2 = rd(b.kw2);
      r.kdd = rd(b.kdd);
    }
    return r;
  }

  reference::Problem p_;
  Layout layout_;
  std::vector<T> q_, k_, v_, out_, dout_, dq_, dk_, dv_;
  std::vector<Acc> lse_;
  SideBuffers pre_, post_, dpre_, dpost_;
};

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// max |got - expected| / max(1, max |expected|); a size mismatch or a non-finite got is +inf,
/// so a NaN can never hide inside a max().
template <class T>
double max_rel_error(const std::vector<double>& expected, const T* got, size_t n) {
  if (n != expected.size()) return std::numeric_limits<double>::infinity();
  double err = 0, ref = 1;
  for (size_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(got[i]);
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::abs(g - expected[i]));
    ref = std::max(ref, std::abs(expected[i]));
  }
  return err / ref;
}
template <class T>
double max_rel_error(const std::vector<double>& expected, const T* got) {
  return max_rel_error(expected, got, expected.size());
}
template <class T>
double max_rel_error(const std::vector<double>& expected, const std::vector<T>& got) {
  return max_rel_error(expected, got.data(), got.size());
}

/// max |got - expected|, +inf on a size mismatch or a non-finite got.
template <class T>
double max_abs_error(const std::vector<double>& expected, const std::vector<T>& got) {
  if (got.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double err = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]);
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::abs(g - expected[i]));
  }
  return err;
}

/// Names of every gradient in file spelling, with the matching tensor of g. Only the
/// switched-on terms are listed, in a fixed order, so two Gradients of the same problem pair
/// up entry by entry. Works on const and mutable Gradients alike.
template <class Grads>
inline auto named_gradients(Grads& g) {
  static_assert(std::is_same_v<std::remove_const_t<Grads>, reference::Gradients>);
  using Vec =
      std::conditional_t<std::is_const_v<Grads>, const std::vector<double>, std::vector<double>>;
  using Side = std::conditional_t<std::is_const_v<Grads>, const reference::ComposeSide,
                                  reference::ComposeSide>;
  std::vector<std::pair<std::string, Vec*>> out = {
      {"grad_q", &g.dq}, {"grad_k", &g.dk}, {"grad_v", &g.dv}};
  for (const auto& [side, c] :
       {std::pair<std::string, Side*>{"pre", &g.dpre}, {"post", &g.dpost}}) {
    const std::string prefix = "grad_" + side + "_";
    if (c->static_w) out.emplace_back(prefix + "w", &c->w);
    if (c->query_wise) {
      out.emplace_back(prefix + "qw1", &c->qw1);
      out.emplace_back(prefix + "qw2", &c->qw2);
      out.emplace_back(prefix + "qdd", &c->qdd);
    }
    if (c->key_wise) {
      out.emplace_back(prefix + "kw1", &c->kw1);
      out.emplace_back(prefix + "kw2", &c->kw2);
      out.emplace_back(prefix + "kdd", &c->kdd);
    }
  }
  return out;
}

struct TensorError {
  std::string name;  // grad_q, grad_pre_qw1, ... (the conformance files' names)
  double abs = 0, rel = 0;
};

/// Per-tensor errors of got against expected, for every switched-on gradient of expected. Both
/// must come from the same problem (same switches).
inline std::vector<TensorError> gradient_errors(const reference::Gradients& expected,
                                                const reference::Gradients& got) {
  const auto e = named_gradients(expected);
  const auto g = named_gradients(got);
  std::vector<TensorError> errs;
  for (size_t i = 0; i < e.size(); ++i) {
    const double inf = std::numeric_limits<double>::infinity();
    const bool same = i < g.size() && g[i].first == e[i].first;
    errs.push_back({e[i].first, same ? max_abs_error(*e[i].second, *g[i].second) : inf,
                    same ? max_rel_error(*e[i].second, *g[i].second) : inf});
  }
  return errs;
}

}  // namespace dcmha::test

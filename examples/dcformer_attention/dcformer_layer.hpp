#pragma once
// The DCFormer attention layer (dcmha spec, section 4 "kind layer"), forward and backward, on the
// public dcmha API:
//
//   qkv = x wqkvᵀ                     fused projection, rows of wqkv: q heads, k heads, v heads
//   q, k <- RMSNorm_D(q, k) * scale   optional qk-norm (eps 1e-6 by default)
//   q, k <- RoPE(q, k)                pairs (d, d + D/2) rotated by the rope_cos / rope_sin tables
//   dw   = projection(x)              dcmha::dynamic_weights_forward (compose only)
//   o    = attention(q, k, v, dw)     dcmha::forward: causal, optional sliding window
//   y    = o woᵀ                      o merged as (B, T, H·D)
//
// With LayerConfig::compose off the layer is plain multi-head attention: no projection, and the
// attention core runs with every compose term off.
//
// T is float, double, dcmha::bf16 or dcmha::half. In the half types every tensor the caller sees
// (x, y, weights, gradients, RoPE tables) and every activation the cache keeps is stored in T;
// the arithmetic is float on widened values, each result rounded once: the dense products on
// panels widened one at a time (no float copy of a weight), RMS norm and RoPE per head.
//
// Every tensor is a dcmha::TensorView over caller memory in row-major (C) order, in the official
// DCFormer checkpoint layout: x, y (B, T, E); wqkv ((H + 2Hk)·D, E); wo (E, H·D); dw1 (E, G, 4,
// K); qkw (G, 4, K, 2R, M) with M = H / G; dd (E, G, 4M); q_norm, k_norm (D); rope cos / sin (at
// least T rows, D/2). Gradients are overwritten, never accumulated. Invalid arguments throw
// dcmha::Error naming the argument and the expected value, before any output is written.
#include <dcmha/dcmha.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <array>
#include <cmath>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace dcformer {

using dcmha::index_t;
using dcmha::TensorView;

struct LayerConfig {
  index_t E = 0;   ///< model width
  index_t H = 0;   ///< query heads
  index_t Hk = 0;  ///< key / value heads (GQA: divides H)
  index_t D = 0;   ///< head dim of q, k and v (even: RoPE pairs d with d + D/2)
  /// DCMHA (true) or plain multi-head attention (false: no projection, no compose weights).
  bool compose = true;
  index_t G = 1;  ///< compose groups (M = H / G heads each)
  index_t R = 2;  ///< rank of the dynamic low-rank terms
  index_t K = 0;  ///< hidden width of the projection per split; 0: 4·M (official)
  dcmha::Gelu gelu = dcmha::Gelu::erf;
  bool qk_norm = false;    ///< RMS-normalize q and k over D, times q_norm / k_norm
  double norm_eps = 1e-6;  ///< epsilon of the qk-norm
  index_t window = 0;      ///< 0: global causal layer; W > 0: local layer, W keys per query
  double scale = 0.0;      ///< score scale; 0: 1/sqrt(D)
  int num_threads = 0;     ///< dcmha's OpenMP threads; 0: all

  index_t M() const { return G > 0 ? H / G : 0; }
  index_t hidden() const { return K > 0 ? K : 4 * M(); }
  index_t qkv_width() const { return (H + 2 * Hk) * D; }
};

/// Parameters. dw1, qkw, dd only with compose; q_norm, k_norm only with qk_norm (otherwise
/// empty: a parameter the layer would ignore is refused).
template <class T>
struct LayerWeights {
  TensorView<const T, 2> wqkv, wo;
  TensorView<const T, 4> dw1;
  TensorView<const T, 5> qkw;
  TensorView<const T, 3> dd;
  TensorView<const T, 1> q_norm, k_norm;
};

/// Their gradients, same shapes and the same rule for the optional ones.
template <class T>
struct LayerGrads {
  TensorView<T, 2> wqkv, wo;
  TensorView<T, 4> dw1;
  TensorView<T, 5> qkw;
  TensorView<T, 3> dd;
  TensorView<T, 1> q_norm, k_norm;
};

/// RoPE tables: row t holds cos and sin of the angles of position t (D/2 each).
template <class T>
struct Rope {
  TensorView<const T, 2> cos, sin;
};

/// Owning RoPE tables for positions [0, positions): angle t · base^(-2d/D), d < D/2.
template <class T>
struct RopeTables {
  index_t positions = 0, half = 0;
  std::vector<T> cos, sin;

  Rope<T> views() const {
    return {dcmha::view<2>(cos.data(), {positions, half}),
            dcmha::view<2>(sin.data(), {positions, half})};
  }
};

template <class T>
RopeTables<T> make_rope_tables(index_t positions, index_t head_dim, double base = 10000.0) {
  if (positions <= 0 || head_dim <= 0 || head_dim % 2 != 0 || !(base > 0.0)) {
    std::ostringstream os;
    os << "dcformer::make_rope_tables: expected positions > 0, an even head_dim > 0 and base > 0, "
       << "got " << positions << ", " << head_dim << ", " << base;
    throw dcmha::Error(os.str());
  }
  RopeTables<T> r;
  r.positions = positions;
  r.half = head_dim / 2;
  r.cos.resize(static_cast<std::size_t>(positions * r.half));
  r.sin.resize(r.cos.size());
  for (index_t t = 0; t < positions; ++t)
    for (index_t d = 0; d < r.half; ++d) {
      const double inv_freq = std::pow(base, -2.0 * double(d) / double(head_dim));
      const double angle = double(t) * inv_freq;
      r.cos[static_cast<std::size_t>(t * r.half + d)] = static_cast<T>(std::cos(angle));
      r.sin[static_cast<std::size_t>(t * r.half + d)] = static_cast<T>(std::sin(angle));
    }
  return r;
}

/// What forward keeps for backward (one per layer and step, like any saved activation), and the
/// backward's scratch. Its memory is O(B·T·(E + H·D)) plus dcmha's own; never B·H·T·S.
template <class T>
struct LayerCache {
  index_t batch = 0, length = 0;  // B and T of the forward's x
  LayerConfig config;             // of the forward
  std::vector<T> qkv;             // (B·T, (H + 2Hk)·D): x wqkvᵀ, v read from here
  std::vector<T> q, k;            // (B, T, H|Hk, D): after qk-norm and RoPE
  std::vector<dcmha::acc_t<T>> q_inv_rms, k_inv_rms;  // (B·T, H|Hk): qk-norm's 1 / rms
  std::vector<T> o;                                   // (B, T, H, D): the attention output
  std::vector<dcmha::acc_t<T>> lse;                   // (B, H, T): softmax statistics
  dcmha::DynamicWeightsStorage<T> dw;
  dcmha::ProjectionActivations<T> projection;
  /// dcmha's kernel buffers: set to share one Workspace among the layers a thread runs (one
  /// call at a time); null: the cache's own.
  dcmha::Workspace* shared_workspace = nullptr;
  dcmha::Workspace own_workspace;
  dcmha::Workspace& workspace() { return shared_workspace ? *shared_workspace : own_workspace; }
  // Backward scratch: d o, d qkv, the projection's dx, the dynamic weights' gradients.
  std::vector<T> d_o, dqkv, dx_projection;
  dcmha::DynamicWeightsStorage<T> ddw;
};

namespace detail {

template <class X>
struct identity {
  using type = X;
};
/// Keeps a parameter out of template argument deduction (T comes from the weights).
template <class X>
using nondeduced = typename identity<X>::type;

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using ConstMatrixMap = Eigen::Map<const RowMatrix<T>>;
template <class T>
using MatrixMap = Eigen::Map<RowMatrix<T>>;

/// Whether T is stored narrower than its arithmetic (bf16, half).
template <class T>
constexpr bool is_narrow = !std::is_same_v<T, dcmha::acc_t<T>>;

/// Columns of a narrow product computed per panel: 256 × E floats of a weight at a time.
constexpr index_t kProductPanel = 256;

/// out = a · b (+ addend, of out's shape), a and b Eigen expressions over T. float and double:
/// Eigen on the caller's buffers. bf16 and half: Eigen's float product on a widened once and b
/// widened panel by panel, each result rounded once (Eigen's product on narrow scalars would
/// round after every multiply-add).
template <class T, class A, class B>
void product(const A& a, const B& b, MatrixMap<T> out, const T* addend = nullptr) {
  if constexpr (!is_narrow<T>) {
    out.noalias() = a * b;
    if (addend) out += ConstMatrixMap<T>(addend, out.rows(), out.cols());
  } else {
    const Eigen::MatrixXf a32 = a.template cast<float>();
    for (index_t j = 0; j < out.cols(); j += kProductPanel) {
      const index_t width = std::min(kProductPanel, index_t(out.cols()) - j);
      Eigen::MatrixXf panel = a32 * b.middleCols(j, width).template cast<float>();
      if (addend)
        panel += ConstMatrixMap<T>(addend, out.rows(), out.cols())
                     .middleCols(j, width)
                     .template cast<float>();
      out.middleCols(j, width) = panel.template cast<T>();
    }
  }
}

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw dcmha::Error(os.str());
}

template <std::size_t N>
std::string shape_string(const std::array<index_t, N>& s) {
  std::ostringstream os;
  os << '(';
  for (std::size_t i = 0; i < N; ++i) os << (i ? ", " : "") << s[i];
  os << ')';
  return os.str();
}

/// v must be given, of shape `want`, row-major and contiguous.
template <class V>
void check_tensor(const char* fn, const std::string& name, const V& v,
                  const dcmha::Shape<V::rank>& want) {
  if (v.empty()) fail(fn, ": ", name, ": expected a tensor of shape ", shape_string(want));
  if (v.shape != want)
    fail(fn, ": ", name, ": expected shape ", shape_string(want), ", got ", shape_string(v.shape));
  if (v.stride != dcmha::contiguous_strides<V::rank>(v.shape))
    fail(fn, ": ", name, ": expected row-major contiguous strides ",
         shape_string(dcmha::contiguous_strides<V::rank>(v.shape)), ", got ",
         shape_string(v.stride));
}

/// v must be given with that shape when `on`, and must not be given otherwise.
template <class V>
void check_optional(const char* fn, const std::string& name, const V& v,
                    const dcmha::Shape<V::rank>& want, bool on, const char* off_reason) {
  if (on) return check_tensor(fn, name, v, want);
  if (!v.empty())
    fail(fn, ": ", name, ": expected no tensor (", off_reason, "), got one of shape ",
         shape_string(v.shape));
}

inline void check_config(const char* fn, const LayerConfig& c) {
  if (c.E <= 0 || c.H <= 0 || c.Hk <= 0 || c.D <= 0)
    fail(fn, ": config: expected E, H, Hk, D > 0, got ", c.E, ", ", c.H, ", ", c.Hk, ", ", c.D);
  if (c.H % c.Hk != 0) fail(fn, ": config.Hk: expected a divisor of H = ", c.H, ", got ", c.Hk);
  if (c.D % 2 != 0) fail(fn, ": config.D: expected an even head dim (RoPE pairs), got ", c.D);
  if (c.window < 0) fail(fn, ": config.window: expected >= 0, got ", c.window);
  if (c.qk_norm && !(c.norm_eps > 0.0))
    fail(fn, ": config.norm_eps: expected > 0, got ", c.norm_eps);
  if (!c.compose) return;
  if (c.G <= 0 || c.H % c.G != 0)
    fail(fn, ": config.G: expected a divisor of H = ", c.H, ", got ", c.G);
  if (c.R <= 0) fail(fn, ": config.R: expected >= 1, got ", c.R);
  if (c.K < 0) fail(fn, ": config.K: expected >= 0 (0: 4·M), got ", c.K);
}

/// The shapes of the parameters (and of their gradients), checked under the names prefix.*.
template <class P>
void check_parameters(const char* fn, const LayerConfig& c, const P& p, const std::string& prefix) {
  check_tensor(fn, prefix + ".wqkv", p.wqkv, {c.qkv_width(), c.E});
  check_tensor(fn, prefix + ".wo", p.wo, {c.E, c.H * c.D});
  const index_t G = c.G, M = c.M(), K = c.hidden();
  const char* no_compose = "config.compose is off";
  check_optional(fn, prefix + ".dw1", p.dw1, {c.E, G, 4, K}, c.compose, no_compose);
  check_optional(fn, prefix + ".qkw", p.qkw, {G, 4, K, 2 * c.R, M}, c.compose, no_compose);
  check_optional(fn, prefix + ".dd", p.dd, {c.E, G, 4 * M}, c.compose, no_compose);
  const char* no_norm = "config.qk_norm is off";
  check_optional(fn, prefix + ".q_norm", p.q_norm, {c.D}, c.qk_norm, no_norm);
  check_optional(fn, prefix + ".k_norm", p.k_norm, {c.D}, c.qk_norm, no_norm);
}

/// x (B, T, E) with B, T > 0; the RoPE tables cover positions [0, T).
template <class T>
void check_input(const char* fn, const LayerConfig& c, TensorView<const T, 3> x,
                 const Rope<T>& rope) {
  if (x.empty() || x.shape[0] <= 0 || x.shape[1] <= 0)
    fail(fn, ": x: expected a tensor (B, T, ", c.E, ") with B, T > 0");
  check_tensor(fn, "x", x, {x.shape[0], x.shape[1], c.E});
  for (const auto* tab : {&rope.cos, &rope.sin}) {
    const char* name = tab == &rope.cos ? "rope.cos" : "rope.sin";
    const index_t rows = tab->empty() ? 0 : tab->shape[0];
    if (rows < x.shape[1])
      fail(fn, ": ", name, ": expected at least T = ", x.shape[1], " rows (positions), got ", rows);
    check_tensor(fn, name, *tab, {rows, c.D / 2});
  }
}

inline dcmha::AttentionConfig attention_config(const LayerConfig& c) {
  dcmha::AttentionConfig a;
  a.mask = dcmha::Mask::causal;
  a.window = c.window;
  a.scale = c.scale;
  a.num_threads = c.num_threads;
  return a;
}

inline dcmha::ProjectionConfig projection_config(const LayerConfig& c) {
  dcmha::ProjectionConfig p;
  p.gelu = c.gelu;
  p.num_threads = c.num_threads;
  return p;
}

template <class T>
dcmha::DynamicWeightProjection<T> projection_parameters(const LayerWeights<T>& w) {
  return {w.dw1, w.qkw, w.dd};
}

/// count heads starting at column `column` of the rows of a (B·T, width) buffer, as dcmha's
/// logical (B, count, T, D).
template <class T>
TensorView<T, 4> fused_heads(T* base, const LayerConfig& c, index_t B, index_t T_, index_t count,
                             index_t column) {
  const index_t width = c.qkv_width();
  return dcmha::view<4>(base + column, {B, count, T_, c.D}, {T_ * width, c.D, width, 1});
}

/// The q heads, k heads or v heads of the fused projection.
template <class T>
struct HeadSet {
  index_t count = 0, column = 0;       // heads; their first column in a qkv row
  T* out = nullptr;                    // (B·T, count, D): normalized and rotated
  dcmha::acc_t<T>* inv_rms = nullptr;  // (B·T, count): qk-norm only
  const T* norm_scale = nullptr;       // D values; null: no qk-norm
};

/// Rotates pairs (d, d + D/2) of v (in the arithmetic type A) by the angles of one position:
/// v' = R v.
template <class A, class T>
void rotate(A* v, const T* cos, const T* sin, index_t half) {
  for (index_t d = 0; d < half; ++d) {
    const A a = v[d], b = v[d + half], c = A(cos[d]), s = A(sin[d]);
    v[d] = a * c - b * s;
    v[d + half] = b * c + a * s;
  }
}

/// The gradient through rotate: g <- Rᵀ g.
template <class A, class T>
void rotate_backward(A* g, const T* cos, const T* sin, index_t half) {
  for (index_t d = 0; d < half; ++d) {
    const A a = g[d], b = g[d + half], c = A(cos[d]), s = A(sin[d]);
    g[d] = a * c + b * s;
    g[d + half] = b * c - a * s;
  }
}

/// out = in / rms(in) * scale, out in the arithmetic type A; returns 1 / rms(in).
template <class T, class A>
A rms_norm(const T* in, const T* scale, index_t D, double eps, A* out) {
  double sum_sq = 0.0;
  for (index_t i = 0; i < D; ++i) sum_sq += double(in[i]) * double(in[i]);
  const A r = static_cast<A>(1.0 / std::sqrt(sum_sq / double(D) + eps));
  for (index_t i = 0; i < D; ++i) out[i] = A(in[i]) * r * A(scale[i]);
  return r;
}

/// g: in d(out), out d(in), in the arithmetic type A; dscale accumulates d(scale).
template <class T, class A>
void rms_norm_backward(const T* in, const T* scale, A r, index_t D, A* g, double* dscale) {
  double dot = 0.0;  // sum_i d(out)_i · scale_i · in_i
  for (index_t i = 0; i < D; ++i) {
    dscale[i] += double(g[i]) * double(in[i]) * double(r);
    dot += double(g[i]) * double(scale[i]) * double(in[i]);
  }
  const A coef = static_cast<A>(double(r) * double(r) * double(r) * dot / double(D));
  for (index_t i = 0; i < D; ++i) g[i] = r * g[i] * A(scale[i]) - coef * A(in[i]);
}

template <class T>
void norm_and_rotate(const LayerConfig& c, const Rope<T>& rope, index_t rows, index_t T_,
                     const T* qkv, const HeadSet<T>& hs) {
  using A = dcmha::acc_t<T>;
  const index_t width = c.qkv_width(), half = c.D / 2;
  std::vector<A> head(static_cast<std::size_t>(c.D));  // one head, rounded to T once at the end
  for (index_t r = 0; r < rows; ++r) {
    const T* cos = &rope.cos(r % T_, 0);
    const T* sin = &rope.sin(r % T_, 0);
    for (index_t j = 0; j < hs.count; ++j) {
      const T* in = qkv + r * width + hs.column + j * c.D;
      if (hs.norm_scale)
        hs.inv_rms[r * hs.count + j] = rms_norm(in, hs.norm_scale, c.D, c.norm_eps, head.data());
      else
        std::transform(in, in + c.D, head.begin(), [](T v) { return A(v); });
      rotate(head.data(), cos, sin, half);
      std::transform(head.begin(), head.end(), hs.out + (r * hs.count + j) * c.D,
                     [](A v) { return static_cast<T>(v); });
    }
  }
}

/// In place on the head's columns of dqkv (which hold d(q) or d(k) after RoPE); writes
/// d(norm scale) when the set has one.
template <class T>
void norm_and_rotate_backward(const LayerConfig& c, const Rope<T>& rope, index_t rows, index_t T_,
                              const T* qkv, const HeadSet<T>& hs, T* dqkv, T* dscale) {
  using A = dcmha::acc_t<T>;
  const index_t width = c.qkv_width(), half = c.D / 2;
  std::vector<double> acc(static_cast<std::size_t>(c.D), 0.0);
  std::vector<A> head(static_cast<std::size_t>(c.D));  // one head's gradient, rounded once
  for (index_t r = 0; r < rows; ++r) {
    const T* cos = &rope.cos(r % T_, 0);
    const T* sin = &rope.sin(r % T_, 0);
    for (index_t j = 0; j < hs.count; ++j) {
      T* g = dqkv + r * width + hs.column + j * c.D;
      std::transform(g, g + c.D, head.begin(), [](T v) { return A(v); });
      rotate_backward(head.data(), cos, sin, half);
      if (hs.norm_scale)
        rms_norm_backward(qkv + (g - dqkv), hs.norm_scale, hs.inv_rms[r * hs.count + j], c.D,
                          head.data(), acc.data());
      std::transform(head.begin(), head.end(), g, [](A v) { return static_cast<T>(v); });
    }
  }
  if (dscale)
    for (index_t i = 0; i < c.D; ++i) dscale[i] = static_cast<T>(acc[static_cast<std::size_t>(i)]);
}

template <class T>
HeadSet<T> q_heads(const LayerConfig& c, const LayerWeights<T>& w, LayerCache<T>& cache) {
  return {c.H, 0, cache.q.data(), cache.q_inv_rms.data(), c.qk_norm ? w.q_norm.data : nullptr};
}

template <class T>
HeadSet<T> k_heads(const LayerConfig& c, const LayerWeights<T>& w, LayerCache<T>& cache) {
  return {c.Hk, c.H * c.D, cache.k.data(), cache.k_inv_rms.data(),
          c.qk_norm ? w.k_norm.data : nullptr};
}

template <class T>
void resize_cache(const LayerConfig& c, index_t B, index_t T_, LayerCache<T>& cache) {
  const auto n = [](index_t v) { return static_cast<std::size_t>(v); };
  const index_t rows = B * T_;
  cache.batch = B;
  cache.length = T_;
  cache.config = c;
  cache.qkv.resize(n(rows * c.qkv_width()));
  cache.q.resize(n(rows * c.H * c.D));
  cache.k.resize(n(rows * c.Hk * c.D));
  cache.q_inv_rms.resize(c.qk_norm ? n(rows * c.H) : 0);
  cache.k_inv_rms.resize(c.qk_norm ? n(rows * c.Hk) : 0);
  cache.o.resize(n(rows * c.H * c.D));
  cache.lse.resize(n(rows * c.H));
  const auto& dw = cache.dw;
  if (c.compose && (dw.B != B || dw.L != T_ || dw.G != c.G || dw.R != c.R || dw.M != c.M()))
    cache.dw = dcmha::DynamicWeightsStorage<T>(B, T_, c.G, c.R, c.M());
}

/// The attention core on the cached q, k (rotated) and v (in qkv), into cache.o and cache.lse.
template <class T>
void attention_forward(const LayerConfig& c, LayerCache<T>& cache) {
  const index_t B = cache.batch, T_ = cache.length;
  const auto q = dcmha::bthd(cache.q.data(), B, T_, c.H, c.D);
  const auto k = dcmha::bthd(cache.k.data(), B, T_, c.Hk, c.D);
  const auto v = fused_heads(cache.qkv.data(), c, B, T_, c.Hk, (c.H + c.Hk) * c.D);
  const auto o = dcmha::bthd(cache.o.data(), B, T_, c.H, c.D);
  const auto lse = dcmha::view<3>(cache.lse.data(), {B, c.H, T_});
  dcmha::ComposeWeights<T> compose;  // default: every term off, i.e. multi-head attention
  if (c.compose) compose = dcmha::compose_weights<T>(cache.dw.views());
  dcmha::forward(attention_config(c), q, k, v, o, lse, compose, cache.workspace());
}

/// d(o) = dy wo and d(wo) = dyᵀ o.
template <class T>
void output_backward(const LayerConfig& c, const LayerWeights<T>& w, LayerCache<T>& cache,
                     const T* dy, T* dwo) {
  const index_t rows = cache.batch * cache.length, HD = c.H * c.D;
  const ConstMatrixMap<T> dY(dy, rows, c.E), Wo(w.wo.data, c.E, HD), O(cache.o.data(), rows, HD);
  cache.d_o.resize(static_cast<std::size_t>(rows * HD));
  product<T>(dY, Wo, MatrixMap<T>(cache.d_o.data(), rows, HD));
  product<T>(dY.transpose(), O, MatrixMap<T>(dwo, c.E, HD));
}

/// The attention core's backward: d(q), d(k), d(v) into their columns of cache.dqkv, and with
/// compose the dynamic weights' gradients into cache.ddw.
template <class T>
void attention_backward(const LayerConfig& c, LayerCache<T>& cache) {
  const index_t B = cache.batch, T_ = cache.length;
  cache.dqkv.resize(cache.qkv.size());
  T* dqkv = cache.dqkv.data();
  const auto q = dcmha::bthd(cache.q.data(), B, T_, c.H, c.D);
  const auto k = dcmha::bthd(cache.k.data(), B, T_, c.Hk, c.D);
  const auto v = fused_heads(cache.qkv.data(), c, B, T_, c.Hk, (c.H + c.Hk) * c.D);
  const auto d_o = dcmha::bthd(cache.d_o.data(), B, T_, c.H, c.D);
  const auto lse = dcmha::view<3>(cache.lse.data(), {B, c.H, T_});
  const auto dq = fused_heads(dqkv, c, B, T_, c.H, 0);
  const auto dk = fused_heads(dqkv, c, B, T_, c.Hk, c.H * c.D);
  const auto dv = fused_heads(dqkv, c, B, T_, c.Hk, (c.H + c.Hk) * c.D);
  if (!c.compose) {
    dcmha::backward(attention_config(c), q, k, v, lse, d_o, dq, dk, dv, {}, {}, cache.workspace());
    return;
  }
  auto& ddw = cache.ddw;
  if (ddw.B != B || ddw.L != T_ || ddw.G != c.G || ddw.R != c.R || ddw.M != c.M())
    ddw = dcmha::DynamicWeightsStorage<T>(B, T_, c.G, c.R, c.M());
  dcmha::backward(attention_config(c), q, k, v, lse, d_o, dq, dk, dv,
                  dcmha::compose_weights<T>(cache.dw.views()), dcmha::compose_grads(ddw.views()),
                  cache.workspace());
}

/// dx = d(qkv) wqkv (+ the projection's dx), d(wqkv) = d(qkv)ᵀ x, and the projection's
/// parameter gradients.
template <class T>
void input_backward(const LayerConfig& c, TensorView<const T, 3> x, const LayerWeights<T>& w,
                    LayerCache<T>& cache, TensorView<T, 3> dx, const LayerGrads<T>& g) {
  const index_t rows = cache.batch * cache.length, width = c.qkv_width();
  const ConstMatrixMap<T> dQKV(cache.dqkv.data(), rows, width), Wqkv(w.wqkv.data, width, c.E),
      X(x.data, rows, c.E);
  product<T>(dQKV.transpose(), X, MatrixMap<T>(g.wqkv.data, width, c.E));
  const T* dx_projection = nullptr;
  if (c.compose) {
    cache.dx_projection.resize(static_cast<std::size_t>(rows * c.E));
    dx_projection = cache.dx_projection.data();
    dcmha::dynamic_weights_backward(
        projection_config(c), x, projection_parameters(w), cache.projection, cache.ddw.views(),
        dcmha::view<3>(cache.dx_projection.data(), {cache.batch, cache.length, c.E}),
        dcmha::DynamicWeightProjectionGrads<T>{g.dw1, g.qkw, g.dd});
  }
  // dx = d(qkv) wqkv + the projection's dx, rounded once.
  product<T>(dQKV, Wqkv, MatrixMap<T>(dx.data, rows, c.E), dx_projection);
}

/// Everything but the thread count.
inline bool same_layer(const LayerConfig& a, const LayerConfig& b) {
  return a.E == b.E && a.H == b.H && a.Hk == b.Hk && a.D == b.D && a.compose == b.compose &&
         a.G == b.G && a.R == b.R && a.K == b.K && a.gelu == b.gelu && a.qk_norm == b.qk_norm &&
         a.norm_eps == b.norm_eps && a.window == b.window && a.scale == b.scale;
}

template <class T>
void check_backward_arguments(const char* fn, const LayerConfig& c, TensorView<const T, 3> x,
                              const LayerCache<T>& cache, TensorView<const T, 3> dy,
                              TensorView<T, 3> dx) {
  if (cache.batch != x.shape[0] || cache.length != x.shape[1])
    fail(fn, ": cache: expected the activations of a forward on x (B, T) = (", x.shape[0], ", ",
         x.shape[1], "), got those of (", cache.batch, ", ", cache.length, ")");
  if (!same_layer(cache.config, c))
    fail(fn, ": cache: expected the activations of a forward with this config, got another's");
  check_tensor(fn, "dy", dy, x.shape);
  check_tensor(fn, "dx", dx, x.shape);
}

}  // namespace detail

/// y = layer(x). Fills `cache` for backward (reuse one cache per layer: its buffers are kept).
template <class T>
void forward(const LayerConfig& cfg, detail::nondeduced<TensorView<const T, 3>> x,
             const Rope<T>& rope, const LayerWeights<T>& w, detail::nondeduced<TensorView<T, 3>> y,
             LayerCache<T>& cache) {
  const char* fn = "dcformer::forward";
  detail::check_config(fn, cfg);
  detail::check_input(fn, cfg, x, rope);
  detail::check_parameters(fn, cfg, w, "weights");
  detail::check_tensor(fn, "y", y, x.shape);

  const index_t B = x.shape[0], T_ = x.shape[1], rows = B * T_;
  detail::resize_cache(cfg, B, T_, cache);
  detail::product<T>(detail::ConstMatrixMap<T>(x.data, rows, cfg.E),
                     detail::ConstMatrixMap<T>(w.wqkv.data, cfg.qkv_width(), cfg.E).transpose(),
                     detail::MatrixMap<T>(cache.qkv.data(), rows, cfg.qkv_width()));
  detail::norm_and_rotate(cfg, rope, rows, T_, cache.qkv.data(), detail::q_heads(cfg, w, cache));
  detail::norm_and_rotate(cfg, rope, rows, T_, cache.qkv.data(), detail::k_heads(cfg, w, cache));
  if (cfg.compose)
    dcmha::dynamic_weights_forward(detail::projection_config(cfg), x,
                                   detail::projection_parameters(w), cache.dw.views(),
                                   cache.projection);
  detail::attention_forward(cfg, cache);
  detail::product<T>(detail::ConstMatrixMap<T>(cache.o.data(), rows, cfg.H * cfg.D),
                     detail::ConstMatrixMap<T>(w.wo.data, cfg.E, cfg.H * cfg.D).transpose(),
                     detail::MatrixMap<T>(y.data, rows, cfg.E));
}

/// Gradients of sum(y · dy) with respect to x and every parameter, from the cache of the forward
/// on the same x, rope and weights.
template <class T>
void backward(const LayerConfig& cfg, detail::nondeduced<TensorView<const T, 3>> x,
              const Rope<T>& rope, const LayerWeights<T>& w, LayerCache<T>& cache,
              detail::nondeduced<TensorView<const T, 3>> dy,
              detail::nondeduced<TensorView<T, 3>> dx, const LayerGrads<T>& g) {
  const char* fn = "dcformer::backward";
  detail::check_config(fn, cfg);
  detail::check_input(fn, cfg, x, rope);
  detail::check_parameters(fn, cfg, w, "weights");
  detail::check_backward_arguments(fn, cfg, x, cache, dy, dx);
  detail::check_parameters(fn, cfg, g, "grads");

  const index_t rows = cache.batch * cache.length;
  detail::output_backward(cfg, w, cache, dy.data, g.wo.data);
  detail::attention_backward(cfg, cache);
  detail::norm_and_rotate_backward(cfg, rope, rows, cache.length, cache.qkv.data(),
                                   detail::q_heads(cfg, w, cache), cache.dqkv.data(),
                                   g.q_norm.data);
  detail::norm_and_rotate_backward(cfg, rope, rows, cache.length, cache.qkv.data(),
                                   detail::k_heads(cfg, w, cache), cache.dqkv.data(),
                                   g.k_norm.data);
  detail::input_backward(cfg, x, w, cache, dx, g);
}

}  // namespace dcformer

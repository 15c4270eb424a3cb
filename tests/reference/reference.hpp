#pragma once
// The test reference of the attention core (spec section 1), double precision.
//
// Written to be checked by eye against the spec, not to be fast: it materializes the scores L,
// the composed scores L', the probabilities P and the composed probabilities P' in full (zero
// where the mask hides the key, since nothing reads them there), and its backward is the chain
// rule applied to those same arrays step by step, in reverse. Every other
// test compares the production kernels against this file, and tests/test_reference.cpp checks
// this file against finite differences and the official conformance cases.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcmha::reference {

/// One side (pre- or post-softmax) of Compose. Dense row-major tensors, canonical layouts.
struct ComposeSide {
  bool static_w = false, query_wise = false, key_wise = false;
  std::vector<double> w;  // (G, M, M)  [group, input head, output head]; residual NOT folded in
  std::vector<double> qw1, qw2;  // (B, T, G, Rq, M)
  std::vector<double> kw1, kw2;  // (B, S, G, Rk, M)
  std::vector<double> qdd;       // (B, T, G, M)
  std::vector<double> kdd;       // (B, S, G, M)
  int64_t Rq = 0, Rk = 0;

  bool enabled() const { return static_w || query_wise || key_wise; }
};

struct Problem {
  int64_t B = 1, H = 1, Hk = 1, T = 1, S = 1, D = 1, Dv = 1, G = 1;
  bool causal = false;    // bottom-right: t sees s iff s <= t + (S - T)
  int64_t window = 0;     // 0 = none; else also (t + S - T) - s < window
  double scale = 0;       // <= 0 means 1/sqrt(D)
  std::vector<double> q;  // (B, H, T, D)
  std::vector<double> k;  // (B, Hk, S, D)
  std::vector<double> v;  // (B, Hk, S, Dv)
  ComposeSide pre, post;
  // Per-sequence lengths (B values each; empty = all T / all S). Sequence b has query rows
  // [0, query_lengths[b]) and keys [0, key_lengths[b]); the rest is padding, and the causal
  // rule aligns the sequence's own lengths bottom-right.
  std::vector<int64_t> query_lengths, key_lengths;
};

/// Gradients of every input, same shapes and switches as the inputs.
struct Gradients {
  std::vector<double> dq, dk, dv;
  ComposeSide dpre, dpost;
};

namespace detail {

inline int64_t M_of(const Problem& p) { return p.H / p.G; }
inline double scale_of(const Problem& p) {
  return p.scale > 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.D));
}
inline int64_t kv_head(const Problem& p, int64_t h) { return h / (p.H / p.Hk); }

inline bool visible(const Problem& p, int64_t b, int64_t t, int64_t s) {
  const int64_t T = p.query_lengths.empty() ? p.T : p.query_lengths[size_t(b)];
  const int64_t S = p.key_lengths.empty() ? p.S : p.key_lengths[size_t(b)];
  if (t >= T || s >= S) return false;
  const int64_t last = t + (S - T);  // the key aligned with query t (bottom-right)
  if (p.causal && s > last) return false;
  if (p.window > 0 && last - s >= p.window) return false;
  return true;
}

inline void check_size(const char* what, const std::vector<double>& x, int64_t n) {
  if (static_cast<int64_t>(x.size()) != n)
    throw std::invalid_argument(std::string("dcmha::reference: ") + what + " has " +
                                std::to_string(x.size()) + " values, expected " +
                                std::to_string(n));
}

inline void check_side(const Problem& p, const ComposeSide& c) {
  const int64_t M = M_of(p);
  if (c.static_w) check_size("w", c.w, p.G * M * M);
  if (c.query_wise) {
    if (c.Rq < 1) throw std::invalid_argument("dcmha::reference: query_wise needs Rq >= 1");
    check_size("qw1", c.qw1, p.B * p.T * p.G * c.Rq * M);
    check_size("qw2", c.qw2, p.B * p.T * p.G * c.Rq * M);
    check_size("qdd", c.qdd, p.B * p.T * p.G * M);
  }
  if (c.key_wise) {
    if (c.Rk < 1) throw std::invalid_argument("dcmha::reference: key_wise needs Rk >= 1");
    check_size("kw1", c.kw1, p.B * p.S * p.G * c.Rk * M);
    check_size("kw2", c.kw2, p.B * p.S * p.G * c.Rk * M);
    check_size("kdd", c.kdd, p.B * p.S * p.G * M);
  }
}

inline void check(const Problem& p) {
  if (p.B < 1 || p.H < 1 || p.Hk < 1 || p.T < 1 || p.S < 1 || p.D < 1 || p.Dv < 1 || p.G < 1)
    throw std::invalid_argument("dcmha::reference: every size must be >= 1");
  if (p.H % p.Hk != 0) throw std::invalid_argument("dcmha::reference: Hk must divide H");
  if (p.H % p.G != 0) throw std::invalid_argument("dcmha::reference: G must divide H");
  check_size("q", p.q, p.B * p.H * p.T * p.D);
  check_size("k", p.k, p.B * p.Hk * p.S * p.D);
  check_size("v", p.v, p.B * p.Hk * p.S * p.Dv);
  check_side(p, p.pre);
  check_side(p, p.post);
}

// Index helpers, one per canonical layout.
inline int64_t at_bhtx(int64_t H, int64_t T, int64_t X, int64_t b, int64_t h, int64_t t,
                       int64_t x) {
  return ((b * H + h) * T + t) * X + x;
}
inline int64_t at_w(const Problem& p, int64_t g, int64_t m, int64_t n) {
  const int64_t M = M_of(p);
  return (g * M + m) * M + n;
}
inline int64_t at_lowrank(const Problem& p, int64_t L, int64_t R, int64_t b, int64_t l, int64_t g,
                          int64_t r, int64_t m) {
  const int64_t M = M_of(p);
  return (((b * L + l) * p.G + g) * R + r) * M + m;
}
inline int64_t at_gate(const Problem& p, int64_t L, int64_t b, int64_t l, int64_t g, int64_t m) {
  const int64_t M = M_of(p);
  return ((b * L + l) * p.G + g) * M + m;
}

/// The low-rank terms' projections of one group's heads ag at position l, sum_m ag[m] w1[r, m]
/// for r < R: the same for every output head, so computed once per group.
inline void lowrank_projections(const Problem& p, const std::vector<double>& w1, int64_t L,
                                int64_t R, int64_t b, int64_t l, int64_t g, const double* ag,
                                std::vector<double>& proj) {
  proj.assign(R, 0.0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < M_of(p); ++m) proj[r] += ag[m] * w1[at_lowrank(p, L, R, b, l, g, r, m)];
}

/// Buffers the callers keep across positions, so that the loops allocate nothing (the sanitized
/// suite's time is mostly this file).
struct ComposeScratch {
  std::vector<double> query_proj, key_proj;

  void project(const Problem& p, const ComposeSide& c, int64_t b, int64_t t, int64_t s, int64_t g,
               const double* ag) {
    if (c.query_wise) lowrank_projections(p, c.qw1, p.T, c.Rq, b, t, g, ag, query_proj);
    if (c.key_wise) lowrank_projections(p, c.kw1, p.S, c.Rk, b, s, g, ag, key_proj);
  }
};

/// Compose of the H values a[h] at one (b, t, s) into y: spec section 1, term by term.
inline void compose(const Problem& p, const ComposeSide& c, int64_t b, int64_t t, int64_t s,
                    const std::vector<double>& a, std::vector<double>& y, ComposeScratch& scratch) {
  const int64_t M = M_of(p);
  y = a;  // residual
  for (int64_t g = 0; g < p.G; ++g) {
    const double* ag = &a[g * M];
    double* yg = &y[g * M];
    scratch.project(p, c, b, t, s, g, ag);
    for (int64_t n = 0; n < M; ++n) {
      if (c.static_w)
        for (int64_t m = 0; m < M; ++m) yg[n] += ag[m] * c.w[at_w(p, g, m, n)];
      if (c.query_wise) {
        for (int64_t r = 0; r < c.Rq; ++r)
          yg[n] += scratch.query_proj[r] * c.qw2[at_lowrank(p, p.T, c.Rq, b, t, g, r, n)];
        yg[n] += ag[n] * c.qdd[at_gate(p, p.T, b, t, g, n)];
      }
      if (c.key_wise) {
        for (int64_t r = 0; r < c.Rk; ++r)
          yg[n] += scratch.key_proj[r] * c.kw2[at_lowrank(p, p.S, c.Rk, b, s, g, r, n)];
        yg[n] += ag[n] * c.kdd[at_gate(p, p.S, b, s, g, n)];
      }
    }
  }
}

/// One dynamic term of a side, query-wise (at position t) or key-wise (at s), at one position
/// and group: its low-rank weights as [R][M] blocks, its gate as an [M] block, and the same
/// blocks of their gradients.
struct DynamicTermAt {
  int64_t R;
  const double *w1, *w2, *dd;
  double *dw1, *dw2, *ddd;
};

inline DynamicTermAt dynamic_term_at(const Problem& p, const ComposeSide& c, ComposeSide& dc,
                                     bool query_wise, int64_t b, int64_t l, int64_t g) {
  const int64_t L = query_wise ? p.T : p.S, R = query_wise ? c.Rq : c.Rk;
  const int64_t lowrank = at_lowrank(p, L, R, b, l, g, 0, 0), gate = at_gate(p, L, b, l, g, 0);
  const std::vector<double>& w1 = query_wise ? c.qw1 : c.kw1;
  const std::vector<double>& w2 = query_wise ? c.qw2 : c.kw2;
  const std::vector<double>& dd = query_wise ? c.qdd : c.kdd;
  std::vector<double>& dw1 = query_wise ? dc.qw1 : dc.kw1;
  std::vector<double>& dw2 = query_wise ? dc.qw2 : dc.kw2;
  std::vector<double>& ddd = query_wise ? dc.qdd : dc.kdd;
  return {R, &w1[lowrank], &w2[lowrank], &dd[gate], &dw1[lowrank], &dw2[lowrank], &ddd[gate]};
}

/// Backward of a dynamic term: y[n] += sum_r proj[r] w2[r][n] + a[n] dd[n] with
/// proj[r] = sum_m a[m] w1[r][m], so the gradient reaching proj[r] is sum_n w2[r][n] dy[n].
inline void dynamic_term_backward(int64_t M, const DynamicTermAt& term,
                                  const std::vector<double>& proj, const double* ag,
                                  const double* dyg, double* dag) {
  for (int64_t r = 0; r < term.R; ++r) {
    double dproj = 0;
    for (int64_t n = 0; n < M; ++n) {
      dproj += term.w2[r * M + n] * dyg[n];
      term.dw2[r * M + n] += proj[r] * dyg[n];
    }
    for (int64_t m = 0; m < M; ++m) {
      dag[m] += term.w1[r * M + m] * dproj;
      term.dw1[r * M + m] += ag[m] * dproj;
    }
  }
  for (int64_t n = 0; n < M; ++n) {
    dag[n] += term.dd[n] * dyg[n];
    term.ddd[n] += ag[n] * dyg[n];
  }
}

/// Backward of compose() at one (b, t, s): d(a) for upstream dy into da, and the gradients of
/// the side's weights accumulated into dc. Term by term, as compose() adds them.
inline void compose_backward(const Problem& p, const ComposeSide& c, int64_t b, int64_t t,
                             int64_t s, const std::vector<double>& a, const std::vector<double>& dy,
                             ComposeSide& dc, std::vector<double>& da, ComposeScratch& scratch) {
  const int64_t M = M_of(p);
  da = dy;  // residual
  for (int64_t g = 0; g < p.G; ++g) {
    const double* ag = &a[g * M];
    const double* dyg = &dy[g * M];
    double* dag = &da[g * M];
    scratch.project(p, c, b, t, s, g, ag);
    if (c.static_w)
      for (int64_t n = 0; n < M; ++n)
        for (int64_t m = 0; m < M; ++m) {
          dag[m] += c.w[at_w(p, g, m, n)] * dyg[n];
          dc.w[at_w(p, g, m, n)] += ag[m] * dyg[n];
        }
    if (c.query_wise)
      dynamic_term_backward(M, dynamic_term_at(p, c, dc, true, b, t, g), scratch.query_proj, ag,
                            dyg, dag);
    if (c.key_wise)
      dynamic_term_backward(M, dynamic_term_at(p, c, dc, false, b, s, g), scratch.key_proj, ag, dyg,
                            dag);
  }
}

/// Zero gradients with the shapes and switches of c.
inline ComposeSide zeros_like(const ComposeSide& c) {
  ComposeSide z;
  z.static_w = c.static_w;
  z.query_wise = c.query_wise;
  z.key_wise = c.key_wise;
  z.Rq = c.Rq;
  z.Rk = c.Rk;
  if (c.static_w) z.w.assign(c.w.size(), 0.0);
  if (c.query_wise) {
    z.qw1.assign(c.qw1.size(), 0.0);
    z.qw2.assign(c.qw2.size(), 0.0);
    z.qdd.assign(c.qdd.size(), 0.0);
  }
  if (c.key_wise) {
    z.kw1.assign(c.kw1.size(), 0.0);
    z.kw2.assign(c.kw2.size(), 0.0);
    z.kdd.assign(c.kdd.size(), 0.0);
  }
  return z;
}

/// Every intermediate of the forward, each (B, H, T, S).
struct Intermediates {
  std::vector<double> L, Lc, P, Pc;  // L, L', P, P'
};

inline int64_t at_bhts(const Problem& p, int64_t b, int64_t h, int64_t t, int64_t s) {
  return at_bhtx(p.H, p.T, p.S, b, h, t, s);
}

/// The H values of x at (b, t, s) into a.
inline void heads_at(const Problem& p, const std::vector<double>& x, int64_t b, int64_t t,
                     int64_t s, std::vector<double>& a) {
  a.resize(p.H);
  for (int64_t h = 0; h < p.H; ++h) a[h] = x[at_bhts(p, b, h, t, s)];
}

/// x' = Compose(x) at every visible (b, t, s), zero at the others (a copy where the side is off).
/// Masked positions are left out because nothing reads them: softmax skips them in L', and
/// Compose is linear in its input, so the post side maps their P = 0 to P' = 0 exactly and takes
/// no gradient from them. Leaving them out halves the reference's time on causal problems.
inline std::vector<double> compose_all(const Problem& p, const ComposeSide& c,
                                       const std::vector<double>& x) {
  if (!c.enabled()) return x;
  std::vector<double> out(x.size(), 0.0), a, y;
  ComposeScratch scratch;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t t = 0; t < p.T; ++t)
      for (int64_t s = 0; s < p.S; ++s) {
        if (!visible(p, b, t, s)) continue;
        heads_at(p, x, b, t, s, a);
        compose(p, c, b, t, s, a, y, scratch);
        for (int64_t h = 0; h < p.H; ++h) out[at_bhts(p, b, h, t, s)] = y[h];
      }
  return out;
}

/// dx = d(x)/d(Compose(x)) applied to dy at every visible (b, t, s), zero at the others (see
/// compose_all); dc accumulates the side's weight gradients (dy itself where the side is off).
inline std::vector<double> compose_all_backward(const Problem& p, const ComposeSide& c,
                                                const std::vector<double>& x,
                                                const std::vector<double>& dy, ComposeSide& dc) {
  if (!c.enabled()) return dy;
  std::vector<double> dx(dy.size(), 0.0), a, g, da;
  ComposeScratch scratch;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t t = 0; t < p.T; ++t)
      for (int64_t s = 0; s < p.S; ++s) {
        if (!visible(p, b, t, s)) continue;
        heads_at(p, x, b, t, s, a);
        heads_at(p, dy, b, t, s, g);
        compose_backward(p, c, b, t, s, a, g, dc, da, scratch);
        for (int64_t h = 0; h < p.H; ++h) dx[at_bhts(p, b, h, t, s)] = da[h];
      }
  return dx;
}

inline Intermediates forward_intermediates(const Problem& p) {
  check(p);
  const double scale = scale_of(p);
  const int64_t n = p.B * p.H * p.T * p.S;
  Intermediates it;
  it.L.assign(n, 0.0);
  it.P.assign(n, 0.0);

  // 1. L = scale * Q K^T
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t s = 0; s < p.S; ++s) {
          if (!visible(p, b, t, s)) continue;  // unread: see compose_all
          double dot = 0;
          for (int64_t d = 0; d < p.D; ++d)
            dot += p.q[at_bhtx(p.H, p.T, p.D, b, h, t, d)] *
                   p.k[at_bhtx(p.Hk, p.S, p.D, b, kv_head(p, h), s, d)];
          it.L[at_bhts(p, b, h, t, s)] = scale * dot;
        }

  // 2. L' = Compose_pre(L), across heads at each (b, t, s)
  it.Lc = compose_all(p, p.pre, it.L);

  // 3-4. mask, P = softmax over the visible keys; a row with none stays all zero
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t t = 0; t < p.T; ++t) {
        double mx = -INFINITY;
        for (int64_t s = 0; s < p.S; ++s)
          if (visible(p, b, t, s)) mx = std::max(mx, it.Lc[at_bhts(p, b, h, t, s)]);
        if (mx == -INFINITY) continue;
        double sum = 0;
        for (int64_t s = 0; s < p.S; ++s)
          if (visible(p, b, t, s)) sum += std::exp(it.Lc[at_bhts(p, b, h, t, s)] - mx);
        for (int64_t s = 0; s < p.S; ++s)
          if (visible(p, b, t, s))
            it.P[at_bhts(p, b, h, t, s)] = std::exp(it.Lc[at_bhts(p, b, h, t, s)] - mx) / sum;
      }

  // 5. P' = Compose_post(P)
  it.Pc = compose_all(p, p.post, it.P);
  return it;
}

/// O (B, H, T, Dv) from the forward's intermediates.
inline std::vector<double> output(const Problem& p, const Intermediates& it) {
  std::vector<double> out(p.B * p.H * p.T * p.Dv, 0.0);
  // 6. O = P' V
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t s = 0; s < p.S; ++s) {
          if (!detail::visible(p, b, t, s)) continue;  // P' = 0 there
          for (int64_t e = 0; e < p.Dv; ++e)
            out[detail::at_bhtx(p.H, p.T, p.Dv, b, h, t, e)] +=
                it.Pc[detail::at_bhts(p, b, h, t, s)] *
                p.v[detail::at_bhtx(p.Hk, p.S, p.Dv, b, detail::kv_head(p, h), s, e)];
        }
  return out;
}

/// Gradients of sum(O * dout) with respect to every input, from the forward's intermediates.
inline Gradients gradients(const Problem& p, const Intermediates& it,
                           const std::vector<double>& dout) {
  check_size("dout", dout, p.B * p.H * p.T * p.Dv);
  const double scale = scale_of(p);
  const int64_t n = p.B * p.H * p.T * p.S;

  Gradients g;
  g.dq.assign(p.q.size(), 0.0);
  g.dk.assign(p.k.size(), 0.0);
  g.dv.assign(p.v.size(), 0.0);
  g.dpre = zeros_like(p.pre);
  g.dpost = zeros_like(p.post);

  // 6. O = P' V
  std::vector<double> dPc(n, 0.0);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t s = 0; s < p.S; ++s) {
          if (!visible(p, b, t, s)) continue;  // P' = 0 there, and its dP' is unread
          for (int64_t e = 0; e < p.Dv; ++e) {
            const double go = dout[at_bhtx(p.H, p.T, p.Dv, b, h, t, e)];
            const int64_t iv = at_bhtx(p.Hk, p.S, p.Dv, b, kv_head(p, h), s, e);
            dPc[at_bhts(p, b, h, t, s)] += go * p.v[iv];
            g.dv[iv] += go * it.Pc[at_bhts(p, b, h, t, s)];
          }
        }

  // 5. P' = Compose_post(P)
  const std::vector<double> dP = compose_all_backward(p, p.post, it.P, dPc, g.dpost);

  // 3-4. softmax: dL' = P * (dP - sum_s P dP); masked keys have P = 0 and get nothing
  std::vector<double> dLc(n, 0.0);
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t t = 0; t < p.T; ++t) {
        double dot = 0;
        for (int64_t s = 0; s < p.S; ++s)
          dot += it.P[at_bhts(p, b, h, t, s)] * dP[at_bhts(p, b, h, t, s)];
        for (int64_t s = 0; s < p.S; ++s) {
          const int64_t i = at_bhts(p, b, h, t, s);
          dLc[i] = it.P[i] * (dP[i] - dot);
        }
      }

  // 2. L' = Compose_pre(L)
  const std::vector<double> dL = compose_all_backward(p, p.pre, it.L, dLc, g.dpre);

  // 1. L = scale * Q K^T
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t s = 0; s < p.S; ++s) {
          if (!visible(p, b, t, s)) continue;  // dL = 0 there
          for (int64_t d = 0; d < p.D; ++d) {
            const double gl = scale * dL[at_bhts(p, b, h, t, s)];
            const int64_t iq = at_bhtx(p.H, p.T, p.D, b, h, t, d);
            const int64_t ik = at_bhtx(p.Hk, p.S, p.D, b, kv_head(p, h), s, d);
            g.dq[iq] += gl * p.k[ik];
            g.dk[ik] += gl * p.q[iq];
          }
        }
  return g;
}

}  // namespace detail

/// O (B, H, T, Dv).
inline std::vector<double> forward(const Problem& p) {
  return detail::output(p, detail::forward_intermediates(p));
}

/// Gradients of sum(forward(p) * dout) with respect to every input.
inline Gradients backward(const Problem& p, const std::vector<double>& dout) {
  return detail::gradients(p, detail::forward_intermediates(p), dout);
}

/// forward(p) and backward(p, dout) from one pass over the forward's intermediates.
struct ForwardAndBackward {
  std::vector<double> out;
  Gradients grads;
};

inline ForwardAndBackward forward_and_backward(const Problem& p, const std::vector<double>& dout) {
  const detail::Intermediates it = detail::forward_intermediates(p);
  return {detail::output(p, it), detail::gradients(p, it, dout)};
}

}  // namespace dcmha::reference

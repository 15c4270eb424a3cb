#pragma once
// The numbers of a fuzz case: random values for the reference problem (the tests' scales, see
// tests/support/problem.hpp) and the seeded memory layouts of the compose and projection tensors.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dcmha/config.hpp"
#include "fuzz_case.hpp"
#include "reference/reference.hpp"
#include "support/problem.hpp"

namespace dcmha::fuzz {

using test::Rng;

/// One compose side's tensors for B sequences of T query and S key positions. Low-rank terms are
/// scaled so that each changes a head's value by about 0.3 of its size (as random_problem does):
/// large enough that a wrong term shows, small enough that Compose stays well conditioned.
inline reference::ComposeSide random_side(Rng& rng, const SideSpec& s, std::int64_t B,
                                          std::int64_t T, std::int64_t S, std::int64_t G,
                                          std::int64_t M) {
  reference::ComposeSide c;
  c.static_w = s.static_w;
  c.query_wise = s.query_wise;
  c.key_wise = s.key_wise;
  auto lowrank_sd = [&](std::int64_t R) {
    return std::sqrt(0.3 / (double(R) * std::sqrt(double(M))));
  };
  if (s.static_w) c.w = rng.normal(size_t(G * M * M), 0.3 / std::sqrt(double(M)));
  if (s.query_wise) {
    c.Rq = s.Rq;
    c.qw1 = rng.normal(size_t(B * T * G * s.Rq * M), lowrank_sd(s.Rq));
    c.qw2 = rng.normal(size_t(B * T * G * s.Rq * M), lowrank_sd(s.Rq));
    c.qdd = rng.normal(size_t(B * T * G * M), 0.3);
  }
  if (s.key_wise) {
    c.Rk = s.Rk;
    c.kw1 = rng.normal(size_t(B * S * G * s.Rk * M), lowrank_sd(s.Rk));
    c.kw2 = rng.normal(size_t(B * S * G * s.Rk * M), lowrank_sd(s.Rk));
    c.kdd = rng.normal(size_t(B * S * G * M), 0.3);
  }
  return c;
}

inline reference::Problem attention_problem(const AttentionCase& a, std::uint64_t seed) {
  reference::Problem p;
  p.B = a.B;
  p.H = a.H;
  p.Hk = a.Hk;
  p.T = a.T;
  p.S = a.S;
  p.D = a.D;
  p.Dv = a.Dv;
  p.G = a.G;
  p.causal = a.causal;
  p.window = a.window;
  p.scale = a.scale;
  p.query_lengths = a.qlen;
  p.key_lengths = a.klen;
  Rng rng(seed);
  p.q = rng.normal(size_t(a.B * a.H * a.T * a.D), a.score_scale);
  p.k = rng.normal(size_t(a.B * a.Hk * a.S * a.D), a.score_scale);
  p.v = rng.normal(size_t(a.B * a.Hk * a.S * a.Dv), 1.0);
  p.pre = random_side(rng, a.pre, a.B, a.T, a.S, a.G, a.H / a.G);
  p.post = random_side(rng, a.post, a.B, a.T, a.S, a.G, a.H / a.G);
  return p;
}

inline double round_to_bf16(double x) {
  return double(static_cast<float>(bf16(static_cast<float>(x))));
}

inline void round_all(std::vector<double>& x) {
  for (double& e : x) e = round_to_bf16(e);
}

/// p with every input a bf16 value, so float and bf16 storage hold the same numbers.
inline void round_inputs_to_bf16(reference::Problem& p) {
  for (auto* x : {&p.q, &p.k, &p.v}) round_all(*x);
  for (auto* c : {&p.pre, &p.post})
    for (auto* x : {&c->w, &c->qw1, &c->qw2, &c->kw1, &c->kw2, &c->qdd, &c->kdd}) round_all(*x);
}

/// The layouts of tensors without a contiguity rule (compose weights, projection tensors), from
/// one kind byte and the case's seed: 0 dense, 1 gaps, 2 reversed order, 3 any order with gaps.
template <int N>
MemLayout<N> seeded_layout(Rng& rng, std::uint8_t kind) {
  MemLayout<N> l = MemLayout<N>::dense();
  if (kind == 0) return l;
  auto draw = [&](int n) { return int(rng.uniform() * n); };
  if (kind == 2) std::reverse(l.order.begin(), l.order.end());
  if (kind == 3)
    for (int i = N - 1; i > 0; --i) std::swap(l.order[size_t(i)], l.order[size_t(draw(i + 1))]);
  if (kind != 2) {
    for (index_t& g : l.gap) g = draw(3);
    l.offset = draw(4);
  }
  return l;
}

}  // namespace dcmha::fuzz

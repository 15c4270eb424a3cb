#pragma once
// Forward and backward against the reference (reference/reference.hpp), and their invalid calls.
//
// float and double: within the tests' tolerances (2e-4, 1e-9 relative to max(1, max |ref|)).
// bf16 storage: inputs rounded to bf16 values, then every result must be exactly the float
// kernels' result on the same values rounded once to bf16 (lse, float in both, the same bits),
// and the float run itself must match the reference.
// Always: lse of every row that sees keys matches the reference's; rows that see no key (padding
// rows among them) are exactly zero, as are the key gradients of padding keys; nothing outside an
// output's view is written.
#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_breaks.hpp"
#include "attention_tensors.hpp"
#include "report.hpp"
#include "support/problem.hpp"
#include "values.hpp"

namespace dcmha::fuzz {

template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, double> ? 1e-9 : 2e-4;
}

inline bool row_sees_keys(const reference::Problem& p, std::int64_t b, std::int64_t t) {
  for (std::int64_t s = 0; s < p.S; ++s)
    if (reference::detail::visible(p, b, t, s)) return true;
  return false;
}

/// x (B, H, T, width): rows of queries without a visible key must be exactly 0 (not NaN).
inline void expect_keyless_rows_zero(const std::string& name, const reference::Problem& p,
                                     const std::vector<double>& x, std::int64_t width) {
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t t = 0; t < p.T; ++t) {
      if (row_sees_keys(p, b, t)) continue;
      for (std::int64_t h = 0; h < p.H; ++h)
        for (std::int64_t e = 0; e < width; ++e) {
          const double v = x[size_t(((b * p.H + h) * p.T + t) * width + e)];
          if (v != 0.0)
            mismatch(name + ": row b" + std::to_string(b) + " h" + std::to_string(h) + " t" +
                     std::to_string(t) + " sees no key but element " + std::to_string(e) + " = " +
                     num(v) + " (expected exactly 0)");
        }
    }
}

/// x (B, Hk, S, width): gradients of padding keys (s >= key_lengths[b]) must be exactly 0.
inline void expect_padding_keys_zero(const std::string& name, const reference::Problem& p,
                                     const std::vector<double>& x, std::int64_t width) {
  if (p.key_lengths.empty()) return;
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hk; ++h)
      for (std::int64_t s = p.key_lengths[size_t(b)]; s < p.S; ++s)
        for (std::int64_t e = 0; e < width; ++e) {
          const double v = x[size_t(((b * p.Hk + h) * p.S + s) * width + e)];
          if (v != 0.0)
            mismatch(name + ": padding key b" + std::to_string(b) + " h" + std::to_string(h) +
                     " s" + std::to_string(s) + " element " + std::to_string(e) + " = " + num(v) +
                     " (expected exactly 0)");
        }
}

/// bf16 storage's result must be the float result rounded once.
inline void expect_rounded(const std::string& name, const std::vector<double>& f,
                           const std::vector<double>& h) {
  if (f.size() != h.size()) mismatch(name + ": bf16 and float results differ in size");
  for (size_t i = 0; i < f.size(); ++i)
    if (!(round_to_bf16(f[i]) == h[i]))
      mismatch(name + ": bf16 storage element " + std::to_string(i) + " = " + num(h[i]) +
               ", the float result rounded to bf16 = " + num(round_to_bf16(f[i])) + " (float " +
               num(f[i]) + ")");
}

template <class X>
void expect_untouched_outside(const std::string& name, const X& x) {
  if (!x.empty() && !x.outside_untouched()) mismatch(name + ": written outside its view");
}

struct ForwardResult {
  std::vector<double> out, lse;
};

/// The reference's out, and lse: the log of the sum of exp over each row's visible composed
/// scores (NaN for a row without keys, whose lse the contract leaves open and which is not
/// compared).
inline ForwardResult reference_forward(const reference::Problem& p) {
  ForwardResult r{reference::forward(p),
                  std::vector<double>(size_t(p.B * p.H * p.T), std::nan(""))};
  const reference::detail::Intermediates it = reference::detail::forward_intermediates(p);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.H; ++h)
      for (std::int64_t t = 0; t < p.T; ++t) {
        double mx = -INFINITY, sum = 0;
        for (std::int64_t s = 0; s < p.S; ++s)
          if (reference::detail::visible(p, b, t, s))
            mx = std::max(mx, it.Lc[size_t(reference::detail::at_bhts(p, b, h, t, s))]);
        if (mx == -INFINITY) continue;
        for (std::int64_t s = 0; s < p.S; ++s)
          if (reference::detail::visible(p, b, t, s))
            sum += std::exp(it.Lc[size_t(reference::detail::at_bhts(p, b, h, t, s))] - mx);
        r.lse[size_t((b * p.H + h) * p.T + t)] = mx + std::log(sum);
      }
  return r;
}

/// lse of the rows that see keys against the reference's.
inline void expect_lse_close(const std::vector<double>& want, const std::vector<double>& got,
                             double tol) {
  std::vector<double> w, g;
  for (size_t i = 0; i < want.size(); ++i)
    if (!std::isnan(want[i])) w.push_back(want[i]), g.push_back(got[i]);
  expect_close("lse", w, g, tol);
}

template <class T>
ForwardResult run_forward(const FuzzCase& c, const reference::Problem& p,
                          const ForwardResult* want) {
  AttentionTensors<T> t(c.attn, p, {}, c.seed);
  Workspace ws;
  Workspace* w = c.attn.workspace ? &ws : nullptr;
  const ForwardCall<T> call = t.forward_call(c.threads);
  expect_success("forward", [&] { call.run(w); });
  ForwardResult r{t.act[kOut].get(), t.lse.empty() ? std::vector<double>{} : t.lse.get()};
  if (want) {
    expect_close("out", want->out, r.out, tolerance<T>());
    if (!r.lse.empty()) expect_lse_close(want->lse, r.lse, tolerance<T>());
  }
  expect_keyless_rows_zero("out", p, r.out, p.Dv);
  expect_untouched_outside("out", t.act[kOut]);
  expect_untouched_outside("lse", t.lse);
  if (w) {  // again, through the buffers the first call left in the Workspace: the same bits
    expect_success("forward (second call)", [&] { call.run(w); });
    if (t.act[kOut].get() != r.out)
      mismatch("out: a second call through the same Workspace differs");
  }
  return r;
}

inline void check_forward(const FuzzCase& c) {
  reference::Problem p = attention_problem(c.attn, c.seed);
  if (c.scalar == Scalar::bf16) round_inputs_to_bf16(p);
  const ForwardResult want = reference_forward(p);
  if (c.scalar == Scalar::f64) {
    run_forward<double>(c, p, &want);
  } else if (c.scalar == Scalar::f32) {
    run_forward<float>(c, p, &want);
  } else {
    const ForwardResult f = run_forward<float>(c, p, &want);
    const ForwardResult h = run_forward<bf16>(c, p, nullptr);
    expect_rounded("out", f.out, h.out);
    for (size_t i = 0; i < f.lse.size(); ++i)
      if (!(f.lse[i] == h.lse[i]) && !(std::isnan(f.lse[i]) && std::isnan(h.lse[i])))
        mismatch("lse: bf16 storage element " + std::to_string(i) + " = " + num(h.lse[i]) +
                 ", float " + num(f.lse[i]));
  }
}

inline std::vector<double> random_dout(const reference::Problem& p, std::uint64_t seed) {
  return Rng(seed ^ 0xd0d0ull).normal(size_t(p.B * p.H * p.T * p.Dv), 1.0);
}

template <class T>
reference::Gradients run_backward(const FuzzCase& c, const reference::Problem& p,
                                  const std::vector<double>& dout,
                                  const reference::Gradients* want) {
  AttentionTensors<T> t(c.attn, p, dout, c.seed);
  Workspace ws;
  Workspace* w = c.attn.workspace ? &ws : nullptr;
  expect_success("forward (before backward)", [&] { t.forward_call(c.threads).run(w); });
  expect_success("backward", [&] { t.backward_call(c.threads).run(w); });
  const reference::Gradients got = t.gradients(p);
  if (want) {
    const auto e = test::named_gradients(*want);
    const auto g = test::named_gradients(got);
    for (size_t i = 0; i < e.size(); ++i)
      expect_close(e[i].first, *e[i].second, *g[i].second, tolerance<T>());
  }
  expect_keyless_rows_zero("grad_q", p, got.dq, p.D);
  expect_padding_keys_zero("grad_k", p, got.dk, p.D);
  expect_padding_keys_zero("grad_v", p, got.dv, p.Dv);
  expect_untouched_outside("grad_q", t.act[kDq]);
  expect_untouched_outside("grad_k", t.act[kDk]);
  expect_untouched_outside("grad_v", t.act[kDv]);
  for (int s = 0; s < 2; ++s)
    for_each_buffer(t.grad[s], [&](const char* name, const auto& b) {
      expect_untouched_outside(std::string(s ? "grad_post_" : "grad_pre_") + name, b);
    });
  return got;
}

inline void check_backward(const FuzzCase& c) {
  reference::Problem p = attention_problem(c.attn, c.seed);
  std::vector<double> dout = random_dout(p, c.seed);
  if (c.scalar == Scalar::bf16) round_inputs_to_bf16(p), round_all(dout);
  const reference::Gradients want = reference::backward(p, dout);
  if (c.scalar == Scalar::f64) {
    run_backward<double>(c, p, dout, &want);
  } else if (c.scalar == Scalar::f32) {
    run_backward<float>(c, p, dout, &want);
  } else {
    const reference::Gradients f = run_backward<float>(c, p, dout, &want);
    const reference::Gradients h = run_backward<bf16>(c, p, dout, nullptr);
    const auto fs = test::named_gradients(f);
    const auto hs = test::named_gradients(h);
    for (size_t i = 0; i < fs.size(); ++i)
      expect_rounded(fs[i].first, *fs[i].second, *hs[i].second);
  }
}

// --- invalid calls ------------------------------------------------------------------------------

/// The call must throw dcmha::Error and leave every output (and every arena buffer a break
/// moved an argument into) byte for byte as it was.
template <class T, class F>
void expect_rejected(const std::string& what, const AttentionTensors<T>& t, bool backward,
                     const Arena& arena, F&& call) {
  const auto outputs = t.output_bytes(backward);
  const auto moved = arena.snapshot();
  expect_error(what, call);
  if (t.output_bytes(backward) != outputs || !arena.same_as(moved))
    mismatch(what + ": the rejected call wrote to an output");
}

template <class T>
void check_invalid_attention(const FuzzCase& c) {
  const reference::Problem p = attention_problem(c.attn, c.seed);
  const bool backward = c.op == Op::backward;
  AttentionTensors<T> t(c.attn, p, backward ? random_dout(p, c.seed) : std::vector<double>{},
                        c.seed);
  Workspace ws;
  Workspace* w = c.attn.workspace ? &ws : nullptr;
  Arena arena;
  if (!backward) {
    ForwardCall<T> call = t.forward_call(c.threads);
    std::vector<AnyView> views = views_of(call);
    const std::string what =
        AttentionBreaker<T>(c.attn, call.cfg, call.compose, nullptr, views, arena).apply(c.brk);
    expect_rejected("forward with " + what, t, false, arena, [&] { call.run(w); });
    return;
  }
  expect_success("forward (before a broken backward)", [&] { t.forward_call(c.threads).run(w); });
  BackwardCall<T> call = t.backward_call(c.threads);
  std::vector<AnyView> views = views_of(call);
  const std::string what =
      AttentionBreaker<T>(c.attn, call.cfg, call.compose, &call.dcompose, views, arena)
          .apply(c.brk);
  expect_rejected("backward with " + what, t, true, arena, [&] { call.run(w); });
}

inline void check_attention(const FuzzCase& c) {
  if (c.brk.on()) {
    if (c.scalar == Scalar::f32) check_invalid_attention<float>(c);
    if (c.scalar == Scalar::f64) check_invalid_attention<double>(c);
    if (c.scalar == Scalar::bf16) check_invalid_attention<bf16>(c);
    return;
  }
  if (c.op == Op::forward) check_forward(c);
  if (c.op == Op::backward) check_backward(c);
}

}  // namespace dcmha::fuzz

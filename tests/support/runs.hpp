#pragma once
// Helpers of the edge-case and backend tests: every result of a forward + backward in one
// vector, per-sequence parts of it, bit-for-bit comparison, bf16-valued problems, and decoding
// a problem's tokens through a DecodeCache in steps of per-sequence counts.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "dcmha/dcmha.hpp"
#include "reference/reference.hpp"
#include "support/decode_steps.hpp"
#include "support/problem.hpp"

namespace dcmha::test {

// ---------------------------------------------------------------------------------------------
// Results and their comparison

/// The first index at which a and b differ bit for bit (or where the shorter one ends), -1 if
/// they are the same.
inline int64_t first_bitwise_difference(const std::vector<double>& a,
                                        const std::vector<double>& b) {
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) return int64_t(i);
  return a.size() == b.size() ? -1 : int64_t(n);
}

/// One named result tensor in the reference's layout; every one of them has the batch as its
/// first dimension except the static W gradients (G, M, M).
struct NamedResult {
  std::string name;
  std::vector<double> values;
  bool per_sequence = true;
};

/// out, lse and every gradient of tp (after forward and backward), in a fixed order.
template <class T>
std::vector<NamedResult> named_results(const TypedProblem<T>& tp) {
  std::vector<NamedResult> r{{"out", tp.out_values()}, {"lse", tp.lse_values()}};
  const reference::Gradients g = tp.gradients();
  for (const auto& [name, vec] : named_gradients(g)) {
    const bool static_w = name.size() >= 2 && name.compare(name.size() - 2, 2, "_w") == 0;
    r.push_back({name, *vec, !static_w});
  }
  return r;
}

/// Sequence b's part of a tensor whose first dimension is the batch of B.
inline std::vector<double> sequence_part(const std::vector<double>& x, int64_t B, int64_t b) {
  const size_t n = x.size() / size_t(B);
  return std::vector<double>(x.begin() + std::ptrdiff_t(n * size_t(b)),
                             x.begin() + std::ptrdiff_t(n * size_t(b + 1)));
}

/// All values concatenated (for one bitwise comparison of a whole run).
inline std::vector<double> concatenated(const std::vector<NamedResult>& rs) {
  std::vector<double> all;
  for (const NamedResult& r : rs) all.insert(all.end(), r.values.begin(), r.values.end());
  return all;
}

inline bool all_finite(const std::vector<double>& x) {
  return std::all_of(x.begin(), x.end(), [](double v) { return std::isfinite(v); });
}

/// `values` followed by every gradient of g, in named_gradients' order.
inline std::vector<double> with_gradients(std::vector<double> values,
                                          const dcmha::reference::Gradients& g) {
  for (auto& [name, vec] : dcmha::test::named_gradients(g))
    values.insert(values.end(), vec->begin(), vec->end());
  return values;
}

// bf16 storage: float arithmetic on the widened values, results rounded once (config.hpp).

inline double round_to_bf16(double x) { return round_to<dcmha::bf16>(x); }

inline void round_all(std::vector<double>& x) {
  for (double& e : x) e = round_to_bf16(e);
}

/// p with every input rounded to a bf16 value (float and bf16 storage then hold the same values).
inline dcmha::reference::Problem bf16_problem(const dcmha::reference::Problem& p) {
  return storage_problem<dcmha::bf16>(p);
}

/// forward then backward of tp with cfg (tp.config() plus whatever the test changed).
template <class T>
void forward_backward(TypedProblem<T>& tp, const AttentionConfig& cfg, Workspace* ws = nullptr) {
  if (ws) {
    forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose(), *ws);
    backward(cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(), tp.dv(),
             tp.compose(), tp.dcompose(), *ws);
  } else {
    forward(cfg, tp.q(), tp.k(), tp.v(), tp.out(), tp.lse(), tp.compose());
    backward(cfg, tp.q(), tp.k(), tp.v(), tp.lse(), tp.dout(), tp.dq(), tp.dk(), tp.dv(),
             tp.compose(), tp.dcompose());
  }
}

/// The reference's lse (B, H, T): log sum exp of each row's composed scores over its visible
/// keys, -inf for a row that sees none (what the library documents for such rows).
inline std::vector<double> reference_lse(const reference::Problem& p) {
  const reference::detail::Intermediates it = reference::detail::forward_intermediates(p);
  std::vector<double> lse(size_t(p.B * p.H * p.T), -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.H; ++h)
      for (int64_t t = 0; t < p.T; ++t) {
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        for (int64_t s = 0; s < p.S; ++s)
          if (reference::detail::visible(p, b, t, s))
            mx = std::max(mx, it.Lc[size_t(reference::detail::at_bhts(p, b, h, t, s))]);
        if (mx == -std::numeric_limits<double>::infinity()) continue;
        for (int64_t s = 0; s < p.S; ++s)
          if (reference::detail::visible(p, b, t, s))
            sum += std::exp(it.Lc[size_t(reference::detail::at_bhts(p, b, h, t, s))] - mx);
        lse[size_t((b * p.H + h) * p.T + t)] = mx + std::log(sum);
      }
  return lse;
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// decode_steps_with through a DecodeCache and decode().
template <class T>
std::vector<std::vector<double>> decode_steps(const reference::Problem& p, DecodeCache<T>& cache,
                                              const DecodeSchedule& schedule,
                                              const AttentionConfig& cfg, Workspace* ws = nullptr) {
  cache.reset();
  return decode_steps_with<T>(p, schedule, [&](const DecodeStepTensors<T>& x) {
    cache.append(x.k, x.v, x.key_side, x.counts);
    if (ws)
      decode(cfg, x.q, cache, x.query_side, x.out, *ws);
    else
      decode(cfg, x.q, cache, x.query_side, x.out);
  });
}

}  // namespace dcmha::test

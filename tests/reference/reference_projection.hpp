#pragma once
// Plain double-precision reference of the dynamic weight projection (spec section 2) and its
// hand-derived backward: straight loops over contiguous row-major arrays, written to be read
// against the spec, not to be fast. Tests compare the production path and finite differences
// against it.
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

namespace dcmha::reference {

struct ProjectionShape {
  std::int64_t B = 1, L = 1, E = 1, G = 1, K = 1, R = 1, M = 1;
  bool tanh_gelu = false;  // false: exact erf GELU
  double eps = 1e-6;

  std::int64_t x_size() const { return B * L * E; }
  std::int64_t dw1_size() const { return E * G * 4 * K; }
  std::int64_t qkw_size() const { return G * 4 * K * 2 * R * M; }
  std::int64_t dd_size() const { return E * G * 4 * M; }
  std::int64_t w_size() const { return B * L * G * R * M; }  // (B, L, G, R, M)
  std::int64_t gate_size() const { return B * L * G * M; }   // (B, L, G, M)
};

/// Contiguous arrays in the official layouts: dw1 (E, G, 4, K), qkw (G, 4, K, 2R, M),
/// dd (E, G, 4M).
struct ProjectionParams {
  std::vector<double> dw1, qkw, dd;
};

/// Indexed by split c = 0..3: pre/query, pre/key, post/query, post/key.
struct ProjectionOutputs {
  std::array<std::vector<double>, 4> w1, w2, dd;
};

constexpr double kPi = 3.14159265358979323846;

inline double gelu(double v, bool tanh_form) {
  if (!tanh_form) return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
  const double c = std::sqrt(2.0 / kPi);
  return 0.5 * v * (1.0 + std::tanh(c * (v + 0.044715 * v * v * v)));
}

inline double gelu_grad(double v, bool tanh_form) {
  if (!tanh_form)
    return 0.5 * (1.0 + std::erf(v / std::sqrt(2.0))) +
           v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * kPi);
  const double c = std::sqrt(2.0 / kPi);
  const double t = std::tanh(c * (v + 0.044715 * v * v * v));
  return 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * v * v);
}

/// Everything the forward computes before the RMS norm, for one position: hidden pre-
/// activations hpre[g][c][k], raw w[g][c][i][m] (i < 2R), and gate pre-activations
/// gpre[g][c][m].
struct PositionState {
  std::vector<double> hpre, w, gpre;
};

inline PositionState position_state(const ProjectionShape& s, const std::vector<double>& x,
                                    const ProjectionParams& p, std::int64_t b, std::int64_t l) {
  const std::int64_t G = s.G, K = s.K, R = s.R, M = s.M, E = s.E;
  PositionState st;
  st.hpre.assign(G * 4 * K, 0.0);
  st.w.assign(G * 4 * 2 * R * M, 0.0);
  st.gpre.assign(G * 4 * M, 0.0);
  const double* xr = &x[(b * s.L + l) * E];
  for (std::int64_t g = 0; g < G; ++g)
    for (std::int64_t c = 0; c < 4; ++c) {
      for (std::int64_t k = 0; k < K; ++k) {
        double acc = 0.0;
        for (std::int64_t e = 0; e < E; ++e) acc += xr[e] * p.dw1[((e * G + g) * 4 + c) * K + k];
        st.hpre[(g * 4 + c) * K + k] = acc;
      }
      for (std::int64_t i = 0; i < 2 * R; ++i)
        for (std::int64_t m = 0; m < M; ++m) {
          double acc = 0.0;
          for (std::int64_t k = 0; k < K; ++k)
            acc += gelu(st.hpre[(g * 4 + c) * K + k], s.tanh_gelu) *
                   p.qkw[(((g * 4 + c) * K + k) * 2 * R + i) * M + m];
          st.w[((g * 4 + c) * 2 * R + i) * M + m] = acc;
        }
      for (std::int64_t m = 0; m < M; ++m) {
        double acc = 0.0;
        for (std::int64_t e = 0; e < E; ++e) acc += xr[e] * p.dd[(e * G + g) * 4 * M + c * M + m];
        st.gpre[(g * 4 + c) * M + m] = acc;
      }
    }
  return st;
}

inline void projection_forward(const ProjectionShape& s, const std::vector<double>& x,
                               const ProjectionParams& p, ProjectionOutputs& out) {
  const std::int64_t G = s.G, R = s.R, M = s.M;
  for (int c = 0; c < 4; ++c) {
    out.w1[c].assign(s.w_size(), 0.0);
    out.w2[c].assign(s.w_size(), 0.0);
    out.dd[c].assign(s.gate_size(), 0.0);
  }
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t l = 0; l < s.L; ++l) {
      const PositionState st = position_state(s, x, p, b, l);
      const std::int64_t pos = b * s.L + l;
      for (std::int64_t g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) {
          for (std::int64_t r = 0; r < R; ++r) {
            const double* w1 = &st.w[((g * 4 + c) * 2 * R + r) * M];
            const double* w2 = &st.w[((g * 4 + c) * 2 * R + R + r) * M];
            double ms = 0.0;
            for (std::int64_t m = 0; m < M; ++m) ms += w1[m] * w1[m];
            const double rms = std::sqrt(ms / M + s.eps);
            for (std::int64_t m = 0; m < M; ++m) {
              out.w1[c][((pos * G + g) * R + r) * M + m] = w1[m] / rms;
              out.w2[c][((pos * G + g) * R + r) * M + m] = w2[m];
            }
          }
          for (std::int64_t m = 0; m < M; ++m)
            out.dd[c][(pos * G + g) * M + m] = std::tanh(st.gpre[(g * 4 + c) * M + m]);
        }
    }
}

/// Gradients of sum over outputs of (output * dout), overwriting dx and grads.
inline void projection_backward(const ProjectionShape& s, const std::vector<double>& x,
                                const ProjectionParams& p, const ProjectionOutputs& dout,
                                std::vector<double>& dx, ProjectionParams& grads) {
  const std::int64_t G = s.G, K = s.K, R = s.R, M = s.M, E = s.E;
  dx.assign(s.x_size(), 0.0);
  grads.dw1.assign(s.dw1_size(), 0.0);
  grads.qkw.assign(s.qkw_size(), 0.0);
  grads.dd.assign(s.dd_size(), 0.0);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t l = 0; l < s.L; ++l) {
      const PositionState st = position_state(s, x, p, b, l);
      const std::int64_t pos = b * s.L + l;
      const double* xr = &x[pos * E];
      double* dxr = &dx[pos * E];
      for (std::int64_t g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) {
          // d(raw w): through the RMS norm for w1, unchanged for w2.
          std::vector<double> dw(2 * R * M);
          for (std::int64_t r = 0; r < R; ++r) {
            const double* w1 = &st.w[((g * 4 + c) * 2 * R + r) * M];
            const double* dy = &dout.w1[c][((pos * G + g) * R + r) * M];
            double ms = 0.0;
            for (std::int64_t m = 0; m < M; ++m) ms += w1[m] * w1[m];
            const double rms = std::sqrt(ms / M + s.eps);
            // y_m = w_m / rms, d rms / d w_j = w_j / (M rms)
            double dot = 0.0;
            for (std::int64_t m = 0; m < M; ++m) dot += dy[m] * w1[m];
            for (std::int64_t j = 0; j < M; ++j)
              dw[r * M + j] = dy[j] / rms - dot * w1[j] / (M * rms * rms * rms);
            const double* dy2 = &dout.w2[c][((pos * G + g) * R + r) * M];
            for (std::int64_t m = 0; m < M; ++m) dw[(R + r) * M + m] = dy2[m];
          }
          // qkw and hidden.
          std::vector<double> dh(K, 0.0);
          for (std::int64_t k = 0; k < K; ++k) {
            const double hp = st.hpre[(g * 4 + c) * K + k];
            const double h = gelu(hp, s.tanh_gelu);
            for (std::int64_t i = 0; i < 2 * R; ++i)
              for (std::int64_t m = 0; m < M; ++m) {
                const std::int64_t q = (((g * 4 + c) * K + k) * 2 * R + i) * M + m;
                grads.qkw[q] += h * dw[i * M + m];
                dh[k] += p.qkw[q] * dw[i * M + m];
              }
            dh[k] *= gelu_grad(hp, s.tanh_gelu);
          }
          for (std::int64_t k = 0; k < K; ++k)
            for (std::int64_t e = 0; e < E; ++e) {
              const std::int64_t q = ((e * G + g) * 4 + c) * K + k;
              grads.dw1[q] += xr[e] * dh[k];
              dxr[e] += p.dw1[q] * dh[k];
            }
          // Gates.
          for (std::int64_t m = 0; m < M; ++m) {
            const double t = std::tanh(st.gpre[(g * 4 + c) * M + m]);
            const double dg = dout.dd[c][(pos * G + g) * M + m] * (1.0 - t * t);
            for (std::int64_t e = 0; e < E; ++e) {
              const std::int64_t q = (e * G + g) * 4 * M + c * M + m;
              grads.dd[q] += xr[e] * dg;
              dxr[e] += p.dd[q] * dg;
            }
          }
        }
    }
}

}  // namespace dcmha::reference

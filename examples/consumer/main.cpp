// Smallest useful dcmha program: one causal MHA forward on fixed data. Exits non-zero when
// the call fails or the output is not finite, so a build script can use it as a check.
#include <dcmha/dcmha.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  const dcmha::index_t B = 1, H = 2, T = 8, D = 4;
  std::vector<float> q(B * H * T * D), k(q.size()), v(q.size()), out(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    // Deterministic, varied, and small enough that nothing can overflow.
    q[i] = std::sin(0.37f * static_cast<float>(i));
    k[i] = std::cos(0.11f * static_cast<float>(i));
    v[i] = static_cast<float>(i % 7) - 3.0f;
  }

  dcmha::AttentionConfig cfg;
  cfg.mask = dcmha::Mask::causal;
  try {
    dcmha::forward(cfg, dcmha::bhtd(q.data(), B, H, T, D), dcmha::bhtd(k.data(), B, H, T, D),
                   dcmha::bhtd(v.data(), B, H, T, D), dcmha::bhtd(out.data(), B, H, T, D));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: dcmha::forward failed: %s\n", e.what());
    return 1;
  }

  double sum = 0.0;
  for (float x : out) {
    if (!std::isfinite(x)) {
      std::fprintf(stderr, "consumer: non-finite output\n");
      return 1;
    }
    sum += x;
  }
  std::printf("dcmha %d.%d.%d consumer OK, sum(out) = %.6f\n", DCMHA_VERSION_MAJOR,
              DCMHA_VERSION_MINOR, DCMHA_VERSION_PATCH, sum);
  return 0;
}

// Smallest useful dcmha program: one causal MHA forward on fixed data, then the same in bf16 with
// storage-type products (the CPU's bf16 dot products where it has them). Exits non-zero when a
// call fails or an output is not finite or far from the float one, so a build script can use it
// as a check.
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

  // bf16 tensors, products in bf16 where the CPU can: within bf16's resolution of the float run.
  std::vector<dcmha::bf16> q16(q.begin(), q.end()), k16(k.begin(), k.end()),
      v16(v.begin(), v.end());
  std::vector<dcmha::bf16> out16(out.size());
  cfg.products = dcmha::Products::storage_type;
  try {
    const dcmha::bf16 *cq = q16.data(), *ck = k16.data(), *cv = v16.data();
    dcmha::forward(cfg, dcmha::bhtd(cq, B, H, T, D), dcmha::bhtd(ck, B, H, T, D),
                   dcmha::bhtd(cv, B, H, T, D), dcmha::bhtd(out16.data(), B, H, T, D));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: dcmha::forward (bf16) failed: %s\n", e.what());
    return 1;
  }

  double sum = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    const float x = out[i], x16 = static_cast<float>(out16[i]);
    if (!std::isfinite(x) || !(std::fabs(x16 - x) <= 0.05f * (1.0f + std::fabs(x)))) {
      std::fprintf(stderr, "consumer: output %zu: float %g, bf16 %g\n", i, x, x16);
      return 1;
    }
    sum += x;
  }
  std::printf("dcmha %d.%d.%d consumer OK, sum(out) = %.6f\n", DCMHA_VERSION_MAJOR,
              DCMHA_VERSION_MINOR, DCMHA_VERSION_PATCH, sum);
  return 0;
}

#pragma once
// AttentionConfig: everything about an attention call that is not a tensor.
#include <Eigen/Core>
#include <cstdint>

#include "tensor.hpp"

namespace dcmha {

enum class Mask {
  full,    ///< every query sees every key
  causal,  ///< query t sees key s iff s <= t + (S - T) (bottom-right aligned, spec section 1)
};

/// The arithmetic of the tile products (Q K^T, P'V and, in backward, dO V^T, dS K, dS^T Q,
/// P'^T dO) for narrow storage types.
enum class Products {
  /// On values widened to float: a bf16 or fp16 result is the float kernels' result on the same
  /// inputs, rounded once (bitwise, on every machine).
  exact,
  /// In the storage type with float accumulation, as FlashAttention and PyTorch's CPU flash
  /// attention compute: P' and dS are rounded to the storage type before the products they feed,
  /// and the products run on the CPU's bf16 dot-product instructions (AVX512_BF16), chosen at run
  /// time. Used for bf16 tensors on CPUs that have them (storage_type_products_available()); every
  /// other case computes as `exact`. Results differ from `exact` by the roundings of P' and dS
  /// (docs/performance.md has the errors of both against the float64 reference).
  storage_type,
};

struct AttentionConfig {
  Mask mask = Mask::causal;
  /// Score scale; a value <= 0 means 1/sqrt(D), the default of the spec.
  double scale = 0.0;
  /// Sliding window W (spec section 1): with W > 0, query t additionally needs
  /// (t + S - T) - s < W. 0 means no window.
  std::int64_t window = 0;
  /// Per-sequence lengths for padded batches, B values each; empty views mean T and S for
  /// every sequence. Sequence b has real query rows [0, query_lengths[b]) and real keys
  /// [0, key_lengths[b]); padding rows get zero output and zero gradients, padding keys are
  /// never attended to, and the causal rule aligns each sequence's own lengths bottom-right
  /// (query t sees key s iff s <= t + key_lengths[b] - query_lengths[b]). Right-padded prefill:
  /// both equal to the prompt lengths. Decoding n new tokens after a cache of c_b tokens:
  /// query_lengths = n, key_lengths = c_b + n.
  TensorView<const index_t, 1> query_lengths, key_lengths;
  /// OpenMP threads for this call; 0 means omp_get_max_threads(). Results are bitwise the same
  /// from call to call for a fixed count; backward's for every count (from the same lse).
  int num_threads = 0;
  /// The tile products' arithmetic for bf16 and fp16 storage (float and double: always exact).
  Products products = Products::exact;
};

/// The type softmax statistics and reductions are accumulated in (float for float and narrower
/// storage types, double for double).
template <class T>
struct accumulator {
  using type = float;
};
template <>
struct accumulator<double> {
  using type = double;
};
template <class T>
using acc_t = typename accumulator<T>::type;

/// bfloat16 storage (the official DCFormer checkpoints' type): attention's tensors, compose
/// weights and gradients in bf16, arithmetic and lse in float. Results are the float kernels'
/// results on the same values, rounded once to bf16.
using bf16 = Eigen::bfloat16;

/// IEEE float16 storage (the DCFormer-2.8B and DCPythia checkpoints' type), with the same
/// contract as bf16: arithmetic and lse in float, each result rounded once. The CPU attention
/// entry points and the CUDA backend take it.
using half = Eigen::half;

}  // namespace dcmha

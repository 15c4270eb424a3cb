#pragma once
// STUB: fused CPU backward kernel, being written.
#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../detail/dims.hpp"
#include "../error.hpp"
#include "../tensor.hpp"
namespace dcmha::cpu {
template <class T>
void backward(const AttentionConfig&, const detail::AttentionDims&, TensorView<const T, 4>,
              TensorView<const T, 4>, TensorView<const T, 4>, TensorView<const acc_t<T>, 3>,
              TensorView<const T, 4>, TensorView<T, 4>, TensorView<T, 4>, TensorView<T, 4>,
              const ComposeWeights<T>&, const ComposeGrads<T>&) {
  throw Error("dcmha::backward: not implemented yet");
}
}  // namespace dcmha::cpu

#pragma once
// STUB: fused CPU forward kernel, being written.
#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../detail/dims.hpp"
#include "../error.hpp"
#include "../tensor.hpp"
namespace dcmha::cpu {
template <class T>
void forward(const AttentionConfig&, const detail::AttentionDims&, TensorView<const T, 4>,
             TensorView<const T, 4>, TensorView<const T, 4>, TensorView<T, 4>,
             TensorView<acc_t<T>, 3>, const ComposeWeights<T>&) {
  throw Error("dcmha::forward: not implemented yet");
}
}  // namespace dcmha::cpu

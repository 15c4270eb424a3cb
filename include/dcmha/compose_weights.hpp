#pragma once
// The inputs of Compose (spec section 1) and their gradients.
//
// Logical shapes (any strides):
//   w          (G, M, M)       static head mixing, [group, input head, output head]
//   qw1, qw2   (B, T, G, R, M) query-wise low rank, R >= 1
//   kw1, kw2   (B, S, G, R, M) key-wise low rank
//   qdd        (B, T, G, M)    query-wise gate
//   kdd        (B, S, G, M)    key-wise gate
// where M = H / G. The switches say which terms are on; a term that is on needs its tensors,
// a term that is off must not be given one (a tensor that would be ignored is a caller bug).
#include "tensor.hpp"

namespace dcmha {

template <class T>
struct ComposeTerms {
  bool static_w = false;    ///< w
  bool query_wise = false;  ///< qw1, qw2, qdd
  bool key_wise = false;    ///< kw1, kw2, kdd

  TensorView<const T, 3> w;
  TensorView<const T, 5> qw1, qw2;
  TensorView<const T, 5> kw1, kw2;
  TensorView<const T, 4> qdd, kdd;

  /// With every term off Compose is the identity (the residual).
  DCMHA_HOST_DEVICE bool enabled() const { return static_w || query_wise || key_wise; }
};

/// Pre-softmax (on scores) and post-softmax (on probabilities) compose. Default-constructed:
/// both off, which is exactly multi-head attention.
template <class T>
struct ComposeWeights {
  ComposeTerms<T> pre, post;
  DCMHA_HOST_DEVICE bool enabled() const { return pre.enabled() || post.enabled(); }
};

/// Gradients of one side's compose inputs, same logical shapes as ComposeTerms. Every tensor
/// of a term that is on is required and overwritten.
template <class T>
struct ComposeTermGrads {
  TensorView<T, 3> w;
  TensorView<T, 5> qw1, qw2;
  TensorView<T, 5> kw1, kw2;
  TensorView<T, 4> qdd, kdd;
};

template <class T>
struct ComposeGrads {
  ComposeTermGrads<T> pre, post;
};

}  // namespace dcmha

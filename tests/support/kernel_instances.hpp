#pragma once
// The library's kernels compiled once for the whole test build instead of once per test file:
// every test target force-includes this header (tests/CMakeLists.txt), whose explicit
// instantiation declarations keep each file from instantiating the entry points' templates, and
// links dcmha_test_kernels (tests/support/kernels/), which defines them with the same flags and
// definitions. A sanitized build of the suite compiles in a third of the time; the code under
// test is the same.
#include <dcmha/dcmha.hpp>

// cpu::forward is the decode's kernel too: declared here, decode_projection.cpp does not
// compile it a second time.
#define DCMHA_TEST_ATTENTION_INSTANCES(PREFIX, T)                                                  \
  PREFIX void dcmha::cpu::forward<T>(const dcmha::detail::ForwardParams<T>&, dcmha::Workspace&);   \
  PREFIX void dcmha::detail::forward_impl<T>(                                                      \
      const dcmha::AttentionConfig&, dcmha::TensorView<const T, 4>, dcmha::TensorView<const T, 4>, \
      dcmha::TensorView<const T, 4>, dcmha::TensorView<T, 4>,                                      \
      dcmha::TensorView<dcmha::acc_t<T>, 3>, const dcmha::ComposeWeights<T>&, dcmha::Workspace*);  \
  PREFIX void dcmha::detail::backward_impl<T>(                                                     \
      const dcmha::AttentionConfig&, dcmha::TensorView<const T, 4>, dcmha::TensorView<const T, 4>, \
      dcmha::TensorView<const T, 4>, dcmha::TensorView<const dcmha::acc_t<T>, 3>,                  \
      dcmha::TensorView<const T, 4>, dcmha::TensorView<T, 4>, dcmha::TensorView<T, 4>,             \
      dcmha::TensorView<T, 4>, const dcmha::ComposeWeights<T>&, const dcmha::ComposeGrads<T>&,     \
      dcmha::Workspace*, dcmha::TensorView<const T, 4>);

#define DCMHA_TEST_DECODE_INSTANCES(PREFIX, T)                                                    \
  PREFIX void dcmha::detail::decode_impl<T>(                                                      \
      const dcmha::AttentionConfig&, dcmha::TensorView<const T, 4>, const dcmha::DecodeCache<T>&, \
      const dcmha::ComposeWeights<T>&, dcmha::TensorView<T, 4>, dcmha::Workspace*);

#define DCMHA_TEST_PROJECTION_INSTANCES(PREFIX, T)                                     \
  PREFIX void dcmha::detail::dynamic_weights_forward_impl<T>(                          \
      const dcmha::ProjectionConfig&, dcmha::TensorView<const T, 3>,                   \
      const dcmha::DynamicWeightProjection<T>&, const dcmha::DynamicWeights<T>&,       \
      dcmha::ProjectionActivations<T>*);                                               \
  PREFIX void dcmha::detail::dynamic_weights_backward_impl<T>(                         \
      const dcmha::ProjectionConfig&, dcmha::TensorView<const T, 3>,                   \
      const dcmha::DynamicWeightProjection<T>&, const dcmha::DynamicWeights<const T>&, \
      dcmha::TensorView<T, 3>, const dcmha::DynamicWeightProjectionGrads<T>&,          \
      const dcmha::ProjectionActivations<T>*);

#define DCMHA_TEST_ALL_INSTANCES(PREFIX)               \
  DCMHA_TEST_ATTENTION_INSTANCES(PREFIX, float)        \
  DCMHA_TEST_ATTENTION_INSTANCES(PREFIX, double)       \
  DCMHA_TEST_ATTENTION_INSTANCES(PREFIX, dcmha::bf16)  \
  DCMHA_TEST_ATTENTION_INSTANCES(PREFIX, dcmha::half)  \
  DCMHA_TEST_DECODE_INSTANCES(PREFIX, float)           \
  DCMHA_TEST_DECODE_INSTANCES(PREFIX, double)          \
  DCMHA_TEST_DECODE_INSTANCES(PREFIX, dcmha::bf16)     \
  DCMHA_TEST_DECODE_INSTANCES(PREFIX, dcmha::half)     \
  DCMHA_TEST_PROJECTION_INSTANCES(PREFIX, float)       \
  DCMHA_TEST_PROJECTION_INSTANCES(PREFIX, double)      \
  DCMHA_TEST_PROJECTION_INSTANCES(PREFIX, dcmha::bf16) \
  DCMHA_TEST_PROJECTION_INSTANCES(PREFIX, dcmha::half)

DCMHA_TEST_ALL_INSTANCES(extern template)

#pragma once
// torch tensors as dcmha views, without a copy: sizes and strides are both in elements, so a view
// is the tensor's pointer, sizes and strides. The official compose layouts have no group axis
// ((B, L, R, N), (B, L, N), (N, N)): they get one of size 1, which needs no copy either.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <dcmha/compose_weights.hpp>
#include <dcmha/config.hpp>
#include <dcmha/tensor.hpp>

#include <type_traits>

#include "call.hpp"

namespace dcmha_torch {

static_assert(sizeof(dcmha::bf16) == sizeof(c10::BFloat16), "bf16 layouts differ");
static_assert(sizeof(dcmha::half) == sizeof(c10::Half), "fp16 layouts differ");

/// The view of a defined tensor of rank N (the caller has checked the rank); empty otherwise.
template <class T, int N>
dcmha::TensorView<T, N> view_of(const at::Tensor& t) {
  if (!t.defined()) return {};
  TORCH_INTERNAL_ASSERT(t.dim() == N, "view_of: rank ", t.dim(), ", expected ", N);
  dcmha::Shape<N> shape{}, stride{};
  for (int i = 0; i < N; ++i) shape[i] = t.size(i), stride[i] = t.stride(i);
  return {reinterpret_cast<T*>(const_cast<void*>(t.data_ptr())), shape, stride};
}

/// Rank of an entry in dcmha's layout: sw (G, M, M), qw/kw (B, L, G, R, M), qdd/kdd (B, L, G, M);
/// the official layout has one axis less, the group axis.
inline int dcmha_rank(int entry) {
  const int e = entry % kSideEntries;
  return e == 0 ? 3 : e <= 4 ? 5 : 4;
}
inline int group_axis(int entry) { return entry % kSideEntries == 0 ? 0 : 2; }

/// An entry in dcmha's layout, the group axis of size 1 inserted where it has the official rank.
template <class T, int N>
dcmha::TensorView<T, N> compose_view_of(const ComposeEntries& e, int entry) {
  const at::Tensor& t = e[entry];
  if (!t.defined()) return {};
  return view_of<T, N>(t.dim() == N ? t : t.unsqueeze(group_axis(entry)));
}

/// One side's views of entries [first, first + 7), into ComposeTerms (T const) or
/// ComposeTermGrads.
template <class T, class Terms>
void side_views(const ComposeEntries& e, int first, Terms& terms) {
  terms.w = compose_view_of<T, 3>(e, first + 0);
  terms.qw1 = compose_view_of<T, 5>(e, first + 1);
  terms.qw2 = compose_view_of<T, 5>(e, first + 2);
  terms.kw1 = compose_view_of<T, 5>(e, first + 3);
  terms.kw2 = compose_view_of<T, 5>(e, first + 4);
  terms.qdd = compose_view_of<T, 4>(e, first + 5);
  terms.kdd = compose_view_of<T, 4>(e, first + 6);
}

/// The compose inputs: a term is on where any of its tensors is given (dcmha then requires the
/// others and names a missing one).
template <class T>
dcmha::ComposeWeights<T> compose_weights(const ComposeEntries& e) {
  dcmha::ComposeWeights<T> c;
  for (int side = 0; side < 2; ++side) {
    dcmha::ComposeTerms<T>& terms = side == 0 ? c.pre : c.post;
    const int first = side * kSideEntries;
    side_views<const T>(e, first, terms);
    terms.static_w = e[first].defined();
    terms.query_wise = e[first + 1].defined() || e[first + 2].defined() || e[first + 5].defined();
    terms.key_wise = e[first + 3].defined() || e[first + 4].defined() || e[first + 6].defined();
  }
  return c;
}

template <class T>
dcmha::ComposeGrads<T> compose_grads(const ComposeEntries& grads) {
  dcmha::ComposeGrads<T> g;
  side_views<T>(grads, 0, g.pre);
  side_views<T>(grads, kSideEntries, g.post);
  return g;
}

}  // namespace dcmha_torch

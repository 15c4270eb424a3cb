#pragma once
// Eigen maps over caller tensors and kernel panels: tile GEMMs read the caller's memory in place.
#include <Eigen/Core>

#include "../tensor.hpp"

namespace dcmha::cpu {

template <class S>
using RowMajorMatrix = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using ConstTile = Eigen::Map<const RowMajorMatrix<S>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class S>
using Tile = Eigen::Map<RowMajorMatrix<S>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class S>
using Segment = Eigen::Map<Eigen::Array<S, Eigen::Dynamic, 1>>;

/// Rows [t, t + rows) of head h of batch b of a (B, heads, len, dim) view whose last dimension is
/// contiguous (checked by validation): a rows x dim matrix with the view's row stride.
template <class S>
inline ConstTile<std::remove_const_t<S>> rows_of(const TensorView<S, 4>& x, index_t b, index_t h,
                                                 index_t t, index_t rows) {
  return ConstTile<std::remove_const_t<S>>(
      x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2], rows, x.shape[3],
      Eigen::OuterStride<>(x.stride[2]));
}

template <class S>
inline Tile<S> mutable_rows_of(const TensorView<S, 4>& x, index_t b, index_t h, index_t t,
                               index_t rows) {
  return Tile<S>(x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2], rows, x.shape[3],
                 Eigen::OuterStride<>(x.stride[2]));
}

inline index_t round_up(index_t x, index_t m) { return (x + m - 1) / m * m; }

}  // namespace dcmha::cpu

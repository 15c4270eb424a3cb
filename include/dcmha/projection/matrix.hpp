#pragma once
// Strided tensor views seen as row-major Eigen matrices.
//
// Eigen's GEMM reads a Map in place only when its inner stride is 1 at compile time; a Map
// with a runtime inner stride is copied into a temporary by Eigen anyway. So a view is mapped
// (Eigen::Map with an outer stride) when its column dims collapse to unit stride and its row
// dims collapse to one stride, and packed into contiguous scratch otherwise. Packing costs
// O(rows * cols) against the GEMM's O(rows * cols * other dim).
#include <Eigen/Core>
#include <optional>
#include <vector>

#include "../tensor.hpp"

namespace dcmha::detail::projection {

template <class T>
using RowMat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using ConstMap = Eigen::Map<const RowMat<T>, 0, Eigen::OuterStride<>>;
template <class T>
using MutMap = Eigen::Map<RowMat<T>, 0, Eigen::OuterStride<>>;

/// Row-major matrix with unit column stride and leading dimension ld; U may be const.
template <class U>
struct MatRef {
  U* data = nullptr;
  index_t rows = 0, cols = 0, ld = 0;
};

template <class T>
ConstMap<T> map(const MatRef<const T>& m) {
  return ConstMap<T>(m.data, m.rows, m.cols, Eigen::OuterStride<>(m.ld));
}
template <class T>
MutMap<T> map(const MatRef<T>& m) {
  return MutMap<T>(m.data, m.rows, m.cols, Eigen::OuterStride<>(m.ld));
}

/// Dims [first, last) as one dim of `size` elements `stride` apart; false when no single
/// stride describes them. Size-1 dims place nothing, so their strides are ignored.
inline bool collapse(const index_t* shape, const index_t* stride, int first, int last,
                     index_t& size, index_t& out_stride) {
  size = 1;
  out_stride = 0;
  bool found = false;
  index_t expected = 0;
  for (int d = last - 1; d >= first; --d) {
    size *= shape[d];
    if (shape[d] == 1) continue;
    if (!found) {
      out_stride = stride[d];
      found = true;
    } else if (stride[d] != expected) {
      return false;
    }
    expected = stride[d] * shape[d];
  }
  return true;
}

/// Dims [0, split) as rows, [split, N) as columns, if that is a plain row-major layout.
template <class U, int N>
std::optional<MatRef<U>> as_matrix(const TensorView<U, N>& v, int split) {
  index_t rows, row_stride, cols, col_stride;
  if (!collapse(v.shape.data(), v.stride.data(), 0, split, rows, row_stride)) return std::nullopt;
  if (!collapse(v.shape.data(), v.stride.data(), split, N, cols, col_stride)) return std::nullopt;
  if (cols > 1 && col_stride != 1) return std::nullopt;
  if (rows == 1) row_stride = cols;
  // Rows that run backwards or overlap one another are not a matrix Eigen can address.
  if (row_stride < cols) return std::nullopt;
  return MatRef<U>{v.data, rows, cols, row_stride};
}

/// Visits the elements of v in logical row-major order, with their running index.
template <class U, int N, class F>
void for_each_element(const TensorView<U, N>& v, F&& f) {
  Shape<N> idx{};
  const index_t total = v.numel();
  index_t off = 0;
  for (index_t i = 0; i < total; ++i) {
    f(i, v.data[off]);
    for (int d = N - 1; d >= 0; --d) {
      off += v.stride[d];
      if (++idx[d] < v.shape[d]) break;
      off -= v.stride[d] * v.shape[d];
      idx[d] = 0;
    }
  }
}

template <class T, int N>
MatRef<const T> pack(const TensorView<const T, N>& v, int split, RowMat<T>& storage) {
  index_t rows = 1, cols = 1;
  for (int d = 0; d < split; ++d) rows *= v.shape[d];
  for (int d = split; d < N; ++d) cols *= v.shape[d];
  storage.resize(rows, cols);
  T* dst = storage.data();
  for_each_element(v, [dst](index_t i, const T& e) { dst[i] = e; });
  return {storage.data(), rows, cols, cols};
}

/// An input operand: mapped in place, or packed into `storage` where its strides forbid it.
template <class T, int N>
MatRef<const T> input_matrix(const TensorView<const T, N>& v, int split, RowMat<T>& storage) {
  if (auto m = as_matrix(v, split)) return *m;
  return pack(v, split, storage);
}

/// A GEMM result: written in place when the view maps, else into scratch that finish()
/// scatters into the view.
template <class T, int N>
class OutputMatrix {
 public:
  OutputMatrix(const TensorView<T, N>& v, int split) : view_(v) {
    if (auto m = as_matrix(v, split)) {
      mat_ = *m;
      return;
    }
    index_t rows = 1, cols = 1;
    for (int d = 0; d < split; ++d) rows *= v.shape[d];
    for (int d = split; d < N; ++d) cols *= v.shape[d];
    scratch_.resize(rows, cols);
    mat_ = {scratch_.data(), rows, cols, cols};
    packed_ = true;
  }
  const MatRef<T>& mat() const { return mat_; }
  void finish() {
    if (!packed_) return;
    const T* src = scratch_.data();
    for_each_element(view_, [src](index_t i, T& e) { e = src[i]; });
  }

 private:
  TensorView<T, N> view_;
  MatRef<T> mat_;
  RowMat<T> scratch_;
  bool packed_ = false;
};

/// (B, L, E) as B*L rows of E: one matrix when the batch stride allows, else one per batch
/// (a view of a longer padded sequence buffer), else a packed copy.
template <class U>
struct RowBlocks {
  std::vector<MatRef<U>> blocks;  // block i covers rows [i * block_rows, (i + 1) * block_rows)
  index_t block_rows = 0;
};

template <class U>
std::optional<RowBlocks<U>> as_row_blocks(const TensorView<U, 3>& v) {
  RowBlocks<U> r;
  if (auto m = as_matrix(v, 2)) {
    r.blocks.push_back(*m);
    r.block_rows = m->rows;
    return r;
  }
  for (index_t b = 0; b < v.shape[0]; ++b) {
    TensorView<U, 2> vb(v.data + b * v.stride[0], {v.shape[1], v.shape[2]},
                        {v.stride[1], v.stride[2]});
    auto m = as_matrix(vb, 1);
    if (!m) return std::nullopt;
    r.blocks.push_back(*m);
  }
  r.block_rows = v.shape[1];
  return r;
}

template <class T>
RowBlocks<const T> input_rows(const TensorView<const T, 3>& v, RowMat<T>& storage) {
  if (auto r = as_row_blocks(v)) return *r;
  RowBlocks<const T> r;
  r.blocks.push_back(pack(v, 2, storage));
  r.block_rows = r.blocks[0].rows;
  return r;
}

}  // namespace dcmha::detail::projection

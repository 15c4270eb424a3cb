#pragma once
// Strided, non-owning tensor views over caller memory.
//
// Every public tensor argument is a TensorView whose *logical* index order is fixed by the API
// (e.g. q is (B, H, T, D)); the strides say where the caller keeps it. A caller holding
// (B, T, H, D) activations passes them with bthd() and nothing is copied.
#include <array>
#include <cstdint>
#include <type_traits>

// Functions the CUDA kernels call on the shared structs (cuda/) are host and device functions
// under nvcc, plain functions elsewhere.
#if defined(__CUDACC__)
#define DCMHA_HOST_DEVICE __host__ __device__
#else
#define DCMHA_HOST_DEVICE
#endif
// What a CUDA kernel body calls, inlined into its __global__ wrapper: a call would need the kernel
// object's members in a stack frame and everything live across it saved.
#if defined(__CUDACC__)
#define DCMHA_INLINE __host__ __device__ __forceinline__
#else
#define DCMHA_INLINE inline
#endif
// Unrolls the loop it precedes in device code: loops over a thread's register arrays (fragments,
// compose items) must be unrolled, or the arrays go to local memory.
// DCMHA_NO_UNROLL keeps the loop it precedes rolled in device code, where the unrolled copies of
// a body that loads its operands would each hold their loads in registers of their own.
#if defined(__CUDA_ARCH__)
#define DCMHA_UNROLL _Pragma("unroll")
#define DCMHA_NO_UNROLL _Pragma("unroll 1")
#else
#define DCMHA_UNROLL
#define DCMHA_NO_UNROLL
#endif

namespace dcmha {

using index_t = std::int64_t;

template <int N>
using Shape = std::array<index_t, N>;

template <class T, int N>
struct TensorView {
  static_assert(N >= 1, "TensorView needs at least one dimension");
  using value_type = T;
  static constexpr int rank = N;

  T* data = nullptr;
  Shape<N> shape{};
  Shape<N> stride{};  // in elements, not bytes

  /// An empty view (data == nullptr) means "not given": a switched-off compose term, or an
  /// optional output the caller does not want.
  DCMHA_HOST_DEVICE bool empty() const { return data == nullptr; }
  DCMHA_HOST_DEVICE index_t size(int d) const { return shape[d]; }
  index_t numel() const {
    index_t n = 1;
    for (int d = 0; d < N; ++d) n *= shape[d];
    return n;
  }

  template <class... I>
  DCMHA_HOST_DEVICE T& operator()(I... i) const {
    static_assert(sizeof...(I) == N, "wrong number of indices");
    const index_t idx[N] = {static_cast<index_t>(i)...};
    index_t off = 0;
    for (int d = 0; d < N; ++d) off += idx[d] * stride[d];
    return data[off];
  }

  /// Implicit T -> const T conversion, so outputs can be passed where inputs are expected.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_const_v<U>>>
  TensorView(const TensorView<U, N>& o) : data(o.data), shape(o.shape), stride(o.stride) {}
  TensorView() = default;
  TensorView(T* d, const Shape<N>& sh, const Shape<N>& st) : data(d), shape(sh), stride(st) {}
};

/// Row-major (C order) strides for a shape.
template <int N>
inline Shape<N> contiguous_strides(const Shape<N>& shape) {
  Shape<N> st{};
  index_t s = 1;
  for (int d = N - 1; d >= 0; --d) {
    st[d] = s;
    s *= shape[d];
  }
  return st;
}

/// View of row-major memory: logical order == memory order.
template <int N, class T>
inline TensorView<T, N> view(T* data, const Shape<N>& shape) {
  return TensorView<T, N>(data, shape, contiguous_strides<N>(shape));
}

/// View with explicit strides (in elements).
template <int N, class T>
inline TensorView<T, N> view(T* data, const Shape<N>& shape, const Shape<N>& stride) {
  return TensorView<T, N>(data, shape, stride);
}

/// Attention activations kept as (B, H, T, D) in memory; logical order (B, H, T, D).
template <class T>
inline TensorView<T, 4> bhtd(T* data, index_t B, index_t H, index_t T_, index_t D) {
  return view<4>(data, {B, H, T_, D});
}

/// Attention activations kept as (B, T, H, D) in memory (the usual output of a fused QKV
/// projection); returned in the logical order (B, H, T, D) every entry point expects.
template <class T>
inline TensorView<T, 4> bthd(T* data, index_t B, index_t T_, index_t H, index_t D) {
  return view<4>(data, {B, H, T_, D}, {T_ * H * D, D, H * D, 1});
}

}  // namespace dcmha

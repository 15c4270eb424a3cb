#pragma once
// Eigen maps over caller tensors and kernel panels (row segments, the few Eigen products left),
// row addresses, aligned workspace buffers.
#include <Eigen/Core>
#include <algorithm>
#include <cstddef>
#include <limits>
#include <new>
#include <vector>

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

/// Address of row t of head h of batch b of a (B, heads, len, dim) view.
template <class S>
inline S* row_ptr(const TensorView<S, 4>& x, index_t b, index_t h, index_t t) {
  return x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2];
}

/// Row p of the kv head serving query head h + 1 of batch b, if that is another kv head than
/// head h's and h + 1 < h_end; else null. The packing routines prefetch it while packing head h's.
template <class S>
inline S* next_kv_rows(const TensorView<S, 4>& x, index_t b, index_t h, index_t h_end,
                       index_t group_of_kv, index_t p) {
  const index_t hk = h / group_of_kv, hn = (h + 1) / group_of_kv;
  return h + 1 < h_end && hn != hk ? row_ptr(x, b, hn, p) : nullptr;
}

/// Asks for the cache lines of [p, p + bytes) ahead of use (into L2: they are read a little
/// later, by a product or a Compose pass that has other data in L1). Hardware prefetchers stop
/// at page boundaries, and the kernels' streams are short runs pages apart (one row of K or V
/// per caller row, one panel row per query row): without this each run starts with a full
/// memory latency, which would leave packing all heads' K and V per query block latency-bound.
inline void prefetch_bytes(const void* p, index_t bytes) {
#if defined(__GNUC__)
  const char* c = static_cast<const char*>(p);
  for (index_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
#else
  (void)p;
  (void)bytes;
#endif
}

/// prefetch_bytes for `rows` rows of `bytes` each, `stride` elements apart.
template <class S>
inline void prefetch_rows(const S* p, index_t rows, index_t stride, index_t bytes) {
  for (index_t r = 0; r < rows; ++r) prefetch_bytes(p + r * stride, bytes);
}

/// Rows a kernel reads after the current product, for the product to ask for in equal shares
/// while it runs: `rows` rows of `bytes` bytes, `stride` bytes apart. A DCMHA tile cycles through
/// all M heads' K, V, Q and dO rows (megabytes at M = 32, D = 128), from L3 or memory and pages
/// apart, where hardware prefetchers stop. Asked for in one burst (while packing the tile
/// before), they would fill the miss queue and the packing would wait on its own loads; not asked
/// for, every product's first row block would wait on its operand.
struct NextRows {
  const void* p = nullptr;
  index_t rows = 0, stride = 0, bytes = 0;
};

/// NextRows over `rows` rows of `cols` values at p, `ld` values apart (null p: nothing).
template <class S>
inline NextRows next_rows(const S* p, index_t rows, index_t ld, index_t cols) {
  return {p, rows, ld * index_t(sizeof(S)), cols * index_t(sizeof(S))};
}

/// What one product asks for: the next key tile (K or V of the next head) and the next
/// product's operand, either may be empty.
struct NextReads {
  NextRows tile, operand;
};

/// Spreads NextReads' prefetches over `steps` calls of step() (one per row block of a product).
class SpreadPrefetch {
 public:
  SpreadPrefetch(const NextReads& r, index_t steps) : r_{r.tile, r.operand} {
    for (int k = 0; k < 2; ++k)
      per_step_[k] = r_[k].p ? (r_[k].rows + steps - 1) / std::max<index_t>(steps, 1) : 0;
  }
  void step() {
    for (int k = 0; k < 2; ++k) {
      const index_t end = std::min(r_[k].rows, done_[k] + per_step_[k]);
      for (; done_[k] < end; ++done_[k])
        prefetch_bytes(static_cast<const char*>(r_[k].p) + done_[k] * r_[k].stride, r_[k].bytes);
    }
  }

 private:
  NextRows r_[2];
  index_t per_step_[2] = {0, 0}, done_[2] = {0, 0};
};

/// Cache-line aligned memory from the global operator new, so that a program's (or a test's)
/// replacement of it sees every allocation of the kernels, and its failures arrive as
/// std::bad_alloc.
template <class S>
struct AlignedAllocator {
  using value_type = S;
  static constexpr std::size_t kAlign = 64;
  AlignedAllocator() = default;
  template <class U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  S* allocate(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(S)) throw std::bad_array_new_length();
    return static_cast<S*>(::operator new(n * sizeof(S), std::align_val_t(kAlign)));
  }
  void deallocate(S* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t(kAlign)); }
  template <class U>
  bool operator==(const AlignedAllocator<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const AlignedAllocator<U>&) const {
    return false;
  }
};

/// Kernel workspace. Eigen's vectorized reductions (sum, maxCoeff) start their packets at the
/// first aligned element, so their summation order depends on the address: buffers with a fixed
/// alignment keep results bitwise reproducible from call to call.
template <class S>
using Buffer = std::vector<S, AlignedAllocator<S>>;

/// What kernel panels and packing buffers start as. Their contents are scratch: every value is
/// written before it is read. Tests define DCMHA_POISON_WORKSPACE so that a read of a value never
/// written (a tile tail, a stale column of an earlier block) turns into a NaN in the results
/// instead of silently reading the zeros an allocation happens to hold.
template <class S>
inline S scratch_init() {
#ifdef DCMHA_POISON_WORKSPACE
  return std::numeric_limits<S>::quiet_NaN();
#else
  return S(0);
#endif
}

inline index_t round_up(index_t x, index_t m) { return (x + m - 1) / m * m; }

/// A workspace stride of at least n elements that is a multiple of 16 elements but one cache
/// line off every large power of two. Compose walks M rows (one per head) in lockstep; at a
/// power-of-two stride all of them map to the same L1/L2 set and evict each other.
template <class S>
inline index_t padded_stride(index_t n) {
  return round_up(n, 16) + 64 / index_t(sizeof(S));
}

}  // namespace dcmha::cpu

#pragma once
// Tensors in caller memory of any layout, as the fuzzer hands them to the library.
//
// A Strided<T, N> owns its buffer and a view into it whose logical dims lie in memory in a
// chosen order, with gaps after the blocks of chosen dims (padded rows, heads, batches). Every
// byte the view does not cover holds kSentinel, so a kernel writing outside its output or
// skipping an element of it is caught, and a rejected call can be checked for leaving its
// outputs byte for byte as they were.
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "dcmha/tensor.hpp"

namespace dcmha::fuzz {

/// Every byte of an untouched buffer: a NaN in float, double and bf16 alike, so an output element
/// the kernel never wrote also fails every numeric comparison.
inline constexpr unsigned char kSentinel = 0xFF;

/// Where a tensor's elements lie: the memory order of its logical dims and the gaps.
template <int N>
struct MemLayout {
  std::array<int, N> order{};    // logical dims, outermost first
  std::array<index_t, N> gap{};  // unused elements after each block of a dim
  index_t offset = 0;            // unused elements before the first one

  static MemLayout dense() {
    MemLayout l;
    std::iota(l.order.begin(), l.order.end(), 0);
    return l;
  }
  bool is_dense() const {
    for (int i = 0; i < N; ++i)
      if (order[size_t(i)] != i || gap[size_t(i)] != 0) return false;
    return offset == 0;
  }
  std::string str() const {
    if (is_dense()) return "dense";
    std::string s;
    for (int i = 0; i < N; ++i) {
      const int d = order[size_t(i)];
      s += char('0' + d);
      if (gap[size_t(d)]) s += "+" + std::to_string(gap[size_t(d)]);
    }
    return offset ? s + "@" + std::to_string(offset) : s;
  }
};

/// Calls f(flat, offset) for every logical index of (shape, stride), flat in row-major order.
template <int N, class F>
void for_each_offset(const Shape<N>& shape, const Shape<N>& stride, F&& f) {
  index_t total = 1;
  for (int d = 0; d < N; ++d) total *= shape[size_t(d)];
  std::array<index_t, N> idx{};
  for (index_t flat = 0; flat < total; ++flat) {
    index_t off = 0;
    for (int d = 0; d < N; ++d) off += idx[size_t(d)] * stride[size_t(d)];
    f(flat, off);
    for (int d = N - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
}

template <class T, int N>
class Strided {
 public:
  Strided() = default;
  Strided(const Shape<N>& shape, const MemLayout<N>& layout) {
    Shape<N> stride{};
    index_t run = 1;
    for (int i = N - 1; i >= 0; --i) {
      const int d = layout.order[size_t(i)];
      stride[size_t(d)] = run;
      run = run * shape[size_t(d)] + layout.gap[size_t(d)];
    }
    // Twice the span as slack: a test that breaks a view (one dim one larger, a head dim with
    // stride 2) still addresses only this buffer, so a library that fails to reject it is
    // reported by the comparison, not by a heap overflow in a plain build.
    const size_t n = size_t(layout.offset + 2 * run + 8);
    mem_.resize(n);
    std::memset(static_cast<void*>(mem_.data()), kSentinel, n * sizeof(T));
    view_ = TensorView<T, N>(mem_.data() + layout.offset, shape, stride);
  }
  Strided(const Strided&) = delete;
  Strided& operator=(const Strided&) = delete;
  Strided(Strided&&) = default;  // the vector's heap buffer moves with it: the view stays valid
  Strided& operator=(Strided&&) = default;

  const TensorView<T, N>& view() const { return view_; }
  TensorView<const T, N> cview() const { return view_; }
  bool empty() const { return view_.empty(); }

  /// Writes canonical (row-major) values into the view's elements.
  void set(const std::vector<double>& values) {
    for_each_offset<N>(view_.shape, view_.stride, [&](index_t flat, index_t off) {
      view_.data[off] = static_cast<T>(values[size_t(flat)]);
    });
  }
  /// The view's elements in canonical order.
  std::vector<double> get() const {
    std::vector<double> out(size_t(view_.numel()));
    for_each_offset<N>(view_.shape, view_.stride, [&](index_t flat, index_t off) {
      out[size_t(flat)] = static_cast<double>(view_.data[off]);
    });
    return out;
  }
  /// Whether every element outside the view still holds the sentinel.
  bool outside_untouched() const {
    std::vector<char> inside(mem_.size(), 0);
    const index_t base = view_.data - mem_.data();
    for_each_offset<N>(view_.shape, view_.stride,
                       [&](index_t, index_t off) { inside[size_t(base + off)] = 1; });
    for (size_t i = 0; i < mem_.size(); ++i)
      if (!inside[i] && !is_sentinel(mem_[i])) return false;
    return true;
  }
  /// The whole buffer's bytes, for before/after comparisons.
  std::vector<unsigned char> bytes() const {
    const auto* p = reinterpret_cast<const unsigned char*>(mem_.data());
    return std::vector<unsigned char>(p, p + mem_.size() * sizeof(T));
  }

 private:
  static bool is_sentinel(const T& x) {
    unsigned char b[sizeof(T)];
    std::memcpy(b, &x, sizeof(T));
    return std::all_of(b, b + sizeof(T), [](unsigned char c) { return c == kSentinel; });
  }

  std::vector<T> mem_;
  TensorView<T, N> view_;
};

/// Extra memory a broken call needs (a tensor of another shape, two views sharing one buffer),
/// kept alive for the call and compared before/after like any output.
class Arena {
 public:
  /// `bytes` bytes of sentinel, 64-byte aligned.
  unsigned char* alloc(size_t bytes) {
    blocks_.emplace_back(bytes + 64, kSentinel);
    auto* p = blocks_.back().data();
    const auto misalign = reinterpret_cast<std::uintptr_t>(p) % 64;
    return p + (misalign ? 64 - misalign : 0);
  }
  template <class T>
  T* alloc_elems(index_t n) {
    return reinterpret_cast<T*>(alloc(size_t(std::max<index_t>(n, 1)) * sizeof(T)));
  }
  std::vector<std::vector<unsigned char>> snapshot() const { return blocks_; }
  bool same_as(const std::vector<std::vector<unsigned char>>& before) const {
    return blocks_ == before;
  }

 private:
  std::vector<std::vector<unsigned char>> blocks_;
};

/// Elements from a view's data pointer to its last element, plus one (non-negative strides).
template <class V>
index_t extent_of(const V& v) {
  index_t last = 0;
  for (int d = 0; d < V::rank; ++d) last += (v.shape[size_t(d)] - 1) * v.stride[size_t(d)];
  return last + 1;
}

}  // namespace dcmha::fuzz

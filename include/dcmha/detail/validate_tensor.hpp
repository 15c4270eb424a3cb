#pragma once
// Checks of a single TensorView argument (presence, shape, strides, self-overlap) and the byte
// ranges used to detect aliasing between arguments. Every failure goes through fail() with the
// message layout "<fn>: <argument>: expected <value>, got <value>".
#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "../error.hpp"
#include "../tensor.hpp"

namespace dcmha::detail {

template <class V>
void require_given(const char* fn, const std::string& name, const V& t, const char* shape) {
  if (t.empty()) fail(fn, ": ", name, ": expected a tensor ", shape, ", got an empty view");
}

/// The dims a kernel loops over must be >= 1: a zero-sized problem is almost always a caller
/// bug, and rejecting it keeps every later check (divisibility, byte ranges) well defined.
template <class V>
void check_positive(const char* fn, const std::string& name, const V& t, int d, const char* what) {
  if (t.shape[d] < 1)
    fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected >= 1, got ", t.shape[d]);
}

/// Names where the expected value comes from, so the caller knows which of two disagreeing
/// arguments to fix.
template <class V>
void check_dim(const char* fn, const std::string& name, const V& t, int d, index_t expected,
               const char* what, const std::string& source) {
  if (t.shape[d] != expected)
    fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected ", expected, " (", source,
         "), got ", t.shape[d]);
}

/// Offset in elements of the last addressed element, or -1 if it does not fit in index_t.
/// Requires non-negative strides and shapes >= 1.
template <class V>
index_t max_offset(const V& t) {
  constexpr index_t lim = std::numeric_limits<index_t>::max();
  index_t off = 0;
  for (int d = 0; d < V::rank; ++d) {
    const index_t n = t.shape[d] - 1;
    const index_t s = t.stride[d];
    if (n == 0 || s == 0) continue;
    if (n > lim / s) return -1;
    if (off > lim - n * s) return -1;
    off += n * s;
  }
  return off;
}

/// Negative strides are rejected because the byte-range aliasing test below assumes the view
/// starts at data; the kernels have no use for reversed views.
template <class V>
void check_strides(const char* fn, const std::string& name, const V& t) {
  for (int d = 0; d < V::rank; ++d)
    if (t.stride[d] < 0) fail(fn, ": ", name, ".stride[", d, "]: expected >= 0, got ", t.stride[d]);
  const index_t off = max_offset(t);
  constexpr index_t lim = std::numeric_limits<index_t>::max();
  constexpr index_t elem = static_cast<index_t>(sizeof(typename V::value_type));
  if (off < 0 || off > lim / elem - 1)
    fail(fn, ": ", name, ": expected shape and strides addressing at most ", lim / elem,
         " elements, got an extent that overflows");
}

/// The kernels map each row of the head dim as a contiguous Eigen vector.
template <class V>
void check_inner_contiguous(const char* fn, const std::string& name, const V& t) {
  constexpr int d = V::rank - 1;
  if (t.shape[d] > 1 && t.stride[d] != 1)
    fail(fn, ": ", name, ".stride[", d, "]: expected 1 (head dim must be contiguous), got ",
         t.stride[d]);
}

/// An output whose elements share memory would be written twice with different values, so
/// the result would depend on thread scheduling. The test is sufficient, not exact: ordered
/// by stride, every stride must step past everything the smaller ones reach. It accepts every
/// dense or padded layout (any permutation of dims) and all broadcast (zero-stride) outputs
/// are rejected; rare exotic injective interleavings are rejected too.
template <class V>
void check_no_self_overlap(const char* fn, const std::string& name, const V& t) {
  std::array<int, V::rank> dims{};
  int n = 0;
  for (int d = 0; d < V::rank; ++d)
    if (t.shape[d] > 1) dims[n++] = d;
  std::stable_sort(dims.begin(), dims.begin() + n,
                   [&](int a, int b) { return t.stride[a] < t.stride[b]; });
  index_t reach = 0;  // largest offset reachable through the dims already visited
  for (int i = 0; i < n; ++i) {
    const int d = dims[i];
    if (t.stride[d] <= reach)
      fail(fn, ": ", name, ".stride[", d, "]: expected >= ", reach + 1, " (", name,
           " is written, its elements must not overlap), got ", t.stride[d]);
    reach += (t.shape[d] - 1) * t.stride[d];  // cannot overflow: check_strides bounded it
  }
}

/// Inclusive byte range [lo, hi] a checked view touches.
struct ByteRange {
  std::string name;
  std::uintptr_t lo = 0, hi = 0;
};

template <class V>
ByteRange byte_range(const std::string& name, const V& t) {
  const std::uintptr_t elem = sizeof(typename V::value_type);
  const std::uintptr_t lo = reinterpret_cast<std::uintptr_t>(t.data);
  return {name, lo, lo + static_cast<std::uintptr_t>(max_offset(t)) * elem + elem - 1};
}

/// Conservative: two views whose ranges merely interleave without sharing an element are
/// reported too; callers never need that layout for arguments of one call.
inline void check_disjoint(const char* fn, const std::vector<ByteRange>& outputs,
                           const std::vector<ByteRange>& inputs) {
  auto overlap = [](const ByteRange& a, const ByteRange& b) {
    return a.lo <= b.hi && b.lo <= a.hi;
  };
  auto hex = [](const ByteRange& r) {
    std::ostringstream os;
    os << "[0x" << std::hex << r.lo << ", 0x" << r.hi << "]";
    return os.str();
  };
  auto report = [&](const ByteRange& o, const ByteRange& x, const char* kind) {
    fail(fn, ": ", o.name, ": expected memory disjoint from ", kind, " ", x.name, " (", o.name,
         " is written), got overlapping byte ranges ", hex(o), " and ", hex(x));
  };
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (const ByteRange& x : inputs)
      if (overlap(outputs[i], x)) report(outputs[i], x, "input");
    for (std::size_t j = i + 1; j < outputs.size(); ++j)
      if (overlap(outputs[i], outputs[j])) report(outputs[i], outputs[j], "output");
  }
}

}  // namespace dcmha::detail

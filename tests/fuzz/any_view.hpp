#pragma once
// AnyView: one argument of a call, whatever its scalar type and rank, as something a break can
// edit (shape, strides, data pointer). Every break of every operation is written once against
// this: "make a dim one larger", "reverse a stride", "point this output into that input".
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "dcmha/tensor.hpp"
#include "strided.hpp"

namespace dcmha::fuzz {

struct AnyView {
  std::string name;
  bool output = false;
  const char* dims = "";  // one letter per dim, e.g. "BHTD", "BTGRM"
  int rank = 0;
  index_t* shape = nullptr;  // the view's own arrays
  index_t* stride = nullptr;
  size_t elem = 0;  // bytes per element
  std::function<unsigned char*()> data;
  std::function<void(unsigned char*)> set_data;

  bool given() const { return data() != nullptr; }
  int dim_of(char letter) const {
    for (int d = 0; d < rank; ++d)
      if (dims[d] == letter) return d;
    return -1;
  }
  index_t extent() const {  // elements from data to the last one, plus one
    index_t last = 0;
    for (int d = 0; d < rank; ++d) last += (shape[d] - 1) * std::max<index_t>(stride[d], 0);
    return last + 1;
  }
  /// Dims of size > 1.
  std::vector<int> long_dims() const {
    std::vector<int> r;
    for (int d = 0; d < rank; ++d)
      if (shape[d] > 1) r.push_back(d);
    return r;
  }
};

template <class U, int N>
AnyView any_view(std::string name, TensorView<U, N>& v, bool output, const char* dims) {
  AnyView a;
  a.name = std::move(name);
  a.output = output;
  a.dims = dims;
  a.rank = N;
  a.shape = v.shape.data();
  a.stride = v.stride.data();
  a.elem = sizeof(U);
  using M = std::remove_const_t<U>;
  a.data = [&v] { return reinterpret_cast<unsigned char*>(const_cast<M*>(v.data)); };
  a.set_data = [&v](unsigned char* p) { v.data = reinterpret_cast<U*>(p); };
  return a;
}

/// The given views of a list (absent optional ones are skipped).
inline std::vector<AnyView*> given(std::vector<AnyView>& views, bool outputs) {
  std::vector<AnyView*> r;
  for (AnyView& v : views)
    if (v.given() && v.output == outputs) r.push_back(&v);
  return r;
}

template <class X>
X* choose(const std::vector<X*>& xs, unsigned selector) {
  return xs.empty() ? nullptr : xs[selector % xs.size()];
}

// --- edits -------------------------------------------------------------------------------------

/// Dim d one smaller, or at size 1 two: an input then reads its only element twice (stride 0), an
/// output's second index falls into the slack Strided keeps after the view.
inline std::string resize_dim(AnyView& v, int d) {
  if (v.shape[d] > 1) {
    --v.shape[d];
  } else {
    v.shape[d] = 2;
    if (!v.output) v.stride[d] = 0;
  }
  return v.name + ".shape[" + std::to_string(d) + "] = " + std::to_string(v.shape[d]);
}

/// The same elements walked backwards along dim d (needs shape[d] > 1).
inline std::string reverse_dim(AnyView& v, int d) {
  v.set_data(v.data() + std::ptrdiff_t((v.shape[d] - 1) * v.stride[d]) * std::ptrdiff_t(v.elem));
  v.stride[d] = -v.stride[d];
  return v.name + ".stride[" + std::to_string(d) + "] = " + std::to_string(v.stride[d]);
}

/// Dense row-major strides for `shape`, in fresh arena memory (sentinel-filled).
inline void place_dense(AnyView& v, const index_t* shape, Arena& arena) {
  index_t run = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.stride[d] = run;
    run *= shape[d];
  }
  v.set_data(arena.alloc(size_t(run) * v.elem));
}

/// Byte offset from a's data of its middle element (index (shape - 1) / 2 in every dim).
inline size_t middle_element(const AnyView& a) {
  index_t at = 0;
  for (int d = 0; d < a.rank; ++d) at += (a.shape[d] - 1) / 2 * std::max<index_t>(a.stride[d], 0);
  return size_t(at) * a.elem;
}

/// Moves `a` and `b` into one arena buffer where b's first element shares a byte with one of a's
/// (starts at the same address when `same_start`), a's bytes copied along so that a still holds
/// its values. Not merely inside a's range: a padded or permuted view has gaps between its
/// elements, and b placed in them shares no byte with a, which the library rightly accepts.
inline std::string overlap(AnyView& a, AnyView& b, Arena& arena, bool same_start) {
  const size_t a_bytes = size_t(a.extent()) * a.elem, b_bytes = size_t(b.extent()) * b.elem;
  // Rounded down to b's alignment, b's first element still covers the first byte of a's.
  const size_t at = same_start ? 0 : middle_element(a) / b.elem * b.elem;
  unsigned char* p = arena.alloc(std::max(a_bytes, at + b_bytes));
  std::memcpy(p, a.data(), a_bytes);
  a.set_data(p);
  b.set_data(p + at);
  return b.name + " placed " + std::to_string(at) + " bytes into " + a.name;
}

}  // namespace dcmha::fuzz

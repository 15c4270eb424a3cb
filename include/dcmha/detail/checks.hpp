#pragma once
// The argument checks every entry point (attention, projection, DecodeCache) is built from.
// One argument order: (fn, name, view[, dim, what][, expectation, source]). Every failure goes
// through fail() as "<fn>: <argument>: expected <value> (<source>), got <value>", where the
// source names the argument or config field the expected value was taken from.
//
// Aliasing rule (check_no_alias): an output must not touch any byte of an input's byte range
// (outputs are written while inputs are still read), and two outputs must not share a byte
// (neither could keep its value). Outputs may interleave in one buffer, e.g. qw1 and qw2 as
// the halves of one (B, L, G, 2R, M) allocation; overlapping byte ranges are accepted only
// where the strides prove no byte is shared (interleaved()), anything else is rejected.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../error.hpp"
#include "../tensor.hpp"

namespace dcmha::detail {

// --- presence and sizes -------------------------------------------------------------------

/// `shape` spells the expected shape, e.g. "(B, H, T, D)"; `because` (optional) says why the
/// tensor is needed, e.g. "compose.pre.static_w is on".
template <class V>
void require_given(const char* fn, const std::string& name, const V& t, std::string_view shape,
                   std::string_view because = {}) {
  if (!t.empty()) return;
  if (because.empty()) fail(fn, ": ", name, ": expected a tensor ", shape, ", got an empty view");
  fail(fn, ": ", name, ": expected a tensor ", shape, " because ", because, ", got an empty view");
}

/// A tensor given where it would be ignored hides a caller bug (e.g. a forgotten switch).
/// `because` says why it is not used, e.g. "key_wise is off (config.pre_key_wise == false)".
template <class V>
void require_absent(const char* fn, const std::string& name, const V& t, std::string_view because) {
  if (!t.empty())
    fail(fn, ": ", name, ": given but ", because, ": expected an empty view, got a tensor");
}

/// The dims a problem's sizes are taken from must be >= 1: a zero-sized problem is almost
/// always a caller bug, and rejecting it keeps every later check well defined.
template <class V>
void check_positive(const char* fn, const std::string& name, const V& t, int d, const char* what) {
  if (t.shape[d] < 1)
    fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected >= 1, got ", t.shape[d]);
}

/// `source` names where `expected` comes from, so the caller knows which of two disagreeing
/// arguments to fix; empty for a size fixed by the format.
template <class V>
void check_dim(const char* fn, const std::string& name, const V& t, int d, const char* what,
               index_t expected, std::string_view source = {}) {
  if (t.shape[d] == expected) return;
  if (source.empty())
    fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected ", expected, ", got ", t.shape[d]);
  fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected ", expected, " (", source, "), got ",
       t.shape[d]);
}

/// `total` (named `total_what`) splits into whole groups of dim d's size, e.g. H into G groups.
/// Requires check_positive.
template <class V>
void check_divisor(const char* fn, const std::string& name, const V& t, int d, const char* what,
                   const char* total_what, index_t total, std::string_view source) {
  if (total % t.shape[d] != 0)
    fail(fn, ": ", name, ".shape[", d, "] (", what, "): expected a divisor of ", total_what, " = ",
         total, " (", source, "), got ", t.shape[d]);
}

/// One row of a shape table for check_shape.
struct DimSpec {
  const char* what;
  index_t expected;
  std::string_view source;  // empty: fixed by the format
};

template <class V, std::size_t N>
void check_shape(const char* fn, const std::string& name, const V& t, const DimSpec (&dims)[N]) {
  static_assert(N == V::rank, "one DimSpec per dim");
  for (int d = 0; d < V::rank; ++d)
    check_dim(fn, name, t, d, dims[d].what, dims[d].expected, dims[d].source);
}

/// A gradient has exactly the shape of the tensor it differentiates (`ref`, named `ref_name`).
template <class V, class W>
void check_same_shape(const char* fn, const std::string& name, const V& t,
                      const char* const (&what)[V::rank], const std::string& ref_name,
                      const W& ref) {
  static_assert(V::rank == W::rank, "a gradient has its tensor's rank");
  for (int d = 0; d < V::rank; ++d)
    check_dim(fn, name, t, d, what[d], ref.shape[d],
              ref_name + ".shape[" + std::to_string(d) + "]");
}

// --- strides and layout ---------------------------------------------------------------------

/// Elements between the first and the last one a view addresses, summed over |stride| (an
/// upper bound for either direction), or -1 if that does not fit in index_t. Shapes >= 1.
template <class V>
index_t span_elements(const V& t) {
  constexpr index_t lim = std::numeric_limits<index_t>::max();
  index_t span = 0;
  for (int d = 0; d < V::rank; ++d) {
    const index_t n = t.shape[d] - 1, s = t.stride[d];
    if (n == 0 || s == 0) continue;
    if (s == std::numeric_limits<index_t>::min()) return -1;
    const index_t a = s < 0 ? -s : s;
    if (n > lim / a || span > lim - n * a) return -1;
    span += n * a;
  }
  return span;
}

/// Every later computation on the view (byte ranges, overlap tests) relies on its span in bytes
/// fitting in index_t.
template <class V>
void check_extent(const char* fn, const std::string& name, const V& t) {
  constexpr index_t lim = std::numeric_limits<index_t>::max();
  constexpr index_t elem = static_cast<index_t>(sizeof(typename V::value_type));
  const index_t span = span_elements(t);
  if (span < 0 || span > lim / elem - 1)
    fail(fn, ": ", name, ": expected shape and strides addressing at most ", lim / elem,
         " elements, got an extent that overflows");
}

/// Non-negative strides and a bounded extent. The attention and decode kernels have no use for
/// reversed views; the projection accepts them and calls check_extent alone.
template <class V>
void check_strides(const char* fn, const std::string& name, const V& t) {
  for (int d = 0; d < V::rank; ++d)
    if (t.stride[d] < 0) fail(fn, ": ", name, ".stride[", d, "]: expected >= 0, got ", t.stride[d]);
  check_extent(fn, name, t);
}

/// The attention kernels map each row of the head dim as a contiguous Eigen vector.
template <class V>
void check_inner_contiguous(const char* fn, const std::string& name, const V& t) {
  constexpr int d = V::rank - 1;
  if (t.shape[d] > 1 && t.stride[d] != 1)
    fail(fn, ": ", name, ".stride[", d, "]: expected 1 (head dim must be contiguous), got ",
         t.stride[d]);
}

/// An output whose elements share memory would be written twice with different values. The test
/// is sufficient, not exact: ordered by |stride|, every stride must step past everything the
/// smaller ones reach. It accepts every dense or padded layout (any permutation or reversal of
/// dims) and rejects every broadcast (zero stride) over a dim of size > 1; rare exotic
/// injective interleavings are rejected too. Requires check_extent.
template <class V>
void check_no_self_overlap(const char* fn, const std::string& name, const V& t) {
  auto mag = [&](int d) { return t.stride[d] < 0 ? -t.stride[d] : t.stride[d]; };
  std::array<int, V::rank> dims{};
  int n = 0;
  for (int d = 0; d < V::rank; ++d)
    if (t.shape[d] > 1) dims[n++] = d;
  std::stable_sort(dims.begin(), dims.begin() + n, [&](int a, int b) { return mag(a) < mag(b); });
  index_t reach = 0;  // largest distance reachable through the dims already visited
  for (int i = 0; i < n; ++i) {
    const int d = dims[i];
    if (mag(d) <= reach)
      fail(fn, ": ", name, ".stride[", d, "]: expected ",
           t.stride[d] < 0 ? "<= -" : ">= ", reach + 1, " (", name,
           " is written, its elements must not overlap), got ", t.stride[d]);
    reach += (t.shape[d] - 1) * mag(d);  // bounded by check_extent
  }
}

// --- aliasing -------------------------------------------------------------------------------

/// Where a checked view lies, in bytes: its inclusive range [lo, hi] and the steps of its dims
/// of size > 1, for check_no_alias.
struct Footprint {
  static constexpr int kMaxRank = 8;
  std::string name;
  std::uintptr_t lo = 0, hi = 0, base = 0;
  index_t elem = 0;
  int dims = 0;
  std::array<index_t, kMaxRank> step{}, count{};  // byte stride (signed) and size
};

/// Requires check_extent (so every byte offset fits in index_t).
template <class V>
Footprint footprint(std::string name, const V& t) {
  static_assert(V::rank <= Footprint::kMaxRank, "raise Footprint::kMaxRank");
  Footprint f;
  f.name = std::move(name);
  f.elem = static_cast<index_t>(sizeof(typename V::value_type));
  f.base = reinterpret_cast<std::uintptr_t>(t.data);
  index_t lo = 0, hi = 0;
  for (int d = 0; d < V::rank; ++d) {
    if (t.shape[d] <= 1) continue;
    f.step[f.dims] = t.stride[d] * f.elem;
    f.count[f.dims] = t.shape[d];
    const index_t e = (t.shape[d] - 1) * f.step[f.dims++];
    (e < 0 ? lo : hi) += e;
  }
  f.lo = f.base + static_cast<std::uintptr_t>(lo);  // unsigned wrap-around adds a negative lo
  f.hi = f.base + static_cast<std::uintptr_t>(hi + f.elem - 1);
  return f;
}

inline bool ranges_overlap(const Footprint& a, const Footprint& b) {
  return a.lo <= b.hi && b.lo <= a.hi;
}

/// Modulo a period p, dims stepping by multiples of p change no residue, so all bytes of a view
/// fall in one arc of residues, spanned by its other dims. Disjoint arcs: no shared byte.
inline bool disjoint_modulo(const Footprint& a, const Footprint& b, index_t p) {
  auto arc = [p](const Footprint& f, index_t& start, index_t& len) {
    index_t lo = 0, hi = f.elem;  // byte offsets from base, hi exclusive
    for (int i = 0; i < f.dims; ++i)
      if (f.step[i] % p != 0) ((f.step[i] < 0) ? lo : hi) += (f.count[i] - 1) * f.step[i];
    len = hi - lo;
    const auto up = static_cast<std::uintptr_t>(p);
    start = static_cast<index_t>((f.base + static_cast<std::uintptr_t>(lo)) % up);
  };
  index_t sa = 0, la = 0, sb = 0, lb = 0;
  arc(a, sa, la);
  arc(b, sb, lb);
  if (la > p || lb > p - la) return false;
  const index_t gap = sb >= sa ? sb - sa : sb - sa + p;  // from a's arc start to b's, mod p
  return gap >= la && p - gap >= lb;
}

/// Outputs whose ranges overlap but share no byte, the way views into one buffer interleave: both
/// step by a common period p (the byte stride of a dim of each, e.g. the buffer's row) and stay
/// in their own slots of it (the halves of (..., 2R, M): slots [0, R * M) and [R * M, 2R * M)).
inline bool interleaved(const Footprint& a, const Footprint& b) {
  auto mag = [](index_t s) { return s < 0 ? -s : s; };
  for (int i = 0; i < a.dims; ++i)
    for (int j = 0; j < b.dims; ++j) {
      const index_t p = mag(a.step[i]);
      if (p > 0 && p == mag(b.step[j]) && disjoint_modulo(a, b, p)) return true;
    }
  return false;
}

inline std::string hex(std::uintptr_t a) {
  std::ostringstream os;
  os << "0x" << std::hex << a;
  return os.str();
}

inline std::string hex_range(const Footprint& f) {
  return "[" + hex(f.lo) + ", " + hex(f.hi) + "]";
}

/// The aliasing rule of the header comment. Outputs are checked in order, each against every
/// input, then against the outputs after it.
inline void check_no_alias(const char* fn, const std::vector<Footprint>& outputs,
                           const std::vector<Footprint>& inputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const Footprint& o = outputs[i];
    for (const Footprint& x : inputs)
      if (ranges_overlap(o, x))
        fail(fn, ": ", o.name, ": expected memory disjoint from input ", x.name, " (", o.name,
             " is written), got overlapping byte ranges ", hex_range(o), " and ", hex_range(x));
    for (std::size_t j = i + 1; j < outputs.size(); ++j) {
      const Footprint& x = outputs[j];
      if (!ranges_overlap(o, x) || interleaved(o, x)) continue;
      const std::string same = o.base == x.base ? ", both starting at " + hex(o.base) : "";
      fail(fn, ": ", o.name, ": expected memory disjoint from output ", x.name,
           " (both are written; they may interleave only with strides that keep every element "
           "apart), "
           "got overlapping byte ranges ",
           hex_range(o), " and ", hex_range(x), same);
    }
  }
}

}  // namespace dcmha::detail

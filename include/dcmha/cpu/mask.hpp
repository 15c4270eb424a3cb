#pragma once
// Which keys a query row sees (spec section 1, step 3), as one contiguous range per row.
//
// Every mask the library supports keeps the visible keys of a row contiguous: causal bounds
// them from above (bottom-right aligned), the sliding window from below. Kernels therefore never
// test (t, s) pairs one by one; they iterate [begin, end) and treat everything else as exactly 0.
#include <algorithm>

#include "../params.hpp"
#include "../tensor.hpp"

namespace dcmha::cpu {

struct KeyRange {
  index_t begin = 0, end = 0;  // [begin, end); empty when begin >= end
  bool empty() const { return end <= begin; }
  index_t size() const { return end > begin ? end - begin : 0; }
};

struct RowMask {
  bool causal = false;
  index_t window = 0;  // 0 = none
  index_t T = 0, S = 0;
  TensorView<const index_t, 1> query_lengths, key_lengths;

  RowMask(const detail::MaskParams& mask, index_t T_, index_t S_)
      : causal(mask.causal),
        window(mask.window),
        T(T_),
        S(S_),
        query_lengths(mask.query_lengths),
        key_lengths(mask.key_lengths) {}

  KeyRange row(index_t b, index_t t) const {
    const index_t Tb = query_lengths.empty() ? T : query_lengths(b);
    const index_t Sb = key_lengths.empty() ? S : key_lengths(b);
    if (t >= Tb) return {0, 0};
    const index_t diag = t + (Sb - Tb);  // the key aligned with query t
    index_t e = causal ? std::min(Sb, diag + 1) : Sb;
    index_t s = window > 0 ? std::max<index_t>(0, diag - window + 1) : 0;
    e = std::max<index_t>(e, 0);
    s = std::min(s, Sb);
    return {s, std::max(s, e)};
  }

  /// Rows [t0 + lo, t0 + hi) of the block see at least one key; the others (padding rows, rows
  /// before the first key of causal T > S) lie at its ends. Compose skips them: their
  /// query-wise terms may hold anything (padding), and their output is zero regardless.
  void live_rows(index_t b, index_t t0, index_t t1, index_t& lo, index_t& hi) const {
    lo = t1 - t0;
    hi = 0;
    for (index_t t = t0; t < t1; ++t)
      if (!row(b, t).empty()) {
        lo = std::min(lo, t - t0);
        hi = t - t0 + 1;
      }
    if (hi < lo) lo = hi = 0;
  }

  /// The most keys a block of `rows` consecutive query rows can see: a causal window bounds it
  /// by rows + W - 1 whatever S is, which keeps windowed panels (and so cost) O(W) per row.
  index_t max_block_keys(index_t rows) const {
    return causal && window > 0 ? std::min(S, rows + window - 1) : S;
  }

  /// Union of the ranges of rows [t0, t1) (a block is at most a few dozen rows; empty rows,
  /// which causal T > S and padding produce, do not shrink it).
  KeyRange rows(index_t b, index_t t0, index_t t1) const {
    index_t lo = S, hi = 0;
    for (index_t t = t0; t < t1; ++t) {
      KeyRange r = row(b, t);
      if (r.empty()) continue;
      lo = std::min(lo, r.begin);
      hi = std::max(hi, r.end);
    }
    return hi > lo ? KeyRange{lo, hi} : KeyRange{0, 0};
  }
};

}  // namespace dcmha::cpu

namespace dcmha::cpu {

using detail::KeyRing;

}  // namespace dcmha::cpu

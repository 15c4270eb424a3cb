#pragma once
// Which keys a query row sees (spec section 1, step 3): one definition for every backend.
//
// Every mask the library supports keeps the visible keys of a row contiguous: causal bounds them
// from above (bottom-right aligned to each sequence's own lengths), the sliding window from
// below, the key length from above. Kernels therefore never test (t, s) pairs one by one against
// the mask's rules; they take the row's range and treat everything outside it as exactly 0.
#include "../params.hpp"
#include "../tensor.hpp"

namespace dcmha::detail {

/// Logical keys [begin, end); empty when end <= begin.
struct KeyRange {
  index_t begin = 0, end = 0;
  DCMHA_INLINE bool empty() const { return end <= begin; }
  DCMHA_INLINE index_t size() const { return end > begin ? end - begin : 0; }
  DCMHA_INLINE bool contains(index_t s) const { return s >= begin && s < end; }
};

/// Sequence b's length from per-sequence lengths, or `full` where none are given.
DCMHA_INLINE index_t sequence_length(const TensorView<const index_t, 1>& lengths, index_t b,
                                     index_t full) {
  return lengths.empty() ? full : lengths(b);
}

/// The keys of a row t of a sequence with `query_length` real rows and `key_length` real keys:
/// empty for a padding row (t >= query_length), else clamped to [0, key_length).
DCMHA_INLINE KeyRange visible_keys(const MaskParams& mask, index_t t, index_t query_length,
                                   index_t key_length) {
  if (t >= query_length) return {0, 0};
  const index_t diagonal = t + (key_length - query_length);  // the key aligned with row t
  index_t end = key_length;
  if (mask.causal && diagonal + 1 < end) end = diagonal + 1;
  if (end < 0) end = 0;
  index_t begin = 0;
  if (mask.window > 0 && diagonal - mask.window + 1 > 0) begin = diagonal - mask.window + 1;
  if (begin > key_length) begin = key_length;
  return {begin, end > begin ? end : begin};
}

/// The mask of one call: each row's keys, and what blocks of rows see together.
struct RowMask {
  MaskParams mask;
  index_t T = 0, S = 0;

  DCMHA_INLINE RowMask(const MaskParams& m, index_t T_, index_t S_) : mask(m), T(T_), S(S_) {}

  DCMHA_INLINE index_t query_length(index_t b) const {
    return sequence_length(mask.query_lengths, b, T);
  }
  DCMHA_INLINE index_t key_length(index_t b) const {
    return sequence_length(mask.key_lengths, b, S);
  }

  /// The keys row t of sequence b sees.
  DCMHA_INLINE KeyRange row(index_t b, index_t t) const {
    return visible_keys(mask, t, query_length(b), key_length(b));
  }

  /// The union of the ranges of rows [t0, t1): rows see ranges whose ends move forward with t
  /// (nested or sliding), so the first and last rows that see any key bound it; empty rows
  /// (padding, causal rows before the first key) do not shrink it.
  DCMHA_INLINE KeyRange rows(index_t b, index_t t0, index_t t1) const {
    index_t lo = S, hi = 0;
    for (index_t t = t0; t < t1; ++t) {
      const KeyRange r = row(b, t);
      if (r.empty()) continue;
      if (r.begin < lo) lo = r.begin;
      if (r.end > hi) hi = r.end;
    }
    return hi > lo ? KeyRange{lo, hi} : KeyRange{0, 0};
  }

  /// Rows [t0 + lo, t0 + hi) of the block [t0, t1) see at least one key; the others (padding
  /// rows, rows before the first key of causal T > S) lie at its ends.
  DCMHA_INLINE void live_rows(index_t b, index_t t0, index_t t1, index_t& lo, index_t& hi) const {
    lo = t1 - t0;
    hi = 0;
    for (index_t t = t0; t < t1; ++t)
      if (!row(b, t).empty()) {
        if (t - t0 < lo) lo = t - t0;
        hi = t - t0 + 1;
      }
    if (hi < lo) lo = hi = 0;
  }

  /// The most keys a block of `rows` consecutive query rows can see: a causal window bounds it
  /// by rows + W - 1 whatever S is, which keeps windowed work O(W) per row.
  DCMHA_INLINE index_t max_block_keys(index_t rows) const {
    return mask.causal && mask.window > 0 && rows + mask.window - 1 < S ? rows + mask.window - 1
                                                                        : S;
  }
};

}  // namespace dcmha::detail

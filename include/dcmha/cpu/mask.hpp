#pragma once
// Which keys a query row sees (spec section 1, step 3), as one contiguous range per row.
//
// Every mask the library supports keeps the visible keys of a row contiguous: causal bounds
// them from above (bottom-right aligned), the sliding window from below. Kernels therefore never
// test (t, s) pairs one by one; they iterate [begin, end) and treat everything else as exactly 0.
#include <algorithm>

#include "../config.hpp"
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

  RowMask(const AttentionConfig& cfg, index_t T_, index_t S_)
      : causal(cfg.mask == Mask::causal), window(cfg.window), T(T_), S(S_) {}

  KeyRange row(index_t t) const {
    const index_t diag = t + (S - T);  // the key aligned with query t
    index_t e = causal ? std::min(S, diag + 1) : S;
    index_t b = window > 0 ? std::max<index_t>(0, diag - window + 1) : 0;
    e = std::max<index_t>(e, 0);
    b = std::min(b, S);
    return {b, std::max(b, e)};
  }

  /// Union of the ranges of rows [t0, t1) (a block is at most a few dozen rows; empty rows,
  /// which causal T > S produces, do not shrink it).
  KeyRange rows(index_t t0, index_t t1) const {
    index_t b = S, e = 0;
    for (index_t t = t0; t < t1; ++t) {
      KeyRange r = row(t);
      if (r.empty()) continue;
      b = std::min(b, r.begin);
      e = std::max(e, r.end);
    }
    return e > b ? KeyRange{b, e} : KeyRange{0, 0};
  }
};

}  // namespace dcmha::cpu

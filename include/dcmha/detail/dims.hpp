#pragma once
// Problem sizes of one attention call, derived and checked by detail/validate.hpp.
#include "../tensor.hpp"

namespace dcmha::detail {

struct AttentionDims {
  index_t B = 0, H = 0, Hk = 0;  // batch, query heads, key/value heads
  index_t T = 0, S = 0;          // query length, key length
  index_t D = 0, Dv = 0;         // query/key head dim, value head dim
  index_t G = 0, M = 0;          // compose groups and heads per group (M = H / G)
};

}  // namespace dcmha::detail

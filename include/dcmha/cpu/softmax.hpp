#pragma once
// The softmax of one query row over its visible keys, in the pieces the kernels need: an online
// pass over key tiles (the forward's pass 1), the team's statistics combined, one factor per tile
// that turns stored exponentials into probabilities (the forward's pass 2), probabilities from
// the forward's lse (the backward), and the zeros of keys a row does not see.
//
// A row's values live in a panel slab with row[s] holding key s of the tile's keys [cs, ce);
// the row sees keys [visible_begin, visible_end) (RowMask), possibly none of the tile.
#include <algorithm>
#include <cmath>
#include <limits>

#include "../tensor.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

template <class A>
constexpr A kNegInf = -std::numeric_limits<A>::infinity();

/// One row and head's running statistics: the maximum seen so far and the sum of exponentials
/// taken against it; max = -inf means no key yet.
template <class A>
struct RunningSoftmax {
  A max = kNegInf<A>;
  A sum = A(0);
};

/// Keys [cs, ce) of a row that lie outside [visible_begin, visible_end) become exactly 0, so that
/// Compose_post and P'V (or the backward's products) see nothing of them.
template <class A>
inline void zero_invisible_keys(A* row, index_t cs, index_t ce, index_t visible_begin,
                                index_t visible_end) {
  for (index_t s = cs; s < std::min(visible_begin, ce); ++s) row[s] = A(0);
  for (index_t s = std::max(visible_end, cs); s < ce; ++s) row[s] = A(0);
}

/// row[s] = exp(row[s] - running max) over keys [begin, end) (non-empty), the running maximum
/// `max` raised to theirs first and the sum of exponentials so far rescaled to it.
template <class A>
inline void exponentiate_online(A* row, index_t begin, index_t end, A& max, A& sum) {
  Segment<A> e(row + begin, end - begin);
  const A new_max = std::max(max, e.maxCoeff());
  // Rescale the sum so far; max = -inf means there is none yet (and exp would give NaN).
  if (max != kNegInf<A> && new_max != max) sum *= std::exp(max - new_max);
  max = new_max;
  e = (e - max).exp();
  sum += e.sum();
}

/// One row and head's statistics over a team's ranks (each saw a share of the keys): `max` and
/// `sum` hold rank j's at j * stride; summed in rank order.
template <class A>
inline RunningSoftmax<A> combine_ranks(const A* max, const A* sum, index_t stride, int ranks) {
  RunningSoftmax<A> total;
  for (int j = 0; j < ranks; ++j) total.max = std::max(total.max, max[j * stride]);
  for (int j = 0; j < ranks; ++j) {
    const A mj = max[j * stride];
    if (mj != kNegInf<A>) total.sum += sum[j * stride] * std::exp(mj - total.max);
  }
  return total;
}

/// The factors that turn one tile's exponentials into probabilities, n of them (a block's rows
/// and heads): exp(tile max - row max) / row sum, vectorized rather than a scalar exp each. No
/// keys seen yet (tile max = -inf) gives 0, also where the row sees none at all (tile max - row
/// max would be NaN there).
template <class A>
inline void tile_probability_factors(const A* tile_max, const A* row_max, const A* inverse_sum,
                                     index_t n, A* factors) {
  using Row = Eigen::Map<const Eigen::Array<A, Eigen::Dynamic, 1>>;
  const Row tm(tile_max, n), fm(row_max, n), inv(inverse_sum, n);
  Segment<A>(factors, n) = (tm == kNegInf<A>).select(A(0), (tm - fm).exp() * inv);
}

/// row[s] = exp(row[s] - lse) over keys [begin, end): probabilities from the forward's
/// statistics.
template <class A>
inline void probabilities_from_lse(A* row, index_t begin, index_t end, A lse) {
  if (end <= begin) return;
  Segment<A> p(row + begin, end - begin);
  p = (p - lse).exp();
}

}  // namespace dcmha::cpu

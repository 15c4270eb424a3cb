#pragma once
// The softmax of one query row over its visible keys, in the pieces the kernels need: an online
// pass over key tiles (the forward's pass 1; the row's state, and the merge of a team's states,
// are common/softmax_state.hpp's), one factor per tile that turns stored exponentials into
// probabilities (the forward's pass 2), probabilities from the forward's lse (the backward), and
// the zeros of keys a row does not see.
//
// A row's values live in a panel slab with row[s] holding key s of the tile's keys [cs, ce);
// the row sees keys [visible_begin, visible_end) (common/mask.hpp), possibly none of the tile.
#include <algorithm>

#include "../common/softmax_state.hpp"
#include "../tensor.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

/// Keys [cs, ce) of a row that lie outside [visible_begin, visible_end) become exactly 0, so that
/// Compose_post and P'V (or the backward's products) see nothing of them.
template <class A>
inline void zero_invisible_keys(A* row, index_t cs, index_t ce, index_t visible_begin,
                                index_t visible_end) {
  for (index_t s = cs; s < std::min(visible_begin, ce); ++s) row[s] = A(0);
  for (index_t s = std::max(visible_end, cs); s < ce; ++s) row[s] = A(0);
}

/// row[s] = exp(row[s] - running max) over keys [begin, end) (non-empty), the row's state
/// raised to their maximum first (its sum so far rescaled to it), their sum added.
template <class A>
inline void exponentiate_online(A* row, index_t begin, index_t end,
                                detail::SoftmaxState<A>& state) {
  Segment<A> e(row + begin, end - begin);
  state.raise_max(e.maxCoeff());
  e = (e - state.max).exp();
  state.sum += e.sum();
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
  Segment<A>(factors, n) =
      (tm == detail::negative_infinity<A>()).select(A(0), (tm - fm).exp() * inv);
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

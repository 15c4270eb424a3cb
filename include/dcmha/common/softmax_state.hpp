#pragma once
// The online softmax of one row and head, for every backend: the running maximum of the scores
// seen so far and the sum of their exponentials taken against it (Milakov and Gimelshein's online
// normalizer), the rescaling when the maximum rises, the merge of states that saw disjoint keys,
// and the log-sum-exp they end in.
#include <cmath>
#include <limits>

#include "../tensor.hpp"

namespace dcmha::detail {

template <class A>
DCMHA_INLINE constexpr A negative_infinity() {
  return -std::numeric_limits<A>::infinity();
}

template <class A>
struct SoftmaxState {
  A max = negative_infinity<A>();  // -inf: no key seen yet
  A sum = A(0);

  DCMHA_INLINE bool empty() const { return max == negative_infinity<A>(); }

  /// Raises the running maximum to at least m and rescales the sum to it. Returns the factor the
  /// old sum (and anything accumulated against the old maximum) was multiplied by: 1 when the
  /// maximum stays, 0 when there was none yet (exp(-inf - m) would be NaN for m = -inf).
  DCMHA_INLINE A raise_max(A m) {
    using std::exp;
    if (!(m > max)) return A(1);
    const A factor = empty() ? A(0) : exp(max - m);
    sum *= factor;
    max = m;
    return factor;
  }

  /// log(sum) + max; -inf for a row that saw no key (its output is then zero).
  DCMHA_INLINE A lse() const {
    using std::log;
    return sum > A(0) ? max + log(sum) : negative_infinity<A>();
  }
};

/// The log-sum-exp of the scores seen so far as one value, where registers are too few for a
/// SoftmaxState: each score adds log(1 + exp(lo - hi)) to the larger of it and the value, an
/// exponential and a logarithm, and a rounding of the value (relative 2^-24) each time.
template <class A>
struct RunningLse {
  A value = negative_infinity<A>();  // -inf: no key seen yet

  /// Adds one finite score x.
  DCMHA_INLINE void add(A x) {
    using std::exp;
    using std::log;
    const A hi = x > value ? x : value, lo = x > value ? value : x;
    value = hi + log(A(1) + exp(lo - hi));
  }
  /// The state it stands for: any maximum with its sum gives the same lse and merges alike.
  DCMHA_INLINE SoftmaxState<A> state() const {
    SoftmaxState<A> s;
    s.max = value;
    s.sum = value > negative_infinity<A>() ? A(1) : A(0);
    return s;
  }
};

/// The state of n states that saw disjoint keys, `at(j)` giving the j-th: the maximum of all first,
/// then the sums rescaled to it and added in order j = 0, 1, ... (a fixed order, so a backend that
/// splits a row's keys gets the same result on every run).
template <class A, class At>
DCMHA_INLINE SoftmaxState<A> merge_states(int n, At&& at) {
  using std::exp;
  SoftmaxState<A> total;
  for (int j = 0; j < n; ++j) {
    const A max = at(j).max;  // one read of state j: at() may load it from memory
    if (max > total.max) total.max = max;
  }
  for (int j = 0; j < n; ++j) {
    const SoftmaxState<A> s = at(j);
    if (!s.empty()) total.sum += s.sum * exp(s.max - total.max);
  }
  return total;
}

}  // namespace dcmha::detail

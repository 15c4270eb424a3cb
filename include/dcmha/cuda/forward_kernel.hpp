#pragma once
// The forward (and decode) kernel body: one block per (query tile, compose group, sequence).
//
// Two passes over the keys the tile's rows see. The first computes each row's softmax
// statistics of the pre-composed scores; the second recomputes the scores, turns them into
// exact probabilities with those statistics, post-composes them and accumulates P' V. The
// recomputation replaces the CPU backend's score panels: on a GPU one row's M x S panel does not
// fit in shared memory, and post-compose needs normalized probabilities of every head.
#include <cmath>

#include "scores_tile.hpp"

namespace dcmha::cuda {

/// The forward's shared memory.
template <class A>
struct ForwardShared {
  using value_type = A;
  A *scores, *composed;        // [M][rows][keys]
  LowRankSums<A> sums;         // [rank][positions], of the input
  A *row_max, *row_sum, *lse;  // [M][rows]
  A* out;                      // [M][rows][Dv]

  DCMHA_HOST_DEVICE void carve(SharedArena<A>& arena, const TileGeometry& geo) {
    scores = arena.take(geo.scores());
    composed = arena.take(geo.scores());
    sums.query_of_input = arena.take(geo.rank * geo.positions());
    sums.key_of_input = arena.take(geo.rank * geo.positions());
    row_max = arena.take(geo.M * geo.rows);
    row_sum = arena.take(geo.M * geo.rows);
    lse = arena.take(geo.M * geo.rows);
    out = arena.take(geo.M * geo.rows * geo.Dv);
  }
};

template <class T, class Block>
class ForwardKernel {
 public:
  using A = acc_t<T>;

  DCMHA_HOST_DEVICE ForwardKernel(const Block& blk, const detail::ForwardParams<T>& p,
                                  const TileGeometry& geo)
      : blk_(blk), p_(p), geo_(geo), sh_(carve_shared<ForwardShared<A>>(blk.shared(), geo)) {
    at_.rows = query_tile(p, geo, blk.block(0), blk.block(1), blk.block(2));
    at_.ring = p.keys;
  }

  DCMHA_HOST_DEVICE void run() {
    const KeyRange keys = tile_keys(p_.mask, at_.rows);
    fill(blk_, sh_.row_max, geo_.M * geo_.rows, negative_infinity<A>());
    fill(blk_, sh_.row_sum, geo_.M * geo_.rows, A(0));
    fill(blk_, sh_.out, geo_.M * geo_.rows * geo_.Dv, A(0));
    blk_.sync();
    for (index_t s0 = keys.begin; s0 < keys.end; s0 += geo_.keys) {
      step_to(s0, keys.end);
      composed_score_tile(blk_, p_, geo_, at_, sh_.scores, sh_.composed, sh_.sums);
      accumulate_statistics();
      blk_.sync();
    }
    finish_statistics();
    blk_.sync();
    for (index_t s0 = keys.begin; s0 < keys.end; s0 += geo_.keys) {
      step_to(s0, keys.end);
      composed_score_tile(blk_, p_, geo_, at_, sh_.scores, sh_.composed, sh_.sums);
      probabilities_tile(blk_, p_, geo_, at_, sh_.lse, sh_.composed);
      blk_.sync();
      compose_tile(blk_, p_.compose.post, geo_, at_, sh_.composed, sh_.scores, sh_.sums);
      blk_.sync();
      accumulate_values(sh_.scores);
      blk_.sync();
    }
    store_output();
  }

 private:
  DCMHA_HOST_DEVICE void step_to(index_t s0, index_t end) {
    at_.keys.s0 = s0;
    at_.keys.count = end - s0 < geo_.keys ? end - s0 : geo_.keys;
  }

  /// Online softmax statistics: item (m, r) is one thread's in every step.
  DCMHA_HOST_DEVICE void accumulate_statistics() {
    using std::exp;
    for_each_owned(blk_, geo_.M * geo_.rows, [&](index_t item) {
      const index_t m = item / geo_.rows, r = item % geo_.rows;
      const KeyRange seen =
          visible_keys(p_.mask, at_.rows.t0 + r, at_.rows.query_length, at_.rows.key_length);
      const A* row = sh_.composed + m * geo_.positions() + r * geo_.keys;
      A tile_max = negative_infinity<A>();
      for (index_t c = 0; c < at_.keys.count; ++c)
        if (sees(seen, at_.keys.s0 + c) && row[c] > tile_max) tile_max = row[c];
      if (tile_max == negative_infinity<A>()) return;  // no key of this row in the step
      const A old_max = sh_.row_max[item];
      const A new_max = old_max > tile_max ? old_max : tile_max;
      A sum = old_max == negative_infinity<A>() ? A(0) : sh_.row_sum[item] * exp(old_max - new_max);
      for (index_t c = 0; c < at_.keys.count; ++c)
        if (sees(seen, at_.keys.s0 + c)) sum += exp(row[c] - new_max);
      sh_.row_max[item] = new_max;
      sh_.row_sum[item] = sum;
    });
  }

  /// lse = max + log(sum), -inf for a row that sees no key (its output is then zero).
  DCMHA_HOST_DEVICE void finish_statistics() {
    using std::log;
    for_each_owned(blk_, geo_.M * geo_.rows, [&](index_t item) {
      const index_t m = item / geo_.rows, r = item % geo_.rows;
      const A sum = sh_.row_sum[item];
      const A lse = sum > 0 ? sh_.row_max[item] + log(sum) : negative_infinity<A>();
      sh_.lse[item] = lse;
      if (r < at_.rows.rows && !p_.lse.empty())
        p_.lse(at_.rows.b, at_.rows.g * geo_.M + m, at_.rows.t0 + r) = lse;
    });
  }

  /// out[m][r][e] += sum_c P'[m][r][c] v[s][e]: item (m, r, e) is one thread's in every step.
  DCMHA_HOST_DEVICE void accumulate_values(const A* composed_probabilities) {
    const index_t heads_per_kv = p_.dims.H / p_.dims.Hk, b = at_.rows.b;
    for_each_owned(blk_, geo_.M * geo_.rows * geo_.Dv, [&](index_t item) {
      const index_t m = item / (geo_.rows * geo_.Dv), r = item / geo_.Dv % geo_.rows;
      const index_t e = item % geo_.Dv, kv = (at_.rows.g * geo_.M + m) / heads_per_kv;
      const A* row = composed_probabilities + m * geo_.positions() + r * geo_.keys;
      A sum = 0;
      for (index_t c = 0; c < at_.keys.count; ++c)
        sum += row[c] * A(p_.v(b, kv, at_.ring.slot(b, at_.keys.s0 + c), e));
      sh_.out[item] += sum;
    });
  }

  DCMHA_HOST_DEVICE void store_output() {
    for_each_owned(blk_, geo_.M * at_.rows.rows * geo_.Dv, [&](index_t item) {
      const index_t m = item / (at_.rows.rows * geo_.Dv), r = item / geo_.Dv % at_.rows.rows;
      const index_t e = item % geo_.Dv;
      p_.out(at_.rows.b, at_.rows.g * geo_.M + m, at_.rows.t0 + r, e) =
          T(sh_.out[(m * geo_.rows + r) * geo_.Dv + e]);
    });
  }

  const Block& blk_;
  const detail::ForwardParams<T>& p_;
  TileGeometry geo_;
  ForwardShared<A> sh_;
  TilePlace at_;
};

}  // namespace dcmha::cuda

#pragma once
// The forward (and decode) kernel body: one block per (query tile, compose group, sequence).
//
// Two passes over the keys the tile's rows see. The first computes each row's softmax
// statistics of the pre-composed scores; the second recomputes the scores, turns them into
// exact probabilities with those statistics, post-composes them and accumulates P' V. The
// recomputation replaces the CPU backend's score panels: on a GPU one row's M x S panel does not
// fit in shared memory, and post-compose needs normalized probabilities of every head.
//
// With few query blocks and many keys (decode: one row per sequence, and DCMHA's one group) the
// keys of a tile are split across `KeySplit::count` blocks: partial statistics, combined into
// the lse in a fixed order, then partial P'V, summed in a fixed order (four launches).
#include <cmath>

#include "scores_tile.hpp"
#include "tensor_core_tile.hpp"

namespace dcmha::cuda {

/// The forward's shared memory.
template <class A>
struct ForwardShared {
  using value_type = A;
  A *scores, *composed;            // [M][rows][keys]
  LowRankSums<A> sums;             // [rank][positions], of the input
  A *row_max, *row_sum, *lse;      // [M][rows]
  A* out;                          // [M][rows][Dv]
  TensorCoreStaging tensor_cores;  // bf16 with geo.tensor_warps: the products' staging

  DCMHA_HOST_DEVICE void carve(SharedArena<A>& arena, const TileGeometry& geo) {
    scores = arena.take(geo.scores());
    composed = arena.take(geo.scores());
    sums.query_of_input = arena.take(geo.rank * geo.positions());
    sums.key_of_input = arena.take(geo.rank * geo.positions());
    row_max = arena.take(geo.M * geo.rows);
    row_sum = arena.take(geo.M * geo.rows);
    lse = arena.take(geo.M * geo.rows);
    out = arena.take(geo.M * geo.rows * geo.Dv);
    if constexpr (std::is_same_v<A, float>) tensor_cores.carve(arena, geo);
  }
};

/// The scratch of a forward whose keys are split across blocks; count 1: not split.
template <class A>
struct KeySplit {
  index_t count = 1;
  A* stats = nullptr;  // [split][B][H][T][2]: each split's row max and sum
  A* lse = nullptr;    // [B][H][T]
  A* out = nullptr;    // [split][B][H][T][Dv]: each split's P'V
};

template <class T, class Block>
class ForwardKernel {
 public:
  using A = acc_t<T>;

  /// The block's query tile and, for a split forward, its share of the keys: grid z is
  /// split * B + sequence.
  DCMHA_HOST_DEVICE ForwardKernel(const Block& blk, const detail::ForwardParams<T>& p,
                                  const TileGeometry& geo, const KeySplit<A>& split = {})
      : blk_(blk),
        p_(p),
        geo_(geo),
        sh_(carve_shared<ForwardShared<A>>(blk.shared(), geo)),
        split_(split) {
    split_index_ = blk.block(2) / p.dims.B;
    at_.rows = query_tile(p, geo, blk.block(0), blk.block(1), blk.block(2) % p.dims.B);
    at_.ring = p.keys;
  }

  /// The whole forward of the block's rows.
  DCMHA_HOST_DEVICE void run() {
    const KeyRange keys = tile_keys(p_.mask, at_.rows);
    start();
    statistics_pass(keys);
    finish_statistics();
    blk_.sync();
    values_pass(keys);
    store_output();
  }

  /// A split forward's first launch: this share's row statistics into the scratch.
  DCMHA_HOST_DEVICE void run_split_statistics() {
    start();
    statistics_pass(split_keys());
    for_each_owned(blk_, geo_.M * at_.rows.rows, [&](index_t item) {
      const index_t m = item / at_.rows.rows, r = item % at_.rows.rows;
      A* stats = split_.stats + 2 * (split_index_ * rows_total() + row_index(m, r));
      stats[0] = sh_.row_max[m * geo_.rows + r];
      stats[1] = sh_.row_sum[m * geo_.rows + r];
    });
  }

  /// A split forward's third launch (after combine_split_statistics): this share's P'V.
  DCMHA_HOST_DEVICE void run_split_values() {
    start();
    for_each_owned(blk_, geo_.M * geo_.rows, [&](index_t item) {
      const index_t m = item / geo_.rows, r = item % geo_.rows;
      sh_.lse[item] = r < at_.rows.rows ? split_.lse[row_index(m, r)] : negative_infinity<A>();
    });
    blk_.sync();
    values_pass(split_keys());
    for_each_owned(blk_, geo_.M * at_.rows.rows * geo_.Dv, [&](index_t item) {
      const index_t m = item / (at_.rows.rows * geo_.Dv), r = item / geo_.Dv % at_.rows.rows;
      const index_t e = item % geo_.Dv;
      split_.out[(split_index_ * rows_total() + row_index(m, r)) * geo_.Dv + e] =
          sh_.out[(m * geo_.rows + r) * geo_.Dv + e];
    });
  }

 private:
  DCMHA_HOST_DEVICE index_t rows_total() const { return p_.dims.B * p_.dims.H * p_.dims.T; }
  DCMHA_HOST_DEVICE index_t row_index(index_t m, index_t r) const {
    return (at_.rows.b * p_.dims.H + at_.rows.g * geo_.M + m) * p_.dims.T + at_.rows.t0 + r;
  }

  /// This block's share of the tile's keys: whole key steps, split as evenly as they go (a
  /// share may be empty).
  DCMHA_HOST_DEVICE KeyRange split_keys() const {
    const KeyRange keys = tile_keys(p_.mask, at_.rows);
    const index_t steps = (keys.end - keys.begin + geo_.keys - 1) / geo_.keys;
    const index_t per_split = (steps + split_.count - 1) / split_.count;
    const index_t begin = keys.begin + split_index_ * per_split * geo_.keys;
    const index_t end =
        begin + per_split * geo_.keys < keys.end ? begin + per_split * geo_.keys : keys.end;
    return begin < end ? KeyRange{begin, end} : KeyRange{0, 0};
  }

  DCMHA_HOST_DEVICE void start() {
    fill(blk_, sh_.row_max, geo_.M * geo_.rows, negative_infinity<A>());
    fill(blk_, sh_.row_sum, geo_.M * geo_.rows, A(0));
    fill(blk_, sh_.out, geo_.M * geo_.rows * geo_.Dv, A(0));
    blk_.sync();
  }

  DCMHA_HOST_DEVICE void statistics_pass(const KeyRange& keys) {
    for (index_t s0 = keys.begin; s0 < keys.end; s0 += geo_.keys) {
      step_to(s0, keys.end);
      composed_score_tile(blk_, p_, geo_, at_, sh_.tensor_cores, sh_.scores, sh_.composed,
                          sh_.sums);
      accumulate_statistics();
      blk_.sync();
    }
  }

  /// P = exp(L' - lse), Compose_post, P'V over the keys; ends synced.
  DCMHA_HOST_DEVICE void values_pass(const KeyRange& keys) {
    for (index_t s0 = keys.begin; s0 < keys.end; s0 += geo_.keys) {
      step_to(s0, keys.end);
      composed_score_tile(blk_, p_, geo_, at_, sh_.tensor_cores, sh_.scores, sh_.composed,
                          sh_.sums);
      probabilities_tile(blk_, p_, geo_, at_, sh_.lse, sh_.composed);
      blk_.sync();
      compose_tile(blk_, p_.compose.post, geo_, at_, sh_.composed, sh_.scores, sh_.sums);
      blk_.sync();
      accumulate_values(sh_.scores);
      blk_.sync();
    }
  }

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
          cuda::visible_keys(p_.mask, at_.rows.t0 + r, at_.rows.query_length, at_.rows.key_length);
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
    if constexpr (std::is_same_v<T, bf16>)
      if (geo_.tensor_warps > 0)
        return accumulate_values_on_tensor_cores(blk_, p_, geo_, at_, sh_.tensor_cores,
                                                 composed_probabilities, sh_.out);
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
  KeySplit<A> split_;
  index_t split_index_ = 0;
  TilePlace at_;
};

/// A split forward's second launch, one block per sequence: each row's lse from the splits'
/// statistics, combined in split order (and written to the caller's lse, if kept).
template <class Block, class T>
DCMHA_HOST_DEVICE void combine_split_statistics(const Block& blk, const detail::ForwardParams<T>& p,
                                                const KeySplit<acc_t<T>>& split) {
  using A = acc_t<T>;
  using std::exp;
  using std::log;
  const index_t b = blk.block(0), H = p.dims.H, T_ = p.dims.T;
  const index_t rows_total = p.dims.B * H * T_;
  for_each_owned(blk, H * T_, [&](index_t item) {
    const index_t row = b * H * T_ + item;
    A max = negative_infinity<A>();
    for (index_t s = 0; s < split.count; ++s) {
      const A m = split.stats[2 * (s * rows_total + row)];
      max = m > max ? m : max;
    }
    A sum = 0;
    for (index_t s = 0; s < split.count; ++s) {
      const A* stats = split.stats + 2 * (s * rows_total + row);
      if (stats[0] > negative_infinity<A>()) sum += stats[1] * exp(stats[0] - max);
    }
    const A lse = sum > 0 ? max + log(sum) : negative_infinity<A>();
    split.lse[row] = lse;
    if (!p.lse.empty()) p.lse(b, item / T_, item % T_) = lse;
  });
}

/// A split forward's last launch, one block per sequence: out = the splits' P'V summed in split
/// order, rounded once.
template <class Block, class T>
DCMHA_HOST_DEVICE void sum_split_outputs(const Block& blk, const detail::ForwardParams<T>& p,
                                         const KeySplit<acc_t<T>>& split) {
  using A = acc_t<T>;
  const index_t b = blk.block(0), H = p.dims.H, T_ = p.dims.T, Dv = p.dims.Dv;
  const index_t rows_total = p.dims.B * H * T_;
  for_each_owned(blk, H * T_ * Dv, [&](index_t item) {
    const index_t row = b * H * T_ + item / Dv, e = item % Dv;
    A sum = 0;
    for (index_t s = 0; s < split.count; ++s) sum += split.out[(s * rows_total + row) * Dv + e];
    p.out(b, item / Dv / T_, item / Dv % T_, e) = T(sum);
  });
}

}  // namespace dcmha::cuda

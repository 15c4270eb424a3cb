#pragma once
// The score-side steps every kernel shares: L = scale Q K^T on a tile (zero where a row does not
// see a key), Compose_pre, and probabilities from the forward's lse.
#include <cmath>

#include "compose_tile.hpp"
#include "tensor_core_tile.hpp"

namespace dcmha::cuda {

/// L[m][r][c] = scale q_h[t] . k_kv(h)[s] where row t sees key s, 0 elsewhere (and outside the
/// tile), so that the composed tile's invisible positions carry nothing into the sums.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void score_tile(const Block& blk, const detail::QkvParams<T>& p,
                                  const TileGeometry& geo, const TilePlace& at, A* scores) {
  const index_t P = geo.positions(), heads_per_kv = p.dims.H / p.dims.Hk;
  for_each_owned(blk, geo.scores(), [&](index_t i) {
    const index_t m = i / P;
    const Position q = position(geo, at, i % P);
    const KeyRange seen = cuda::visible_keys(p.mask, q.t, at.rows.query_length, at.rows.key_length);
    if (!q.real || !sees(seen, q.s)) {
      scores[i] = 0;
      return;
    }
    const index_t h = at.rows.g * geo.M + m, b = at.rows.b;
    A dot = 0;
    for (index_t d = 0; d < geo.D; ++d)
      dot += A(p.q(b, h, q.t, d)) * A(p.k(b, h / heads_per_kv, q.slot, d));
    scores[i] = A(p.scale) * dot;
  });
}

/// score_tile, on tensor cores where the plan staged for them.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void planned_score_tile(const Block& blk, const detail::QkvParams<T>& p,
                                          const TileGeometry& geo, const TilePlace& at,
                                          const TensorCoreStaging& staging, A* scores) {
  if constexpr (std::is_same_v<T, bf16>)
    if (geo.tensor_warps > 0) return score_tile_on_tensor_cores(blk, p, geo, at, staging, scores);
  score_tile(blk, p, geo, at, scores);
}

/// The tile's raw scores into `scores` and the pre-composed ones into `composed`; ends synced.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void composed_score_tile(const Block& blk, const detail::QkvParams<T>& p,
                                           const TileGeometry& geo, const TilePlace& at,
                                           const TensorCoreStaging& staging, A* scores, A* composed,
                                           LowRankSums<A> sums) {
  planned_score_tile(blk, p, geo, at, staging, scores);
  blk.sync();
  compose_tile(blk, p.compose.pre, geo, at, scores, composed, sums);
  blk.sync();
}

/// x[m][r][c] = exp(x - lse[m][r]) where row t sees key s, 0 elsewhere: the exact
/// probabilities, from the statistics of a first pass (or the forward's). No barrier inside.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void probabilities_tile(const Block& blk, const detail::QkvParams<T>& p,
                                          const TileGeometry& geo, const TilePlace& at,
                                          const A* lse, A* x) {
  const index_t P = geo.positions();
  for_each_owned(blk, geo.scores(), [&](index_t i) {
    const index_t m = i / P;
    const Position q = position(geo, at, i % P);
    const KeyRange seen = cuda::visible_keys(p.mask, q.t, at.rows.query_length, at.rows.key_length);
    const A row_lse = lse[m * geo.rows + q.r];
    using std::exp;
    x[i] =
        q.real && sees(seen, q.s) && row_lse > negative_infinity<A>() ? exp(x[i] - row_lse) : A(0);
  });
}

}  // namespace dcmha::cuda

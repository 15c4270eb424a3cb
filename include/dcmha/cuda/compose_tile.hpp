#pragma once
// Compose (spec section 1, step 2 and 5) on score-shaped tiles in shared memory, its transpose,
// and its weights' gradients. Each position (r, c) of a tile is one thread's: it reads the M
// heads' values there and writes the M composed ones, so no barrier is needed inside a call, only
// around it. The low-rank terms go through their R projections per position, kept in shared
// memory beside the tile (`LowRankSums`) for the weight gradients that need them.
#include "tile.hpp"

namespace dcmha::cuda {

/// Where one tile sits: query rows and keys (logical), and the key slots (a decode ring).
struct TilePlace {
  QueryTile rows;
  KeyTile keys;
  detail::KeyRing ring;
};

/// A position's row, logical key and key slot. `real` is false outside the tile's rows or keys
/// and for the padding of per-sequence lengths: nothing is read there (a caller's padding may
/// hold anything), and every tile array holds 0.
struct Position {
  index_t r = 0, c = 0, t = 0, s = 0, slot = 0;
  bool real = false;
};

DCMHA_HOST_DEVICE inline Position position(const TileGeometry& geo, const TilePlace& at,
                                           index_t pos) {
  Position p;
  p.r = pos / geo.keys;
  p.c = pos % geo.keys;
  p.t = at.rows.t0 + p.r;
  p.s = at.keys.s0 + p.c;
  p.real = p.r < at.rows.rows && p.c < at.keys.count && p.t < at.rows.query_length &&
           p.s < at.rows.key_length;
  p.slot = p.real ? at.ring.slot(at.rows.b, p.s) : 0;
  return p;
}

/// Per position, the R sums over heads of the low-rank terms: of the input (sum_m x[m] w1[r, m])
/// and, in the transpose, of the upstream gradient (sum_n dy[n] w2[r, n]). [rank][position].
template <class A>
struct LowRankSums {
  A *query_of_input = nullptr, *key_of_input = nullptr;
  A *query_of_grad = nullptr, *key_of_grad = nullptr;
};

template <class T>
DCMHA_HOST_DEVICE index_t query_rank(const ComposeTerms<T>& c) {
  return c.query_wise ? c.qw1.shape[3] : 0;
}
template <class T>
DCMHA_HOST_DEVICE index_t key_rank(const ComposeTerms<T>& c) {
  return c.key_wise ? c.kw1.shape[3] : 0;
}

/// Zero sums at a position outside the tile: the weight gradients sum over whole rows and
/// columns of the tile, and a stale value there times a zero input must not become NaN.
template <class T, class A>
DCMHA_HOST_DEVICE void zero_sums(const ComposeTerms<T>& side, const LowRankSums<A>& sums,
                                 index_t pos, index_t P) {
  A* const arrays[4] = {sums.query_of_input, sums.query_of_grad, sums.key_of_input,
                        sums.key_of_grad};
  const index_t ranks[4] = {query_rank(side), query_rank(side), key_rank(side), key_rank(side)};
  for (int a = 0; a < 4; ++a)
    if (arrays[a])
      for (index_t r = 0; r < ranks[a]; ++r) arrays[a][r * P + pos] = 0;
}

/// Outside the tile (or its sequences' lengths) the output is 0, and with the side off it is the
/// input; either way the position's low-rank sums are 0. Returns whether Compose proper is due.
template <class T, class A>
DCMHA_HOST_DEVICE bool composes_here(const ComposeTerms<T>& side, const Position& q, const A* in,
                                     A* out, const LowRankSums<A>& sums, index_t pos, index_t P,
                                     index_t M) {
  if (q.real && side.enabled()) return true;
  for (index_t m = 0; m < M; ++m) out[m * P + pos] = q.real ? in[m * P + pos] : A(0);
  zero_sums(side, sums, pos, P);
  return false;
}

/// y = Compose(x) at every position of the tile; a side that is off copies.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void compose_tile(const Block& blk, const ComposeTerms<T>& side,
                                    const TileGeometry& geo, const TilePlace& at, const A* x, A* y,
                                    LowRankSums<A> sums) {
  const index_t P = geo.positions(), M = geo.M, b = at.rows.b, g = at.rows.g;
  for_each_owned(blk, P, [&](index_t pos) {
    const Position q = position(geo, at, pos);
    if (!composes_here(side, q, x, y, sums, pos, P, M)) return;
    for (index_t r = 0; r < query_rank(side); ++r) {
      A sum = 0;
      for (index_t m = 0; m < M; ++m) sum += x[m * P + pos] * A(side.qw1(b, q.t, g, r, m));
      sums.query_of_input[r * P + pos] = sum;
    }
    for (index_t r = 0; r < key_rank(side); ++r) {
      A sum = 0;
      for (index_t m = 0; m < M; ++m) sum += x[m * P + pos] * A(side.kw1(b, q.slot, g, r, m));
      sums.key_of_input[r * P + pos] = sum;
    }
    for (index_t n = 0; n < M; ++n) {
      const A xn = x[n * P + pos];
      A out = xn;  // residual
      if (side.static_w)
        for (index_t m = 0; m < M; ++m) out += x[m * P + pos] * A(side.w(g, m, n));
      if (side.query_wise) {
        for (index_t r = 0; r < query_rank(side); ++r)
          out += sums.query_of_input[r * P + pos] * A(side.qw2(b, q.t, g, r, n));
        out += xn * A(side.qdd(b, q.t, g, n));
      }
      if (side.key_wise) {
        for (index_t r = 0; r < key_rank(side); ++r)
          out += sums.key_of_input[r * P + pos] * A(side.kw2(b, q.slot, g, r, n));
        out += xn * A(side.kdd(b, q.slot, g, n));
      }
      y[n * P + pos] = out;
    }
  });
}

/// dx = Compose^T(dy) at every position; also the low-rank sums of x and dy the weight
/// gradients need. A side that is off copies.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void compose_transpose_tile(const Block& blk, const ComposeTerms<T>& side,
                                              const TileGeometry& geo, const TilePlace& at,
                                              const A* x, const A* dy, A* dx, LowRankSums<A> sums) {
  const index_t P = geo.positions(), M = geo.M, b = at.rows.b, g = at.rows.g;
  for_each_owned(blk, P, [&](index_t pos) {
    const Position q = position(geo, at, pos);
    if (!composes_here(side, q, dy, dx, sums, pos, P, M)) return;
    for (index_t r = 0; r < query_rank(side); ++r) {
      A of_input = 0, of_grad = 0;
      for (index_t m = 0; m < M; ++m) {
        of_input += x[m * P + pos] * A(side.qw1(b, q.t, g, r, m));
        of_grad += dy[m * P + pos] * A(side.qw2(b, q.t, g, r, m));
      }
      sums.query_of_input[r * P + pos] = of_input;
      sums.query_of_grad[r * P + pos] = of_grad;
    }
    for (index_t r = 0; r < key_rank(side); ++r) {
      A of_input = 0, of_grad = 0;
      for (index_t m = 0; m < M; ++m) {
        of_input += x[m * P + pos] * A(side.kw1(b, q.slot, g, r, m));
        of_grad += dy[m * P + pos] * A(side.kw2(b, q.slot, g, r, m));
      }
      sums.key_of_input[r * P + pos] = of_input;
      sums.key_of_grad[r * P + pos] = of_grad;
    }
    for (index_t m = 0; m < M; ++m) {
      const A dym = dy[m * P + pos];
      A out = dym;  // residual
      if (side.static_w)
        for (index_t n = 0; n < M; ++n) out += A(side.w(g, m, n)) * dy[n * P + pos];
      if (side.query_wise) {
        for (index_t r = 0; r < query_rank(side); ++r)
          out += A(side.qw1(b, q.t, g, r, m)) * sums.query_of_grad[r * P + pos];
        out += A(side.qdd(b, q.t, g, m)) * dym;
      }
      if (side.key_wise) {
        for (index_t r = 0; r < key_rank(side); ++r)
          out += A(side.kw1(b, q.slot, g, r, m)) * sums.key_of_grad[r * P + pos];
        out += A(side.kdd(b, q.slot, g, m)) * dym;
      }
      dx[m * P + pos] = out;
    }
  });
}

/// One side's gradient accumulators of the terms that vary along one axis of the tile (rows for
/// the query-wise terms, keys for the key-wise ones): w1, w2 [index][rank][M], dd [index][M].
template <class A>
struct LowRankGrads {
  A *w1 = nullptr, *w2 = nullptr, *dd = nullptr;
};

template <class A>
DCMHA_HOST_DEVICE LowRankGrads<A> take_lowrank_grads(SharedArena<A>& arena, index_t extent,
                                                     const TileGeometry& geo) {
  LowRankGrads<A> g;
  g.w1 = arena.take(extent * geo.rank * geo.M);
  g.w2 = arena.take(extent * geo.rank * geo.M);
  g.dd = arena.take(extent * geo.M);
  return g;
}

template <class Block, class A>
DCMHA_HOST_DEVICE void zero_lowrank_grads(const Block& blk, const LowRankGrads<A>& g,
                                          index_t extent, const TileGeometry& geo) {
  fill(blk, g.w1, extent * geo.rank * geo.M, A(0));
  fill(blk, g.w2, extent * geo.rank * geo.M, A(0));
  fill(blk, g.dd, extent * geo.M, A(0));
}

/// Adds the tile's contributions to the low-rank terms' gradients along one axis: `by_row` for
/// the query-wise terms (summed over the tile's keys), else the key-wise ones (over its rows).
/// x, dy: the side's input and upstream gradient; sums from compose_transpose_tile. Item
/// (index, rank, head) is always the same thread's, so accumulating needs no barrier.
template <class Block, class A>
DCMHA_HOST_DEVICE void accumulate_lowrank_grads(const Block& blk, const TileGeometry& geo,
                                                bool by_row, index_t rank, const A* x, const A* dy,
                                                const A* of_input, const A* of_grad,
                                                const LowRankGrads<A>& acc) {
  const index_t P = geo.positions(), M = geo.M;
  const index_t extent = by_row ? geo.rows : geo.keys, across = by_row ? geo.keys : geo.rows;
  auto at = [&](index_t i, index_t j) { return by_row ? i * geo.keys + j : j * geo.keys + i; };
  for_each_owned(blk, extent * rank * M, [&](index_t item) {
    const index_t i = item / (rank * M), r = item / M % rank, m = item % M;
    A w1 = 0, w2 = 0;
    for (index_t j = 0; j < across; ++j) {
      const index_t pos = at(i, j);
      w1 += x[m * P + pos] * of_grad[r * P + pos];
      w2 += of_input[r * P + pos] * dy[m * P + pos];
    }
    acc.w1[(i * geo.rank + r) * M + m] += w1;
    acc.w2[(i * geo.rank + r) * M + m] += w2;
  });
  for_each_owned(blk, extent * M, [&](index_t item) {
    const index_t i = item / M, m = item % M;
    A dd = 0;
    for (index_t j = 0; j < across; ++j) dd += x[m * P + at(i, j)] * dy[m * P + at(i, j)];
    acc.dd[item] += dd;
  });
}

/// dW[m][n] += sum over the tile's positions of x[m] dy[n]: item (m, n) is one thread's.
template <class Block, class A>
DCMHA_HOST_DEVICE void accumulate_static_grads(const Block& blk, const TileGeometry& geo,
                                               const A* x, const A* dy, A* dw) {
  const index_t P = geo.positions(), M = geo.M;
  for_each_owned(blk, M * M, [&](index_t item) {
    const index_t m = item / M, n = item % M;
    A sum = 0;
    for (index_t pos = 0; pos < P; ++pos) sum += x[m * P + pos] * dy[n * P + pos];
    dw[item] += sum;
  });
}

}  // namespace dcmha::cuda

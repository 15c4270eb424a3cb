#pragma once
// A tile's products on tensor cores, for bf16 storage: the score-shaped ones (Q K^T, and the
// backward's dO V^T) and the forward's P'V. Each warp takes whole items, (head m, chunk of 8 rows),
// and stages what one item needs in its own shared memory as bf16: the chunk's Q (or P') rows and
// the step's K (or V) rows, with zeros wherever the tile has no real row or key. Staging is what
// makes the products safe: a warp_product never reads past a tensor's end, a sequence's length or a
// ring's wrap, and the staging loads walk d (contiguous in the caller's layout) with consecutive
// lanes. The backward's other products (dQ, dK, dV) stay scalar.
//
// An item always belongs to the same warp and a result element to the same lane, so, as in the
// scalar path, a thread keeps accumulating into the output it owns across key steps.
#include <type_traits>

#include "compose_tile.hpp"
#include "warp_matrix.hpp"

namespace dcmha::cuda {

/// Whether a launch can take its products on tensor cores: bf16 storage, steps of 32 keys, D a
/// multiple of 16, Dv of 32, and whole warps.
template <class T>
bool tensor_core_shape(const TileGeometry& geo, int threads) {
  return std::is_same_v<T, bf16> && geo.keys == WarpTile::cols && geo.D % WarpTile::depth == 0 &&
         geo.Dv % WarpTile::cols == 0 && threads % kWarpSize == 0;
}

/// One warp's staging: `rows` [8][max(D, Dv, keys)] bf16 (Q, dO or P' rows), `panel`
/// [keys][max(D, Dv)] bf16 (K or V rows of the step), `product` [8][32] float.
struct WarpStaging {
  bf16* rows = nullptr;
  bf16* panel = nullptr;
  float* product = nullptr;
};

/// The staging of the block's first geo.tensor_warps warps, the ones that take the products
/// (the plan may give fewer than all where shared memory is short), carved after a kernel's other
/// arrays; nothing when 0.
struct TensorCoreStaging {
  float* base = nullptr;
  index_t warps = 0, rows_floats = 0, panel_floats = 0, per_warp = 0;

  template <class A>
  DCMHA_HOST_DEVICE void carve(SharedArena<A>& arena, const TileGeometry& geo) {
    static_assert(std::is_same_v<A, float>, "tensor-core staging sits in a float arena");
    warps = geo.tensor_warps;
    if (warps == 0) return;
    const index_t widest = geo.D > geo.Dv ? geo.D : geo.Dv;
    rows_floats = WarpTile::rows * (widest > geo.keys ? widest : geo.keys) / 2;
    panel_floats = geo.keys * widest / 2;
    // Every array a multiple of 8 floats, so each stays 32-byte aligned after an aligned start.
    per_warp = rows_floats + panel_floats + WarpTile::rows * WarpTile::cols;
    arena.align(8);
    base = arena.take(warps * per_warp);
  }
  DCMHA_HOST_DEVICE WarpStaging of(int warp) const {
    float* mine = base + warp * per_warp;
    return {reinterpret_cast<bf16*>(mine), reinterpret_cast<bf16*>(mine + rows_floats),
            mine + rows_floats + panel_floats};
  }
};

namespace tensor_core {

/// Whether key c of the step is real (inside the step and the sequence's keys).
DCMHA_HOST_DEVICE inline bool real_key(const TilePlace& at, index_t c) {
  return c < at.keys.count && at.keys.s0 + c < at.rows.key_length;
}

/// staged[c][d] = x(b, head, slot(s0 + c), d) for the step's real keys, 0 for the rest.
template <class Block, class T>
DCMHA_HOST_DEVICE void stage_key_rows(const Block& blk, const TensorView<const T, 4>& x,
                                      const TileGeometry& geo, const TilePlace& at, index_t head,
                                      index_t width, bf16* staged) {
  for (index_t e = lane_of(blk); e < geo.keys * width; e += kWarpSize) {
    const index_t c = e / width, d = e % width, b = at.rows.b;
    staged[e] = real_key(at, c) ? bf16(x(b, head, at.ring.slot(b, at.keys.s0 + c), d)) : bf16(0.0f);
  }
}

/// staged[i][d] = x(b, h, t0 + r0 + i, d) for the chunk's real rows, 0 for the rest.
template <class Block, class T>
DCMHA_HOST_DEVICE void stage_query_rows(const Block& blk, const TensorView<const T, 4>& x,
                                        const TilePlace& at, index_t h, index_t r0, index_t width,
                                        bf16* staged) {
  for (index_t e = lane_of(blk); e < WarpTile::rows * width; e += kWarpSize) {
    const index_t r = r0 + e / width, t = at.rows.t0 + r;
    const bool real = r < at.rows.rows && t < at.rows.query_length;
    staged[e] = real ? bf16(x(at.rows.b, h, t, e % width)) : bf16(0.0f);
  }
}

/// Calls f(m, r0, w) for the (head m, rows [r0, r0 + 8)) items of this warp, with its staging w:
/// item i is staging warp i mod warps's in every step; warps without staging take none.
template <class Block, class F>
DCMHA_HOST_DEVICE void for_each_warp_item(const Block& blk, const TileGeometry& geo,
                                          const TensorCoreStaging& staging, F&& f) {
  const int warp = warp_of(blk);
  if (warp >= staging.warps) return;
  const index_t chunks = (geo.rows + WarpTile::rows - 1) / WarpTile::rows;
  const WarpStaging w = staging.of(warp);
  for (index_t item = warp; item < geo.M * chunks; item += staging.warps)
    f(item / chunks, item % chunks * WarpTile::rows, w);
}

/// Calls f(r, c, value) for this lane's results of w.product that fall on the tile's rows
/// (r0 + i < geo.rows), then syncs the warp so that the product can be overwritten.
template <class Block, class F>
DCMHA_HOST_DEVICE void for_each_product_result(const Block& blk, const TileGeometry& geo,
                                               index_t r0, const WarpStaging& w, F&& f) {
  for (int e = lane_of(blk); e < WarpTile::rows * WarpTile::cols; e += kWarpSize) {
    const index_t r = r0 + e / WarpTile::cols;
    if (r < geo.rows) f(r, index_t(e % WarpTile::cols), w.product[e]);
  }
  blk.sync_warp();
}

/// The products of a score-shaped tile, rows[h][t] . panel[kv(h)][s] over `width` for each
/// head, row and key, handed to store(m, r, c, product) for the tile's rows (r < geo.rows).
template <class Block, class T, class Store>
DCMHA_HOST_DEVICE void row_panel_products(const Block& blk, const TileGeometry& geo,
                                          const TilePlace& at, index_t heads_per_kv,
                                          const TensorView<const T, 4>& rows,
                                          const TensorView<const T, 4>& panel, index_t width,
                                          const TensorCoreStaging& staging, Store&& store) {
  for_each_warp_item(blk, geo, staging, [&](index_t m, index_t r0, const WarpStaging& w) {
    const index_t h = at.rows.g * geo.M + m;
    stage_query_rows(blk, rows, at, h, r0, width, w.rows);
    stage_key_rows(blk, panel, geo, at, h / heads_per_kv, width, w.panel);
    blk.sync_warp();
    warp_product<Layout::column_major>(blk, w.rows, width, w.panel, width, width, w.product,
                                       WarpTile::cols);
    blk.sync_warp();
    for_each_product_result(blk, geo, r0, w,
                            [&](index_t r, index_t c, float dot) { store(m, r, c, dot); });
  });
}

}  // namespace tensor_core

/// score_tile's result (scale q . k where the row sees the key, 0 elsewhere) with the dot
/// products on tensor cores. No barrier inside beyond the warps' own.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void score_tile_on_tensor_cores(const Block& blk, const detail::QkvParams<T>& p,
                                                  const TileGeometry& geo, const TilePlace& at,
                                                  const TensorCoreStaging& staging, A* scores) {
  tensor_core::row_panel_products(blk, geo, at, p.dims.H / p.dims.Hk, p.q, p.k, geo.D, staging,
                                  [&](index_t m, index_t r, index_t c, float dot) {
                                    const Position q = position(geo, at, r * geo.keys + c);
                                    const KeyRange seen = cuda::visible_keys(
                                        p.mask, q.t, at.rows.query_length, at.rows.key_length);
                                    scores[m * geo.positions() + r * geo.keys + c] =
                                        q.real && sees(seen, q.s) ? A(p.scale) * A(dot) : A(0);
                                  });
}

/// dP' = dO V^T on a tile (0 outside its real positions) with the products on tensor cores.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void output_grad_tile_on_tensor_cores(
    const Block& blk, const detail::BackwardParams<T>& p, const TileGeometry& geo,
    const TilePlace& at, const TensorCoreStaging& staging, A* upstream) {
  tensor_core::row_panel_products(blk, geo, at, p.dims.H / p.dims.Hk, p.dout, p.v, geo.Dv, staging,
                                  [&](index_t m, index_t r, index_t c, float dot) {
                                    const index_t i = m * geo.positions() + r * geo.keys + c;
                                    upstream[i] =
                                        position(geo, at, r * geo.keys + c).real ? A(dot) : A(0);
                                  });
}

/// out[m][r][e] += sum_c P'[m][r][c] v[s][e] with the products on tensor cores (P' rounded to
/// bf16, as the tensor cores take it; the sums stay float). No barrier inside beyond the warps'.
template <class Block, class T, class A>
DCMHA_HOST_DEVICE void accumulate_values_on_tensor_cores(
    const Block& blk, const detail::QkvParams<T>& p, const TileGeometry& geo, const TilePlace& at,
    const TensorCoreStaging& staging, const A* probabilities, A* out) {
  const index_t heads_per_kv = p.dims.H / p.dims.Hk;
  tensor_core::for_each_warp_item(
      blk, geo, staging, [&](index_t m, index_t r0, const WarpStaging& w) {
        const A* head = probabilities + m * geo.positions();
        for (index_t e = lane_of(blk); e < WarpTile::rows * geo.keys; e += kWarpSize) {
          const index_t r = r0 + e / geo.keys;
          w.rows[e] = r < geo.rows ? bf16(float(head[r * geo.keys + e % geo.keys])) : bf16(0.0f);
        }
        const index_t kv = (at.rows.g * geo.M + m) / heads_per_kv;
        tensor_core::stage_key_rows(blk, p.v, geo, at, kv, geo.Dv, w.panel);
        blk.sync_warp();
        for (index_t e0 = 0; e0 < geo.Dv; e0 += WarpTile::cols) {
          warp_product<Layout::row_major>(blk, w.rows, geo.keys, w.panel + e0, geo.Dv, geo.keys,
                                          w.product, WarpTile::cols);
          blk.sync_warp();
          tensor_core::for_each_product_result(blk, geo, r0, w, [&](index_t r, index_t c, float x) {
            out[(m * geo.rows + r) * geo.Dv + e0 + c] += x;
          });
        }
      });
}

}  // namespace dcmha::cuda

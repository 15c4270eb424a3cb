#pragma once
// Tiles of the CUDA kernels: which query rows a block owns, which keys a step covers, which keys
// a row sees, and the carving of a block's shared memory into named arrays.
//
// Score-shaped arrays in shared memory are [head m][row r][key c] over a tile: M heads of one
// compose group, `rows` query rows, `keys` keys, so position (r, c) of head m is at
// m * positions + r * keys + c. Compose mixes the M values of one position.
#include <limits>

#include "../params.hpp"
#include "simt.hpp"

namespace dcmha::cuda {

/// The shape every tile of one launch has.
struct TileGeometry {
  index_t M = 1;     // heads per compose group
  index_t rows = 1;  // query rows per block
  index_t keys = 1;  // keys per step
  index_t D = 1, Dv = 1;
  index_t rank = 0;  // the largest R of the low-rank terms that are on (0: none)
  // Warps that stage products for the tensor cores (tensor_core_tile.hpp); 0: scalar products.
  index_t tensor_warps = 0;

  DCMHA_HOST_DEVICE index_t positions() const { return rows * keys; }
  DCMHA_HOST_DEVICE index_t scores() const { return M * rows * keys; }
};

/// Logical keys [begin, end) (empty when end <= begin).
struct KeyRange {
  index_t begin = 0, end = 0;
};

/// The query rows [t0, t0 + rows) of group g of sequence b, and the sequence's lengths.
struct QueryTile {
  index_t b = 0, g = 0, t0 = 0, rows = 0;
  index_t query_length = 0, key_length = 0;
};

/// The keys [s0, s0 + count) of one step.
struct KeyTile {
  index_t s0 = 0, count = 0;
};

DCMHA_HOST_DEVICE inline index_t sequence_length(const TensorView<const index_t, 1>& lengths,
                                                 index_t b, index_t full) {
  return lengths.empty() ? full : lengths(b);
}

/// The keys row t sees (spec section 1, step 3): a contiguous range, empty for padding rows.
DCMHA_HOST_DEVICE inline KeyRange visible_keys(const detail::MaskParams& mask, index_t t,
                                               index_t query_length, index_t key_length) {
  if (t >= query_length) return {0, 0};
  const index_t last = t + key_length - query_length;  // the key aligned with t (bottom-right)
  KeyRange r{0, key_length};
  if (mask.causal && last + 1 < r.end) r.end = last + 1;
  if (mask.window > 0 && last - mask.window + 1 > 0) r.begin = last - mask.window + 1;
  return r;
}

DCMHA_HOST_DEVICE inline bool sees(const KeyRange& r, index_t s) {
  return s >= r.begin && s < r.end;
}

/// The union of the keys the tile's rows see (rows see nested-or-sliding ranges, so the first
/// and last real rows bound it).
DCMHA_HOST_DEVICE inline KeyRange tile_keys(const detail::MaskParams& mask, const QueryTile& q) {
  const index_t last_row = (q.t0 + q.rows < q.query_length ? q.t0 + q.rows : q.query_length) - 1;
  if (last_row < q.t0) return {0, 0};
  const KeyRange first = cuda::visible_keys(mask, q.t0, q.query_length, q.key_length);
  const KeyRange last = cuda::visible_keys(mask, last_row, q.query_length, q.key_length);
  return {first.begin < last.begin ? first.begin : last.begin,
          first.end > last.end ? first.end : last.end};
}

template <class Params>
DCMHA_HOST_DEVICE QueryTile query_tile(const Params& p, const TileGeometry& geo, index_t tile,
                                       index_t g, index_t b) {
  QueryTile q;
  q.b = b;
  q.g = g;
  q.t0 = tile * geo.rows;
  q.rows = p.dims.T - q.t0 < geo.rows ? p.dims.T - q.t0 : geo.rows;
  q.query_length = sequence_length(p.mask.query_lengths, b, p.dims.T);
  q.key_length = sequence_length(p.mask.key_lengths, b, p.dims.S);
  return q;
}

/// Hands out consecutive arrays of a block's shared memory; with a null base it only counts, so
/// the host sizes a launch with the same code the kernel carves with.
template <class A>
class SharedArena {
 public:
  DCMHA_HOST_DEVICE explicit SharedArena(void* base) : base_(static_cast<A*>(base)) {}
  DCMHA_HOST_DEVICE A* take(index_t n) {
    A* p = base_ ? base_ + used_ : nullptr;
    used_ += n;
    return p;
  }
  /// Starts the next array at a multiple of `elements` from the base.
  DCMHA_HOST_DEVICE void align(index_t elements) {
    used_ = (used_ + elements - 1) / elements * elements;
  }
  DCMHA_HOST_DEVICE index_t bytes() const { return used_ * static_cast<index_t>(sizeof(A)); }

 private:
  A* base_;
  index_t used_ = 0;
};

/// A kernel's shared-memory struct (aggregate with carve(arena, geometry)) over base.
template <class Shared, class A = typename Shared::value_type>
DCMHA_HOST_DEVICE Shared carve_shared(void* base, const TileGeometry& geo) {
  SharedArena<A> arena(base);
  Shared shared{};
  shared.carve(arena, geo);
  return shared;
}

/// The bytes of shared memory a kernel's struct takes for a geometry.
template <class Shared, class A = typename Shared::value_type>
index_t shared_bytes(const TileGeometry& geo) {
  SharedArena<A> arena(nullptr);
  Shared shared{};
  shared.carve(arena, geo);
  return arena.bytes();
}

template <class A>
DCMHA_HOST_DEVICE constexpr A negative_infinity() {
  return -std::numeric_limits<A>::infinity();
}

/// Sets n values of shared memory to x, spread over the block (the caller syncs).
template <class Block, class A>
DCMHA_HOST_DEVICE void fill(const Block& blk, A* x, index_t n, A value) {
  for_each_owned(blk, n, [&](index_t i) { x[i] = value; });
}

}  // namespace dcmha::cuda

#pragma once
// Staging: copying rows of the caller's tensors (Q, K, V, dO) into operand tiles, by 16-byte
// asynchronous copies (cp.async.cg, which leaves L1 alone) where the rows allow it: a row that is
// not real (past a sequence's length, past the tensor, a padding column chunk) is zero-filled by
// the copy itself, so no product ever reads the caller's padding or past its memory. Rows whose
// start or width is not a multiple of 16 bytes (odd head dims, odd strides) go element by
// element instead; both ways leave the same tile.
//
// The copies of one stage are committed as one group; the consumer waits for it
// (cp_async_wait<N>) and syncs the block before reading: the copy's destination is undefined
// until its wait, and another thread's copy is visible only after a barrier.
#include <cstdint>

#include "simt.hpp"
#include "tile_layout.hpp"

namespace dcmha::cuda {

/// Whether every row of a (B, H, L, D) view starts on 16 bytes and holds whole 16-byte chunks,
/// so that its rows can be staged by cp.async. Checked once per launch on the host.
template <class T>
bool rows_are_chunked(const TensorView<const T, 4>& x) {
  if (x.empty()) return true;
  const auto bytes = [](index_t elements) { return elements * index_t(sizeof(T)); };
  return reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0 && bytes(x.shape[3]) % 16 == 0 &&
         x.stride[3] == 1 && bytes(x.stride[0]) % 16 == 0 && bytes(x.stride[1]) % 16 == 0 &&
         bytes(x.stride[2]) % 16 == 0;
}

/// Copies rows [0, tile.rows) of a tile from the caller: row r comes from row_of(r) (a pointer to
/// its `width` elements, or null where the row is not real: zeros), columns past `width` are
/// zeros; `any_row` is some row of the same tensor (the address zero-filling copies name). Spread
/// over the block's threads (every thread calls it); the copies are this thread's part of the
/// stage's group, not yet committed.
template <class Block, class T, class RowOf>
DCMHA_INLINE void stage_rows(const Block& blk, const OperandTile<T>& tile, int width, bool chunked,
                             const T* any_row, RowOf&& row_of) {
  constexpr int kChunk = OperandTile<T>::kChunkElements;
  const int chunks = tile.chunks;
  if (chunked) {
    const int data_chunks = width / kChunk;
    for_each_owned(blk, tile.rows * chunks, [&](int item) {
      const int r = item / chunks, c = item % chunks;
      const T* row = row_of(r);
      const bool real = row != nullptr && c < data_chunks;
      // A zero-filled copy reads nothing; its source only has to be a global address.
      blk.cp_async_16(tile.chunk(r, c), real ? row + c * kChunk : any_row, real);
    });
    return;
  }
  for_each_owned(blk, tile.rows * chunks * kChunk, [&](int item) {
    const int r = item / (chunks * kChunk), e = item % (chunks * kChunk);
    const T* row = row_of(r);
    const T x = row != nullptr && e < width ? blk.load_global(row + e) : T(0.0f);
    blk.store_shared(tile.at(r, e), x);
  });
}

}  // namespace dcmha::cuda

#pragma once
// Where the kernels' tiles live in shared memory, and how they are carved out of it.
//
// OperandTile: rows of a matrix the tensor cores take (Q, K, V, dO rows; P' and dL), in the
// storage type, `width` elements a row. ldmatrix reads 8 rows x 16 bytes at a time and cp.async
// writes 16-byte chunks, so rows are laid out in 16-byte chunks with the chunk index permuted per
// row (XOR swizzle) wherever a row is a multiple of 128 bytes, and 64-byte rows pair up in
// 128-byte lines with their chunk index permuted per pair; any other width gets one spare chunk
// per row. Either way the 8 rows of one ldmatrix phase fall into 8 different groups of 4 banks:
// no replays, whatever the width.
//
// ScoreTile: float values per (row, key) of one head (scores, probabilities, their gradients),
// rows padded by 8 floats so that the tensor cores' accumulator fragments (two floats per lane,
// 8 rows x 4 lanes a phase) store and load without conflicts, and a warp's 32 consecutive keys of
// one row (the Compose pass's access) are one wavefront.
#include <cstdint>

#include "../tensor.hpp"

namespace dcmha::cuda {

/// Lays out a block's shared memory: consecutive, aligned pieces, as byte offsets from its start.
/// The host lays out a launch once (its size, and the offsets its kernel's parameters carry);
/// the kernel turns an offset into a tile view where it needs one, so that no long-lived register
/// holds a tile's address.
class SharedCarver {
 public:
  template <class U>
  DCMHA_INLINE std::uint32_t take(index_t count, index_t alignment = 128) {
    used_ = (used_ + alignment - 1) / alignment * alignment;
    const index_t offset = used_;
    used_ += count * static_cast<index_t>(sizeof(U));
    return static_cast<std::uint32_t>(offset);
  }
  DCMHA_INLINE index_t bytes() const { return used_; }

 private:
  index_t used_ = 0;
};

/// The address at `offset` bytes into a block's shared memory.
template <class U>
DCMHA_INLINE U* at_offset(void* base, std::uint32_t offset) {
  return reinterpret_cast<U*>(static_cast<unsigned char*>(base) + offset);
}

/// `rows` rows of `width` elements of U (2 or 4 bytes), 16-byte chunks, conflict-free for
/// ldmatrix and cp.async.
template <class U>
struct OperandTile {
  static constexpr int kChunkElements = 16 / int(sizeof(U));
  U* data = nullptr;
  int rows = 0, chunks = 0;  // chunks per row (width / kChunkElements, rounded up)

  DCMHA_INLINE static int chunks_of(int width) {
    return (width + kChunkElements - 1) / kChunkElements;
  }
  /// Chunks of storage a row takes (one spare where no swizzle applies).
  DCMHA_INLINE static int stored_chunks(int chunks) {
    return chunks % 8 == 0 || chunks == 4 ? chunks : chunks + 1;
  }
  DCMHA_INLINE static index_t elements(int rows, int width) {
    return index_t(rows) * stored_chunks(chunks_of(width)) * kChunkElements;
  }

  /// The address of chunk c of row r.
  DCMHA_INLINE U* chunk(int r, int c) const {
    int physical;
    if (chunks % 8 == 0)
      physical = r * chunks + (c ^ (r & 7));
    else if (chunks == 4)
      physical = r * 4 + (c ^ ((r >> 1) & 3));
    else
      physical = r * (chunks + 1) + c;
    return data + index_t(physical) * kChunkElements;
  }
  /// Element e of row r.
  DCMHA_INLINE U* at(int r, int e) const {
    return chunk(r, e / kChunkElements) + e % kChunkElements;
  }
};

/// Float values of `rows` x `keys` positions, rows padded by 8 floats.
struct ScoreTile {
  float* data = nullptr;
  int stride = 0;  // floats per row

  DCMHA_INLINE float* at(int r, int c) const { return data + index_t(r) * stride + c; }

  DCMHA_INLINE static int stride_of(int keys) { return keys + 8; }
};

/// One score-shaped array for each of `heads` heads, `rows` x `keys` positions each, a fixed
/// distance apart: head h's tile at data + h * head_stride.
struct ScoreTiles {
  float* data = nullptr;
  int stride = 0;           // floats per row
  index_t head_stride = 0;  // floats per head

  DCMHA_INLINE ScoreTile head(int h) const { return {data + index_t(h) * head_stride, stride}; }
  DCMHA_INLINE float* at(int h, int r, int c) const {
    return data + index_t(h) * head_stride + index_t(r) * stride + c;
  }
  /// Heads 8 floats past a 128-byte line apart: the compose items' parts read 8 keys of one row
  /// of consecutive heads together, one wavefront.
  DCMHA_INLINE static index_t head_stride_of(int rows, int keys) {
    return (index_t(rows) * ScoreTile::stride_of(keys) + 31) / 32 * 32 + 8;
  }
  DCMHA_INLINE static std::uint32_t carve(SharedCarver& c, int heads, int rows, int keys) {
    return c.take<float>(heads * head_stride_of(rows, keys));
  }
  DCMHA_INLINE static ScoreTiles view(void* base, std::uint32_t offset, int rows, int keys) {
    return {at_offset<float>(base, offset), ScoreTile::stride_of(keys), head_stride_of(rows, keys)};
  }
};

/// Operand tiles of `heads` heads (or kv heads), a fixed distance apart.
template <class U>
struct OperandTiles {
  U* data = nullptr;
  int rows = 0, chunks = 0;
  index_t head_stride = 0;  // elements per head

  DCMHA_INLINE OperandTile<U> head(int h) const {
    OperandTile<U> t;
    t.data = data + index_t(h) * head_stride;
    t.rows = rows;
    t.chunks = chunks;
    return t;
  }
  /// Elements per head: 16 bytes past a 128-byte line, so that the compose items' parts writing
  /// one 16-byte chunk of consecutive heads each fall in different banks (the swizzle depends on
  /// the row only: shifting a whole tile by 16 bytes keeps ldmatrix conflict-free).
  DCMHA_INLINE static index_t head_stride_of(int rows, int width) {
    const index_t bytes = OperandTile<U>::elements(rows, width) * index_t(sizeof(U));
    return ((bytes + 127) / 128 * 128 + 16) / index_t(sizeof(U));
  }
  DCMHA_INLINE static std::uint32_t carve(SharedCarver& c, int heads, int rows, int width) {
    return c.take<U>(heads * head_stride_of(rows, width));
  }
  DCMHA_INLINE static OperandTiles view(void* base, std::uint32_t offset, int rows, int width) {
    OperandTiles t;
    t.data = at_offset<U>(base, offset);
    t.rows = rows;
    t.chunks = OperandTile<U>::chunks_of(width);
    t.head_stride = head_stride_of(rows, width);
    return t;
  }
};

}  // namespace dcmha::cuda

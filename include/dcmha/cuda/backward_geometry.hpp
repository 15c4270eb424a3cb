#pragma once
// The backward's tile geometry and shared-memory layout (query side and key side), plain data
// chosen by the launch plan, and the views a kernel makes of it.
//
// Query side: a cluster per (query tile of `rows` rows, group, sequence) walks the key tiles of
// kKeys keys; key side: a cluster per (key tile of `rows` keys, group, sequence) walks the query
// tiles of stream_rows rows. Either way each block owns `own_heads` heads, one warp per (own head,
// 16 rows or keys), and composes a `slice` of the resident rows or keys.
#include "../common/compose_terms.hpp"
#include "compose_pass.hpp"
#include "forward_geometry.hpp"
#include "tile_layout.hpp"
#include "warp_product.hpp"

namespace dcmha::cuda {

/// Rows of a backward compose item: one, as the chain keeps two values per head (x and g) in
/// registers beside the key side's dK and dV accumulators; two rows spill at head dim 128.
constexpr int kChainRows = 1;

/// The score-shaped arrays of the backward's chain, one set per own head, [row][key]:
/// L (scores), dP' (dO V^T), P (probabilities), dL'. In the query side's first pass (the row
/// dots) the P tiles hold the compose items' sums of P * dP over the key tiles, and at its end
/// the dL' tiles hold those sums by key column.
struct ChainTiles {
  ScoreTiles scores, upstream, probs, softmax_grad;
};

/// The projections the weight gradients need at each position a block composed, per side:
/// of the side's input (x-projection) and of its upstream gradient (gradient projection), along
/// the kernel's axis (query-wise on the query side, key-wise on the key side): [r][row][key] of
/// the block's compose region.
struct ChainSums {
  float* data = nullptr;
  int ranks = 0, rows = 0, keys = 0;  // ranks: the largest R of the call
  DCMHA_INLINE float* at(int side, int kind, int r, int row, int key) const {
    return data + ((index_t(side * 2 + kind) * ranks + r) * rows + row) * key_stride(keys) + key;
  }
  /// Rows of 32 keys padded by 8 floats: the weight gradients read 8 keys of 4 rows at a time,
  /// one wavefront.
  DCMHA_INLINE static int key_stride(int keys) { return keys % 32 == 0 ? keys + 8 : keys; }
  DCMHA_INLINE static std::uint32_t carve(SharedCarver& c, int ranks, int rows, int keys) {
    return c.take<float>(index_t(2) * 2 * ranks * rows * key_stride(keys));
  }
};

/// Where the backward's arrays sit in a block's shared memory (byte offsets). The query side's
/// resident tiles are q[0], dout[0] and its streamed ones k, v (two stages); the key side's
/// resident ones k[0], v[0] and its streamed ones q, dout.
struct BackwardLayout {
  std::uint32_t q[2] = {0, 0}, dout[2] = {0, 0}, k[2] = {0, 0}, v[2] = {0, 0};
  std::uint32_t scores = 0, upstream = 0, probs = 0, softmax_grad = 0;  // the chain's
  std::uint32_t dscores = 0, values_probs = 0;  // dL (for dQ or dK), P' (for dV): storage type
  std::uint32_t lse = 0, row_dot = 0;           // [own head][row]
  std::uint32_t sums = 0;
  std::uint32_t grads = 0;  // [pair][side][w1 r, w2 r, dd]: the weight gradients' sums
  SideLayout side[2];
};

/// Query rows per streamed tile of the key side: the Q and dO rows of the group's own heads come
/// twice (two stages), and 16 rows keep the official DCMHA's key side within the shared memory.
constexpr int kStreamRows = 16;
/// The same for MHA in fragments: each warp's K and V fragments (read from shared memory at head
/// dim 128, where they are not held) then serve 32 query rows instead of 16.
constexpr int kFragmentStreamRows = 32;
/// MHA's one-pass backward (mha_backward_kernel.hpp): blocks of 128 keys (8 warps) over query
/// tiles of 64 rows, so that each warp's products are 32 x 32 blocks, as FlashAttention-2's.
constexpr int kOnePassKeys = 128;
constexpr int kOnePassRows = 64;
/// Rows of its row passes (the row dots before it, dQ after it) per block: a quad of lanes a row.
constexpr int kRowPassRows = 64;

struct BackwardGeometry {
  bool registers = true;  // MHA on the tensor cores: scores, P, dP and dS stay in fragments
  bool key_side = false;
  // MHA's one-pass backward: the key side also adds dQ atomically; P and dS cross shared memory.
  bool one_pass = false;
  // The one pass, launched in rounds of key_splits blocks a head: block x of the round from
  // first_key_block takes key block first_key_block + x, adding dQ into sums of its own
  // (split_sums: one thread a round adds to each, the rounds in stream order) or into one.
  int key_splits = 1, first_key_block = 0;
  bool split_sums = false;
  int M = 1, cluster = 1, own_heads = 1, kv_slots = 1;
  int rows = 16;  // resident rows (query side) or keys (key side) per block, a multiple of 16
  int stream_rows = kStreamRows;  // key side: query rows per streamed tile
  int warps = 1;                  // own_heads * rows / 16
  int D = 0, Dv = 0;
  bool chunked_q = false, chunked_k = false, chunked_v = false, chunked_dout = false;
  int slice = 16;  // the resident rows or keys this block composes: rows / (cluster / key_slices)
  // The query side splits each key tile's keys among key_slices blocks of its cluster first and
  // its rows among the rest, so that a block stages the key-wise weights of its own keys only;
  // the key side composes every row of a streamed tile (key_slices 1).
  int key_slices = 1;
  int slice_keys = kKeys;  // kKeys / key_slices: the keys of a tile the query side composes
  int compose_parts = 1;
  bool dkv_per_head = false;  // GQA: dK, dV per query head into scratch, summed per kv head after
  detail::ComposeTermSets terms;
  BackwardLayout layout;
  index_t shared_bytes = 0;

  DCMHA_INLINE int threads() const { return warps * 32; }
  /// The chain tiles' rows and keys: resident x streamed (query side) or streamed x resident.
  DCMHA_INLINE int tile_rows() const { return key_side ? stream_rows : rows; }
  DCMHA_INLINE int tile_keys() const { return key_side ? rows : kKeys; }
  /// The compose region's rows and keys.
  DCMHA_INLINE int sum_rows() const { return key_side ? tile_rows() : slice; }
  DCMHA_INLINE int sum_keys() const { return key_side ? slice : slice_keys; }

  /// Lays out the shared memory for storage type T and head-dim class kHeadDim.
  template <class T, int kHeadDim>
  void lay_out() {
    SharedCarver c;
    carve_operands<T, kHeadDim>(c);
    carve_chain<T>(c);
    // Query-wise weights of the rows composed; key-wise ones of the keys composed (query side,
    // every key tile) or of every resident key (key side, once).
    for (int s = 0; s < 2; ++s)
      layout.side[s].template carve<T>(c, s == 0 ? terms.pre : terms.post, M, sum_rows(),
                                       key_side ? tile_keys() : slice_keys);
    shared_bytes = c.bytes();
  }

 private:
  /// Q, dO, K and V in two stages each where they stream.
  template <class T, int kHeadDim>
  void carve_operands(SharedCarver& c) {
    BackwardLayout& l = layout;
    for (int s = 0; s < 2; ++s) {
      const int heads = s == 0 || key_side ? own_heads : 0;  // streamed on the key side
      l.q[s] = OperandTiles<T>::carve(c, heads, tile_rows(), kHeadDim);
      l.dout[s] = OperandTiles<T>::carve(c, heads, tile_rows(), kHeadDim);
    }
    // K streams in two stages on the query side; V in one, reloaded once a tile's products are
    // done (it lands while the chain runs).
    for (int s = 0; s < 2; ++s) {
      l.k[s] = OperandTiles<T>::carve(c, s == 0 || !key_side ? kv_slots : 0, tile_keys(), kHeadDim);
      l.v[s] = OperandTiles<T>::carve(c, s == 0 ? kv_slots : 0, tile_keys(), kHeadDim);
    }
  }
  /// The chain's score tiles (none in fragments), P and dS as operands, the row statistics, the
  /// projections' sums and the weight gradients.
  template <class T>
  void carve_chain(SharedCarver& c) {
    BackwardLayout& l = layout;
    const int heads = registers ? 0 : own_heads;
    l.scores = ScoreTiles::carve(c, heads, tile_rows(), tile_keys());
    l.upstream = ScoreTiles::carve(c, heads, tile_rows(), tile_keys());
    l.probs = ScoreTiles::carve(c, heads, tile_rows(), tile_keys());
    l.softmax_grad = ScoreTiles::carve(c, heads, tile_rows(), tile_keys());
    const int operand_heads = one_pass ? own_heads : heads;
    l.dscores = OperandTiles<T>::carve(c, operand_heads, tile_rows(), tile_keys());
    l.values_probs =
        OperandTiles<T>::carve(c, key_side ? operand_heads : 0, tile_rows(), tile_keys());
    l.lse = c.take<float>(index_t(own_heads) * tile_rows());
    l.row_dot = c.take<float>(index_t(own_heads) * tile_rows());
    l.sums = ChainSums::carve(c, int(terms.largest_rank()), registers ? 0 : sum_rows(), sum_keys());
    l.grads = c.take<float>(registers ? 0 : index_t(rows) * own_heads * 2 * (2 * kMaxRank + 1));
  }
};

/// The backward's tiles as a kernel sees them: views made from the layout where needed.
template <class T, int kHeadDim>
struct BackwardTiles {
  const BackwardGeometry& g;
  void* base;

  DCMHA_INLINE OperandTiles<T> q(int s) const {
    return OperandTiles<T>::view(base, g.layout.q[s], g.tile_rows(), kHeadDim);
  }
  DCMHA_INLINE OperandTiles<T> dout(int s) const {
    return OperandTiles<T>::view(base, g.layout.dout[s], g.tile_rows(), kHeadDim);
  }
  DCMHA_INLINE OperandTiles<T> k(int s) const {
    return OperandTiles<T>::view(base, g.layout.k[s], g.tile_keys(), kHeadDim);
  }
  DCMHA_INLINE OperandTiles<T> v(int s) const {
    return OperandTiles<T>::view(base, g.layout.v[s], g.tile_keys(), kHeadDim);
  }
  DCMHA_INLINE ScoreTiles score_tiles(std::uint32_t offset) const {
    return ScoreTiles::view(base, offset, g.tile_rows(), g.tile_keys());
  }
  DCMHA_INLINE ChainTiles chain() const {
    return {score_tiles(g.layout.scores), score_tiles(g.layout.upstream),
            score_tiles(g.layout.probs), score_tiles(g.layout.softmax_grad)};
  }
  DCMHA_INLINE OperandTiles<T> dscores() const {
    return OperandTiles<T>::view(base, g.layout.dscores, g.tile_rows(), g.tile_keys());
  }
  DCMHA_INLINE OperandTiles<T> values_probs() const {
    return OperandTiles<T>::view(base, g.layout.values_probs, g.tile_rows(), g.tile_keys());
  }
  DCMHA_INLINE float* lse() const { return at_offset<float>(base, g.layout.lse); }
  DCMHA_INLINE float* row_dot() const { return at_offset<float>(base, g.layout.row_dot); }
  DCMHA_INLINE ChainSums sums() const {
    return {at_offset<float>(base, g.layout.sums), int(g.terms.largest_rank()), g.sum_rows(),
            g.sum_keys()};
  }
  DCMHA_INLINE SideWeights<T> side(int s) const {
    return g.layout.side[s].template view<T>(base, s == 0 ? g.terms.pre : g.terms.post, g.M,
                                             g.compose_parts);
  }
};

/// Device scratch of one backward call.
struct BackwardScratch {
  float* row_dot = nullptr;          // D (B, H, T), from the query side for the key side
  float* static_partials = nullptr;  // [query block][side][M][M]
  float* dk = nullptr;               // with dkv_per_head: (B, H, S, D) per query head
  float* dv = nullptr;               // (B, H, S, Dv)
  float* dq_sum = nullptr;  // one pass: dQ / scale (dq_sums, B, H, T, D), added to atomically
  int dq_sums = 0;          // one per key split (deterministic) or one
};

}  // namespace dcmha::cuda

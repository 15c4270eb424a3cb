#pragma once
// The forward's tile geometry and shared-memory layout: plain data chosen by the launch plan on
// the host, passed to the kernel by value, and the one carving both sides use.
#include <type_traits>

#include "../common/compose_terms.hpp"
#include "compose_pass.hpp"
#include "tile_layout.hpp"
#include "warp_product.hpp"

namespace dcmha::cuda {

/// Keys per key tile, in every kernel.
constexpr int kKeys = 32;

enum class ForwardMode : int {
  registers,  // MHA on the tensor cores: scores, softmax and P stay in registers (FlashAttention-2)
  one_pass,   // no post-compose: scores through shared memory for Compose_pre, online softmax
  two_pass,   // post-compose: row statistics first, then exact probabilities, Compose_post, P'V
};

/// The forward's launch pieces (split keys: statistics, their combination, values, their sum).
enum class ForwardPhase : int { whole, split_statistics, split_values };

/// Whether the forward leaves a lane registers to spare: tensor-core types up to head dim 128.
/// At 256 (128 output accumulators a lane in a 16-row warp) the forward takes all 255, and the
/// float forward spills already at head dim 128 (ptxas, sm_90).
template <class T, int kHeadDim>
constexpr bool kForwardRegistersToSpare = kHeadDim <= 128 && kTensorCoreType<T>;

/// Whether MHA's registers mode gives each warp 32 rows (two m16 tiles sharing each K and V
/// fragment, as FlashAttention-2's warps do), which doubles the output accumulators.
template <class T, int kHeadDim>
constexpr bool kTallWarps = kForwardRegistersToSpare<T, kHeadDim>;

/// Rows of a forward compose item (compose_pass.hpp): two, which read each key-wise weight once,
/// where the registers allow it; one where two rows' values and projections would spill beside
/// the output accumulators.
template <class T, int kHeadDim>
constexpr int kForwardItemRows = kForwardRegistersToSpare<T, kHeadDim> ? 2 : 1;

/// Where the forward's arrays sit in a block's shared memory (byte offsets).
struct ForwardLayout {
  std::uint32_t q = 0;  // [own head][rows][kHeadDim]
  std::uint32_t k[2] = {0,
                        0};    // [stage][kv slot][kKeys][kHeadDim]: a key tile while the next lands
  std::uint32_t v = 0;         // [kv slot][kKeys][kHeadDim]: lands while the tile's scores are made
  std::uint32_t scores = 0;    // [own head][rows][kKeys]: scores, composed in place
  std::uint32_t composed = 0;  // the same, where Compose_pre writes out of place
  std::uint32_t probs = 0;     // [own head][rows][kKeys]: P' in the storage type, for P'V
  std::uint32_t lse = 0;       // [own head][rows]
  SideLayout side[2];          // pre, post
};

struct ForwardGeometry {
  ForwardMode mode = ForwardMode::registers;
  ForwardPhase phase = ForwardPhase::whole;
  int M = 1;           // heads per compose group
  int cluster = 1;     // blocks that share a query tile, each owning own_heads of the M heads
  int own_heads = 1;   // M / cluster
  int kv_slots = 1;    // key/value heads the own heads read (GQA)
  int rows = 16;       // query rows per block, a multiple of warp_rows
  int warp_rows = 16;  // 16, or 32 for tall warps (kTallWarps)
  int warps = 1;       // own_heads * rows / warp_rows: one (head, warp_rows rows) item per warp
  int D = 0, Dv = 0;
  bool chunked_q = false, chunked_k = false, chunked_v = false;  // rows staged by cp.async
  // The cluster's blocks compose a tile's positions in key_slices x (cluster / key_slices) slices
  // of slice_keys keys x slice_rows rows, keys first: a block stages the key-wise weights of its
  // own keys only, every key tile.
  int key_slices = 1;
  int slice_keys = kKeys;  // kKeys / key_slices
  int slice_rows = 16;     // rows / (cluster / key_slices)
  int compose_parts = 1;   // lanes sharing one compose item's heads
  int splits = 1;          // blocks sharing a query tile's keys (decode)
  // A split two-pass forward's statistics launch keeps the composed scores in the scratch and
  // its values launch reads them back instead of staging K for QK^T and Compose_pre again.
  bool scores_kept = false;
  detail::ComposeTermSets terms;
  ForwardLayout layout;
  index_t shared_bytes = 0;

  DCMHA_INLINE bool composes() const { return terms.enabled(); }
  /// Compose_pre with a static W mixes every head's input into each output: it writes a second
  /// tile instead of overwriting its input.
  DCMHA_INLINE bool pre_out_of_place() const { return terms.pre.static_w; }
  DCMHA_INLINE int threads() const { return warps * 32; }
  /// Whether the block's threads take all of its slice's compose items (of item_rows rows) at
  /// once, so that each lane composes the same positions in every key tile: with two-row items
  /// where M is 8 times a power of two (a lane holds 8 heads; DCFormer's 32), never with one row.
  DCMHA_INLINE bool slice_in_one_round(int item_rows) const {
    return compose_items(ComposeRegion{0, slice_rows, 0, slice_keys, 0}, compose_parts,
                         item_rows) <= threads();
  }
  /// Floats per own head of the lse array: 8 past a multiple of 32, so that the compose items'
  /// parts reading consecutive heads' lse of one row fall in different banks.
  DCMHA_INLINE int lse_stride() const { return (rows + 31) / 32 * 32 + 8; }

  /// Lays out the shared memory for storage type T and head-dim class kHeadDim.
  template <class T, int kHeadDim>
  void lay_out() {
    SharedCarver c;
    ForwardLayout& l = layout;
    l.q = OperandTiles<T>::carve(c, own_heads, rows, kHeadDim);
    for (int s = 0; s < 2; ++s) l.k[s] = OperandTiles<T>::carve(c, kv_slots, kKeys, kHeadDim);
    l.v = OperandTiles<T>::carve(c, phase != ForwardPhase::split_statistics ? kv_slots : 0, kKeys,
                                 kHeadDim);
    const bool tiles = mode != ForwardMode::registers;
    l.scores = ScoreTiles::carve(c, tiles ? own_heads : 0, rows, kKeys);
    l.composed = ScoreTiles::carve(c, tiles && pre_out_of_place() ? own_heads : 0, rows, kKeys);
    // P' for the values (two passes; float storage, whose P V reads P from shared memory too).
    const bool probs = mode == ForwardMode::two_pass || !kTensorCoreType<T>;
    l.probs = OperandTiles<T>::carve(c, probs ? own_heads : 0, rows, kKeys);
    l.lse = c.take<float>(index_t(own_heads) * lse_stride());
    l.side[0].template carve<T>(c, terms.pre, M, slice_rows, slice_keys);
    const detail::ComposeTermSet post =
        mode == ForwardMode::two_pass ? terms.post : detail::ComposeTermSet{};
    l.side[1].template carve<T>(c, post, M, slice_rows, slice_keys);
    shared_bytes = c.bytes();
  }
};

/// Calls f(std::integral_constant<int, kRowTiles>{}, std::bool_constant<kComposes>{}) for the
/// forward kernel the geometry needs: the tall one (32-row warps, registers mode) where warp_rows
/// asks for it, which only the kTallWarps classes compile; for the registers mode of the other
/// tensor-core classes (head dim 256), a 16-row kernel without Compose, whose 128 output
/// accumulators a lane then have the registers that Compose's code would take; else the 16-row
/// kernel of every mode (float storage spills without Compose too, at head dim 128 already: a
/// kernel more per class would lengthen its build for no kernel without spills).
template <class T, int kHeadDim, class F>
decltype(auto) dispatch_forward_warps(const ForwardGeometry& geo, F&& f) {
  if constexpr (kTallWarps<T, kHeadDim>) {
    if (geo.warp_rows == 32) return f(std::integral_constant<int, 2>{}, std::false_type{});
  } else if constexpr (kTensorCoreType<T>) {
    if (geo.mode == ForwardMode::registers)
      return f(std::integral_constant<int, 1>{}, std::false_type{});
  }
  return f(std::integral_constant<int, 1>{}, std::true_type{});
}

/// The forward's tiles as a kernel sees them: views made from the layout where needed.
template <class T, int kHeadDim>
struct ForwardTiles {
  const ForwardGeometry& g;
  void* base;

  DCMHA_INLINE OperandTiles<T> q() const {
    return OperandTiles<T>::view(base, g.layout.q, g.rows, kHeadDim);
  }
  DCMHA_INLINE OperandTiles<T> k(int stage) const {
    return OperandTiles<T>::view(base, g.layout.k[stage], kKeys, kHeadDim);
  }
  DCMHA_INLINE OperandTiles<T> v() const {
    return OperandTiles<T>::view(base, g.layout.v, kKeys, kHeadDim);
  }
  DCMHA_INLINE ScoreTiles scores() const {
    return ScoreTiles::view(base, g.layout.scores, g.rows, kKeys);
  }
  DCMHA_INLINE ScoreTiles composed() const {
    return ScoreTiles::view(base, g.pre_out_of_place() ? g.layout.composed : g.layout.scores,
                            g.rows, kKeys);
  }
  DCMHA_INLINE OperandTiles<T> probs() const {
    return OperandTiles<T>::view(base, g.layout.probs, g.rows, kKeys);
  }
  /// Row r's lse of own head h.
  DCMHA_INLINE float* lse(int h, int r) const {
    return at_offset<float>(base, g.layout.lse) + index_t(h) * g.lse_stride() + r;
  }
  DCMHA_INLINE SideWeights<T> side(int s) const {
    return g.layout.side[s].template view<T>(base, s == 0 ? g.terms.pre : g.terms.post, g.M,
                                             g.compose_parts);
  }
};

/// The scratch of a forward whose keys are split across blocks: count 1 means not split.
struct KeySplit {
  int count = 1;
  float* stats = nullptr;   // [split][B][H][T][2]: each split's row max and sum
  float* lse = nullptr;     // [B][H][T]
  float* out = nullptr;     // [split][B][H][T][Dv]: each split's P'V
  float* scores = nullptr;  // [B][H][T][kept_score_row(S)]: composed scores (scores_kept)
};

/// Floats of one row's kept scores, by key: a split's last tile may reach kKeys past S.
DCMHA_INLINE constexpr index_t kept_score_row(index_t S) { return S + kKeys; }

}  // namespace dcmha::cuda

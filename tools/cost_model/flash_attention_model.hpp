#pragma once
// FlashAttention-2's algorithm for MHA, counted by hand in the same units as the emulator counts
// ours, with its tiles for head dims 96 and 128 on sm_80/sm_90 (mma.sync, the instruction ours
// uses; the same tiles for both), a head dim between compiled in the next class up:
//
// - forward: a block of 4 warps holds 128 query rows of one head (Q in shared memory) and walks
//   64-key tiles, K and V staged once per tile and read by every warp (ldmatrix), P staying in
//   registers; O and lse written once.
// - backward: a block of 8 warps holds 128 keys of one head (K, V resident) and walks 64-row
//   query tiles: Q, dO, lse and the row dots staged per tile; S = QKᵀ, dP = dO Vᵀ, dV += Pᵀ dO,
//   dK += dSᵀ Q and dQ += dS K, P and dS through shared memory, dQ by fp32 atomics into L2,
//   then converted by a second kernel; the row dots (dO·O) by a first one.
//
// CUDA-core work counts exponentials only, as ours counts the exponentials and Compose's
// multiply-adds: the softmax's and dS's element-wise operations are left out on both sides.
// Warp shuffles count as shared-memory cycles on both sides; the backward's are its row dots'
// reductions, one per 8 elements of dO O (left out: under 0.1% of its shared cycles).
#include <algorithm>

#include "work.hpp"

namespace dcmha::cost_model {

/// Its launches: the forward's one kernel; the backward's row dots, main loop and dQ's
/// conversion.
constexpr int kFlashForwardLaunches = 1, kFlashBackwardLaunches = 3;

/// The head dim FlashAttention-2 compiles a head dim D in (its classes 32, 64, 96, 128, ...):
/// its products and shared tiles are that wide, zero-filled past D; global memory moves D.
inline index_t flash_head_dim(index_t D) { return (D + 31) / 32 * 32; }

/// (query tile, key tile) pairs a causal walk visits: every key tile that starts at or before
/// the query tile's last row.
inline double causal_pairs(index_t T, index_t rows, index_t keys) {
  double pairs = 0;
  for (index_t first = 0; first < T; first += rows)
    pairs += double(std::min((first + rows + keys - 1) / keys, (T + keys - 1) / keys));
  return pairs;
}

/// Shared-memory cycles of a warp-tiled product: each of the warps_n column groups reads all of
/// A, each of the warps_m row groups all of B (16-byte ldmatrix rows, conflict-free: 128 bytes
/// per cycle).
inline double product_wavefronts(double a_bytes, double b_bytes, int warps_m, int warps_n) {
  return (a_bytes * warps_n + b_bytes * warps_m) / 128.0;
}

inline Work flash_forward(const BenchmarkShape& s) {
  const index_t rows = 128, keys = 64;
  const int warps = 4;
  const double D = double(s.D), heads = double(s.B) * double(s.H), element = 2;
  const double tile_D = double(flash_head_dim(s.D));
  const double pairs = causal_pairs(s.T, rows, keys) * heads;
  const double query_tiles = double((s.T + rows - 1) / rows) * heads;
  Work w;
  w.mma = pairs * rows * keys * 2 * tile_D / 2048;
  w.exp = pairs * rows * keys;
  // K, V; Q, O, lse
  w.l2_bytes = pairs * 2 * keys * D * element + query_tiles * rows * (2 * D * element + 4);
  // K and V written once per tile and read by every warp; Q written once per query tile and
  // read per key tile (each warp its own rows: FA2 keeps Q in shared memory at head dim 128);
  // P stays in registers.
  const double kv_tile = 2 * keys * tile_D * element, q_tile = rows * tile_D * element;
  // Shuffles: each warp's row maxima per tile and row sums at the end, 4 rows a lane (two m16
  // tiles) over its quad of lanes (2 steps).
  const double row_shuffles = warps * 4 * 2;
  w.shared_wavefronts =
      pairs * (kv_tile / 128 + product_wavefronts(q_tile, kv_tile, warps, 1) + row_shuffles) +
      query_tiles * (q_tile / 128 + row_shuffles);
  w.hbm_bytes = compulsory_bytes(s);
  return w;
}

inline Work flash_backward(const BenchmarkShape& s) {
  const index_t rows = 64, keys = 128;
  const int warps_m = 2, warps_n = 4;  // 8 warps over a (64 rows, 128 keys) tile
  const double D = double(s.D), heads = double(s.B) * double(s.H), element = 2;
  const double tile_D = double(flash_head_dim(s.D));
  const double pairs = causal_pairs(s.T, rows, keys) * heads;
  const double key_tiles = double((s.T + keys - 1) / keys) * heads;
  const double tokens = double(s.T) * heads;
  Work w;
  w.mma = pairs * rows * keys * 5 * tile_D / 2048;  // QKᵀ, dO Vᵀ, Pᵀ dO, dSᵀ Q, dS K
  w.exp = pairs * rows * keys;
  const double q_rows = rows * D * element;  // one of Q and dO, global
  const double q_tile = rows * tile_D * element, score_tile = rows * keys * element;
  // Per pair: Q, dO, lse, row dots in; dQ's fp32 atomics out. Per key tile: K, V in, dK, dV out.
  // The row dots' kernel reads O and dO and writes the dots; dQ's conversion reads fp32, writes
  // bf16 (the fp32 accumulator as wide as the tiles).
  w.l2_bytes = pairs * (2 * q_rows + rows * 8 + rows * tile_D * 4) +
               key_tiles * 4 * keys * D * element + tokens * (D * element * 2 + 4) +
               tokens * (tile_D * 4 + D * element);
  const double k_tile = keys * tile_D * element;
  w.shared_wavefronts =
      pairs * (2 * q_tile / 128                                                // Q, dO staged
               + product_wavefronts(q_tile, k_tile, warps_m, warps_n) * 2      // QKᵀ, dO Vᵀ
               + 2 * score_tile / 128                                          // P, dS stored
               + product_wavefronts(score_tile, q_tile, warps_m, warps_n) * 2  // Pᵀ dO, dSᵀ Q
               + product_wavefronts(score_tile, k_tile, warps_m, warps_n));    // dS K
  w.hbm_bytes = compulsory_bytes(s) + tokens * D * element                     // O for the row dots
                + 2 * tokens * tile_D * 4;  // dQ's fp32 accumulator
  return w;
}

}  // namespace dcmha::cost_model

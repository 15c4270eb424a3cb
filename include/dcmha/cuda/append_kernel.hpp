#pragma once
// The decode cache's append on the device: one block per (new token, sequence) copies the
// token's K and V rows and key-wise terms into its slot (DecodeCache::append_rows says which).
#include "../compose_weights.hpp"
#include "simt.hpp"

namespace dcmha::cuda {

/// What the append kernel reads and writes; every view is device memory.
template <class T>
struct AppendParams {
  TensorView<const T, 4> k_new, v_new;          // (B, Hk, n, D), (B, Hk, n, Dv)
  TensorView<T, 4> k_slots, v_slots;            // (B, Hk, capacity, D), (B, Hk, capacity, Dv)
  ComposeTerms<T> key_side[2];                  // pre, post: the new tokens' kw1, kw2, kdd
  TensorView<T, 5> kw1_slots[2], kw2_slots[2];  // (B, capacity, G, R, M)
  TensorView<T, 4> kdd_slots[2];                // (B, capacity, G, M)
  const index_t* lengths = nullptr;             // (B,) tokens before this append
  const index_t* counts = nullptr;              // (B,) tokens this append adds
  index_t capacity = 1;
};

template <class Block, class T>
DCMHA_HOST_DEVICE void append_token(const Block& blk, const AppendParams<T>& p) {
  const index_t i = blk.block(0), b = blk.block(1);
  if (i >= p.counts[b]) return;
  const index_t slot = (p.lengths[b] + i) % p.capacity;
  const index_t Hk = p.k_new.shape[1], D = p.k_new.shape[3], Dv = p.v_new.shape[3];
  for_each_owned(blk, Hk * D, [&](index_t e) {
    p.k_slots(b, e / D, slot, e % D) = p.k_new(b, e / D, i, e % D);
  });
  for_each_owned(blk, Hk * Dv, [&](index_t e) {
    p.v_slots(b, e / Dv, slot, e % Dv) = p.v_new(b, e / Dv, i, e % Dv);
  });
  for (int side = 0; side < 2; ++side) {
    const ComposeTerms<T>& c = p.key_side[side];
    if (!c.key_wise) continue;
    const index_t G = c.kw1.shape[2], R = c.kw1.shape[3], M = c.kw1.shape[4];
    for_each_owned(blk, G * R * M, [&](index_t e) {
      const index_t g = e / (R * M), r = e / M % R, m = e % M;
      p.kw1_slots[side](b, slot, g, r, m) = c.kw1(b, i, g, r, m);
      p.kw2_slots[side](b, slot, g, r, m) = c.kw2(b, i, g, r, m);
    });
    for_each_owned(blk, G * M, [&](index_t e) {
      p.kdd_slots[side](b, slot, e / M, e % M) = c.kdd(b, i, e / M, e % M);
    });
  }
}

}  // namespace dcmha::cuda

#pragma once
// What a backend receives for one call: plain data, validated and resolved by the entry point
// (detail/validate.hpp), in the manner of FlashAttention's Flash_fwd_params. The CPU backend
// (cpu/) takes these and nothing else; a CUDA backend takes the same structs.
//
//   QkvParams       what both share: dims, q, k, v, compose inputs, mask, scale, threads
//   ForwardParams   forward(), and decode(): a decode step is a forward whose keys are the
//                   cache's slots (`keys`, a ring for sliding-window layers) and whose
//                   per-sequence lengths are the step's token counts and the kept keys
//   BackwardParams  backward()
//
// Every view is the caller's memory (or the decode cache's); nothing here owns a buffer.
#include <algorithm>

#include "compose_weights.hpp"
#include "config.hpp"
#include "detail/dims.hpp"
#include "tensor.hpp"

namespace dcmha::detail {

/// Which keys each query row sees (spec section 1, step 3).
struct MaskParams {
  bool causal = false;
  index_t window = 0;                                       // 0 = no sliding window
  TensorView<const index_t, 1> query_lengths, key_lengths;  // empty: T and S for every sequence
};

/// Where logical key s of sequence b is stored: slot (start[b] + s) mod capacity of a ring
/// buffer (the decode cache of a sliding-window layer), or slot s when capacity is 0. Masks and
/// panels work in logical positions; only the loads of K, V and key-wise terms go through this.
struct KeyRing {
  index_t capacity = 0;
  TensorView<const index_t, 1> start;

  DCMHA_HOST_DEVICE index_t slot(index_t b, index_t s) const {
    return capacity ? (start(b) + s) % capacity : s;
  }

  /// Calls f(logical_begin, slot_begin, count) for each run of consecutive slots covering
  /// logical keys [s0, s1): one run, or two where the ring wraps.
  template <class F>
  void runs(index_t b, index_t s0, index_t s1, F&& f) const {
    for (index_t s = s0; s < s1;) {
      const index_t p = slot(b, s);
      const index_t n = capacity ? std::min(s1 - s, capacity - p) : s1 - s;
      f(s, p, n);
      s += n;
    }
  }
};

/// What forward and backward share: the problem, its inputs and how to attend.
template <class T>
struct QkvParams {
  AttentionDims dims;
  TensorView<const T, 4> q, k, v;  // (B, H, T, D), (B, Hk, S, D), (B, Hk, S, Dv)
  ComposeWeights<T> compose;       // both sides off: MHA
  MaskParams mask;
  acc_t<T> scale = 0;   // the applied score scale (the config's default resolved)
  int num_threads = 0;  // the caller's request; 0 = all
  Products products = Products::exact;
};

template <class T>
struct ForwardParams : QkvParams<T> {
  TensorView<T, 4> out;         // (B, H, T, Dv)
  TensorView<acc_t<T>, 3> lse;  // (B, H, T), or empty: not kept (inference)
  KeyRing keys;                 // capacity 0 outside decode
};

template <class T>
struct BackwardParams : QkvParams<T> {
  TensorView<const acc_t<T>, 3> lse;  // the forward's statistics
  TensorView<const T, 4> out;         // the forward's output, or empty (not given)
  TensorView<const T, 4> dout;
  TensorView<T, 4> dq, dk, dv;  // overwritten
  ComposeGrads<T> dcompose;     // the switched-on terms' gradients, overwritten
};

}  // namespace dcmha::detail

#pragma once
// The work of a launch or of a whole operation in the units the H200's ceilings take, and the
// benchmark shapes it is modeled at.
#include <cstdint>
#include <string>

#include <dcmha/cuda/emulator/counters.hpp>
#include <dcmha/tensor.hpp>

namespace dcmha::cost_model {

/// A benchmark case: bf16 storage, D = Dv, causal, S = T; DCMHA with the official compose terms
/// (pre and post, query- and key-wise rank R, gates, no static W, one group of all H heads).
struct BenchmarkShape {
  index_t B = 4, H = 32, T = 2048, D = 128, R = 2;
  bool dcmha = false;
  bool backward = false;   // the backward alone (its forward is modeled apart)
  bool two_sided = false;  // MHA's backward on two sides (LaunchOptions::one_pass false)

  std::string name() const {
    return std::string(backward ? "backward" : "forward") + " " + (dcmha ? "DCMHA" : "MHA") + " T" +
           std::to_string(T);
  }
};

struct Work {
  double mma = 0;                // m16n8k16 tensor-core instructions (2,048 multiply-adds each)
  double fma = 0, exp = 0;       // CUDA-core multiply-adds and exponentials
  double l2_bytes = 0;           // global requests in 32-byte sectors: what L2 serves
  double shared_wavefronts = 0;  // shared-memory cycles of one multiprocessor (128 B or a shuffle)
  double peer_bytes = 0;         // another block's shared memory (a cluster's DSMEM)
  double hbm_bytes = 0;          // compulsory: every input read once, every output written once
  // Barriers the blocks wait at, summed over blocks (a cluster barrier once per block): not a
  // unit of the modeled time, whose ceilings are throughputs, but its latency's exposure.
  double block_barriers = 0, cluster_barriers = 0;

  Work& operator+=(const Work& o) {
    mma += o.mma, fma += o.fma, exp += o.exp, l2_bytes += o.l2_bytes;
    shared_wavefronts += o.shared_wavefronts, peer_bytes += o.peer_bytes;
    hbm_bytes += o.hbm_bytes;
    block_barriers += o.block_barriers, cluster_barriers += o.cluster_barriers;
    return *this;
  }
};

/// The fields the emulator counts (all but the compulsory bytes).
constexpr double Work::*kCountedFields[] = {&Work::mma,
                                            &Work::fma,
                                            &Work::exp,
                                            &Work::l2_bytes,
                                            &Work::shared_wavefronts,
                                            &Work::peer_bytes,
                                            &Work::block_barriers,
                                            &Work::cluster_barriers};

/// The emulator's counts of a launch as Work (its compulsory bytes are the shape's, apart).
inline Work work_of(const cuda::emulator::Counters& c) {
  Work w;
  w.mma = double(c.mma);
  w.fma = double(c.fma), w.exp = double(c.exp);
  w.l2_bytes = 32.0 * double(c.global_load_sectors + c.global_store_sectors);
  // A warp shuffle takes the shared-memory unit for a cycle as a wavefront does: both are MIO
  // instructions whose results come back one 32-lane register per cycle.
  w.shared_wavefronts = double(c.shared_wavefronts + c.shuffles);
  w.peer_bytes = double(c.peer_shared_bytes);
  w.block_barriers = double(c.block_barriers), w.cluster_barriers = double(c.cluster_barriers);
  return w;
}

/// Bytes every implementation must move through HBM: inputs once, outputs once, and the
/// softmax statistics the backward needs (the forward's lse, the backward's row dots).
inline double compulsory_bytes(const BenchmarkShape& s) {
  const double element = 2, tokens = double(s.B) * double(s.T) * double(s.H);
  const double row = tokens * double(s.D) * element;  // one (B, H, T, D) tensor
  const double lse = tokens * 4;
  // Compose terms per side: qw1, qw2, kw1, kw2 (R per head and token), qdd, kdd.
  const double terms = s.dcmha ? 2 * tokens * (4 * double(s.R) + 2) * element : 0;
  if (!s.backward) return 3 * row + terms + row + lse;  // q, k, v, terms; out, lse
  // q, k, v, dout, lse, terms; dq, dk, dv, the terms' gradients; row dots written and read.
  const double both = 4 * row + lse + terms + 3 * row + terms + 2 * lse;
  return both;
}

}  // namespace dcmha::cost_model

#pragma once
// Work over the H200's ceilings: a time per unit, and the operation's time with the units
// overlapped (the slowest bounds it) or serialized (they add up).
#include <algorithm>

#include "work.hpp"

namespace dcmha::cost_model {

/// Vendor figures (datasheet) and assumptions, per second, for the whole chip.
struct Ceilings {
  double clock_hz = 1.83e9;  // sustained SM clock under load (assumed)
  int multiprocessors = 132;
  double tensor_flops = 990e12;  // dense bf16 (datasheet)
  double fp32_flops = 67e12;     // plain fp32 (datasheet): 2 FLOPs per multiply-add
  double exp_per_cycle = 16;     // MUFU.EX2 per multiprocessor and cycle
  double hbm_bytes = 4.8e12;     // HBM3e (datasheet)
  double l2_bytes = 10e12;       // L2 to the multiprocessors (assumed, about 2x HBM)
  double peer_bytes = 3.3e12;    // DSMEM across a cluster (assumed)
  double l2_capacity = 50e6;     // bytes the L2 holds (datasheet: 50 MB)

  double shared_wavefronts() const { return clock_hz * multiprocessors; }  // 128 B each
  double exps() const { return exp_per_cycle * clock_hz * multiprocessors; }
};

/// Seconds per unit for one operation.
struct ModeledTime {
  double tensor = 0, fma = 0, exp = 0, shared = 0, l2 = 0, hbm = 0, peer = 0;

  double overlapped() const { return std::max({tensor, fma, exp, shared, l2, hbm, peer}); }
  double serialized() const { return tensor + fma + exp + shared + std::max(l2, hbm) + peer; }
  const char* bound() const {
    const double t = overlapped();
    return t == tensor   ? "tensor"
           : t == fma    ? "fma"
           : t == exp    ? "exp"
           : t == shared ? "shared"
           : t == l2     ? "L2"
           : t == hbm    ? "HBM"
                         : "DSMEM";
  }
  ModeledTime& operator+=(const ModeledTime& o) {
    tensor += o.tensor, fma += o.fma, exp += o.exp, shared += o.shared;
    l2 += o.l2, hbm += o.hbm, peer += o.peer;
    return *this;
  }
};

inline ModeledTime modeled_time(const Work& w, const Ceilings& c = {}) {
  ModeledTime t;
  t.tensor = w.mma * 4096 / c.tensor_flops;  // 2,048 multiply-adds
  t.fma = w.fma * 2 / c.fp32_flops;
  t.exp = w.exp / c.exps();
  t.shared = w.shared_wavefronts / c.shared_wavefronts();
  t.l2 = w.l2_bytes / c.l2_bytes;
  t.hbm = w.hbm_bytes / c.hbm_bytes;
  t.peer = w.peer_bytes / c.peer_bytes;
  return t;
}

}  // namespace dcmha::cost_model

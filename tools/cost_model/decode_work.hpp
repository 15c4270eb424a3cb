#pragma once
// Our decode step's work at the GPU benchmark's decode shape (one new token per sequence over
// a cache of S keys), from the emulator's counts on one sequence.
//
// The plan is the benchmark's (its rows, cluster and key splits forced on the emulated
// problem); with the splits fixed, every count is an affine function of S (each split walks
// S / splits keys), so the fit through three cache lengths that are multiples of
// splits x kKeys gives it at the benchmark's S, a fourth checks it, and the first again on
// other inputs checks that the counts do not follow the data. Sequences (and, for MHA, heads)
// are independent blocks: the counts scale linearly to B and H.
#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "support/emulated_kernels.hpp"

#include "emulated_work.hpp"
#include "h200_model.hpp"

namespace dcmha::cost_model {

/// A decode case: bf16, D = Dv, a global layer whose cache holds S tokens a sequence, one new
/// token; DCMHA with the official compose terms (pre and post, query- and key-wise rank R, the
/// key-wise ones kept in the cache).
struct DecodeShape {
  index_t B = 8, H = 32, S = 4096, D = 128, R = 2;
  bool dcmha = false;
};

/// Bytes of the cache's K (or V) and of its key-wise terms, both sides' (DCMHA).
inline double decode_k_bytes(const DecodeShape& s) {
  return double(s.B) * double(s.S) * double(s.H) * double(s.D) * 2;
}
inline double decode_key_terms_bytes(const DecodeShape& s) {
  return s.dcmha ? double(s.B) * double(s.S) * double(s.H) * 2 * (2 * double(s.R) + 1) * 2 : 0;
}

/// Bytes a decode step must move through HBM: the cache's K, V (and key-wise terms) read once,
/// the new token's query, query-wise terms and output.
inline double decode_compulsory_bytes(const DecodeShape& s) {
  const double heads = double(s.B) * double(s.H);
  const double query_terms = s.dcmha ? heads * 2 * (2 * double(s.R) + 1) * 2 : 0;
  return 2 * decode_k_bytes(s) + decode_key_terms_bytes(s) + query_terms +
         2 * heads * double(s.D) * 2;
}

/// Bytes of the cache a decode step whose values launch recomputes the composed scores reads
/// twice. DCMHA's probabilities need every head's lse over all keys before Compose_post mixes
/// them, so its step walks the keys twice (the statistics, then the values), recomputing the
/// scores from K and the key-wise terms; MHA walks them once. Between the two reads the whole
/// cache streams past (every block walks all its keys), so no more of it than the L2 holds can
/// still be there.
inline double decode_twice_read_bytes(const DecodeShape& s) {
  return s.dcmha ? decode_k_bytes(s) + decode_key_terms_bytes(s) / 2 : 0;
}

/// One decode step's tensors: a cache whose slots are `storage` (random where emulated; a far
/// address nothing reads where only planned), holding S tokens a sequence, and the new token's
/// query, query-wise terms and output.
class DecodeProblem {
 public:
  DecodeProblem(const DecodeShape& s, bool emulated, unsigned seed = kInputDraw)
      : s_(s), emulated_(emulated), rng_(seed) {
    DecodeCacheConfig c;
    c.B = s.B, c.H = c.Hk = s.H, c.D = c.Dv = s.D;
    c.G = s.dcmha ? 1 : s.H;  // MHA: every head its own group
    c.pre_key_wise = c.post_key_wise = s.dcmha;
    c.Rk = s.dcmha ? s.R : 0;
    c.capacity = c.max_step = s.S;
    const index_t elements = DecodeCache<bf16>::required_elements(c);
    cache = std::make_unique<DecodeCache<bf16>>(c, tensor(elements), elements);
    // The tokens are in the slots already (random or never read): the appends only record
    // them, the prompt's S - 1 and the step's new one (decode takes the last append's tokens).
    append(s.S - 1);
    append(1);
    q = view<4>(tensor(s.B * s.H * s.D), {s.B, s.H, 1, s.D});
    out = view<4>(tensor(s.B * s.H * s.D), {s.B, s.H, 1, s.D});
    for (int side = 0; side < 2 && s.dcmha; ++side) {
      ComposeTerms<bf16>& w = side == 0 ? query_side.pre : query_side.post;
      w.query_wise = true;
      w.qw1 = view<5>(tensor(s.B * s.R * s.H), {s.B, 1, 1, s.R, s.H});
      w.qw2 = view<5>(tensor(s.B * s.R * s.H), {s.B, 1, 1, s.R, s.H});
      w.qdd = view<4>(tensor(s.B * s.H), {s.B, 1, 1, s.H});
    }
  }

  std::unique_ptr<DecodeCache<bf16>> cache;
  TensorView<bf16, 4> q, out;
  ComposeWeights<bf16> query_side;

 private:
  /// Records n tokens a sequence, their key-wise terms included, without copying any.
  void append(index_t n) {
    const DecodeShape& s = s_;
    ComposeWeights<bf16> key_side;
    for (int side = 0; side < 2 && s.dcmha; ++side) {
      ComposeTerms<bf16>& k = side == 0 ? key_side.pre : key_side.post;
      k.key_wise = true;
      k.kw1 = view<5>(far(), {s.B, n, 1, s.R, s.H}), k.kw2 = view<5>(far(), {s.B, n, 1, s.R, s.H});
      k.kdd = view<4>(far(), {s.B, n, 1, s.H});
    }
    cache->append_rows("dcmha::cost_model", view<4>(far(), {s.B, s.H, n, s.D}),
                       view<4>(far(), {s.B, s.H, n, s.D}), key_side, {},
                       [](index_t, const index_t*, const index_t*) {});
  }

  /// n random bf16 (emulated) or a far, 256-byte aligned address (planned).
  bf16* tensor(index_t n) {
    if (!emulated_) return far();
    storage_.emplace_back(std::size_t(n) + 128);
    bf16* data = cuda::emulate::aligned_as_on_device(storage_.back(), n);
    std::normal_distribution<float> normal(0.0f, 0.3f);
    for (index_t i = 0; i < n; ++i) data[i] = bf16(normal(rng_));
    return data;
  }
  bf16* far() {
    next_ += std::uintptr_t(1) << 38;
    return reinterpret_cast<bf16*>(next_);
  }

  DecodeShape s_;
  bool emulated_;
  std::uintptr_t next_ = std::uintptr_t(1) << 44;
  std::mt19937 rng_;
  std::vector<std::vector<bf16>> storage_;
};

inline AttentionConfig decode_config() {
  AttentionConfig cfg;
  cfg.mask = Mask::causal;
  return cfg;
}

/// The decode plan at shape s on an sm_90.
inline cuda::ForwardLaunch decode_plan(const DecodeShape& s) {
  const DecodeProblem p(s, false);
  detail::DecodeStepLengths lengths;
  const char* fn = "dcmha::cost_model";
  return cuda::forward_launch(fn, detail::decode_params<bf16>(fn, decode_config(), p.q, *p.cache,
                                                              p.query_side, p.out, lengths));
}

/// One emulated decode step of shape s with the plan forced, on inputs drawn from `seed`: its
/// launches' counts per kernel.
inline Counts emulate_decode(const DecodeShape& s, const cuda::ForwardLaunch& plan,
                             unsigned seed = kInputDraw) {
  DecodeProblem p(s, true, seed);
  cuda::emulator::Counting::enabled() = true;
  cuda::emulator::LaunchLog::get().take();
  Plans forced;
  forced.forward = plan;
  cuda::emulate::decode<bf16>(decode_config(), p.q, *p.cache, p.query_side, p.out,
                              forced.forward_options());
  Counts c;
  for (auto& [kernel, launch] : cuda::emulator::LaunchLog::get().take()) c[kernel] += launch;
  cuda::emulator::Counting::enabled() = false;
  return c;
}

/// Our decode step's work at shape s: emulated on one sequence (MHA: two heads) at four cache
/// lengths, fitted in S and scaled to B and H. Its HBM bytes are the floor's and, for DCMHA, the
/// kept scores written and read back (the statistics launch's K streams past them) or, where
/// the values launch recomputes them, the second read of what the L2 cannot hold.
struct DecodeWork {
  cuda::ForwardLaunch plan;
  std::array<index_t, 4> lengths{};
  OperationWork step;
  Ceilings ceilings;
  double floor_bytes = 0;        // what any decode kernel moves: decode_compulsory_bytes
  double kept_scores_bytes = 0;  // the kept scores' floats, written and read (scores_kept)
  double reread_bytes = 0;       // read again from HBM: decode_twice_read_bytes less the L2
};

inline DecodeWork decode_work(const DecodeShape& s, const Ceilings& ceilings = {}) {
  DecodeWork r;
  r.ceilings = ceilings;
  r.plan = decode_plan(s);
  DecodeShape e = s;
  e.B = 1;
  if (!s.dcmha) e.H = 2;
  const index_t unit = index_t(r.plan.geo.splits) * cuda::kKeys;
  std::array<Counts, 4> runs;
  for (int i = 0; i < 4; ++i) {
    e.S = r.lengths[i] = unit * (i + 1);
    runs[i] = emulate_decode(e, r.plan);
  }
  r.step = fitted_operation(r.lengths, runs, s.S, double(s.B) * double(s.H) / double(e.H));
  e.S = r.lengths[0];
  r.step.data_error = counts_difference(runs[0], emulate_decode(e, r.plan, kInputDraw + 1));
  r.floor_bytes = decode_compulsory_bytes(s);
  if (r.plan.geo.scores_kept)
    r.kept_scores_bytes = 2.0 * 4 * double(s.B) * double(s.H) * double(cuda::kept_score_row(s.S));
  else
    r.reread_bytes = std::max(0.0, decode_twice_read_bytes(s) - ceilings.l2_capacity);
  r.step.total.hbm_bytes = r.floor_bytes + r.kept_scores_bytes + r.reread_bytes;
  return r;
}

}  // namespace dcmha::cost_model

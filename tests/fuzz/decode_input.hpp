#pragma once
// CaseDecoder: fuzz input bytes -> FuzzCase.
//
// Layout of an input (each item one byte unless noted; an exhausted input reads zeros):
//   op, scalar type, threads, seed (4 bytes), then the operation's problem:
//   attention: size class, sizes, Hk and G (divisor indices), both compose sides (switch bits,
//     ranks), mask and window, scale, lengths, a layout byte per activation, lse and compose
//     layouts, options; last the break (a chance byte, then kind, a, b).
//   decode: sizes, sides, layer kind (global capacity or window), max_step, options, layouts, a
//     schedule of steps (kind, n, padding counts), and a possibly broken cache config.
//   projection: sizes, GELU, eps, layouts, options, break.
// Sizes are cut down afterwards to a cost budget (the double-precision reference is
// O(B T S H (D + M R)) and runs under ASan), shrinking the query side first so that long key
// rows (several key tiles and 32-key compose chunks) survive.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "byte_reader.hpp"
#include "fuzz_case.hpp"

namespace dcmha::fuzz {

/// How many kinds of break each operation knows (their lists: attention_breaks.hpp,
/// decode_check.hpp, projection_check.hpp).
inline constexpr int kAttentionBreakKinds = 17;
inline constexpr int kDecodeBreakKinds = 15;
inline constexpr int kConfigBreakKinds = 8;
inline constexpr int kProjectionBreakKinds = 9;

/// Multiply-adds (plus a per-(b, t, s) overhead for the reference's small allocations) that one
/// attention reference pass may take. Under ASan at -O1 the largest inputs then take 0.1-0.3 s,
/// the average one about 12 ms (libFuzzer runs 70-90 inputs a second on one core).
inline constexpr double kReferenceBudget = 1.2e7;

inline std::vector<std::int64_t> divisors_of(std::int64_t n) {
  std::vector<std::int64_t> d;
  for (std::int64_t x = 1; x <= n; ++x)
    if (n % x == 0) d.push_back(x);
  return d;
}

/// The smallest integer >= 2 that does not divide n (for breaks).
inline std::int64_t non_divisor_of(std::int64_t n) {
  std::int64_t x = 2;
  while (n % x == 0) ++x;
  return x;
}

/// Reference cost of one (b, t, s) of an attention problem.
inline double pair_cost(std::int64_t H, std::int64_t D, std::int64_t Dv, std::int64_t M,
                        const SideSpec& pre, const SideSpec& post) {
  auto side = [&](const SideSpec& s) {
    if (!s.enabled()) return 0.0;
    const double terms =
        (s.static_w ? 1 : 0) + (s.query_wise ? s.Rq + 1 : 0) + (s.key_wise ? s.Rk + 1 : 0);
    return double(H) * (double(M) * terms + 20);
  };
  return 60 + double(H) * double(D + Dv) + side(pre) + side(post);
}

class CaseDecoder {
 public:
  explicit CaseDecoder(ByteReader& in) : in_(in) {}

  FuzzCase read() {
    FuzzCase c;
    c.op = Op(in_.byte() % 4);
    c.scalar = Scalar(in_.byte() % 3);
    // bf16 storage exists for forward and backward only.
    if ((c.op == Op::decode || c.op == Op::projection) && c.scalar == Scalar::bf16)
      c.scalar = Scalar::f32;
    c.threads = 1 + in_.byte() % 3;
    c.seed = in_.u32();
    if (c.op == Op::forward || c.op == Op::backward) read_attention(c.attn, c.op);
    if (c.op == Op::decode) read_decode(c.dec);
    if (c.op == Op::projection) read_projection(c.proj);
    if (c.op != Op::decode)
      c.brk = read_break(c.op == Op::projection ? kProjectionBreakKinds : kAttentionBreakKinds, 36);
    return c;
  }

 private:
  Break read_break(int kinds, int chance) {
    Break b;
    if (!in_.chance(chance)) return b;
    b.kind = in_.byte() % kinds;
    b.a = in_.byte();
    b.b = in_.byte();
    return b;
  }

  // --- attention ------------------------------------------------------------------------------

  void read_attention(AttentionCase& a, Op op) {
    read_attention_sizes(a);
    a.pre = read_side();
    a.post = read_side();
    a.causal = in_.flag();
    a.window = in_.chance(64) ? in_.range(1, std::max(a.T, a.S) + 2) : 0;
    // Scores of a few units (the default 1/sqrt(D), half or twice it; q and k 1.5 times larger):
    // far larger ones make float's sums over many (t, s) cancel (the static W's gradient sums
    // B T S products of scores and their gradients), and those are test_numerics' business.
    a.scale = in_.pick({0.0, 0.0, 0.0, 0.5, 2.0}) / std::sqrt(double(a.D));
    a.score_scale = in_.pick({1.0, 1.0, 1.0, 1.5});
    fit_attention_budget(a, op == Op::backward ? 3.5 : 1.0);
    read_lengths(a);
    for (MemLayout<4>& l : a.act) l = read_layout<4>(true);
    a.lse = read_layout<3>(false);
    a.compose_layout = in_.byte() % 4;
    a.with_lse = op == Op::backward || !in_.chance(64);
    // One byte for both (bit 1 was unused), so that the corpus decodes as it did before the
    // backward took the forward's output.
    const std::uint8_t call = in_.byte();
    a.workspace = (call & 1) != 0;
    a.with_out = op == Op::backward && (call & 2) != 0;
  }

  void read_attention_sizes(AttentionCase& a) {
    const int size_class = in_.byte() % 8;
    if (size_class <= 4) {  // small: most inputs, fast
      a.B = in_.range(1, 2);
      a.H = in_.pick<std::int64_t>({1, 2, 3, 4, 6, 8});
      a.T = in_.range(1, 20);
      a.S = in_.flag() ? a.T : in_.range(1, 24);
      a.D = in_.range(1, 8);
      a.Dv = in_.flag() ? a.D : in_.range(1, 8);
    } else if (size_class <= 6) {  // medium: several query blocks and compose chunks
      a.B = in_.range(1, 3);
      a.H = in_.pick<std::int64_t>({1, 2, 4, 6, 8, 12, 16});
      a.T = in_.range(1, 90);
      a.S = in_.flag() ? a.T : in_.range(1, 100);
      a.D = in_.range(1, 20);
      a.Dv = in_.flag() ? a.D : in_.range(1, 20);
    } else {  // the kernels' internal boundaries: 64/128-row blocks, key tiles, many heads
      a.B = in_.range(1, 2);
      a.H = in_.pick<std::int64_t>({4, 8, 16, 32});
      a.T = edge_length();
      a.S = in_.flag() ? a.T : edge_length();
      a.D = in_.range(1, 4);
      a.Dv = in_.range(1, 4);
    }
    const std::vector<std::int64_t> div = divisors_of(a.H);
    a.Hk = div[in_.byte() % div.size()];
    a.G = div[in_.byte() % div.size()];
  }

  std::int64_t edge_length() {
    return in_.pick<std::int64_t>({1,  2,  7,   8,   9,   31,  32,  33,  47,  48,  63, 64,
                                   65, 96, 127, 128, 129, 150, 160, 255, 256, 257, 300});
  }

  SideSpec read_side() {
    SideSpec s;
    const std::uint8_t bits = in_.byte();
    s.static_w = bits & 1;
    s.query_wise = bits & 2;
    s.key_wise = bits & 4;
    // Ranks 1-3 take the register-blocked compose kernels, 4 the generic one.
    s.Rq = 1 + (bits >> 3) % 4;
    s.Rk = 1 + (bits >> 5) % 4;
    return s;
  }

  /// Shrinks T (then S, then compose) until the reference fits the budget.
  static void fit_attention_budget(AttentionCase& a, double passes) {
    auto cost = [&] {
      return passes * double(a.B) * double(a.T) * double(a.S) *
             pair_cost(a.H, a.D, a.Dv, a.H / a.G, a.pre, a.post);
    };
    while (cost() > kReferenceBudget) {
      if (a.T > 1 && a.T * 4 >= a.S)
        a.T = (a.T * 3 + 3) / 4;
      else if (a.S > 1)
        a.S = (a.S * 3 + 3) / 4;
      else if (a.post.enabled())
        a.post = {};
      else if (a.pre.enabled())
        a.pre = {};
      else
        break;
    }
    if (a.window > std::max(a.T, a.S) + 2) a.window = std::max(a.T, a.S) + 2;
  }

  /// Per-sequence lengths, 0 and full included.
  void read_lengths(AttentionCase& a) {
    const int mode = in_.byte() % 6;
    if (mode <= 2) return;  // none
    auto one = [&](std::int64_t full) {
      const std::uint8_t v = in_.byte();
      return v % 4 == 0 ? 0 : v % 4 == 1 ? full : std::int64_t(v >> 2) % (full + 1);
    };
    for (std::int64_t b = 0; b < a.B; ++b) {
      const std::int64_t q = one(a.T);
      a.qlen.push_back(q);
      // mode 3: self-attention (equal lengths where T == S), 4: independent, 5: only one given
      a.klen.push_back(mode == 3 && a.S == a.T ? q : one(a.S));
    }
    if (mode == 5) (in_.flag() ? a.qlen : a.klen).clear();
  }

  /// Dense, (B, T, H, D)-like, with gaps, or any order of the outer dims (of all dims unless
  /// `last_fixed`, which keeps the head dim innermost: attention activations need it contiguous).
  template <int N>
  MemLayout<N> read_layout(bool last_fixed) {
    const std::uint8_t kind = in_.byte();
    MemLayout<N> l = MemLayout<N>::dense();
    switch (kind % 8) {
      case 3:
      case 4:
      case 6:  // dims 1 and 2 swapped: (B, T, H, D) in memory
        std::swap(l.order[1], l.order[2]);
        break;
      case 7: {  // a permutation, from one byte
        unsigned p = in_.byte();
        for (int i = (last_fixed ? N - 1 : N) - 1; i > 0; --i) {
          std::swap(l.order[size_t(i)], l.order[p % unsigned(i + 1)]);
          p /= unsigned(i + 1);
        }
        break;
      }
      default:
        break;
    }
    if (kind % 8 >= 5) {  // gaps after rows, heads, batches, and an offset
      const std::uint8_t g = in_.byte();
      l.gap[N - 1] = g & 3;
      l.gap[N - 2] = (g >> 2) & 3;
      for (int d = 0; d < N - 2; ++d) l.gap[size_t(d)] = (g >> (4 + d)) & 1;
      l.offset = g >> 6;
    }
    return l;
  }

  // --- decode ---------------------------------------------------------------------------------

  void read_decode(DecodeCase& d) {
    d.B = in_.range(1, 3);
    d.H = in_.pick<std::int64_t>({1, 2, 3, 4, 6, 8, 16});
    const std::vector<std::int64_t> div = divisors_of(d.H);
    d.Hk = div[in_.byte() % div.size()];
    d.G = div[in_.byte() % div.size()];
    d.D = in_.range(1, 12);
    d.Dv = in_.range(1, 12);
    d.pre = read_side();
    d.post = read_side();
    // The cache keeps one key-wise rank for both sides.
    d.Rk = (d.pre.key_wise || d.post.key_wise) ? d.pre.Rk : 0;
    d.post.Rk = d.pre.Rk;
    read_decode_layer(d);
    d.scale = in_.pick({0.0, 0.0, 0.0, 0.45});
    d.cfg_window = in_.flag();
    d.workspace = in_.flag();
    d.caller_memory = in_.flag();
    for (MemLayout<4>& l : d.act) l = read_layout<4>(true);
    // K and V of new tokens are copied element by element: any order, the head dim included.
    const std::uint8_t free_kv = in_.byte();
    if (free_kv & 1) d.act[1] = read_layout<4>(false);
    if (free_kv & 2) d.act[2] = read_layout<4>(false);
    d.compose_layout = in_.byte() % 4;
    read_schedule(d);
    if (in_.chance(20)) d.config_break = {in_.byte() % kConfigBreakKinds, in_.byte(), in_.byte()};
  }

  void read_decode_layer(DecodeCase& d) {
    const std::uint8_t kind = in_.byte();
    if (kind % 3 == 0) {  // local layer: a ring of window + max_step - 1 slots
      d.window = kind % 2 ? in_.range(1, 8) : in_.range(1, 80);
      d.capacity = 0;
    } else {  // global layer: small capacities fill up within a schedule
      d.capacity = kind % 2 ? in_.range(1, 24) : in_.range(1, 160);
    }
    d.max_step = in_.chance(200) ? in_.range(1, 8) : in_.range(1, 48);
  }

  /// Steps, simulated as they are read: counts never take a global cache past its capacity (a
  /// sequence that reaches it is clipped to exactly fill it while the others append more), and
  /// no episode (the steps between resets) exceeds the reference budget.
  void read_schedule(DecodeCase& d) {
    const std::int64_t M = d.H / d.G;
    const double per_pair = double(d.B) * pair_cost(d.H, d.D, d.Dv, M, d.pre, d.post);
    const std::int64_t token_cap =
        std::clamp<std::int64_t>(std::int64_t(std::sqrt(kReferenceBudget / per_pair)), 1, 300);
    std::vector<std::int64_t> len(size_t(d.B), 0);
    const int nsteps = int(in_.range(1, 28));
    for (int i = 0; i < nsteps && !in_.exhausted(); ++i) {
      DecodeStep st;
      const std::uint8_t kind = in_.byte() % 20;
      if (kind == 0) st.kind = DecodeStep::reset;
      if (kind == 1) st.kind = DecodeStep::repeat;
      if (kind == 2 || kind == 3) st.kind = DecodeStep::broken;
      if (st.kind == DecodeStep::reset) std::fill(len.begin(), len.end(), 0);
      if (st.kind == DecodeStep::broken)
        st.brk = {in_.byte() % kDecodeBreakKinds, in_.byte(), in_.byte()};
      if (st.kind == DecodeStep::append && !read_append(d, st, len, token_cap)) break;
      d.steps.push_back(st);
    }
  }

  /// One append step; false when no sequence can take another token.
  bool read_append(const DecodeCase& d, DecodeStep& st, std::vector<std::int64_t>& len,
                   std::int64_t token_cap) {
    const std::int64_t limit = d.window ? token_cap : std::min(token_cap, d.capacity);
    if (*std::min_element(len.begin(), len.end()) >= limit) return false;
    st.n = in_.range(1, d.max_step);
    const bool padded = in_.flag();
    bool clipped = false;
    st.counts.assign(size_t(d.B), st.n);
    for (std::int64_t b = 0; b < d.B; ++b) {
      std::int64_t& c = st.counts[size_t(b)];
      if (padded) {
        const std::uint8_t v = in_.byte();
        c = v % 3 == 0 ? st.n : v % 3 == 1 ? 0 : std::int64_t(v / 3) % (st.n + 1);
      }
      const std::int64_t room = limit - len[size_t(b)];
      if (c > room) c = room, clipped = true;
      len[size_t(b)] += c;
    }
    if (!padded && !clipped) st.counts.clear();
    return true;
  }

  // --- projection -----------------------------------------------------------------------------

  void read_projection(ProjectionCase& p) {
    const bool large = in_.chance(40);
    p.B = in_.range(1, 3);
    p.L = large ? in_.range(1, 80) : in_.range(1, 24);
    p.E = large ? in_.range(1, 96) : in_.range(1, 40);
    p.G = in_.range(1, 3);
    p.K = in_.range(1, large ? 40 : 16);
    p.R = in_.range(1, 3);
    p.M = in_.range(1, large ? 16 : 8);
    p.tanh_gelu = in_.flag();
    p.eps = in_.pick({1e-6, 1e-6, 1e-3, 0.5});
    p.in_layout = in_.byte() % 4;
    p.out_layout = in_.byte() % 4;
    p.backward = in_.flag();
    p.keep = in_.flag();
  }

  ByteReader& in_;
};

}  // namespace dcmha::fuzz

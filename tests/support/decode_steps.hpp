#pragma once
// Decoding a test problem's tokens step by step: the cache configuration for a problem, each
// step's tensors (gathered per-sequence counts, NaN where a step hands nothing), and the rows of
// all steps put back at their token positions. Backend-neutral (no kernels): the CPU tests pass a
// step that calls decode(), the CUDA tests one that calls the device's.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "dcmha/compose_weights.hpp"
#include "dcmha/decode/decode_cache.hpp"
#include "dcmha/tensor.hpp"
#include "reference/reference.hpp"

namespace dcmha::test {

/// v restricted to [start, start + n) along dimension dim, in the same memory.
template <class T, int N>
TensorView<T, N> slice(TensorView<T, N> v, int dim, index_t start, index_t n) {
  if (v.empty()) return v;
  v.data += start * v.stride[dim];
  v.shape[dim] = n;
  return v;
}

/// A cache for p's keys: its sizes, window and key-wise switches (global layers hold `capacity`
/// tokens per sequence).
inline DecodeCacheConfig cache_config(const reference::Problem& p, index_t capacity,
                                      index_t max_step) {
  DecodeCacheConfig c;
  c.B = p.B;
  c.H = p.H;
  c.Hk = p.Hk;
  c.D = p.D;
  c.Dv = p.Dv;
  c.G = p.G;
  c.pre_key_wise = p.pre.key_wise;
  c.post_key_wise = p.post.key_wise;
  c.Rk = p.pre.key_wise ? p.pre.Rk : p.post.key_wise ? p.post.Rk : 0;
  c.window = p.window;
  c.capacity = p.window > 0 ? 0 : capacity;
  c.max_step = max_step;
  return c;
}

/// decode()'s query side from the compose weights of a whole problem: the static W and the
/// query-wise terms of queries [t0, t0 + n) (the cache supplies the key-wise ones).
template <class T>
ComposeWeights<T> query_side_of(const ComposeWeights<T>& cw, index_t t0, index_t n) {
  ComposeWeights<T> out;
  for (int s = 0; s < 2; ++s) {
    const ComposeTerms<T>& c = s == 0 ? cw.pre : cw.post;
    ComposeTerms<T>& q = s == 0 ? out.pre : out.post;
    q.static_w = c.static_w;
    q.w = c.w;
    q.query_wise = c.query_wise;
    q.qw1 = slice(c.qw1, 1, t0, n);
    q.qw2 = slice(c.qw2, 1, t0, n);
    q.qdd = slice(c.qdd, 1, t0, n);
  }
  return out;
}

/// DecodeCache::append()'s key side: the key-wise terms of keys [s0, s0 + n).
template <class T>
ComposeWeights<T> key_side_of(const ComposeWeights<T>& cw, index_t s0, index_t n) {
  ComposeWeights<T> out;
  for (int s = 0; s < 2; ++s) {
    const ComposeTerms<T>& c = s == 0 ? cw.pre : cw.post;
    ComposeTerms<T>& k = s == 0 ? out.pre : out.post;
    k.key_wise = c.key_wise;
    k.kw1 = slice(c.kw1, 1, s0, n);
    k.kw2 = slice(c.kw2, 1, s0, n);
    k.kdd = slice(c.kdd, 1, s0, n);
  }
  return out;
}

/// Tokens [start[b], start[b] + count[b]) of every sequence b of a canonical tensor whose dim
/// `td` is the token dim, packed to the front of a tensor with n tokens; the rest is `fill`.
template <class T>
std::vector<T> gather_tokens(const std::vector<double>& src, const std::vector<int64_t>& shape,
                             int td, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& count, int64_t n, double fill) {
  std::vector<int64_t> out_shape = shape;
  out_shape[size_t(td)] = n;
  int64_t total = 1;
  for (int64_t s : out_shape) total *= s;
  std::vector<T> out(static_cast<size_t>(total), T(fill));
  std::vector<int64_t> idx(shape.size(), 0);
  for (int64_t flat = 0; flat < total; ++flat) {
    const int64_t b = idx[0], i = idx[size_t(td)];
    if (i < count[size_t(b)]) {
      int64_t off = 0;
      for (size_t d = 0; d < shape.size(); ++d)
        off = off * shape[d] + (int(d) == td ? start[size_t(b)] + i : idx[d]);
      out[size_t(flat)] = T(src[size_t(off)]);
    }
    for (int d = int(shape.size()) - 1; d >= 0; --d) {
      if (++idx[size_t(d)] < out_shape[size_t(d)]) break;
      idx[size_t(d)] = 0;
    }
  }
  return out;
}

/// Per step, how many new tokens each sequence appends.
using DecodeSchedule = std::vector<std::vector<int64_t>>;

/// Every sequence: `prefill` tokens, then `step` at a time up to `length`.
inline DecodeSchedule uniform_schedule(int64_t B, int64_t length, int64_t prefill, int64_t step) {
  DecodeSchedule s{std::vector<int64_t>(size_t(B), std::min(prefill, length))};
  for (int64_t done = s[0][0]; done < length; done += step)
    s.push_back(std::vector<int64_t>(size_t(B), std::min(step, length - done)));
  return s;
}

/// One decode step's tensors (host memory): what append() and decode() take.
template <class T>
struct DecodeStepTensors {
  TensorView<const T, 4> k, v, q;  // (B, Hk, n, D), (B, Hk, n, Dv), (B, H, n, D)
  ComposeWeights<T> key_side, query_side;
  TensorView<const index_t, 1> counts;
  TensorView<T, 4> out;  // (B, H, n, Dv)
};

/// Decodes p's tokens (self-attention: T == S, token i is query i and key i) step by step,
/// step(tensors) appending and decoding each (with a freshly reset cache); returns each step's
/// out (B, H, n, Dv) row-major, n the step's largest count. Everything a step does not hand the
/// cache or kernel (the padding tokens of a sequence with a smaller count) is NaN, so that
/// reading it shows.
template <class T, class Step>
std::vector<std::vector<double>> decode_steps_with(const reference::Problem& p,
                                                   const DecodeSchedule& schedule, Step&& step) {
  const int64_t B = p.B, H = p.H, Hk = p.Hk, L = p.T, D = p.D, Dv = p.Dv, G = p.G, M = H / G;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<int64_t> done(size_t(B), 0);
  std::vector<std::vector<double>> outs;
  for (const std::vector<int64_t>& count : schedule) {
    const int64_t n = std::max<int64_t>(1, *std::max_element(count.begin(), count.end()));
    std::vector<T> q = gather_tokens<T>(p.q, {B, H, L, D}, 2, done, count, n, nan);
    std::vector<T> k = gather_tokens<T>(p.k, {B, Hk, L, D}, 2, done, count, n, nan);
    std::vector<T> v = gather_tokens<T>(p.v, {B, Hk, L, Dv}, 2, done, count, n, nan);
    std::vector<T> out(size_t(B * H * n * Dv), T(nan));
    std::vector<std::vector<T>> keep;  // this step's compose buffers
    keep.reserve(32);
    auto lowrank = [&](const std::vector<double>& x, int64_t R) {
      keep.push_back(gather_tokens<T>(x, {B, L, G, R, M}, 1, done, count, n, nan));
      return view<5>(static_cast<const T*>(keep.back().data()), {B, n, G, R, M});
    };
    auto gate = [&](const std::vector<double>& x) {
      keep.push_back(gather_tokens<T>(x, {B, L, G, M}, 1, done, count, n, nan));
      return view<4>(static_cast<const T*>(keep.back().data()), {B, n, G, M});
    };
    DecodeStepTensors<T> tensors;
    for (int s = 0; s < 2; ++s) {
      const reference::ComposeSide& c = s == 0 ? p.pre : p.post;
      ComposeTerms<T>& qs = s == 0 ? tensors.query_side.pre : tensors.query_side.post;
      ComposeTerms<T>& ks = s == 0 ? tensors.key_side.pre : tensors.key_side.post;
      if (c.static_w) {
        qs.static_w = true;
        keep.emplace_back(c.w.begin(), c.w.end());
        qs.w = view<3>(static_cast<const T*>(keep.back().data()), {G, M, M});
      }
      if (c.query_wise) {
        qs.query_wise = true;
        qs.qw1 = lowrank(c.qw1, c.Rq);
        qs.qw2 = lowrank(c.qw2, c.Rq);
        qs.qdd = gate(c.qdd);
      }
      if (c.key_wise) {
        ks.key_wise = true;
        ks.kw1 = lowrank(c.kw1, c.Rk);
        ks.kw2 = lowrank(c.kw2, c.Rk);
        ks.kdd = gate(c.kdd);
      }
    }
    tensors.k = bhtd(static_cast<const T*>(k.data()), B, Hk, n, D);
    tensors.v = bhtd(static_cast<const T*>(v.data()), B, Hk, n, Dv);
    tensors.q = bhtd(static_cast<const T*>(q.data()), B, H, n, D);
    tensors.counts = view<1>(static_cast<const index_t*>(count.data()), {B});
    tensors.out = bhtd(out.data(), B, H, n, Dv);
    step(tensors);
    outs.emplace_back(out.begin(), out.end());
    for (int64_t b = 0; b < B; ++b) done[size_t(b)] += count[size_t(b)];
  }
  return outs;
}

/// Decode's rows placed at their token positions, (B, H, T, Dv) row-major; rows past a
/// sequence's tokens are 0. `padding_nonzero` counts padding rows (beyond a step's count) that
/// were not exactly 0.
inline std::vector<double> assemble_rows(const reference::Problem& p,
                                         const DecodeSchedule& schedule,
                                         const std::vector<std::vector<double>>& outs,
                                         int64_t& padding_nonzero) {
  const int64_t B = p.B, H = p.H, L = p.T, Dv = p.Dv;
  std::vector<double> rows(size_t(B * H * L * Dv), 0.0);
  std::vector<int64_t> done(size_t(B), 0);
  padding_nonzero = 0;
  for (size_t step = 0; step < schedule.size(); ++step) {
    const std::vector<int64_t>& count = schedule[step];
    const int64_t n = int64_t(outs[step].size()) / (B * H * Dv);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < n; ++i)
          for (int64_t e = 0; e < Dv; ++e) {
            const double x = outs[step][size_t(((b * H + h) * n + i) * Dv + e)];
            if (i < count[size_t(b)])
              rows[size_t(((b * H + h) * L + done[size_t(b)] + i) * Dv + e)] = x;
            else if (!(x == 0.0))
              ++padding_nonzero;
          }
    for (int64_t b = 0; b < B; ++b) done[size_t(b)] += count[size_t(b)];
  }
  return rows;
}

}  // namespace dcmha::test

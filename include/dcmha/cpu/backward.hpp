#pragma once
// Fused CPU backward of the attention core (MHA and DCMHA).
//
// For one (batch, group, query block) the team recomputes the scores of its keys and keeps three
// panels of M x Bq x S values: L (Compose_pre's input, needed for its weight gradients), P, and
// dP' = dO V^T, which turns into dP = Compose_post^T(dP') and then into dL. The softmax term needs
// D = sum_s P dP per row and head: unlike FlashAttention this is not rowsum(dO * O), because
// Compose_post mixes heads between P and O, so it is reduced across the team at a barrier.
//
// Each thread owns a contiguous share of the block's keys, so dK, dV and the key-wise compose
// gradients are accumulated without races or atomics; dQ and the query-wise gradients of a block
// are summed across threads in thread order. Results are deterministic for a fixed thread count.
#include <cmath>
#include <type_traits>
#include <vector>

#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../detail/dims.hpp"
#include "../tensor.hpp"
#include "compose.hpp"
#include "forward.hpp"
#include "mask.hpp"
#include "parallel.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

namespace detail_bwd {

/// Writes one side's key-wise gradient accumulators of group g to the caller's tensors, keys [s0, s1).
template <class A, class T>
void store_key_grads(const ComposeSide<A>& c, const ComposeKeyGrads<A>& kg,
                     const ComposeTermGrads<T>& out, index_t b, index_t g, index_t s0, index_t s1) {
  if (!c.has_k) return;
  const index_t M = c.M, ld = c.ld;
  for (index_t s = s0; s < s1; ++s)
    for (index_t m = 0; m < M; ++m) {
      for (index_t r = 0; r < c.Rk; ++r) {
        out.kw1(b, s, g, r, m) = T(kg.kw1[(r * M + m) * ld + s]);
        out.kw2(b, s, g, r, m) = T(kg.kw2[(r * M + m) * ld + s]);
      }
      out.kdd(b, s, g, m) = T(kg.kdd[m * ld + s]);
    }
}

/// Sums one row's query-wise gradients over the team (in thread order) into the caller's tensors.
template <class A, class T>
void store_row_grads(const ComposeSide<A>& c, const ComposeRowGrads<A>* parts,
                     index_t stride, int nth, index_t i, const ComposeTermGrads<T>& out, index_t b,
                     index_t t, index_t g) {
  if (!c.has_q) return;
  const index_t M = c.M;
  for (index_t r = 0; r < c.Rq; ++r)
    for (index_t m = 0; m < M; ++m) {
      A s1 = 0, s2 = 0;
      for (int j = 0; j < nth; ++j) {
        s1 += parts[j * stride + i].qw1[r * M + m];
        s2 += parts[j * stride + i].qw2[r * M + m];
      }
      out.qw1(b, t, g, r, m) = T(s1);
      out.qw2(b, t, g, r, m) = T(s2);
    }
  for (index_t m = 0; m < M; ++m) {
    A s = 0;
    for (int j = 0; j < nth; ++j) s += parts[j * stride + i].qdd[m];
    out.qdd(b, t, g, m) = T(s);
  }
}

template <class T>
void zero_rows(const TensorView<T, 4>& x, int tid, int nth) {
  const index_t rows = x.shape[0] * x.shape[1] * x.shape[2];
  index_t r0, r1;
  split_range(0, rows, tid, nth, 1, r0, r1);
  for (index_t r = r0; r < r1; ++r) {
    const index_t b = r / (x.shape[1] * x.shape[2]), h = r / x.shape[2] % x.shape[1], t = r % x.shape[2];
    T* p = x.data + b * x.stride[0] + h * x.stride[1] + t * x.stride[2];
    for (index_t e = 0; e < x.shape[3]; ++e) p[e] = T(0);
  }
}

}  // namespace detail_bwd

template <class T>
void backward(const AttentionConfig& cfg, const detail::AttentionDims& d, TensorView<const T, 4> q,
              TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<const acc_t<T>, 3> lse,
              TensorView<const T, 4> dout, TensorView<T, 4> dq, TensorView<T, 4> dk,
              TensorView<T, 4> dv, const ComposeWeights<T>& cw, const ComposeGrads<T>& dcw) {
  using A = acc_t<T>;
  static_assert(std::is_same_v<A, T>, "storage narrower than the accumulator is not supported yet");
  using namespace detail_bwd;
  const int nt = thread_count(cfg.num_threads);
  const RowMask mask(cfg, d.T, d.S);
  const A scale = default_scale<A>(cfg.scale, d.D);
  const index_t M = d.M, D = d.D, Dv = d.Dv, group_of_kv = d.H / d.Hk;
  const index_t ld = round_up(d.S, 16);
  const index_t Bq = query_block_rows<A>(M, ld, d.T, 3);
  const index_t hs = Bq * ld;
  constexpr index_t kTile = 2 * kChunk;  // keys per P' tile feeding the dV product

  ComposeSide<A> pre, post;
  pre.init(cw.pre, M, ld);
  post.init(cw.post, M, ld);
  const bool composed = pre.on || post.on;
  ComposeKeyGrads<A> pre_kg, post_kg;
  if (pre.has_k) pre_kg.init(pre);
  if (post.has_k) post_kg.init(post);

  std::vector<A> Lp(pre.on ? M * hs : 0), Pp(M * hs), dPp(M * hs);
  std::vector<A> d_part(nt * M * Bq);
  std::vector<A> dq_part(nt * M * Bq * D);
  // Two sets, alternating by block: a thread may start the next block while others still sum
  // this block's query-wise gradients.
  std::vector<ComposeRowGrads<A>> pre_rg(2 * nt * Bq), post_rg(2 * nt * Bq);
  for (auto& r : pre_rg) r.init(pre);
  for (auto& r : post_rg) r.init(post);
  std::vector<A> dw_pre(pre.has_w ? nt * d.G * M * M : 0), dw_post(post.has_w ? nt * d.G * M * M : 0);

#pragma omp parallel num_threads(nt)
  {
    const int tid = thread_id(), nth = team_size();
    std::vector<ComposeRow<A>> pre_rows(Bq), post_rows(Bq);
    for (auto& r : pre_rows) r.init(pre);
    for (auto& r : post_rows) r.init(post);
    std::vector<A> scratch(std::max(pre.scratch_size(), post.scratch_size()));
    std::vector<A> ptile(post.on ? M * Bq * kTile : 0);
    A* my_d = d_part.data() + tid * M * Bq;

    zero_rows(dk, tid, nth);
    zero_rows(dv, tid, nth);
    barrier();

    for (index_t b = 0; b < d.B; ++b) {
      for (index_t g = 0; g < d.G; ++g) {
        A* my_dw_pre = pre.has_w ? dw_pre.data() + (tid * d.G + g) * M * M : nullptr;
        A* my_dw_post = post.has_w ? dw_post.data() + (tid * d.G + g) * M * M : nullptr;
        index_t s0, s1;
        split_range(0, d.S, tid, nth, 1, s0, s1);
        if (composed) {
          if (pre.on) pre.load(cw.pre, b, g, s0, s1);
          if (post.on) post.load(cw.post, b, g, s0, s1);
          barrier();
        }
        for (index_t t0 = 0; t0 < d.T; t0 += Bq) {
          const index_t t1 = std::min(d.T, t0 + Bq), nr = t1 - t0;
          const KeyRange keys = mask.rows(t0, t1);
          index_t c0, c1;
          split_range(keys.begin, keys.end, tid, nth, 16, c0, c1);
          const index_t w = c1 - c0;
          ComposeRowGrads<A>* my_pre_rg = pre_rg.data() + ((t0 / Bq) % 2 * nt + tid) * Bq;
          ComposeRowGrads<A>* my_post_rg = post_rg.data() + ((t0 / Bq) % 2 * nt + tid) * Bq;
          for (index_t i = 0; i < nr; ++i) {
            pre_rows[i].load(pre, cw.pre, b, t0 + i, g);
            post_rows[i].load(post, cw.post, b, t0 + i, g);
            if (pre.has_q) my_pre_rg[i].zero();
            if (post.has_q) my_post_rg[i].zero();
          }

          // 1. L, P (from the saved statistics), dP' = dO V^T, dV += P'^T dO, dP, D.
          A* Ls = pre.on ? Lp.data() : Pp.data();
          for (index_t m = 0; m < M && w > 0; ++m) {
            const index_t h = g * M + m, hk = h / group_of_kv;
            Tile<A> L(Ls + m * hs + c0, nr, w, Eigen::OuterStride<>(ld));
            L.noalias() = (rows_of(q, b, h, t0, nr) * rows_of(k, b, hk, c0, w).transpose()) * scale;
            Tile<A> dPm(dPp.data() + m * hs + c0, nr, w, Eigen::OuterStride<>(ld));
            dPm.noalias() = rows_of(dout, b, h, t0, nr) * rows_of(v, b, hk, c0, w).transpose();
          }
          if (pre.on)
            for (index_t cs = c0; cs < c1; cs += kChunk) {
              const int n = int(std::min<index_t>(kChunk, c1 - cs));
              for (index_t i = 0; i < nr; ++i)
                compose_chunk(pre, pre_rows[i], cs, n, Lp.data() + i * ld + cs, hs,
                              Pp.data() + i * ld + cs, hs, scratch.data());
            }
          for (index_t i = 0; i < nr; ++i) {
            const KeyRange r = mask.row(t0 + i);
            const index_t vb = std::max(r.begin, c0), ve = std::min(r.end, c1);
            for (index_t m = 0; m < M; ++m) {
              A* row = Pp.data() + m * hs + i * ld;
              if (ve > vb) {
                Segment<A> p(row + vb, ve - vb);
                p = (p - lse(b, g * M + m, t0 + i)).exp();
              }
              for (index_t s = c0; s < std::min(vb, c1); ++s) row[s] = A(0);
              for (index_t s = std::max(ve, c0); s < c1; ++s) row[s] = A(0);
            }
          }
          for (index_t m = 0; m < M && w > 0 && !post.on; ++m) {
            const index_t h = g * M + m, hk = h / group_of_kv;
            mutable_rows_of(dv, b, hk, c0, w).noalias() +=
                ConstTile<A>(Pp.data() + m * hs + c0, nr, w, Eigen::OuterStride<>(ld)).transpose() *
                rows_of(dout, b, h, t0, nr);
          }
          if (post.on) {
            for (index_t ts = c0; ts < c1; ts += kTile) {
              const index_t tw = std::min(kTile, c1 - ts);
              for (index_t cs = ts; cs < ts + tw; cs += kChunk) {
                const int n = int(std::min<index_t>(kChunk, ts + tw - cs));
                for (index_t i = 0; i < nr; ++i)
                  compose_chunk(post, post_rows[i], cs, n, Pp.data() + i * ld + cs, hs,
                                ptile.data() + i * kTile + (cs - ts), Bq * kTile, scratch.data());
              }
              for (index_t m = 0; m < M; ++m) {
                const index_t h = g * M + m, hk = h / group_of_kv;
                mutable_rows_of(dv, b, hk, ts, tw).noalias() +=
                    ConstTile<A>(ptile.data() + m * Bq * kTile, nr, tw, Eigen::OuterStride<>(kTile)).transpose() *
                    rows_of(dout, b, h, t0, nr);
              }
            }
            for (index_t cs = c0; cs < c1; cs += kChunk) {
              const int n = int(std::min<index_t>(kChunk, c1 - cs));
              for (index_t i = 0; i < nr; ++i) {
                A* gp = dPp.data() + i * ld + cs;
                compose_chunk_backward(post, post_rows[i], cs, n, Pp.data() + i * ld + cs, hs, gp,
                                       hs, gp, hs, my_post_rg[i], post_kg, my_dw_post,
                                       scratch.data());
              }
            }
          }
          for (index_t m = 0; m < M; ++m)
            for (index_t i = 0; i < nr; ++i) {
              A s = 0;
              if (w > 0)
                s = (Segment<A>(Pp.data() + m * hs + i * ld + c0, w) *
                     Segment<A>(dPp.data() + m * hs + i * ld + c0, w)).sum();
              my_d[m * Bq + i] = s;
            }
          barrier();

          // 2. dL' = P (dP - D), dL = Compose_pre^T(dL'), dK += dL^T Q, this thread's part of dQ.
          for (index_t m = 0; m < M && w > 0; ++m)
            for (index_t i = 0; i < nr; ++i) {
              A Dm = 0;
              for (int j = 0; j < nth; ++j) Dm += d_part[(j * M + m) * Bq + i];
              Segment<A> dp(dPp.data() + m * hs + i * ld + c0, w);
              dp = Segment<A>(Pp.data() + m * hs + i * ld + c0, w) * (dp - Dm);
            }
          if (pre.on)
            for (index_t cs = c0; cs < c1; cs += kChunk) {
              const int n = int(std::min<index_t>(kChunk, c1 - cs));
              for (index_t i = 0; i < nr; ++i) {
                A* gp = dPp.data() + i * ld + cs;
                compose_chunk_backward(pre, pre_rows[i], cs, n, Lp.data() + i * ld + cs, hs, gp, hs,
                                       gp, hs, my_pre_rg[i], pre_kg, my_dw_pre,
                                       scratch.data());
              }
            }
          for (index_t m = 0; m < M; ++m) {
            const index_t h = g * M + m, hk = h / group_of_kv;
            Tile<A> dQ(dq_part.data() + (tid * M + m) * Bq * D, nr, D, Eigen::OuterStride<>(D));
            if (w == 0) {
              dQ.setZero();
              continue;
            }
            ConstTile<A> dL(dPp.data() + m * hs + c0, nr, w, Eigen::OuterStride<>(ld));
            mutable_rows_of(dk, b, hk, c0, w).noalias() += (dL.transpose() * rows_of(q, b, h, t0, nr)) * scale;
            dQ.noalias() = (dL * rows_of(k, b, hk, c0, w)) * scale;
          }
          barrier();

          // 3. Sum dQ and the query-wise gradients over the team, a share of the rows each.
          index_t r0, r1;
          split_range(0, nr, tid, nth, 1, r0, r1);
          for (index_t m = 0; m < M; ++m) {
            const index_t h = g * M + m;
            for (index_t i = r0; i < r1; ++i) {
              T* o = dq.data + b * dq.stride[0] + h * dq.stride[1] + (t0 + i) * dq.stride[2];
              const A* p0 = dq_part.data() + (0 * M + m) * Bq * D + i * D;
              for (index_t e = 0; e < D; ++e) o[e] = p0[e];
              for (int j = 1; j < nth; ++j) {
                const A* pj = dq_part.data() + (j * M + m) * Bq * D + i * D;
                for (index_t e = 0; e < D; ++e) o[e] += pj[e];
              }
            }
          }
          for (index_t i = r0; i < r1; ++i) {
            const index_t set = (t0 / Bq) % 2 * nt * Bq;
            store_row_grads(pre, pre_rg.data() + set, Bq, nth, i, dcw.pre, b, t0 + i, g);
            store_row_grads(post, post_rg.data() + set, Bq, nth, i, dcw.post, b, t0 + i, g);
          }
        }
        if (pre.has_k || post.has_k) {
          barrier();  // every block of this group has added its key-wise gradients
          store_key_grads(pre, pre_kg, dcw.pre, b, g, s0, s1);
          store_key_grads(post, post_kg, dcw.post, b, g, s0, s1);
          for (auto* kg : {&pre_kg, &post_kg})
            for (auto* vec : {&kg->kw1, &kg->kw2, &kg->kdd})
              for (index_t r = 0; r < index_t(vec->size()) / ld; ++r)
                std::fill(vec->data() + r * ld + s0, vec->data() + r * ld + s1, A(0));
        }
        barrier();  // the next group reloads the compose sides
      }
    }
  }

  // Static weights: per-thread sums, added in thread order.
  for (int side = 0; side < 2; ++side) {
    const std::vector<A>& parts = side ? dw_post : dw_pre;
    const TensorView<T, 3>& out = side ? dcw.post.w : dcw.pre.w;
    if (parts.empty()) continue;
    for (index_t g = 0; g < d.G; ++g)
      for (index_t m = 0; m < M; ++m)
        for (index_t n = 0; n < M; ++n) {
          A s = 0;
          for (int j = 0; j < nt; ++j) s += parts[(j * d.G + g) * M * M + m * M + n];
          out(g, m, n) = T(s);
        }
  }
}

}  // namespace dcmha::cpu

#pragma once
// Fused CPU forward of the attention core (MHA and DCMHA).
//
// Why a panel and not an online softmax: Compose_post mixes *normalized* probabilities across
// the heads of a group, and each head's normalizer is only known once its whole row has been
// seen. So for one query block of Bq rows we keep the scores of all M heads of the group over
// the block's visible keys, a panel [m][row][key] of M x Bq x S values (never B*H*T*S), take an
// exact softmax, compose, and multiply by V. The matrix products are the same two as in MHA.
//
// Parallelism: the whole team works on one (batch, group, query block) at a time, each thread on
// a contiguous share of its keys. Row statistics are combined across threads at two barriers and
// partial outputs summed in thread order at a third, so results are deterministic for a fixed
// thread count. Key ownership is what makes the backward race-free (backward.hpp), and the same
// split serves decoding, where one query row meets many keys.
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../compose_weights.hpp"
#include "../config.hpp"
#include "../detail/dims.hpp"
#include "../tensor.hpp"
#include "compose.hpp"
#include "mask.hpp"
#include "parallel.hpp"
#include "tile.hpp"

namespace dcmha::cpu {

/// Rows per query block: as many as keep the kernel's panels (each M x Bq x S) within a budget
/// that stays in the last-level cache, between 8 and 64.
template <class A>
inline index_t query_block_rows(index_t M, index_t ld, index_t T, index_t panels = 1) {
  constexpr index_t kPanelBytes = index_t(16) << 20;
  index_t rows = kPanelBytes / index_t(sizeof(A)) / std::max<index_t>(panels * M * ld, 1);
  rows = std::max<index_t>(8, std::min<index_t>(64, rows / 8 * 8));
  return std::min(rows, T);
}

template <class A>
inline A default_scale(double scale, index_t D) {
  return scale > 0 ? A(scale) : A(1) / std::sqrt(A(D));
}

template <class T>
void forward(const AttentionConfig& cfg, const detail::AttentionDims& d, TensorView<const T, 4> q,
             TensorView<const T, 4> k, TensorView<const T, 4> v, TensorView<T, 4> out,
             TensorView<acc_t<T>, 3> lse, const ComposeWeights<T>& cw) {
  using A = acc_t<T>;
  static_assert(std::is_same_v<A, T>, "storage narrower than the accumulator is not supported yet");
  const int nt = thread_count(cfg.num_threads);
  const RowMask mask(cfg, d.T, d.S);
  const A scale = default_scale<A>(cfg.scale, d.D);
  const index_t M = d.M, Dv = d.Dv, group_of_kv = d.H / d.Hk;
  const index_t ld = round_up(d.S, 16);
  const index_t Bq = query_block_rows<A>(M, ld, d.T);
  const index_t hs = Bq * ld;  // panel head stride

  ComposeSide<A> pre, post;
  pre.init(cw.pre, M, ld);
  post.init(cw.post, M, ld);
  const bool composed = pre.on || post.on;

  std::vector<A> panel(M * hs);
  std::vector<A> row_max(nt * M * Bq), row_sum(nt * M * Bq);
  std::vector<A> o_part(nt * M * Bq * Dv);

#pragma omp parallel num_threads(nt)
  {
    const int tid = thread_id(), nth = team_size();
    std::vector<ComposeRow<A>> pre_rows(Bq), post_rows(Bq);
    for (auto& r : pre_rows) r.init(pre);
    for (auto& r : post_rows) r.init(post);
    std::vector<A> scratch(std::max(pre.scratch_size(), post.scratch_size()));
    A* my_max = row_max.data() + tid * M * Bq;
    A* my_sum = row_sum.data() + tid * M * Bq;
    constexpr A kNegInf = -std::numeric_limits<A>::infinity();

    for (index_t b = 0; b < d.B; ++b) {
      for (index_t g = 0; g < d.G; ++g) {
        if (composed) {
          index_t s0, s1;
          split_range(0, d.S, tid, nth, 1, s0, s1);
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
          for (index_t i = 0; i < nr; ++i) {
            pre_rows[i].load(pre, cw.pre, b, t0 + i, g);
            post_rows[i].load(post, cw.post, b, t0 + i, g);
          }

          // A: scores, Compose_pre, this thread's share of each row's maximum.
          for (index_t m = 0; m < M && w > 0; ++m) {
            const index_t h = g * M + m;
            Tile<A> L(panel.data() + m * hs + c0, nr, w, Eigen::OuterStride<>(ld));
            L.noalias() = (rows_of(q, b, h, t0, nr) * rows_of(k, b, h / group_of_kv, c0, w).transpose()) * scale;
          }
          if (pre.on)
            for (index_t cs = c0; cs < c1; cs += kChunk) {
              const int n = int(std::min<index_t>(kChunk, c1 - cs));
              for (index_t i = 0; i < nr; ++i) {
                A* p = panel.data() + i * ld + cs;
                compose_chunk(pre, pre_rows[i], cs, n, p, hs, p, hs, scratch.data());
              }
            }
          for (index_t i = 0; i < nr; ++i) {
            const KeyRange r = mask.row(t0 + i);
            const index_t vb = std::max(r.begin, c0), ve = std::min(r.end, c1);
            for (index_t m = 0; m < M; ++m)
              my_max[m * Bq + i] =
                  ve > vb ? Segment<A>(panel.data() + m * hs + i * ld + vb, ve - vb).maxCoeff() : kNegInf;
          }
          barrier();

          // B: exponentials against the row maximum; masked keys become exactly 0.
          for (index_t i = 0; i < nr; ++i) {
            const KeyRange r = mask.row(t0 + i);
            const index_t vb = std::max(r.begin, c0), ve = std::min(r.end, c1);
            for (index_t m = 0; m < M; ++m) {
              A mx = kNegInf;
              for (int j = 0; j < nth; ++j) mx = std::max(mx, row_max[(j * M + m) * Bq + i]);
              A* row = panel.data() + m * hs + i * ld;
              A sum = 0;
              if (ve > vb) {
                Segment<A> e(row + vb, ve - vb);
                e = (e - mx).exp();
                sum = e.sum();
              }
              for (index_t s = c0; s < std::min(vb, c1); ++s) row[s] = A(0);
              for (index_t s = std::max(ve, c0); s < c1; ++s) row[s] = A(0);
              my_sum[m * Bq + i] = sum;
            }
          }
          barrier();

          // C: normalize, Compose_post, this thread's share of P' V.
          for (index_t i = 0; i < nr; ++i) {
            const KeyRange r = mask.row(t0 + i);
            const index_t vb = std::max(r.begin, c0), ve = std::min(r.end, c1);
            for (index_t m = 0; m < M; ++m) {
              A l = 0, mx = kNegInf;
              for (int j = 0; j < nth; ++j) {
                l += row_sum[(j * M + m) * Bq + i];
                mx = std::max(mx, row_max[(j * M + m) * Bq + i]);
              }
              if (ve > vb) Segment<A>(panel.data() + m * hs + i * ld + vb, ve - vb) *= (l > 0 ? A(1) / l : A(0));
              if (tid == 0 && !lse.empty())
                lse(b, g * M + m, t0 + i) = l > 0 ? mx + std::log(l) : kNegInf;
            }
          }
          if (post.on)
            for (index_t cs = c0; cs < c1; cs += kChunk) {
              const int n = int(std::min<index_t>(kChunk, c1 - cs));
              for (index_t i = 0; i < nr; ++i) {
                A* p = panel.data() + i * ld + cs;
                compose_chunk(post, post_rows[i], cs, n, p, hs, p, hs, scratch.data());
              }
            }
          for (index_t m = 0; m < M; ++m) {
            const index_t h = g * M + m;
            Tile<A> O(o_part.data() + (tid * M + m) * Bq * Dv, nr, Dv, Eigen::OuterStride<>(Dv));
            if (w > 0)
              O.noalias() = ConstTile<A>(panel.data() + m * hs + c0, nr, w, Eigen::OuterStride<>(ld)) *
                            rows_of(v, b, h / group_of_kv, c0, w);
            else
              O.setZero();
          }
          barrier();

          // D: sum the partial outputs in thread order; each thread writes a share of the rows.
          index_t r0, r1;
          split_range(0, nr, tid, nth, 1, r0, r1);
          for (index_t m = 0; m < M; ++m) {
            const index_t h = g * M + m;
            for (index_t i = r0; i < r1; ++i) {
              T* o = out.data + b * out.stride[0] + h * out.stride[1] + (t0 + i) * out.stride[2];
              const A* p0 = o_part.data() + (0 * M + m) * Bq * Dv + i * Dv;
              for (index_t e = 0; e < Dv; ++e) o[e] = p0[e];
              for (int j = 1; j < nth; ++j) {
                const A* pj = o_part.data() + (j * M + m) * Bq * Dv + i * Dv;
                for (index_t e = 0; e < Dv; ++e) o[e] += pj[e];
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace dcmha::cpu

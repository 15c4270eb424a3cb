#pragma once
// CPU forward and backward of the dynamic weight projection (spec section 2).
//
// Rows n = b * L + l. The two products with x are (B*L) x E by E x (G*4*K) and E x (G*4*M)
// GEMMs on Eigen maps of the caller's memory; the per-split hidden -> w products are small
// GEMMs; GELU, the RMS norm and tanh are elementwise loops split over rows with OpenMP.
// Every result element is owned by one thread and reduced in a fixed order, so results are
// deterministic for a fixed thread count.
#include <Eigen/Core>
#include <cmath>
#include <memory>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "../config.hpp"
#include "../tensor.hpp"
#include "matrix.hpp"
#include "validate.hpp"

namespace dcmha::detail::projection {

/// Sets the calling thread's OpenMP team size for one call and restores it after. Eigen's
/// GEMM asks omp_get_max_threads() (unless the program called Eigen::setNbThreads), and the
/// setting is per thread, so concurrent calls with different counts do not interfere.
class ThreadScope {
 public:
  explicit ThreadScope(int n) {
#ifdef _OPENMP
    saved_ = omp_get_max_threads();
    if (n > 0) omp_set_num_threads(n);
#else
    (void)n;
#endif
  }
  ~ThreadScope() {
#ifdef _OPENMP
    omp_set_num_threads(saved_);
#endif
  }
  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 private:
  [[maybe_unused]] int saved_ = 1;  // read only with OpenMP
};

template <class A>
struct GeluConstants {
  static constexpr A inv_sqrt2 = A(0.70710678118654752440);
  static constexpr A inv_sqrt_2pi = A(0.39894228040143267794);
  static constexpr A sqrt_2_over_pi = A(0.79788456080286535588);
  static constexpr A cubic = A(0.044715);
};

template <class A>
inline A gelu(A v, Gelu kind) {
  using C = GeluConstants<A>;
  if (kind == Gelu::erf) return A(0.5) * v * (A(1) + std::erf(v * C::inv_sqrt2));
  const A t = std::tanh(C::sqrt_2_over_pi * (v + C::cubic * v * v * v));
  return A(0.5) * v * (A(1) + t);
}

template <class A>
inline A gelu_grad(A v, Gelu kind) {
  using C = GeluConstants<A>;
  if (kind == Gelu::erf)
    return A(0.5) * (A(1) + std::erf(v * C::inv_sqrt2)) +
           v * C::inv_sqrt_2pi * std::exp(A(-0.5) * v * v);
  const A t = std::tanh(C::sqrt_2_over_pi * (v + C::cubic * v * v * v));
  return A(0.5) * (A(1) + t) +
         A(0.5) * v * (A(1) - t * t) * C::sqrt_2_over_pi * (A(1) + A(3) * C::cubic * v * v);
}

/// The parameters as matrices: dw1 as E x (G*4*K), dd as E x (G*4*M), and qkw as one
/// K x (2R*M) matrix per (group, split).
template <class T>
struct ParamMatrices {
  RowMat<T> dw1_store, dd_store;
  std::vector<RowMat<T>> qkw_store;
  MatRef<const T> dw1, dd;
  std::vector<MatRef<const T>> qkw;

  ParamMatrices(const DynamicWeightProjection<T>& p, const ProjectionDims& d)
      : qkw_store(static_cast<std::size_t>(d.G * 4)), qkw(static_cast<std::size_t>(d.G * 4)) {
    dw1 = input_matrix(p.dw1, 1, dw1_store);
    dd = input_matrix(p.dd, 1, dd_store);
    for (index_t g = 0; g < d.G; ++g)
      for (index_t c = 0; c < 4; ++c) {
        const index_t gc = g * 4 + c;
        qkw[gc] = input_matrix(qkw_block(p.qkw, g, c), 1, qkw_store[gc]);
      }
  }

  template <class U>
  static TensorView<U, 3> qkw_block(const TensorView<U, 5>& q, index_t g, index_t c) {
    return TensorView<U, 3>(q.data + g * q.stride[0] + c * q.stride[1],
                            {q.shape[2], q.shape[3], q.shape[4]},
                            {q.stride[2], q.stride[3], q.stride[4]});
  }
};

/// dst (B*L rows) = x * w, one GEMM per row block of x.
template <class T, class Dst>
void rows_times(const RowBlocks<const T>& x, const MatRef<const T>& w, Dst& dst) {
  for (std::size_t i = 0; i < x.blocks.size(); ++i) {
    const index_t r0 = static_cast<index_t>(i) * x.block_rows;
    dst.middleRows(r0, x.blocks[i].rows).noalias() = map(x.blocks[i]) * map(w);
  }
}

/// out = x^T * rhs, summed over the row blocks of x.
template <class T, class Rhs>
void rows_transpose_times(const RowBlocks<const T>& x, const Rhs& rhs, const MatRef<T>& out) {
  MutMap<T> o = map(out);
  for (std::size_t i = 0; i < x.blocks.size(); ++i) {
    const index_t r0 = static_cast<index_t>(i) * x.block_rows;
    const auto part = rhs.middleRows(r0, x.blocks[i].rows);
    if (i == 0)
      o.noalias() = map(x.blocks[i]).transpose() * part;
    else
      o.noalias() += map(x.blocks[i]).transpose() * part;
  }
}

/// Hidden pre-activations and raw w for every row: what the backward needs of the forward,
/// recomputed there unless the forward kept it (ProjectionActivations).
template <class T>
struct Recomputed {
  RowMat<T> hpre;       // (B*L) x (G*4*K), x * dw1
  RowMat<T> hidden;     // GELU(hpre)
  RowMat<T> w;          // (B*L) x (G*4*2R*M), hidden * qkw per (group, split), before the norm
  RowMat<T> ddpre;      // (B*L) x (G*4*M), x * dd
  ProjectionDims dims;  // of the call that computed them
  bool filled = false;  // a forward that keeps them finished; what a backward may read

  std::size_t bytes() const {
    return std::size_t(hpre.size() + hidden.size() + w.size() + ddpre.size()) * sizeof(T);
  }
};

/// The kernels' way into a ProjectionActivations.
struct ActivationsAccess {
  /// Storage is made on the first forward that keeps activations (and after release or a move).
  template <class T>
  static Recomputed<acc_t<T>>& get(ProjectionActivations<T>& a) {
    if (!a.r_) a.r_ = std::make_unique<Recomputed<acc_t<T>>>();
    return *a.r_;
  }
  /// Null for activations no forward has kept since they were made, released or moved from.
  template <class T>
  static const Recomputed<acc_t<T>>* find(const ProjectionActivations<T>& a) {
    return a.r_.get();
  }
};

/// Whether `r` (kept by a forward, or null) is the activations of a call of dims d.
template <class T>
void check_activations(const char* fn, const Recomputed<T>* r, const ProjectionDims& d) {
  if (!r || !r->filled)
    fail(fn,
         ": kept: expected the activations a dynamic_weights_forward kept, got empty ones "
         "(never filled, released or moved from)");
  const ProjectionDims& k = r->dims;
  if (k.B != d.B || k.L != d.L || k.E != d.E || k.G != d.G || k.K != d.K || k.R != d.R ||
      k.M != d.M)
    fail(fn, ": kept: expected the activations of a forward with (B, L, E, G, K, R, M) = (", d.B,
         ", ", d.L, ", ", d.E, ", ", d.G, ", ", d.K, ", ", d.R, ", ", d.M,
         ") as x and the parameters here, got those of (", k.B, ", ", k.L, ", ", k.E, ", ", k.G,
         ", ", k.K, ", ", k.R, ", ", k.M, ")");
}

template <class T>
void recompute(const ProjectionConfig& cfg, const ProjectionDims& d, const RowBlocks<const T>& x,
               const ParamMatrices<T>& p, Recomputed<T>& r, bool keep_hpre) {
  const index_t N = d.rows(), GK = d.G * 4 * d.K, W2 = 2 * d.R * d.M;
  r.hpre.resize(N, GK);
  rows_times(x, p.dw1, r.hpre);

  if (keep_hpre) r.hidden.resize(N, GK);
  RowMat<T>& h = keep_hpre ? r.hidden : r.hpre;
  const Gelu kind = cfg.gelu;
  const T* src = r.hpre.data();
  T* dst = h.data();
  const index_t total = N * GK;
#pragma omp parallel for schedule(static)
  for (index_t i = 0; i < total; ++i) dst[i] = gelu<T>(src[i], kind);

  r.w.resize(N, d.G * 4 * W2);
  for (index_t gc = 0; gc < d.G * 4; ++gc)
    r.w.middleCols(gc * W2, W2).noalias() = h.middleCols(gc * d.K, d.K) * map(p.qkw[gc]);

  r.ddpre.resize(N, d.G * 4 * d.M);
  rows_times(x, p.dd, r.ddpre);
  r.dims = d;
}

template <class U, int N>
inline U* row_ptr(const TensorView<U, N>& v, index_t b, index_t l, index_t g) {
  return v.data + b * v.stride[0] + l * v.stride[1] + g * v.stride[2];
}

/// `keep`: where to leave the activations for the backward, or null.
template <class T>
void forward(const ProjectionConfig& cfg, const ProjectionDims& d, TensorView<const T, 3> x,
             const DynamicWeightProjection<T>& p, const DynamicWeights<T>& out,
             Recomputed<T>* keep = nullptr) {
  ThreadScope threads(cfg.num_threads);
  using A = acc_t<T>;
  RowMat<T> x_store;
  const RowBlocks<const T> xr = input_rows(x, x_store);
  const ParamMatrices<T> pm(p, d);
  Recomputed<T> local;
  Recomputed<T>& r = keep ? *keep : local;
  r.filled = false;  // until this forward has refilled them (an exception leaves them refused)
  recompute(cfg, d, xr, pm, r, /*keep_hpre=*/keep != nullptr);
  r.filled = keep != nullptr;

  const SplitViews<T> o = by_split(out);
  const index_t N = d.rows(), L = d.L, G = d.G, R = d.R, M = d.M, W2 = 2 * R * M;
  const A eps = static_cast<A>(cfg.eps);
#pragma omp parallel for schedule(static)
  for (index_t n = 0; n < N; ++n) {
    const index_t b = n / L, l = n % L;
    const T* wrow = r.w.data() + n * r.w.cols();
    const T* drow = r.ddpre.data() + n * r.ddpre.cols();
    for (index_t g = 0; g < G; ++g) {
      for (int c = 0; c < 4; ++c) {
        const index_t gc = g * 4 + c;
        const T* w = wrow + gc * W2;
        const TensorView<T, 5>& v1 = o.w1[c];
        const TensorView<T, 5>& v2 = o.w2[c];
        T* o1 = row_ptr(v1, b, l, g);
        T* o2 = row_ptr(v2, b, l, g);
        for (index_t ri = 0; ri < R; ++ri) {
          const T* w1 = w + ri * M;
          A ss = 0;
          for (index_t m = 0; m < M; ++m) ss += A(w1[m]) * A(w1[m]);
          const A inv = A(1) / std::sqrt(ss / A(M) + eps);
          for (index_t m = 0; m < M; ++m)
            o1[ri * v1.stride[3] + m * v1.stride[4]] = static_cast<T>(A(w1[m]) * inv);
          const T* w2 = w + (R + ri) * M;
          for (index_t m = 0; m < M; ++m) o2[ri * v2.stride[3] + m * v2.stride[4]] = w2[m];
        }
        const TensorView<T, 4>& vd = o.dd[c];
        T* od = row_ptr(vd, b, l, g);
        const T* dp = drow + gc * M;
        for (index_t m = 0; m < M; ++m) od[m * vd.stride[3]] = std::tanh(dp[m]);
      }
    }
  }
}

/// One row's upstream gradients of the dynamic weights through the RMS norm (w1) and tanh (dd),
/// in place: `w` holds the row's pre-norm weights and becomes their gradient; `dd_pre` holds the
/// gate's pre-tanh values and becomes theirs.
template <class T>
void norm_and_tanh_backward_row(const ProjectionDims& d, const SplitViews<const T>& g_in,
                                acc_t<T> eps, index_t n, T* w_row, T* dd_pre_row) {
  using A = acc_t<T>;
  const index_t b = n / d.L, l = n % d.L, R = d.R, M = d.M, W2 = 2 * R * M;
  for (index_t g = 0; g < d.G; ++g) {
    for (int c = 0; c < 4; ++c) {
      const index_t gc = g * 4 + c;
      T* w = w_row + gc * W2;
      const TensorView<const T, 5>& v1 = g_in.w1[c];
      const TensorView<const T, 5>& v2 = g_in.w2[c];
      const T* dy1 = row_ptr(v1, b, l, g);
      const T* dy2 = row_ptr(v2, b, l, g);
      for (index_t ri = 0; ri < R; ++ri) {
        // y = w / s with s = sqrt(mean(w^2) + eps): dw = (dy - y * mean(dy * y)) / s.
        T* w1 = w + ri * M;
        A ss = 0, dot = 0;
        for (index_t m = 0; m < M; ++m) {
          ss += A(w1[m]) * A(w1[m]);
          dot += A(dy1[ri * v1.stride[3] + m * v1.stride[4]]) * A(w1[m]);
        }
        const A inv = A(1) / std::sqrt(ss / A(M) + eps);
        const A mean_dy_y = dot * inv / A(M);
        for (index_t m = 0; m < M; ++m) {
          const A dy = dy1[ri * v1.stride[3] + m * v1.stride[4]];
          const A y = A(w1[m]) * inv;
          w1[m] = static_cast<T>((dy - y * mean_dy_y) * inv);
        }
        T* w2 = w + (R + ri) * M;
        for (index_t m = 0; m < M; ++m) w2[m] = dy2[ri * v2.stride[3] + m * v2.stride[4]];
      }
      const TensorView<const T, 4>& vd = g_in.dd[c];
      const T* ddy = row_ptr(vd, b, l, g);
      T* dp = dd_pre_row + gc * M;
      for (index_t m = 0; m < M; ++m) {
        const A t = std::tanh(A(dp[m]));
        dp[m] = static_cast<T>(A(ddy[m * vd.stride[3]]) * (A(1) - t * t));
      }
    }
  }
}

/// Per (group, split): d(qkw) = hidden^T dw, then d(hidden) = dw qkw^T into r.hidden over the
/// same block of `hidden`, which is no longer needed.
template <class T>
void lowrank_backward(const ProjectionDims& d, const RowMat<T>& hidden, const ParamMatrices<T>& pm,
                      const DynamicWeightProjectionGrads<T>& grads, Recomputed<T>& r) {
  const index_t K = d.K, W2 = 2 * d.R * d.M;
  for (index_t g = 0; g < d.G; ++g)
    for (index_t c = 0; c < 4; ++c) {
      const index_t gc = g * 4 + c;
      OutputMatrix<T, 3> gq(ParamMatrices<T>::qkw_block(grads.qkw, g, c), 1);
      map(gq.mat()).noalias() =
          hidden.middleCols(gc * K, K).transpose() * r.w.middleCols(gc * W2, W2);
      gq.finish();
      r.hidden.middleCols(gc * K, K).noalias() =
          r.w.middleCols(gc * W2, W2) * map(pm.qkw[gc]).transpose();
    }
}

/// d(hidden) becomes d(hidden before GELU), in place.
template <class T>
void gelu_backward(Gelu kind, const RowMat<T>& hpre, RowMat<T>& dhidden) {
  const T* pre = hpre.data();
  T* dh = dhidden.data();
  const index_t total = dhidden.size();
#pragma omp parallel for schedule(static)
  for (index_t i = 0; i < total; ++i) dh[i] = static_cast<T>(dh[i] * gelu_grad<T>(pre[i], kind));
}

/// The gradients of the input projections (dw1, dd) and of x.
template <class T>
void input_backward(const RowBlocks<const T>& xr, const RowMat<T>& dhpre, const RowMat<T>& dddpre,
                    const ParamMatrices<T>& pm, TensorView<T, 3> dx,
                    const DynamicWeightProjectionGrads<T>& grads) {
  OutputMatrix<T, 4> gw(grads.dw1, 1);
  rows_transpose_times(xr, dhpre, gw.mat());
  gw.finish();
  OutputMatrix<T, 3> gd(grads.dd, 1);
  rows_transpose_times(xr, dddpre, gd.mat());
  gd.finish();

  auto dx_rows = [&](auto&& dst, index_t r0, index_t rows) {
    dst.noalias() = dhpre.middleRows(r0, rows) * map(pm.dw1).transpose();
    dst.noalias() += dddpre.middleRows(r0, rows) * map(pm.dd).transpose();
  };
  if (auto blocks = as_row_blocks(dx)) {
    for (std::size_t i = 0; i < blocks->blocks.size(); ++i) {
      MutMap<T> dst = map(blocks->blocks[i]);
      dx_rows(dst, static_cast<index_t>(i) * blocks->block_rows, blocks->blocks[i].rows);
    }
  } else {
    OutputMatrix<T, 3> o(dx, 2);
    MutMap<T> dst = map(o.mat());
    dx_rows(dst, 0, dhpre.rows());
    o.finish();
  }
}

/// `kept`: the forward's activations (validated to match d), or null to recompute them.
template <class T>
void backward(const ProjectionConfig& cfg, const ProjectionDims& d, TensorView<const T, 3> x,
              const DynamicWeightProjection<T>& p, const DynamicWeights<const T>& dout,
              TensorView<T, 3> dx, const DynamicWeightProjectionGrads<T>& grads,
              const Recomputed<T>* kept = nullptr) {
  ThreadScope threads(cfg.num_threads);
  RowMat<T> x_store;
  const RowBlocks<const T> xr = input_rows(x, x_store);
  const ParamMatrices<T> pm(p, d);
  // r.w and r.ddpre turn into their gradients in place, and r.hidden into d(hidden): copies of
  // kept activations, which stay as they are.
  Recomputed<T> r;
  if (kept) {
    r.w = kept->w;
    r.ddpre = kept->ddpre;
    r.hidden.resize(kept->hidden.rows(), kept->hidden.cols());
  } else {
    recompute(cfg, d, xr, pm, r, /*keep_hpre=*/true);
  }
  const RowMat<T>& hpre = kept ? kept->hpre : r.hpre;
  const RowMat<T>& hidden = kept ? kept->hidden : r.hidden;

  const SplitViews<const T> g_in = by_split(dout);
  const acc_t<T> eps = static_cast<acc_t<T>>(cfg.eps);
  const index_t N = d.rows();
#pragma omp parallel for schedule(static)
  for (index_t n = 0; n < N; ++n)
    norm_and_tanh_backward_row(d, g_in, eps, n, r.w.data() + n * r.w.cols(),
                               r.ddpre.data() + n * r.ddpre.cols());
  lowrank_backward(d, hidden, pm, grads, r);
  gelu_backward(cfg.gelu, hpre, r.hidden);
  input_backward(xr, r.hidden, r.ddpre, pm, dx, grads);
}

}  // namespace dcmha::detail::projection

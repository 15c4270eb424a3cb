#pragma once
// The dynamic weight projection on bf16 / fp16 storage: the float kernels on widened copies of x,
// the parameters and the upstream gradients, each result rounded once when written to the
// caller's tensors. A narrow result is therefore the float projection's result on contiguous
// tensors of the same values, rounded once: the contract of attention's narrow storage
// (config.hpp). Eigen's GEMM on narrow
// scalars would round after every multiply-add instead. The copies are O(B·L·E + parameters)
// against the products' O(B·L·E·G·4·(K + M)), and live for one call.
#include <vector>

#include "../config.hpp"
#include "../cpu/convert.hpp"
#include "../tensor.hpp"
#include "kernels.hpp"

namespace dcmha::detail::projection {

/// Calls f(src_offset, dst_offset) for the first element of every innermost row of two views of
/// one shape.
template <int N, class F>
void for_each_row(const Shape<N>& shape, const Shape<N>& src_stride, const Shape<N>& dst_stride,
                  F&& f) {
  index_t rows = 1;
  for (int d = 0; d + 1 < N; ++d) rows *= shape[d];
  if (shape[N - 1] == 0) return;
  Shape<N> idx{};
  for (index_t r = 0; r < rows; ++r) {
    index_t s = 0, t = 0;
    for (int d = 0; d + 1 < N; ++d) s += idx[d] * src_stride[d], t += idx[d] * dst_stride[d];
    f(s, t);
    for (int d = N - 2; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

/// dst = Dst(src) elementwise, any strides: the vector conversions where rows are unit-stride.
template <class Src, class Dst, int N>
void convert_view(TensorView<const Src, N> src, TensorView<Dst, N> dst) {
  const index_t n = src.shape[N - 1], ss = src.stride[N - 1], ds = dst.stride[N - 1];
  for_each_row<N>(src.shape, src.stride, dst.stride, [&](index_t s, index_t t) {
    const Src* from = src.data + s;
    Dst* to = dst.data + t;
    if (ss == 1 && ds == 1) {
      if constexpr (std::is_same_v<Dst, float>)
        cpu::widen_row(from, to, n, 1.0f);
      else
        cpu::narrow_row(from, to, n);
    } else {
      for (index_t e = 0; e < n; ++e)
        to[e * ds] = static_cast<Dst>(static_cast<float>(from[e * ss]));
    }
  });
}

/// A contiguous float tensor of a caller view's shape (empty where the view is): the widened copy
/// of an input, or the float result that is then rounded into an output.
template <int N>
struct FloatTensor {
  std::vector<float> data;
  TensorView<float, N> view;

  template <class S>
  explicit FloatTensor(TensorView<S, N> like) {
    if (like.empty()) return;
    data.resize(static_cast<std::size_t>(like.numel()));
    view = dcmha::view<N>(data.data(), like.shape);
  }
  template <class S>
  static FloatTensor widened(TensorView<const S, N> src) {
    FloatTensor t(src);
    if (!src.empty()) convert_view<S, float, N>(src, t.view);
    return t;
  }
  template <class S>
  void round_into(TensorView<S, N> dst) const {
    if (!dst.empty()) convert_view<float, S, N>(view, dst);
  }
};

/// The twelve dynamic tensors in float, shaped as the caller's; widened from them or rounded into
/// them.
struct FloatDynamicWeights {
  std::vector<FloatTensor<5>> w;   // qw1, qw2, kw1, kw2 of pre, then of post
  std::vector<FloatTensor<4>> dd;  // qdd, kdd of pre, then of post

  template <class U>
  explicit FloatDynamicWeights(const DynamicWeights<U>& like, bool widen) {
    for (const DynamicWeightsSide<U>* s : {&like.pre, &like.post}) {
      for (const TensorView<U, 5>* v : {&s->qw1, &s->qw2, &s->kw1, &s->kw2})
        w.push_back(widen ? FloatTensor<5>::widened<std::remove_const_t<U>>(*v)
                          : FloatTensor<5>(*v));
      for (const TensorView<U, 4>* v : {&s->qdd, &s->kdd})
        dd.push_back(widen ? FloatTensor<4>::widened<std::remove_const_t<U>>(*v)
                           : FloatTensor<4>(*v));
    }
  }
  template <class U = float>
  DynamicWeights<U> views() const {
    auto side = [&](int i) {
      return DynamicWeightsSide<U>{w[4 * i].view,     w[4 * i + 1].view, w[4 * i + 2].view,
                                   w[4 * i + 3].view, dd[2 * i].view,    dd[2 * i + 1].view};
    };
    return {side(0), side(1)};
  }
  template <class S>
  void round_into(const DynamicWeights<S>& out) const {
    const DynamicWeights<S>* o = &out;
    const DynamicWeightsSide<S>* sides[] = {&o->pre, &o->post};
    for (int i = 0; i < 2; ++i) {
      const TensorView<S, 5>* ws[] = {&sides[i]->qw1, &sides[i]->qw2, &sides[i]->kw1,
                                      &sides[i]->kw2};
      for (int j = 0; j < 4; ++j) w[4 * i + j].round_into(*ws[j]);
      dd[2 * i].round_into(sides[i]->qdd);
      dd[2 * i + 1].round_into(sides[i]->kdd);
    }
  }
};

/// The projection's parameters widened to float.
struct FloatParameters {
  FloatTensor<4> dw1;
  FloatTensor<5> qkw;
  FloatTensor<3> dd;

  template <class S>
  explicit FloatParameters(const DynamicWeightProjection<S>& p)
      : dw1(FloatTensor<4>::widened<S>(p.dw1)),
        qkw(FloatTensor<5>::widened<S>(p.qkw)),
        dd(FloatTensor<3>::widened<S>(p.dd)) {}
  DynamicWeightProjection<float> views() const { return {dw1.view, qkw.view, dd.view}; }
};

template <class S>
void forward_narrow(const ProjectionConfig& cfg, const ProjectionDims& d, TensorView<const S, 3> x,
                    const DynamicWeightProjection<S>& p, const DynamicWeights<S>& out,
                    Recomputed<float>* keep) {
  const FloatTensor<3> x32 = FloatTensor<3>::widened<S>(x);
  const FloatParameters p32(p);
  FloatDynamicWeights out32(out, /*widen=*/false);
  forward<float>(cfg, d, x32.view, p32.views(), out32.views(), keep);
  out32.round_into(out);
}

template <class S>
void backward_narrow(const ProjectionConfig& cfg, const ProjectionDims& d, TensorView<const S, 3> x,
                     const DynamicWeightProjection<S>& p, const DynamicWeights<const S>& dout,
                     TensorView<S, 3> dx, const DynamicWeightProjectionGrads<S>& grads,
                     const Recomputed<float>* kept) {
  const FloatTensor<3> x32 = FloatTensor<3>::widened<S>(x);
  const FloatParameters p32(p);
  const FloatDynamicWeights dout32(dout, /*widen=*/true);
  FloatTensor<3> dx32(dx);
  FloatTensor<4> gdw1(grads.dw1);
  FloatTensor<5> gqkw(grads.qkw);
  FloatTensor<3> gdd(grads.dd);
  backward<float>(cfg, d, x32.view, p32.views(), dout32.views<const float>(), dx32.view,
                  {gdw1.view, gqkw.view, gdd.view}, kept);
  dx32.round_into(dx);
  gdw1.round_into(grads.dw1);
  gqkw.round_into(grads.qkw);
  gdd.round_into(grads.dd);
}

}  // namespace dcmha::detail::projection

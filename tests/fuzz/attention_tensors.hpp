#pragma once
// An attention case in the library's types: every tensor in its own buffer and layout, and the
// arguments of one forward or backward call as plain views (which the breaks then edit).
#include <array>
#include <vector>

#include "dcmha/dcmha.hpp"
#include "fuzz_case.hpp"
#include "reference/reference.hpp"
#include "strided.hpp"
#include "values.hpp"

namespace dcmha::fuzz {

/// One compose side's seven tensors (empty where the term is off).
template <class T>
struct ComposeBuffers {
  Strided<T, 3> w;
  Strided<T, 5> qw1, qw2, kw1, kw2;
  Strided<T, 4> qdd, kdd;
};

/// Shapes of one side's compose tensors.
struct ComposeShapes {
  Shape<3> w;
  Shape<5> qw, kw;
  Shape<4> qdd, kdd;
  ComposeShapes(const SideSpec& s, index_t B, index_t T, index_t S, index_t G, index_t M)
      : w{G, M, M}, qw{B, T, G, s.Rq, M}, kw{B, S, G, s.Rk, M}, qdd{B, T, G, M}, kdd{B, S, G, M} {}
};

template <class T>
ComposeBuffers<T> compose_buffers(const SideSpec& s, const ComposeShapes& sh, Rng& rng,
                                  std::uint8_t kind) {
  ComposeBuffers<T> c;
  if (s.static_w) c.w = Strided<T, 3>(sh.w, seeded_layout<3>(rng, kind));
  if (s.query_wise) {
    c.qw1 = Strided<T, 5>(sh.qw, seeded_layout<5>(rng, kind));
    c.qw2 = Strided<T, 5>(sh.qw, seeded_layout<5>(rng, kind));
    c.qdd = Strided<T, 4>(sh.qdd, seeded_layout<4>(rng, kind));
  }
  if (s.key_wise) {
    c.kw1 = Strided<T, 5>(sh.kw, seeded_layout<5>(rng, kind));
    c.kw2 = Strided<T, 5>(sh.kw, seeded_layout<5>(rng, kind));
    c.kdd = Strided<T, 4>(sh.kdd, seeded_layout<4>(rng, kind));
  }
  return c;
}

template <class T>
void set_values(ComposeBuffers<T>& b, const reference::ComposeSide& c) {
  if (c.static_w) b.w.set(c.w);
  if (c.query_wise) b.qw1.set(c.qw1), b.qw2.set(c.qw2), b.qdd.set(c.qdd);
  if (c.key_wise) b.kw1.set(c.kw1), b.kw2.set(c.kw2), b.kdd.set(c.kdd);
}

/// Calls f(name, buffer) for every given tensor of a side (any rank).
template <class T, class F>
void for_each_buffer(const ComposeBuffers<T>& b, F&& f) {
  if (!b.w.empty()) f("w", b.w);
  if (!b.qw1.empty()) f("qw1", b.qw1), f("qw2", b.qw2), f("qdd", b.qdd);
  if (!b.kw1.empty()) f("kw1", b.kw1), f("kw2", b.kw2), f("kdd", b.kdd);
}

template <class T>
ComposeTerms<T> terms_of(const SideSpec& s, const ComposeBuffers<T>& b) {
  ComposeTerms<T> t;
  t.static_w = s.static_w;
  t.query_wise = s.query_wise;
  t.key_wise = s.key_wise;
  t.w = b.w.cview();
  t.qw1 = b.qw1.cview(), t.qw2 = b.qw2.cview(), t.qdd = b.qdd.cview();
  t.kw1 = b.kw1.cview(), t.kw2 = b.kw2.cview(), t.kdd = b.kdd.cview();
  return t;
}

template <class T>
ComposeTermGrads<T> grads_of(const ComposeBuffers<T>& b) {
  ComposeTermGrads<T> g;
  g.w = b.w.view();
  g.qw1 = b.qw1.view(), g.qw2 = b.qw2.view(), g.qdd = b.qdd.view();
  g.kw1 = b.kw1.view(), g.kw2 = b.kw2.view(), g.kdd = b.kdd.view();
  return g;
}

template <class T>
struct ForwardCall {
  AttentionConfig cfg;
  TensorView<const T, 4> q, k, v;
  TensorView<T, 4> out;
  TensorView<acc_t<T>, 3> lse;
  ComposeWeights<T> compose;

  void run(Workspace* ws) const {
    if (ws)
      dcmha::forward(cfg, q, k, v, out, lse, compose, *ws);
    else
      dcmha::forward(cfg, q, k, v, out, lse, compose);
  }
};

/// The backward's two call shapes: without the forward's output (`out` empty), or given it.
template <class T>
struct BackwardCall {
  AttentionConfig cfg;
  TensorView<const T, 4> q, k, v;
  TensorView<const acc_t<T>, 3> lse;
  TensorView<const T, 4> dout;
  TensorView<T, 4> dq, dk, dv;
  ComposeWeights<T> compose;
  ComposeGrads<T> dcompose;
  TensorView<const T, 4> out;

  void run(Workspace* ws) const {
    if (!out.empty() && ws)
      dcmha::backward(cfg, q, k, v, out, lse, dout, dq, dk, dv, compose, dcompose, *ws);
    else if (!out.empty())
      dcmha::backward(cfg, q, k, v, out, lse, dout, dq, dk, dv, compose, dcompose);
    else if (ws)
      dcmha::backward(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose, *ws);
    else
      dcmha::backward(cfg, q, k, v, lse, dout, dq, dk, dv, compose, dcompose);
  }
};

template <class T>
class AttentionTensors {
 public:
  AttentionTensors(const AttentionCase& a, const reference::Problem& p,
                   const std::vector<double>& dout, std::uint64_t seed)
      : a_(a), qlen_(a.qlen.begin(), a.qlen.end()), klen_(a.klen.begin(), a.klen.end()) {
    const Shape<4> shapes[kActs] = {{a.B, a.H, a.T, a.D},   {a.B, a.Hk, a.S, a.D},
                                    {a.B, a.Hk, a.S, a.Dv}, {a.B, a.H, a.T, a.Dv},
                                    {a.B, a.H, a.T, a.Dv},  {a.B, a.H, a.T, a.D},
                                    {a.B, a.Hk, a.S, a.D},  {a.B, a.Hk, a.S, a.Dv}};
    for (int i = 0; i < kActs; ++i) act[size_t(i)] = Strided<T, 4>(shapes[i], a.act[size_t(i)]);
    if (a.with_lse) lse = Strided<acc_t<T>, 3>({a.B, a.H, a.T}, a.lse);
    act[kQ].set(p.q);
    act[kK].set(p.k);
    act[kV].set(p.v);
    if (!dout.empty()) act[kDout].set(dout);
    Rng rng(seed ^ 0x1a7e5ull);
    const SideSpec* specs[2] = {&a.pre, &a.post};
    const reference::ComposeSide* values[2] = {&p.pre, &p.post};
    for (int s = 0; s < 2; ++s) {
      const ComposeShapes sh(*specs[s], a.B, a.T, a.S, a.G, a.H / a.G);
      side[s] = compose_buffers<T>(*specs[s], sh, rng, a.compose_layout);
      grad[s] = compose_buffers<T>(*specs[s], sh, rng, a.compose_layout);
      set_values(side[s], *values[s]);
    }
  }

  const AttentionCase& spec() const { return a_; }

  AttentionConfig config(int threads) const {
    AttentionConfig c;
    c.mask = a_.causal ? Mask::causal : Mask::full;
    c.scale = a_.scale;
    c.window = a_.window;
    c.num_threads = threads;
    if (!qlen_.empty()) c.query_lengths = view<1>(qlen_.data(), {a_.B});
    if (!klen_.empty()) c.key_lengths = view<1>(klen_.data(), {a_.B});
    return c;
  }
  ComposeWeights<T> compose() const {
    return {terms_of(a_.pre, side[0]), terms_of(a_.post, side[1])};
  }
  ComposeGrads<T> dcompose() const { return {grads_of(grad[0]), grads_of(grad[1])}; }

  ForwardCall<T> forward_call(int threads) const {
    return {config(threads),  act[kQ].cview(), act[kK].cview(), act[kV].cview(),
            act[kOut].view(), lse.view(),      compose()};
  }
  BackwardCall<T> backward_call(int threads) const {
    const TensorView<const T, 4> out = a_.with_out ? act[kOut].cview() : TensorView<const T, 4>{};
    return {config(threads), act[kQ].cview(),    act[kK].cview(), act[kV].cview(),
            lse.view(),      act[kDout].cview(), act[kDq].view(), act[kDk].view(),
            act[kDv].view(), compose(),          dcompose(),      out};
  }

  /// The gradients written, in the reference's layout (switched-on terms only).
  reference::Gradients gradients(const reference::Problem& p) const {
    reference::Gradients g;
    g.dq = act[kDq].get();
    g.dk = act[kDk].get();
    g.dv = act[kDv].get();
    g.dpre = reference::detail::zeros_like(p.pre);
    g.dpost = reference::detail::zeros_like(p.post);
    reference::ComposeSide* out[2] = {&g.dpre, &g.dpost};
    for (int s = 0; s < 2; ++s) {
      if (!grad[s].w.empty()) out[s]->w = grad[s].w.get();
      if (!grad[s].qw1.empty())
        out[s]->qw1 = grad[s].qw1.get(), out[s]->qw2 = grad[s].qw2.get(),
        out[s]->qdd = grad[s].qdd.get();
      if (!grad[s].kw1.empty())
        out[s]->kw1 = grad[s].kw1.get(), out[s]->kw2 = grad[s].kw2.get(),
        out[s]->kdd = grad[s].kdd.get();
    }
    return g;
  }

  /// Bytes of every output a call may write (for rejected calls: all must stay as they were).
  std::vector<std::vector<unsigned char>> output_bytes(bool backward) const {
    std::vector<std::vector<unsigned char>> all;
    if (!backward) {
      all.push_back(act[kOut].bytes());
      if (!lse.empty()) all.push_back(lse.bytes());
      return all;
    }
    for (int i : {kDq, kDk, kDv}) all.push_back(act[size_t(i)].bytes());
    for (const auto& g : grad)
      for_each_buffer(g, [&](const char*, const auto& b) { all.push_back(b.bytes()); });
    return all;
  }

  std::array<Strided<T, 4>, kActs> act;
  Strided<acc_t<T>, 3> lse;
  ComposeBuffers<T> side[2], grad[2];

 private:
  const AttentionCase& a_;
  std::vector<index_t> qlen_, klen_;
};

}  // namespace dcmha::fuzz

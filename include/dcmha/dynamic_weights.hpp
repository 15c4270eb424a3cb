#pragma once
// The dynamic weight projection (spec section 2): hidden state x -> the twelve dynamic compose
// tensors (pre/post x query/key x {w1, w2, dd}), with the official DCFormer parameter layout.
#include <cstddef>
#include <memory>
#include <vector>

#include "compose_weights.hpp"
#include "config.hpp"
#include "error.hpp"
#include "tensor.hpp"

namespace dcmha {

enum class Gelu {
  erf,   ///< exact GELU, official PyTorch inference
  tanh,  ///< tanh approximation, JAX nn.gelu default used in official training
};

struct ProjectionConfig {
  Gelu gelu = Gelu::erf;
  /// epsilon of the RMS norm of w1 over the M heads
  double eps = 1e-6;
  /// OpenMP threads for this call; 0 means omp_get_max_threads().
  int num_threads = 0;
};

/// Parameters, official layout (`layers.N.attention.dyn_w_proj.*`):
///   dw1 (E, G, 4, K), qkw (G, 4, K, 2R, M), dd (E, G, 4M).
/// Split c = 0..3 is pre/query, pre/key, post/query, post/key.
template <class T>
struct DynamicWeightProjection {
  TensorView<const T, 4> dw1;
  TensorView<const T, 5> qkw;
  TensorView<const T, 3> dd;
};

template <class T>
struct DynamicWeightProjectionGrads {
  TensorView<T, 4> dw1;
  TensorView<T, 5> qkw;
  TensorView<T, 3> dd;
};

/// One side's dynamic tensors over positions l of the input: w1/w2 (B, L, G, R, M), dd (B, L, G,
/// M). Use T = const float for read-only views (e.g. upstream gradients).
template <class T>
struct DynamicWeightsSide {
  TensorView<T, 5> qw1, qw2, kw1, kw2;
  TensorView<T, 4> qdd, kdd;
};

template <class T>
struct DynamicWeights {
  DynamicWeightsSide<T> pre, post;
};

/// Owns the twelve dynamic tensors of one layer (or their gradients) in one allocation and hands
/// out the views: w1, w2 (B, L, G, R, M) and dd (B, L, G, M) for pre/post x query/key, with
/// L = T for the query-wise and S for the key-wise terms (one L: self-attention).
template <class T>
struct DynamicWeightsStorage {
  index_t B = 0, L = 0, G = 0, R = 0, M = 0;
  std::vector<T> data;

  DynamicWeightsStorage() = default;
  DynamicWeightsStorage(index_t B_, index_t L_, index_t G_, index_t R_, index_t M_)
      : B(B_),
        L(L_),
        G(G_),
        R(R_),
        M(M_),
        data(static_cast<std::size_t>(2 * 2 * (2 * B * L * G * R * M + B * L * G * M))) {}

  DynamicWeights<T> views() {
    T* p = data.data();
    auto w = [&] {
      auto v = view<5>(p, {B, L, G, R, M});
      p += v.numel();
      return v;
    };
    auto dd = [&] {
      auto v = view<4>(p, {B, L, G, M});
      p += v.numel();
      return v;
    };
    DynamicWeights<T> dw;
    for (DynamicWeightsSide<T>* s : {&dw.pre, &dw.post}) {
      s->qw1 = w();
      s->qw2 = w();
      s->qdd = dd();
      s->kw1 = w();
      s->kw2 = w();
      s->kdd = dd();
    }
    return dw;
  }
};

namespace detail {
/// The six low-rank and gate views of one side, from the projection's outputs (or gradients).
template <class Terms, class Side>
void set_side_views(Terms& c, const Side& s) {
  c.qw1 = s.qw1;
  c.qw2 = s.qw2;
  c.qdd = s.qdd;
  c.kw1 = s.kw1;
  c.kw2 = s.kw2;
  c.kdd = s.kdd;
}
}  // namespace detail

/// Self-attention compose weights from a projection's output (queries and keys are the same
/// positions): query- and key-wise terms on, static terms on where a W (G, M, M) is given.
template <class U, class T = std::remove_const_t<U>>
inline ComposeWeights<T> compose_weights(const DynamicWeights<U>& dw,
                                         TensorView<const T, 3> pre_w = {},
                                         TensorView<const T, 3> post_w = {}) {
  auto side = [](const DynamicWeightsSide<U>& s, TensorView<const T, 3> w) {
    ComposeTerms<T> c;
    c.static_w = !w.empty();
    c.query_wise = c.key_wise = true;
    c.w = w;
    detail::set_side_views(c, s);
    return c;
  };
  return {side(dw.pre, pre_w), side(dw.post, post_w)};
}

/// The matching gradient views: attention backward writes d(compose inputs) straight into the
/// buffers that dynamic_weights_backward then reads as its upstream gradients.
template <class T>
inline ComposeGrads<T> compose_grads(const DynamicWeights<T>& g, TensorView<T, 3> pre_w = {},
                                     TensorView<T, 3> post_w = {}) {
  auto side = [](const DynamicWeightsSide<T>& s, TensorView<T, 3> w) {
    ComposeTermGrads<T> c;
    c.w = w;
    detail::set_side_views(c, s);
    return c;
  };
  return {side(g.pre, pre_w), side(g.post, post_w)};
}

namespace detail::projection {
template <class T>
struct Recomputed;
struct ActivationsAccess;
}  // namespace detail::projection

/// What dynamic_weights_forward can keep for dynamic_weights_backward: the projection's
/// intermediate activations (the hidden layer before and after GELU, the raw w before the RMS norm,
/// dd before tanh), (2·4K + 4·2R·M + 4M)·G values per position, about two fifths of x's size at
/// DCFormer-6.9B's shapes. With them the backward skips recomputing the forward's two large
/// products (x dw1 and x dd), a third of its work. Pass the same x and parameters to both calls;
/// the backward only reads the activations, and the next forward overwrites them.
template <class T>
class ProjectionActivations {
 public:
  ProjectionActivations();
  ~ProjectionActivations();
  ProjectionActivations(ProjectionActivations&&) noexcept;
  ProjectionActivations& operator=(ProjectionActivations&&) noexcept;
  ProjectionActivations(const ProjectionActivations&) = delete;
  ProjectionActivations& operator=(const ProjectionActivations&) = delete;

  /// Bytes held (0 before the first forward and after release()).
  std::size_t bytes() const;
  /// Frees the memory; a backward given these activations then refuses them until a forward
  /// fills them again.
  void release();

 private:
  friend struct detail::projection::ActivationsAccess;
  // In the arithmetic type: bf16 / fp16 storage keeps float activations.
  std::unique_ptr<detail::projection::Recomputed<acc_t<T>>> r_;  // null: empty
};

}  // namespace dcmha

#include "projection/dynamic_weights_impl.hpp"

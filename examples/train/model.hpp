#pragma once
// The model train_recall trains, forward and backward, in float or double:
//
//   h0     = embedding of each position's tokens (summed)           (B, T, E)
//   h(l+1) = h(l) + layer_l(h(l))                                   DCFormer attention layers
//   logits = h(L)[query position] headᵀ + bias                      (B, S), the query only
//   loss   = mean over the batch of cross-entropy(logits, answer)
//
// The layers are ../dcformer_attention/dcformer_layer.hpp with RoPE; ModelConfig::compose
// switches all of them between DCMHA and plain multi-head attention, and nothing else changes.
#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "dcformer_layer.hpp"
#include "recall_task.hpp"

namespace train {

using dcmha::index_t;

struct ModelConfig {
  index_t vocab = 0;    ///< embedding rows (recall::TaskConfig::vocab)
  index_t classes = 0;  ///< outputs of the head (recall::TaskConfig::symbols)
  index_t E = 64, H = 4, D = 16, layers = 2;
  bool compose = true;  ///< DCMHA (true) or MHA (false) in every layer
  int num_threads = 0;  ///< the layers' OpenMP threads; 0: all

  dcformer::LayerConfig layer() const {
    dcformer::LayerConfig c;
    c.E = E;
    c.H = c.Hk = H;
    c.D = D;
    c.compose = compose;  // G = 1, R = 2, K = 4M: the official DCFormer projection
    c.num_threads = num_threads;
    return c;
  }
};

/// One parameter tensor, its gradient beside it.
template <class T>
struct Param {
  std::string name;
  std::vector<T> value, grad;
};

template <class T>
struct LayerParams {
  Param<T> wqkv, wo, dw1, qkw, dd;  // dw1, qkw, dd: DCMHA only (empty for MHA)
};

template <class T>
struct Model {
  ModelConfig cfg;
  Param<T> embedding;  // (vocab, E)
  std::vector<LayerParams<T>> layers;
  Param<T> head_w, head_b;  // (classes, E), (classes)
  dcformer::RopeTables<T> rope;
};

/// What forward keeps for backward, and the backward's scratch; one per batch shape.
template <class T>
struct Activations {
  std::vector<std::vector<T>> hidden;  // layers + 1 residual states h(l), (B, T, E)
  std::vector<T> layer_out, d_hidden, d_x;
  std::vector<dcformer::LayerCache<T>> caches;
  std::vector<T> probs;  // (B, classes): softmax at the query positions
};

struct Outcome {
  double loss = 0.0;    // mean cross-entropy
  index_t correct = 0;  // sequences whose argmax is the answer
};

template <class T>
using RowMatrix = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using MatrixMap = Eigen::Map<RowMatrix<T>>;
template <class T>
using ConstMatrixMap = Eigen::Map<const RowMatrix<T>>;
/// The query rows (t = T - 1) of a (B, T, E) buffer, as a B x E matrix.
template <class T>
using QueryRows = Eigen::Map<RowMatrix<T>, 0, Eigen::OuterStride<>>;

template <class T>
Param<T> make_param(const std::string& name, index_t size, double stddev, std::mt19937& rng) {
  // Drawn in double, so that float and double models from one seed hold the same values;
  // stddev 0: zeros.
  Param<T> p{name, std::vector<T>(static_cast<std::size_t>(size), T(0)), {}};
  if (stddev > 0.0) {
    std::normal_distribution<double> dist(0.0, stddev);
    for (T& v : p.value) v = static_cast<T>(dist(rng));
  }
  p.grad.assign(p.value.size(), T(0));
  return p;
}

/// Official DCFormer init scales for the projection (spec 2): at first the dynamic weights are
/// tiny and DCMHA behaves like MHA; training grows them where composing heads pays off.
template <class T>
void init_projection(const dcformer::LayerConfig& c, const std::string& prefix, LayerParams<T>& p,
                     std::mt19937& rng) {
  const index_t E = c.E, H = c.H, G = c.G, R = c.R, M = c.M(), K = c.hidden();
  p.dw1 = make_param<T>(prefix + "dw1", E * G * 4 * K, std::sqrt(2.0 / double(E + K)), rng);
  p.qkw = make_param<T>(prefix + "qkw", G * 4 * K * 2 * R * M,
                        0.02 / (std::sqrt(2.0 * double(H * R)) * double(H + R)), rng);
  p.dd = make_param<T>(prefix + "dd", E * G * 4 * M, 0.05 * std::sqrt(2.0 / double(H + E)), rng);
}

/// Weights shared by MHA and DCMHA come from `seed` alone and the projection from seed + 1, so
/// the two models start from the same embedding, attention and head weights.
template <class T>
Model<T> make_model(const ModelConfig& cfg, index_t max_length, unsigned seed) {
  std::mt19937 shared(seed), projection(seed + 1);
  Model<T> m;
  m.cfg = cfg;
  const dcformer::LayerConfig lc = cfg.layer();
  const double inv_sqrt_e = 1.0 / std::sqrt(double(cfg.E));
  m.embedding = make_param<T>("embedding", cfg.vocab * cfg.E, 1.0, shared);
  m.head_w = make_param<T>("head_w", cfg.classes * cfg.E, inv_sqrt_e, shared);
  m.head_b = make_param<T>("head_b", cfg.classes, 0.0, shared);
  for (index_t l = 0; l < cfg.layers; ++l) {
    const std::string prefix = "layer" + std::to_string(l) + ".";
    LayerParams<T> p;
    p.wqkv = make_param<T>(prefix + "wqkv", lc.qkv_width() * cfg.E, inv_sqrt_e, shared);
    // Scaled down with depth, so that the residual stream stays near unit scale at init.
    p.wo = make_param<T>(prefix + "wo", cfg.E * cfg.H * cfg.D,
                         1.0 / std::sqrt(double(cfg.H * cfg.D * cfg.layers)), shared);
    if (cfg.compose) init_projection(lc, prefix, p, projection);
    m.layers.push_back(std::move(p));
  }
  m.rope = dcformer::make_rope_tables<T>(max_length, cfg.D);
  return m;
}

/// Every trained tensor (the projection's with DCMHA only).
template <class T>
std::vector<Param<T>*> parameters(Model<T>& m) {
  std::vector<Param<T>*> all{&m.embedding, &m.head_w, &m.head_b};
  for (LayerParams<T>& p : m.layers) {
    all.push_back(&p.wqkv);
    all.push_back(&p.wo);
    if (m.cfg.compose) all.insert(all.end(), {&p.dw1, &p.qkw, &p.dd});
  }
  return all;
}

template <class T>
dcformer::LayerWeights<T> layer_weights(const dcformer::LayerConfig& c, const LayerParams<T>& p) {
  dcformer::LayerWeights<T> w;
  w.wqkv = dcmha::view<2>(p.wqkv.value.data(), {c.qkv_width(), c.E});
  w.wo = dcmha::view<2>(p.wo.value.data(), {c.E, c.H * c.D});
  if (!c.compose) return w;
  const index_t M = c.M(), K = c.hidden();
  w.dw1 = dcmha::view<4>(p.dw1.value.data(), {c.E, c.G, 4, K});
  w.qkw = dcmha::view<5>(p.qkw.value.data(), {c.G, 4, K, 2 * c.R, M});
  w.dd = dcmha::view<3>(p.dd.value.data(), {c.E, c.G, 4 * M});
  return w;
}

template <class T>
dcformer::LayerGrads<T> layer_grads(const dcformer::LayerConfig& c, LayerParams<T>& p) {
  dcformer::LayerGrads<T> g;
  g.wqkv = dcmha::view<2>(p.wqkv.grad.data(), {c.qkv_width(), c.E});
  g.wo = dcmha::view<2>(p.wo.grad.data(), {c.E, c.H * c.D});
  if (!c.compose) return g;
  const index_t M = c.M(), K = c.hidden();
  g.dw1 = dcmha::view<4>(p.dw1.grad.data(), {c.E, c.G, 4, K});
  g.qkw = dcmha::view<5>(p.qkw.grad.data(), {c.G, 4, K, 2 * c.R, M});
  g.dd = dcmha::view<3>(p.dd.grad.data(), {c.E, c.G, 4 * M});
  return g;
}

template <class T>
void resize_activations(const ModelConfig& cfg, const recall::Batch& batch, Activations<T>& a) {
  const auto size = static_cast<std::size_t>(batch.B * batch.T * cfg.E);
  a.hidden.resize(static_cast<std::size_t>(cfg.layers + 1));
  for (auto& h : a.hidden) h.resize(size);
  a.layer_out.resize(size);
  a.d_hidden.resize(size);
  a.d_x.resize(size);
  a.caches.resize(static_cast<std::size_t>(cfg.layers));
  a.probs.resize(static_cast<std::size_t>(batch.B * cfg.classes));
}

/// h0: each position's token embeddings, summed.
template <class T>
void embed(const Model<T>& m, const recall::Batch& batch, T* h0) {
  const index_t E = m.cfg.E, positions = batch.B * batch.T;
  std::fill(h0, h0 + positions * E, T(0));
  for (index_t p = 0; p < positions; ++p)
    for (index_t slot = 0; slot < 2; ++slot) {
      const int token = batch.tokens[static_cast<std::size_t>(2 * p + slot)];
      if (token < 0) continue;
      const T* row = &m.embedding.value[static_cast<std::size_t>(token * E)];
      for (index_t e = 0; e < E; ++e) h0[p * E + e] += row[e];
    }
}

/// The embedding's gradient: each position's d(h0) added to the rows of its tokens.
template <class T>
void embed_backward(Model<T>& m, const recall::Batch& batch, const T* d_h0) {
  const index_t E = m.cfg.E, positions = batch.B * batch.T;
  std::fill(m.embedding.grad.begin(), m.embedding.grad.end(), T(0));
  for (index_t p = 0; p < positions; ++p)
    for (index_t slot = 0; slot < 2; ++slot) {
      const int token = batch.tokens[static_cast<std::size_t>(2 * p + slot)];
      if (token < 0) continue;
      T* row = &m.embedding.grad[static_cast<std::size_t>(token * E)];
      for (index_t e = 0; e < E; ++e) row[e] += d_h0[p * E + e];
    }
}

template <class T>
QueryRows<T> query_rows(T* h, index_t B, index_t T_, index_t E) {
  return QueryRows<T>(h + (T_ - 1) * E, B, E, Eigen::OuterStride<>(T_ * E));
}

/// Softmax of the head's logits at the query positions, into a.probs; the loss and accuracy.
template <class T>
Outcome head_forward(const Model<T>& m, const recall::Batch& batch, Activations<T>& a) {
  const index_t S = m.cfg.classes, E = m.cfg.E;
  MatrixMap<T> probs(a.probs.data(), batch.B, S);
  probs.noalias() = query_rows(a.hidden.back().data(), batch.B, batch.T, E) *
                    ConstMatrixMap<T>(m.head_w.value.data(), S, E).transpose();
  Outcome out;
  for (index_t b = 0; b < batch.B; ++b) {
    auto row = probs.row(b);
    row += Eigen::Map<const Eigen::Matrix<T, 1, Eigen::Dynamic>>(m.head_b.value.data(), S);
    index_t best = 0;
    const T top = row.maxCoeff(&best);
    row = (row.array() - top).exp().matrix();  // shifted by the maximum: no overflow
    row /= row.sum();
    const int answer = batch.answers[static_cast<std::size_t>(b)];
    out.loss -= std::log(std::max(double(row(answer)), 1e-300));
    out.correct += best == answer ? 1 : 0;
  }
  out.loss /= double(batch.B);
  return out;
}

/// d(loss)/d(logits) = (softmax - onehot) / B; into the head's gradients and d(h(L)), which is
/// zero except at the query positions.
template <class T>
void head_backward(Model<T>& m, const recall::Batch& batch, Activations<T>& a) {
  const index_t S = m.cfg.classes, E = m.cfg.E;
  MatrixMap<T> d_logits(a.probs.data(), batch.B, S);  // the softmax is not needed after this
  for (index_t b = 0; b < batch.B; ++b)
    d_logits(b, batch.answers[static_cast<std::size_t>(b)]) -= 1;
  d_logits /= T(batch.B);
  const auto h = query_rows(a.hidden.back().data(), batch.B, batch.T, E);
  MatrixMap<T>(m.head_w.grad.data(), S, E).noalias() = d_logits.transpose() * h;
  Eigen::Map<Eigen::Matrix<T, 1, Eigen::Dynamic>>(m.head_b.grad.data(), S) =
      d_logits.colwise().sum();
  std::fill(a.d_hidden.begin(), a.d_hidden.end(), T(0));
  query_rows(a.d_hidden.data(), batch.B, batch.T, E).noalias() =
      d_logits * ConstMatrixMap<T>(m.head_w.value.data(), S, E);
}

template <class T>
dcmha::TensorView<T, 3> activation_view(std::vector<T>& v, const recall::Batch& batch, index_t E) {
  return dcmha::view<3>(v.data(), {batch.B, batch.T, E});
}

/// Loss and accuracy of the batch; keeps in `a` what backward needs.
template <class T>
Outcome forward(const Model<T>& m, const recall::Batch& batch, Activations<T>& a) {
  resize_activations(m.cfg, batch, a);
  embed(m, batch, a.hidden[0].data());
  const dcformer::LayerConfig lc = m.cfg.layer();
  for (std::size_t l = 0; l < m.layers.size(); ++l) {
    dcformer::forward(lc, activation_view(a.hidden[l], batch, lc.E), m.rope.views(),
                      layer_weights(lc, m.layers[l]), activation_view(a.layer_out, batch, lc.E),
                      a.caches[l]);
    // The residual connection: h(l+1) = h(l) + layer(h(l)).
    for (std::size_t i = 0; i < a.layer_out.size(); ++i)
      a.hidden[l + 1][i] = a.hidden[l][i] + a.layer_out[i];
  }
  return head_forward(m, batch, a);
}

/// Every parameter's gradient of the loss of the last forward (same batch), overwritten.
template <class T>
void backward(Model<T>& m, const recall::Batch& batch, Activations<T>& a) {
  head_backward(m, batch, a);
  const dcformer::LayerConfig lc = m.cfg.layer();
  for (std::size_t l = m.layers.size(); l-- > 0;) {
    dcformer::backward(lc, activation_view(a.hidden[l], batch, lc.E), m.rope.views(),
                       layer_weights(lc, m.layers[l]), a.caches[l],
                       activation_view(a.d_hidden, batch, lc.E),
                       activation_view(a.d_x, batch, lc.E), layer_grads(lc, m.layers[l]));
    // h(l) reaches the loss through the layer and through the skip connection.
    for (std::size_t i = 0; i < a.d_x.size(); ++i) a.d_hidden[i] += a.d_x[i];
  }
  embed_backward(m, batch, a.d_hidden.data());
}

}  // namespace train

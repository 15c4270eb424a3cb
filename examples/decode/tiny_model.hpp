#pragma once
// A small DCFormer-style language model: token embedding, attention-only blocks
//
//   x <- x + attention_l(RMSNorm(x))      l = 0 .. layers - 1, the official "LGLL" window pattern
//   logits = RMSNorm(x) headᵀ
//
// with random weights drawn from a seed. The attention layer is the DCFormer layer of
// ../dcformer_attention/dcformer_layer.hpp (fused wqkv, qk-norm, RoPE, the dynamic weight
// projection, dcmha's core, wo); `full_forward` runs it over a whole sequence with
// dcformer::forward, decoder.hpp runs the same model token by token. The blocks have no MLP: it
// would add dense products only, nothing the attention cache is involved in.
#include "dcformer_layer.hpp"

#include <dcmha/dcmha.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace tiny {

using dcmha::index_t;
namespace layer_detail = dcformer::detail;

inline std::size_t sz(index_t n) { return static_cast<std::size_t>(n); }

struct ModelConfig {
  index_t vocab = 256;
  index_t E = 512, H = 8, Hk = 8, D = 64;  ///< width, query heads, key/value heads, head dim
  index_t layers = 4;
  index_t window = 256;  ///< keys a local layer's query sees, its own included
  bool compose = true;   ///< DCMHA (true) or plain multi-head attention: the one switch
  index_t G = 1, R = 2;  ///< DCMHA's compose groups and rank (the official values)
  double norm_eps = 1e-6;
  int num_threads = 0;  ///< dcmha's OpenMP threads; 0: all
  std::uint32_t seed = 1;

  /// The official window_type "LGLL" (window sizes [256, None, 256, 256] indexed by layer % 4):
  /// layer i is global when i % 4 == 1, local otherwise.
  bool global_layer(index_t layer) const { return layer % 4 == 1; }

  /// "LGLL..." for `layers` layers.
  std::string pattern() const {
    std::string s;
    for (index_t l = 0; l < layers; ++l) s += global_layer(l) ? 'G' : 'L';
    return s;
  }

  dcformer::LayerConfig layer_config(index_t layer) const {
    dcformer::LayerConfig c;
    c.E = E;
    c.H = H;
    c.Hk = Hk;
    c.D = D;
    c.compose = compose;
    c.G = G;
    c.R = R;
    c.qk_norm = true;  // as DCFormer (use_qk_norm)
    c.window = global_layer(layer) ? 0 : window;
    c.num_threads = num_threads;
    return c;
  }
};

/// One block's parameters, in the official checkpoint layout (see dcformer_layer.hpp).
struct LayerParams {
  std::vector<float> attention_norm;  // (E): RMSNorm weight of the block's input
  std::vector<float> wqkv, wo;        // ((H + 2Hk)·D, E), (E, H·D)
  std::vector<float> q_norm, k_norm;  // (D): qk-norm weights
  std::vector<float> dw1, qkw, dd;    // the dynamic weight projection (DCMHA only)
};

struct ModelWeights {
  std::vector<float> embedding;  // (vocab, E)
  std::vector<LayerParams> layers;
  std::vector<float> final_norm;  // (E)
  std::vector<float> head;        // (vocab, E)
};

inline std::vector<float> normal(std::mt19937& rng, index_t n, double stddev) {
  std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
  std::vector<float> v(sz(n));
  for (float& e : v) e = dist(rng);
  return v;
}

inline LayerParams random_layer(const ModelConfig& c, std::mt19937& rng) {
  const dcformer::LayerConfig lc = c.layer_config(0);
  const index_t E = c.E, G = lc.G, M = lc.M(), K = lc.hidden();
  LayerParams p;
  p.attention_norm.assign(sz(E), 1.0f);
  p.q_norm.assign(sz(c.D), 1.0f);
  p.k_norm.assign(sz(c.D), 1.0f);
  p.wqkv = normal(rng, lc.qkv_width() * E, 1.0 / std::sqrt(double(E)));
  p.wo = normal(rng, E * c.H * c.D, 1.0 / std::sqrt(double(c.H * c.D)));
  // Drawn in MHA mode too, so that both modes share every other weight. Larger than the official
  // init, which starts the dynamic terms near zero and would leave DCMHA close to MHA here.
  p.dw1 = normal(rng, E * G * 4 * K, 1.0 / std::sqrt(double(E)));
  p.qkw = normal(rng, G * 4 * K * 2 * lc.R * M, 0.3 / std::sqrt(double(K)));
  p.dd = normal(rng, E * G * 4 * M, 0.5 / std::sqrt(double(E)));
  return p;
}

/// Every weight from c.seed; the same seed gives MHA and DCMHA the same weights but the projection.
inline ModelWeights random_weights(const ModelConfig& c) {
  std::mt19937 rng(c.seed);
  ModelWeights w;
  w.embedding = normal(rng, c.vocab * c.E, 1.0);
  for (index_t l = 0; l < c.layers; ++l) w.layers.push_back(random_layer(c, rng));
  w.final_norm.assign(sz(c.E), 1.0f);
  w.head = normal(rng, c.vocab * c.E, 1.0 / std::sqrt(double(c.E)));
  return w;
}

/// The views dcformer::forward takes; the projection's only with compose (the layer refuses
/// parameters its config would ignore).
inline dcformer::LayerWeights<float> layer_weights(const ModelConfig& c, index_t layer,
                                                   const LayerParams& p) {
  const dcformer::LayerConfig lc = c.layer_config(layer);
  dcformer::LayerWeights<float> w;
  w.wqkv = dcmha::view<2>(p.wqkv.data(), {lc.qkv_width(), c.E});
  w.wo = dcmha::view<2>(p.wo.data(), {c.E, c.H * c.D});
  w.q_norm = dcmha::view<1>(p.q_norm.data(), {c.D});
  w.k_norm = dcmha::view<1>(p.k_norm.data(), {c.D});
  if (!lc.compose) return w;
  w.dw1 = dcmha::view<4>(p.dw1.data(), {c.E, lc.G, 4, lc.hidden()});
  w.qkw = dcmha::view<5>(p.qkw.data(), {lc.G, 4, lc.hidden(), 2 * lc.R, lc.M()});
  w.dd = dcmha::view<3>(p.dd.data(), {c.E, lc.G, 4 * lc.M()});
  return w;
}

/// x (n, E): the embedding rows of n tokens.
inline void embed(const ModelConfig& c, const ModelWeights& w, const int* tokens, index_t n,
                  float* x) {
  for (index_t t = 0; t < n; ++t) {
    const float* row = w.embedding.data() + index_t(tokens[t]) * c.E;
    std::copy(row, row + c.E, x + t * c.E);
  }
}

/// out = RMSNorm(x) · weight, row by row; the layer's own qk-norm helper over E instead of D.
inline void rms_norm_rows(const ModelConfig& c, const float* x, const std::vector<float>& weight,
                          index_t rows, float* out) {
  for (index_t r = 0; r < rows; ++r)
    layer_detail::rms_norm(x + r * c.E, weight.data(), c.E, c.norm_eps, out + r * c.E);
}

/// logits (rows, vocab) = RMSNorm(x) headᵀ; `normed` is scratch, kept by the caller.
inline void output_logits(const ModelConfig& c, const ModelWeights& w, const float* x, index_t rows,
                          float* logits, std::vector<float>& normed) {
  normed.resize(sz(rows * c.E));
  rms_norm_rows(c, x, w.final_norm, rows, normed.data());
  layer_detail::MatrixMap<float>(logits, rows, c.vocab).noalias() =
      layer_detail::ConstMatrixMap<float>(normed.data(), rows, c.E) *
      layer_detail::ConstMatrixMap<float>(w.head.data(), c.vocab, c.E).transpose();
}

/// Greedy choice: the first index of the largest logit.
inline int argmax(const float* logits, index_t vocab) {
  return static_cast<int>(std::max_element(logits, logits + vocab) - logits);
}

/// What a forward produced at each position: every layer's attention output (before the residual
/// add) and the logits. The decoder and the full forward each fill one, for the comparison.
struct Trace {
  std::vector<std::vector<float>> attention;  // [layer]: (positions, E)
  std::vector<float> logits;                  // (positions, vocab)
};

inline Trace make_trace(const ModelConfig& c, index_t positions) {
  Trace t;
  t.attention.assign(sz(c.layers), std::vector<float>(sz(positions * c.E)));
  t.logits.resize(sz(positions * c.vocab));
  return t;
}

/// The whole sequence at once: each layer through dcformer::forward (its training path).
inline Trace full_forward(const ModelConfig& c, const ModelWeights& w,
                          const std::vector<int>& tokens) {
  const index_t T = static_cast<index_t>(tokens.size()), E = c.E;
  Trace trace = make_trace(c, T);
  std::vector<float> x(sz(T * E)), normed(sz(T * E)), scratch;
  embed(c, w, tokens.data(), T, x.data());
  const auto rope = dcformer::make_rope_tables<float>(T, c.D);
  dcformer::LayerCache<float> cache;  // what forward keeps for a backward; reused layer to layer
  auto act = [&](float* p) { return dcmha::view<3>(p, {1, T, E}); };
  for (index_t l = 0; l < c.layers; ++l) {
    std::vector<float>& y = trace.attention[sz(l)];
    rms_norm_rows(c, x.data(), w.layers[sz(l)].attention_norm, T, normed.data());
    dcformer::forward(c.layer_config(l), act(normed.data()), rope.views(),
                      layer_weights(c, l, w.layers[sz(l)]), act(y.data()), cache);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += y[i];
  }
  output_logits(c, w, x.data(), T, trace.logits.data(), scratch);
  return trace;
}

}  // namespace tiny

#pragma once
// Token-by-token decoding of the tiny model (tiny_model.hpp) with one dcmha::DecodeCache per
// layer. A step takes n new tokens (a prefill chunk, or one generated token) and, per layer:
//
//   qkv = RMSNorm(x) wqkvᵀ                      the n new rows only
//   q, k <- RoPE(qk-norm(q, k))                 at the new positions
//   dw = projection(RMSNorm(x))                 DCMHA: the new tokens' dynamic weights
//   cache.append(k, v, key-wise terms of dw)    a local layer's cache is a ring of window slots
//   o = dcmha::decode(q, cache, query-wise terms of dw)
//   x += o woᵀ
//
// The per-token pieces are the layer's own helpers (dcformer::detail in dcformer_layer.hpp), so
// the decoder computes exactly what dcformer::forward computes for those rows.
#include "tiny_model.hpp"

#include <chrono>
#include <cstddef>

namespace tiny {

/// Sizes a decoder is built for.
struct DecodeLimits {
  index_t max_positions = 1;  ///< tokens fed in all: a global layer's cache capacity
  index_t max_step = 1;       ///< most tokens one step takes (the prefill chunk)
};

/// One layer: config, weights, and the cache of its keys, values and key-wise compose terms.
struct DecoderLayer {
  dcformer::LayerConfig config;
  dcformer::LayerWeights<float> weights;
  dcmha::DecodeCache<float> cache;
};

/// Scratch for the n tokens of one step, shared by the layers; sized once for max_step.
struct StepBuffers {
  std::vector<float> x, normed, qkv, q, k, o, y;  // (n, ·) rows
  std::vector<float> q_inv_rms, k_inv_rms;        // qk-norm's 1 / rms, which only backward needs
  std::vector<float> logits, logits_scratch;      // (n, vocab)
  dcmha::DynamicWeightsStorage<float> dw;         // the projection's output for the n tokens
};

inline dcmha::DecodeCacheConfig cache_config(const dcformer::LayerConfig& c,
                                             const DecodeLimits& limits) {
  dcmha::DecodeCacheConfig cc;
  cc.B = 1;
  cc.H = c.H;
  cc.Hk = c.Hk;
  cc.D = cc.Dv = c.D;
  cc.G = c.G;
  // DCMHA keeps each key's key-wise terms (pre and post); MHA keeps keys and values only.
  cc.Rk = c.compose ? c.R : 0;
  cc.pre_key_wise = cc.post_key_wise = c.compose;
  cc.window = c.window;  // local: a ring of window + max_step - 1 slots; global: capacity
  cc.capacity = c.window > 0 ? 0 : limits.max_positions;
  cc.max_step = limits.max_step;
  return cc;
}

inline void resize_buffers(const ModelConfig& m, const dcformer::LayerConfig& c, index_t n,
                           StepBuffers& b) {
  for (auto* v : {&b.x, &b.normed, &b.y}) v->resize(sz(n * m.E));
  b.qkv.resize(sz(n * c.qkv_width()));
  b.q.resize(sz(n * c.H * c.D));
  b.o.resize(sz(n * c.H * c.D));
  b.k.resize(sz(n * c.Hk * c.D));
  b.q_inv_rms.resize(sz(n * c.H));
  b.k_inv_rms.resize(sz(n * c.Hk));
  b.logits.resize(sz(n * m.vocab));
}

struct Decoder {
  const ModelConfig& model;
  const ModelWeights& weights;
  DecodeLimits limits;
  dcformer::RopeTables<float> rope;  // rows for positions [0, max_positions)
  std::vector<DecoderLayer> layers;
  StepBuffers buffers;
  dcmha::Workspace workspace;  // dcmha's kernel buffers, for every layer's decode (one at a time)
  index_t position = 0;        // tokens fed so far

  Decoder(const ModelConfig& m, const ModelWeights& w, const DecodeLimits& l)
      : model(m),
        weights(w),
        limits(l),
        rope(dcformer::make_rope_tables<float>(l.max_positions, m.D)) {
    const char* fn = "tiny::Decoder";
    layers.reserve(sz(m.layers));
    for (index_t i = 0; i < m.layers; ++i) {
      const dcformer::LayerConfig c = m.layer_config(i);
      const dcformer::LayerWeights<float> lw = layer_weights(m, i, w.layers[sz(i)]);
      layer_detail::check_config(fn, c);  // the checks dcformer::forward makes
      layer_detail::check_parameters(fn, c, lw, "weights");
      layers.push_back({c, lw, dcmha::DecodeCache<float>(cache_config(c, l))});
    }
    resize_buffers(m, m.layer_config(0), l.max_step, buffers);  // no allocation while decoding
  }
};

/// q, k of the new rows of buffers.qkv: qk-norm, then RoPE at positions [position, position + n).
inline void rotate_new_heads(Decoder& d, const DecoderLayer& layer, index_t n) {
  const dcformer::LayerConfig& c = layer.config;
  StepBuffers& b = d.buffers;
  const index_t half = c.D / 2;
  // The table rows of the new positions, as a table of n rows: norm_and_rotate rotates row r of
  // its input by row r of the table.
  const dcformer::Rope<float> at{dcmha::view<2>(d.rope.cos.data() + d.position * half, {n, half}),
                                 dcmha::view<2>(d.rope.sin.data() + d.position * half, {n, half})};
  auto heads = [&](index_t count, index_t column, std::vector<float>& out,
                   std::vector<float>& inv_rms, const float* norm_scale) {
    layer_detail::norm_and_rotate(
        c, at, n, n, b.qkv.data(),
        layer_detail::HeadSet<float>{count, column, out.data(), inv_rms.data(), norm_scale});
  };
  heads(c.H, 0, b.q, b.q_inv_rms, layer.weights.q_norm.data);           // q: columns [0, H·D)
  heads(c.Hk, c.H * c.D, b.k, b.k_inv_rms, layer.weights.k_norm.data);  // k: the next Hk·D
}

/// Appends the new tokens' k, v and (DCMHA) key-wise terms to the layer's cache; returns what
/// decode takes for the new queries: their query-wise terms (nothing for MHA).
inline dcmha::ComposeWeights<float> append_new_tokens(Decoder& d, DecoderLayer& layer, index_t n) {
  const dcformer::LayerConfig& c = layer.config;
  StepBuffers& b = d.buffers;
  const auto k_new = dcmha::bthd(b.k.data(), 1, n, c.Hk, c.D);
  // v straight from its columns of the fused projection, as the layer does.
  const auto v_new = layer_detail::fused_heads(b.qkv.data(), c, 1, n, c.Hk, (c.H + c.Hk) * c.D);
  if (!c.compose) {
    layer.cache.append(k_new, v_new);
    return {};
  }
  if (b.dw.L != n)  // new storage only when the step's length changes (prefill -> decoding)
    b.dw = dcmha::DynamicWeightsStorage<float>(1, n, c.G, c.R, c.M());
  const dcmha::DynamicWeights<float> dw = b.dw.views();
  dcmha::dynamic_weights_forward(layer_detail::projection_config(c),
                                 dcmha::view<3>(b.normed.data(), {1, n, c.E}),
                                 layer_detail::projection_parameters(layer.weights), dw);
  layer.cache.append(k_new, v_new, dcmha::decode_key_side(dw));
  return dcmha::decode_query_side(dw);
}

/// One layer's attention for the step's n tokens: buffers.normed (n, E) -> buffers.y (n, E).
inline void attention_step(Decoder& d, DecoderLayer& layer, index_t n) {
  const dcformer::LayerConfig& c = layer.config;
  StepBuffers& b = d.buffers;
  const index_t HD = c.H * c.D;
  layer_detail::MatrixMap<float>(b.qkv.data(), n, c.qkv_width()).noalias() =
      layer_detail::ConstMatrixMap<float>(b.normed.data(), n, c.E) *
      layer_detail::ConstMatrixMap<float>(layer.weights.wqkv.data, c.qkv_width(), c.E).transpose();
  rotate_new_heads(d, layer, n);
  const dcmha::ComposeWeights<float> query_side = append_new_tokens(d, layer, n);
  dcmha::decode(layer_detail::attention_config(c), dcmha::bthd(b.q.data(), 1, n, c.H, c.D),
                layer.cache, query_side, dcmha::bthd(b.o.data(), 1, n, c.H, c.D), d.workspace);
  layer_detail::MatrixMap<float>(b.y.data(), n, c.E).noalias() =
      layer_detail::ConstMatrixMap<float>(b.o.data(), n, HD) *
      layer_detail::ConstMatrixMap<float>(layer.weights.wo.data, c.E, HD).transpose();
}

/// rows [at, at + n) of `dst` (rows of `width`) <- src.
inline void record_rows(std::vector<float>& dst, index_t at, index_t n, index_t width,
                        const std::vector<float>& src) {
  std::copy(src.begin(), src.begin() + static_cast<std::ptrdiff_t>(n * width),
            dst.begin() + static_cast<std::ptrdiff_t>(at * width));
}

/// Feeds n tokens at the next n positions through the model; returns the greedy next token after
/// the last of them. With a trace, records every layer's attention output and the logits there.
inline int decode_step(Decoder& d, const int* tokens, index_t n, Trace* trace) {
  const ModelConfig& m = d.model;
  StepBuffers& b = d.buffers;
  if (n < 1 || n > d.limits.max_step || d.position + n > d.limits.max_positions)
    layer_detail::fail("tiny::decode_step: n: expected 1 .. ", d.limits.max_step, " tokens within ",
                       d.limits.max_positions, " positions, got ", n, " at position ", d.position);
  resize_buffers(m, d.layers[0].config, n, b);
  embed(m, d.weights, tokens, n, b.x.data());
  for (index_t l = 0; l < m.layers; ++l) {
    rms_norm_rows(m, b.x.data(), d.weights.layers[sz(l)].attention_norm, n, b.normed.data());
    attention_step(d, d.layers[sz(l)], n);
    for (std::size_t i = 0; i < b.x.size(); ++i) b.x[i] += b.y[i];
    if (trace) record_rows(trace->attention[sz(l)], d.position, n, m.E, b.y);
  }
  output_logits(m, d.weights, b.x.data(), n, b.logits.data(), b.logits_scratch);
  if (trace) record_rows(trace->logits, d.position, n, m.vocab, b.logits);
  d.position += n;
  return argmax(b.logits.data() + (n - 1) * m.vocab, m.vocab);
}

/// A greedy generation: the tokens, the decoder's trace and its timings.
struct Generation {
  index_t prompt_length = 0;
  std::vector<int> tokens;  // the prompt, then the generated tokens
  Trace trace;  // at every position fed: the prompt and all generated tokens but the last
  double prefill_seconds = 0.0, decode_seconds = 0.0;
  index_t decode_steps = 0;                     // one token each
  index_t local_layers = 0, wrapped_rings = 0;  // local layers, and those whose ring wrapped
  index_t ring_slots = 0;                       // a local layer's cache slots
};

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// Where the local layers' rings stand: a ring wrapped when it took more tokens than it has slots.
inline void count_wrapped_rings(const Decoder& d, Generation& g) {
  for (const DecoderLayer& layer : d.layers) {
    if (!layer.cache.local()) continue;
    ++g.local_layers;
    g.ring_slots = layer.cache.capacity();
    if (layer.cache.length(0) > layer.cache.capacity()) ++g.wrapped_rings;
  }
}

/// Prefills `prompt` in chunks of `chunk` tokens, then generates `new_tokens` greedily (the
/// first from the prefill's last logits, each next one from a one-token step).
inline Generation generate(const ModelConfig& m, const ModelWeights& w,
                           const std::vector<int>& prompt, index_t new_tokens, index_t chunk) {
  Generation g;
  g.prompt_length = static_cast<index_t>(prompt.size());
  const index_t positions = g.prompt_length + new_tokens - 1, P = g.prompt_length;
  g.tokens.reserve(sz(P + new_tokens));
  g.tokens = prompt;
  g.trace = make_trace(m, positions);
  Decoder d(m, w, {positions, std::min(chunk, P)});

  auto start = std::chrono::steady_clock::now();
  int next = 0;
  for (index_t at = 0; at < P; at += chunk)
    next = decode_step(d, prompt.data() + at, std::min(chunk, P - at), &g.trace);
  g.tokens.push_back(next);
  g.prefill_seconds = seconds_since(start);

  start = std::chrono::steady_clock::now();
  for (index_t i = 1; i < new_tokens; ++i) {
    const int last = g.tokens.back();
    g.tokens.push_back(decode_step(d, &last, 1, &g.trace));
  }
  g.decode_seconds = seconds_since(start);
  g.decode_steps = new_tokens - 1;
  count_wrapped_rings(d, g);
  return g;
}

}  // namespace tiny

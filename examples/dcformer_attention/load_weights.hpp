#pragma once
// Loads one DCFormer / DCPythia attention layer's parameters from a safetensors file by the
// official PyTorch names, into owning storage that hands out dcformer::LayerWeights views.
//
//   layers.{i}.attention.wqkv.weight              ((H + 2Hk)·D, E)
//   layers.{i}.attention.wo.weight                (E, H·D)
//   layers.{i}.attention.dyn_w_proj.dw1           (E, G, 4, K)       with config.compose
//   layers.{i}.attention.dyn_w_proj.qkw           (G, 4, K, 2R, M)   with config.compose
//   layers.{i}.attention.dyn_w_proj.dd            (E, G, 4M)         with config.compose
//   layers.{i}.attention.q_norm.scale, k_norm.scale (D)              with config.qk_norm
//   layers.{i}.attention.dyn_w_proj.pre_proj.w, post_proj.w (G, M, M) with LoadOptions::static_w
//
// wqkv.weight may instead be given as wq.weight (H·D, E), wk.weight and wv.weight (Hk·D, E):
// their rows are concatenated, as the official code's load hook does for older checkpoints.
//
// Shapes. A stored shape is accepted when it is the official one, or the official one with runs
// of consecutive axes merged into one axis (size-1 axes dropped or added): dw1 as (E, G·4·K), dd
// as (E, 4M) when G = 1. The flat row-major order is then the official one, while a transposed
// tensor, or one of another model size, is refused. The official checkpoints store exactly the
// shapes above (4-D dw1, 5-D qkw, 3-D dd).
//
// Static W (official use_sw, off in the published models) is stored without the identity: the
// compose adds the input itself (dcmha spec, section 1). Its shape is the spec's (G, M, M); the
// official module builds it (1, H, H), the same for the official G = 1. Models without static W
// keep an identity buffer under the same names, so those are read only with
// LoadOptions::static_w.
//
// Ignored: every other tensor, among them the merged copies of the official inference code
// (dyn_w_proj.dw_m, qkw_m, sw) and the dyn_w_proj tensors when config.compose is off (the
// official module builds them in MHA mode too). Refused: q_norm.scale / k_norm.scale when
// config.qk_norm is off, since the model then normalizes q and k and the layer would not.
//
// Everything is validated before any tensor data is read: the header by safetensors::File, then
// every wanted tensor's presence, dtype (BF16, F16, F32 or F64) and shape. Failures throw
// safetensors::Error naming the file, the tensor and what was expected; an invalid config or
// layer index throws dcmha::Error.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "dcformer_layer.hpp"
#include "safetensors.hpp"

namespace dcformer {

struct LoadOptions {
  /// Put before "layers.{i}.attention.": empty for the official checkpoints; e.g. "model." for
  /// a state dict saved from a module that wraps the model.
  std::string prefix;
  /// The model has static W: load dyn_w_proj.pre_proj.w and post_proj.w (compose only).
  bool static_w = false;
};

/// One layer's parameters, owned, in the official layout; views() gives the layer's weights.
template <class T>
struct LayerWeightStorage {
  LayerConfig config;
  std::vector<T> wqkv, wo, dw1, qkw, dd, q_norm, k_norm;
  /// Static W of the scores (pre) and the probabilities (post): (G, M, M), [group, input head,
  /// output head], without the identity; empty unless loaded with LoadOptions::static_w.
  /// dcformer::forward has no static W term; the attention core takes them through
  /// dcmha::compose_weights(dw, static_w_pre(), static_w_post()).
  std::vector<T> pre_w, post_w;

  /// Zeros of every parameter `cfg` uses (static W too when `static_w`).
  void allocate(const LayerConfig& cfg, bool static_w);

  LayerWeights<T> views() const {
    const LayerConfig& c = config;
    LayerWeights<T> w;
    w.wqkv = dcmha::view<2>(wqkv.data(), {c.qkv_width(), c.E});
    w.wo = dcmha::view<2>(wo.data(), {c.E, c.H * c.D});
    if (c.compose) {
      const index_t G = c.G, M = c.M(), K = c.hidden();
      w.dw1 = dcmha::view<4>(dw1.data(), {c.E, G, 4, K});
      w.qkw = dcmha::view<5>(qkw.data(), {G, 4, K, 2 * c.R, M});
      w.dd = dcmha::view<3>(dd.data(), {c.E, G, 4 * M});
    }
    if (c.qk_norm) {
      w.q_norm = dcmha::view<1>(q_norm.data(), {c.D});
      w.k_norm = dcmha::view<1>(k_norm.data(), {c.D});
    }
    return w;
  }
  TensorView<const T, 3> static_w_pre() const { return static_w_view(pre_w); }
  TensorView<const T, 3> static_w_post() const { return static_w_view(post_w); }

 private:
  TensorView<const T, 3> static_w_view(const std::vector<T>& w) const {
    if (w.empty()) return {};
    return dcmha::view<3>(w.data(), {config.G, config.M(), config.M()});
  }
};

namespace detail {

using Dims = std::vector<std::int64_t>;

/// One parameter: its name after "layers.{i}.attention.", official shape and storage member.
template <class T>
struct ParameterSpec {
  std::string suffix;
  Dims shape;
  std::vector<T> LayerWeightStorage<T>::*member;
};

template <class T>
std::vector<ParameterSpec<T>> parameter_specs(const LayerConfig& c, bool static_w) {
  using S = LayerWeightStorage<T>;
  std::vector<ParameterSpec<T>> specs = {{"wqkv.weight", {c.qkv_width(), c.E}, &S::wqkv},
                                         {"wo.weight", {c.E, c.H * c.D}, &S::wo}};
  const index_t G = c.G, M = c.M(), K = c.hidden();
  if (c.compose) {
    specs.push_back({"dyn_w_proj.dw1", {c.E, G, 4, K}, &S::dw1});
    specs.push_back({"dyn_w_proj.qkw", {G, 4, K, 2 * c.R, M}, &S::qkw});
    specs.push_back({"dyn_w_proj.dd", {c.E, G, 4 * M}, &S::dd});
  }
  if (c.compose && static_w) {
    specs.push_back({"dyn_w_proj.pre_proj.w", {G, M, M}, &S::pre_w});
    specs.push_back({"dyn_w_proj.post_proj.w", {G, M, M}, &S::post_w});
  }
  if (c.qk_norm) {
    specs.push_back({"q_norm.scale", {c.D}, &S::q_norm});
    specs.push_back({"k_norm.scale", {c.D}, &S::k_norm});
  }
  return specs;
}

inline std::string layer_prefix(const LoadOptions& options, index_t layer) {
  return options.prefix + "layers." + std::to_string(layer) + ".attention.";
}

/// Products of the trailing axes (1, last, last two, ..., all); false on overflow.
inline bool suffix_products(const Dims& dims, std::vector<std::uint64_t>& out) {
  std::uint64_t p = 1;
  out.assign(1, 1);
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
    if (*it < 0 ||
        !safetensors::detail::checked_mul(p, static_cast<std::uint64_t>(*it), UINT64_MAX, p))
      return false;
    out.push_back(p);
  }
  return true;
}

/// Whether `stored` is `official` with runs of consecutive axes merged (size-1 axes dropped or
/// added): same element count, and every boundary between stored axes is one between official
/// axes, i.e. each product of trailing stored axes is a product of trailing official axes.
inline bool same_axes_merged(const Dims& stored, const Dims& official) {
  std::vector<std::uint64_t> s, o;
  if (!suffix_products(stored, s) || !suffix_products(official, o) || s.back() != o.back())
    return false;
  return std::all_of(s.begin(), s.end(),
                     [&](std::uint64_t p) { return std::find(o.begin(), o.end(), p) != o.end(); });
}

template <class... Args>
[[noreturn]] void load_fail(const safetensors::File& file, const std::string& tensor,
                            const Args&... args) {
  safetensors::detail::fail("dcformer::load_layer_weights: file '", file.path(), "': tensor '",
                            tensor, "'", args...);
}

/// How many tensors of the file start with `prefix` (for the message of a missing one).
inline std::size_t count_with_prefix(const safetensors::File& file, const std::string& prefix) {
  std::size_t n = 0;
  for (const auto& entry : file.tensors()) n += entry.first.rfind(prefix, 0) == 0;
  return n;
}

/// The tensor `name`, present, of a convertible dtype and of the official shape (or it merged).
inline const safetensors::TensorInfo& wanted_tensor(const safetensors::File& file,
                                                    const std::string& name, const Dims& shape,
                                                    const std::string& prefix) {
  const safetensors::TensorInfo* t = file.find(name);
  if (!t)
    load_fail(file, name, " not found: expected a tensor of shape ",
              safetensors::shape_string(shape), " (the file has ", file.tensors().size(),
              " tensors, ", count_with_prefix(file, prefix), " of them under '", prefix, "')");
  if (safetensors::parse_dtype(t->dtype) == safetensors::DType::other)
    load_fail(file, name, ": dtype: expected BF16, F16, F32 or F64, got '", t->dtype, "'");
  if (!same_axes_merged(t->shape, shape))
    load_fail(file, name, ": expected shape ", safetensors::shape_string(shape),
              " (or it with consecutive axes merged), got ", safetensors::shape_string(t->shape));
  return *t;
}

/// The tensors a parameter is read from, in order: one, or wq, wk, wv for a missing wqkv.
template <class T>
std::vector<const safetensors::TensorInfo*> parameter_sources(const safetensors::File& file,
                                                              const LayerConfig& c,
                                                              const ParameterSpec<T>& spec,
                                                              const std::string& prefix) {
  const std::string name = prefix + spec.suffix;
  if (spec.suffix != "wqkv.weight" || file.find(name) || !file.find(prefix + "wq.weight"))
    return {&wanted_tensor(file, name, spec.shape, prefix)};
  return {&wanted_tensor(file, prefix + "wq.weight", {c.H * c.D, c.E}, prefix),
          &wanted_tensor(file, prefix + "wk.weight", {c.Hk * c.D, c.E}, prefix),
          &wanted_tensor(file, prefix + "wv.weight", {c.Hk * c.D, c.E}, prefix)};
}

/// Tensors whose presence says the config does not describe the model.
inline void check_config_matches_file(const safetensors::File& file, const LayerConfig& c,
                                      const std::string& prefix) {
  if (c.qk_norm) return;
  for (const char* suffix : {"q_norm.scale", "k_norm.scale"})
    if (file.find(prefix + suffix))
      load_fail(file, prefix + suffix,
                ": expected no qk-norm scale with config.qk_norm off; the model normalizes q and "
                "k, set config.qk_norm");
}

}  // namespace detail

template <class T>
void LayerWeightStorage<T>::allocate(const LayerConfig& cfg, bool static_w) {
  *this = LayerWeightStorage<T>();
  config = cfg;
  for (const auto& spec : detail::parameter_specs<T>(cfg, static_w)) {
    std::size_t n = 1;
    for (std::int64_t d : spec.shape) n *= static_cast<std::size_t>(d);
    (this->*spec.member).assign(n, T(0));
  }
}

/// Layer `layer`'s attention parameters from an open file, converted to T (float, double,
/// dcmha::bf16 or dcmha::half: a BF16 checkpoint loads into bf16 storage as it is).
template <class T>
LayerWeightStorage<T> load_layer_weights(const safetensors::File& file, const LayerConfig& cfg,
                                         index_t layer, const LoadOptions& options = {}) {
  const char* fn = "dcformer::load_layer_weights";
  detail::check_config(fn, cfg);
  if (layer < 0) detail::fail(fn, ": layer: expected >= 0, got ", layer);
  if (options.static_w && !cfg.compose)
    detail::fail(fn, ": options.static_w: expected false with config.compose off");
  const std::string prefix = detail::layer_prefix(options, layer);
  detail::check_config_matches_file(file, cfg, prefix);
  const auto specs = detail::parameter_specs<T>(cfg, options.static_w);
  std::vector<std::vector<const safetensors::TensorInfo*>> sources;
  for (const auto& spec : specs)
    sources.push_back(detail::parameter_sources(file, cfg, spec, prefix));

  // Every tensor is validated: read them.
  LayerWeightStorage<T> w;
  w.allocate(cfg, options.static_w);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    T* out = (w.*specs[i].member).data();
    for (const safetensors::TensorInfo* part : sources[i]) {
      file.read(*part, out);
      out += part->numel();
    }
  }
  return w;
}

/// The same from a file path.
template <class T>
LayerWeightStorage<T> load_layer_weights(const std::string& path, const LayerConfig& cfg,
                                         index_t layer, const LoadOptions& options = {}) {
  return load_layer_weights<T>(safetensors::File(path), cfg, layer, options);
}

}  // namespace dcformer

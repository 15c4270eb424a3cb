// dcformer_safetensors_test                      checks the safetensors reader and weight loader
// dcformer_safetensors_test --write FILE [DTYPE]  writes a random test layer's weights (layer 0,
//                                                 DTYPE BF16, F16 or F32; default BF16)
//
// The checks: exact BF16 / F16 conversion (every bit pattern), round trips of a layer's weights
// through F32, BF16 and F16 files into float and double (and BF16 into bf16, F16 into half),
// the layer's forward on loaded weights against the forward on the same weights in memory, the
// bf16 and fp16 layers on their loaded weights against the float layer, the accepted variants
// of the official
// layout (static W, merged copies, merged axes, split wq / wk / wv, MHA, a name prefix,
// unaligned data), and one refusal per kind of corrupt or mismatched file, each checked for the
// words of its message. One line per check; the exit status is non-zero when any fails.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "load_weights.hpp"
#include "write_safetensors.hpp"

namespace {

namespace fs = std::filesystem;
using dcformer::LayerConfig;
using dcformer::LayerWeightStorage;
using dcformer::LoadOptions;
using safetensors::DType;

/// Prints one line per check and counts the failures.
struct Checks {
  int total = 0, failed = 0;
  void report(const std::string& name, bool ok, const std::string& detail = "") {
    ++total;
    failed += !ok;
    std::printf("%s %s%s%s\n", ok ? "PASS" : "FAIL", name.c_str(), detail.empty() ? "" : ": ",
                detail.c_str());
    std::fflush(stdout);
  }
};

/// G = 2 groups, GQA and qk-norm: every parameter and a non-trivial layout.
LayerConfig test_config() {
  LayerConfig c;
  c.E = 32;
  c.H = 4;
  c.Hk = 2;
  c.D = 8;
  c.G = 2;
  c.R = 2;
  c.qk_norm = true;
  c.num_threads = 1;
  return c;
}

LayerWeightStorage<float> random_layer(const LayerConfig& c, bool static_w, unsigned seed) {
  LayerWeightStorage<float> w;
  w.allocate(c, static_w);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (auto* v : {&w.wqkv, &w.wo, &w.dw1, &w.qkw, &w.dd, &w.pre_w, &w.post_w})
    for (float& e : *v) e = normal(rng);
  for (auto* v : {&w.q_norm, &w.k_norm})
    for (float& e : *v) e = 1.0f + normal(rng);
  return w;
}

/// Every parameter vector of a storage, named (const or not as the storage).
template <class Storage>
auto members(Storage& w) {
  using Ptr = decltype(&w.wqkv);
  return std::vector<std::pair<std::string, Ptr>>{
      {"wqkv", &w.wqkv},     {"wo", &w.wo},       {"dw1", &w.dw1},
      {"qkw", &w.qkw},       {"dd", &w.dd},       {"q_norm", &w.q_norm},
      {"k_norm", &w.k_norm}, {"pre_w", &w.pre_w}, {"post_w", &w.post_w}};
}

/// The weights as they read back after being stored as dtype, in precision T.
template <class T>
LayerWeightStorage<T> stored_copy(const LayerWeightStorage<float>& w, DType dtype) {
  LayerWeightStorage<T> out;
  out.allocate(w.config, !w.pre_w.empty());
  const auto from = members(w);
  const auto to = members(out);
  for (std::size_t m = 0; m < from.size(); ++m) {
    std::vector<T>& dst = *to[m].second;
    for (std::size_t i = 0; i < dst.size(); ++i)
      dst[i] = static_cast<T>(safetensors::round_to(dtype, (*from[m].second)[i]));
  }
  return out;
}

/// "" when every parameter matches exactly (sizes and values), else the first difference.
template <class T>
std::string difference(const LayerWeightStorage<T>& got, const LayerWeightStorage<T>& want) {
  const auto g = members(got), w = members(want);
  for (std::size_t m = 0; m < g.size(); ++m) {
    const std::vector<T>&a = *g[m].second, &b = *w[m].second;
    if (a.size() != b.size())
      return g[m].first + ": " + std::to_string(a.size()) + " values, expected " +
             std::to_string(b.size());
    for (std::size_t i = 0; i < a.size(); ++i)
      if (a[i] != b[i])
        return g[m].first + "[" + std::to_string(i) +
               "] = " + std::to_string(static_cast<double>(a[i])) + ", expected " +
               std::to_string(static_cast<double>(b[i]));
  }
  return "";
}

/// y of the layer on a fixed random x (B = 2, T = 6).
template <class T>
std::vector<T> layer_output(const LayerConfig& c, const dcformer::LayerWeights<T>& w) {
  const dcmha::index_t B = 2, T_ = 6;
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<T> x(static_cast<std::size_t>(B * T_ * c.E)), y(x.size());
  for (T& e : x) e = static_cast<T>(normal(rng));
  const auto rope = dcformer::make_rope_tables<T>(T_, c.D);
  dcformer::LayerCache<T> cache;
  dcformer::forward(c, dcmha::view<3>(static_cast<const T*>(x.data()), {B, T_, c.E}), rope.views(),
                    w, dcmha::view<3>(y.data(), {B, T_, c.E}), cache);
  return y;
}

/// A file's header and data buffer, to be altered and assembled again.
struct Parts {
  nlohmann::json header;
  std::string data;
};

Parts split_file(const std::string& bytes) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(bytes[std::size_t(i)]);
  return {nlohmann::json::parse(bytes.substr(8, n)), bytes.substr(8 + n)};
}

/// The file `bytes` with its header edited.
std::string altered(const std::string& bytes, const std::function<void(nlohmann::json&)>& edit) {
  Parts p = split_file(bytes);
  edit(p.header);
  return safetensors::assemble(p.header.dump(), p.data);
}

/// The test environment: a temporary folder and the files written to it.
struct Env {
  fs::path dir;
  LayerConfig cfg = test_config();
  LayerWeightStorage<float> layer0 = random_layer(cfg, false, 1),
                            layer1 = random_layer(cfg, false, 2);

  std::string path(const std::string& name) const { return (dir / name).string(); }
  /// Layers 0 and 1 of the test config, stored as dtype.
  safetensors::Writer two_layers(DType dtype, const LoadOptions& o = {}) const {
    safetensors::Writer w;
    dcformer::add_layer_weights(w, layer0, 0, dtype, o);
    dcformer::add_layer_weights(w, layer1, 1, dtype, o);
    return w;
  }
  std::string write(const std::string& name, const std::string& bytes) const {
    safetensors::write_file(path(name), bytes);
    return path(name);
  }
};

const std::string kLayer1 = "layers.1.attention.";

/// Runs f; it must throw safetensors::Error or dcmha::Error whose message holds every word.
void expect_refusal(Checks& checks, const std::string& name, const std::function<void()>& f,
                    const std::vector<std::string>& words) {
  std::string message;
  try {
    f();
    return checks.report(name, false, "accepted, expected a refusal");
  } catch (const safetensors::Error& e) {
    message = e.what();
  } catch (const dcmha::Error& e) {
    message = e.what();
  } catch (const std::exception& e) {
    return checks.report(name, false, std::string("unexpected exception type: ") + e.what());
  }
  for (const std::string& w : words)
    if (message.find(w) == std::string::npos)
      return checks.report(name, false, "message lacks '" + w + "': " + message);
  checks.report(name, true, message);
}

/// A corrupt variant of layers 0 and 1 (F32) must be refused by the loader of layer 1 with
/// the file's path and `words` in the message.
void expect_corrupt(Checks& checks, const Env& env, const std::string& name,
                    const std::string& bytes, std::vector<std::string> words) {
  const std::string path =
      env.write("corrupt_" + std::to_string(checks.total) + ".safetensors", bytes);
  words.push_back("file '" + path + "'");
  expect_refusal(
      checks, "refuses " + name, [&] { dcformer::load_layer_weights<float>(path, env.cfg, 1); },
      words);
}

// ---------------------------------------------------------------------------------------------
// Conversions

/// binary16 by its definition, in double.
double f16_reference(std::uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double mag = e == 0    ? std::ldexp(m, -24)
                     : e == 31 ? (m ? NAN : INFINITY)
                               : std::ldexp(1024 + m, e - 25);
  return (h & 0x8000) ? -mag : mag;
}

/// bf16 by its definition (binary32's exponent, 7 mantissa bits), in double.
double bf16_reference(std::uint16_t h) {
  const int e = (h >> 7) & 0xff, m = h & 0x7f;
  const double mag = e == 0     ? std::ldexp(m, -133)
                     : e == 255 ? (m ? NAN : INFINITY)
                                : std::ldexp(128 + m, e - 134);
  return (h & 0x8000) ? -mag : mag;
}

bool same_value(double got, double want) {
  if (std::isnan(want)) return std::isnan(got) && std::signbit(got) == std::signbit(want);
  return got == want && std::signbit(got) == std::signbit(want);
}

/// Every bit pattern decodes to its defined value, and encodes back to itself (NaN aside).
void check_conversions(Checks& checks) {
  int bad_f16 = 0, bad_bf16 = 0, bad_f16_back = 0, bad_bf16_back = 0;
  for (std::uint32_t u = 0; u < 0x10000u; ++u) {
    const auto h = static_cast<std::uint16_t>(u);
    bad_f16 += !same_value(safetensors::f16_to_float(h), f16_reference(h));
    bad_bf16 += !same_value(safetensors::bf16_to_float(h), bf16_reference(h));
    if (!std::isnan(f16_reference(h)))
      bad_f16_back += safetensors::float_to_f16(safetensors::f16_to_float(h)) != h;
    if (!std::isnan(bf16_reference(h)))
      bad_bf16_back += safetensors::float_to_bf16(safetensors::bf16_to_float(h)) != h;
  }
  checks.report("F16 decoding: all 65536 patterns (subnormals, inf, NaN)", bad_f16 == 0,
                std::to_string(bad_f16) + " wrong");
  checks.report("BF16 decoding: all 65536 patterns", bad_bf16 == 0,
                std::to_string(bad_bf16) + " wrong");
  checks.report("F16 encoding of every F16 value gives it back", bad_f16_back == 0,
                std::to_string(bad_f16_back) + " wrong");
  checks.report("BF16 encoding of every BF16 value gives it back", bad_bf16_back == 0,
                std::to_string(bad_bf16_back) + " wrong");
}

/// Rounding to nearest even at ties, overflow, underflow and NaN.
void check_rounding(Checks& checks) {
  using safetensors::float_to_bf16;
  using safetensors::float_to_f16;
  const struct {
    float in;
    std::uint16_t f16, bf16;
  } cases[] = {{1.0f + std::ldexp(1.0f, -11), 0x3c00, 0x3f80},      // f16 tie: to even
               {1.0f + 3 * std::ldexp(1.0f, -11), 0x3c02, 0x3f80},  // f16 tie: up to even
               {1.0f + std::ldexp(1.0f, -8), 0x3c04, 0x3f80},       // bf16 tie: to even
               {1.0f + 3 * std::ldexp(1.0f, -8), 0x3c0c, 0x3f82},   // bf16 tie: up to even
               {65519.0f, 0x7bff, 0x4780},                          // f16: below the tie
               {65520.0f, 0x7c00, 0x4780},                          // f16: tie to infinity
               {std::ldexp(1.0f, -25), 0x0000, 0x3300},             // f16: tie to zero
               {3 * std::ldexp(1.0f, -25), 0x0002, 0x33c0},         // f16 subnormal tie: up
               {-std::ldexp(1.0f, -14), 0x8400, 0xb880},            // smallest f16 normal
               {3.4028235e38f, 0x7c00, 0x7f80},                     // bf16: rounds to infinity
               {-INFINITY, 0xfc00, 0xff80}};
  int bad = 0;
  for (const auto& c : cases) bad += float_to_f16(c.in) != c.f16 || float_to_bf16(c.in) != c.bf16;
  bad += !std::isnan(safetensors::f16_to_float(float_to_f16(NAN)));
  bad += !std::isnan(safetensors::bf16_to_float(float_to_bf16(NAN)));
  checks.report("F16 / BF16 rounding: ties to even, overflow, underflow, NaN", bad == 0,
                std::to_string(bad) + " wrong");
}

/// Special values through a file, into float and double, from F16 and BF16 tensors.
void check_special_values_in_file(Checks& checks, const Env& env) {
  const std::vector<std::uint16_t> patterns = {0x0001, 0x03ff, 0x0400, 0x8000, 0x3c00,
                                               0x7bff, 0x7c00, 0xfc00, 0x7e00, 0x0080};
  std::string bytes;
  for (std::uint16_t p : patterns) bytes += std::string{char(p & 0xff), char(p >> 8)};
  const std::vector<std::int64_t> shape = {std::int64_t(patterns.size())};
  safetensors::Writer w;
  w.add_raw("f16", "F16", shape, bytes);
  w.add_raw("bf16", "BF16", shape, bytes);
  const safetensors::File file(env.write("special.safetensors", w.bytes()));
  std::vector<float> f(patterns.size());
  std::vector<double> d(patterns.size());
  std::vector<dcmha::half> h(patterns.size());
  std::vector<dcmha::bf16> b(patterns.size());
  int bad = 0;
  for (const char* name : {"f16", "bf16"}) {
    const bool is_f16 = name[0] == 'f';
    file.read(*file.find(name), f.data());
    file.read(*file.find(name), d.data());
    if (is_f16)
      file.read(*file.find(name), h.data());
    else
      file.read(*file.find(name), b.data());
    for (std::size_t i = 0; i < patterns.size(); ++i) {
      const double want = is_f16 ? f16_reference(patterns[i]) : bf16_reference(patterns[i]);
      const double own = is_f16 ? static_cast<double>(h[i]) : static_cast<double>(b[i]);
      bad += !same_value(f[i], want) || !same_value(d[i], want) || !same_value(own, want);
    }
  }
  checks.report(
      "special values (subnormal, -0, max, inf, NaN) read from a file into float, "
      "double and the file's own half type",
      bad == 0, std::to_string(bad) + " wrong");
}

// ---------------------------------------------------------------------------------------------
// Loading

template <class T>
void check_round_trip(Checks& checks, const Env& env, DType dtype, const char* type_name) {
  const std::string path =
      env.write(std::string("layers_") + safetensors::dtype_name(dtype) + ".safetensors",
                env.two_layers(dtype).bytes());
  const auto loaded = dcformer::load_layer_weights<T>(path, env.cfg, 1);
  const std::string diff = difference(loaded, stored_copy<T>(env.layer1, dtype));
  checks.report(std::string("round trip ") + safetensors::dtype_name(dtype) + " -> " + type_name +
                    " (layer 1 of 2, every parameter exactly)",
                diff.empty(), diff);
}

template <class T>
void check_forward(Checks& checks, const Env& env, DType dtype, const char* type_name) {
  const std::string path =
      env.path(std::string("layers_") + safetensors::dtype_name(dtype) + ".safetensors");
  const auto loaded = dcformer::load_layer_weights<T>(path, env.cfg, 1);
  const auto memory = stored_copy<T>(env.layer1, dtype);
  const std::vector<T> a = layer_output(env.cfg, loaded.views());
  const std::vector<T> b = layer_output(env.cfg, memory.views());
  checks.report(std::string("forward on loaded ") + safetensors::dtype_name(dtype) +
                    " weights equals forward on them in memory (" + type_name + ", bitwise)",
                a == b);
}

/// The layer in a half type T on weights loaded straight into T against the float layer on the
/// same file: max|y_T - y_float| / max(1, max|y_float|) within `tolerance`.
template <class T>
void check_half_against_float(Checks& checks, const Env& env, DType dtype, const char* type_name,
                              double tolerance) {
  const std::string path =
      env.path(std::string("layers_") + safetensors::dtype_name(dtype) + ".safetensors");
  const std::vector<T> narrow =
      layer_output(env.cfg, dcformer::load_layer_weights<T>(path, env.cfg, 1).views());
  const std::vector<float> wide =
      layer_output(env.cfg, dcformer::load_layer_weights<float>(path, env.cfg, 1).views());
  double diff = 0.0, scale = 1.0;
  for (std::size_t i = 0; i < wide.size(); ++i) {
    const double d = std::fabs(static_cast<double>(narrow[i]) - double(wide[i]));
    diff = std::isnan(d) ? INFINITY : std::max(diff, d);
    scale = std::max(scale, std::fabs(double(wide[i])));
  }
  char detail[96];
  std::snprintf(detail, sizeof detail, "error %.3g, tolerance %.0e", diff / scale, tolerance);
  checks.report(std::string("forward in ") + type_name + " on loaded " +
                    safetensors::dtype_name(dtype) + " weights against the float forward",
                diff / scale <= tolerance, detail);
}

void check_static_w(Checks& checks, const Env& env) {
  const LayerWeightStorage<float> sw = random_layer(env.cfg, true, 3);
  safetensors::Writer w;
  dcformer::add_layer_weights(w, sw, 1, DType::f32);
  const safetensors::File file(env.write("static_w.safetensors", w.bytes()));
  LoadOptions with;
  with.static_w = true;
  const auto loaded = dcformer::load_layer_weights<float>(file, env.cfg, 1, with);
  std::string diff = difference(loaded, stored_copy<float>(sw, DType::f32));
  const auto pre = loaded.static_w_pre();
  if (diff.empty() && (pre.empty() || pre.shape != dcmha::Shape<3>{2, 2, 2}))
    diff = "static_w_pre(): expected a (G, M, M) = (2, 2, 2) view";
  checks.report("static W: pre_proj.w / post_proj.w loaded, (G, M, M), without the identity",
                diff.empty(), diff);
  const auto without = dcformer::load_layer_weights<float>(file, env.cfg, 1);
  checks.report("static W: pre_proj.w / post_proj.w ignored without LoadOptions::static_w",
                without.pre_w.empty() && without.post_w.empty() && without.wqkv == sw.wqkv);
  expect_refusal(
      checks, "refuses static W requested but absent",
      [&] {
        dcformer::load_layer_weights<float>(env.path("layers_F32.safetensors"), env.cfg, 1, with);
      },
      {kLayer1 + "dyn_w_proj.pre_proj.w", "not found", "expected a tensor of shape (2, 2, 2)"});
}

/// The official inference code's merged copies (dw_m, qkw_m, sw) are ignored.
void check_merged_copies(Checks& checks, const Env& env) {
  safetensors::Writer w = env.two_layers(DType::bf16);
  const LayerConfig& c = env.cfg;
  const std::int64_t K = c.hidden(), M = c.M();
  w.add(kLayer1 + "dyn_w_proj.dw_m", DType::bf16, {c.E, 4 * K + 4 * M},
        std::vector<float>(std::size_t(c.E * (4 * K + 4 * M)), 9.0f));
  w.add(kLayer1 + "dyn_w_proj.qkw_m", DType::bf16, {4, K, 2 * c.R * M},
        std::vector<float>(std::size_t(4 * K * 2 * c.R * M), 9.0f));
  w.add_raw(kLayer1 + "dyn_w_proj.sw", "F8_E4M3", {2, c.H, c.H}, std::string(2 * 16, '\x7f'));
  const std::string path = env.write("merged.safetensors", w.bytes());
  const auto loaded = dcformer::load_layer_weights<float>(path, c, 1);
  const std::string diff = difference(loaded, stored_copy<float>(env.layer1, DType::bf16));
  checks.report("merged copies dw_m, qkw_m, sw (any dtype) ignored", diff.empty(), diff);
}

/// dw1 as (E, G·4·K) and dd as (E, G·4M): the official axes merged.
void check_merged_axes(Checks& checks, const Env& env) {
  Parts p = split_file(env.two_layers(DType::f32).bytes());
  const LayerConfig& c = env.cfg;
  p.header[kLayer1 + "dyn_w_proj.dw1"]["shape"] = {c.E, c.G * 4 * c.hidden()};
  p.header[kLayer1 + "dyn_w_proj.dd"]["shape"] = {c.E, c.G * 4 * c.M()};
  const std::string path =
      env.write("merged_axes.safetensors", safetensors::assemble(p.header.dump(), p.data));
  const auto loaded = dcformer::load_layer_weights<float>(path, c, 1);
  const std::string diff = difference(loaded, stored_copy<float>(env.layer1, DType::f32));
  checks.report("dw1 stored (E, G*4*K), dd stored (E, G*4M): accepted, same values", diff.empty(),
                diff);
}

/// wq, wk, wv in place of wqkv (rows concatenated), and a name prefix.
void check_split_qkv_and_prefix(Checks& checks, const Env& env) {
  LoadOptions o;
  o.prefix = "model.";
  Parts p = split_file(env.two_layers(DType::f32, o).bytes());
  const std::string base = "model." + kLayer1;
  const auto wqkv = p.header[base + "wqkv.weight"];
  p.header.erase(base + "wqkv.weight");
  const std::int64_t row = env.cfg.E * 4, q_rows = env.cfg.H * env.cfg.D;
  const std::int64_t kv_rows = env.cfg.Hk * env.cfg.D, begin = wqkv["data_offsets"][0];
  const std::int64_t starts[] = {begin, begin + q_rows * row, begin + (q_rows + kv_rows) * row};
  const std::int64_t rows[] = {q_rows, kv_rows, kv_rows};
  const char* names[] = {"wq.weight", "wk.weight", "wv.weight"};
  for (int i = 0; i < 3; ++i)
    p.header[base + names[i]] = {{"dtype", "F32"},
                                 {"shape", {rows[i], env.cfg.E}},
                                 {"data_offsets", {starts[i], starts[i] + rows[i] * row}}};
  const std::string path =
      env.write("split_qkv.safetensors", safetensors::assemble(p.header.dump(), p.data));
  const auto loaded = dcformer::load_layer_weights<float>(path, env.cfg, 1, o);
  const std::string diff = difference(loaded, stored_copy<float>(env.layer1, DType::f32));
  checks.report("prefix 'model.' and wq/wk/wv in place of wqkv", diff.empty(), diff);
}

/// An MHA config reads wqkv, wo (and the norms) and ignores the dyn_w_proj tensors.
void check_mha(Checks& checks, const Env& env) {
  LayerConfig mha = env.cfg;
  mha.compose = false;
  const auto loaded =
      dcformer::load_layer_weights<float>(env.path("layers_F32.safetensors"), mha, 1);
  const bool ok = loaded.dw1.empty() && loaded.wqkv == env.layer1.wqkv &&
                  loaded.k_norm == env.layer1.k_norm && loaded.views().dw1.empty();
  const std::vector<float> y = layer_output(mha, loaded.views());
  checks.report("MHA config: dyn_w_proj tensors ignored, the layer runs", ok && !y.empty());
}

/// Data at odd offsets after a header whose length is not a multiple of 8.
void check_unaligned(Checks& checks, const Env& env) {
  safetensors::Writer w;
  w.add_raw("pad", "U8", {1}, std::string(1, '\0'));
  w.add("x", DType::f32, {3}, {1.5f, -2.25f, 1e-40f});
  w.add("y", DType::f64, {2}, {0.1f, -3.0f});
  w.set_metadata("format", "pt");
  std::string text = w.header().dump();
  while ((8 + text.size()) % 8 != 2) text += ' ';  // x at 3, y at 15 (mod 8): both unaligned
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i)
    bytes[std::size_t(i)] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  bytes += text + w.data();
  const safetensors::File file(env.write("unaligned.safetensors", bytes));
  std::vector<double> x(3), y(2);
  file.read(*file.find("x"), x.data());
  file.read(*file.find("y"), y.data());
  const bool ok = x == std::vector<double>{1.5, -2.25, double(1e-40f)} &&
                  y == std::vector<double>{double(0.1f), -3.0} &&
                  file.metadata().at("format") == "pt";
  checks.report("unaligned data, F32 subnormal, F64, metadata", ok);
}

// ---------------------------------------------------------------------------------------------
// Refusals

/// Header entries that lie about the data, and malformed entries.
void check_lying_headers(Checks& checks, const Env& env) {
  const std::string good = env.two_layers(DType::f32).bytes();
  const std::string qkw = kLayer1 + "dyn_w_proj.qkw", dw1 = kLayer1 + "dyn_w_proj.dw1";
  const std::uint64_t size = split_file(good).data.size();
  expect_corrupt(checks, env, "end beyond the data",
                 altered(good, [&](nlohmann::json& h) { h[qkw]["data_offsets"][1] = size + 4; }),
                 {qkw, "expected end <= " + std::to_string(size)});
  expect_corrupt(checks, env, "begin > end",
                 altered(good,
                         [&](nlohmann::json& h) {
                           h[qkw]["data_offsets"] = {100, 50};
                         }),
                 {qkw, "expected begin <= end"});
  expect_corrupt(checks, env, "size not shape x dtype",
                 altered(good,
                         [&](nlohmann::json& h) {
                           h[qkw]["shape"] = {2, 4, 8, 4, 3};
                         }),
                 {qkw, "expected 768 x 4 bytes", "got 2048"});
  expect_corrupt(checks, env, "overlapping tensors",
                 altered(good,
                         [&](nlohmann::json& h) {
                           const std::uint64_t b = h[dw1]["data_offsets"][0];
                           h[qkw]["data_offsets"] = {b + 4, b + 4 + 2048};
                         }),
                 {qkw, dw1, "overlaps", "expected disjoint"});
  expect_corrupt(checks, env, "entry not an object",
                 altered(good, [&](nlohmann::json& h) { h[qkw] = 5; }),
                 {qkw, "expected an object"});
  expect_corrupt(checks, env, "negative shape",
                 altered(good, [&](nlohmann::json& h) { h[qkw]["shape"][0] = -2; }),
                 {qkw, "expected non-negative integers"});
  expect_corrupt(checks, env, "element count overflow",
                 altered(good,
                         [&](nlohmann::json& h) {
                           h[qkw]["shape"] = {1ull << 40, 1ull << 40};
                         }),
                 {qkw, "expected at most"});
  expect_corrupt(checks, env, "data_offsets of three numbers",
                 altered(good,
                         [&](nlohmann::json& h) {
                           h[qkw]["data_offsets"] = {0, 4, 8};
                         }),
                 {qkw, "expected [begin, end]"});
  expect_corrupt(checks, env, "__metadata__ not an object",
                 altered(good, [&](nlohmann::json& h) { h["__metadata__"] = 1; }),
                 {"__metadata__", "expected an object"});
}

/// Tensors that are well-formed but not what the layer needs.
void check_wrong_tensors(Checks& checks, const Env& env) {
  const std::string good = env.two_layers(DType::f32).bytes();
  const std::string qkw = kLayer1 + "dyn_w_proj.qkw";
  expect_corrupt(checks, env, "unknown dtype string",
                 altered(good, [&](nlohmann::json& h) { h[qkw]["dtype"] = "F33"; }),
                 {qkw, "expected BF16, F16, F32 or F64, got 'F33'"});
  expect_corrupt(checks, env, "integer dtype",
                 altered(good, [&](nlohmann::json& h) { h[qkw]["dtype"] = "I32"; }),
                 {qkw, "expected BF16, F16, F32 or F64, got 'I32'"});
  expect_corrupt(checks, env, "wrong shape (same count)",
                 altered(good,
                         [&](nlohmann::json& h) {
                           h[qkw]["shape"] = {2, 4, 8, 2, 4};
                         }),
                 {qkw, "expected shape (2, 4, 8, 4, 2)", "got (2, 4, 8, 2, 4)"});
  expect_corrupt(checks, env, "missing tensor",
                 altered(good, [&](nlohmann::json& h) { h.erase(qkw); }),
                 {qkw, "not found", "expected a tensor of shape (2, 4, 8, 4, 2)"});
  // An unknown dtype is fine on a tensor the loader does not need, as long as it is in bounds.
  Parts p = split_file(good);
  p.header["extra"] = {{"dtype", "XYZ"}, {"shape", {3}}, {"data_offsets", {0, 0}}};
  const std::string ok_path =
      env.write("extra_ok.safetensors", safetensors::assemble(p.header.dump(), p.data));
  bool loaded = true;
  try {
    dcformer::load_layer_weights<float>(ok_path, env.cfg, 1);
  } catch (const std::exception&) {
    loaded = false;
  }
  checks.report("an unneeded tensor of unknown dtype, in bounds, is ignored", loaded);
  p.header["extra"]["data_offsets"] = {0, p.data.size() + 1};
  expect_corrupt(checks, env, "an unneeded tensor out of bounds",
                 safetensors::assemble(p.header.dump(), p.data), {"'extra'", "expected end <="});
}

/// Files cut short, lengths that lie, headers that are not JSON objects.
void check_broken_files(Checks& checks, const Env& env) {
  const std::string good = env.two_layers(DType::f32).bytes();
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = n << 8 | static_cast<unsigned char>(good[std::size_t(i)]);
  const auto with_length = [&](std::uint64_t len) {
    std::string b = good;
    for (int i = 0; i < 8; ++i) b[std::size_t(i)] = static_cast<char>((len >> (8 * i)) & 0xff);
    return b;
  };
  expect_corrupt(checks, env, "truncated data", good.substr(0, good.size() - 3),
                 {kLayer1 + "k_norm.scale", "expected end <="});
  expect_corrupt(checks, env, "truncated header", good.substr(0, 8 + n / 2),
                 {"header length", "exceeds the file", "expected at most"});
  expect_corrupt(checks, env, "file of 5 bytes", good.substr(0, 5),
                 {"expected at least 8 bytes", "got 5"});
  expect_corrupt(checks, env, "empty file", "", {"expected at least 8 bytes", "got 0"});
  const std::uint64_t beyond = good.size() - 8 + 1;
  expect_corrupt(checks, env, "header length larger than the file", with_length(beyond),
                 {"header length " + std::to_string(beyond), "exceeds the file",
                  "expected at most " + std::to_string(beyond - 1)});
  expect_corrupt(checks, env, "header length reaching into the data", with_length(n + 1000),
                 {"header", "expected JSON"});
  expect_corrupt(checks, env, "header length 2^64 - 1", with_length(~std::uint64_t(0)),
                 {"exceeds the file", "expected at most"});
  const std::string data = split_file(good).data;
  expect_corrupt(checks, env, "non-JSON header", safetensors::assemble("{\"a\": [1, 2", data),
                 {"header", "expected JSON"});
  expect_corrupt(checks, env, "header not an object", safetensors::assemble("[1, 2, 3]", data),
                 {"header", "expected a JSON object", "array"});
  std::string text = split_file(good).header.dump();
  text.insert(1, "\"" + kLayer1 +
                     "wo.weight\":{\"dtype\":\"F32\",\"shape\":[0],"
                     "\"data_offsets\":[0,0]},");
  expect_corrupt(checks, env, "a name twice", safetensors::assemble(text, data),
                 {kLayer1 + "wo.weight", "expected each name once"});
}

/// Arguments and configs that do not match the file.
void check_mismatches(Checks& checks, const Env& env) {
  const std::string path = env.path("layers_F32.safetensors");
  LayerConfig no_norm = env.cfg;
  no_norm.qk_norm = false;
  expect_refusal(checks, "refuses qk-norm scales with config.qk_norm off",
                 [&] { dcformer::load_layer_weights<float>(path, no_norm, 1); },
                 {kLayer1 + "q_norm.scale", "file '" + path + "'", "set config.qk_norm"});
  expect_refusal(
      checks, "refuses a layer the file lacks",
      [&] { dcformer::load_layer_weights<float>(path, env.cfg, 2); },
      {"layers.2.attention.wqkv.weight", "not found", "0 of them under 'layers.2.attention.'"});
  expect_refusal(checks, "refuses a negative layer index",
                 [&] { dcformer::load_layer_weights<float>(path, env.cfg, -1); },
                 {"layer", "expected >= 0"});
  LayerConfig wide = env.cfg;
  wide.E = 64;
  expect_refusal(checks, "refuses another model size",
                 [&] { dcformer::load_layer_weights<float>(path, wide, 1); },
                 {kLayer1 + "wqkv.weight", "expected shape (64, 64)", "got (64, 32)"});
  expect_refusal(
      checks, "refuses a file that does not exist",
      [&] { dcformer::load_layer_weights<float>(env.path("absent.safetensors"), env.cfg, 1); },
      {"file '" + env.path("absent.safetensors") + "'", "cannot open"});
}

int write_mode(const std::string& path, const std::string& dtype_name) {
  const DType dtype = safetensors::parse_dtype(dtype_name);
  if (dtype != DType::bf16 && dtype != DType::f16 && dtype != DType::f32) {
    std::fprintf(stderr, "dtype: expected BF16, F16 or F32, got '%s'\n", dtype_name.c_str());
    return 2;
  }
  const LayerConfig c = test_config();
  safetensors::Writer w;
  dcformer::add_layer_weights(w, random_layer(c, false, 1), 0, dtype);
  w.write(path);
  std::printf("wrote %s: layer 0, %s, E=%ld H=%ld Hk=%ld D=%ld G=%ld R=%ld K=%ld qk_norm=1\n",
              path.c_str(), dtype_name.c_str(), long(c.E), long(c.H), long(c.Hk), long(c.D),
              long(c.G), long(c.R), long(c.hidden()));
  return 0;
}

void run_checks(Checks& checks, const Env& env) {
  check_conversions(checks);
  check_rounding(checks);
  check_special_values_in_file(checks, env);
  for (DType d : {DType::f32, DType::bf16, DType::f16}) {
    check_round_trip<float>(checks, env, d, "float");
    check_round_trip<double>(checks, env, d, "double");
  }
  check_round_trip<dcmha::bf16>(checks, env, DType::bf16, "bf16");
  check_round_trip<dcmha::half>(checks, env, DType::f16, "half");
  check_forward<float>(checks, env, DType::f32, "float");
  check_forward<float>(checks, env, DType::bf16, "float");
  check_forward<double>(checks, env, DType::f16, "double");
  check_forward<dcmha::bf16>(checks, env, DType::bf16, "bf16");
  check_forward<dcmha::half>(checks, env, DType::f16, "half");
  check_half_against_float<dcmha::bf16>(checks, env, DType::bf16, "bf16", 2e-2);
  check_half_against_float<dcmha::half>(checks, env, DType::f16, "half", 3e-3);
  check_static_w(checks, env);
  check_merged_copies(checks, env);
  check_merged_axes(checks, env);
  check_split_qkv_and_prefix(checks, env);
  check_mha(checks, env);
  check_unaligned(checks, env);
  check_lying_headers(checks, env);
  check_wrong_tensors(checks, env);
  check_broken_files(checks, env);
  check_mismatches(checks, env);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "--write")
    return write_mode(argv[2], argc >= 4 ? argv[3] : "BF16");
  if (argc != 1) {
    std::fprintf(stderr, "usage: %s [--write FILE [BF16|F16|F32]]\n", argv[0]);
    return 2;
  }
  std::string dir = (fs::temp_directory_path() / "dcformer_safetensors_XXXXXX").string();
  if (!mkdtemp(dir.data())) {
    std::perror("mkdtemp");
    return 1;
  }
  Checks checks;
  Env env;
  env.dir = dir;
  try {
    run_checks(checks, env);
  } catch (const std::exception& e) {
    checks.report("unexpected exception", false, e.what());
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
  std::printf("%d of %d checks passed\n", checks.total - checks.failed, checks.total);
  return checks.failed == 0 ? 0 : 1;
}

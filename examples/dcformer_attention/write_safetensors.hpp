#pragma once
// Writes safetensors files in the format safetensors.hpp reads, and a layer's parameters under
// the official DCFormer names (load_weights.hpp). The tests build their files with it; it also
// hands weights from C++ to PyTorch (safetensors.torch.load_file reads these files).
//
//   safetensors::Writer w;
//   dcformer::add_layer_weights(w, storage, /*layer=*/0, safetensors::DType::bf16);
//   w.write("layer0.safetensors");
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "load_weights.hpp"
#include "safetensors.hpp"

namespace safetensors {

/// binary32 to bf16, rounded to nearest even (overflow gives infinity); NaN stays a quiet NaN.
inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

namespace detail {

/// Rounds m >> shift to nearest even.
inline std::uint32_t shift_right_even(std::uint32_t m, std::uint32_t shift) {
  const std::uint32_t kept = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
  return kept + (rest > half || (rest == half && (kept & 1u)));
}

}  // namespace detail

/// binary32 to binary16, rounded to nearest even: magnitudes from 65520 up become infinity,
/// those below 2^-14 binary16 subnormals (2^-25 and below: zero); NaN stays a quiet NaN.
inline std::uint16_t float_to_f16(float f) {
  const std::uint32_t u = bits_of(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  std::uint32_t h;
  if (a > 0x7f800000u)
    h = 0x7e00u | ((a >> 13) & 0x3ffu);  // NaN: quiet bit set, top payload bits kept
  else if (a >= 0x477ff000u)             // >= 65520, halfway from 65504 to 2^16: ties go up
    h = 0x7c00u;
  else if (a >= 0x38800000u)  // normal: rebias 127 to 15; a carry into the exponent is right
    h = detail::shift_right_even(a - (112u << 23), 13);
  else if (a > 0x33000000u)  // subnormal: round(value · 2^24), value = 1.m · 2^(e - 127)
    h = detail::shift_right_even((a & 0x7fffffu) | 0x800000u, 126u - (a >> 23));
  else
    h = 0;
  return static_cast<std::uint16_t>(sign | h);
}

/// The value a float reads back as after being stored as dtype.
inline float round_to(DType dtype, float f) {
  if (dtype == DType::bf16) return bf16_to_float(float_to_bf16(f));
  if (dtype == DType::f16) return f16_to_float(float_to_f16(f));
  return f;
}

/// A safetensors file from its header text and data buffer. The header is padded with spaces
/// to a multiple of 8 bytes, as the reference writer does, so that the data buffer is aligned.
inline std::string assemble(std::string header_text, const std::string& data) {
  while ((8 + header_text.size()) % 8 != 0) header_text += ' ';
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<char>((std::uint64_t(header_text.size()) >> (8 * i)) & 0xffu);
  return out + header_text + data;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.flush()) detail::fail("safetensors: file '", path, "': cannot write");
}

/// Collects tensors (data appended in the order added) and writes them as one file.
class Writer {
 public:
  /// Adds numel(shape) values stored as dtype (BF16 and F16 rounded to nearest even).
  void add(const std::string& name, DType dtype, const std::vector<std::int64_t>& shape,
           const std::vector<float>& values) {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;
    if (dtype == DType::other || n != static_cast<std::int64_t>(values.size()))
      detail::fail("safetensors::Writer: tensor '", name, "': expected ", n, " values (shape ",
                   shape_string(shape), ") of BF16, F16, F32 or F64, got ", values.size(), " of ",
                   dtype_name(dtype));
    add_raw(name, dtype_name(dtype), shape, encode(dtype, values));
  }

  /// Adds an entry of any dtype string and raw bytes: entries a reader must ignore or refuse.
  void add_raw(const std::string& name, const std::string& dtype,
               const std::vector<std::int64_t>& shape, const std::string& bytes) {
    header_[name] = {{"dtype", dtype},
                     {"shape", shape},
                     {"data_offsets", {data_.size(), data_.size() + bytes.size()}}};
    data_ += bytes;
  }

  void set_metadata(const std::string& key, const std::string& value) {
    header_["__metadata__"][key] = value;
  }

  const nlohmann::json& header() const { return header_; }
  const std::string& data() const { return data_; }
  /// The whole file.
  std::string bytes() const { return assemble(header_.dump(), data_); }
  void write(const std::string& path) const { write_file(path, bytes()); }

 private:
  static void append_le(std::string& out, std::uint64_t bits, int bytes) {
    for (int i = 0; i < bytes; ++i) out += static_cast<char>((bits >> (8 * i)) & 0xffu);
  }
  static std::string encode(DType dtype, const std::vector<float>& values) {
    std::string out;
    for (float v : values) {
      if (dtype == DType::bf16) append_le(out, float_to_bf16(v), 2);
      if (dtype == DType::f16) append_le(out, float_to_f16(v), 2);
      if (dtype == DType::f32) append_le(out, bits_of(v), 4);
      if (dtype == DType::f64) {
        const double d = v;
        std::uint64_t bits;
        std::memcpy(&bits, &d, sizeof bits);
        append_le(out, bits, 8);
      }
    }
    return out;
  }

  nlohmann::json header_ = nlohmann::json::object();
  std::string data_;
};

}  // namespace safetensors

namespace dcformer {

/// Adds a layer's parameters under their official names (options.prefix, layer `layer`),
/// stored as dtype; static W too when the storage holds it.
inline void add_layer_weights(safetensors::Writer& writer, const LayerWeightStorage<float>& w,
                              index_t layer, safetensors::DType dtype,
                              const LoadOptions& options = {}) {
  const std::string prefix = detail::layer_prefix(options, layer);
  for (const auto& spec : detail::parameter_specs<float>(w.config, !w.pre_w.empty()))
    writer.add(prefix + spec.suffix, dtype, spec.shape, w.*spec.member);
}

}  // namespace dcformer

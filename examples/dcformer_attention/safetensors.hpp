#pragma once
// A reader of the safetensors format: an 8-byte little-endian header length N, N bytes of JSON
// header, then the data buffer.
//
//   {"NAME": {"dtype": "BF16", "shape": [d0, d1, ...], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value", ...}}
//
// Offsets are bytes from the start of the data buffer; tensors are row-major and little-endian.
// safetensors::File memory-maps the file read-only and validates the whole header when it opens
// it, before any tensor data is read: every entry is well-formed, lies inside the data buffer,
// has the byte size its shape and dtype imply (for every dtype whose element size is known), and
// no two tensors overlap. Gaps between tensors are allowed. Reading converts BF16, F16, F32 or
// F64 to float, double, Eigen::bfloat16 or Eigen::half. Every failure throws safetensors::Error
// naming the file, the tensor and what was expected.
//
// The mapping is shared with the file: a file truncated by another process while it is open makes
// reading its tail fault (SIGBUS), as with any memory-mapped file.
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace safetensors {

/// Every failure of opening, validating or reading a file.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The element types this reader converts; `other` is any other dtype string of the header.
enum class DType { bf16, f16, f32, f64, other };

inline DType parse_dtype(const std::string& name) {
  if (name == "BF16") return DType::bf16;
  if (name == "F16") return DType::f16;
  if (name == "F32") return DType::f32;
  if (name == "F64") return DType::f64;
  return DType::other;
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::other:
      break;
  }
  return "other";
}

/// Bytes per element of a dtype name of the format; 0 for a name whose size is not known here
/// (sub-byte types, names added later): the size of such a tensor is not checked.
inline std::uint64_t dtype_size(const std::string& name) {
  static const std::map<std::string, std::uint64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},
      {"U32", 4},  {"F32", 4}, {"I64", 8}, {"U64", 8},     {"F64", 8}};
  const auto it = sizes.find(name);
  return it == sizes.end() ? 0 : it->second;
}

/// One entry of the header, validated against the file.
struct TensorInfo {
  std::string name;
  std::string dtype;                 // as the header spells it, e.g. "BF16"
  std::vector<std::int64_t> shape;   // row-major
  std::uint64_t begin = 0, end = 0;  // byte range in the data buffer

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (std::int64_t d : shape) n *= d;  // cannot overflow: checked when the file was opened
    return n;
  }
};

inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::ostringstream os;
  os << '(';
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

inline float float_from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

/// bf16 is the upper half of an IEEE binary32, so widening is exact for every value: subnormals,
/// infinities and NaN payloads included.
inline float bf16_to_float(std::uint16_t h) { return float_from_bits(std::uint32_t(h) << 16); }

/// IEEE binary16 to binary32, exact. The exponent is rebiased (15 to 127); binary16 subnormals
/// are normal numbers in binary32, so their mantissa is shifted up until its leading one becomes
/// the implicit bit.
inline float f16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f)  // infinity, or NaN with its payload (the quiet bit stays the top one)
    return float_from_bits(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return float_from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return float_from_bits(sign);  // signed zero
  std::uint32_t biased = 113;  // mantissa · 2^-24 = 1.f · 2^(biased - 127) once normalized
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    --biased;
  }
  return float_from_bits(sign | (biased << 23) | ((mantissa & 0x3ffu) << 13));
}

namespace detail {

template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Error(os.str());
}

/// The format's own bound (the reference implementation refuses larger headers).
constexpr std::uint64_t kMaxHeaderBytes = 100000000;

// Little-endian loads from unaligned bytes: a tensor's offset need not be a multiple of its
// element size, and the host's byte order does not matter.
inline std::uint16_t load_u16(const unsigned char* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}
inline std::uint32_t load_u32(const unsigned char* p) {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 |
         std::uint32_t(p[3]) << 24;
}
inline std::uint64_t load_u64(const unsigned char* p) {
  return std::uint64_t(load_u32(p)) | std::uint64_t(load_u32(p + 4)) << 32;
}

/// a · b, or false when it would exceed `limit`.
inline bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t limit, std::uint64_t& out) {
  if (a != 0 && b > limit / a) return false;
  out = a * b;
  return true;
}

/// A read-only memory mapping of a whole file, unmapped on destruction.
class Mapping {
 public:
  Mapping() = default;
  explicit Mapping(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("safetensors: file '", path, "': cannot open: ", std::strerror(errno));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      fail("safetensors: file '", path, "': cannot stat: ", std::strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      fail("safetensors: file '", path, "': expected a regular file, got another kind");
    }
    size_ = static_cast<std::size_t>(st.st_size);
    void* p = size_ > 0 ? ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0) : nullptr;
    const int err = errno;
    ::close(fd);  // the mapping keeps the file open
    if (p == MAP_FAILED) fail("safetensors: file '", path, "': cannot map: ", std::strerror(err));
    data_ = static_cast<const unsigned char*>(p);
  }
  Mapping(Mapping&& o) noexcept { swap(o); }
  Mapping& operator=(Mapping&& o) noexcept {
    Mapping(std::move(o)).swap(*this);
    return *this;
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), size_);
  }

  const unsigned char* data() const { return data_; }
  std::uint64_t size() const { return size_; }

 private:
  void swap(Mapping& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
  }
  const unsigned char* data_ = nullptr;
  std::size_t size_ = 0;
};

/// N, checked against the file: the header must fit in it.
inline std::uint64_t header_length(const Mapping& m, const std::string& path) {
  if (m.size() < 8)
    fail("safetensors: file '", path, "': expected at least 8 bytes (the header length), got ",
         m.size());
  const std::uint64_t n = load_u64(m.data());
  if (n > m.size() - 8)
    fail("safetensors: file '", path, "': header length ", n,
         " exceeds the file: expected at most ", m.size() - 8,
         " (the bytes after the 8-byte length); truncated or not safetensors");
  if (n > kMaxHeaderBytes)
    fail("safetensors: file '", path, "': header length ", n, ": expected at most ",
         kMaxHeaderBytes, " bytes");
  return n;
}

/// The header as a JSON object, refusing duplicate top-level names (the DOM keeps only one).
inline nlohmann::json parse_header(const unsigned char* text, std::uint64_t n,
                                   const std::string& path) {
  std::set<std::string> names;
  std::string duplicate;
  const nlohmann::json::parser_callback_t note_names =
      [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
        if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string() &&
            !names.insert(parsed.get<std::string>()).second && duplicate.empty())
          duplicate = parsed.get<std::string>();
        return true;
      };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, text + n, note_names);
  } catch (const nlohmann::json::exception& e) {
    fail("safetensors: file '", path, "': header: expected JSON, got a parse error: ", e.what());
  }
  if (!header.is_object())
    fail("safetensors: file '", path, "': header: expected a JSON object, got a JSON ",
         header.type_name());
  if (!duplicate.empty())
    fail("safetensors: file '", path, "': tensor '", duplicate,
         "': expected each name once in the header, got it twice");
  return header;
}

inline std::vector<std::int64_t> parse_shape(const nlohmann::json& entry,
                                             const std::string& where) {
  const auto it = entry.find("shape");
  if (it == entry.end() || !it->is_array())
    fail(where, ": shape: expected an array of non-negative integers");
  std::vector<std::int64_t> shape;
  std::uint64_t numel = 1;
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  for (const nlohmann::json& d : *it) {
    if (!d.is_number_unsigned())
      fail(where, ": shape: expected non-negative integers, got ", d.dump());
    const auto v = d.get<std::uint64_t>();
    if (!checked_mul(numel, v, kMax, numel))
      fail(where, ": shape ", it->dump(), ": expected at most ", kMax, " elements in all");
    shape.push_back(static_cast<std::int64_t>(v));
  }
  return shape;
}

inline std::pair<std::uint64_t, std::uint64_t> parse_offsets(const nlohmann::json& entry,
                                                             const std::string& where) {
  const auto it = entry.find("data_offsets");
  if (it == entry.end() || !it->is_array() || it->size() != 2 || !(*it)[0].is_number_unsigned() ||
      !(*it)[1].is_number_unsigned())
    fail(where, ": data_offsets: expected [begin, end], two non-negative integers, got ",
         it == entry.end() ? std::string("none") : it->dump());
  return {(*it)[0].get<std::uint64_t>(), (*it)[1].get<std::uint64_t>()};
}

/// One header entry, checked for form and against the data buffer's size.
inline TensorInfo parse_entry(const std::string& name, const nlohmann::json& entry,
                              std::uint64_t data_size, const std::string& path) {
  const std::string where = "safetensors: file '" + path + "': tensor '" + name + "'";
  if (!entry.is_object())
    fail(where, ": expected an object {dtype, shape, data_offsets}, got ", entry.type_name());
  const auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string())
    fail(where, ": dtype: expected a string such as \"BF16\"");
  TensorInfo t{name, dtype->get<std::string>(), parse_shape(entry, where), 0, 0};
  std::tie(t.begin, t.end) = parse_offsets(entry, where);
  if (t.begin > t.end)
    fail(where, ": data_offsets [", t.begin, ", ", t.end, "]: expected begin <= end");
  if (t.end > data_size)
    fail(where, ": data_offsets [", t.begin, ", ", t.end, "]: expected end <= ", data_size,
         " (the size of the data buffer); truncated or a wrong offset");
  const std::uint64_t element = dtype_size(t.dtype);
  std::uint64_t bytes = 0;
  if (element != 0 && (!checked_mul(static_cast<std::uint64_t>(t.numel()), element,
                                    std::numeric_limits<std::uint64_t>::max(), bytes) ||
                       bytes != t.end - t.begin))
    fail(where, ": data_offsets [", t.begin, ", ", t.end, "]: expected ", t.numel(), " x ", element,
         " bytes (shape ", shape_string(t.shape), ", dtype ", t.dtype, "), got ", t.end - t.begin);
  return t;
}

inline std::map<std::string, std::string> parse_metadata(const nlohmann::json& m,
                                                         const std::string& path) {
  if (!m.is_object())
    fail("safetensors: file '", path, "': __metadata__: expected an object of strings, got ",
         m.type_name());
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : m.items()) {
    if (!value.is_string())
      fail("safetensors: file '", path, "': __metadata__.", key, ": expected a string, got ",
           value.type_name());
    out[key] = value.get<std::string>();
  }
  return out;
}

/// No byte belongs to two tensors.
inline void check_no_overlap(const std::map<std::string, TensorInfo>& tensors,
                             const std::string& path) {
  std::vector<const TensorInfo*> by_offset;
  for (const auto& entry : tensors) by_offset.push_back(&entry.second);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  for (std::size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo& a = *by_offset[i - 1];
    const TensorInfo& b = *by_offset[i];
    if (b.begin < a.end)
      fail("safetensors: file '", path, "': tensor '", b.name, "' [", b.begin, ", ", b.end,
           ") overlaps tensor '", a.name, "' [", a.begin, ", ", a.end,
           "): expected disjoint data_offsets");
  }
}

/// Converts n elements stored as `dtype` at src (unaligned, little-endian) to T.
template <class T>
void convert(DType dtype, const unsigned char* src, std::size_t n, T* out) {
  switch (dtype) {
    case DType::bf16:
      for (std::size_t i = 0; i < n; ++i)
        out[i] = static_cast<T>(bf16_to_float(load_u16(src + 2 * i)));
      return;
    case DType::f16:
      for (std::size_t i = 0; i < n; ++i)
        out[i] = static_cast<T>(f16_to_float(load_u16(src + 2 * i)));
      return;
    case DType::f32:
      for (std::size_t i = 0; i < n; ++i)
        out[i] = static_cast<T>(float_from_bits(load_u32(src + 4 * i)));
      return;
    case DType::f64:
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint64_t u = load_u64(src + 8 * i);
        double d;
        std::memcpy(&d, &u, sizeof d);
        out[i] = static_cast<T>(d);  // to float: rounded to nearest
      }
      return;
    case DType::other:
      break;
  }
  fail("safetensors: convert: unsupported dtype");
}

}  // namespace detail

/// An open safetensors file: the mapping and its validated header.
class File {
 public:
  /// Maps and validates the file; throws Error naming the file and the problem.
  explicit File(const std::string& path) : path_(path), mapping_(path) {
    const std::uint64_t n = detail::header_length(mapping_, path_);
    const nlohmann::json header = detail::parse_header(mapping_.data() + 8, n, path_);
    data_ = mapping_.data() + 8 + n;
    data_size_ = mapping_.size() - 8 - n;
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__")
        metadata_ = detail::parse_metadata(entry, path_);
      else
        tensors_[name] = detail::parse_entry(name, entry, data_size_, path_);
    }
    detail::check_no_overlap(tensors_, path_);
  }

  const std::string& path() const { return path_; }
  /// Every tensor of the header, by name.
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::uint64_t data_size() const { return data_size_; }

  /// The tensor of that name, or null.
  const TensorInfo* find(const std::string& name) const {
    const auto it = tensors_.find(name);
    return it == tensors_.end() ? nullptr : &it->second;
  }

  /// The tensor's end - begin bytes, inside the mapping (valid while the File lives).
  const unsigned char* bytes(const TensorInfo& t) const { return data_ + t.begin; }

  /// Converts a tensor of this file to T into out[0, numel): its dtype must be BF16, F16, F32 or
  /// F64. Exact wherever T holds every value of the dtype (BF16 and F16 to float, double and their
  /// own type); otherwise rounded to nearest even (F64 to a half type through float).
  template <class T>
  void read(const TensorInfo& t, T* out) const {
    const DType dtype = parse_dtype(t.dtype);
    if (dtype == DType::other)
      detail::fail("safetensors: file '", path_, "': tensor '", t.name,
                   "': dtype: expected BF16, F16, F32 or F64, got '", t.dtype, "'");
    detail::convert(dtype, bytes(t), static_cast<std::size_t>(t.numel()), out);
  }

 private:
  std::string path_;
  detail::Mapping mapping_;
  const unsigned char* data_ = nullptr;
  std::uint64_t data_size_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace safetensors

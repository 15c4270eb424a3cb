#pragma once
// Reader of dcmha conformance case files (dcmha spec, section 4): `#` comments, `meta KEY VALUE`
// lines (VALUE is the rest of the line), and `tensor NAME d0 d1 ...` followed by the tensor's
// d0·d1·... values in row-major order (whitespace-separated, any number per line). Every problem
// is reported as a CaseError naming the file and line.
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <istream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcformer::conformance {

class CaseError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct CaseTensor {
  std::string name;
  std::vector<std::int64_t> dims;
  std::vector<double> values;
  int line = 0;  // of its `tensor` line
};

struct CaseFile {
  std::string path;
  std::map<std::string, std::string> meta;
  std::map<std::string, int> meta_line;
  std::vector<CaseTensor> tensors;

  [[noreturn]] void fail(const std::string& what, int line = 0) const {
    throw CaseError(path + (line > 0 ? ":" + std::to_string(line) : "") + ": " + what);
  }

  const CaseTensor* find(const std::string& name) const {
    for (const CaseTensor& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }

  /// The tensor, which must exist and have exactly these dims.
  const CaseTensor& tensor(const std::string& name, const std::vector<std::int64_t>& dims) const {
    const CaseTensor* t = find(name);
    if (!t) fail("missing tensor " + name + " " + dims_string(dims));
    if (t->dims != dims)
      fail("tensor " + name + ": expected dims " + dims_string(dims) + ", got " +
               dims_string(t->dims),
           t->line);
    return *t;
  }

  bool has_meta(const std::string& key) const { return meta.count(key) != 0; }

  std::string meta_string(const std::string& key) const {
    const auto it = meta.find(key);
    if (it == meta.end()) fail("missing meta " + key);
    return it->second;
  }

  /// An integer meta value; `fallback` when absent, unless required.
  std::int64_t meta_int(const std::string& key, bool required = true,
                        std::int64_t fallback = 0) const {
    if (!has_meta(key)) {
      if (required) fail("missing meta " + key);
      return fallback;
    }
    const std::string v = meta.at(key);
    char* end = nullptr;
    errno = 0;
    const long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || errno != 0 || *end != '\0')
      fail("meta " + key + ": expected an integer, got '" + v + "'", meta_line.at(key));
    return x;
  }

  static std::string dims_string(const std::vector<std::int64_t>& dims) {
    std::string s = "(";
    for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
    return s + ")";
  }
};

namespace detail {

inline std::vector<std::string> split(const std::string& line) {
  std::istringstream is(line);
  std::vector<std::string> words;
  for (std::string w; is >> w;) words.push_back(w);
  return words;
}

inline double parse_value(const CaseFile& cf, const std::string& word, int line) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(word.c_str(), &end);
  if (errno == ERANGE || *end != '\0' || !std::isfinite(v))
    cf.fail("expected a finite number, got '" + word + "'", line);
  return v;
}

inline void parse_meta(CaseFile& cf, const std::string& line, int n) {
  std::istringstream is(line);
  std::string word, key, value;
  is >> word >> key;
  std::getline(is, value);
  const std::size_t b = value.find_first_not_of(" \t"), e = value.find_last_not_of(" \t\r");
  value = b == std::string::npos ? "" : value.substr(b, e - b + 1);
  if (key.empty()) cf.fail("meta line without a key", n);
  if (cf.meta.count(key)) cf.fail("duplicate meta " + key, n);
  cf.meta[key] = value;
  cf.meta_line[key] = n;
}

/// A `tensor NAME dims...` line: the new tensor, its values still to come.
inline CaseTensor parse_tensor_header(const CaseFile& cf, const std::vector<std::string>& w,
                                      int n) {
  if (w.size() < 3) cf.fail("expected 'tensor NAME d0 d1 ...'", n);
  if (cf.find(w[1])) cf.fail("duplicate tensor " + w[1], n);
  CaseTensor t;
  t.name = w[1];
  t.line = n;
  std::int64_t count = 1;
  for (std::size_t i = 2; i < w.size(); ++i) {
    char* end = nullptr;
    const long long d = std::strtoll(w[i].c_str(), &end, 10);
    if (*end != '\0' || d <= 0 || d > (std::int64_t(1) << 31) / count)
      cf.fail("tensor " + t.name + ": bad dim '" + w[i] + "'", n);
    t.dims.push_back(d);
    count *= d;
  }
  t.values.reserve(static_cast<std::size_t>(count));
  return t;
}

inline std::size_t element_count(const CaseTensor& t) {
  std::size_t n = 1;
  for (std::int64_t d : t.dims) n *= static_cast<std::size_t>(d);
  return n;
}

}  // namespace detail

inline CaseFile parse_case_file(std::istream& in, const std::string& path) {
  CaseFile cf;
  cf.path = path;
  CaseTensor* open = nullptr;  // the tensor whose values are being read
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    const std::vector<std::string> w = detail::split(line);
    if (w.empty() || w[0][0] == '#') continue;
    const bool keyword = w[0] == "meta" || w[0] == "tensor";
    if (open && keyword)
      cf.fail("tensor " + open->name + ": expected " +
                  std::to_string(detail::element_count(*open)) + " values, got " +
                  std::to_string(open->values.size()),
              n);
    if (w[0] == "meta") {
      detail::parse_meta(cf, line, n);
    } else if (w[0] == "tensor") {
      cf.tensors.push_back(detail::parse_tensor_header(cf, w, n));
      open = &cf.tensors.back();
    } else {
      if (!open) cf.fail("expected a meta or tensor line, got '" + w[0] + "'", n);
      for (const std::string& word : w) {
        if (open->values.size() == detail::element_count(*open))
          cf.fail("tensor " + open->name + ": more than " + std::to_string(open->values.size()) +
                      " values",
                  n);
        open->values.push_back(detail::parse_value(cf, word, n));
      }
    }
    if (open && open->values.size() == detail::element_count(*open)) open = nullptr;
  }
  if (open)
    cf.fail("tensor " + open->name + ": file ends after " + std::to_string(open->values.size()) +
            " of " + std::to_string(detail::element_count(*open)) + " values");
  return cf;
}

inline CaseFile read_case_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw CaseError(path + ": cannot open the file");
  CaseFile cf = parse_case_file(in, path);
  if (in.bad()) throw CaseError(path + ": read error");
  return cf;
}

}  // namespace dcformer::conformance

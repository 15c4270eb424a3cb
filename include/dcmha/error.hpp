#pragma once
// dcmha::Error: every rejected argument of a public entry point is reported with this type.
#include <sstream>
#include <stdexcept>
#include <string>

namespace dcmha {

/// Thrown for invalid arguments. The message names the argument, the expected value and the
/// actual one, e.g. "dcmha::forward: k.shape[3] (D): expected 64 (q.shape[3]), got 32".
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

namespace detail {

template <class... Args>
[[noreturn]] inline void fail(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw Error(os.str());
}

}  // namespace detail
}  // namespace dcmha

#pragma once
// The exceptions of dcmha's public entry points: dcmha::Error for a rejected argument,
// dcmha::AllocationError for memory a call could not get.
#include <memory>
#include <new>
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

/// Thrown when a call cannot allocate the memory it works in (or when that memory would not fit
/// in the address space). It is a std::bad_alloc, so existing out-of-memory handlers catch it;
/// what() names the call. Thrown before any output is written: the outputs keep their contents,
/// nothing the call allocated is leaked, and a Workspace passed to it stays usable.
class AllocationError : public std::bad_alloc {
 public:
  explicit AllocationError(const std::string& what)
      : what_(std::make_shared<const std::string>(what)) {}
  const char* what() const noexcept override { return what_->c_str(); }

 private:
  std::shared_ptr<const std::string> what_;  // shared: copying an exception must not throw
};

namespace detail {

template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <class... Args>
[[noreturn]] inline void fail(const Args&... args) {
  throw Error(concat(args...));
}

/// Runs a public call's work; an allocation failure anywhere in it leaves as AllocationError
/// naming the call.
template <class F>
void with_allocation_errors(const char* fn, F&& work) {
  try {
    work();
  } catch (const AllocationError& e) {
    throw AllocationError(concat(fn, ": ", e.what()));
  } catch (const std::bad_alloc&) {
    throw AllocationError(concat(fn, ": out of memory for the kernels' working buffers"));
  } catch (const std::length_error&) {  // a std::vector larger than it can ever be
    throw AllocationError(concat(fn, ": the kernels' working buffers exceed the address space"));
  }
}

}  // namespace detail
}  // namespace dcmha

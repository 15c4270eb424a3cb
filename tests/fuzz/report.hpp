#pragma once
// How the fuzzer reports a finding: one line on stderr starting "fuzz mismatch:", with the
// problem and what differed, then abort(), so that libFuzzer (or the plain driver) keeps the input.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "dcmha/error.hpp"

namespace dcmha::fuzz {

/// The problem being run, for the report line (set once per input, and per step for decode).
inline std::string& current_problem() {
  static std::string s;
  return s;
}

/// Called just before abort(); the plain driver saves the input there.
inline void (*&on_mismatch())() {
  static void (*hook)() = nullptr;
  return hook;
}

[[noreturn]] inline void mismatch(const std::string& what) {
  std::fprintf(stderr, "fuzz mismatch: %s: %s\n", current_problem().c_str(), what.c_str());
  std::fflush(stderr);
  if (on_mismatch()) on_mismatch()();
  std::abort();
}

/// Runs a call that must succeed: any exception is a finding.
template <class F>
void expect_success(const char* what, F&& call) {
  try {
    call();
  } catch (const dcmha::Error& e) {
    mismatch(std::string(what) + ": dcmha::Error on a valid problem: " + e.what());
  } catch (const std::exception& e) {
    mismatch(std::string(what) + ": unexpected exception on a valid problem: " + e.what());
  } catch (...) {
    mismatch(std::string(what) + ": unexpected non-standard exception on a valid problem");
  }
}

/// Runs a call that must throw dcmha::Error (and nothing else).
template <class F>
void expect_error(const std::string& what, F&& call) {
  try {
    call();
  } catch (const dcmha::Error&) {
    return;
  } catch (const std::exception& e) {
    mismatch(what + ": expected dcmha::Error, got another exception: " + e.what());
  } catch (...) {
    mismatch(what + ": expected dcmha::Error, got a non-standard exception");
  }
  mismatch(what + ": expected dcmha::Error, the call succeeded");
}

/// A number for a report line: %g, which keeps 1e-9 readable (std::to_string would print 0).
inline std::string num(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

/// max |got - want| / max(1, max |want|), the tests' measure; +inf for a size mismatch or any
/// non-finite value in got.
inline double rel_error(const std::vector<double>& want, const std::vector<double>& got) {
  if (want.size() != got.size()) return std::numeric_limits<double>::infinity();
  double err = 0, scale = 1;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::abs(got[i] - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

inline void expect_close(const std::string& name, const std::vector<double>& want,
                         const std::vector<double>& got, double tol) {
  const double e = rel_error(want, got);
  if (e <= tol) return;
  // The first offending element, for a reader of the report.
  size_t at = 0;
  double worst = -1;
  for (size_t i = 0; i < std::min(want.size(), got.size()); ++i) {
    const double d = std::isfinite(got[i]) ? std::abs(got[i] - want[i])
                                           : std::numeric_limits<double>::infinity();
    if (d > worst) worst = d, at = i;
  }
  mismatch(name + ": relative error " + num(e) + " > " + num(tol) + " (element " +
           std::to_string(at) + " of " + std::to_string(want.size()) + ": want " +
           (at < want.size() ? num(want[at]) : "?") + ", got " +
           (at < got.size() ? num(got[at]) : "?") + ")");
}

}  // namespace dcmha::fuzz

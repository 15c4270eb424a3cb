#pragma once
// The cases the CUDA backend's tests share (test_cuda_kernels in the emulator, test_cuda_gpu on
// a device): a problem, per-sequence lengths and the launch's tiles.
#include <cstdint>
#include <string>
#include <vector>

#include "dcmha/cuda/launch_plan.hpp"
#include "reference/reference.hpp"
#include "support/problem.hpp"

namespace dcmha::test {

struct BackendCase {
  ProblemSpec spec;
  std::vector<int64_t> query_lengths, key_lengths;  // empty: none
  cuda::LaunchOptions launch;                       // 0 fields: planned

  std::string str() const {
    return spec.str() + " rows=" + std::to_string(launch.rows) +
           " cluster=" + std::to_string(launch.cluster) +
           " splits=" + std::to_string(launch.key_splits) + split_scores() +
           (query_lengths.empty() ? "" : " lengths");
  }
  std::string split_scores() const {
    switch (launch.split_scores) {
      case cuda::SplitScores::kept:
        return " scores=kept";
      case cuda::SplitScores::recomputed:
        return " scores=recomputed";
      default:
        return "";
    }
  }
};

/// The shapes most cases start from: two groups, GQA, S != T; with 16-row tiles and 32-key steps
/// a few dozen tokens cross several tiles and end in partial ones.
inline ProblemSpec tiled_spec() {
  ProblemSpec s;
  s.B = 2, s.H = 4, s.Hk = 2, s.T = 37, s.S = 45, s.D = 5, s.Dv = 3, s.G = 2, s.Rq = 2, s.Rk = 1;
  s.causal = true;
  return s;
}

inline BackendCase with_launch(const ProblemSpec& s, const cuda::LaunchOptions& launch = {}) {
  BackendCase c;
  c.spec = s;
  c.launch = launch;
  return c;
}

/// Launch options with the tiles given (0: planned).
inline cuda::LaunchOptions tiles(index_t rows, int cluster = 0, index_t splits = 0) {
  cuda::LaunchOptions o;
  o.rows = rows;
  o.cluster = cluster;
  o.key_splits = splits;
  return o;
}

/// The case's random problem with its lengths.
inline reference::Problem problem_of(const BackendCase& c, uint64_t seed) {
  reference::Problem p = random_problem(c.spec, seed);
  p.query_lengths = c.query_lengths;
  p.key_lengths = c.key_lengths;
  return p;
}

}  // namespace dcmha::test

#pragma once
// The cases the CUDA backend's tests share (test_cuda_kernels on host threads, test_cuda_gpu on
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
    return spec.str() + " threads=" + std::to_string(launch.threads) +
           " rows=" + std::to_string(launch.rows) + " keys=" + std::to_string(launch.keys) +
           " splits=" + std::to_string(launch.key_splits) +
           (query_lengths.empty() ? "" : " lengths");
  }
};

/// The shapes most cases start from: two groups, GQA, S != T; with tiles of 2 rows x 4 keys a
/// handful of tokens crosses several tiles and ends in partial ones.
inline ProblemSpec tiled_spec() {
  ProblemSpec s;
  s.B = 2, s.H = 4, s.Hk = 2, s.T = 7, s.S = 9, s.D = 5, s.Dv = 3, s.G = 2, s.Rq = 2, s.Rk = 1;
  s.causal = true;
  return s;
}

inline BackendCase with_launch(const ProblemSpec& s, const cuda::LaunchOptions& launch = {}) {
  BackendCase c;
  c.spec = s;
  c.launch = launch;
  return c;
}

/// The case's random problem with its lengths.
inline reference::Problem problem_of(const BackendCase& c, uint64_t seed) {
  reference::Problem p = random_problem(c.spec, seed);
  p.query_lengths = c.query_lengths;
  p.key_lengths = c.key_lengths;
  return p;
}

}  // namespace dcmha::test

#!/usr/bin/env bash
# Build the library's tests with a sanitizer and run every one of them.
#
#   bash scripts/sanitize.sh asan   # AddressSanitizer + UndefinedBehaviorSanitizer (g++, -O1 -g1)
#   bash scripts/sanitize.sh tsan   # ThreadSanitizer (clang + LLVM's libomp and its Archer tool)
#
# Every report is fatal. Tests shrink the few problems that are large for their purpose (the
# DCMHA_TEST_SANITIZED definition, tests/support/sanitizer.hpp), so every test still runs.
# Environment: BUILD_DIR (default build-asan / build-tsan), JOBS (default: all cores),
# VECTOR_BYTES (default 64: the kernels' vector width; empty: the compiler's).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

KIND="${1:-}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
case "$KIND" in
  asan)
    dcmha_require_packages cmake make g++ libeigen3-dev libgtest-dev libbenchmark-dev
    compiler=(-DCMAKE_CXX_COMPILER=g++)
    sanitize=address
    # scripts/fuzz.sh replays the fuzzer's corpus under clang's ASan + UBSan.
    fuzzer=OFF
    ;;
  tsan)
    # libomp-14-dev: LLVM's OpenMP runtime with libarcher; libclang-rt-14-dev: TSan's runtime.
    dcmha_require_packages cmake make clang libomp-14-dev libclang-rt-14-dev libeigen3-dev \
      libgtest-dev libbenchmark-dev
    compiler=(-DCMAKE_CXX_COMPILER=clang++)
    sanitize=thread
    fuzzer=ON
    ;;
  *) die "usage: bash scripts/sanitize.sh {asan|tsan}" ;;
esac
BUILD_DIR="${BUILD_DIR:-build-$KIND}"
VECTOR_BYTES="${VECTOR_BYTES-64}"

# Optimized (-O1) so that the suite finishes; -g1 (line tables) for the reports' stack traces.
# The library's tests and the conformance runner; the benchmark's and the example's smoke tests
# and the CUDA targets run in the Release suite. The kernels use VECTOR_BYTES-byte vectors
# (default 64, an AVX-512 build's width, whatever the host; empty: the compiler's), so that with
# the Release suite, which checks the host's own width, CI covers both without building the
# kernels twice in either tree.
step "configure ($BUILD_DIR, $KIND)"
cmake -S . -B "$BUILD_DIR" "${compiler[@]}" -DDCMHA_SANITIZE="$sanitize" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" \
  -DDCMHA_BUILD_TESTS=ON -DDCMHA_BUILD_BENCHMARKS=OFF -DDCMHA_BUILD_EXAMPLES=OFF \
  -DDCMHA_BUILD_FUZZER="$fuzzer" -DDCMHA_CUDA=OFF -DDCMHA_TEST_VECTOR_COPIES=OFF \
  -DDCMHA_TEST_VECTOR_BYTES="$VECTOR_BYTES" >/dev/null

step "build (-j$JOBS)"
cmake --build "$BUILD_DIR" -j "$JOBS"

# In parallel: the sanitized suite's time is mostly the single-threaded reference.
step "ctest under $KIND (-j$JOBS)"
start=$(date +%s)
status=0
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS") | tee "$BUILD_DIR/ctest.log" || status=$?
summary=$(grep -E 'tests passed|tests failed' "$BUILD_DIR/ctest.log" | tail -n 1)
# The last line is the summary scripts/test.sh recaps.
vectors="${VECTOR_BYTES}-byte vectors"
[ -n "$VECTOR_BYTES" ] || vectors="the compiler's vectors"
echo "$KIND: ${summary:-ctest did not finish} ($(($(date +%s) - start)) s, kernels with $vectors)"
exit "$status"

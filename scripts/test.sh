#!/usr/bin/env bash
# Build everything, run the test suite, then prove the installed package works for a consumer.
#
#   bash scripts/test.sh
#
# Environment: BUILD_DIR (default build), JOBS (default: all cores).
# Exits non-zero on the first failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

# make: cmake's default generator needs it, and Debian's cmake only recommends it.
dcmha_require_packages cmake make g++ libeigen3-dev libgtest-dev libbenchmark-dev

step "configure ($BUILD_DIR, Release)"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release \
  -DDCMHA_BUILD_TESTS=ON -DDCMHA_BUILD_BENCHMARKS=ON -DDCMHA_BUILD_EXAMPLES=ON

step "build (-j$JOBS)"
cmake --build "$BUILD_DIR" -j "$JOBS"

step "ctest"
(cd "$BUILD_DIR" && ctest --output-on-failure)

# The packaging proof: install into a throw-away prefix and build a separate project that only
# knows that prefix, exactly as a user would.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dcmha-test.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

step "install into $WORK/prefix"
cmake --install "$BUILD_DIR" --prefix "$WORK/prefix"

step "consumer via find_package(dcmha)"
cmake -S examples/consumer -B "$WORK/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$WORK/prefix"
cmake --build "$WORK/consumer" -j "$JOBS"
"$WORK/consumer/consumer"

step "consumer via add_subdirectory(dcmha)"
cmake -S examples/consumer -B "$WORK/consumer-subdir" -DCMAKE_BUILD_TYPE=Release \
  -DDCMHA_SOURCE_DIR="$ROOT"
cmake --build "$WORK/consumer-subdir" -j "$JOBS"
"$WORK/consumer-subdir/consumer"

step "all passed"

#!/usr/bin/env bash
# Prepares .deps/, the headers and libraries scripts/gpu_check.sh needs on a machine that has
# the CUDA toolkit, CMake and PyTorch but nothing else and no network (Eigen, GoogleTest,
# Google Benchmark), copied from this machine's Debian packages with their CMake package files,
# in a prefix layout that CMAKE_PREFIX_PATH finds:
#
#   bash scripts/gpu_deps.sh          # then take .deps/ (about 12 MB) along to the GPU machine
#
# .deps/ is ignored by git. x86-64 Linux only (the libraries are this machine's builds).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"
dcmha_require_packages libeigen3-dev libgtest-dev libbenchmark-dev

DEPS="$ROOT/.deps"
MULTIARCH="$(gcc -print-multiarch)"
rm -rf "$DEPS"
mkdir -p "$DEPS/include" "$DEPS/lib/$MULTIARCH/cmake" "$DEPS/share/eigen3"
cp -r /usr/include/eigen3 /usr/include/gtest /usr/include/gmock /usr/include/benchmark \
  "$DEPS/include/"
cp -r /usr/share/eigen3/cmake "$DEPS/share/eigen3/"
cp -r "/usr/lib/$MULTIARCH/cmake/GTest" "/usr/lib/$MULTIARCH/cmake/benchmark" \
  "$DEPS/lib/$MULTIARCH/cmake/"
cp -P /usr/lib/"$MULTIARCH"/libgtest*.a /usr/lib/"$MULTIARCH"/libgmock*.a \
  /usr/lib/"$MULTIARCH"/libbenchmark* "$DEPS/lib/$MULTIARCH/"
echo "gpu_deps: $(du -sh "$DEPS" | cut -f1) in $DEPS"

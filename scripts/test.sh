#!/usr/bin/env bash
# Build everything, run the test suite, prove the installed package works for a consumer, then
# run the suite again under sanitizers and fuzz the library against the reference.
#
#   bash scripts/test.sh
#
# Environment: BUILD_DIR (default build), JOBS (default: all cores), SANITIZERS (default
# "asan tsan": AddressSanitizer + UBSan, then ThreadSanitizer; "asan" leaves out the latter, ""
# skips both; their time is in docs/performance.md),
# FUZZ_SECONDS (default 60; 0 skips the fuzzer).
# Exits non-zero on the first failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

BUILD_DIR="${BUILD_DIR:-build}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"

# make: cmake's default generator needs it, and Debian's cmake only recommends it.
# clang, libclang-rt-14-dev, libomp-14-dev: the fuzzer's (scripts/fuzz.sh), installed here so that
# its build ahead never runs apt-get beside anything else.
# python3-torch, libtorch-dev: the PyTorch operators' build and tests (python/).
dcmha_require_packages cmake make g++ libeigen3-dev libgtest-dev libbenchmark-dev clang-format \
  nlohmann-json3-dev clang libclang-rt-14-dev libomp-14-dev python3-torch libtorch-dev

# Every C++ file as .clang-format writes it (clang-format -i FILE... fixes one).
step "format (clang-format $(clang-format --version | grep -o '[0-9][0-9.]*' | head -n 1))"
mapfile -t sources < <(find include tests tools bench examples python -name '*.hpp' -o -name '*.cpp' \
  -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' | sort)
clang-format --dry-run --Werror "${sources[@]}"
RECAP=("format: ${#sources[@]} files as .clang-format writes them")

# The CUDA backend builds wherever nvcc is, for sm_90 (the GPU the device check runs on; each
# architecture more adds about 10 minutes on 2 cores); its kernel source runs on the host in the
# emulated tests either way, and its GPU tests (label gpu) report skipped without a device.
# Without a GPU the targets carry PTX only (compute_90): no machine code to run, and ptxas, half
# of a kernel unit's compile, runs only in the ptxas tests of the main kernels (tests/cuda); the
# other kernel units compile as a check, their device code unoptimized (DCMHA_CUDA_COMPILE_CHECK).
NVCC="$(command -v nvcc || true)"
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -n "$NVCC" ]; then
  cuda_architecture=90-virtual compile_check=ON
  cuda_code="PTX for compute_90, device code optimized in the ptxas-tested units"
  if nvidia-smi -L >/dev/null 2>&1; then
    cuda_architecture=90 cuda_code="sm_90 and PTX" compile_check=OFF
  fi
  cuda_args=(-DDCMHA_CUDA=ON -DCMAKE_CUDA_COMPILER="$NVCC" "-DCMAKE_CUDA_ARCHITECTURES=$cuda_architecture"
    "-DDCMHA_CUDA_COMPILE_CHECK=$compile_check")
  RECAP+=("cuda: $("$NVCC" --version | grep -o 'release [0-9.]*'), every CUDA target ($cuda_code)")
else
  cuda_args=(-DDCMHA_CUDA=OFF)
  RECAP+=("cuda: no nvcc here, the CUDA targets were not compiled (test_cuda_kernels still ran)")
fi

# The kernel tests' vector widths: the host's own here, an AVX-512 build's 64 bytes in the ASan
# suite (scripts/sanitize.sh). Without that suite, the *_vec64 copies here check the latter.
vector_copies=ON
case " ${SANITIZERS-asan tsan} " in *" asan "*) vector_copies=OFF ;; esac

# -Werror: the project's own targets (CUDA ones too) build without a warning. The fuzzer and its
# corpus replay are left to scripts/fuzz.sh below, which starts from that corpus.
step "configure ($BUILD_DIR, Release)"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DDCMHA_WERROR=ON \
  -DDCMHA_BUILD_TESTS=ON -DDCMHA_BUILD_BENCHMARKS=ON -DDCMHA_BUILD_EXAMPLES=ON \
  -DDCMHA_BUILD_FUZZER=OFF -DDCMHA_TEST_VECTOR_COPIES="$vector_copies" -DDCMHA_TEST_VECTOR_BYTES= \
  "${cuda_args[@]}" >/dev/null

step "build (-j$JOBS)"
cmake --build "$BUILD_DIR" -j "$JOBS"

# The fuzzer's build (one translation unit, so one core) runs beside the Release suite, the
# install and the consumers, which leave a core to spare; the fuzz step below waits for it.
FUZZ_BUILD_LOG="$ROOT/$BUILD_DIR/fuzz-build-ahead.log"
fuzz_build=""
if [ "${FUZZ_SECONDS:-60}" -gt 0 ]; then
  env -u BUILD_DIR FUZZ_BUILD_ONLY=1 JOBS=1 bash "$ROOT/scripts/fuzz.sh" >"$FUZZ_BUILD_LOG" 2>&1 &
  fuzz_build=$!
fi

# In parallel, as the sanitized suite: the fuzzer's build ahead takes a core part of the time.
step "ctest (-j$JOBS)"
(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS") | tee "$BUILD_DIR/ctest.log"
RECAP+=("release: $(grep -E 'tests passed|tests failed' "$BUILD_DIR/ctest.log" | tail -n 1)")
skipped=$(grep -c '(Skipped)' "$BUILD_DIR/ctest.log" || true)
[ "$skipped" -gt 0 ] && RECAP+=("gpu: $skipped tests skipped (no CUDA device here; scripts/gpu_check.sh runs them)")
# The ptxas tests' registers per kernel (they passed: no kernel spills), from CTest's log.
ctest_log="$BUILD_DIR/Testing/Temporary/LastTest.log"
ptxas_lines=$(grep -hE ' registers, spill stores |kernels, [0-9]+ spilling$' "$ctest_log" || true)
if [ -n "$ptxas_lines" ]; then
  step "ptxas: the main kernels' registers per thread"
  printf '%s\n' "$ptxas_lines"
  units=$(grep -cE 'kernels, 0 spilling$' "$ctest_log")
  RECAP+=("ptxas: $units kernel units of the main kernels, no spill")
fi

# The CUDA kernels' cost model (tools/cost_model): a single-threaded emulation of a few minutes,
# beside the steps below; its table is printed at the end.
COST_MODEL_LOG="$ROOT/$BUILD_DIR/cost-model.txt"
"$BUILD_DIR/tools/cost_model/dcmha_cost_model" >"$COST_MODEL_LOG" 2>&1 &
cost_model=$!

# Runs a command and keeps its last line (its summary) for the recap at the end.
recap_of() {
  local log
  log=$(mktemp "${TMPDIR:-/tmp}/dcmha-step.XXXXXX")
  "$@" 2>&1 | tee "$log"
  RECAP+=("$(tail -n 1 "$log")")
  rm -f "$log"
}

# The PyTorch operators (python/): built against Debian's torch (and against the torch of
# `python3` on PATH where that is another one), then the libtorch program and the Python tests.
torch_pythons=(/usr/bin/python3)
path_python="$(command -v python3 || true)"
if [ -n "$path_python" ] && [ "$(readlink -f "$path_python")" != "$(readlink -f /usr/bin/python3)" ] &&
  "$path_python" -c "import torch" 2>/dev/null; then
  torch_pythons+=("$path_python")
fi
for python in "${torch_pythons[@]}"; do
  torch_version="$("$python" -c 'import torch; print(torch.__version__)')"
  torch_dir="$BUILD_DIR/torch-$torch_version"
  step "PyTorch operators against torch $torch_version ($python)"
  PYTHON="$python" DCMHA_TORCH_WERROR=ON DCMHA_TORCH_TESTS=ON JOBS="$JOBS" \
    bash scripts/build_torch.sh "$torch_dir"
  "$torch_dir/build/libtorch_attention"
  (cd python/tests && PYTHONPATH="$ROOT/$torch_dir" "$python" -m unittest discover -v 2>&1) |
    tee "$torch_dir/tests.log"
  RECAP+=("torch $torch_version: $(grep '^Ran ' "$torch_dir/tests.log"), $(tail -n 1 "$torch_dir/tests.log"); libtorch program passed")
done

# The packaging proof: install into a throw-away prefix and build a separate project that only
# knows that prefix, exactly as a user would.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dcmha-test.XXXXXX")"
trap 'rm -rf "$WORK"; [ -z "$fuzz_build" ] || kill "$fuzz_build" 2>/dev/null || true
  [ -z "$cost_model" ] || kill "$cost_model" 2>/dev/null || true' EXIT

step "install into $WORK/prefix"
cmake --install "$BUILD_DIR" --prefix "$WORK/prefix"

# The two consumers build side by side (one file each, so one core each); a failure shows its log.
step "consumers via find_package(dcmha) and via add_subdirectory(dcmha)"
cmake -S examples/consumer -B "$WORK/consumer" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$WORK/prefix" >/dev/null
cmake -S examples/consumer -B "$WORK/consumer-subdir" -DCMAKE_BUILD_TYPE=Release \
  -DDCMHA_SOURCE_DIR="$ROOT" >/dev/null
build_consumer() {  # build dir
  cmake --build "$1" -j "$JOBS" >"$1.log" 2>&1 || { cat "$1.log"; return 1; }
  "$1/consumer"
}
build_consumer "$WORK/consumer" &
installed=$!
build_consumer "$WORK/consumer-subdir"
wait "$installed"

# The safety net: the whole suite under AddressSanitizer + UBSan, then under ThreadSanitizer
# (scripts/sanitize.sh), then the fuzzer against the reference for a fixed budget
# (scripts/fuzz.sh).
# Each in its own default build directory: BUILD_DIR names this script's Release tree only.
for kind in ${SANITIZERS-asan tsan}; do
  recap_of env -u BUILD_DIR bash "$ROOT/scripts/sanitize.sh" "$kind"
done
if [ -n "$fuzz_build" ]; then
  wait "$fuzz_build" || { cat "$FUZZ_BUILD_LOG"; die "building the fuzzer failed"; }
  fuzz_build=""
  recap_of env -u BUILD_DIR bash "$ROOT/scripts/fuzz.sh" "${FUZZ_SECONDS:-60}"
fi

step "cost model of the CUDA kernels (a model, not a measurement)"
wait "$cost_model" || { cat "$COST_MODEL_LOG"; die "the cost model failed"; }
cost_model=""
cat "$COST_MODEL_LOG"
RECAP+=("cost model: $(grep -c '^| [MD]' "$COST_MODEL_LOG") rows modeled ($COST_MODEL_LOG)")

step "all passed"
printf '  %s\n' "${RECAP[@]}"

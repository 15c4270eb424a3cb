#!/usr/bin/env bash
# The device check of the CUDA backend, one command on a machine with an sm_90 GPU (an H100 or
# H200), the CUDA toolkit, CMake and PyTorch, and no network; about 5-8 minutes on one H200:
#
#   bash scripts/gpu_check.sh [OUT_DIR]   # OUT_DIR (default $OUT, else build-gpu/out): the logs
#
#   1. builds the CUDA targets for sm_90 (test_cuda_gpu, dcmha_cuda_bench)
#   2. runs the gpu tests: CUDA results against the float64 reference, decode, determinism
#   3. runs compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on one small case of
#      every kernel
#   4. runs the GPU benchmarks, then scripts/gpu_bench.py: PyTorch SDPA's flash backend (MHA)
#      and the official, unfused einsum formulation of DCMHA on the same shapes, and prints one
#      table (bf16, B4/H32/D128 causal, T = 2048, 4096, 8192; decode B8/S4096; memory peaks)
#      with the issue's targets marked.
#
# Eigen, GoogleTest and Google Benchmark come from the system or from .deps/ (made on a Debian
# machine by scripts/gpu_deps.sh and carried along). Exits non-zero on the first failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${BUILD_DIR:-build-gpu}"
OUT="${1:-${OUT:-$BUILD/out}}"
mkdir -p "$OUT"
step() { printf '\n== %s (%s)\n' "$1" "$(date +%T)"; }
# The toolkit's programs, also where only /usr/local/cuda has them.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
nvcc --version | tail -n 2

step "configure and build for sm_90"
prefix=()
if [ -d "$ROOT/.deps" ]; then prefix=(-DCMAKE_PREFIX_PATH="$ROOT/.deps"); fi
generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S . -B "$BUILD" "${generator[@]}" "${prefix[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DDCMHA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DDCMHA_WERROR=ON -DDCMHA_BUILD_TESTS=ON \
  -DDCMHA_BUILD_BENCHMARKS=ON -DDCMHA_BUILD_EXAMPLES=OFF -DDCMHA_BUILD_FUZZER=OFF \
  -DDCMHA_INSTALL=OFF >"$OUT/configure.log"
cmake --build "$BUILD" -j "$(nproc)" --target test_cuda_gpu dcmha_cuda_bench >"$OUT/build.log" 2>&1 ||
  { tail -n 50 "$OUT/build.log"; exit 1; }

step "gpu tests"
"$BUILD/tests/cuda/test_cuda_gpu" 2>&1 | tee "$OUT/test_cuda_gpu.log" | tail -n 25

step "compute-sanitizer on the small case"
small=(--gtest_filter=CudaGpu.SmallCaseForTheSanitizers)
# racecheck: shared-memory races; synccheck: barriers not all threads reach; initcheck: device
# memory read before it was written (cudaMalloc'd scratch is not zeroed, the host runner's is).
for tool in memcheck racecheck synccheck initcheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 1 "$BUILD/tests/cuda/test_cuda_gpu" \
    "${small[@]}" >"$OUT/sanitizer-$tool.log" 2>&1 ||
    { tail -n 40 "$OUT/sanitizer-$tool.log"; exit 1; }
  echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -n 1)"
done

step "benchmarks"
# A failed case (an error in one benchmark) still lets the table print; the exit status says it.
bench_status=0
"$BUILD/bench/dcmha_cuda_bench" --benchmark_min_time=0.3 --benchmark_out="$OUT/bench.json" \
  --benchmark_out_format=json | tee "$OUT/bench.txt" || bench_status=$?

step "against PyTorch (SDPA flash, the official einsum formulation)"
PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py --ours "$OUT/bench.json" \
  --table "$OUT/table.md" | tee "$OUT/gpu_bench.txt"

[ "$bench_status" -eq 0 ] || { echo "dcmha_cuda_bench: a benchmark failed (see above)"; exit 1; }
step "all passed"

#!/usr/bin/env bash
# The device check of the CUDA backend, one command on a machine with an sm_90 GPU (an H100 or
# H200), the CUDA toolkit, CMake and PyTorch, and no network. It is sized for a leased machine
# with a hard time limit: every step runs under its own timeout, and all of them together stay
# within DEADLINE_S (340 s), so the script ends in under 6 minutes whatever hangs:
#
#   bash scripts/gpu_check.sh [OUT_DIR]   # OUT_DIR: default $OUT, else build-gpu/out
#
#   step        budget  what
#   device       20 s   nvidia-smi, nvcc --version
#   configure    60 s   CMake for sm_90 only, no -Werror (a warning must not cost the lease)
#   build       180 s   test_cuda_gpu, dcmha_cuda_bench and dcmha_model_probes only, ninja where
#                       present, all cores:
#                       24 kernel units (3 types x head-dim classes 32-128 x forward, backward;
#                       no case uses 256), each at most 100 s of one core (docs/performance.md)
#   gpu-tests    60 s   test_cuda_gpu: CUDA results against the reference, decode, determinism
#   probes       20 s   dcmha_model_probes: the cost model's assumptions measured (a 16-byte
#                       shared load's cycles by lanes per address, block and cluster barriers,
#                       DSMEM bandwidth) -> probes.md
#   memcheck     30 s   compute-sanitizer on CudaGpu.SmallCaseForTheSanitizers* (a small case
#   racecheck    30 s     of every kernel): out-of-bounds accesses, shared-memory races,
#   synccheck    30 s     barriers not every thread reaches
#   bench        75 s   dcmha_cuda_bench (one warm-up, one timed call a case) -> bench.json
#   table        60 s   scripts/gpu_bench.py: PyTorch SDPA flash (MHA) and the official einsum
#                       DCMHA on the same shapes, one markdown table with the targets -> table.md
#   initcheck    30 s   optional, last, only if its whole budget is left: device memory read
#                       before it was written
#
# The steps before the benchmarks keep bench + table's budgets in reserve: a slow build or a
# hanging test shortens the tests and moves a sanitizer that no longer has its whole budget to
# after the table (where the benchmarks' unused reserve usually leaves room), but never takes
# time from the benchmarks. A failed or timed-out step is reported and the later steps still
# run (those that need a binary the build did not make are reported as not run); the exit
# status is non-zero if any step failed. The end of the output is the table, the sanitizers'
# findings and the summary (step, status, seconds), because only the last ~12,000 characters
# of a leased machine's output come back.
#
# OUT_DIR gets six files: summary.txt, table.md, probes.md, bench.json, sanitizer.txt (each
# tool's verdict and first findings) and gpu_check.log (every step's output, in order).
# Per-step logs are in build-gpu/logs/. DCMHA_BENCH_LONG=1 adds T = 8192 to the benchmarks and the table (a longer,
# manual run: their budgets and the deadline grow by 180 s).
#
# Eigen, GoogleTest and Google Benchmark come from the system or from .deps/ (made on a Debian
# machine by scripts/gpu_deps.sh and carried along).
set -uo pipefail # no -e: a failed step is recorded and the next one runs

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="${BUILD_DIR:-build-gpu}"
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
OUT_DIR="${1:-${OUT:-$BUILD/out}}" # relative to where the script was started
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)" || exit 2
cd "$ROOT" || exit 2
LOGS="$BUILD/logs"
mkdir -p "$OUT_DIR" "$LOGS" || exit 2
LOG="$OUT_DIR/gpu_check.log"
SUMMARY="$OUT_DIR/summary.txt"
SANITIZER="$OUT_DIR/sanitizer.txt"
rm -f "$OUT_DIR/bench.json" "$OUT_DIR/table.md" "$OUT_DIR/probes.md" "$SUMMARY" "$SANITIZER" \
  "$LOGS"/*.log
: >"$LOG"

DEADLINE_S="${DCMHA_GPU_CHECK_DEADLINE_S:-340}" # smaller only for a dry run of the control flow
BENCH_S=75
TABLE_S=60
if [ "${DCMHA_BENCH_LONG:-}" = 1 ]; then
  BENCH_S=$((BENCH_S + 90)) TABLE_S=$((TABLE_S + 90)) DEADLINE_S=$((DEADLINE_S + 180))
fi
MIN_STEP_S=5        # a step with less time than this left is not started
STEP_LOG_BYTES=1048576 # a step's share of the combined log (head and tail beyond it)
START=$SECONDS
FAILED=0
ROWS=()

# The toolkit's programs, also where only /usr/local/cuda has them.
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH"
fi

# record STEP STATUS SECONDS LIMIT: one line of the summary; STATUS other than ok/skipped fails.
record() {
  LAST_STATUS="$2 ($3 s)"
  ROWS+=("$(printf '%-10s %-30s %5s %6s' "$1" "$2" "$3" "$4")")
  case "$2" in ok | skipped*) ;; *) FAILED=1 ;; esac
  printf '== %s: %s (%s s)\n' "$1" "$2" "$3"
}

# append_log STEP FILE: FILE into the combined log, cut to its head and tail when it is long
# (a build with many warnings must not push the log past what comes back from the machine).
append_log() {
  {
    printf '\n======== %s\n' "$1"
    if [ "$(wc -c <"$2")" -le "$STEP_LOG_BYTES" ]; then
      cat "$2"
    else
      head -c $((STEP_LOG_BYTES / 2)) "$2"
      printf '\n[... cut, the whole log is %s ...]\n' "$2"
      tail -c $((STEP_LOG_BYTES / 2)) "$2"
    fi
  } >>"$LOG"
}

# step_limit BUDGET RESERVE: the seconds a step may take: its budget, or less so that RESERVE
# seconds for the steps after it remain before the deadline.
step_limit() {
  local left=$((DEADLINE_S - (SECONDS - START) - $2))
  echo $(($1 < left ? $1 : left))
}

# run_step STEP BUDGET RESERVE COMMAND...: COMMAND under timeout, its output in the step's log.
run_step() {
  local name=$1 limit rc=0 t0=$SECONDS log="$LOGS/$1.log"
  limit=$(step_limit "$2" "$3")
  shift 3
  if [ "$limit" -lt "$MIN_STEP_S" ]; then
    record "$name" "NOT RUN (no time left)" 0 -
    return 1
  fi
  printf '\n== %s (limit %s s, %s)\n' "$name" "$limit" "$(date +%T)"
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1 || rc=$?
  append_log "$name" "$log"
  local status=ok
  case $rc in
    0) ;;
    124 | 137) status="TIMEOUT (limit ${limit} s)" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || tail -n 25 "$log"
  record "$name" "$status" $((SECONDS - t0)) "$limit"
  return "$rc"
}

# needs STEP FILE: records STEP as not run when FILE (a binary of the build) is missing.
needs() {
  [ -x "$2" ] && return 0
  record "$1" "NOT RUN (no $(basename "$2"))" 0 -
  return 1
}

# The steps' own commands, run by `timeout ... bash -c NAME` (exported below).
# shellcheck disable=SC2317
show_device() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || return 1
  nvcc --version | tail -n 2
}

# shellcheck disable=SC2317
configure_build() {
  local args=(-S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DDCMHA_CUDA=ON
    -DCMAKE_CUDA_ARCHITECTURES=90 -DDCMHA_WERROR=OFF -DDCMHA_BUILD_TESTS=ON
    -DDCMHA_BUILD_BENCHMARKS=ON -DDCMHA_BUILD_EXAMPLES=OFF -DDCMHA_BUILD_FUZZER=OFF
    -DDCMHA_INSTALL=OFF -DDCMHA_CUDA_COMPILE_CHECK=OFF "-DDCMHA_CUDA_HEAD_DIMS=32;64;96;128")
  if [ -d "$ROOT/.deps" ]; then args+=(-DCMAKE_PREFIX_PATH="$ROOT/.deps"); fi
  # A build directory keeps its first generator; ask for ninja only in a new one.
  if [ ! -f "$BUILD/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
    args+=(-G Ninja)
  fi
  cmake "${args[@]}"
}

# shellcheck disable=SC2317
build_targets() {
  cmake --build "$BUILD" -j "$(nproc)" --target test_cuda_gpu dcmha_cuda_bench dcmha_model_probes
}

# compute-sanitizer beside nvcc (the toolkit's bin/), on PATH, or in the toolkit's own folder.
find_sanitizer() {
  local beside
  beside="$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")"
  for candidate in "$beside/compute-sanitizer" "$(command -v compute-sanitizer 2>/dev/null)" \
    "$beside/../compute-sanitizer/compute-sanitizer"; do
    [ -n "$candidate" ] && [ -x "$candidate" ] && { echo "$candidate"; return 0; }
  done
  return 1
}

# sanitize TOOL BUDGET RESERVE: one compute-sanitizer tool on the small cases; its verdict and
# first findings go to sanitizer.txt.
sanitize() {
  local tool=$1 tests="$BUILD/tests/cuda/test_cuda_gpu" log="$LOGS/$1.log"
  needs "$tool" "$tests" || return 0
  if [ -z "$SANITIZER_BIN" ]; then
    record "$tool" "NOT RUN (no compute-sanitizer)" 0 -
    echo "$tool: no compute-sanitizer beside nvcc or on PATH" >>"$SANITIZER"
    return 0
  fi
  run_step "$tool" "$2" "$3" "$SANITIZER_BIN" --tool "$tool" --error-exitcode 1 \
    --print-limit 20 "$tests" --gtest_filter='CudaGpu.SmallCaseForTheSanitizers*'
  # GoogleTest 1.12 passes a filter that matches nothing: a sanitizer that checked no kernel.
  if grep -q 'Running 0 tests' "$log" 2>/dev/null; then
    unset 'ROWS[-1]'
    record "$tool" "FAILED (no test matched)" 0 -
  fi
  {
    printf '%s: %s\n' "$tool" "$LAST_STATUS"
    if [ -f "$log" ]; then
      grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -n 1
      grep -A 2 -E '^========= +(Invalid|Race|Barrier|Uninitialized|Error|Warning|Program hit)' \
        "$log" | head -n 15
      grep -E '^\[  (PASSED|FAILED) +\]' "$log" | head -n 3
    fi
  } >>"$SANITIZER"
}

export BUILD ROOT
export -f show_device configure_build build_targets
tests="$BUILD/tests/cuda/test_cuda_gpu"
bench="$BUILD/bench/dcmha_cuda_bench"
probes="$BUILD/bench/dcmha_model_probes"
RESERVE=$((BENCH_S + TABLE_S)) # kept for the benchmarks and the table by every step before them

run_step device 20 "$RESERVE" bash -c show_device
# A failed build must not leave an earlier run's binaries to be tested and timed.
rm -f "$tests" "$bench" "$probes"
if run_step configure 60 "$RESERVE" bash -c configure_build; then
  # Its first errors too: the tail of a failed nvcc run is often template context.
  run_step build 180 "$RESERVE" bash -c build_targets || grep -m 10 ' error' "$LOGS/build.log"
else
  record build "NOT RUN (configure failed)" 0 -
fi

if needs gpu-tests "$tests"; then
  run_step gpu-tests 60 "$RESERVE" "$tests" && grep -E '^\[  PASSED' "$LOGS/gpu-tests.log"
fi
if needs probes "$probes"; then
  run_step probes 20 "$RESERVE" "$probes" --table "$OUT_DIR/probes.md"
fi

SANITIZER_BIN="$(find_sanitizer || true)"
SANITIZER_S=30
# A tool without its whole budget before the reserve waits until after the table, where the
# benchmarks' unused reserve usually leaves room.
deferred=()
for tool in memcheck racecheck synccheck; do
  if [ "$(step_limit "$SANITIZER_S" "$RESERVE")" -ge "$SANITIZER_S" ]; then
    sanitize "$tool" "$SANITIZER_S" "$RESERVE"
  else
    echo "== $tool: deferred until after the table (no time before the benchmarks)"
    deferred+=("$tool")
  fi
done

if needs bench "$bench"; then
  run_step bench "$BENCH_S" "$TABLE_S" "$bench" --benchmark_out="$OUT_DIR/bench.json" \
    --benchmark_out_format=json
fi
# The table also without bench.json: the PyTorch columns alone are still a measurement.
run_step table "$TABLE_S" 0 env PYTHONUNBUFFERED=1 python3 scripts/gpu_bench.py \
  --ours "$OUT_DIR/bench.json" --table "$OUT_DIR/table.md"

for tool in "${deferred[@]}"; do
  sanitize "$tool" "$SANITIZER_S" 0
done
# initcheck (device memory read before it was written) only with its whole budget: optional.
if [ "$(step_limit "$SANITIZER_S" 0)" -ge "$SANITIZER_S" ]; then
  sanitize initcheck "$SANITIZER_S" 0
else
  record initcheck "skipped (optional, no time)" 0 -
fi

{
  echo "gpu_check $(date -u +%FT%TZ), $(git -C "$ROOT" describe --always --dirty 2>/dev/null ||
    echo 'no git'), $(head -n 1 "$LOGS/device.log" 2>/dev/null)"
  printf '%-10s %-30s %5s %6s\n' step status s limit
  printf '%s\n' "${ROWS[@]}"
  echo "total $((SECONDS - START)) s of $DEADLINE_S; $([ "$FAILED" -eq 0 ] && echo 'all passed' ||
    echo 'FAILED')"
} >"$SUMMARY"
printf '\n==== the cost model assumptions, measured (%s)\n' "$OUT_DIR/probes.md"
cat "$OUT_DIR/probes.md" 2>/dev/null || echo "no probes: see the probes step above"
printf '\n==== table (%s)\n' "$OUT_DIR/table.md"
cat "$OUT_DIR/table.md" 2>/dev/null || echo "no table: see the table step above"
printf '\n==== sanitizers (%s)\n' "$SANITIZER"
cat "$SANITIZER" 2>/dev/null || echo "no sanitizer ran"
printf '\n==== summary (%s)\n' "$SUMMARY"
cat "$SUMMARY"
exit "$FAILED"

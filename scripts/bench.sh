#!/usr/bin/env bash
# Build and run a representative subset of dcmha_bench, then print a summary table and plot it.
#
#   bash scripts/bench.sh
#
# Environment:
#   BUILD_DIR     build tree (default build-bench; kept apart from scripts/test.sh's build/)
#   OUT_DIR       results: JSON, summary.txt, dcmha_bench.png (default $BUILD_DIR/results)
#   BENCH_FILTER  --benchmark_filter regex for the timing run (default below)
#   BENCH_REPS    repetitions of each timing benchmark (default 3). Repetitions of all the
#                 benchmarks run interleaved in random order, so that a slow phase of a shared
#                 machine hits MHA and DCMHA alike instead of one of a pair (the ratios moved by
#                 up to 30% between back-to-back runs without it).
#   BENCH_MEMORY  1 (default) also runs the T=16384 fwd+bwd memory case, 0 skips it
#   JOBS          build parallelism (default: all cores)
#   OMP_NUM_THREADS is honoured by the kernels and reported in the "threads" column.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

BUILD_DIR="${BUILD_DIR:-build-bench}"
OUT_DIR="${OUT_DIR:-$BUILD_DIR/results}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
BENCH_REPS="${BENCH_REPS:-3}"
BENCH_MEMORY="${BENCH_MEMORY:-1}"
# Causal fwd and bwd, MHA and DCMHA, for the small-model heads over the whole T range and for
# DCFormer-6.9B's heads (H32/D128) at 1024 and 2048; the window-256 forward of a local layer at
# T = 2048 and 8192; one decode step against a 4096-token cache for B = 1 and 8; the dynamic weight
# projection forward and backward for DCFormer-6.9B's width at T = 1024 and 2048. About 0.7 TFLOP
# per repetition, so a few minutes even at ~10 GFLOP/s. No '$' anchor: reported names end in
# /real_time.
BENCH_FILTER="${BENCH_FILTER:-^((fwd|bwd)/(mha|dcmha)/B1/(H16/T(512|1024|2048|4096)/D64|H32/T(1024|2048)/D128)/causal|fwdbwd/(mha|dcmha)/B1/H32/T(1024|2048)/D128/causal|fwd/(mha|dcmha)/B1/H32/T(2048|8192)/D128/window256|(fwd|fwdbwd)/(mha|dcmha)/bf16/B1/H32/T2048/D128/causal|decode/(mha|dcmha)/B(1|8)/H32/S4096/D128|(fwd|bwd)/dynw/B1/H32/T(1024|2048)/D128)}"
MEMORY_FILTER='^fwdbwd/(mha|dcmha)/B1/H16/T16384/D64/causal'

pkgs=(cmake make g++ libeigen3-dev libbenchmark-dev)
# Any gnuplot flavour or python3 already present will do; -nox is the one without X deps.
command -v gnuplot >/dev/null 2>&1 || pkgs+=(gnuplot-nox)
command -v python3 >/dev/null 2>&1 || pkgs+=(python3)
dcmha_require_packages "${pkgs[@]}"

step "configure ($BUILD_DIR, Release, -march=native)"
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DDCMHA_NATIVE=ON \
  -DDCMHA_BUILD_BENCHMARKS=ON -DDCMHA_BUILD_TESTS=OFF -DDCMHA_BUILD_EXAMPLES=OFF

step "build dcmha_bench (-j$JOBS)"
cmake --build "$BUILD_DIR" -j "$JOBS" --target dcmha_bench

mkdir -p "$OUT_DIR"
SECONDS=0
BENCH="$BUILD_DIR/bench/dcmha_bench"
status=0

step "timing run: $BENCH_FILTER"
"$BENCH" --benchmark_filter="$BENCH_FILTER" \
  --benchmark_repetitions="$BENCH_REPS" --benchmark_report_aggregates_only=true \
  --benchmark_enable_random_interleaving=true \
  --benchmark_out="$OUT_DIR/timing.json" --benchmark_out_format=json || status=1
jsons=("$OUT_DIR/timing.json")

# A process of its own: peak RSS is a high-water mark, so only a fresh process measures the
# long-context case alone. One repetition: one iteration is ~1.9 TFLOP per op, the longest
# part of this script on a small machine.
if [ "$BENCH_MEMORY" = 1 ]; then
  step "memory run: $MEMORY_FILTER"
  "$BENCH" --benchmark_filter="$MEMORY_FILTER" --benchmark_repetitions=1 \
    --benchmark_out="$OUT_DIR/memory.json" --benchmark_out_format=json || status=1
  jsons+=("$OUT_DIR/memory.json")
fi

step "summary"
python3 scripts/bench_summary.py "$OUT_DIR" "${jsons[@]}" || status=1
if [ -f "$OUT_DIR/plot.gp" ]; then
  gnuplot "$OUT_DIR/plot.gp" && echo "plot: $OUT_DIR/dcmha_bench.png" || status=1
fi
echo "table: $OUT_DIR/summary.txt  raw: ${jsons[*]}  (benchmarks took ${SECONDS}s)"
exit "$status"

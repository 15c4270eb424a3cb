#!/usr/bin/env bash
# Fuzz dcmha against its test reference (tests/fuzz/) for SECONDS seconds.
#
#   bash scripts/fuzz.sh [SECONDS]        (default 60)
#
# With clang's libFuzzer: builds only fuzz_dcmha, with ASan and UBSan at -O1 -g1, in build-fuzz/,
# copies the seed corpus (tests/fuzz/corpus, never written) into a scratch corpus there and runs
# libFuzzer on it. Without libFuzzer: builds the same harness as a plain driver with g++ and
# ASan in build-fuzzplain/ and runs it on random inputs after the seed corpus.
# libFuzzer's own output goes to <build dir>/fuzz.log (its tail is shown on failure); findings are
# saved in <build dir>/fuzz-artifacts/. The last line is always
#   fuzz: N runs, M mismatches, C crashes
# where a "fuzz mismatch:" report counts as a mismatch and any other failure (a sanitizer report,
# a deadly signal, a per-input timeout, running out of memory) as a crash; the exit status is 0
# only when both are 0.
#
# Environment: BUILD_DIR, JOBS (default 2), FUZZ_BUILD_ONLY (1: configure and build, then stop;
# scripts/test.sh builds ahead this way while other steps run), FUZZ_TIMEOUT (seconds one input
# may take, default 60), FUZZ_RSS_MB (default 4096), FUZZ_MAX_LEN (bytes per input, default 512),
# FUZZ_ENGINE (auto, or plain for the plain driver even where libFuzzer exists).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

SECONDS_TO_RUN="${1:-60}"
[[ "$SECONDS_TO_RUN" =~ ^[0-9]+$ ]] || die "usage: bash scripts/fuzz.sh [SECONDS]"
JOBS="${JOBS:-2}"
FUZZ_TIMEOUT="${FUZZ_TIMEOUT:-60}"
FUZZ_RSS_MB="${FUZZ_RSS_MB:-4096}"
FUZZ_MAX_LEN="${FUZZ_MAX_LEN:-512}"
FUZZ_ENGINE="${FUZZ_ENGINE:-auto}"

dcmha_require_packages clang libclang-rt-14-dev libomp-14-dev g++ cmake make libeigen3-dev libgtest-dev

# Only the library and tests/: no benchmarks, examples or install rules to configure.
configure() {  # build dir, C compiler, C++ compiler, extra cmake arguments...
  local dir="$1" cc="$2" cxx="$3"
  shift 3
  CC="$cc" CXX="$cxx" cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1" -DDCMHA_BUILD_TESTS=ON \
    -DDCMHA_BUILD_BENCHMARKS=OFF -DDCMHA_BUILD_EXAMPLES=OFF -DDCMHA_INSTALL=OFF -DDCMHA_CUDA=OFF "$@" \
    >/dev/null
}

summary() {  # runs, mismatches, crashes
  printf 'fuzz: %s runs, %s mismatches, %s crashes\n' "$1" "$2" "$3"
  [ "$2" -eq 0 ] && [ "$3" -eq 0 ]
}

count_mismatches() { grep -c '^fuzz mismatch:' "$1" || true; }

show_failure() {  # log
  printf '\n--- last lines of %s ---\n' "$1"
  tail -n 40 "$1"
  printf -- '---\n'
}

use_libfuzzer=no
BUILD_DIR="${BUILD_DIR:-build-fuzz}"
if [ "$FUZZ_ENGINE" != plain ] && command -v clang++ >/dev/null 2>&1; then
  step "configure $BUILD_DIR (clang, libFuzzer, ASan + UBSan, -O1 -g1)"
  configure "$BUILD_DIR" clang clang++ -DDCMHA_FUZZ_LIBFUZZER=ON
  if grep -q '^DCMHA_HAVE_LIBFUZZER:INTERNAL=1' "$BUILD_DIR/CMakeCache.txt"; then
    use_libfuzzer=yes
  fi
fi
if [ "$use_libfuzzer" = no ]; then
  BUILD_DIR="${BUILD_DIR%/}plain"  # build-fuzzplain by default: other compiler, other cache
  step "no libFuzzer here: configure $BUILD_DIR (g++, plain driver, ASan + UBSan)"
  configure "$BUILD_DIR" gcc g++ -DDCMHA_FUZZ_LIBFUZZER=OFF -DDCMHA_SANITIZE=address
fi

step "build fuzz_dcmha (-j$JOBS)"
cmake --build "$BUILD_DIR" --target fuzz_dcmha -j "$JOBS" >"$BUILD_DIR/fuzz-build.log" 2>&1 ||
  { tail -n 40 "$BUILD_DIR/fuzz-build.log"; die "building fuzz_dcmha failed (log: $BUILD_DIR/fuzz-build.log)"; }
if [ "${FUZZ_BUILD_ONLY:-0}" = 1 ]; then
  echo "fuzz: fuzz_dcmha built in $BUILD_DIR"
  exit 0
fi

BIN="$ROOT/$BUILD_DIR/tests/fuzz/fuzz_dcmha"
LOG="$ROOT/$BUILD_DIR/fuzz.log"
ARTIFACTS="$ROOT/$BUILD_DIR/fuzz-artifacts"
WORK_CORPUS="$ROOT/$BUILD_DIR/fuzz-corpus"
rm -rf "$ARTIFACTS"  # only this run's findings
mkdir -p "$ARTIFACTS"
# OpenMP workers sleep between the many small calls instead of spinning on the shared cores.
export OMP_WAIT_POLICY=passive
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

status=0
if [ "$use_libfuzzer" = yes ]; then
  # A scratch copy: libFuzzer adds every input that finds new coverage to its corpus directory.
  rm -rf "$WORK_CORPUS"
  cp -r tests/fuzz/corpus "$WORK_CORPUS"
  step "libFuzzer for ${SECONDS_TO_RUN}s on $(find "$WORK_CORPUS" -type f | wc -l) seed inputs (log: $LOG)"
  "$BIN" "$WORK_CORPUS" -max_total_time="$SECONDS_TO_RUN" -timeout="$FUZZ_TIMEOUT" \
    -rss_limit_mb="$FUZZ_RSS_MB" -max_len="$FUZZ_MAX_LEN" -len_control=0 -print_final_stats=1 \
    -artifact_prefix="$ARTIFACTS/" >"$LOG" 2>&1 || status=$?
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$LOG" | tail -n 1)"
  # Without final stats (a crash), the last status line's count.
  [ -n "$runs" ] || runs="$(sed -n 's/^#\([0-9][0-9]*\)[[:space:]].*/\1/p' "$LOG" | tail -n 1)"
  grep -E '^#[0-9]+[[:space:]]+DONE' "$LOG" | tail -n 1 || true
else
  step "plain driver for ${SECONDS_TO_RUN}s after the seed corpus (log: $LOG)"
  (cd "$ARTIFACTS" && "$BIN" --seconds "$SECONDS_TO_RUN" "$ROOT/tests/fuzz/corpus") >"$LOG" 2>&1 || status=$?
  runs="$(sed -n 's/^fuzz_dcmha: \([0-9][0-9]*\) runs.*/\1/p' "$LOG" | tail -n 1)"
  tail -n 1 "$LOG"
fi
runs="${runs:-0}"

# Both runners stop at the first finding, and every finding ends the process with a non-zero
# status: a mismatch by abort() (which libFuzzer reports as a deadly signal too), anything else
# by the sanitizer, libFuzzer's timeout or rss limit, or a signal.
mismatches="$(count_mismatches "$LOG")"
crashes=0
if [ "$status" -ne 0 ] && [ "$mismatches" -eq 0 ]; then
  crashes=1
fi
if [ "$mismatches" -gt 0 ] || [ "$crashes" -gt 0 ]; then
  grep -m 3 '^fuzz mismatch:' "$LOG" || true
  show_failure "$LOG"
  printf 'inputs that failed: %s\n' "$ARTIFACTS"
fi
summary "$runs" "$mismatches" "$crashes"

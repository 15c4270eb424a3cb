#!/usr/bin/env bash
# ptxas on the PTX nvcc kept for one kernel instance (tests/cuda/CMakeLists.txt): prints each
# kernel's registers and spill bytes, and fails if any kernel spills.
#
#   bash ptxas_spills.sh PTXAS KEEP_DIR INSTANCE ARCHITECTURE ARCHITECTURE_COUNT
#
# nvcc names the kept PTX INSTANCE.ptx for a single architecture, INSTANCE.compute_XX.ptx for
# several.
set -euo pipefail
ptxas=$1 keep_dir=$2 instance=$3 architecture=$4 architecture_count=$5
ptx="$keep_dir/$instance.ptx"
[ "$architecture_count" -eq 1 ] || ptx="$keep_dir/$instance.compute_$architecture.ptx"
if [ ! -f "$ptx" ]; then
  echo "error: $ptx not found: build the CUDA targets (dcmha_cuda_test_kernels) first" >&2
  exit 1
fi
log=$("$ptxas" -arch="sm_$architecture" -v "$ptx" -o /dev/null 2>&1) || {
  echo "$log"
  exit 1
}
demangle="cat"
command -v c++filt >/dev/null && demangle=c++filt
# ptxas -v reports, per kernel, "Compiling entry function 'NAME'", then "N bytes spill stores,
# M bytes spill loads", then "Used R registers".
echo "$log" | awk -v instance="$instance" -v architecture="sm_$architecture" '
  /Compiling entry function/ { name = $0; sub(/^[^'\'']*'\''/, "", name); sub(/'\''.*$/, "", name) }
  /bytes spill stores/ { stores = $5; loads = $9 }
  /Used [0-9]+ registers/ {
    registers = $0; sub(/^.*Used /, "", registers); sub(/ registers.*$/, "", registers)
    printf "%s %s registers, spill stores %s B, loads %s B\n", name, registers, stores, loads
    kernels++
    if (stores + loads > 0) spilling++
  }
  END {
    printf "%s, %s: %d kernels, %d spilling\n", instance, architecture, kernels, spilling
    exit (kernels == 0 || spilling > 0)
  }' | "$demangle" | sed -E 's/\(dcmha::detail::[^)]*\)//'

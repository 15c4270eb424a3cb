#!/usr/bin/env bash
# The kernels in one_call.cu's PTX (tests/cuda/CMakeLists.txt): each must be a bf16 forward
# kernel, of head-dim class 128 where it has one. Prints them.
#
#   bash one_call_kernels.sh PTX_FILE
set -euo pipefail
ptx=$1
[ -f "$ptx" ] || {
  echo "error: $ptx not found: build dcmha_cuda_one_call first" >&2
  exit 1
}
demangle="cat"
command -v c++filt >/dev/null && demangle=c++filt
names=$(sed -nE 's/^\.(visible|weak) \.entry ([A-Za-z0-9_]+)\(.*$/\2/p' "$ptx" | $demangle)
count=$(printf '%s\n' "$names" | grep -c . || true)
echo "$count kernels:"
printf '%s\n' "$names" | sed -E 's/\(.*$//'
wrong=$(printf '%s\n' "$names" | grep -vE '^void dcmha::cuda::[a-z_]+<Eigen::bfloat16(>|, 128[,>])' || true)
backward=$(printf '%s\n' "$names" | grep -E 'grad|backward|row_dots' || true)
if [ "$count" -eq 0 ] || [ -n "$wrong" ] || [ -n "$backward" ]; then
  echo "error: kernels other than the bf16 forward's of class 128:" >&2
  printf '%s\n' "$wrong" "$backward" | sed -E 's/\(.*$//' | grep . >&2 || true
  exit 1
fi

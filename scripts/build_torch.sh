#!/usr/bin/env bash
# Builds the dcmha PyTorch extension into DIR, against the torch that ${PYTHON:-python3} imports:
#   bash scripts/build_torch.sh DIR   then   PYTHONPATH=DIR $PYTHON -c "import dcmha_torch"
# Environment: PYTHON (the interpreter), DCMHA_TORCH_MARCH (default native; e.g. x86-64-v3 for a
# build that runs on any AVX2 machine), DCMHA_TORCH_WERROR=ON and DCMHA_TORCH_TESTS=ON (the
# project's tests: -Werror, and the libtorch test program in DIR/build), JOBS.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -eq 1 ] || { echo "usage: bash scripts/build_torch.sh DIR" >&2; exit 2; }
DIR="$(mkdir -p "$1" && cd "$1" && pwd)"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "build_torch.sh: $PYTHON ($(command -v "$PYTHON" || echo 'not found')) cannot import torch." >&2
  debian_python=/usr/bin/python3
  if [ "$(command -v "$PYTHON")" != "$debian_python" ] && "$debian_python" -c "import torch" 2>/dev/null; then
    echo "  $debian_python can: PYTHON=$debian_python bash scripts/build_torch.sh $1" >&2
  fi
  echo "  (Debian: apt-get install python3-torch libtorch-dev, then PYTHON=/usr/bin/python3)" >&2
  exit 1
fi

# A pip torch ships its CMake package inside the Python package; Debian's is in the system path.
read -r torch_version torch_cmake < <("$PYTHON" - <<'PY'
import os, torch
path = torch.utils.cmake_prefix_path
print(torch.__version__, path if os.path.isdir(path) else "")
PY
)
echo "build_torch.sh: torch $torch_version (${torch_cmake:-system CMake package}) for $PYTHON"
cmake -S "$ROOT/python" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release \
  ${torch_cmake:+-DCMAKE_PREFIX_PATH="$torch_cmake"} \
  -DDCMHA_TORCH_PACKAGE_DIR="$DIR/dcmha_torch" \
  -DDCMHA_TORCH_MARCH="${DCMHA_TORCH_MARCH:-native}" \
  -DDCMHA_TORCH_WERROR="${DCMHA_TORCH_WERROR:-OFF}" \
  -DDCMHA_TORCH_TESTS="${DCMHA_TORCH_TESTS:-OFF}" >"$DIR/configure.log" ||
  { cat "$DIR/configure.log"; exit 1; }
cmake --build "$DIR/build" -j "${JOBS:-$(nproc)}"
PYTHONPATH="$DIR" "$PYTHON" -c "import dcmha_torch, torch; assert hasattr(torch.ops.dcmha, 'attention')"
echo "build_torch.sh: PYTHONPATH=$DIR $PYTHON -c 'import dcmha_torch'"

#!/usr/bin/env bash
# C tier: configure, build libubnext.so (C API + kernels, nvcc for sm_90 and sm_100) and run its
# ctests, in build/c. Extra arguments go to cmake's configure step, e.g.
#   scripts/build_c.sh -DCMAKE_CUDA_ARCHITECTURES=90 -DUBNEXT_CUDART=Shared
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${UBNEXT_C_BUILD_DIR:-$ROOT/build/c}"

if [ -z "${CUDACXX:-}" ] && ! command -v nvcc >/dev/null 2>&1; then
  for cand in "${CUDA_HOME:-}" /usr/local/cuda; do
    if [ -n "$cand" ] && [ -x "$cand/bin/nvcc" ]; then export CUDACXX="$cand/bin/nvcc"; break; fi
  done
fi

generator=()
# Keep whatever generator an existing build dir was made with; cmake refuses to switch.
if [ ! -f "$BUILD/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi

start=$SECONDS
cmake -S "$ROOT" -B "$BUILD" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@"
cmake --build "$BUILD" --parallel "$(nproc)"
echo "[build_c] configure + build: $((SECONDS - start)) s"
ctest --test-dir "$BUILD" --output-on-failure --timeout 300

#!/usr/bin/env bash
# The whole test suite: set-up, then every tier. Exits non-zero on any failure.
source "$(dirname "$0")/_setup.sh"
export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/cache}"
start=$SECONDS
step() { echo; echo "=== $* ($((SECONDS - start)) s)"; }

step "kernels: NVRTC compile of every kernel for sm_90 and sm_100 (no spills allowed)"
python -m ubnext.kernels build --arch sm_90 sm_100 --fail-on-spill

step "emulator: build the CPU emulator library and its test-only broken builds (cached by content)"
python -m ubnext._emu build --all

step "unit tier (no GPU, one process)"
python -m pytest -q tests/unit

step "mpi tier (mpirun -np 2 and -np 4 on CPU: gloo fallback and emulated kernels, normal and chaos)"
python -m pytest -q tests/mpi

step "c tier (CMake + nvcc for sm_90/sm_100, ctest)"
scripts/build_c.sh

step "gpu tier (skips without a GPU, saying why)"
python -m pytest -q -rs tests/gpu

step "all tiers passed"

#!/usr/bin/env bash
# The whole test suite: set-up, then every tier. Exits non-zero on any failure.
source "$(dirname "$0")/_setup.sh"
export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/cache}"
start=$SECONDS
step() { echo; echo "=== $* ($((SECONDS - start)) s)"; }

step "format: the C/C++/CUDA sources of csrc/ and include/ follow .clang-format"
scripts/check_format_c.sh

step "python: ruff (lint, format) over ubnext/ tests/ scripts/ examples/, mypy over ubnext/"
scripts/check_python.sh

step "kernels: NVRTC compile of every kernel for sm_90 and sm_100 (no spills allowed)"
python -m ubnext.kernels build --arch sm_90 sm_100 --fail-on-spill

step "emulator: build the CPU emulator library and its test-only broken builds (cached by content)"
python -m ubnext.runtime._emu build --all

step "c tier, in the background (CMake + nvcc for sm_90/sm_100, ctest): its log follows the unit tier"
mkdir -p build
scripts/build_c.sh > build/c-tier.log 2>&1 &
c_tier=$!

step "unit tier (no GPU, one process)"
unit_rc=0
python -m pytest -q tests/unit || unit_rc=$?

step "c tier's output"
c_rc=0
wait "$c_tier" || c_rc=$?
if [ "$c_rc" -eq 0 ]; then tail -n 40 build/c-tier.log; else cat build/c-tier.log; echo "c tier failed"; fi
[ "$unit_rc" -eq 0 ] || echo "unit tier failed"
[ "$unit_rc" -eq 0 ] && [ "$c_rc" -eq 0 ] || exit 1

step "mpi tier (mpirun -np 2, 3 and 4 on CPU: gloo fallback and emulated kernels, normal and chaos; two jobs at a time)"
python -m pytest -q -n 2 --dist load --durations=12 tests/mpi

step "gpu tier (skips without a GPU, saying why)"
python -m pytest -q -rs tests/gpu

step "all tiers passed"

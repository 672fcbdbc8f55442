#!/usr/bin/env bash
# The GPU check (issue 36), with no install step and no network:
#
#   scripts/gpu_check.sh [--only STEP[,STEP...]] [--budget SECONDS]   on a GPU machine
#   scripts/gpu_check.sh --rehearse [--only ...]                      on the CPU (CI): emulator + stub driver
#
# Every machine: the one-GPU check (python3 -m tests.gpu_check: facts, kernels, gpu_tests, world1, loopback,
# ranks2, timings, probes), each step with its own timeout, gpu_check.json rewritten after each step, into
# $OUT (else build/gpu_check). On a node with two GPUs or more, the multi-GPU tier and the benchmarks follow,
# as before (mpirun, one rank per GPU), unless --only or --rehearse is given.
#
# Python: the machine's own, with its torch, and this checkout on PYTHONPATH ($PYTHON overrides). Only a
# machine without torch (a fresh CPU clone rehearsing by hand) gets the project's .venv (scripts/_setup.sh).
# Cubins exported here (python -m ubnext.kernels export --arch sm_90 --to build/gpu_cubins) and carried to
# the device are used where the driver accepts them (UBNEXT_CUBIN_DIR).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ "$(id -u)" = 0 ]; then  # Open MPI refuses root without both words (the device image runs as root)
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

rehearse=0
only=0
for arg in "$@"; do
  case "$arg" in
    --rehearse) rehearse=1 ;;
    --only|--only=*) only=1 ;;
  esac
done

if [ -x .venv/bin/python ] && [ "$rehearse" = 1 ]; then
  PY="${PYTHON:-$ROOT/.venv/bin/python}"
elif "${PYTHON:-python3}" -c "import torch" >/dev/null 2>&1; then
  PY="${PYTHON:-python3}"
else
  echo "[gpu_check] no torch in ${PYTHON:-python3}: setting up the project's .venv (a CPU machine)"
  # shellcheck source=scripts/_setup.sh
  source "$ROOT/scripts/_setup.sh"
  PY="$ROOT/.venv/bin/python"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/cache}"
if [ -z "${UBNEXT_CUBIN_DIR:-}" ] && [ -f "$ROOT/build/gpu_cubins/manifest.json" ] && [ "$rehearse" = 0 ]; then
  export UBNEXT_CUBIN_DIR="$ROOT/build/gpu_cubins"
fi
out="${OUT:-$ROOT/build/gpu_check}"
mkdir -p "$out"

"$PY" -m tests.gpu_check --out "$out" "$@"
rc=$?

if [ "$rehearse" = 1 ] || [ "$only" = 1 ]; then
  exit "$rc"
fi
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$ngpu" -lt 2 ]; then
  echo "multi-GPU tier and benchmarks: need >= 2 GPUs ($ngpu found); the one-GPU check above is what this machine proves"
  exit "$rc"
fi
{
  nvidia-smi -L || true
  "$PY" -m ubnext.kernels build --arch sm_90 sm_100 --fail-on-spill
  # tests/gpu at every rank count: includes two communicators with kernels in flight on two streams in
  # opposite orders (case two_comms_two_streams: the grid cap of csrc/host/launch_rules.h keeps them
  # deadlock-free)
  "$PY" -m pytest -q -rs tests/gpu
  mpirun -np "$ngpu" "$PY" -m ubnext.bench
  mpirun -np "$ngpu" "$PY" -m ubnext.bench --fused
  # every path against NCCL and torch's symmetric-memory op at the same sizes; the ratios go to
  # docs/PERF.md (commit them with the run's log)
  paths="lamport nvls_lamport nvls_twoshot twoshot torch_symm"
  mpirun -np "$ngpu" "$PY" -m ubnext.bench --algo $paths --sizes 8k 64k 512k 2m 8m 32m --ratios docs/PERF.md
  mpirun -np "$ngpu" "$PY" -m ubnext.bench --fused --algo lamport nvls_lamport nvls_twoshot twoshot \
    --sizes 16k 64k 512k 2m 8m --ratios docs/PERF.md
  # one FSDP2 training step: NCCL's collectives, torch's symmetric-memory staging, ubnext's
  for mode in nccl torch_symm ubnext; do
    mpirun -np "$ngpu" "$PY" scripts/fsdp_step_bench.py --mode "$mode"
  done
} 2>&1 | tee "$out/multi_gpu.log"
multi_rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && [ "$multi_rc" -eq 0 ]

#!/usr/bin/env bash
# The main job: allreduce benchmark on 4 ranks (GPUs when present, else the CPU emulator and gloo).
source "$(dirname "$0")/_setup.sh"
NP="${UBNEXT_BENCH_NP:-4}"
exec mpirun -np "$NP" python -m ubnext.bench "$@"

#!/usr/bin/env bash
# Host time per call (python -m ubnext.bench --host), twice: with a recorder in place of the kernel
# launch, then with the launch itself running through cuda.core and cuda.bindings into the stub
# driver (tests/stub_driver), so that everything but the real driver's own work is timed.
#   scripts/host_bench.sh [extra bench arguments, e.g. --calls 3000]
source "$(dirname "$0")/_setup.sh"
export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/cache}"
stub="$(python -m tests.stub_driver "$ROOT/build/stub_driver")"
# the stub reports an sm_90 device; NVRTC looks for the driver too and crashes on the stub, so the
# kernels are compiled (or found in the cache) here, before any process loads it
python -m ubnext.kernels build --arch sm_90 >/dev/null
export UBNEXT_EMULATE=1 UBNEXT_SELFTEST=0
mpirun -np 2 python -m ubnext.bench --host "$@"
LD_LIBRARY_PATH="$stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" mpirun -np 2 python -m ubnext.bench --host --launch driver "$@"

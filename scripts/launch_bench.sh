#!/usr/bin/env bash
# Host time of one kernel launch into the stub driver: ubnext's _cuda.launch beside cuda.core's launch
# of the same twelve arguments, ns per call, alternating rounds (scripts/launch_bench.py says what each
# row times). The stub (tests/stub_driver) is built and put first on LD_LIBRARY_PATH here, before
# cuda.bindings loads a driver.
#   scripts/launch_bench.sh [--calls 20000] [--rounds 9]
source "$(dirname "$0")/_setup.sh"
export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/cache}"
stub="$(python -m tests.stub_driver "$ROOT/build/stub_driver")"
LD_LIBRARY_PATH="$stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python scripts/launch_bench.py "$@"

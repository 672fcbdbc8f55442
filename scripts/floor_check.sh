#!/usr/bin/env bash
# Opt-in (neither scripts/test.sh nor CI runs it): the tests that run cuda.core's and cuda.bindings'
# own code against the stub driver (tests/stub_driver), with the oldest releases pyproject.toml
# allows of cuda-core, cuda-bindings and numpy, installed in a scratch venv (build/floor-venv).
# cuda-core 0.3 names a kernel's handle and loads cubins differently from 1.x, cuda-bindings 12.9 builds
# CUlaunchConfig's attributes as 13.x does or not, and the main venv only ever has the newest: this is
# where the floors are checked, not only claimed.
# Installs nothing multi-GB: the CPU torch (scripts/_torch.sh) and wheels of a few MB.
# Output also goes to build/floor_check.log. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VENV="$ROOT/build/floor-venv"
mkdir -p build
# shellcheck source=scripts/_torch.sh
source "$ROOT/scripts/_torch.sh"

# The tests whose calls reach cuda.core or cuda.bindings (their launch, cubin loading, structs and
# enums, argument packing, the driver module) rather than ubnext's fakes alone.
TESTS=(tests/unit/test_stub_driver.py tests/unit/test_launch_context.py tests/unit/test_launch_args.py
       tests/unit/test_vmm_calls.py)

{
  # the floors as pyproject.toml states them ("name>=version"), pinned exactly
  "$PY" - > build/floor-constraints.txt <<'PYEOF'
import re
text = open("pyproject.toml").read()
for name in ("cuda-core", "cuda-bindings", "numpy"):
    (version,) = re.findall(rf'"{name}>=([^",;\s]+)"', text)
    print(f"{name}=={version}")
PYEOF
  echo "[floor] pins: $(tr '\n' ' ' < build/floor-constraints.txt)"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  stamp="$VENV/.floor-$(cat pyproject.toml scripts/floor_check.sh scripts/_torch.sh | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    install_torch -c build/floor-constraints.txt
    # the floors are constraints, so nothing ubnext or its test extras pull in can lift them
    python -m pip install -q -c build/floor-constraints.txt --no-build-isolation -e ".[test]"
    rm -f "$VENV"/.floor-*
    touch "$stamp"
  fi
  python -m pip list 2>/dev/null | grep -iE '^(cuda-core|cuda-bindings|numpy|torch) '
  # installed versions must be the floors, whatever pip resolved
  python - <<'PYEOF'
from importlib.metadata import version
from packaging.version import Version  # "1.24" is 1.24.0
for line in open("build/floor-constraints.txt"):
    name, want = line.strip().split("==")
    assert Version(version(name)) == Version(want), f"{name} {version(name)} installed, floor is {want}"
print("[floor] installed versions are the floors")
PYEOF
  export UBNEXT_CACHE_DIR="${UBNEXT_CACHE_DIR:-$ROOT/build/floor-cache}"
  # The stub driver for the whole run, not only for the tests that start a process with it: at the
  # floor, in-process tests that reach cuda-core or cuda.bindings may need a libcuda. A GPU node has one.
  stub="$(python -m tests.stub_driver build/stub_driver)"
  export LD_LIBRARY_PATH="$stub${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  python -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" "$@"
} 2>&1 | tee build/floor_check.log
exit "${PIPESTATUS[0]}"

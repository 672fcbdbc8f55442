# Sourced by scripts/test.sh and scripts/bench.sh: create .venv on first use and install ubnext
# with its test dependencies. CPU-only machines get the CPU torch wheel; a machine that already
# has torch (a GPU box) keeps it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
TORCH_CPU_VERSION="2.13.0"

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] torch found in $PY: keeping it (venv sees system site-packages)"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
# shellcheck disable=SC1091
. .venv/bin/activate

stamp=".venv/.ubnext-setup-$(cat pyproject.toml scripts/_setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  if ! python -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "[setup] GPU found and no torch: installing the default (CUDA) torch"
      python -m pip install -q torch
    else
      echo "[setup] no GPU: installing the CPU torch $TORCH_CPU_VERSION+cpu"
      # The exact CPU pin from pip's configured sources first (a local wheel where one lies in
      # find-links, its dependencies from the configured index); only then PyTorch's CPU index,
      # without retries, so an unreachable index costs seconds, not minutes. Never a bare
      # "torch" from the default index: that is several GB of CUDA wheels.
      python -m pip install -q "torch==$TORCH_CPU_VERSION+cpu" ||
        python -m pip install -q --retries 0 --timeout 20 "torch==$TORCH_CPU_VERSION+cpu" \
          --index-url https://download.pytorch.org/whl/cpu
    fi
  fi
  python -m pip install -q --no-build-isolation -e ".[test,plot]"
  rm -f .venv/.ubnext-setup-*
  touch "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"

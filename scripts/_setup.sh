# Sourced by scripts/test.sh and scripts/bench.sh: create .venv on first use and install ubnext
# with its test dependencies. CPU-only machines get the CPU torch wheel; a machine that already
# has torch (a GPU box) keeps it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
# shellcheck source=scripts/_torch.sh
source "$ROOT/scripts/_torch.sh"

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

stamp=".venv/.ubnext-setup-$(cat pyproject.toml scripts/_setup.sh scripts/_torch.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  install_torch
  python -m pip install -q --no-build-isolation -e ".[test,plot]"
  rm -f .venv/.ubnext-setup-*
  touch "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"

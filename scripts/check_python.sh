#!/usr/bin/env bash
# The Python checks (issue 37 item 3), configured in pyproject.toml: ruff's lint and its format check
# over ubnext/, tests/, scripts/ and examples/, and mypy over ubnext/ at the strictness stated in
# [tool.mypy]. Run by scripts/test.sh; to fix what ruff can: ruff check --fix . && ruff format .
set -euo pipefail
cd "$(dirname "$0")/.."
python -m ruff check ubnext tests scripts examples
python -m ruff format --check ubnext tests scripts examples
python -m mypy

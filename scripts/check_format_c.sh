#!/usr/bin/env bash
# The C, C++ and CUDA sources of csrc/ and include/ (every tracked .cu .cuh .h .hpp .c .cpp .cc)
# follow .clang-format: `clang-format --dry-run --Werror` over all of them, one process. Exits 0
# when every file is formatted, 1 with clang-format's report of each difference otherwise, 2 when
# clang-format is missing. The clang-format is the PyPI wheel that pyproject.toml's test extra pins
# (other major versions may format differently); CLANG_FORMAT overrides the executable.
# To reformat: clang-format -i FILE... A table that must keep its hand layout is fenced with
# `// clang-format off: why` and `// clang-format on` (grep csrc for the few there are).
# Usage: scripts/check_format_c.sh [DIR]   (DIR: another git work tree with its own .clang-format,
# for tests/unit/test_c_format.py; default the repository root)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${1:-$ROOT}"
CF="${CLANG_FORMAT:-clang-format}"
if ! command -v "$CF" >/dev/null 2>&1; then
  echo "check_format_c: $CF not found: pip install the test extra (pip install -e '.[test]')" >&2
  exit 2
fi
mapfile -t files < <(git ls-files -- csrc include | grep -E '\.(cu|cuh|h|hpp|c|cpp|cc)$')
if [ "${#files[@]}" -eq 0 ]; then
  echo "check_format_c: no C/C++/CUDA file under csrc/ or include/" >&2
  exit 2
fi
if ! "$CF" --style=file --dry-run --Werror "${files[@]}"; then
  echo "check_format_c: the files above differ from .clang-format ($("$CF" --version)):" \
       "run clang-format -i on them" >&2
  exit 1
fi
echo "check_format_c: ${#files[@]} files follow .clang-format ($("$CF" --version))"

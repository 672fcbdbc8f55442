"""scripts/check_format_c.sh: csrc/ and include/ follow .clang-format (C, C++ and CUDA), and the check
catches a file that does not. Skips, saying why, where clang-format (the PyPI wheel of the test extra)
is not installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "check_format_c.sh"


def _clang_format() -> str | None:
    """The clang-format executable: the wheel's own binary if importable, else one on PATH."""
    try:
        import clang_format
    except ImportError:
        return shutil.which("clang-format")
    exe = clang_format.get_executable("clang-format")
    return exe if os.access(exe, os.X_OK) else shutil.which("clang-format")


CLANG_FORMAT = _clang_format()
pytestmark = pytest.mark.skipif(
    CLANG_FORMAT is None or shutil.which("git") is None,
    reason="clang-format is not installed (pip install -e '.[test]' brings the pinned wheel) or git is missing",
)


def _check(root: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = [str(SCRIPT)] + ([str(root)] if root is not None else [])
    env = {**os.environ, "CLANG_FORMAT": str(CLANG_FORMAT)}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)


def test_sources_follow_clang_format():
    r = _check()
    assert r.returncode == 0, f"csrc/ or include/ is not formatted (run clang-format -i):\n{r.stdout}{r.stderr}"
    assert "files follow .clang-format" in r.stdout


# A kernel file as the repository writes them: platform.cuh first, out of alphabetical order (SortIncludes:
# Never keeps it there), one-line `if`/`else` branches and case labels, a hand-aligned trailing comment.
GOOD = """\
#include "../device/platform.cuh"
#include "../device/desc.cuh"

namespace ubx {

UBX_DEV int pick(int w, int a, int b) {
  switch (w) {
    case 0: return a;
    default: return b;
  }
}
UBX_DEV void store(int c, int* p) {
  if (c) p[0] = 1;
  else p[1] = 2;
  int x = 3;       // aligned by hand
  int yy = 4;      // with its neighbour
  p[2] = x + yy;
}

}  // namespace ubx
"""


def _tree(tmp_path: Path, source: str) -> Path:
    """A scratch git work tree with the repository's .clang-format and one tracked kernel file."""
    (tmp_path / "csrc" / "kernels").mkdir(parents=True)
    shutil.copy(ROOT / ".clang-format", tmp_path / ".clang-format")
    (tmp_path / "csrc" / "kernels" / "k.cu").write_text(source)
    (tmp_path / "csrc" / "notes.txt").write_text("not C:   ignored\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    return tmp_path


def test_check_accepts_the_house_style(tmp_path):
    r = _check(_tree(tmp_path, GOOD))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 files follow" in r.stdout


@pytest.mark.parametrize(
    "bad",
    [
        GOOD.replace("  if (c) p[0] = 1;", "    if (c) p[0] = 1;"),  # indent
        GOOD.replace("int* p", "int *p"),  # pointer alignment
        GOOD.replace("UBX_DEV int pick(int w, int a, int b) {", "UBX_DEV int pick(int w, int a, int b)\n{"),  # brace
        GOOD.replace("x + yy", "x + yy + " + " + ".join(["x"] * 40)),  # past 120 columns
    ],
    ids=["indent", "pointer", "brace", "column-limit"],
)
def test_check_rejects_a_difference(tmp_path, bad):
    r = _check(_tree(tmp_path, bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "csrc/kernels/k.cu" in r.stderr

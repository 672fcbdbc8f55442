"""Issue 37 item 2: the Communicator's parts and the operators hold one another to written contracts
(ubnext/comm/_contracts.py, ubnext/ops/_target.py), and the type checker enforces them. CI runs mypy
over the real tree (scripts/check_python.sh); this test shows, once, that mypy catches each way of
breaking a contract, on a copy of the package with one deliberate break of each kind."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (file, text replaced, its replacement, what mypy must then say)
BREAKS = [
    # a part needs a member that no part provides and no constructor line sets
    (
        "ubnext/comm/_contracts.py",
        "    def _pool_reads_done(self) -> None: ...\n",
        "    def _pool_reads_done(self) -> None: ...\n\n    def _provided_by_nobody(self) -> None: ...\n",
        'Cannot instantiate abstract class "Communicator" with abstract attribute "_provided_by_nobody"',
    ),
    # a part provides a member with another signature than its contract states
    (
        "ubnext/comm/_contracts.py",
        "    def _run(self, how: Launch, pointers: tuple) -> None: ...\n",
        "    def _run(self, how: Launch, pointers: list) -> None: ...\n",
        'Argument 2 of "_run" is incompatible with supertype',
    ),
    # a part uses state that its contract does not name
    (
        "ubnext/comm/_exchange.py",
        "        self.last_path = call.path\n",
        "        self.last_path = call.path + self._not_in_any_contract\n",
        'has no attribute "_not_in_any_contract"',
    ),
    # the same inside a function without annotations (mypy reads such bodies in comm/ and ops/ only
    # because pyproject's [tool.mypy] asks it to: check_untyped_defs)
    (
        "ubnext/comm/_fused.py",
        "            q, scales = self._quantize_blocks(outputs[0], *block)\n",
        "            q, scales = self._quantize_blocks_renamed(outputs[0], *block)\n",
        'has no attribute "_quantize_blocks_renamed"',
    ),
    # an operator's implementation (unannotated) calls what the operators' contract does not name
    (
        "ubnext/ops/__init__.py",
        "    return c._all_reduce(x, torch.empty_like(x))\n",
        "    return c._all_reduce_not_in_optarget(x, torch.empty_like(x))\n",
        '"OpTarget" has no attribute "_all_reduce_not_in_optarget"',
    ),
    # the operators call a member the Communicator does not have
    (
        "ubnext/ops/_target.py",
        "    def _all_gather(self, x: torch.Tensor, out: torch.Tensor) -> None: ...\n",
        "    def _all_gather(self, x: torch.Tensor, out: torch.Tensor) -> None: ...\n\n"
        "    def _not_on_the_communicator(self) -> None: ...\n",
        'variable has type "Callable[[str], OpTarget]"',
    ),
]


def test_mypy_catches_each_broken_contract(tmp_path):
    pytest.importorskip("mypy", reason="mypy is a test dependency (pyproject's test extras)")
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "ubnext", copy / "ubnext", ignore=shutil.ignore_patterns("__pycache__", "_data"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    for rel, old, new, _ in BREAKS:
        path = copy / rel
        text = path.read_text()
        assert text.count(old) >= 1, f"{rel} no longer has the line this test breaks: {old!r}"
        path.write_text(text.replace(old, new, 1))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=copy,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    missing = [said for *_, said in BREAKS if said not in out]
    assert not missing, f"mypy did not report {missing}:\n{out}"
    # and nothing else: every error is a break or its knock-on effect (a caller of the changed member,
    # another construction of the abstract class)
    names = ("_provided_by_nobody", '"_run"', "_not_in_any_contract", "_renamed", "OpTarget")
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert all(any(name in line for name in names) for line in errors), out

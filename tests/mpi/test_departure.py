"""A rank that leaves (its script ends or raises) while its peers still call: the peers raise within
seconds, naming it, instead of spinning until the timeout; and the job ends instead of hanging with
the leaving rank stuck at exit."""

import re
import time
from pathlib import Path

import pytest

from tests.conftest import assert_mpi_ok, run_torchrun

SCRIPT = Path(__file__).resolve().parent / "departure.py"
TIMEOUT_S = 120  # UBNEXT_TIMEOUT: what the callers would wait without the departure


@pytest.mark.mpi
@pytest.mark.parametrize("how, where", [("exit", "kernel"), ("raise", "kernel"), ("exit", "setup")])
def test_a_departed_rank_is_noticed_in_seconds(mpi, how, where):
    start = time.monotonic()
    proc = mpi(2, SCRIPT, how, where, env={"UBNEXT_EMULATE": "1", "UBNEXT_TIMEOUT": str(TIMEOUT_S)}, timeout=TIMEOUT_S)
    _check(proc, how, where, time.monotonic() - start)


@pytest.mark.mpi
def test_a_rank_that_ends_before_the_first_op_is_noticed_under_torchrun():
    """The same under torchrun (no MPI_Finalize on the leaving rank; the store is torchrun's)."""
    start = time.monotonic()
    proc = run_torchrun(
        2, SCRIPT, "exit", "setup", env={"UBNEXT_EMULATE": "1", "UBNEXT_TIMEOUT": str(TIMEOUT_S)}, timeout=TIMEOUT_S
    )
    _check(proc, "exit", "setup", time.monotonic() - start)


def _check(proc, how: str, where: str, took: float) -> None:
    out = proc.stdout + proc.stderr
    if how == "exit":
        assert_mpi_ok(proc)
    else:
        assert proc.returncode != 0 and "a bug on the last rank" in out, out[-4000:]
    found = re.search(r"rank 0 raised after ([\d.]+) s: (\w+): (.*)", proc.stdout)
    assert found, out[-4000:]
    # in a kernel, the pool's departure word; in the set-up, the store's departure key (issue 40 H2)
    said = "peer 1, which has left" if where == "kernel" else "rank(s) [1] left without reaching it"
    assert found[2] == "UbnextError" and said in found[3], found[0]
    assert float(found[1]) < 10, f"the departure took {found[1]} s to notice (timeout {TIMEOUT_S} s)"
    assert took < TIMEOUT_S / 2, f"the job took {took:.0f} s to end"

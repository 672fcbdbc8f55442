"""The emulator across rank processes (mpirun -np 2 and 4): memfd pools shared by fd passing,
multicast semantics, traffic, chaos-mode reordering between processes, stores of parked threads,
and bounded waits."""

from pathlib import Path

import pytest

from tests.conftest import assert_mpi_ok
from ubnext.runtime import _emu

WORKER = Path(__file__).resolve().parent / "emu_worker.py"


@pytest.fixture(scope="module", autouse=True)
def built_library():
    _emu.build()  # once here, rather than every rank queueing on the build lock


@pytest.mark.mpi
@pytest.mark.parametrize("chaos", [False, True], ids=["plain", "chaos"])
@pytest.mark.parametrize("np", [2, 4])
def test_emulator_across_ranks(mpi, np, chaos):
    args = ["multicast", "litmus", "parked", "timeout"] + (["--chaos"] if chaos else [])
    proc = mpi(np, WORKER, *args, timeout=180)
    assert_mpi_ok(proc)
    for case in ("multicast", "litmus", "parked", "timeout"):
        assert f"emu_worker {case} chaos={chaos} np={np}: ok" in proc.stdout, proc.stdout


@pytest.mark.mpi
def test_stamped_lamport_phases_decode_in_order(mpi):
    """The Lamport one-shot's per-phase stamps (the test-only build UBNEXT_STAMPS, csrc/device/stamps.cuh)
    at 2 ranks: every rank's record, read back from its sync region by tests/gpu_check/stamps.py (what the
    one-GPU check decodes), is complete and in program order for plain and fused calls, the row split's
    exchange included; the normal build leaves the record untouched. A few seconds."""
    _emu.build("stamps")  # once here, not by both ranks
    proc = mpi(2, WORKER, "stamps", timeout=120)
    assert_mpi_ok(proc)
    assert "emu_worker stamps chaos=False np=2: ok" in proc.stdout, proc.stdout

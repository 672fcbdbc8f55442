"""The dependent-access chain probe of the one-GPU check (csrc/probes/chains.cu, tests/gpu_check/chains.py)
without a GPU: on the emulator, each mode walks the whole chain it is given and reports it the way
chains.measure checks on a GPU (where only the timing is new); the check refuses a walk that did not
follow the chain; NVRTC compiles the probe for sm_90 (chains.rehearse)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu_check import chains
from tests.mpi.emu_util import kargs
from ubnext.runtime import _emu

LINKS, STEPS = 512, 300


@pytest.fixture(scope="module")
def emu():
    return _emu.load()


def _walk(emu, table: np.ndarray, mode: int, untimed: int = LINKS, steps: int = STEPS) -> np.ndarray:
    result = np.zeros(chains.RESULT_WORDS, np.uint64)
    emu.launch(chains.KERNEL, 1, 32, kargs(**{"in": table}, out=result, n=steps, hidden=untimed, flags=mode))
    return result


@pytest.mark.parametrize("name", sorted(chains.CHAINS))
def test_each_mode_walks_the_whole_chain(emu, name):
    mode = chains.CHAINS[name][0]
    table = chains.cycle(LINKS)
    before = table.copy()
    result = _walk(emu, table, mode)
    assert chains.walk_problem(result, mode, table, LINKS, STEPS) is None, result
    assert np.array_equal(table, before), "the chain changed (the atomic mode adds 0)"


def test_the_cycle_visits_every_link():
    table = chains.cycle(LINKS)
    seen, i = set(), 0
    for _ in range(LINKS):
        seen.add(i)
        i = int(table[i, 0])
    assert i == 0 and len(seen) == LINKS


def test_a_walk_that_did_not_follow_the_chain_is_refused(emu):
    table = chains.cycle(LINKS)
    other = chains.cycle(LINKS, seed=1)
    assert "did not follow the chain" in chains.walk_problem(_walk(emu, other, 0), 0, table, LINKS, STEPS)
    assert "launched as 1" in chains.walk_problem(_walk(emu, table, 0), 1, table, LINKS, STEPS)
    assert "links timed" in chains.walk_problem(_walk(emu, table, 0, steps=STEPS - 1), 0, table, LINKS, STEPS)
    assert _walk(emu, table, 7)[3] == np.uint64(2**64 - 1), "an unknown mode must show"


def test_the_probe_compiles_for_sm_90():
    pytest.importorskip("cuda.bindings.nvrtc")
    report = chains.rehearse()
    compiled = report["compiled"]
    assert [k["name"] for k in compiled["kernels"]] == [chains.KERNEL], report
    assert compiled["kernels"][0]["spill_stores"] == 0 and compiled["cubin_bytes"] > 0, report
    assert set(report["figures"]) == set(chains.CHAINS) | {"dsmem_ld_and_barrier_cluster"}
    assert all(f["status"] == "skip" for f in report["figures"].values()), report

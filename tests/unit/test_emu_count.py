"""Count mode's calibrated counts (issue 38 item 1; rules at the top of csrc/emu/memory.cpp's count-mode
section): dependent local L2 round trips, GPU-scope atomics, serialised waits and bytes in flight per CTA,
each shown catching what it counts on the self-test kernel ``ubnext_emu_selftest_count``, in one process
(rank 0 of 1: every access is of this rank's memory), and independent of scheduling: the same counts twice
and under chaos mode."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mpi.emu_util import kargs
from ubnext.runtime import _emu
from ubnext.tuning import _emucounts

REGION_WORDS = 16384  # 64 KB


@pytest.fixture(scope="module")
def region():
    e = _emu.load()
    mem = np.zeros(REGION_WORDS, np.uint32)
    shadow = np.zeros(REGION_WORDS * _emu.STAMP_BYTES_PER_BYTE, np.uint8)
    handle = e.register(0, 1, [mem.ctypes.data], mem.nbytes)
    e.register_stamps(handle, [shadow.ctypes.data])
    e.set_counting(True)
    log = _emucounts.CountLog(e)
    try:
        yield e, mem, log
    finally:
        e.set_counting(False)
        e.configure(False)
        e.unregister(handle)


def _count(region, flags: int, n: int, grid: int = 2, chaos_seed: int | None = None) -> _emucounts.Counts:
    e, mem, log = region
    mem[:] = 0
    e.configure(chaos_seed is not None, chaos_seed or 0)
    log.take()
    e.launch("ubnext_emu_selftest_count", grid, 64, kargs(out=mem, n=n, flags=flags))
    (c,) = log.take()
    return c


def _chain(c: _emucounts.Counts) -> tuple[int, int, int, int]:
    return (c.t_hops, c.l2, c.atomics, c.waits)


def test_a_strong_local_load_costs_one_round_trip_and_dependent_ones_add_up(region):
    # n loads, each joined into the control clock by a warp op: n dependent L2 round trips
    assert _chain(_count(region, 0, 5)) == (0, 5, 0, 0)
    # n loads back to back, then a store of their sum: they overlap, one round trip
    assert _chain(_count(region, 4, 5)) == (0, 1, 0, 0)


def test_gpu_scope_atomics_whose_result_is_used_count_and_a_red_does_not(region):
    # n atomics in a chain; the red's release waits for the thread's stores to land: one hop, no atomic
    c = _count(region, 2, 4)
    assert _chain(c) == (1, 0, 4, 0)
    assert (c.hops, c.fences) == (1, 1)  # the planner's chain: as before


def test_waits_of_a_poll_loop_are_serialised_whether_or_not_the_value_was_there(region):
    # each marked wait costs a round trip after the previous one ended: n waits after the writer's atomic
    assert _chain(_count(region, 1, 6)) == (0, 0, 1, 6)
    # the flags written at the waiter's start (no atomic first): already there, still one each
    assert _chain(_count(region, 1 | 8, 6)) == (0, 0, 0, 6)


def test_a_batch_then_its_checks_counts_as_the_model_sees_it(region):
    # the Lamport pattern: load every flag, then wait for those not set. The writer's stamps are later than
    # the loads' issue, so in the model every load read the old value: n serialised waits, whichever ones
    # the kernel actually waited in
    assert _chain(_count(region, 1 | 4, 6)) == (0, 0, 1, 6)
    # stamps no later than the loads' issue: the model's loads saw the values, no wait, one round trip
    assert _chain(_count(region, 1 | 4 | 8, 6)) == (0, 1, 0, 0)


def test_a_poll_that_reloads_every_outstanding_slot_is_one_wait(region):
    # lamport_poll.cuh's poll_slots: load every flag, then re-load all those not set on each pass. The
    # writer's stamps are later than the loads' issue: one wait, however many flags (was n, above)
    assert _chain(_count(region, 1 | 16, 6)) == (0, 0, 1, 1)
    # stamps no later than the loads' issue: no wait, one round trip, as for the batch
    assert _chain(_count(region, 1 | 16 | 8, 6)) == (0, 1, 0, 0)


def test_bytes_in_flight_are_what_a_ctas_threads_load_between_two_control_advances(region):
    n = 6
    c = _count(region, 3, n, grid=1)
    assert c.cta_load_bytes == 64 * 16 * (n + 1)
    assert c.cta_inflight == 64 * 16 * n  # the barrier ends the first n loads' flight
    assert c.cta_remote_load_bytes == 0
    assert _chain(c) == (0, 2, 0, 0)  # a load, the barrier, a load


@pytest.mark.parametrize("flags", [0, 1, 1 | 4, 1 | 4 | 8, 1 | 16, 1 | 16 | 8, 2])
def test_counts_do_not_depend_on_scheduling(region, flags):
    grid = 2
    want = _count(region, flags, 8, grid)
    assert _count(region, flags, 8, grid) == want
    for seed in (1, 2, 3):
        assert _count(region, flags, 8, grid, chaos_seed=seed) == want, seed

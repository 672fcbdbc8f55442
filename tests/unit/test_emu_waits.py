"""The shared device helpers of every cross-rank wait and every error report (csrc/device/barrier.cuh) on
the CPU emulator, one process: SpinWait's clock reads, and the error word's lock under racing reports."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mpi.emu_util import SYNC_BARRIER_FLAG, kargs, pack_desc
from ubnext.pool import ERR_WORDS, SYNC_ERR_LOCK
from ubnext.runtime import _emu


def _one_rank(timeout_s: float = 0.0):
    """A sync region (zeroed: no abort, no departure), an error word and a descriptor of one rank."""
    pool = np.zeros(SYNC_BARRIER_FLAG * 4 + 4096, np.uint8)
    err = np.zeros(ERR_WORDS, np.uint32)
    desc = pack_desc(
        rank=0,
        nranks=1,
        peer_bases=[pool.__array_interface__["data"][0]],
        timeout_ns=int(timeout_s * 1e9),
        err_ptr=err.__array_interface__["data"][0],
    )
    return pool, err, desc


@pytest.mark.parametrize("steps", [1, 15, 16, 17, 40])
def test_a_wait_reads_the_clock_once_per_n_spins(emu, steps):
    """barrier.cuh's SpinWait, the spin of every cross-rank wait: a wait of K spins reads %globaltimer
    ceil(K / N) times (the first read starts its clock), not once per spin."""
    pool, err, desc = _one_rank(timeout_s=60.0)
    out = np.zeros(4, np.uint32)
    emu.launch("ubnext_emu_selftest_spin", 1, 32, kargs(desc=desc, out=out, n=steps))
    reads, ended, every = (int(x) for x in out[:3])
    assert every == 16  # barrier.cuh says why 16
    assert ended == 0, "a step ended a wait with a 60 s timeout and no abort"
    assert reads == -(-steps // every), (steps, reads)


def _report_race(emu, err, desc, base):
    emu.launch("ubnext_emu_selftest_report", 4, 64, kargs(desc=desc, n=base))
    code, op, rank, peer, field, mine, theirs, aborted = (int(w) for w in err)
    g = peer
    assert 0 <= g < 4 * 64, err
    # every word from the same report: a mixed record fails here
    assert (code, op, rank, field, mine, theirs, aborted) == (
        2,
        100 + base + g,
        0,
        g ^ 0x5A5A,
        3 * g + 7,
        ~g & 0xFFFFFFFF,
        0,
    ), err


def test_racing_reports_leave_one_intact_record(emu, chaos):
    """barrier.cuh write_error_word: 256 threads in 4 blocks report at once; the lock in device memory lets
    one record through whole. It is released after the copy (sync word ERR_LOCK is 0 after the launch), so
    once the host has taken the record (zeroed the word, as ubnext_take_kernel_error does) the next
    launch's report lands: nothing stays claimed."""
    pool, err, desc = _one_rank()
    lock = pool.view(np.uint32)[SYNC_ERR_LOCK : SYNC_ERR_LOCK + 1]
    _report_race(emu, err, desc, 0)
    assert lock[0] == 0
    err[:] = 0  # the host takes the record
    _report_race(emu, err, desc, 1000)
    assert lock[0] == 0


def test_racing_reports_without_the_lock_mix_records():
    """The test-only err_no_claim build copies records without the lock: under chaos the racing reports'
    stores interleave and _report_race sees a mixed record (in plain mode fibers run in order and the last
    writer writes every word, so chaos is what shows it). Chaos interleaves by the OS's scheduling too, so
    one seed does not always mix (a fresh clone's CI run once saw none): up to 20 seeds, until one does."""
    broken = _emu.load("err_no_claim")
    mixed_at = None
    try:
        for seed in range(1, 21):
            broken.configure(True, seed)
            _, err, desc = _one_rank()
            try:
                _report_race(broken, err, desc, 0)
            except AssertionError:
                mixed_at = seed
                break
    finally:
        broken.configure(False)
    assert mixed_at is not None, "20 chaos runs without the lock never mixed a record: the test cannot see the lock"

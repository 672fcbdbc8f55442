"""Thread-block clusters in the CPU emulator (issue 38 item 2): the launch's cluster size and its refusals,
%cluster_ctarank / %cluster_nctarank, distributed shared memory (mapa, ld/st.shared::cluster), the cluster
barrier as its own wait state, chaos mode's release at arrive, the co-scheduling of a cluster's blocks, the
misuses that fail a launch, and the count-mode counts ``dsm`` and ``cluster_syncs``. Self-test kernel:
``ubnext_emu_selftest_cluster`` (csrc/emu/selftest_cluster.cu), in one process."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mpi.emu_util import kargs
from ubnext.runtime import _emu
from ubnext.tuning import _emucounts

KERNEL = "ubnext_emu_selftest_cluster"


CHAOS_SEED = 4242  # the conftest's chaos fixture runs this module's chaos cases with it


@pytest.mark.parametrize("grid,cluster", [(4, 1), (8, 2), (16, 8), (32, 16)])
def test_cluster_ranks(emu, grid, cluster):
    block = 64
    out = np.zeros((grid, block, 2), np.uint32)
    emu.launch(KERNEL, grid, block, kargs(out=out, flags=0), cluster=cluster, nonportable_cluster=cluster > 8)
    ranks = np.arange(grid) % cluster
    np.testing.assert_array_equal(out[:, :, 0], np.repeat(ranks[:, None], block, 1), "%cluster_ctarank")
    assert (out[:, :, 1] == cluster).all(), "%cluster_nctarank"


@pytest.mark.parametrize(
    "grid,cluster,nonportable,match",
    [
        (6, 4, False, "grid 6 is not a multiple of the cluster 4"),
        (16, 16, False, "cluster 16 outside \\[1, 8\\] \\(over 8 needs the non-portable"),
        (32, 32, True, "cluster 32 outside \\[1, 16\\]"),
        (4, 0, False, "cluster 0 outside"),
    ],
)
def test_cluster_launch_refusals(emu, grid, cluster, nonportable, match):
    with pytest.raises(_emu.EmulatorError, match=match):
        emu.launch(
            KERNEL,
            grid,
            32,
            kargs(out=np.zeros(2 * 32 * grid, np.uint32)),
            cluster=cluster,
            nonportable_cluster=nonportable,
        )


@pytest.mark.parametrize("cluster", [2, 4])
def test_distributed_shared_memory_message_passing(emu, chaos, cluster):
    """Each thread stores into the next block's shared memory, the cluster barrier (arrive.release, wait)
    publishes it: every value arrives, in plain and chaos mode."""
    grid, block, rounds = 2 * cluster, 64, 50
    out = np.full(grid * block, 7, np.uint32)
    emu.launch(KERNEL, grid, block, kargs(out=out, n=rounds, flags=1), cluster=cluster)
    assert (out == 0).all(), out.reshape(grid, block)


def test_chaos_catches_a_cluster_barrier_without_release(emu):
    """The same exchange with barrier.cluster.arrive.relaxed: chaos mode holds the DSM stores in the
    writers' store buffers past the arrive, so readers see stale values; with .release (above) never."""
    emu.configure(True, 777)
    try:
        grid, block, rounds = 4, 64, 50
        out = np.zeros(grid * block, np.uint32)
        emu.launch(KERNEL, grid, block, kargs(out=out, n=rounds, flags=1 | 16), cluster=2)
        assert out.sum() > 0, "no stale value seen without the release"
    finally:
        emu.configure(False)


@pytest.mark.parametrize("grid,cluster", [(8, 8), (64, 8)])
def test_a_clusters_blocks_are_co_scheduled(emu, chaos, grid, cluster):
    """Block r of a cluster spins until block r + 1 sets its flag through DSM: a chain over the whole
    cluster that completes only if its blocks run together (here each block has its own worker, and a block
    starts its threads only once every sibling's shared memory is in place); at 64 blocks too, 8 clusters
    at once on two cores."""
    block = 32
    out = np.zeros(grid * block, np.uint32)
    emu.launch(KERNEL, grid, block, kargs(out=out, flags=2), cluster=cluster)
    assert (out == 1).all(), out.reshape(grid, block)


@pytest.mark.parametrize(
    "case,match",
    [
        (0, "barrier.cluster.arrive twice without a barrier.cluster.wait"),
        (1, "barrier.cluster.wait without a barrier.cluster.arrive"),
        (2, "mapa of 0x[0-9a-f]+, which is not this block's shared memory"),
        (3, "mapa to block rank 2 of a cluster of 2"),
        (4, "wait in __syncthreads, a warp op or the cluster barrier that the others never reach"),
        (5, "ld.shared::cluster of block rank 1 of the cluster, which has exited"),
    ],
)
def test_cluster_misuse_fails_the_launch(emu, case, match):
    grid, block = 4, 64
    with pytest.raises(_emu.EmulatorError, match=match):
        emu.launch(KERNEL, grid, block, kargs(out=np.zeros(grid * block, np.uint32), n=case, flags=3), cluster=2)


def _counts(emu, log, flags: int, n: int, chaos_seed: int | None = None) -> _emucounts.Counts:
    emu.configure(chaos_seed is not None, chaos_seed or 0)
    log.take()
    out = np.zeros(4 * 32, np.uint32)
    emu.launch(KERNEL, 4, 32, kargs(out=out, n=n, flags=flags), cluster=2)
    (c,) = log.take()
    return c


def test_counts_price_dsm_accesses_and_cluster_barriers(emu):
    """Count mode: a load of a sibling's shared memory is one ``dsm``, dependent ones add up, the block's own
    through the cluster window costs nothing; a store into a sibling lands before the next arrive; each
    cluster barrier is one ``cluster_syncs``. Nothing else is counted, and scheduling changes nothing."""
    emu.set_counting(True)
    log = _emucounts.CountLog(emu)
    try:
        for seed in (None, 5, 6):
            for n in (1, 4):
                c = _counts(emu, log, 4, n, seed)
                assert (c.dsm, c.cluster_syncs) == (n, 2), c
                assert (c.t_hops, c.l2, c.atomics, c.waits) == (0, 0, 0, 0), c
            assert (lambda c: (c.dsm, c.cluster_syncs))(_counts(emu, log, 4 | 16, 3, seed)) == (0, 2)
            assert (lambda c: (c.dsm, c.cluster_syncs))(_counts(emu, log, 4 | 32, 1, seed)) == (1, 2)
    finally:
        emu.configure(False)
        emu.set_counting(False)

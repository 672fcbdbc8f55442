"""One rank of the emulator's multi-process tests (started by tests/mpi/test_emu_mpi.py under
mpirun). Each rank maps every rank's memfd pool (fds passed by ubnext.pool._fdshare), registers it with
the emulator and runs the cases named on the command line:

  multicast  ld_reduce / st / red through the multicast range across processes, unicast pushes,
             traffic counters, identical bits on every rank (plain mode)
  litmus     message passing rank 0 -> rank 1 without a fence (must be caught in chaos mode) and
             with one (must never fail)
  parked     every rank's thread 0 pushes data + flag (no fence) to the next rank, then parks
             (barrier, warp op, pause loops) until its block saw the previous rank's flag: the
             parked thread's stores must drain (no deadlock), still unordered in chaos mode
  timeout    rank 0 waits for rank 1, which never comes: the error names op, rank and peer within
             the timeout; then rank 1 does come (a host write to rank 0's pool) and the wait ends
  stamps     the Lamport one-shot built with its per-phase stamps (UBNEXT_STAMPS, csrc/device/stamps.cuh):
             plain (unicast and multicast push) and fused (row split and one CTA per row) calls leave in
             each rank's sync region stamps that decode in program order (tests/gpu_check/stamps.py); the
             normal build leaves the record untouched
  --chaos    chaos mode for every case
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from tests.mpi.emu_util import (
    SYNC_BARRIER_FLAG,
    bf16_round,
    bf16_to_f32,
    kargs,
    pack_desc,  # noqa: E402
    reduce_in_order,
)
from ubnext.pool import _fdshare  # noqa: E402
from ubnext.runtime import _emu  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, NRANKS = COMM.Get_rank(), COMM.Get_size()
POOL_BYTES = 1 << 20
DATA_OFF = 1 << 16  # the sync region lies below


class Pool:
    def __init__(self, emu):
        fd = os.memfd_create(f"emu-test-r{RANK}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, POOL_BYTES)
            fds = _fdshare.exchange_fds(fd, RANK, NRANKS, COMM.allgather)
        finally:
            os.close(fd)
        try:
            self.maps = [mmap.mmap(f, POOL_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) for f in fds]
        finally:
            for f in fds:
                os.close(f)
        self.arrays = [np.frombuffer(m, np.uint8) for m in self.maps]
        self.bases = [a.__array_interface__["data"][0] for a in self.arrays]
        self.emu = emu
        self.mc = emu.reserve(POOL_BYTES)
        self.handle = emu.register(RANK, NRANKS, self.bases, POOL_BYTES, self.mc)
        self.own = self.arrays[RANK]

    def desc(self, **kw):
        return pack_desc(
            rank=RANK,
            nranks=NRANKS,
            peer_bases=self.bases,
            mc_base=self.mc,
            data_off=DATA_OFF,
            pool_bytes=POOL_BYTES,
            **kw,
        )

    def close(self):
        self.emu.unregister(self.handle)
        self.emu.release(self.mc, POOL_BYTES)
        self.arrays = self.own = None
        for m in self.maps:
            m.close()


def check(cond, what):
    if not cond:
        raise AssertionError(f"rank {RANK}: {what}")


def case_multicast(emu, pool, chaos):
    n = 256
    d = pool.own[DATA_OFF:]
    d[: 6 * n * 16] = 0
    inputs = []
    for r in range(NRANKS):  # every rank knows every rank's data, for the reference
        rng = np.random.default_rng(100 + r)
        inputs.append(
            (
                rng.standard_normal(8 * n).astype(np.float32),
                rng.standard_normal(8 * n).astype(np.float16),
                rng.standard_normal(4 * n).astype(np.float32),
            )
        )
    bf, f16, f32 = inputs[RANK]
    d[0 : 16 * n].view(np.uint16)[:] = bf16_round(bf)
    d[16 * n : 32 * n].view(np.float16)[:] = f16
    d[32 * n : 48 * n].view(np.float32)[:] = f32
    COMM.Barrier()
    desc = pool.desc()
    # the kernel addresses sections from the pool base: hand it the data arena as the "pool"
    desc[5] = pool.mc + DATA_OFF
    desc[16 : 16 + NRANKS] = [b + DATA_OFF for b in pool.bases]
    out = np.zeros(3 * n * 16, np.uint8)
    emu.launch("ubnext_emu_selftest_multicast", 4, 64, kargs(desc=desc, out=out, n=n))
    traffic = emu.traffic()
    COMM.Barrier()

    ref_bf = reduce_in_order([bf16_to_f32(bf16_round(x[0])) for x in inputs])
    ref_f16 = reduce_in_order([x[1] for x in inputs]).astype(np.float16)
    ref_f32 = reduce_in_order([x[2] for x in inputs])
    got_bf, got_f16, got_f32 = (
        out[0 : 16 * n].view(np.uint16),
        out[16 * n : 32 * n].view(np.float16),
        out[32 * n :].view(np.float32),
    )
    if chaos:
        np.testing.assert_allclose(bf16_to_f32(got_bf), ref_bf, rtol=1e-2, atol=1e-6)
        np.testing.assert_allclose(got_f16.astype(np.float32), ref_f16.astype(np.float32), rtol=2e-3, atol=1e-6)
        np.testing.assert_allclose(got_f32, ref_f32, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got_bf, bf16_round(ref_bf))
        np.testing.assert_array_equal(got_f16.view(np.uint16), ref_f16.view(np.uint16))
        np.testing.assert_array_equal(got_f32.view(np.uint32), ref_f32.view(np.uint32))
        digests = COMM.allgather(out.tobytes())
        check(all(x == digests[0] for x in digests), "ld_reduce bits differ between ranks")

    words = d.view(np.uint32)
    for r in range(NRANKS):
        slot = words[(3 * n + r) * 4 : (3 * n + r) * 4 + 4]
        check(list(slot) == [r, 0xABCD, 7, 9], f"rank {r}'s multicast store missing here: {slot}")
    check(words[(3 * n + NRANKS) * 4] == NRANKS, f"multicast reds: {words[(3 * n + NRANKS) * 4]} != {NRANKS}")
    pushed = words[4 * n * 4 : 5 * n * 4].reshape(n, 4)
    check(
        (pushed[:, 0] == (RANK - 1) % NRANKS).all() and (pushed[:, 1] == np.arange(n)).all(),
        "unicast push from the previous rank missing",
    )
    nxt = (RANK + 1) % NRANKS
    check(
        traffic.peer_store_bytes[nxt] == 16 * n and sum(traffic.peer_store_bytes) == 16 * n,
        f"peer store traffic {traffic.peer_store_bytes[:NRANKS]}",
    )
    check(
        traffic.peer_load_bytes[RANK] == 0
        and all(traffic.peer_load_bytes[p] == 4 * n for p in range(NRANKS) if p != RANK),
        f"peer load traffic {traffic.peer_load_bytes[:NRANKS]}",
    )
    check(
        (traffic.mc_ld_reduce_bytes, traffic.mc_store_ops, traffic.mc_red_ops) == (48 * n, 1, 1),
        f"multicast traffic {traffic}",
    )


def _litmus(emu, pool, fence, messages=40, threads=32):
    pool.own[DATA_OFF : DATA_OFF + 3 * threads * 4] = 0
    COMM.Barrier()
    out = np.zeros(threads, np.uint32)
    emu.launch(
        "ubnext_emu_selftest_litmus", 1, threads, kargs(desc=pool.desc(), out=out, n=messages, flags=1 if fence else 0)
    )
    COMM.Barrier()
    check((out != 0xFFFFFFFF).all(), "litmus timed out")
    return int(COMM.bcast(int(out.sum()) if RANK == 1 else None, root=1))


def case_litmus(emu, pool, chaos):
    check(_litmus(emu, pool, fence=True) == 0, "a fenced message was seen before its data")
    unfenced = _litmus(emu, pool, fence=False)
    if chaos:
        check(unfenced > 0, "chaos mode never let rank 1 see a flag before its data")
    else:
        check(unfenced == 0, "plain mode reordered stores")  # x86 is TSO: documents the need for chaos


def case_parked(emu, pool, chaos):
    launches, stale = 5, 0
    inbox = pool.own[DATA_OFF : DATA_OFF + 64].view(np.uint32)
    for mode in range(4):  # __syncthreads, __syncwarp, spin_pause, __nanosleep
        for i in range(launches):
            inbox[:] = 0
            out = np.zeros(2, np.uint32)
            COMM.Barrier()
            emu.launch(
                "ubnext_emu_selftest_parked",
                1,
                64,
                kargs(desc=pool.desc(), out=out, n=(mode * launches + i + 1) << 8, flags=mode),
            )
            COMM.Barrier()
            check(out[0] == 1, f"mode {mode}: the previous rank's flag never came (parked stores stuck)")
            stale += int(out[1])
    stale = sum(COMM.allgather(stale))
    if chaos:
        check(stale > 0, "a parked thread's stores became visible in order, every time")
    else:
        check(stale == 0, "plain mode reordered stores")


def case_timeout(emu, pool, chaos):
    sync = pool.own[:DATA_OFF].view(np.uint32)
    sync[:] = 0
    err = np.zeros(4, np.uint32)
    COMM.Barrier()
    if RANK == 0:  # rank 1 never arrives
        t0 = time.monotonic()
        emu.launch(
            "ubnext_emu_selftest_wait",
            2,
            32,
            kargs(desc=pool.desc(timeout_ns=int(1e9), err_ptr=err.__array_interface__["data"][0]), n=3, hidden=1),
        )
        elapsed = time.monotonic() - t0
        check(list(err) == [1, 3, 0, 1], f"error words {list(err)} (want timeout, op 3, rank 0, peer 1)")
        # the lower bound is the protocol's; the upper one only says "it ended", generously,
        # because the other core may be busy (the launch watchdog catches a wait that never ends)
        check(1.0 <= elapsed < 30.0, f"timeout after {elapsed:.2f} s, want ~1 s")
    COMM.Barrier()
    # now rank 1 does arrive: it writes the flags into rank 0's pool, from the host, late
    err[:] = 0
    if RANK == 0:
        sync[:] = 0
    COMM.Barrier()
    if RANK == 1:
        time.sleep(0.3)
        peer_sync = pool.arrays[0][:DATA_OFF].view(np.uint32)
        for b in range(2):
            peer_sync[SYNC_BARRIER_FLAG + b * 16 + 1] = 1
    elif RANK == 0:
        emu.launch(
            "ubnext_emu_selftest_wait",
            2,
            32,
            kargs(desc=pool.desc(timeout_ns=int(10e9), err_ptr=err.__array_interface__["data"][0]), n=3, hidden=1),
        )
        # a wait that missed the peer's flags would end at the 10 s bound with the timeout code
        check(list(err) == [0, 0, 0, 0], f"the wait failed although the peer came: {list(err)}")
    COMM.Barrier()


LAMPORT_OFF = DATA_OFF + (1 << 18)  # the stamps case's Lamport buffers: past the other cases' data
LAMPORT_SLOT = 1 << 15
SENTINEL = -0x80000000  # the Lamport "not yet written" word (-0.0f)
F_FUSED_NORM, F_MULTICAST = 1, 8  # UBNEXT_F_* (desc.cuh)


def _lamport(emu, pool, err, dtype, n, hidden, grid, flags, cluster=1):
    """One Lamport one-shot call of this rank (64-thread blocks, in clusters of ``cluster``), inputs that
    differ per rank; returns (in, out) as the kernel saw them."""
    kernel = {np.float32: "ubnext_lamport_fp32", np.uint16: "ubnext_lamport_bf16"}[dtype]
    rng = np.random.default_rng(7 + RANK)
    values = rng.standard_normal(n).astype(np.float32)
    x = values if dtype is np.float32 else bf16_round(values)
    out = np.zeros(n, dtype)
    fused = {}
    if flags & F_FUSED_NORM:
        fused = {
            "residual": bf16_round(rng.standard_normal(n).astype(np.float32)),
            "residual_out": np.zeros(n, dtype),
            "weight": bf16_round(np.ones(hidden, np.float32)),
            "eps": 1e-6,
        }
    desc = pool.desc(
        timeout_ns=int(20e9),
        err_ptr=err.__array_interface__["data"][0],
        sync_off=0,
        lamport_off=LAMPORT_OFF,
        lamport_slot_bytes=LAMPORT_SLOT,
    )
    emu.launch(
        kernel,
        grid,
        64,
        kargs(desc=desc, out=out, n=n, hidden=hidden, flags=flags, **{"in": x}, **fused),
        cluster=cluster,
    )
    check(not err.any(), f"{kernel} flags={flags} failed: error words {list(err)}")
    return x, out


def case_stamps(emu, pool, chaos):
    from tests.gpu_check import stamps

    own_sync = pool.own[:DATA_OFF]
    own_sync[:] = 0
    pool.own[LAMPORT_OFF : LAMPORT_OFF + 3 * NRANKS * LAMPORT_SLOT].view(np.int32)[:] = SENTINEL
    err = np.zeros(8, np.uint32)
    COMM.Barrier()
    stamped = _emu.load(stamps.EMU_BUILD)
    handle = stamped.register(RANK, NRANKS, pool.bases, POOL_BYTES, pool.mc)
    try:
        # the normal build first: it computes the same sum and never touches the record
        x, out = _lamport(emu, pool, err, np.float32, 1024, 0, 2, 0)
        sums = COMM.allgather(x)
        check(np.array_equal(out, reduce_in_order(sums)), "the normal build's sum is wrong")
        check(
            not own_sync[stamps.OFFSET : stamps.OFFSET + stamps.RECORD_BYTES].any(),
            "the normal build wrote into the stamp record",
        )
        calls = [  # what, dtype, n, hidden, grid, flags, row split
            ("plain", np.float32, 1024, 0, 2, 0, False),
            ("plain multicast", np.float32, 1024, 0, 2, F_MULTICAST, False),
            # one row of 1024 vectors over 4 CTAs: norm.cuh's row split (4 parts of 8 groups)
            ("fused, row split", np.uint16, 8192, 8192, 4, F_FUSED_NORM, True),
            # two rows, two CTAs: one CTA per row
            ("fused, a CTA per row", np.uint16, 2 * 1024, 1024, 2, F_FUSED_NORM, False),
        ]
        for what, dtype, n, hidden, grid, flags, row_split in calls:
            # a row split is a cluster launch of the row's CTAs (norm.cuh)
            x, out = _lamport(stamped, pool, err, dtype, n, hidden, grid, flags, grid if row_split else 1)
            if not flags & F_FUSED_NORM:
                check(
                    np.array_equal(out, reduce_in_order(COMM.allgather(x))), f"{what}: the stamped build's sum is wrong"
                )
            record = stamps.decode(bytes(own_sync), NRANKS)
            problems = stamps.order_problems(record, row_split=row_split)
            check(not problems, f"{what}: stamps {record}: {problems}")
            if RANK == 0:
                print(f"emu_worker stamps {what}: ns after entry {stamps.since_entry(record)}", flush=True)
    finally:
        COMM.Barrier()
        stamped.unregister(handle)


CASES = {
    "multicast": case_multicast,
    "litmus": case_litmus,
    "parked": case_parked,
    "timeout": case_timeout,
    "stamps": case_stamps,
}


def main(argv):
    chaos = "--chaos" in argv
    names = [a for a in argv if not a.startswith("--")]
    emu = _emu.load()
    emu.set_watchdog(60.0)
    emu.configure(chaos, 1000 + RANK)
    pool = Pool(emu)
    try:
        for name in names:
            t0 = time.monotonic()
            CASES[name](emu, pool, chaos)
            if RANK == 0:
                print(f"emu_worker {name} chaos={chaos} np={NRANKS}: ok ({time.monotonic() - t0:.2f} s)", flush=True)
    finally:
        COMM.Barrier()
        pool.close()
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except Exception:
        import traceback

        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        COMM.Abort(1)
    sys.exit(code)

"""The CPU emulator itself, in one process (no MPI): execution model, multicast semantics with
fake ranks (several mappings of one process stand for the ranks), traffic counters, chaos-mode
store reordering, timeouts, the watchdog, the build cache and fd passing."""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.mpi.emu_util import SYNC_BARRIER_FLAG, bf16_round, bf16_to_f32, kargs, pack_desc, reduce_in_order
from ubnext.pool import _fdshare
from ubnext.runtime import _emu

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- execution model


@pytest.mark.parametrize("grid,block", [(1, 32), (3, 64), (4, 256)])
def test_block_model(emu, chaos, grid, block):
    out = np.zeros((grid, block, 8), np.uint32)
    counter = np.zeros(4, np.uint32)
    emu.launch("ubnext_emu_selftest_block", grid, block, kargs(out=out, residual_out=counter))
    tid = np.arange(block)
    lane = tid % 32
    for b in range(grid):
        o = out[b]
        np.testing.assert_array_equal(o[:, 0], (block - 1 - tid) * 3 + b, "shared memory + __syncthreads")
        assert (o[:, 1] == 496).all(), "xor butterfly"
        warp_base = tid - lane
        expect_down = np.where(lane == 0, 32 * warp_base + 496, 0xFFFFFFFF)
        np.testing.assert_array_equal(o[:, 2], expect_down, "shfl_down reduction")
        np.testing.assert_array_equal(o[:, 3], warp_base + 5, "shfl broadcast")
        assert (o[:, 4] == 0xAAAAAAAA).all(), "ballot"
        assert (o[:, 5] == 3).all(), "any/all"
        assert (o[:, 6] == block // 2).all(), "__syncthreads_count"
        assert (o[:, 7] == 1000 + b).all(), "per-block __shared__ was clobbered by another block"
    assert counter[0] == grid * block


def test_warp_op_variants(emu, chaos):
    grid, block = 2, 96
    out = np.zeros((grid, block, 8), np.uint32)
    emu.launch("ubnext_emu_selftest_warp", grid, block, kargs(out=out))
    lane = np.arange(block) % 32
    for b in range(grid):
        o = out[b]
        np.testing.assert_array_equal(o[:, 0], lane ^ 1, "shfl_xor width 16")
        np.testing.assert_array_equal(o[:, 1], np.where(lane % 8 + 4 < 8, lane + 4, lane), "shfl_down width 8")
        np.testing.assert_array_equal(o[:, 2], np.where(lane >= 3, lane - 3, lane), "shfl_up")
        np.testing.assert_array_equal(o[:, 3], (lane & ~7) + 3, "shfl width 8")
        np.testing.assert_array_equal(o[:, 4], lane ^ 2, "64-bit float shuffle")
        assert (o[:, 5] == 31 + 7000).all(), "64-bit integer shuffle"
        assert (o[:, 6] == 3).all(), "__syncthreads_and/or"
        np.testing.assert_array_equal(o[:, 7], np.where(lane < 16, 0xFFFF, 0), "__activemask after exits")


def test_blocks_wait_on_each_other(emu, chaos):
    grid, rounds = 32, 5
    out = np.zeros(grid, np.uint32)
    counter = np.zeros(1, np.uint32)
    t0 = time.monotonic()
    emu.launch("ubnext_emu_selftest_gridsync", grid, 64, kargs(out=out, residual_out=counter, n=rounds))
    assert (out == 1).all(), out
    assert counter[0] == grid * rounds
    assert time.monotonic() - t0 < 10


def test_divergent_barrier_is_reported(emu):
    out = np.zeros((1, 64, 8), np.uint32)
    with pytest.raises(_emu.EmulatorError, match="__syncthreads or a warp op"):
        emu.launch("ubnext_emu_selftest_block", 1, 64, kargs(out=out, residual_out=np.zeros(1, np.uint32), flags=1))


def test_trap_is_reported(emu):
    out = np.zeros((2, 32, 8), np.uint32)
    with pytest.raises(_emu.EmulatorError, match=r"__trap\(\) in block \(0,0,0\) thread \(0,0,0\)"):
        emu.launch("ubnext_emu_selftest_block", 2, 32, kargs(out=out, residual_out=np.zeros(1, np.uint32), flags=2))


def test_a_kernel_that_touches_memory_before_griddepcontrol_wait_fails_under_pdl(emu):
    """PDL (csrc/device/ptx.cuh): in a launch with the attribute, a thread's memory access before its
    griddepcontrol.wait fails the launch. The real quantize kernel (local: no pool needed) waits at its
    entry; the test-only build no_pdl_wait leaves every kernel's wait out, and is caught at its first
    access (the tests/mpi case `pdl` checks every kernel path's placement with the correct build)."""
    rows, hidden = 3, 64
    x = bf16_round(np.linspace(-3, 3, rows * hidden, dtype=np.float32))

    def quantize(lib, pdl):
        q, scale_inv = np.zeros(rows * hidden, np.uint8), np.zeros(rows, np.float32)
        lib.launch(
            "ubnext_quantize_fp8_bf16",
            2,
            64,
            kargs(**{"in": x, "out": q, "scale_inv": scale_inv, "n": rows * hidden, "hidden": hidden, "flags": 4}),
            pdl=pdl,
        )  # UBNEXT_F_FP8_PER_TOKEN
        return q, scale_inv

    want = quantize(emu, pdl=False)
    assert np.array_equal(quantize(emu, pdl=True)[0], want[0])
    assert emu.griddep() == _emu.GridDep(threads=128, waited=128, launched=0)  # local: launched at exit
    broken = _emu.load("no_pdl_wait")
    with pytest.raises(
        _emu.EmulatorError,
        match=r"load at 0x[0-9a-f]+ before griddepcontrol.wait .* in "
        r"block \(\d,0,0\) thread",
    ):
        quantize(broken, pdl=True)
    assert np.array_equal(quantize(broken, pdl=False)[0], want[0])  # without the attribute nothing waits
    assert broken.griddep().waited == 0


@pytest.mark.parametrize(
    "kernel,grid,block,match",
    [
        ("ubnext_no_such_kernel", 1, 32, "no kernel named"),
        ("ubnext_emu_selftest_block", 0, 32, "grid 0"),
        ("ubnext_emu_selftest_block", _emu.MAX_GRID + 1, 32, f"grid {_emu.MAX_GRID + 1}"),
        ("ubnext_emu_selftest_block", 1, 48, "block 48"),
        ("ubnext_emu_selftest_block", 1, 2048, "block 2048"),
    ],
)
def test_bad_launch(emu, kernel, grid, block, match):
    with pytest.raises(_emu.EmulatorError, match=match):
        emu.launch(kernel, grid, block, kargs())


# ---------------------------------------------------------------------------- multicast, traffic


class FakeRanks:
    """`nranks` copies of a region in this process, registered as rank 0's view, plus a
    multicast range: the twins cannot tell them from other processes' memfd mappings."""

    def __init__(self, emu, nranks: int, nbytes: int):
        self.emu, self.nbytes = emu, nbytes
        self.copies = [np.zeros(nbytes, np.uint8) for _ in range(nranks)]
        self.bases = [c.__array_interface__["data"][0] for c in self.copies]
        self.mc = emu.reserve(nbytes)
        self.handle = emu.register(0, nranks, self.bases, nbytes, self.mc)

    def close(self):
        self.emu.unregister(self.handle)
        self.emu.release(self.mc, self.nbytes)


def _f16_inputs(rng, shape):
    vals = rng.standard_normal(shape).astype(np.float32)
    # edge cases of the fp32 -> fp16 rounding: sums in the subnormal range and near the max
    vals.flat[:8] = [3e-6, -2e-6, 6e-8, 1e-7, 16000.0, 16400.0, -16380.0, 0.5]
    return vals.astype(np.float16)


@pytest.mark.parametrize("nranks", [2, 4])
def test_multicast_semantics_and_traffic(emu, chaos, nranks):
    n = 200  # 16-byte vectors per section; more than one grid-stride pass at grid 2 x block 64
    nbytes = (4 * n + nranks + 1) * 16 + 16 * n
    fake = FakeRanks(emu, nranks, nbytes)
    try:
        rng = np.random.default_rng(nranks)
        bf = [rng.standard_normal(8 * n).astype(np.float32) for _ in range(nranks)]
        f16 = [_f16_inputs(rng, 8 * n) for _ in range(nranks)]
        f32 = [rng.standard_normal(4 * n).astype(np.float32) for _ in range(nranks)]
        for r, c in enumerate(fake.copies):
            c[0 : 16 * n].view(np.uint16)[:] = bf16_round(bf[r])
            c[16 * n : 32 * n].view(np.float16)[:] = f16[r]
            c[32 * n : 48 * n].view(np.float32)[:] = f32[r]
        desc = pack_desc(rank=0, nranks=nranks, peer_bases=fake.bases, mc_base=fake.mc)
        out = np.zeros(3 * n * 16, np.uint8)
        emu.launch("ubnext_emu_selftest_multicast", 2, 64, kargs(desc=desc, out=out, n=n))

        got_bf = out[0 : 16 * n].view(np.uint16)
        got_f16 = out[16 * n : 32 * n].view(np.float16)
        got_f32 = out[32 * n : 48 * n].view(np.float32)
        ref_bf = reduce_in_order([bf16_to_f32(bf16_round(x)) for x in bf])
        with np.errstate(over="ignore"):  # 4 x 16400 is beyond fp16: must round to inf
            ref_f16 = reduce_in_order(f16).astype(np.float16)
        ref_f32 = reduce_in_order(f32)
        if not chaos:  # rank order 0..N-1: bit-exact
            np.testing.assert_array_equal(got_bf, bf16_round(ref_bf))
            np.testing.assert_array_equal(got_f16.view(np.uint16), ref_f16.view(np.uint16))
            np.testing.assert_array_equal(got_f32.view(np.uint32), ref_f32.view(np.uint32))
        else:  # the switch's order is unspecified: only the rounding of the fp32 sum may differ
            np.testing.assert_allclose(bf16_to_f32(got_bf), ref_bf, rtol=1e-2, atol=1e-6)
            np.testing.assert_allclose(got_f16.astype(np.float32), ref_f16.astype(np.float32), rtol=2e-3, atol=1e-7)
            np.testing.assert_allclose(got_f32, ref_f32, rtol=1e-5, atol=1e-6)

        for r, c in enumerate(fake.copies):
            words = c.view(np.uint32)
            slot = words[(3 * n) * 4 : (3 * n) * 4 + 4]
            np.testing.assert_array_equal(slot, [0, 0xABCD, 7, 9], f"multicast store missing in copy {r}")
            assert words[(3 * n + nranks) * 4] == 1, f"multicast red missing in copy {r}"
        pushed = fake.copies[1].view(np.uint32)[4 * n * 4 : 5 * n * 4].reshape(n, 4)
        np.testing.assert_array_equal(pushed[:, 1], np.arange(n), "unicast store to the next peer")

        t = emu.traffic()
        assert t.peer_store_bytes[1] == 16 * n and t.peer_store_ops[1] == n
        assert sum(t.peer_store_bytes) == 16 * n
        assert t.peer_load_bytes[0] == 0, "own-rank accesses are not peer traffic"
        for p in range(1, nranks):
            assert t.peer_load_bytes[p] == 4 * n and t.peer_load_ops[p] == n
        assert sum(t.peer_load_ops[nranks:]) == 0
        assert (t.mc_ld_reduce_ops, t.mc_ld_reduce_bytes) == (3 * n, 48 * n)
        assert (t.mc_store_ops, t.mc_store_bytes) == (1, 16)
        assert (t.mc_red_ops, t.mc_red_bytes) == (1, 4)
    finally:
        fake.close()


@pytest.mark.parametrize("fence", [False, True], ids=["no-fence", "fence"])
def test_proxy_model(emu, chaos, fence):
    """A thread that reads back through unicast what it stored through multicast sees its store only
    after fence.proxy.alias, in chaos mode (PTX: distinct virtual aliases are distinct proxies).
    Every peer copy gets the store either way."""
    n = 96
    fake = FakeRanks(emu, 2, n * 16)
    try:
        desc = pack_desc(rank=0, nranks=2, peer_bases=fake.bases, mc_base=fake.mc)
        out = np.zeros((n, 4), np.uint32)
        emu.launch("ubnext_emu_selftest_proxy", 2, 32, kargs(desc=desc, out=out, n=n, flags=1 if fence else 0))
        stored = np.stack([np.arange(1, n + 1), np.full(n, 0xABCD), np.zeros(n), np.full(n, 7)], 1).astype(np.uint32)
        for c in fake.copies:
            np.testing.assert_array_equal(c.view(np.uint32)[: 4 * n].reshape(n, 4), stored)
        if fence or not chaos:
            np.testing.assert_array_equal(out, stored)
        else:
            assert not out.any(), "chaos mode: an unfenced unicast read-back saw the multicast store"
    finally:
        fake.close()


def test_proxy_model_store_shows_eventually(emu, chaos):
    """Without the fence, a thread that polls its own multicast store through unicast reads the old
    bytes first (chaos mode) and then, within a few reads, the store: a poll that retries what it
    cannot accept (a Lamport poll and its sentinel) needs no fence (issue 24 A, csrc/kernels/lamport.cu)."""
    n = 96
    fake = FakeRanks(emu, 2, n * 16)
    try:
        desc = pack_desc(rank=0, nranks=2, peer_bases=fake.bases, mc_base=fake.mc)
        out = np.zeros((n, 4), np.uint32)
        reads = np.zeros(n, np.uint32)
        emu.launch("ubnext_emu_selftest_proxy", 2, 32, kargs(desc=desc, out=out, residual_out=reads, n=n, flags=2))
        stored = np.stack([np.arange(1, n + 1), np.full(n, 0xABCD), np.zeros(n), np.full(n, 7)], 1).astype(np.uint32)
        np.testing.assert_array_equal(out, stored)
        if chaos:
            assert (reads >= 2).all() and (reads <= 8 + 1).all(), reads  # memory.cpp: kMaxStaleLoads = 8
        else:
            assert (reads == 1).all(), reads
    finally:
        fake.close()


def test_traffic_resets_per_launch(emu):
    fake = FakeRanks(emu, 2, 4096)
    try:
        desc = pack_desc(rank=0, nranks=2, peer_bases=fake.bases, mc_base=fake.mc)
        emu.launch("ubnext_emu_selftest_multicast", 1, 32, kargs(desc=desc, out=np.zeros(3 * 16 * 4, np.uint8), n=4))
        assert emu.traffic().mc_ld_reduce_ops == 12
        emu.launch(
            "ubnext_emu_selftest_block",
            1,
            32,
            kargs(out=np.zeros((1, 32, 8), np.uint32), residual_out=np.zeros(1, np.uint32)),
        )
        t = emu.traffic()
        assert t.mc_ld_reduce_ops == 0 and sum(t.peer_load_ops) == 0
    finally:
        fake.close()


# ---------------------------------------------------------------------------- chaos: ordering


def _litmus(emu, fence: bool, messages: int = 40, threads: int = 64) -> int:
    words = np.zeros(3 * threads, np.uint32)
    out = np.zeros(threads, np.uint32)
    emu.launch(
        "ubnext_emu_selftest_litmus",
        2,
        threads,
        kargs(out=out, residual_out=words, n=messages, flags=1 if fence else 0),
    )
    assert (out != 0xFFFFFFFF).all(), "litmus test timed out"
    return int(out.sum())


def test_chaos_reorders_unfenced_stores(emu):
    """Message passing without a fence between data and flag: chaos mode must let a reader see
    the flag before the data (with high probability: thousands of messages)."""
    emu.configure(True, 7)
    try:
        violations = _litmus(emu, fence=False)
    finally:
        emu.configure(False)
    assert violations > 0, "chaos mode never reordered a data store after its flag"


def test_fence_orders_stores_under_chaos(emu):
    emu.configure(True, 8)
    try:
        assert _litmus(emu, fence=True) == 0
    finally:
        emu.configure(False)


def test_plain_mode_is_in_order(emu):
    emu.configure(False)
    assert _litmus(emu, fence=False, messages=10) == 0


PARKED_MODES = {0: "__syncthreads", 1: "__syncwarp", 2: "spin_pause", 3: "__nanosleep"}
_parked_tag = iter(range(1 << 8, 1 << 30, 1 << 8))  # distinct flag values: see the kernel


@pytest.mark.parametrize("mode", list(PARKED_MODES), ids=list(PARKED_MODES.values()))
def test_parked_thread_stores_become_visible(emu, chaos, mode):
    """Each block's thread 0 pushes data + flag to the other block without a fence, then parks
    (barrier, warp op, or a pause loop on __shared__) until its block has seen the other's flag.
    Hardware drains the parked thread's stores eventually: chaos mode must not hold them until
    the thread runs again (a deadlock), and must still not order them (stale data after a flag
    stays possible)."""
    launches, stale = 12, 0
    t0 = time.monotonic()
    for _ in range(launches):
        words = np.zeros(32, np.uint32)
        out = np.zeros((2, 2), np.uint32)
        emu.launch(
            "ubnext_emu_selftest_parked", 2, 128, kargs(out=out, residual_out=words, n=next(_parked_tag), flags=mode)
        )
        assert (out[:, 0] == 1).all(), f"a block never saw the other's flag (5 s): {out[:, 0]}"
        stale += int(out[:, 1].sum())
    assert time.monotonic() - t0 < 5
    if chaos:
        assert stale > 0, "draining a parked thread's buffer made its stores visible in order"
    else:
        assert stale == 0


# ---------------------------------------------------------------------------- bounded waits


def _wait_setup(timeout_s: float):
    pool = np.zeros(SYNC_BARRIER_FLAG * 4 + 4096, np.uint8)
    err = np.zeros(4, np.uint32)
    desc = pack_desc(
        rank=0,
        nranks=2,
        peer_bases=[pool.__array_interface__["data"][0], 0],
        timeout_ns=int(timeout_s * 1e9),
        err_ptr=err.__array_interface__["data"][0],
    )
    return pool, err, desc


def test_wait_times_out_naming_rank_and_peer(emu):
    pool, err, desc = _wait_setup(0.5)
    t0 = time.monotonic()
    emu.launch("ubnext_emu_selftest_wait", 4, 32, kargs(desc=desc, n=5, hidden=1))
    elapsed = time.monotonic() - t0
    np.testing.assert_array_equal(err, [1, 5, 0, 1])  # {timeout, op 5, rank 0, peer 1}
    assert 0.5 <= elapsed < 3.0, elapsed


def test_watchdog_aborts_a_stuck_launch(tmp_path):
    """A kernel that spins without a bound: the watchdog ends the process with a report instead
    of hanging the test run."""
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r})
        from tests.unit.test_emu import _wait_setup
        from tests.mpi.emu_util import kargs
        from ubnext.runtime import _emu
        emu = _emu.load()
        emu.set_watchdog(1.0)
        pool, err, desc = _wait_setup(0.1)
        emu.launch("ubnext_emu_selftest_wait", 2, 32, kargs(desc=desc, n=5, hidden=1, flags=1))
        print("launch returned")
    """)
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "launch returned" not in proc.stdout
    assert "watchdog" in proc.stderr and "ubnext_emu_selftest_wait" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 30


# ---------------------------------------------------------------------------- build


def test_build_is_cached_and_break_builds_are_separate(emu):
    first = _emu.build()  # may differ from emu.path if csrc/ changed since the module loaded it
    t0 = time.monotonic()
    assert _emu.build() == first and first.exists()
    assert time.monotonic() - t0 < 2, "an unchanged tree must not rebuild"
    flags = _emu._flags("no_release")
    assert "-DUBNEXT_BREAK_NO_RELEASE" in flags and "-DUBNEXT_EMULATOR" in flags
    assert _emu._build_key(_emu._compiler(), flags) != _emu._build_key(_emu._compiler(), _emu._flags(""))
    with pytest.raises(ValueError, match="unknown emulator break"):
        _emu.build("no_such_break")


def test_concurrent_builds_share_one_library(tmp_path, monkeypatch):
    """Ranks that start at once with an empty cache: one compiles, the others wait for its lock
    and reuse the result (compilation replaced by a slow fake: the lock is what is tested)."""
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_compile(cxx, flags, sources, workdir, out, objects):
        calls.append(out)
        time.sleep(0.5)
        Path(out).write_bytes(b"lib")

    monkeypatch.setattr(_emu, "_compile", fake_compile)
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(_emu.build())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and len(paths) == 3 and len(set(paths)) == 1
    assert paths[0].read_bytes() == b"lib"
    assert not list((tmp_path / "emu").glob(".build-*")), "temporary build directories left behind"


# ---------------------------------------------------------------------------- fd passing


def _thread_allgather(nranks):
    """allgather for ranks that are threads of this process."""
    slots = [None] * nranks
    barrier = threading.Barrier(nranks)

    def make(rank):
        def allgather(obj):
            slots[rank] = obj
            barrier.wait(timeout=30)
            result = list(slots)
            barrier.wait(timeout=30)
            return result

        return allgather

    return make


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("only_from", [None, 0, 2])
def test_exchange_fds(only_from):
    nranks = 3
    make = _thread_allgather(nranks)
    results, errors = [None] * nranks, []
    before = _open_fds()

    def rank_main(rank):
        try:
            fd = os.memfd_create(f"t{rank}")
            os.write(fd, bytes([rank + 1]) * 16)
            try:
                fds = _fdshare.exchange_fds(fd, rank, nranks, make(rank), only_from=only_from)
            finally:
                os.close(fd)
            seen = []
            for f in fds:
                seen.append(-1 if f < 0 else mmap.mmap(f, 16, mmap.MAP_SHARED, mmap.PROT_READ)[0])
                if f >= 0:
                    os.close(f)
            results[rank] = seen
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    expect = [r + 1 if only_from in (None, r) else -1 for r in range(nranks)]
    assert results == [expect] * nranks
    assert _open_fds() == before, "exchange_fds leaked descriptors"


def test_exchange_fds_a_rank_that_cannot_listen_still_takes_part(monkeypatch):
    """A rank whose socket cannot be opened still joins the exchange's allgather (its peers would
    otherwise pair that allgather with its next collective), and every rank raises."""
    nranks = 3
    make = _thread_allgather(nranks)
    errors = [None] * nranks
    real_socket = socket.socket

    def rank_main(rank):
        fd = os.memfd_create(f"t{rank}")
        try:
            if rank == 1:
                _fdshare_socket.value = "fail"
            _fdshare.exchange_fds(fd, rank, nranks, make(rank))
        except OSError as exc:
            errors[rank] = exc
        finally:
            os.close(fd)

    class Socket(real_socket):
        def bind(self, address):
            if getattr(_fdshare_socket, "value", None) == "fail":
                raise OSError("address in use")
            return super().bind(address)

    monkeypatch.setattr(_fdshare.socket, "socket", Socket)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a rank hangs in the exchange"
    assert "address in use" in str(errors[1])
    assert all("rank(s) [1] could not open a socket" in str(e) for e in (errors[0], errors[2])), errors


_fdshare_socket = threading.local()

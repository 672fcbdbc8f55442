"""Programmatic dependent launch on a GPU (sm_90 and later), one GPU, no ranks: what the emulator, which
serialises launches, cannot show (docs/TESTING.md). A chain of CHAIN one-rank Lamport allreduces (fp32),
launch k reading buffer k and writing buffer k + 1 (one rank: the identity), queued back to back on one
stream, the pool reset before each chain; buffers 1..CHAIN start as NaN, so a read before the write shows.

- With the attribute the chain is exact and takes less GPU time per launch than in plain stream order.
  Timed by CUDA events around the chain, the GPU held busy (torch.cuda._sleep) until the host has queued
  every launch: the host needs several microseconds of Python per launch, about a kernel's time, so
  without the hold the events would time the host's pace. A chain whose start event had already passed
  when its last launch was queued is timed again with a longer hold.
- The negative case needs a dependent that really starts before its input is written. The kernels
  trigger their dependents last, after their last write (csrc/device/entry.cuh, lamport.cu), so a build
  without griddepcontrol.wait alone shows nothing here. The test-only build UBNEXT_BREAK_EARLY_TRIGGER
  triggers them at the kernel's entry instead (one rank only: entry.cuh says why): with the wait the
  chain stays exact (the wait, not the late trigger, is what orders it); built with UBNEXT_BREAK_NO_PDL_WAIT
  too, it goes wrong or a kernel reports a timeout.
- Every kernel object stays referenced (its cuda.core ObjectCode and Kernel, for the module's tests) while
  its driver handle, taken from that kept Kernel, is launched.

The test-only builds are compiled here by NVRTC (ubnext.kernels' compile helper; not cached). Written
without a GPU at hand: its first run is the one-GPU check (tests/gpu_check)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from ubnext import kernels, pool
from ubnext.runtime import _cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _cuda.gpu_available(), reason=f"GPU tier: {_cuda.no_gpu_reason()}"),
]

N = 1 << 16  # fp32 elements per call: 256 KB, 64 blocks of 256 threads
BLOCK = 256
CHAIN = 200
KERNEL = "ubnext_lamport_fp32"
EARLY_TRIGGER = ("UBNEXT_BREAK_EARLY_TRIGGER",)
EARLY_TRIGGER_NO_WAIT = ("UBNEXT_BREAK_EARLY_TRIGGER", "UBNEXT_BREAK_NO_PDL_WAIT")
HOLD_CYCLES = 50_000_000  # the first hold: ~25 ms at H100 clocks, against ~2 ms of host time for CHAIN launches
HOLD_TRIES = 3  # each doubles the hold


class OneRankPool(NamedTuple):
    memory: torch.Tensor  # the pool in plain device memory, the descriptor's copy at its base
    err: torch.Tensor  # the pinned error word
    desc: bytes
    layout: pool.PoolLayout

    def reset(self) -> None:
        """A fresh communicator's state: zeroed sync region, poisoned Lamport buffers, no error. Each
        chain starts from it, whatever the chain before did (a broken one may have aborted)."""
        lay = self.layout
        self.memory[lay.sync_off : lay.sync_off + pool.SYNC_BYTES].zero_()
        self.memory[lay.lamport_off : lay.lamport_off + lay.lamport_bytes].view(torch.int32).fill_(pool.SENTINEL_WORD)
        torch.cuda.synchronize()
        self.err.zero_()


class Build(NamedTuple):
    code: object  # cuda.core ObjectCode: its module stays loaded while this lives
    kernel: object  # cuda.core Kernel
    handle: object  # the CUfunction taken from `kernel`, launched while both live


@pytest.fixture(scope="module")
def one_rank_pool():
    if torch.cuda.get_device_capability(0)[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    from ubnext.pool.symmetric import _device_pointer_of_pinned

    layout = pool.PoolLayout(1, pool.PAGE * ((N * 4 + pool.LAMPORT_HEADER_BYTES) // pool.PAGE + 1), 1 << 20)
    memory = torch.zeros(layout.pool_bytes, dtype=torch.uint8, device="cuda:0")
    err = torch.zeros(pool.ERR_WORDS, dtype=torch.int32, pin_memory=True)
    desc = pool.pack_desc(
        rank=0,
        nranks=1,
        timeout_ns=2_000_000_000,
        err_ptr=_device_pointer_of_pinned(err),
        mc_base=0,
        layout=layout,
        peer_bases=[memory.data_ptr()],
    )
    memory[: len(desc)].copy_(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
    torch.cuda.synchronize()
    return OneRankPool(memory, err, desc, layout)


@pytest.fixture(scope="module")
def builds(one_rank_pool):
    """Build by its test-only defines (() = the normal build, from ubnext's cubin cache), loaded once into
    the primary context, launched once (an empty call: under lazy loading a kernel's first launch loads
    it and may synchronise the context, which would end a chain's hold early), and kept until the
    module's tests are done."""
    made: dict[tuple[str, ...], Build] = {}

    def get(defines: tuple[str, ...] = ()) -> Build:
        if defines not in made:
            arch = _cuda.device_arch(0)
            if defines:
                image, _ = kernels._nvrtc_compile("lamport.cu", arch, "cubin", defines)
            else:
                image, _ = kernels.compile_kernels("lamport.cu", arch)
            with _cuda.primary_context(0):
                code = kernels.object_code(image)
                kernel = code.get_kernel(KERNEL)
            build = made[defines] = Build(code, kernel, _cuda.kernel_handle(kernel))
            one_rank_pool.reset()
            empty = _cuda.KernelParams(
                one_rank_pool.desc, _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], (0, 0, 0.0, 0))
            )
            _cuda.launch(
                build.handle,
                _cuda.launch_config(1, BLOCK, _cuda.current_stream_handle(0), False, 0),
                empty,
                (0,) * 7,
            )
            torch.cuda.synchronize()
            assert one_rank_pool.err[0].item() == 0, f"{defines}: an empty call failed: {one_rank_pool.err.tolist()}"
        return made[defines]

    yield get
    torch.cuda.synchronize()
    made.clear()


def _chain(build: Build, one: OneRankPool, pdl: bool) -> tuple[torch.Tensor, float | None]:
    """CHAIN launches, launch k reducing buffer k into buffer k + 1, from a reset pool; returns the buffers
    and the GPU's microseconds per launch (CUDA events around the chain), or None when the GPU drained
    the queue before the host had queued the whole chain with every hold tried."""
    stream = _cuda.current_stream_handle(0)
    params = _cuda.KernelParams(one.desc, _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], (N, 0, 0.0, 0)))
    config = _cuda.launch_config(N // 4 // BLOCK, BLOCK, stream, pdl, 0)
    hold = HOLD_CYCLES
    for _ in range(HOLD_TRIES):
        one.reset()
        buffers = torch.full((CHAIN + 1, N), float("nan"), device="cuda:0")
        buffers[0] = torch.arange(N, device="cuda:0", dtype=torch.float32)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(hold)  # the GPU busy while the host queues the chain
        start.record()
        for k in range(CHAIN):
            pointers = (buffers[k].data_ptr(), buffers[k + 1].data_ptr(), 0, 0, 0, 0, 0)
            _cuda.launch(build.handle, config, params, pointers)
        end.record()
        held = not start.query()  # the hold outlasted the queueing: the events time the GPU alone
        end.synchronize()
        if held:
            return buffers, start.elapsed_time(end) * 1e3 / CHAIN
        hold *= 2
    return buffers, None


def _wrong(one: OneRankPool, buffers: torch.Tensor) -> str | None:
    if one.err[0].item() != 0:
        return f"error words {one.err.tolist()}"
    if not torch.equal(buffers[CHAIN], buffers[0]):
        return "the chain's result differs from its input"
    return None


def test_a_pdl_chain_is_exact_and_takes_less_gpu_time(one_rank_pool, builds):
    build = builds()
    _chain(build, one_rank_pool, True)  # warm-up: the module's first launches, torch's allocations
    times: dict[bool, list[float]] = {False: [], True: []}
    for pdl in (False, True, False, True):
        buffers, us = _chain(build, one_rank_pool, pdl)
        assert _wrong(one_rank_pool, buffers) is None, f"pdl={pdl}: {_wrong(one_rank_pool, buffers)}"
        assert us is not None, f"pdl={pdl}: the GPU ran out of queued work before the chain was queued"
        times[pdl].append(us)
    plain, overlapped = min(times[False]), min(times[True])
    print(
        f"one-rank Lamport chain, {N * 4} bytes per call, GPU time by CUDA events: {plain:.2f} us per launch "
        f"in stream order, {overlapped:.2f} us with PDL"
    )
    assert overlapped < plain, f"PDL did not shorten the chain: {overlapped:.2f} us against {plain:.2f} us"


def test_an_early_trigger_with_the_wait_stays_exact(one_rank_pool, builds):
    """The control of the next test: dependents start at once, and griddepcontrol.wait alone keeps
    the chain exact."""
    build = builds(EARLY_TRIGGER)
    for _ in range(2):
        buffers, _ = _chain(build, one_rank_pool, True)
        assert _wrong(one_rank_pool, buffers) is None, _wrong(one_rank_pool, buffers)


def test_an_early_dependent_without_the_wait_goes_wrong(one_rank_pool, builds):
    build = builds(EARLY_TRIGGER_NO_WAIT)
    seen = []
    for _ in range(5):
        buffers, _ = _chain(build, one_rank_pool, True)
        problem = _wrong(one_rank_pool, buffers)
        if problem:
            seen.append(problem)
            break
    assert seen, (
        "kernels that trigger their dependents at entry and skip griddepcontrol.wait gave exact "
        "chains under PDL: the GPU test cannot see a missing wait"
    )

"""From a call signature to a kernel launch: geometry, argument packing, alignment staging, stream
ordering, and the error word that every launch may leave behind.

``Executor`` is one of the Communicator's parts (ubnext/comm/__init__.py). It owns what happens at every
call once the path is known: the checks that a call may run now (closed, aborted, a kernel's
error word, the devices), the launch on the emulator or the GPU, and the ordering of this
communicator's kernels across streams. It reads the state Communicator.__init__ sets
(``mode``, ``device``, ``_pool``, ``_emu``, ``_closed``, ``_broken``, ``_debug``) and keeps the
current call's ``_stream`` and ``_capturing``.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .. import envs, kernels
from ..errors import CLOSED, UbnextError, kernel_error
from ..pool.layout import DESC_STRUCT_BYTES
from ..reference._checks import DTYPE_CODES, FP8
from ..runtime import _cuda, _watchdog

log = logging.getLogger("ubnext")

_SIGNATURE_KINDS = tuple(kind for _, kind in kernels.KERNEL_SIGNATURE)
# The most blocks a kernel path launches on a GPU.
GRID_CAP = 128
# Threads per block on a GPU: the kernels' register use (up to 168 on sm_100) allows 256, not 512.
GPU_BLOCK = 256


# Kernels whose blocks never wait on another block: the rest get at most half the SMs (gpu_max_blocks).
LOCAL_KERNELS = frozenset({"add_rmsnorm", "quantize_fp8", "quantize"})
# The descriptor of a local kernel that sizes its own grid (the quantisers, ubnext/comm/_quantize.py): they
# read none of it (csrc/kernels/quantize.cu, blockscale.cu), so they launch without the pool, whose
# creation is collective: a local op never waits for a peer, even as one rank's first call.
LOCAL_DESC = bytes(DESC_STRUCT_BYTES)


def gpu_max_blocks(
    algo: str, sm_count: int, world_size: int, fused: bool, nvls_ctas: int = 16, rank_order: bool = False
) -> int:
    """The most blocks a GPU launch of ``algo`` takes, from ``sm_count`` = min(GRID_CAP, SMs), agreed
    by the ranks (csrc/host/launch_rules.h has the same rules and their arguments):
    - a kernel that waits on its peers' blocks gets at most half of them, so that two such kernels of
      two communicators are always resident together, whatever order each rank started them in
      (pair_grid_cap: no deadlock between communicators);
    - the flat NVLS two-shot gets NCCL's multicast grid, ceil(nvls_ctas / world), nvls_ctas being 16
      below sm_100 and 32 from it (nvls_twoshot_grid_cap): the switch reduces, a few CTAs keep it
      busy. Not with ``rank_order`` (kernels.F_RANK_ORDER, the batch-invariant mode's form): its CTAs
      sum by unicast loads from every peer, bound by one SM's bandwidth as the unicast two-shot's are,
      so it gets the unicast two-shot's grid (the C API never sets the flag)."""
    cap = sm_count
    if algo not in LOCAL_KERNELS:
        cap = max(1, cap // 2)
    if algo == "nvls_twoshot" and not fused and not rank_order:
        cap = min(cap, -(-nvls_ctas // world_size))
    return cap


# csrc/device/norm.cuh's row split: at least this many 16-byte vectors per CTA, at most ROW_SPLIT_MAX CTAs
# per row (a thread-block cluster of the portable size), a CTA's part within its row cache (UBX_ROW_CACHE_VECS)
ROW_SPLIT_MIN_VECS = 128
ROW_SPLIT_MAX = 8
ROW_CACHE_VECS = 2048
# threads of a split row's CTAs on a GPU: at 1 x 8192 bf16 one vector per thread (FlashInfer's 8 x 128)
ROW_SPLIT_BLOCK = 128


def row_split(tokens: int, row_vectors: int, max_blocks: int) -> int:
    """CTAs per token row of the Lamport fused kernel, launched as one cluster per row: the SMs the rows
    leave free, as long as each CTA keeps >= ROW_SPLIT_MIN_VECS vectors, at most ROW_SPLIT_MAX (1 token x
    hidden 8192 bf16: 8 CTAs of 128 vectors, the split FlashInfer's one-shot uses). The kernel applies the
    same limits (row_split_of) and takes split = its cluster's size."""
    if tokens <= 0:
        return 1
    groups = -(-row_vectors // 32)
    split = min(max_blocks // tokens, row_vectors // ROW_SPLIT_MIN_VECS, ROW_SPLIT_MAX)
    if split < 2 or -(-groups // split) * 32 > ROW_CACHE_VECS:
        return 1
    return split


def launch_geometry(
    algo: str,
    n: int,
    elem: int,
    tokens: int,
    fused: bool,
    world_size: int,
    block: int,
    max_blocks: int,
    *,
    split_rows: bool = True,
) -> tuple[int, int]:
    """(grid, block) of one kernel call: a block per token row for the fused norm (on the Lamport
    path, at few tokens, a cluster of ``row_split`` blocks of at most ROW_SPLIT_BLOCK threads per row unless
    ``split_rows`` is False: per-token FP8; ``row_cluster`` gives the cluster), else enough blocks for one
    vector per thread (of this rank's 1/N share on the two-shot paths), at most ``max_blocks`` (one per SM
    keeps the grid co-resident: blocks wait on peers' blocks)."""
    if fused:
        split = 1
        if algo == "lamport" and split_rows and tokens > 0:
            split = row_split(tokens, n // tokens * elem // 16, max_blocks)
        return max(1, min(tokens * split, max_blocks)), min(block, ROW_SPLIT_BLOCK) if split > 1 else block
    vectors = -(-n * elem // 16)
    if algo in ("nvls_twoshot", "twoshot", "nvls_lamport"):
        vectors = -(-vectors // world_size)  # each rank reduces its 1/N share
    return max(1, min(-(-vectors // block), max_blocks)), block


def row_cluster(algo: str, tokens: int, grid: int) -> int:
    """Blocks per thread-block cluster of a launch: the row split's (launch_geometry's grid tokens x split,
    one cluster per row), else 1 (no cluster)."""
    return grid // tokens if algo == "lamport" and 0 < tokens < grid else 1


def clusters_fit_pair(clusters: int, max_active_clusters: int) -> bool:
    """Whether a cluster launch of ``clusters`` clusters keeps the no-deadlock rule between communicators:
    twice its clusters within what the empty device holds at once (``max_active_clusters``,
    cuOccupancyMaxActiveClusters). csrc/host/launch_rules.h pair_clusters_fit states the same rule and the
    argument for it. When it fails the launch drops its cluster: each row is then one CTA's (norm.cuh)."""
    return max_active_clusters > 0 and 2 * clusters <= max_active_clusters


@functools.cache
def _kernel_name(algo: str, dtype: torch.dtype) -> str:
    return kernels.kernel_name(algo, "u8" if dtype == torch.uint8 else DTYPE_CODES[dtype])


def reads_own_input_only(algo: str, flags: int) -> bool:
    """Whether a launch reads only this rank's ``in``, each vector before the thread that reads it
    writes ``out``: ``in`` may then lie anywhere, unaligned ones staged locally, and be ``out`` (the
    Lamport one-shot; nvls_lamport's plain push form, the batch-invariant mode's, csrc/kernels/nvls.cu)."""
    return algo == "lamport" or (
        algo == "nvls_lamport"
        and bool(flags & kernels.F_RANK_ORDER)
        and not flags
        & (kernels.F_FUSED_NORM | kernels.F_FP8_STATIC | kernels.F_FP8_PER_TOKEN | kernels.F_BLOCK_FMT_MASK)
    )


class Launch(NamedTuple):
    """One call signature's kernel launch, made once (Executor._launch_for): which kernel, its
    grid, its descriptor and scalar arguments, raw for the emulator and laid out for the driver, so
    that a call only adds its seven pointers."""

    algo: str
    name: str
    grid: int
    block: int
    out_align: int  # the kernel writes `out` in vectors: 8 bytes for FP8, else 16
    scalars: tuple  # (n, hidden, eps, flags)
    desc: bytes  # the pool's descriptor, passed by value (csrc/device/entry.cuh)
    pdl: bool  # launched with the programmatic-stream-serialization attribute (_cuda.pdl_enabled)
    params: Any = None  # gpu mode: _cuda.KernelParams of desc and scalars
    kernel: Any = None  # gpu mode: the loaded kernel's driver handle (_cuda.kernel_handle), looked up once
    cluster: int = 1  # blocks per thread-block cluster (row_cluster)


class TorchCall(NamedTuple):
    """A call that torch.distributed makes for ubnext (the fallback), as the flight record names it
    (ubnext/runtime/_watchdog.py reads the fields a Launch has)."""

    algo: str
    name: str
    scalars: tuple  # (elements, 0)


def flight_recorded(op: str):
    """The flight record of a torch.distributed fallback (``op``: its name): the watchdog names it while
    it waits, and a Ctrl-C on the main thread reaches the watchdog during it (``_watchdog.interruptible``)."""

    def wrap(method):
        @functools.wraps(method)
        def recorded(self, x, *args):
            seq = self._flight_seq = self._flight_seq + 1
            self._flight_how = TorchCall("torch", f"torch.distributed.{op}", (x.numel(), 0))
            try:
                with _watchdog.interruptible():
                    return method(self, x, *args)
            finally:
                self._flight_done = seq

        return recorded

    return wrap


class Call(NamedTuple):
    """What one call signature does, decided once (Planner._call_for)."""

    path: str
    launch: Launch | None  # the kernel paths' launch; None for torch_symm and torch
    # a fused call whose allreduce runs outside ubnext's kernels (past the pool): the add + RMSNorm
    # (+FP8) kernel run on its result (csrc/kernels/add_rmsnorm.cu), or None (torch's ops)
    norm: Launch | None = None


# the fallbacks this process has logged, as (key, message): _log_once's memory, shared by its communicators
_logged_fallbacks: set[tuple[str, str]] = set()


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _misaligned(t: torch.Tensor | None, align: int = 16) -> bool:
    """Whether a kernel's vector access to ``t`` would be misaligned."""
    return t is not None and t.data_ptr() % align != 0


# the contract (ubnext/comm/_contracts.py): needs State, Prepared; provides Executing
if TYPE_CHECKING:
    from ._contracts import Executing, Prepared, State

    class Part(State, Prepared, Executing): ...
else:
    Part = object


class Executor(Part):
    """The Communicator's launches and the checks every call makes before one."""

    # NCCL's NVLS grid base (gpu_max_blocks): 16 below sm_100; a GPU communicator from sm_100 sets 32,
    # and the ranks agree on the least at pool creation
    _nvls_ctas = 16
    # the flight record (ubnext/runtime/_watchdog.py): launches made, the last one, the last one that returned
    _flight_seq = 0
    _flight_done = 0
    _flight_how: Launch | TorchCall | None = None
    _launch_done: int | None = None  # the event recorded after the last eager launch (_cuda.create_event)
    _flight_group = ""  # the process group's name (Communicator.__init__)

    def _log_once(self, key: str, message: str) -> None:
        """Log a fallback once per process, naming this rank: every communicator of a process (and
        every plan of one) meets the same fallbacks, and one line per communicator per rank buried
        the rank that said something different."""
        if (key, message) not in _logged_fallbacks:
            _logged_fallbacks.add((key, message))
            # without a GPU and without emulation the torch path is expected, not a degradation
            log.log(logging.INFO if self.mode == "torch" else logging.WARNING, "rank %s: %s", self.rank, message)

    def _check_usable(self) -> None:
        """At the start of every op: refuse a closed or aborted communicator, and order this call's
        stream after the last one, before the op writes anything (staging, pool tensors)."""
        if self._closed:
            raise UbnextError(CLOSED)
        if self.mode == "gpu":
            # this call's stream (its raw handle) and whether it is captured: the launch uses both
            capturing = self._capturing = _cuda.capturing(self.device)
            stream = self._stream = _cuda.current_stream_handle(self._device_index)
            if stream != self._last_stream and not capturing:
                self._order_after_other_stream(stream)
        if self._broken:
            raise UbnextError(f"communicator is unusable after an earlier failure: {self._broken}")
        pool = self._pool
        if pool is not None:
            code = pool.err_view[0]
            if code:
                self._raise_kernel_error(pool)

    def _raise_kernel_error(self, pool) -> None:
        if self.device.type == "cuda" and not _cuda.capturing(self.device):
            # the details are complete once the writing kernel has ended (csrc/device/barrier.cuh);
            # inside a capture a synchronisation would break it: the code, written first, suffices
            torch.cuda.synchronize(self.device)
        error = kernel_error(pool.err_word.tolist(), pool.timeout_s, self.rank)
        self._broken = str(error)
        raise error

    def _check_device(self, names: str, *tensors: torch.Tensor) -> None:
        """Every tensor is on this communicator's device; ``names`` names them, space-separated.
        (The ops' hot paths compare devices inline first and call this to raise.)"""
        device = self.device
        for name, x in zip(names.split(), tensors):
            if x.device != device:
                raise ValueError(f"{name} is on {x.device}, but this communicator works on {device}")

    def _check_same_across_ranks(self, what: tuple) -> None:
        """UBNEXT_DEBUG: compare a call's signature across the ranks before it runs."""
        seen = self._allgather(what)
        if any(s != seen[0] for s in seen):
            detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
            raise ValueError(f"ubnext: ranks called with different arguments ({detail})")

    def _geometry(
        self, algo: str, n: int, elem: int, tokens: int, fused: bool, rank_order: bool = False, split_rows: bool = True
    ) -> tuple[int, int]:
        if self.mode == "emulator" and not self._count_geometry:
            # emulated threads are fibers on 2 cores: keep it small (tests vary it: the bits must not change)
            block, max_blocks = envs.get("UBNEXT_EMU_BLOCK"), envs.get("UBNEXT_EMU_GRID")
        else:
            block = GPU_BLOCK
            max_blocks = gpu_max_blocks(algo, self._sm_count, self.world_size, fused, self._nvls_ctas, rank_order)
        return launch_geometry(algo, n, elem, tokens, fused, self.world_size, block, max_blocks, split_rows=split_rows)

    def _launch_for(
        self,
        algo: str,
        dtype: torch.dtype,
        n: int,
        hidden: int,
        eps: float,
        flags: int,
        geometry: tuple[int, int] | None = None,
    ) -> Launch:
        """``geometry``: (grid, block) of a local kernel that sizes its own (ubnext/comm/_quantize.py); it gets
        LOCAL_DESC, and needs no pool."""
        if geometry is None:
            grid, block = self._geometry(
                algo,
                n,
                dtype.itemsize,
                n // hidden if hidden else 0,
                bool(hidden),
                bool(flags & kernels.F_RANK_ORDER),
                not flags & kernels.F_FP8_PER_TOKEN,
            )
            pool = self._pool
            assert pool is not None, "a collective kernel's launch is made only once there is a pool"
            desc = pool.desc
            if algo in ("lamport", "allgather") and pool.has_multicast:
                flags |= kernels.F_MULTICAST
        else:
            (grid, block), desc = geometry, LOCAL_DESC
        cluster = row_cluster(algo, n // hidden if hidden and geometry is None else 0, grid)
        scalars = (n, hidden, float(eps), flags)
        packed = _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[-len(scalars) :], scalars)
        fp8_out = flags & (kernels.F_FP8_STATIC | kernels.F_FP8_PER_TOKEN)
        name = _kernel_name(algo, dtype)
        if self.mode == "gpu":
            kernel = _cuda.kernel_handle(kernels.load_kernel(name, self._device_index))
            if cluster > 1 and not clusters_fit_pair(
                grid // cluster, _cuda.max_active_clusters(kernel, block, cluster, self._device_index)
            ):
                cluster = 1
            return Launch(
                algo,
                name,
                grid,
                block,
                8 if fp8_out else 16,
                scalars,
                desc,
                _cuda.pdl_enabled(self._device_index),
                _cuda.KernelParams(desc, packed),
                kernel,
                cluster,
            )
        # the emulator stands for sm_90 and later: it checks what the attribute asks of a kernel
        return Launch(
            algo, name, grid, block, 8 if fp8_out else 16, scalars, desc, envs.get("UBNEXT_PDL"), cluster=cluster
        )

    def _launch(
        self,
        how: Launch,
        inp: torch.Tensor,
        out: torch.Tensor,
        residual=None,
        residual_out=None,
        weight=None,
        scale=None,
        scale_inv=None,
    ) -> None:
        p_in, p_out = inp.data_ptr(), out.data_ptr()
        if residual is None:  # the plain allreduce; the fused norm passes all three
            p_res = p_res_out = p_w = 0
        else:
            p_res, p_res_out, p_w = residual.data_ptr(), residual_out.data_ptr(), weight.data_ptr()
        # Every pointer the kernels touch with vectors must be aligned: 16 bytes, 8 for an FP8
        # out; a misaligned GPU access is a sticky fault that kills the context. A misaligned
        # caller tensor is staged through a fresh (aligned) one, locally: the path, and so what
        # the peers see, stays the same. Inputs that peers read through the pool were staged
        # into it by the caller, aligned.
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if (p_in | p_res | p_res_out | p_w) % 16 or p_out % how.out_align:
            copy_back = []
            if not reads_own_input_only(how.algo, how.scalars[3]) and _misaligned(inp):
                raise AssertionError(f"{how.algo}: pool input at {p_in:#x} is not 16-byte aligned")
            staged = self._aligned_copies(inp, out, residual, residual_out, weight, copy_back)
            p_in, p_out, p_res, p_res_out, p_w = (
                _ptr(t) for t in staged
            )  # `staged` is held: the kernel reads the copies
        self._run(
            how,
            (
                p_in,
                p_out,
                p_res,
                p_res_out,
                p_w,
                0 if scale is None else scale.data_ptr(),
                0 if scale_inv is None else scale_inv.data_ptr(),
            ),
        )
        if copy_back:
            for target, staged_out in copy_back:
                target.copy_(staged_out)  # stream-ordered after the kernel

    def _run(self, how: Launch, pointers: tuple) -> None:
        """Launch one kernel with its seven pointers (kernels.KERNEL_SIGNATURE's order, after the
        descriptor), on the emulator or the GPU; the emulator's launch is synchronous, so its error
        word is read here. Without a pool (a local kernel before it exists) there is no error word:
        a local kernel never writes one."""
        pool = self._pool
        seq = self._flight_seq = self._flight_seq + 1  # the flight record (ubnext/runtime/_watchdog.py): a counter
        self._flight_how = how
        if self.mode == "emulator":
            try:
                with _watchdog.interruptible():
                    self._emu.launch(  # type: ignore[union-attr]  # emulator mode loads it with the pool
                        how.name,
                        how.grid,
                        how.block,
                        list(zip(_SIGNATURE_KINDS, (how.desc, *pointers, *how.scalars))),
                        timeout_s=pool.timeout_s if pool is not None else None,
                        pdl=how.pdl,
                        cluster=how.cluster,
                    )
            except KeyboardInterrupt:
                self._broken = f"interrupted (Ctrl-C) in {_watchdog.describe(self)}"
                raise
            finally:
                self._flight_done = seq
            if pool is not None and pool.err_view[0]:
                self._raise_kernel_error(pool)
            return
        if self._capturing:  # since this op's _check_usable, as self._stream
            if pool is not None:
                pool.captured = True  # its memory must outlive close() (SymmetricPool.close)
            done = None  # a graph's kernels are ordered by whoever replays it
            self._flight_done = seq  # nothing runs now
        else:
            done = self._launch_done
            if done is None:
                done = self._new_done_event()
        _cuda.launch(
            how.kernel,
            _cuda.launch_config(how.grid, how.block, self._stream, how.pdl, self._device_index, how.cluster),
            how.params,
            pointers,
            done,
        )
        if self._debug and not self._capturing:  # a synchronisation would break the capture
            torch.cuda.synchronize(self.device)
            if pool is not None and pool.err_view[0]:
                self._raise_kernel_error(pool)

    def _flight_running(self) -> bool:
        """Whether the last launch may still run (the watchdog's question, from its thread): on the
        emulator, its launch has not returned; on a GPU, the event recorded after it has not completed."""
        how = self._flight_how
        assert how is not None, "asked only while a launch is recorded in flight"
        if self.mode == "emulator" or how.algo == "torch":  # synchronous until they return
            return True
        done = self._launch_done
        return done is not None and not _cuda.event_done(done, self._device_index)

    def _pool_reads_done(self) -> None:
        """After an op's last access to pool memory that follows its kernel (a copy out of the staging
        region), or the whole of an op that touched pool-owned buffers without a ubnext kernel
        (torch_symm): the ordering event moves there, so that a call from another stream waits for
        that access too, not only for the kernel."""
        if self.mode != "gpu" or self._capturing:
            return
        done = self._launch_done
        if done is None:
            done = self._new_done_event()
        _cuda.record_event(done, self._stream, self._device_index)

    def _new_done_event(self):
        """The ordering event, made on first use (one per communicator)."""
        self._launch_done = _cuda.create_event(self._device_index)
        return self._launch_done

    @staticmethod
    def _aligned_copies(inp, out, residual, residual_out, weight, copy_back):
        """Aligned stand-ins for the misaligned ones: inputs cloned, outputs written to a fresh
        tensor and copied back after the kernel (stream-ordered)."""

        def aligned_output(t, align=16):
            if t is None or not _misaligned(t, align):
                return t
            staged = torch.empty_like(t)
            copy_back.append((t, staged))
            return staged

        inp, residual, weight = (t.clone() if _misaligned(t) else t for t in (inp, residual, weight))
        return (inp, aligned_output(out, 8 if out.dtype == FP8 else 16), residual, aligned_output(residual_out), weight)

    def _order_after_other_stream(self, stream: int) -> None:
        """A communicator's kernels share one sync region, so two of them must never run at the same
        time: from two streams they could, and their barriers would pair up wrongly or deadlock
        (DESIGN.md section 8). When an eager call comes from another stream than the last eager one
        (a side stream for overlap, FSDP2's streams, a graph's warm-up stream), that stream first
        waits for everything enqueued on the last one, so kernels stay in one order whatever stream
        issues them. _check_usable calls this only when the stream (``stream``, the current one's
        raw handle) changed, and never for captured calls: a graph's kernels run when and where its
        owner replays it, ordered by them. The new stream waits for the event recorded right after
        the last eager launch, not for the old stream as it is now: work the caller queued there
        since (compute meant to overlap the collective) does not hold up this stream."""
        if self._launch_done is not None:
            _cuda.wait_event(stream, self._launch_done, self._device_index)
        self._last_stream = stream

    def synchronize(self) -> None:
        """Wait for this rank's queued ops and raise any error a kernel reported."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._check_usable()

    def _in_pool_aligned(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a pool tensor, 16-byte aligned: peers can read it, and the two-shot
        kernels reduce it, where it lies."""
        pool = self._pool
        return pool is not None and pool.contains(x) and not _misaligned(x)

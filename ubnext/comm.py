"""The Communicator: path choice, the fallback chain and kernel launches.

Paths, best first (``comm.last_path`` uses these names, as does ``UBNEXT_ALGO``):

1. ``lamport``: ubnext Lamport one-shot, when the message fits a Lamport slot of the pool;
2. ``nvls_twoshot`` / ``nvls_lamport`` / ``nvls_oneshot`` (multicast pools) or ``twoshot``
   (unicast): in place in the pool's data arena, when the message fits it;
3. ``torch_symm``: torch's symmetric-memory one-shot op, on GPUs where it exists;
4. ``torch``: ``torch.distributed.all_reduce`` (NCCL on GPUs, gloo on CPU; multi-node).

The fused op falls back to the chosen allreduce, then add + RMSNorm in torch. Each fallback
step is logged once per communicator with its reason.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import _lifecycle, envs, kernels, plan
from . import _cuda
from ._cuda import gpu_available, no_gpu_reason
from .plan import KERNEL_PATHS, PATHS
from .pool import NoRoom, SymmetricPool, plan_layout

__all__ = [
    "Communicator",
    "UbnextError",
    "UbnextTimeoutError",
    "PATHS",
    "reference_add_rmsnorm",
    "rmsnorm",
]

log = logging.getLogger("ubnext")

_SIGNATURE_KINDS = tuple(kind for _, kind in kernels.KERNEL_SIGNATURE)
DTYPE_CODES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest per-token scale_inv: an all-zero row gets this scale, so q = 0 and no 0/0.
FP8_TINY_SCALE_INV = 1e-12
DEFAULT_HIDDEN = 8192
_OP_NAMES = {1: "lamport", 2: "nvls_oneshot", 3: "nvls_twoshot", 4: "nvls_lamport", 5: "twoshot", 6: "allgather",
             7: "reduce_scatter"}
# csrc/device/desc.cuh: error codes and the call header's words
ERR_TIMEOUT, ERR_MISMATCH = 1, 2
_HEADER_FIELDS = {0: "op/dtype/flags", 1: "element count", 2: "hidden size", 3: "in offset"}
_HEADER_DTYPES = {1: "bf16", 2: "fp16", 3: "fp32", 4: "bytes"}


def _header_value(field: int, value: int) -> str:
    """One call-header word as the user would write it."""
    if field == 0:
        dtype = _HEADER_DTYPES.get((value >> 8) & 0xFF, f"dtype {(value >> 8) & 0xFF}")
        return f"({_OP_NAMES.get(value & 0xFF, value & 0xFF)}, {dtype}, flags {value >> 16:#x})"
    if field == 3:
        return f"+{value * 16:#x}"
    return str(value)


def _element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


@functools.lru_cache(maxsize=None)
def _kernel_name(algo: str, dtype: torch.dtype) -> str:
    return kernels.kernel_name(algo, "u8" if dtype == torch.uint8 else DTYPE_CODES[dtype])


class _Launch(NamedTuple):
    """One call signature's kernel launch, made once (Communicator._launch_for): which kernel,
    its grid, and its scalar arguments, raw for the emulator and packed for cuda.core, so that
    a call only adds its eight pointers."""

    algo: str
    name: str
    grid: int
    block: int
    out_align: int  # the kernel writes `out` in vectors: 8 bytes for FP8, else 16
    scalars: tuple  # (n, hidden, eps, flags)
    packed: tuple  # the same, packed by _cuda.pack_kernel_args
    kernel: Any = None  # gpu mode: the loaded kernel (kernels.load_kernel), looked up once
    config: Any = None  # gpu mode: cuda.core's LaunchConfig of grid and block (_cuda.launch_config)


class _Call(NamedTuple):
    """What one call signature does, decided once (Communicator._call_for)."""

    path: str
    launch: _Launch | None  # the kernel paths' launch; None for torch_symm and torch


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _misaligned(t: torch.Tensor | None, align: int = 16) -> bool:
    """Whether a kernel's vector access to ``t`` would be misaligned."""
    return t is not None and t.data_ptr() % align != 0


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of equal shape are the same memory (the dispatcher may hand an
    operator a different Python object for the tensor the caller passed)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.device == b.device and a.stride() == b.stride())


def check_tensor(name: str, x: torch.Tensor) -> None:
    """What every ubnext operator asks of a tensor argument, whatever its device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(f"{name}: ubnext supports bfloat16, float16 and float32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def check_all_reduce_args(x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """Argument checks of the allreduce operators, shared by the real and the fake (tracing)
    implementations, so a compiled call fails at trace time as an eager call fails."""
    check_tensor("x", x)
    if out is not None:
        check_tensor("out", out)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"out must match x ({tuple(x.shape)}, {x.dtype}), got "
                             f"({tuple(out.shape)}, {out.dtype})")


def check_linear_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Argument checks of the GEMM + allreduce operator (real and fake implementations): a wrong
    weight must fail here, not resize the staging view the GEMM writes into."""
    check_tensor("x", x)
    check_tensor("weight", weight)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [out_features, {x.shape[-1] if x.dim() else '?'}] of x's dtype {x.dtype}, "
                         f"got {tuple(weight.shape)} {weight.dtype}")


def check_fused_args(x, residual, weight, eps, fp8: bool, scale) -> None:
    """Argument checks of the fused operator (real and fake implementations)."""
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        check_tensor(name, t)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dimension, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), got "
                         f"({tuple(residual.shape)}, {residual.dtype})")
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},) to match x's hidden size, got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight dtype {weight.dtype} must match x dtype {x.dtype}")
    if not (isinstance(eps, (int, float)) and eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if scale is not None:
        if not fp8:
            raise ValueError("scale is only meaningful with out_dtype=torch.float8_e4m3fn")
        if not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError("scale must be a one-element float32 tensor (the dequantisation scale)")
        if scale.device != x.device:
            raise ValueError(f"scale is on {scale.device}, x on {x.device}")


def check_all_gather_args(x: torch.Tensor, out: torch.Tensor | None, world_size: int) -> None:
    """Argument checks of the all-gather operators (real and fake implementations). Any dtype: the
    all-gather moves bytes."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_contiguous() or x.dim() == 0:
        raise ValueError(f"x must be contiguous with at least one dimension, got shape {tuple(x.shape)}")
    if out is not None:
        want = (world_size * x.shape[0], *x.shape[1:])
        if not isinstance(out, torch.Tensor) or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor")
        if out.dtype != x.dtype or out.numel() != world_size * x.numel():
            raise ValueError(f"out must hold world_size x x's elements ({want}, {x.dtype}), got "
                             f"({tuple(out.shape)}, {out.dtype})")


def check_reduce_scatter_args(x: torch.Tensor, out: torch.Tensor | None, world_size: int) -> None:
    """Argument checks of the reduce-scatter operators (real and fake implementations)."""
    check_tensor("x", x)
    if x.dim() == 0 or x.shape[0] % world_size:
        raise ValueError(f"x's first dimension must be a multiple of the world size {world_size}, got "
                         f"shape {tuple(x.shape)}")
    if out is not None:
        check_tensor("out", out)
        if out.dtype != x.dtype or out.numel() * world_size != x.numel():
            raise ValueError(f"out must hold 1/{world_size} of x's elements in {x.dtype}, got "
                             f"({tuple(out.shape)}, {out.dtype})")


def reduce_factor(op, world_size: int) -> float:
    """The factor a reduce-scatter applies to its sum: ``op`` is "sum", "avg", a number, or a
    torch.distributed ReduceOp (SUM, AVG, or PREMUL_SUM(factor), as FSDP2 passes)."""
    if isinstance(op, (int, float)) and not isinstance(op, bool):
        return float(op)
    if isinstance(op, str) and op in ("sum", "avg"):
        return 1.0 if op == "sum" else 1.0 / world_size
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        # a RedOpType is itself the kind; a ReduceOp object (PREMUL_SUM(f)) carries kind and factor
        kind, factor = (op, None) if isinstance(op, dist.ReduceOp.RedOpType) else (
            op.op, getattr(op, "factor", None))
        if kind == dist.ReduceOp.SUM:
            return 1.0
        if kind == dist.ReduceOp.AVG:
            return 1.0 / world_size
        if kind == dist.ReduceOp.PREMUL_SUM and isinstance(factor, (int, float)):
            return float(factor)
    raise ValueError(f"reduce-scatter op must be 'sum', 'avg', a number, or ReduceOp SUM / AVG / PREMUL_SUM(x), "
                     f"got {op!r}")


def check_quantize_args(x: torch.Tensor, hidden: int, scale) -> None:
    """Argument checks of the FP8 quantisation operator (real and fake implementations)."""
    check_tensor("x", x)
    if hidden <= 0 or x.numel() == 0 or x.numel() % hidden:
        raise ValueError(f"hidden ({hidden}) must divide x's {x.numel()} elements")
    if scale is not None and (not isinstance(scale, torch.Tensor) or scale.numel() != 1
                              or scale.dtype != torch.float32 or scale.device != x.device):
        raise ValueError("scale must be a one-element float32 tensor on x's device (the dequantisation scale)")


def quantize_fp8_reference(y: torch.Tensor, hidden: int, scale: torch.Tensor | None):
    """(q, scale_inv) of ``y`` (any float dtype, quantised as its fp32 values) with the kernels'
    contract (csrc/device/norm.cuh): static, q = sat(y / scale) and scale_inv = scale; else one
    scale per row of ``hidden`` elements, scale_inv = max(amax / 448, 1e-12), q = sat(y / scale_inv).
    q has y's shape; scale_inv has one element (static) or one per row."""
    rows = y.float().reshape(-1, hidden)
    if scale is not None:
        scale_inv = scale.float().reshape(1).clone()
        q = (rows / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    else:
        scale_inv = torch.clamp(rows.abs().amax(dim=-1) / FP8_MAX, min=FP8_TINY_SCALE_INV)
        q = (rows / scale_inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(y.shape), scale_inv


def fp8_output(x: torch.Tensor, out_dtype: torch.dtype | None, scale) -> bool:
    """Whether the fused op writes FP8 (``out_dtype`` is x's dtype, None or e4m3)."""
    if out_dtype is not None and out_dtype not in (x.dtype, FP8):
        raise TypeError(f"out_dtype must be x.dtype ({x.dtype}) or torch.float8_e4m3fn, got {out_dtype}")
    if scale is not None and out_dtype != FP8:
        raise ValueError("scale is only meaningful with out_dtype=torch.float8_e4m3fn")
    return out_dtype == FP8


class UbnextError(RuntimeError):
    """A ubnext collective failed."""


class UbnextTimeoutError(UbnextError):
    """A wait across ranks passed UBNEXT_TIMEOUT; the message names op, rank and peer."""


def rmsnorm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(r * rsqrt(mean(r^2) + eps)) * weight`` over the last dimension, in r's precision, in
    the kernels' order of operations (the torch fallback)."""
    return r * torch.rsqrt(r.square().mean(dim=-1, keepdim=True) + eps) * weight


def reference_add_rmsnorm(reduced: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float, out_dtype: torch.dtype, scale: torch.Tensor | None):
    """add + RMSNorm (+FP8) in torch with the kernels' contract (csrc/device/norm.cuh):
    residual_out rounded to the input dtype, statistics in fp32 from that rounded value,
    y = (r * rms) * weight rounded to the input dtype, FP8 from that same rounded y."""
    residual_out = (reduced.float() + residual.float()).to(residual.dtype)
    y = rmsnorm(residual_out.float(), weight.float(), eps).to(residual.dtype)
    if out_dtype != FP8:
        return y, residual_out, None
    # FP8 quantises y rounded to the input dtype; amax comes from those same rounded values
    q, scale_inv = quantize_fp8_reference(y, y.shape[-1], scale)
    return q, residual_out, (scale_inv if scale is not None else scale_inv.reshape(y.shape[:-1]))


def _host_identity() -> str:
    """Which machine this process runs on: hostname/boot id. The boot id (one per running
    kernel) tells apart nodes that share a hostname; the hostname names them in the message."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class Communicator:
    """Collectives over a torch.distributed group, on ubnext kernels where they can run.

    Collective: every rank of ``group`` constructs it, and calls every op, in the same order.
    ``emulate=True`` (or ``UBNEXT_EMULATE=1``) runs the ubnext kernels on the CPU emulator with
    CPU tensors; without a GPU and without emulation every op uses torch.distributed (gloo).
    ``max_hidden`` sizes the pool (see ``register_hidden``); ``algo`` overrides ``UBNEXT_ALGO``.
    """

    def __init__(self, group=None, *, emulate: bool | None = None, max_hidden: int | None = None,
                 algo: str | None = None):
        if not dist.is_initialized():
            _lifecycle.bootstrap()
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        emulate = envs.get("UBNEXT_EMULATE") if emulate is None else bool(emulate)
        self._sm_count = 0  # GPUs only: the grid bound, agreed at pool creation
        self._device_index = 0  # GPUs only: the launch's device
        if emulate:
            self.mode, self.device = "emulator", torch.device("cpu")
        elif gpu_available():
            self.mode, self.device = "gpu", torch.device("cuda", torch.cuda.current_device())
            self._device_index = self.device.index
            self._sm_count = min(128, torch.cuda.get_device_properties(self.device).multi_processor_count)
        else:
            self.mode, self.device = "torch", torch.device("cpu")
        self._max_hidden = max_hidden or 0
        if algo is not None and algo not in envs.ALGORITHMS:
            raise ValueError(f"algo must be one of {envs.ALGORITHMS}, got {algo!r}")
        self._algo = algo  # overrides UBNEXT_ALGO for this communicator
        self._pool: SymmetricPool | None = None
        self._pool_error: str | None = None
        self._emu = None
        self._symm_buffers: dict[tuple, torch.Tensor] = {}
        self._logged: set[tuple[str, str]] = set()
        self._broken: str | None = None
        self._closed = False
        # the stream of the last eager call (_order_after_other_stream): raw handle and torch object
        self._last_stream: int | None = None
        self._last_torch_stream = None
        self._stream = 0  # the current call's stream (gpu mode, raw handle), set by _check_usable
        self._capturing = False  # whether the current call is captured (gpu mode), set by _check_usable
        self._disabled: dict[str, str] = {}  # kernel paths the self-test turned off, on every rank
        self._run_self_test = False  # agreed at pool creation
        # read once per communicator (README: environment variables): the hot path reads no
        # environment, and a plan, once made, stays right
        self._env_algo = envs.get("UBNEXT_ALGO")
        self._allow_nondeterministic = envs.get("UBNEXT_ALLOW_NONDETERMINISTIC")
        self._debug = envs.get("UBNEXT_DEBUG")
        self._plans: dict[tuple, plan.Plan] = {}
        self._calls: dict[tuple, _Call] = {}  # per call signature: its plan and launch (_call_for)
        self.last_path: str | None = None
        if self.mode == "torch":
            self._pool_error = f"no GPU ({no_gpu_reason()}) and emulation is off"
        # the name under which torch.ops.ubnext.* find this communicator
        self.key = _lifecycle.register(self)

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the pool (collective: every rank calls it)."""
        self._release()

    def _release(self) -> None:
        """Release the pool and drop the process group: a held group keeps gloo's worker
        threads alive into interpreter finalisation (ubnext/_lifecycle.py says why that aborts)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pool is not None:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self._pool.close()
        finally:
            self._pool = None
            self._calls.clear()
            self._symm_buffers.clear()
            self.group = None

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, mode={self.mode})"

    # -- pool ---------------------------------------------------------------------------------

    def register_hidden(self, hidden: int) -> None:
        """Size the pool for rows of ``hidden`` elements (call before the first op)."""
        if hidden <= 0:
            raise ValueError(f"hidden must be positive, got {hidden}")
        self._max_hidden = max(self._max_hidden, hidden)

    def _allgather(self, obj):
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    @property
    def pool(self) -> SymmetricPool | None:
        """The symmetric pool, created on first use (collective)."""
        if self._closed:
            raise UbnextError("communicator is closed")
        if self._pool is None and self._pool_error is None:
            if _cuda.capturing(self.device):
                raise UbnextError(
                    "ubnext: this communicator's first use is inside CUDA graph capture, but creating its "
                    "pool and loading its kernels synchronise the device and talk to the other ranks, which "
                    "a capture cannot contain: call comm.prepare() on every rank before capturing")
            self._pool = self._create_pool()
            if self._pool is not None:
                self._self_test()
        return self._pool

    def prepare(self) -> "Communicator":
        """Create the pool and load every kernel now (collective: every rank calls it). The first
        op does this otherwise; call it before CUDA graph capture, and to keep first-call latency
        (NVRTC compiles, the ranks' rendezvous) out of timed or captured regions."""
        _ = self.pool
        return self

    def _self_test(self) -> None:
        """Run every kernel path once on known data (UBNEXT_SELFTEST=0 skips it), so that a first
        run on new hardware cannot silently give wrong numbers. The inputs are small integers, so
        every correct path returns the exact sum bit for bit, in any summation order. A path that
        differs on any rank is disabled on every rank (agreed), with a warning naming it and the
        mismatch. A kernel that fails outright (timeout, mismatch) raises, as any call would."""
        if not self._run_self_test:  # agreed at pool creation: it is collective
            return
        numel = 2048 * self.world_size + 3  # whole vectors, and a tail that ends inside one
        i = torch.arange(numel, dtype=torch.int64)
        mine = (((i * 7 + self.rank * 3) % 13) - 6).to(torch.bfloat16).to(self.device)
        want = sum((((i * 7 + r * 3) % 13) - 6) for r in range(self.world_size)).to(torch.bfloat16)
        algo, failures = self._algo, {}
        try:
            runnable = self._capabilities(numel * 2, torch.bfloat16, fused=False)
            for path in plan.KERNEL_PATHS:
                if runnable[path] is not None:
                    continue  # this pool cannot run it (no multicast, say): nothing to test
                self._algo = path
                out = self._all_reduce(mine, torch.empty_like(mine))
                got = out.cpu()
                if not torch.equal(got, want):
                    bad = (got != want).nonzero().flatten()
                    k = int(bad[0])
                    failures[path] = (f"rank {self.rank}: {bad.numel()} of {numel} sums wrong, first at {k}: "
                                      f"got {got[k].item():g}, want {want[k].item():g}")
        finally:
            self._algo, self.last_path = algo, None
            self._plans.clear()  # the plans made here did not know the verdict yet
            self._calls.clear()
        for report in self._allgather(failures):
            for path, why in report.items():
                if path not in self._disabled:
                    self._disabled[path] = why
                    log.warning("ubnext self-test: %s gave wrong sums (%s); %s is disabled on every rank",
                                path, why, path)

    def _create_pool(self) -> SymmetricPool | None:
        # Agreed before anything is allocated: a rank that cannot build or load the kernels sends
        # every rank to the torch path; a group that spans hosts too (the pool's memory is shared
        # within one node only); the grid bound (blocks wait on the same blocks of their peers)
        # and the kernels' timeout.
        reports = self._allgather({
            "error": self._prepare_kernels(), "sm_count": self._sm_count, "host": _host_identity(),
            "timeout_s": _lifecycle.kernel_timeout_s(self.group, self.device),
            "selftest": envs.get("UBNEXT_SELFTEST")})
        self._run_self_test = all(r["selftest"] for r in reports)
        if self.mode == "gpu":
            self._sm_count = min(r["sm_count"] for r in reports)
        # the longest: no rank gives up on a peer that another rank is still willing to wait for
        timeout_s = max(r["timeout_s"] for r in reports)
        errors = [f"rank {i}: {r['error']}" for i, r in enumerate(reports) if r["error"]]
        if errors:
            self._pool_error = f"ubnext kernels unavailable ({'; '.join(errors)})"
            log.warning("%s; using torch.distributed", self._pool_error)
            return None
        hosts = {r["host"] for r in reports}
        if len(hosts) > 1:
            names = ", ".join(sorted({h.split("/")[0] for h in hosts}))
            self._pool_error = (f"the group spans {len(hosts)} hosts ({names}); ubnext's symmetric "
                                "pool works within one node")
            log.warning("%s; using torch.distributed", self._pool_error)
            return None
        layout = plan_layout(self.world_size, self._max_hidden or DEFAULT_HIDDEN)
        pool, error = None, None
        try:
            pool = SymmetricPool(layout=layout, rank=self.rank, group=self.group, device=self.device,
                                 allgather=self._allgather, timeout_s=timeout_s)
        except (RuntimeError, OSError, ImportError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        # every rank must agree, or one rank launches kernels its peers never join
        errors = [e for e in self._allgather(error) if e]
        if errors:
            if pool is not None:
                pool.close()
            self._pool_error = f"symmetric pool unavailable: {errors[0]}" + self._isolated_gpu_hint()
            log.warning("%s; using torch.distributed", self._pool_error)
            return None
        return pool

    def _isolated_gpu_hint(self) -> str:
        """Why a GPU pool may fail where every rank sees a single GPU (CUDA_VISIBLE_DEVICES set per
        rank, common under SLURM): importing a peer's memory needs the peer's GPU to be visible
        to the driver in this process, as NCCL's own P2P/IPC transports do."""
        if self.mode != "gpu" or self.world_size < 2 or torch.cuda.device_count() != 1:
            return ""
        return (f" (every rank sees one GPU, CUDA_VISIBLE_DEVICES={envs.cuda_visible_devices()!r}: the driver "
                "may refuse to map a peer's memory on a GPU this process cannot see. Give each rank all of the "
                "node's GPUs and pick one with torch.cuda.set_device(local_rank))")

    def _prepare_kernels(self) -> str | None:
        """Build or load every kernel this communicator may launch; None, or why it cannot."""
        try:
            if self.mode == "emulator":
                from . import _emu

                self._emu = _emu.load(envs.get("UBNEXT_EMU_BREAK"))
                seed = envs.get("UBNEXT_EMU_SEED")
                # 0 lets the emulator derive a seed per process; a fixed seed differs per rank
                self._emu.configure(envs.get("UBNEXT_EMU_CHAOS"), seed + self.rank if seed else 0)
            else:
                kernels.load_all(self.device.index)
        except Exception as exc:  # noqa: BLE001 - any failure here means "use torch", agreed below
            log.warning("rank %d cannot prepare the ubnext kernels: %s: %s", self.rank, type(exc).__name__, exc)
            return f"{type(exc).__name__}: {exc}"
        return None

    def empty(self, *shape, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """A tensor in the symmetric pool (collective, same order on every rank), so that a
        GEMM can write its output there (``out=``) and the allreduce runs in place. Falls back
        to an ordinary tensor, counted in ``pool_stats()['fallbacks']``, when it does not fit."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        if math.prod(shape) == 0:
            raise ValueError(f"pool tensors must hold at least one element, got shape {shape}")
        if dtype not in DTYPE_CODES and dtype not in (FP8, torch.uint8):
            raise TypeError(f"ubnext pool tensors support bf16, fp16, fp32, e4m3 and uint8 (bytes, as FSDP2 "
                            f"all-gathers mixed dtypes), got {dtype}")
        pool = self.pool
        if pool is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        tensor, offset, reason = None, None, ""
        try:
            tensor = pool.empty(shape, dtype)
            offset = pool.offset_of(tensor)
        except NoRoom as exc:
            reason = str(exc)
        # A tensor reduced in place must sit at the same offset on every rank, and arenas can
        # differ (the garbage collector frees at different times on each rank): agree, and
        # give every rank an ordinary tensor unless all got the same offset.
        offsets = self._allgather(offset)
        if tensor is not None and len(set(offsets)) == 1:
            return tensor
        if tensor is not None:
            reason = f"the ranks' pool offsets differ ({offsets})"
        elif any(o is not None for o in offsets):
            reason = f"{reason} on this rank"
        del tensor
        self._log_once("pool", f"comm.empty{shape} {dtype} is not in the pool: {reason}; "
                       "returning an ordinary tensor")
        return torch.empty(shape, dtype=dtype, device=self.device)

    def pool_stats(self) -> dict[str, Any]:
        pool = self.pool
        if pool is None:
            return {"backend": None, "size": 0, "used": 0, "peak": 0, "largest_free": 0,
                    "fallbacks": 0, "reason": self._pool_error}
        return pool.stats()

    # -- checks -------------------------------------------------------------------------------

    def _log_once(self, key: str, message: str) -> None:
        if (key, message) not in self._logged:
            self._logged.add((key, message))
            # without a GPU and without emulation the torch path is expected, not a degradation
            log.log(logging.INFO if self.mode == "torch" else logging.WARNING, "%s", message)

    def _check_usable(self) -> None:
        """At the start of every op: refuse a closed or aborted communicator, and order this call's
        stream after the last one, before the op writes anything (staging, pool tensors)."""
        if self._closed:
            raise UbnextError("communicator is closed")
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

    def _raise_kernel_error(self, pool: SymmetricPool) -> None:
        if self.device.type == "cuda":
            # the details are complete once the writing kernel has ended (csrc/device/barrier.cuh)
            torch.cuda.synchronize(self.device)
        code, op, rank, peer, field, mine, theirs, aborted = (int(v) & 0xFFFFFFFF for v in pool.err_word.tolist())
        op_name = _OP_NAMES.get(op, f"op {op}")
        if code == ERR_TIMEOUT:
            cause = (f"rank {rank} timed out in {op_name} after {pool.timeout_s:g} s (UBNEXT_TIMEOUT, else the "
                     f"process group's timeout) waiting for peer {peer}")
        elif code == ERR_MISMATCH:
            name = _HEADER_FIELDS.get(field, f"header word {field}")
            cause = (f"ranks called {op_name} with different arguments: rank {rank} with {name} "
                     f"{_header_value(field, mine)} but rank {peer} with {name} {_header_value(field, theirs)}; "
                     "every rank must make the same calls, and pool tensors it reduces in place must sit "
                     "at the same offset on every rank (allocate and free them in the same order)")
        else:
            cause = f"{op_name} reported error code {code:#x} on rank {rank} (peer {peer})"
        if aborted:
            # this rank stopped because the communicator had been aborted (csrc/device/barrier.cuh)
            msg = f"ubnext: the communicator was aborted on every rank (seen by rank {self.rank}) because {cause}"
        else:
            msg = f"ubnext {op_name}: {cause}"
        self._broken = msg
        raise UbnextTimeoutError(msg) if code == ERR_TIMEOUT else UbnextError(msg)

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

    # -- path choice ----------------------------------------------------------------------------

    def _pool_view(self) -> plan.PoolView:
        pool = self.pool if self.mode != "torch" else None
        if pool is None:
            return plan.PoolView(self._pool_error or "no symmetric pool", mode=self.mode)
        symm_op = hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "one_shot_all_reduce")
        # sizes of the layout only, never what this rank has allocated: ranks plan identically
        return plan.PoolView(None, pool.has_multicast, pool.lamport_capacity, pool.layout.staging_bytes,
                             self.mode, symm_op, tuple(sorted(self._disabled.items())), pool.layout.sized_by)

    def _capabilities(self, nbytes: int, dtype: torch.dtype, fused: bool, hidden: int = 0) -> dict[str, str | None]:
        """For each path: None if it can run this call, else why not."""
        return plan.capabilities(nbytes, _element_size(dtype), fused, hidden, self._pool_view())

    def _plan(self, nbytes: int, dtype: torch.dtype, fused: bool, hidden: int = 0,
              in_place_pool: bool = False) -> plan.Plan:
        """The plan of a call, cached: its inputs are the call's signature, the forced algorithm
        and what the pool offers, all identical on every rank and fixed once the pool exists
        (the self-test's verdict included), so a cached plan is the one every rank would
        compute. The pool's creation (or failure) and the forced algorithm are in the key."""
        if self._closed:
            raise UbnextError("communicator is closed")
        key = (nbytes, dtype, fused, hidden, in_place_pool, self._algo, self._pool is None, self._pool_error)
        chosen = self._plans.get(key)
        if chosen is None:
            chosen = plan.choose(nbytes, _element_size(dtype), fused, hidden, self._pool_view(),
                                 forced=self._algo or self._env_algo,
                                 allow_nondeterministic=self._allow_nondeterministic, in_place_pool=in_place_pool)
            for path, why in chosen.skipped:  # once per plan, not per call
                self._log_once(path, f"not using {path}: {why}")
            if len(self._plans) < 4096:
                self._plans[key] = chosen
        return chosen

    def explain(self, x: torch.Tensor, *, fused: bool = False, in_place: bool = False) -> str:
        """Which path an allreduce (``fused``: the fused norm over x's last dimension; ``in_place``:
        ``out=x``) of ``x`` would take, and why the better ones would not."""
        nbytes = x.numel() * x.element_size()
        chosen = self._plan(nbytes, x.dtype, fused, x.shape[-1] if fused and x.dim() else 0,
                            in_place_pool=in_place and not fused and self._in_pool_aligned(x))
        lines = [f"{chosen.path}: {chosen.reason} ({nbytes} bytes, {self.world_size} ranks, mode {self.mode})"]
        lines += [f"  not {p}: {why}" for p, why in chosen.skipped]
        return "\n".join(lines)

    def _call_for(self, signature: tuple, shape: torch.Size, dtype: torch.dtype, *, hidden: int = 0,
                  eps: float = 0.0, flags: int = 0, in_place_pool: bool = False) -> _Call:
        """The path and the launch of a call whose arguments passed their checks (``hidden``: the
        fused norm's row, 0 for a plain allreduce). Remembered under ``signature``, everything
        the checks and the plan read of the arguments (shapes, dtypes, eps, the forced path), so
        that a call with the same signature skips both and only checks what varies per call
        (contiguity, devices). Like the plan, a function of the call's arguments and of what the
        pool offers: identical on every rank."""
        n = math.prod(shape)
        chosen = self._plan(n * dtype.itemsize, dtype, fused=bool(hidden), hidden=hidden, in_place_pool=in_place_pool)
        launch = self._launch_for(chosen.path, dtype, n, hidden, eps, flags) if chosen.path in KERNEL_PATHS else None
        call = _Call(chosen.path, launch)
        if len(self._calls) < 4096:
            self._calls[signature] = call
        return call

    # -- launches -------------------------------------------------------------------------------

    def _geometry(self, algo: str, n: int, elem: int, tokens: int, fused: bool) -> tuple[int, int]:
        if self.mode == "emulator":
            block, max_blocks = 64, 4  # emulated threads are fibers on 2 cores: keep it small
        else:
            # 256 threads: the kernels' register use (up to 168 on sm_100) allows it, not 512;
            # one block per SM at most keeps the grid co-resident (blocks wait on peers' blocks)
            block, max_blocks = 256, self._sm_count
        if fused:
            return max(1, min(tokens, max_blocks)), block
        vectors = -(-n * elem // 16)
        if algo in ("nvls_twoshot", "twoshot", "nvls_lamport"):
            vectors = -(-vectors // self.world_size)  # each rank reduces its 1/N share
        return max(1, min(-(-vectors // block), max_blocks)), block

    def _launch_for(self, algo: str, dtype: torch.dtype, n: int, hidden: int, eps: float, flags: int) -> _Launch:
        grid, block = self._geometry(algo, n, dtype.itemsize, n // hidden if hidden else 0, bool(hidden))
        if algo in ("lamport", "allgather") and self._pool.has_multicast:
            flags |= kernels.F_MULTICAST
        scalars = (n, hidden, float(eps), flags)
        packed = _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[-len(scalars):], scalars)
        fp8_out = flags & (kernels.F_FP8_STATIC | kernels.F_FP8_PER_TOKEN)
        name = _kernel_name(algo, dtype)
        kernel = config = None
        if self.mode == "gpu":
            kernel, config = kernels.load_kernel(name, self._device_index), _cuda.launch_config(grid, block)
        return _Launch(algo, name, grid, block, 8 if fp8_out else 16, scalars, tuple(packed), kernel, config)

    def _launch(self, how: _Launch, inp: torch.Tensor, out: torch.Tensor, residual=None, residual_out=None,
                weight=None, scale=None, scale_inv=None) -> None:
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
            if how.algo != "lamport" and _misaligned(inp):
                raise AssertionError(f"{how.algo}: pool input at {p_in:#x} is not 16-byte aligned")
            staged = self._aligned_copies(inp, out, residual, residual_out, weight, copy_back)
            p_in, p_out, p_res, p_res_out, p_w = (_ptr(t) for t in staged)  # `staged` is held: the kernel reads the copies
        self._run(how, (self._pool.base, p_in, p_out, p_res, p_res_out, p_w,
                        0 if scale is None else scale.data_ptr(), 0 if scale_inv is None else scale_inv.data_ptr()))
        if copy_back:
            for target, staged_out in copy_back:
                target.copy_(staged_out)  # stream-ordered after the kernel

    def _run(self, how: _Launch, pointers: tuple) -> None:
        """Launch one kernel with its eight pointers (kernels.KERNEL_SIGNATURE's order), on the
        emulator or the GPU; the emulator's launch is synchronous, so its error word is read here."""
        pool = self._pool
        if self.mode == "emulator":
            self._emu.launch(how.name, how.grid, how.block, list(zip(_SIGNATURE_KINDS, (*pointers, *how.scalars))),
                             timeout_s=pool.timeout_s)
            if pool.err_view[0]:
                self._raise_kernel_error(pool)
            return
        if self._capturing:  # since this op's _check_usable, as self._stream
            pool.captured = True  # its memory must outlive close() (SymmetricPool.close)
        _cuda.launch(how.kernel, how.config, self._stream, (*pointers, *how.packed), self._device_index)
        if self._debug:
            torch.cuda.synchronize(self.device)
            if pool.err_view[0]:
                self._raise_kernel_error(pool)

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
        return (inp, aligned_output(out, 8 if out.dtype == FP8 else 16), residual, aligned_output(residual_out),
                weight)

    def _order_after_other_stream(self, stream: int) -> None:
        """A communicator's kernels share one sync region, so two of them must never run at the same
        time: from two streams they could, and their barriers would pair up wrongly or deadlock
        (DESIGN.md section 8). When an eager call comes from another stream than the last eager one
        (a side stream for overlap, FSDP2's streams, a graph's warm-up stream), that stream first
        waits for everything enqueued on the last one, so kernels stay in one order whatever stream
        issues them. _check_usable calls this only when the stream (``stream``, the current one's
        raw handle) changed, and never for captured calls: a graph's kernels run when and where its
        owner replays it, ordered by them."""
        current = torch.cuda.current_stream(self.device)  # the torch object of `stream`
        last = self._last_torch_stream
        if last is not None:
            done = torch.cuda.Event()
            done.record(last)
            current.wait_event(done)
        self._last_stream, self._last_torch_stream = stream, current

    def synchronize(self) -> None:
        """Wait for this rank's queued ops and raise any error a kernel reported."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._check_usable()

    # -- ops ------------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum of ``x`` over the ranks. ``x`` is unchanged unless ``out is x``."""
        if out is None:
            return ops.all_reduce(x, self.key)
        return ops.all_reduce_out(x, out, self.key)

    def _all_reduce(self, x: torch.Tensor, out: torch.Tensor, call: _Call | None = None) -> torch.Tensor:
        """The allreduce itself (torch.ops.ubnext.all_reduce's implementation); ``out`` may be x.
        A caller that made x and out itself, fresh and contiguous, passes their signature's
        ``call`` (as _linear_all_reduce does): the signature's checks are then its word."""
        in_place = in_place_pool = False
        if call is None:
            try:
                in_place = _same_memory(out, x)
                # a pool tensor reduced where it lies needs no staging: part of the call's signature
                in_place_pool = in_place and self._in_pool_aligned(x)
                signature = ("all_reduce", x.shape, x.dtype, out.shape, out.dtype, in_place_pool, self._algo)
            except AttributeError:  # not a tensor (an operator passes None through): say which
                check_all_reduce_args(x, out)
                raise
            call = self._calls.get(signature)
            if call is None or not (x.is_contiguous() and out.is_contiguous()):
                check_all_reduce_args(x, out)  # what a remembered signature does not vouch for
        device = self.device
        if x.device != device or out.device != device:
            self._check_device("x out", x, out)
        self._check_usable()
        if self._debug:
            self._check_same_across_ranks(("all_reduce", tuple(x.shape), str(x.dtype), in_place_pool))
        if call is None:  # a remembered signature has more than one rank and elements to reduce
            if self.world_size == 1 or x.numel() == 0:
                self.last_path = "torch"
                return out if in_place else out.copy_(x)
            call = self._call_for(signature, x.shape, x.dtype, in_place_pool=in_place_pool)
        if in_place:
            out = x  # the kernels' in-place test is identity
        self.last_path = call.path
        self._all_reduce_by(call, x, out)
        return out

    def _all_reduce_by(self, call: _Call, x: torch.Tensor, out: torch.Tensor) -> None:
        path = call.path
        if path == "lamport":
            self._launch(call.launch, x, out)
        elif path in plan.IN_PLACE_PATHS:
            self._in_place(call.launch, x, out)
        elif path in ("nvls_oneshot", "nvls_lamport"):
            # peers read `in` through multicast while this rank writes `out`: never the same memory
            in_pool = out is not x and self._in_pool_aligned(x)
            stage = x if in_pool else self._pool.staging(x.shape, x.dtype).copy_(x)
            self._launch(call.launch, stage, out)
        elif path == "torch_symm":
            self._torch_symm_all_reduce(x, out)
        else:
            self._torch_all_reduce(x, out)

    def _linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` summed over the ranks (torch.ops.ubnext.linear_all_reduce, the row-parallel
        ubnext.nn.Linear). A path that reduces through the pool's staging region finds the GEMM's
        output already there, at the same offset on every rank whatever each rank has allocated
        (no copy in); Lamport reads its input anywhere, so for a signature planned to take it the
        GEMM writes a fresh tensor. The sum lands in a fresh tensor, since the next call reuses
        the staging region."""
        shape = (*x.shape[:-1], weight.shape[0])
        # the plan of the GEMM output's allreduce, decided before the first GEMM of a signature,
        # so that every call of it runs the same GEMM
        signature = ("linear_all_reduce", x.shape, x.dtype, weight.shape, weight.dtype, self._algo)
        planned = self._calls.get(signature)
        if planned is None:
            check_linear_args(x, weight)
            if self.world_size > 1 and math.prod(shape) > 0:
                planned = self._call_for(signature, shape, x.dtype)
        if planned is not None and planned.path == "lamport":
            # in place: each Lamport thread reads its vectors of `in` before it writes them in `out`
            y = torch.nn.functional.linear(x, weight)
            return self._all_reduce(y, y, planned)
        y = self._staging_or_none(shape, x.dtype)
        if y is None:
            y = torch.nn.functional.linear(x, weight)
        else:
            torch.matmul(x, weight.t(), out=y)
        return self._all_reduce(y, torch.empty_like(y))

    def _staging_or_none(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A view of the pool's staging region, or None when there is no pool or the shape does
        not fit."""
        pool = self._pool
        if pool is None:
            pool = self.pool if self.mode != "torch" else None  # made on first use
        if pool is None:
            return None
        self._check_usable()  # before the caller's GEMM writes into staging
        try:
            return pool.staging(shape, dtype)
        except NoRoom:
            return None

    def _in_pool_aligned(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a pool tensor, 16-byte aligned: peers can read it, and the two-shot
        kernels reduce it, where it lies."""
        pool = self._pool
        return pool is not None and pool.contains(x) and not _misaligned(x)

    def _in_place(self, launch: _Launch, x: torch.Tensor, out: torch.Tensor) -> None:
        if out is x and self._in_pool_aligned(x):
            self._launch(launch, x, x)
            return
        stage = self._pool.staging(x.shape, x.dtype)
        if stage.data_ptr() != x.data_ptr():  # x may already be the staging region
            stage.copy_(x)
        self._launch(launch, stage, stage)
        out.copy_(stage)

    def _torch_all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> None:
        if x.device.type == "cpu" and x.dtype != torch.float32:
            # gloo sums in the tensor's dtype; sum in fp32 like the kernels do
            acc = x.float()
            dist.all_reduce(acc, group=self.group)
            out.copy_(acc)
            return
        if out is not x:
            out.copy_(x)
        dist.all_reduce(out, group=self.group)

    def _torch_symm_all_reduce(self, x: torch.Tensor, out: torch.Tensor,
                               op_name: str = "one_shot_all_reduce") -> None:
        import torch.distributed._symmetric_memory as symm_mem

        key = (x.numel(), x.dtype)
        buf = self._symm_buffers.get(key)
        if buf is None and _cuda.capturing(self.device):
            # a new buffer means an allocation and a rendezvous, which a capture cannot contain;
            # which keys exist follows from the call sequence, the same on every rank: agreed
            self._log_once("capture", f"torch_symm: no buffer for {key} was made before capture; "
                           "this captured call uses torch.distributed (run it once eagerly first)")
            self._torch_all_reduce(x, out)
            return
        if buf is None:
            buf = symm_mem.empty(x.numel(), dtype=x.dtype, device=self.device)
            symm_mem.rendezvous(buf, self.group.group_name)
            self._symm_buffers[key] = buf
        buf.copy_(x.reshape(-1))
        op = getattr(torch.ops.symm_mem, op_name)
        result = op(buf, "sum", self.group.group_name)
        # the in-place variants (trailing underscore) leave the sum in buf
        out.copy_((buf if op_name.endswith("_") else result).view_as(x))

    def all_reduce_torch_symm(self, x: torch.Tensor, op_name: str) -> torch.Tensor:
        """Allreduce by one named torch symmetric-memory op where it exists (CUDA tensors),
        else by the normal path choice (logged once)."""
        return ops.all_reduce(x, self.key, op_name)

    def _all_reduce_torch_symm(self, x: torch.Tensor, op_name: str) -> torch.Tensor:
        check_all_reduce_args(x)
        self._check_device("x", x)
        self._check_usable()
        usable = self.mode == "gpu" and hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, op_name)
        if not usable or self.world_size == 1:
            self._log_once("torch_symm", f"torch symmetric-memory op {op_name} unavailable here; "
                           "using the ubnext path choice")
            return self._all_reduce(x, torch.empty_like(x))
        out = torch.empty_like(x)
        self._torch_symm_all_reduce(x, out, op_name)
        self.last_path = "torch_symm"
        return out

    def all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float = 1e-6, *, out_dtype: torch.dtype | None = None,
                               scale: torch.Tensor | None = None):
        """``residual_out = allreduce(x) + residual``; ``out = rmsnorm(residual_out) * weight``.

        Returns ``(out, residual_out, scale_inv)``. ``out_dtype`` defaults to ``x.dtype``; with
        ``torch.float8_e4m3fn`` the output is FP8 with a static scale (``scale``: a one-element
        fp32 tensor holding the dequantisation scale) or per-token scales, and ``scale_inv``
        satisfies ``y ≈ out.float() * scale_inv`` (one value, or one per token). ``scale_inv``
        is None for non-FP8 outputs.
        """
        return ops.all_reduce_add_rmsnorm(x, residual, weight, eps, self.key, out_dtype, scale)

    def _all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float, scale: torch.Tensor | None = None, fp8: bool = False):
        """The fused op itself: torch.ops.ubnext.all_reduce_add_rmsnorm's implementation, returning
        ``(out, residual_out)``, and with ``fp8`` all_reduce_add_rmsnorm_fp8's, returning
        ``(out, residual_out, scale_inv)``."""
        try:
            signature = ("all_reduce_add_rmsnorm", x.shape, x.dtype, residual.shape, residual.dtype, weight.shape,
                         weight.dtype, eps, fp8, scale is None, self._algo)
        except AttributeError:  # not a tensor (an operator passes None through): say which
            check_fused_args(x, residual, weight, eps, fp8, scale)
            raise
        call = self._calls.get(signature)
        if call is None or scale is not None or not (
                x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
            check_fused_args(x, residual, weight, eps, fp8, scale)  # what a remembered signature does not vouch for
        device = self.device
        if x.device != device or residual.device != device or weight.device != device:
            self._check_device("x residual weight", x, residual, weight)
        self._check_usable()
        if self._debug:
            self._check_same_across_ranks(("all_reduce_add_rmsnorm", tuple(x.shape), str(x.dtype), fp8))
        if call is None:  # a remembered signature has more than one rank and elements to reduce
            if self.world_size == 1 or x.numel() == 0:
                self.last_path = "torch"
                return self._fused_in_torch(x, residual, weight, eps, scale, fp8)
            flags = kernels.F_FUSED_NORM
            if fp8:
                flags |= kernels.F_FP8_STATIC if scale is not None else kernels.F_FP8_PER_TOKEN
            call = self._call_for(signature, x.shape, x.dtype, hidden=x.shape[-1], eps=eps, flags=flags)
        path = self.last_path = call.path
        launch = call.launch
        if launch is None:
            reduced = torch.empty_like(x)
            self._all_reduce_by(call, x, reduced)
            return self._fused_in_torch(reduced, residual, weight, eps, scale, fp8)
        # lamport reads x anywhere; the NVLS/two-shot kernels reduce through the pool and
        # overwrite their input, so x is always staged (never the caller's x)
        inp = x if path == "lamport" else self._pool.staging(x.shape, x.dtype).copy_(x)
        residual_out = torch.empty_like(residual)
        if not fp8:
            out = torch.empty_like(x)
            self._launch(launch, inp, out, residual, residual_out, weight)
            return out, residual_out
        out = torch.empty_like(x, dtype=FP8)
        if scale is not None:
            scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
        else:
            scale_inv = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)  # one per token
        self._launch(launch, inp, out, residual, residual_out, weight, scale, scale_inv)
        return out, residual_out, scale_inv

    @staticmethod
    def _fused_in_torch(reduced, residual, weight, eps, scale, fp8):
        """add + RMSNorm (+FP8) of an already reduced x, in torch, as the fused op returns it."""
        outputs = reference_add_rmsnorm(reduced, residual, weight, eps, FP8 if fp8 else reduced.dtype, scale)
        return outputs if fp8 else outputs[:2]

    # -- all-gather, reduce-scatter and FP8 quantisation (FSDP2: ubnext.fsdp) -------------------

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the first dimension, in rank order: shape
        ``(world_size * x.shape[0], *x.shape[1:])``, any dtype (the kernel moves bytes). ``out``
        may be a pool tensor (``comm.empty``, or ubnext.fsdp's allocate): the peers then write
        straight into it; otherwise the result passes through the pool's staging region, and a
        result larger than that takes torch.distributed. Whether ``out`` is a pool tensor is an
        argument of the call: every rank passes the same kind (``UBNEXT_DEBUG=1`` compares it)."""
        if out is None:
            return torch.ops.ubnext.all_gather(x, self.key)
        torch.ops.ubnext.all_gather_out(x, out, self.key)
        return out

    def reduce_scatter(self, x: torch.Tensor, *, op="sum", out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shard of the sum over the ranks: ``x`` is ``world_size`` equal shards along
        its first dimension, and rank r gets ``factor * sum_ranks(shard r)``, summed in fp32 (in
        rank order, rounded once) whatever the dtype. ``op``: "sum", "avg", a factor, or a
        torch.distributed ReduceOp (SUM, AVG, PREMUL_SUM(f)). ``x`` may be a pool tensor, read by
        the peers where it lies; otherwise it is staged as for ``all_gather``."""
        factor = reduce_factor(op, self.world_size)
        if out is None:
            return torch.ops.ubnext.reduce_scatter(x, factor, self.key)
        torch.ops.ubnext.reduce_scatter_out(x, out, factor, self.key)
        return out

    def quantize_fp8(self, x: torch.Tensor, *, scaling: str = "row", scale: torch.Tensor | None = None):
        """``(q, scale_inv)``: ``x`` as e4m3 and its dequantisation scales, written by one kernel, so
        that ``x ~= q.float() * scale_inv`` (per row: ``scale_inv[:, None]``). ``scaling``: "row"
        (one scale per row of the last dimension), "tensor" (one for the whole tensor), or
        "static" (``scale``: a one-element fp32 tensor, returned as scale_inv). Local: no peer is
        involved. Scales per row are ``max(amax / 448, 1e-12)``; values saturate to +-448."""
        if scaling not in ("row", "tensor", "static"):
            raise ValueError(f"scaling must be 'row', 'tensor' or 'static', got {scaling!r}")
        if (scaling == "static") != (scale is not None):
            raise ValueError("scale is required with scaling='static' and meaningless otherwise")
        hidden = x.shape[-1] if scaling == "row" and x.dim() else x.numel()
        return torch.ops.ubnext.quantize_fp8(x, hidden, scale, self.key)

    def _exchange_call(self, signature: tuple, algo: str, dtype: torch.dtype, n: int, nbytes: int, in_pool: bool,
                       shape_problem: str | None, factor: float = 0.0) -> _Call:
        """The path and launch of an all-gather or reduce-scatter signature (plan.exchange_path),
        made once and remembered like the allreduce's."""
        path, why = plan.exchange_path(algo, nbytes, in_pool, shape_problem, self._pool_view())
        if path == "torch":
            self._log_once(algo, f"{algo} takes torch.distributed: {why}")
        launch = self._launch_for(algo, dtype, n, 0, factor, 0) if path != "torch" else None
        call = _Call(path, launch)
        if len(self._calls) < 4096:
            self._calls[signature] = call
        return call

    def _all_gather(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """torch.ops.ubnext.all_gather(_out)'s implementation."""
        check_all_gather_args(x, out, self.world_size)
        if x.device != self.device or out.device != self.device:
            self._check_device("x out", x, out)
        self._check_usable()
        nbytes = x.numel() * x.element_size()
        in_pool = self._in_pool_aligned(out)
        if self._debug:
            self._check_same_across_ranks(("all_gather", nbytes, in_pool))
        if self.world_size == 1 or nbytes == 0:
            self.last_path = "torch"
            out.view(-1).copy_(x.view(-1))
            return
        signature = ("all_gather", nbytes, in_pool)
        call = self._calls.get(signature)
        if call is None:
            problem = None if nbytes % 4 == 0 else f"the shard's {nbytes} bytes are not a multiple of 4"
            call = self._exchange_call(signature, "allgather", torch.uint8, nbytes, self.world_size * nbytes,
                                       in_pool, problem)
        self.last_path = call.path
        if call.launch is None:
            self._torch_all_gather(x, out)
            return
        src = x if x.data_ptr() % 4 == 0 else x.clone()  # the kernel moves 4-byte words at least
        target = out if in_pool else self._pool.staging((self.world_size * nbytes,), torch.uint8)
        self._run(call.launch, (self._pool.base, src.data_ptr(), target.data_ptr(), 0, 0, 0, 0, 0))
        if target is not out:
            out.view(-1).view(torch.uint8).copy_(target)

    def _torch_all_gather(self, x: torch.Tensor, out: torch.Tensor) -> None:
        # all_gather_single is all_gather_into_tensor's newer name (torch >= 2.10 deprecates the old one)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), x.reshape(-1), group=self.group)

    def _reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
        """torch.ops.ubnext.reduce_scatter(_out)'s implementation."""
        check_reduce_scatter_args(x, out, self.world_size)
        if x.device != self.device or out.device != self.device:
            self._check_device("x out", x, out)
        if (out.data_ptr() < x.data_ptr() + x.numel() * x.element_size()
                and x.data_ptr() < out.data_ptr() + out.numel() * out.element_size()):
            raise ValueError("reduce_scatter: out must not overlap x")
        self._check_usable()
        n, elem = out.numel(), x.element_size()
        in_pool = self._in_pool_aligned(x)
        if self._debug:
            self._check_same_across_ranks(("reduce_scatter", n, str(x.dtype), factor, in_pool))
        if self.world_size == 1:
            self.last_path = "torch"
            out.view(-1).copy_(x.view(-1).float().mul(factor) if factor != 1.0 else x.view(-1))
            return
        signature = ("reduce_scatter", n, x.dtype, factor, in_pool)
        call = self._calls.get(signature)
        if call is None:
            problem = None if (n * elem) % 16 == 0 else (
                f"a shard of {n} {x.dtype} elements is not a whole number of 16-byte vectors")
            call = self._exchange_call(signature, "reduce_scatter", x.dtype, n, x.numel() * elem, in_pool, problem,
                                       factor)
        self.last_path = call.path
        if call.launch is None:
            self._torch_reduce_scatter(x, out, factor)
            return
        src = x if in_pool else self._pool.staging((x.numel(),), x.dtype).copy_(x.view(-1))
        target = out if out.data_ptr() % 16 == 0 else torch.empty_like(out)
        self._run(call.launch, (self._pool.base, src.data_ptr(), target.data_ptr(), 0, 0, 0, 0, 0))
        if target is not out:
            out.copy_(target)

    def _torch_reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, factor: float) -> None:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # as all_gather_single
        if x.device.type == "cpu" and x.dtype != torch.float32:
            # gloo sums in the tensor's dtype; sum in fp32 like the kernel
            acc = torch.empty(out.numel(), dtype=torch.float32)
            scatter(acc, x.reshape(-1).float(), group=self.group)
            out.view(-1).copy_(acc.mul_(factor) if factor != 1.0 else acc)
            return
        scatter(out.view(-1), x.reshape(-1), group=self.group)
        if factor != 1.0:
            out.mul_(factor)

    def _quantize_fp8(self, x: torch.Tensor, hidden: int, scale: torch.Tensor | None):
        """torch.ops.ubnext.quantize_fp8's implementation: the kernel where ubnext kernels run,
        else quantize_fp8_reference, the same contract (bitwise: true division, saturation)."""
        check_quantize_args(x, hidden, scale)
        if x.device != self.device:
            self._check_device("x", x)
        self._check_usable()
        n = x.numel()
        flags = kernels.F_FP8_STATIC if scale is not None else kernels.F_FP8_PER_TOKEN
        signature = ("quantize_fp8", n, x.dtype, hidden, flags)
        call = self._calls.get(signature)
        if call is None:
            view = self._pool_view()
            problem = view.unavailable or (
                None if (hidden * x.element_size()) % 16 == 0 else
                f"rows of {hidden} {x.dtype} elements are not whole 16-byte vectors")
            if problem:
                self._log_once("quantize_fp8", f"quantize_fp8 runs in torch: {problem}")
            launch = None if problem else self._launch_for("quantize_fp8", x.dtype, n, hidden, 0.0, flags)
            call = _Call("torch" if problem else "quantize_fp8", launch)
            if len(self._calls) < 4096:
                self._calls[signature] = call
        if call.launch is None:
            q, scale_inv = quantize_fp8_reference(x, hidden, scale)
            return q, scale_inv
        src = x if x.data_ptr() % 16 == 0 else x.clone()
        q = torch.empty(x.shape, dtype=FP8, device=x.device)
        scale_inv = torch.empty(1 if scale is not None else n // hidden, dtype=torch.float32, device=x.device)
        self._run(call.launch, (self._pool.base, src.data_ptr(), q.data_ptr(), 0, 0, 0,
                                0 if scale is None else scale.data_ptr(), scale_inv.data_ptr()))
        return q, scale_inv


# the public methods enter through the operators (ops.py), which are built on this module
from . import ops  # noqa: E402

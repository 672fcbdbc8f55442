"""Argument checks and reference math: what every ubnext operator asks of its arguments, and the
torch arithmetic that the kernels' contract is written in (csrc/device/norm.cuh).

One home for both, shared by the eager operators, their fake (tracing) implementations and the
torch fallbacks, so that a compiled call fails at trace time as an eager call fails, and a
fallback computes what the kernel computes. A leaf: it imports no other ubnext module.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

DTYPE_CODES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP8 = torch.float8_e4m3fn
# what comm.empty places in the pool: the kernels' dtypes, e4m3, and bytes (FSDP2 all-gathers
# mixed dtypes as uint8)
POOL_DTYPES = (*DTYPE_CODES, FP8, torch.uint8)
FP8_MAX = 448.0
# Smallest per-token scale_inv: an all-zero row gets this scale, so q = 0 and no 0/0.
FP8_TINY_SCALE_INV = 1e-12


def check_tensor(name: str, x: torch.Tensor) -> None:
    """What every ubnext operator asks of a tensor argument, whatever its device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPE_CODES:
        raise TypeError(f"{name}: ubnext supports bfloat16, float16 and float32, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")


def check_same_device(names: str, *tensors) -> None:
    """Every tensor among ``tensors`` (named by ``names``, space-separated; the first is x) is on x's
    device, or a ValueError names the argument and both devices. The fake implementations call it:
    the dispatcher sends a real call with any meta argument there."""
    x = tensors[0]
    for name, t in zip(names.split()[1:], tensors[1:]):
        if isinstance(t, torch.Tensor) and t.device != x.device:
            raise ValueError(
                f"{name} is on {t.device} but x is on {x.device}: every tensor of a ubnext call "
                "must be on the communicator's device"
            )


def check_all_reduce_args(x: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """Argument checks of the allreduce operators, shared by the real and the fake (tracing)
    implementations, so a compiled call fails at trace time as an eager call fails."""
    check_tensor("x", x)
    if out is not None:
        check_tensor("out", out)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"out must match x ({tuple(x.shape)}, {x.dtype}), got ({tuple(out.shape)}, {out.dtype})")


def check_linear_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    """Argument checks of the GEMM + allreduce operator (real and fake implementations): a wrong
    weight must fail here, not resize the staging view the GEMM writes into."""
    check_tensor("x", x)
    check_tensor("weight", weight)
    if x.dim() < 1 or weight.dim() != 2 or weight.shape[1] != x.shape[-1] or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be [out_features, {x.shape[-1] if x.dim() else '?'}] of x's dtype {x.dtype}, "
            f"got {tuple(weight.shape)} {weight.dtype}"
        )


def check_fused_args(x, residual, weight, eps, fp8: bool, scale) -> None:
    """Argument checks of the fused operator (real and fake implementations)."""
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        check_tensor(name, t)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dimension, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}), got ({tuple(residual.shape)}, {residual.dtype})"
        )
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
            raise ValueError(
                f"out must hold world_size x x's elements ({want}, {x.dtype}), got ({tuple(out.shape)}, {out.dtype})"
            )


def check_reduce_scatter_args(x: torch.Tensor, out: torch.Tensor | None, world_size: int) -> None:
    """Argument checks of the reduce-scatter operators (real and fake implementations)."""
    check_tensor("x", x)
    if x.dim() == 0 or x.shape[0] % world_size:
        raise ValueError(
            f"x's first dimension must be a multiple of the world size {world_size}, got shape {tuple(x.shape)}"
        )
    if out is not None:
        check_tensor("out", out)
        if out.dtype != x.dtype or out.numel() * world_size != x.numel():
            raise ValueError(
                f"out must hold 1/{world_size} of x's elements in {x.dtype}, got ({tuple(out.shape)}, {out.dtype})"
            )


def check_out_overlap(
    op: str, x: torch.Tensor, out: torch.Tensor, x_slot: int | None = 0, *, by_storage: bool = False
) -> None:
    """Refuses an ``out`` that shares memory with ``x`` anywhere but where ``op`` lets x lie in it:
    as out's slice number ``x_slot`` of x's size (0: all_reduce's in-place form, out being x; the rank:
    all_gather's in-place form, x as this rank's slice of out, which FSDP2 passes), or nowhere (None:
    reduce_scatter). An out that partly overlaps x is written while this rank or its peers still read
    x: wrong sums that change from run to run. A ValueError names ``op`` and both byte ranges (offsets
    in their storage, the same on every rank). The operators call it before anything collective, so
    every rank refuses alike, and only for an out the caller gave.

    Real tensors are compared by address: a few integer comparisons per call. Fake and meta tensors
    (tracing, shape inference) have no addresses (a fake one's is 0, a meta one's its offset from 0
    whatever its storage): ``by_storage`` compares their storages and their offsets in them instead.
    Something that is not a tensor passes, for the op's argument checks to name."""
    try:
        if by_storage:
            if not all(isinstance(d, int) for d in (*x.shape, *out.shape, x.storage_offset(), out.storage_offset())):
                return  # symbolic sizes (dynamic shapes): the real op checks the real tensors when it runs
            if x.untyped_storage()._cdata != out.untyped_storage()._cdata:
                return
            x_start, out_start = x.storage_offset() * x.element_size(), out.storage_offset() * out.element_size()
        else:
            x_start, out_start = x.data_ptr(), out.data_ptr()
        if not (
            x_start < out_start + out.nbytes
            and out_start < x_start + x.nbytes
            and (x_slot is None or x_start - out_start != x_slot * x.nbytes)
        ):
            return
    except AttributeError:
        return
    x_at = None if x_slot is None else x_slot * x.nbytes
    # refused, unless the ranges only touch (an empty tensor) or a tensor is strided: the op's
    # contiguity check names that, and the hull of a strided tensor is not the memory it uses
    if not (x.nbytes and out.nbytes and x.is_contiguous() and out.is_contiguous()):
        return
    shared = by_storage or x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    base = x.untyped_storage().data_ptr() if shared and not by_storage else 0
    where = "of one storage" if shared else "in memory"
    x_from, out_from = x_start - base, out_start - base
    if x_at is None:
        rule = "out must not overlap x"
    elif x_at == 0 and x.nbytes == out.nbytes:
        rule = "out must be x itself (the in-place form) or memory disjoint from x"
    else:
        rule = (
            f"x may lie in out only as bytes [{x_at}, {x_at + x.nbytes}) of out (the in-place form), "
            "else out must be memory disjoint from x"
        )
    raise ValueError(
        f"{op}: out {'partly ' if x_at is not None else ''}overlaps x: x is bytes "
        f"[{x_from}, {x_from + x.nbytes}) and out bytes [{out_from}, {out_from + out.nbytes}) {where}; "
        f"{rule}"
    )


def _premul_factor(op) -> object:
    """A ReduceOp object's PREMUL_SUM factor, or None: torch 2.13 has ``.factor``; earlier ones (2.11,
    the first GPU run's) only carry it in their pickled state, (kind, factor)."""
    if hasattr(op, "factor"):
        return op.factor
    state = op.__getstate__()
    return state[1] if isinstance(state, tuple) and len(state) > 1 else None


def reduce_factor(op, world_size: int) -> float:
    """The factor a reduce-scatter applies to its sum: ``op`` is "sum", "avg", a number, or a
    torch.distributed ReduceOp (SUM, AVG, or PREMUL_SUM(factor), as FSDP2 passes)."""
    if isinstance(op, (int, float)) and not isinstance(op, bool):
        return float(op)
    if isinstance(op, str) and op in ("sum", "avg"):
        return 1.0 if op == "sum" else 1.0 / world_size
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        # a RedOpType is itself the kind; a ReduceOp object (PREMUL_SUM(f)) carries kind and factor
        # torch's stubs omit ReduceOp.op, the pybind property that holds a ReduceOp object's kind
        kind, factor = (op, None) if isinstance(op, dist.ReduceOp.RedOpType) else (op.op, _premul_factor(op))  # type: ignore[attr-defined]
        if kind == dist.ReduceOp.SUM:
            return 1.0
        if kind == dist.ReduceOp.AVG:
            return 1.0 / world_size
        if kind == dist.ReduceOp.PREMUL_SUM and isinstance(factor, (int, float)):
            return float(factor)
    raise ValueError(
        f"reduce-scatter op must be 'sum', 'avg', a number, or ReduceOp SUM / AVG / PREMUL_SUM(x), got {op!r}"
    )


def check_quantize_args(x: torch.Tensor, hidden: int, scale) -> None:
    """Argument checks of the FP8 quantisation operator (real and fake implementations)."""
    check_tensor("x", x)
    if hidden <= 0 or x.numel() % hidden:  # zero rows are fine: every op takes zero tokens (issue 40 C7)
        raise ValueError(f"hidden ({hidden}) must divide x's {x.numel()} elements")
    if scale is not None and (
        not isinstance(scale, torch.Tensor)
        or scale.numel() != 1
        or scale.dtype != torch.float32
        or scale.device != x.device
    ):
        raise ValueError("scale must be a one-element float32 tensor on x's device (the dequantisation scale)")


def fp8_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """The kernels' scale_inv of an fp32 ``amax``: max(amax / 448, 1e-12), NaN kept, with a true
    division on every device. (On CUDA, a tensor divided by a Python number is multiplied by its
    reciprocal, which differs from the kernel's division in the last bit for about half the values.)"""
    return torch.clamp(amax / torch.full((), FP8_MAX, device=amax.device), min=FP8_TINY_SCALE_INV)


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
        scale_inv = fp8_scale_inv(rows.abs().amax(dim=-1))
        q = (rows / scale_inv.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(y.shape), scale_inv


def fp8_output(x: torch.Tensor, out_dtype: torch.dtype | None, scale) -> bool:
    """Whether the fused op writes FP8 (``out_dtype`` is x's dtype, None or e4m3)."""
    if out_dtype is not None and out_dtype not in (x.dtype, FP8):
        raise TypeError(f"out_dtype must be x.dtype ({x.dtype}) or torch.float8_e4m3fn, got {out_dtype}")
    if scale is not None and out_dtype != FP8:
        raise ValueError("scale is only meaningful with out_dtype=torch.float8_e4m3fn")
    return out_dtype == FP8


def rmsnorm(r: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(r * rsqrt(mean(r^2) + eps)) * weight`` over the last dimension, in r's precision, in
    the kernels' order of operations (the torch fallback)."""
    return r * torch.rsqrt(r.square().mean(dim=-1, keepdim=True) + eps) * weight


def rmsnorm_backward(
    r: torch.Tensor, weight: torch.Tensor, eps: float, grad_y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``y = rmsnorm(r, weight, eps)`` (fp32 in, fp32 out), in closed form:
    with ``inv = rsqrt(mean(r^2) + eps)`` and ``gw = grad_y * weight``,
    ``grad_r = inv * gw - r * inv^3 * mean(gw * r)`` and ``grad_weight = sum_rows(grad_y * r * inv)``."""
    inv = torch.rsqrt(r.square().mean(dim=-1, keepdim=True) + eps)
    gw = grad_y * weight
    grad_r = inv * gw - r * inv.pow(3) * (gw * r).mean(dim=-1, keepdim=True)
    grad_w = (grad_y * r * inv).reshape(-1, r.shape[-1]).sum(dim=0)
    return grad_r, grad_w


def _butterfly(v: torch.Tensor) -> torch.Tensor:
    """reduce.cuh's warp_sum over the last dimension (32 lanes): what lane 0 holds after the xor steps
    16, 8, 4, 2, 1 is the lower half plus the upper half, halved again and again."""
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


def row_sum_of_squares(r: torch.Tensor, vec: int) -> torch.Tensor:
    """fp32 sum of r^2 over the last dimension in csrc/device/norm.cuh's order, fixed by the row
    length alone: per 16-byte vector of ``vec`` elements left to right, a butterfly over each group
    of 32 vectors, a butterfly over each superblock's 32 groups, the superblocks left to right.
    Zero padding (a row that is not whole vectors, and the last group / superblock) adds +0: exact.
    Returns shape ``r.shape[:-1] + (1,)``."""
    x = r.float()
    lead, h = x.shape[:-1], x.shape[-1]
    x = x.reshape(-1, h)
    nv = -(-h // vec)
    sq = torch.nn.functional.pad(x * x, (0, nv * vec - h)).view(-1, nv, vec)
    q = sq[..., 0]
    for j in range(1, vec):
        q = q + sq[..., j]
    supers = max(1, -(-nv // 1024))
    q = torch.nn.functional.pad(q, (0, supers * 1024 - nv)).view(-1, supers, 32, 32)
    s = _butterfly(_butterfly(q))  # groups, then superblocks: (rows, supers)
    ssq = s[:, 0]
    for k in range(1, supers):
        ssq = ssq + s[:, k]
    return ssq.view(*lead, 1)


def reference_add_rmsnorm(
    reduced: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype,
    scale: torch.Tensor | None,
):
    """add + RMSNorm (+FP8) in torch with the kernels' arithmetic (csrc/device/norm.cuh), for the
    paths no kernel runs: ``reduced`` is the sum s (fp32, or exact in the input dtype), residual_out =
    T(s + residual) rounded once to the input dtype T; the sum of squares of that rounded value in
    fp32 in the kernels' order; rms = 1 / sqrt(ssq / hidden + eps), each step correctly rounded; y =
    (r * rms) * weight rounded to T, FP8 from that same rounded y. Given the same s, the bits of every
    kernel path."""
    dtype = residual.dtype
    residual_out = (reduced.float() + residual.float()).to(dtype)
    r = residual_out.float()
    ssq = row_sum_of_squares(r, 16 // dtype.itemsize)
    m = ssq / r.shape[-1] + torch.tensor(eps, dtype=torch.float32)
    # sqrt and 1 / x each correctly rounded to fp32, as the kernels' sqrtf and / are (torch's CPU sqrt
    # is not: a Sleef 0.5-ulp approximation, one fp32 step off for some inputs); in fp64, then
    # rounded, which is exact rounding for both (53 >= 2 x 24 + 2 bits)
    root = torch.sqrt(m.double()).float()
    rms = (1.0 / root.double()).float()
    y = ((r * rms) * weight.float()).to(dtype)
    if out_dtype != FP8:
        return y, residual_out, None
    # FP8 quantises y rounded to the input dtype; amax comes from those same rounded values
    q, scale_inv = quantize_fp8_reference(y, y.shape[-1], scale)
    return q, residual_out, (scale_inv if scale is not None else scale_inv.reshape(y.shape[:-1]))

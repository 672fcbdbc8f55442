"""Reference results and error bounds derived from the arithmetic, shared by the test suite
and ``python -m ubnext.bench`` (and usable in users' own tests).

Bounds (u = unit roundoff of the dtype: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32):

* allreduce: the kernels sum in fp32 in rank order and round once, so
  ``|out - ref| <= u*|ref| + (N-1)*2^-24*sum_r|x_r| + tiny``. NVLS paths round the reduced value
  once more before the norm: the residual bound adds ``u*|sum|``.
* RMSNorm, checked against an fp64 norm of the kernel's own ``residual_out`` (already checked
  against the fp64 sum): fp32 sum of ``hidden`` squares, rsqrt and two products, then one
  rounding: ``|out - y| <= u*|y| + (hidden/2 + 8)*2^-24*|y| + tiny``.
* FP8 e4m3: each code within one e4m3 step of ``y / scale_inv``.
"""

from __future__ import annotations

import torch

from .reference._checks import FP8_MAX, FP8_TINY_SCALE_INV

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# smallest positive subnormal: the absolute floor of any rounding error
TINY = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}
FP32_U = 2.0**-24
E4M3_MAX = FP8_MAX  # the contract's constants, from the one place that defines them


def rank_input(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s input, reproducible on every rank, so each rank computes the reference
    without communication."""
    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def reference_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([x.double().cpu() for x in inputs]).sum(0)


def allreduce_bound(inputs: list[torch.Tensor], dtype: torch.dtype, *, extra_rounding: bool = False) -> torch.Tensor:
    """Per-element bound of an fp32 rank-order sum rounded to ``dtype`` (twice with
    ``extra_rounding``, as on the NVLS fused paths)."""
    ref = reference_sum(inputs)
    absolute = torch.stack([x.double().abs().cpu() for x in inputs]).sum(0)
    u = UNIT_ROUNDOFF[dtype]
    bound = u * ref.abs() * (1 + u) + (len(inputs) - 1) * FP32_U * absolute * (1 + u) + TINY[dtype]
    if extra_rounding:
        bound = bound + u * ref.abs() * (1 + u)
    return bound


def rank_order_sum(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The kernels' s: the fp32 sum of the ranks' values in rank order 0..N-1."""
    acc = inputs[0].float().cpu().clone()
    for x in inputs[1:]:
        acc = acc + x.float().cpu()
    return acc


def one_rounding_bound(
    inputs: list[torch.Tensor], residual: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp64 reference of allreduce(x) + residual, per-element bound of residual_out = T(s + residual)
    with s the fp32 sum over ranks and ONE rounding to T, issue 26's arithmetic): the fp32 sum's error
    e (N - 1 additions), the fp32 add of the residual, then one rounding to T. Tight where s and the
    residual cancel, where rounding s to T first (a second rounding) is off by up to u |s|."""
    ref = reference_sum(inputs) + residual.double().cpu()
    absolute = torch.stack([x.double().abs().cpu() for x in inputs]).sum(0)
    u = UNIT_ROUNDOFF[dtype]
    e = (len(inputs) - 1) * FP32_U * absolute * 1.01
    bound = (1 + u) * (e + FP32_U * (ref.abs() + e)) + u * ref.abs() + TINY[dtype]
    return ref, bound


def residual_bound(
    inputs: list[torch.Tensor], residual: torch.Tensor, dtype: torch.dtype, *, extra_rounding: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp64 reference of allreduce(x) + residual, per-element bound)."""
    s = reference_sum(inputs)
    ref = s + residual.double().cpu()
    u = UNIT_ROUNDOFF[dtype]
    bound = allreduce_bound(inputs, dtype, extra_rounding=extra_rounding) + u * ref.abs() * (1 + u)
    return ref, bound


def rmsnorm_reference(residual_out: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp64 RMSNorm of the kernel's own (rounded) residual_out."""
    r = residual_out.double().cpu()
    return r * torch.rsqrt(r.square().mean(-1, keepdim=True) + eps) * weight.double().cpu()


def rmsnorm_bound(y: torch.Tensor, dtype: torch.dtype, hidden: int) -> torch.Tensor:
    u = UNIT_ROUNDOFF[dtype] if dtype in UNIT_ROUNDOFF else 0.0
    return u * y.abs() * (1 + u) + (hidden / 2 + 8) * FP32_U * y.abs() + TINY.get(dtype, 0.0)


def e4m3_step(value: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 codes at |value| (3 mantissa bits, subnormal step 2^-9)."""
    mag = value.abs().clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(mag)) - 3)


def check_fp8(
    q: torch.Tensor, scale_inv: torch.Tensor, y: torch.Tensor, hidden: int, per_token: bool, dtype: torch.dtype
) -> None:
    """Assert the FP8 contract: codes finite and within +-448, each within one e4m3 step of
    y / scale_inv, and per-token scale_inv = max(amax/448, tiny) of the same y.

    ``y`` is the fp64 norm; the kernel quantises y rounded to ``dtype`` (its amax comes from
    those same rounded values), so both checks allow ``rmsnorm_bound(y, dtype)``."""
    qf = q.float().double().cpu()
    assert torch.isfinite(qf).all(), "FP8 output holds NaN/inf"
    assert qf.abs().max() <= E4M3_MAX, "FP8 output exceeds 448"
    si = scale_inv.double().cpu()
    si_rows = si.reshape(-1, 1) if per_token else si.reshape(1, 1)
    yv = y.reshape(-1, hidden)
    target = (yv / si_rows).clamp(-E4M3_MAX, E4M3_MAX)
    # the kernel's y carries fp32 error and one rounding to dtype; widen the step by it
    slack = rmsnorm_bound(yv, dtype, hidden) / si_rows
    err = (qf.reshape(-1, hidden) - target).abs()
    assert (err <= e4m3_step(target) + slack).all(), f"FP8 code off by more than one step: {err.max().item()}"
    if per_token:
        amax = yv.abs().amax(-1)
        expect = torch.clamp(amax / E4M3_MAX, min=FP8_TINY_SCALE_INV)
        rel = (si.reshape(-1) - expect).abs() / expect
        u = UNIT_ROUNDOFF[dtype]
        assert (rel <= u * (1 + u) + (hidden / 2 + 8) * FP32_U + 2 * FP32_U).all(), f"scale_inv off: {rel.max().item()}"

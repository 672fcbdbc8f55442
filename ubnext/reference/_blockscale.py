"""Block-scaled formats of ``comm.quantize`` (issue 28): their argument checks, output shapes and
the torch reference, which is the one arithmetic of every path (docs/QUANTIZE.md).

The reference computes, in fp32 with true divisions, exactly what the kernels compute
(csrc/device/blockscale.cuh), operation for operation:

- ``nvfp4`` (block 16): ``s = amax / 6`` (``/ global_scale`` with two levels); the e4m3 scale is
  ``e4m3(clamp(s, 2^-6, 448))``; data ``e2m1(x * m)`` with ``m = 1 / s8`` (two levels:
  ``(1 / global_scale) / s8``), ``s8`` the scale's value; e2m1 rounds to nearest even and
  saturates at 6 (torchao's bit-level conversion); two per byte, the even element low. A NaN
  block: scale 0x7F, every nibble 0x4. This is torchao 0.18's ``nvfp4_quantize``.
- ``mxfp8`` (block 32): the e8m0 exponent of ``amax / 448`` rounded up to a power of two,
  computed exactly as ``cvt.rp.satfinite.ue8m0`` does (NaN 0xFF, inf 0xFE, zero 0); data
  ``e4m3(clamp(x * 2^(127 - e), +-448))`` (1 for e = 0, 2^-127 for inf). This is torchao's
  ``to_mx(..., RCEIL)``, whose eager exponent is ``ceil(log2(.))`` in floating point and can be a
  step low for fp32 values just above a power of two; this one is exact.
- ``fp8_group128`` (block 128): the per-token FP8 rule over each group,
  ``scale = max(amax / 448, 1e-12)``, ``q = e4m3(clamp(x / scale, +-448))``
  (``quantize_fp8_reference`` with rows of 128), every NaN written as 0x7F (a group holding an
  inf has an inf scale and inf / inf = NaN there) and a NaN group's scale the canonical NaN
  0x7FFFFFFF; ``ue8m0`` rounds each scale up to a power of
  two, exactly.

fp16 inputs are quantised as their (exact) fp32 values.
"""

from __future__ import annotations

import torch

from .. import kernels
from ._checks import FP8, FP8_MAX, check_fused_args, check_tensor, fp8_scale_inv

BLOCKS = {"nvfp4": 16, "mxfp8": 32, "fp8_group128": 128}
E8M0 = torch.float8_e8m0fnu
# the kernels' format field (csrc/device/desc.cuh UBNEXT_F_BLOCK_*): the fused kernels read it
FORMAT_FLAGS = {
    "nvfp4": kernels.F_BLOCK_NVFP4,
    "mxfp8": kernels.F_BLOCK_MXFP8,
    "fp8_group128": kernels.F_BLOCK_GROUP128,
}

_E2M1_MAX = 6.0
_E4M3_SCALE_FLOOR = 2.0**-6
_E2M1_NAN_CODE = 0x4
_E4M3_NAN_CODE = 0x7F
_CANONICAL_NAN = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)  # a NaN group's fp32 scale


def check_quantize_block_args(x: torch.Tensor, fmt: str, global_scale, swizzled: bool, ue8m0: bool) -> None:
    """The checks of ``comm.quantize`` (real and fake implementations)."""
    if fmt not in BLOCKS:
        raise ValueError(f"fmt must be one of {sorted(BLOCKS)}, got {fmt!r}")
    check_tensor("x", x)  # bf16, fp16 or fp32, contiguous
    if x.dim() == 0 or x.shape[-1] == 0:
        # zero rows are fine (issue 40 C7: every op takes zero tokens and returns empty outputs)
        raise ValueError(f"x must have a last dimension K > 0, got shape {tuple(x.shape)}")
    k, block = x.shape[-1], BLOCKS[fmt]
    if k % block:
        raise ValueError(f"K = {k} (x's last dimension) is not a multiple of the {fmt} block of {block} elements")
    if global_scale is not None:
        if fmt != "nvfp4":
            raise ValueError(f"global_scale is NVFP4's per-tensor scale; fmt={fmt!r} takes none")
        if (
            not isinstance(global_scale, torch.Tensor)
            or global_scale.numel() != 1
            or global_scale.dtype != torch.float32
            or global_scale.device != x.device
        ):
            raise ValueError(
                "global_scale must be a one-element float32 tensor on x's device "
                "(torchao's per_tensor_amax_to_scale: amax / (448 * 6))"
            )
    if swizzled and fmt == "fp8_group128":
        raise ValueError("swizzled scales (to_blocked's layout) are for nvfp4 and mxfp8, not fp8_group128")
    if ue8m0 and fmt != "fp8_group128":
        raise ValueError(f"ue8m0 rounds fp8_group128's scales to powers of two; fmt={fmt!r} has its own scales")


def check_fused_quant_args(x, residual, weight, eps, fmt: str, global_scale, swizzled: bool, ue8m0: bool) -> None:
    """The checks of ``all_reduce_add_rmsnorm(..., quant=fmt)`` (real and fake implementations): the
    fused op's own, then the format's on x's shape (K, the last dimension, a multiple of the block)."""
    check_fused_args(x, residual, weight, eps, False, None)
    check_quantize_block_args(x, fmt, global_scale, swizzled, ue8m0)


def block_flags(fmt: str | None, swizzled: bool, ue8m0: bool) -> int:
    """The kernel flags of a block-scaled output: the format field (None: the standalone kernels,
    whose name says the format), the layout and the scales' rounding."""
    return (
        (FORMAT_FLAGS[fmt] if fmt else 0)
        | (kernels.F_BLOCK_SWIZZLED if swizzled else 0)
        | (kernels.F_BLOCK_UE8M0 if ue8m0 else 0)
    )


def swizzled_count(rows: int, cols: int) -> int:
    """Scales in to_blocked's layout of a [rows, cols] scale matrix: whole 128 x 4 tiles."""
    return -(-rows // 128) * 128 * (-(-cols // 4) * 4)


def output_specs(x: torch.Tensor, fmt: str, swizzled: bool):
    """((q shape, q dtype), (scales shape, scales dtype)) of ``comm.quantize``."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    cols = k // BLOCKS[fmt]
    rows = x.numel() // k
    if fmt == "nvfp4":
        q = ((*lead, k // 2), torch.uint8)
        scales = ((swizzled_count(rows, cols),) if swizzled else (*lead, cols), FP8)
    elif fmt == "mxfp8":
        q = ((*lead, k), FP8)
        scales = ((swizzled_count(rows, cols),) if swizzled else (*lead, cols), E8M0)
    else:
        q = ((*lead, k), FP8)
        scales = ((*lead, cols), torch.float32)
    return q, scales


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """A [rows, cols] scale matrix in cuBLAS's block-scaling layout, 1-D: 128 x 4 tiles in row-major
    tile order, zero padding where a tile sticks out, each tile as 32 rows of 16 bytes whose row r
    holds the tile's rows r, r + 32, r + 64, r + 96 (csrc/device/blockscale.cuh scale_index)."""
    rows, cols = scales.shape
    rb, cb = -(-rows // 128), -(-cols // 4)
    padded = scales.new_zeros((rb * 128, cb * 4))
    padded[:rows, :cols] = scales
    tiles = padded.view(rb, 4, 32, cb, 4).permute(0, 3, 2, 1, 4)  # (tile row, tile col, r % 32, r // 32, col)
    return tiles.reshape(-1)


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b as a true division on every device (CUDA multiplies by a Python number's reciprocal)."""
    return a / torch.full((), b, dtype=torch.float32, device=a.device)


def _e2m1(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, 0..15), torchao's bit-level conversion (blockscale.cuh e2m1_code);
    NaN never reaches it."""
    bits = v.view(torch.int32)
    sign = (bits >> 28) & 0x8
    abits = bits & 0x7FFFFFFF
    a = abits.view(torch.float32)
    sub = (a + 4194304.0).view(torch.int32) - (149 << 23)
    normal = (abits - (126 << 23) + ((1 << 21) - 1) + ((abits >> 22) & 1)) >> 22
    code = torch.where(a >= _E2M1_MAX, 7, torch.where(a < 1.0, sub, normal)) & 0x7
    return (sign | code).to(torch.uint8)


def _ue8m0_ceil(d: torch.Tensor) -> torch.Tensor:
    """The e8m0 code of the smallest power of two >= d (d >= 0 or NaN), exactly (blockscale.cuh
    ue8m0_ceil): int32 codes 0..254, 0xFE for inf, 0xFF for NaN."""
    bits = d.view(torch.int32) & 0x7FFFFFFF
    e, m = bits >> 23, bits & 0x7FFFFF
    normal = torch.clamp(e + (m != 0).to(torch.int32), max=254)
    code = torch.where(e == 0, (m > 0x400000).to(torch.int32), normal)
    special = torch.where(m != 0, 0xFF, 0xFE).to(torch.int32)
    return torch.where(e == 0xFF, special, code)


def _pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 values (or NaN) rounded up to a power of two, exactly."""
    bits = s.view(torch.int32)
    up = ((bits >> 23) + 1) << 23
    return torch.where(torch.isnan(s) | ((bits & 0x7FFFFF) == 0), s, up.view(torch.float32))


def quantize_reference(
    x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None, swizzled: bool = False, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)`` of ``comm.quantize`` in torch (the module docstring's arithmetic)."""
    check_quantize_block_args(x, fmt, global_scale, swizzled, ue8m0)
    (q_shape, _), (s_shape, _) = output_specs(x, fmt, swizzled)
    k, block = x.shape[-1], BLOCKS[fmt]
    rows = x.numel() // k
    xb = x.contiguous().float().reshape(rows, k // block, block)
    amax = xb.abs().amax(dim=-1)  # NaN if any value is NaN
    if fmt == "nvfp4":
        s = _div(amax, _E2M1_MAX)
        if global_scale is not None:
            s = s / global_scale.float().reshape(())
        nan = torch.isnan(s)
        code = torch.clamp(s, _E4M3_SCALE_FLOOR, FP8_MAX).to(FP8)
        code = torch.where(nan, torch.full_like(code.view(torch.uint8), _E4M3_NAN_CODE), code.view(torch.uint8))
        s8 = code.view(FP8).float()
        one = torch.ones((), dtype=torch.float32, device=x.device)
        mul = (one / global_scale.float().reshape(())) / s8 if global_scale is not None else one / s8
        data = _e2m1(torch.where(nan.unsqueeze(-1), 0.0, xb * mul.unsqueeze(-1)))
        data = torch.where(nan.unsqueeze(-1), _E2M1_NAN_CODE, data).reshape(rows, k)
        q = (data[:, 0::2] | (data[:, 1::2] << 4)).reshape(q_shape)
        scales = code.view(FP8)
    elif fmt == "mxfp8":
        code = _ue8m0_ceil(_div(amax, FP8_MAX))
        mul = torch.where(
            code == 0xFE,
            2.0**-127,
            torch.where(code == 0, 1.0, ((254 - code.clamp(max=253)) << 23).view(torch.float32)),
        )
        nan = code == 0xFF
        data = (xb * mul.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        data = torch.where(nan.unsqueeze(-1), _E4M3_NAN_CODE, data)
        q = data.reshape(q_shape).view(FP8)
        scales = code.to(torch.uint8).view(E8M0)
    else:
        s = fp8_scale_inv(amax)
        if ue8m0:
            s = _pow2_ceil(s)
        s = torch.where(torch.isnan(s), _CANONICAL_NAN.to(s.device), s)
        ratio = xb / s.unsqueeze(-1)
        codes = ratio.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
        # any NaN (a NaN group, or inf / inf in a group holding an inf) is the canonical 0x7F, as the
        # kernels' cvt.rn.satfinite gives it; torch keeps the NaN's sign, which differs by platform
        q = torch.where(torch.isnan(ratio), _E4M3_NAN_CODE, codes).view(FP8).reshape(q_shape)
        scales = s
    if swizzled:
        scales = to_blocked(scales.view(torch.uint8)).view(scales.dtype)
    return q, scales.reshape(s_shape)

"""comm.quantize's torch reference (ubnext/reference/_blockscale.py), the arithmetic its kernels share
(csrc/device/blockscale.cuh; the emulator tier checks them against it bitwise, worker case
quantize_blocks), against the references users trust: torchao 0.18's nvfp4_quantize, to_blocked and
to_mx(..., RCEIL), and ubnext's quantize_fp8_reference for groups of 128. Bitwise, at M of 1, 7, 129
and 200 and K of 1024 to 8192, with NaN, inf and zero blocks. torchao is a test extra
(pyproject.toml)."""

from __future__ import annotations

import math

import pytest
import torch

from ubnext.reference._blockscale import (
    E8M0,
    check_quantize_block_args,
    output_specs,
    quantize_reference,
    swizzled_count,
    to_blocked,
)
from ubnext.reference._checks import FP8, FP8_MAX, quantize_fp8_reference

nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
mx_utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

SHAPES = ((1, 8192), (7, 1024), (129, 1040), (200, 2048))  # K 1040: 65 NVFP4 scales, padding columns


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _input(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of differing magnitudes (scales from 2^-12 to 2^12), a zero block, a NaN and an inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-12, 12, (m, 1), generator=g).float())
    x[0, :128] = 0.0
    if m > 1:
        x[1, 37] = float("nan")
        x[m - 1, 200] = float("-inf")
    return x.to(dtype)


def _torchao_input(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype == torch.float16 else x  # torchao takes bf16 and fp32; fp16 -> fp32 is exact


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_is_torchaos(dtype):
    for i, (m, k) in enumerate(SHAPES):
        x = _input(m, k, dtype, i)
        amax = x.float().abs().nan_to_num(0.0, 0.0, 0.0).amax()
        for gs in (None, nvfp4_tensor.per_tensor_amax_to_scale(amax).reshape(1)):
            want_s, want_q = nvfp4_tensor.nvfp4_quantize(_torchao_input(x), 16, gs)
            q, s = quantize_reference(x, "nvfp4", gs)
            assert q.dtype == torch.uint8 and q.shape == (m, k // 2) and s.dtype == FP8 and s.shape == (m, k // 16)
            assert torch.equal(q, want_q), (m, k, gs)
            assert torch.equal(_bits(s), _bits(want_s)), (m, k, gs)
            _, swizzled = quantize_reference(x, "nvfp4", gs, swizzled=True)
            assert torch.equal(_bits(swizzled), mx_utils.to_blocked(_bits(want_s))), (m, k, gs)
    # the special blocks, spelled out: NaN -> scale 0x7F and nibbles 0x4; zero -> the scale floor 2^-6
    q, s = quantize_reference(_input(7, 1024, dtype, 0), "nvfp4")
    assert _bits(s)[1, 2] == 0x7F and bool((q[1, 16:24] == 0x44).all())
    assert _bits(s)[0, 0] == 0x08 and bool((q[0, :8] == 0).all())


def test_to_blocked_layout_and_padding():
    for rows, cols in ((1, 4), (7, 65), (129, 64), (200, 33), (256, 8)):
        scales = torch.randint(1, 255, (rows, cols), dtype=torch.uint8)
        got = to_blocked(scales)
        assert got.shape == (swizzled_count(rows, cols),)
        assert torch.equal(got, mx_utils.to_blocked(scales)), (rows, cols)
        # every real scale once, zeros for the padding
        assert int((got != 0).sum()) == rows * cols


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mxfp8_is_torchaos_rceil(dtype):
    for i, (m, k) in enumerate(SHAPES):
        if k % 32:
            continue
        x = _input(m, k, dtype, 10 + i)
        want_s, want_q = mx_tensor.to_mx(_torchao_input(x), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        q, s = quantize_reference(x, "mxfp8")
        assert q.dtype == FP8 and s.dtype == E8M0 and s.shape == (m, k // 32)
        assert torch.equal(_bits(q), _bits(want_q)), (m, k)
        assert torch.equal(_bits(s), _bits(want_s)), (m, k)
        _, swizzled = quantize_reference(x, "mxfp8", swizzled=True)
        assert torch.equal(_bits(swizzled), mx_utils.to_blocked(_bits(want_s))), (m, k)
    q, s = quantize_reference(_input(7, 1024, dtype, 0), "mxfp8")
    assert _bits(s)[1, 1] == 0xFF and bool((_bits(q)[1, 32:64] == 0x7F).all())  # a NaN block
    assert _bits(s)[6, 6] == 0xFE  # an inf block
    assert _bits(s)[0, 0] == 0 and bool((_bits(q)[0, :32] == 0).all())  # a zero block


def _exact_ue8m0(d: float) -> int:
    """The e8m0 code of the smallest power of two >= d > 0, from exact integer arithmetic."""
    mant, exp = math.frexp(d)  # d = mant * 2^exp, 0.5 <= mant < 1, exact for an fp32 d
    k = exp - 1 if mant == 0.5 else exp
    return min(max(k, -127), 127) + 127


def test_mxfp8_exponent_is_exact_for_fp32_just_above_powers_of_two():
    """torchao's eager RCEIL takes ceil(log2(d)) in floating point, which can land a step low for an
    fp32 descale one ulp above a power of two (platform-dependent); ubnext's is exact, as
    cvt.rp.satfinite.ue8m0 is. Blocks whose amax / 448 is 2^e, 2^e + 1 ulp and 2^e - 1 ulp."""
    descales = []
    for e in range(-126, 120, 7):
        p = torch.tensor(2.0**e, dtype=torch.float32)
        descales += [p, torch.nextafter(p, torch.tensor(math.inf)), torch.nextafter(p, torch.tensor(0.0))]
    d = torch.stack(descales)
    amax = d * FP8_MAX  # exact for these (448 = 7 * 2^6) unless it overflows, which e < 120 avoids
    assert torch.equal(amax / FP8_MAX, d)
    x = torch.zeros(len(descales), 32)
    x[:, 5] = -amax
    _, s = quantize_reference(x, "mxfp8")
    want = torch.tensor([_exact_ue8m0(float(v)) for v in d], dtype=torch.uint8)
    assert torch.equal(_bits(s).flatten(), want)
    assert _exact_ue8m0(2.0**-127) == 0 and _exact_ue8m0(1.5 * 2.0**-127) == 1  # the subnormal edge


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_group128_is_the_per_token_rule_over_groups(dtype):
    for i, (m, k) in enumerate(SHAPES):
        if k % 128:
            continue
        x = _input(m, k, dtype, 20 + i)
        x[x.isinf()] = 3.0  # an inf group: below
        q, s = quantize_reference(x, "fp8_group128")
        q_want, s_want = quantize_fp8_reference(x, 128, None)
        assert q.shape == x.shape and s.shape == (m, k // 128) and s.dtype == torch.float32
        # quantize_fp8_reference writes torch's NaN, whose sign (0x7F or 0xFF) depends on the CPU's
        # NaN / NaN; ubnext's codes are the canonical 0x7F, as the GPU's conversion writes every NaN
        want = _bits(q_want).clone()
        want[want == 0xFF] = 0x7F
        assert torch.equal(_bits(q), want), (m, k)
        finite = ~s_want.isnan()
        assert torch.equal(s.flatten()[finite], s_want[finite]) and bool(s.flatten()[~finite].isnan().all())
    # a group holding an inf: its scale is inf and inf / inf = NaN, written as the canonical 0x7F
    x = torch.ones(1, 128, dtype=dtype)
    x[0, 9] = float("inf")
    q, s = quantize_reference(x, "fp8_group128")
    assert math.isinf(s.item()) and _bits(q)[0, 9] == 0x7F and bool((_bits(q)[0, :9] == 0).all())
    # a NaN group's scale is the canonical NaN, whatever the input's NaN payload
    x[0, 9] = float("nan")
    _, s = quantize_reference(x, "fp8_group128")
    assert s.view(torch.int32).item() == 0x7FFFFFFF


def test_nvfp4_nan_global_scale_is_a_nan_in_every_block():
    """Issue 40 C13 (docs/QUANTIZE.md, "A NaN global_scale is outside the bitwise claim"): every
    scale 0x7F and every data byte 0x44, the kernels' constants, whatever the NaN's sign or payload.
    torchao's bytes follow the NaN's bits (0x33 for the default NaN on x86, 0xBB for a negative one),
    so they are not compared here."""
    x = _input(3, 256, torch.bfloat16, 5)
    x[x.isnan() | x.isinf()] = 1.0
    every_scale = torch.full((3, 256 // 16), 0x7F, dtype=torch.uint8)
    for bits in (0x7FC00000, 0xFFC00000 - (1 << 32), 0x7F800001):
        gs = torch.tensor([bits], dtype=torch.int32).view(torch.float32)
        for swizzled in (False, True):
            q, s = quantize_reference(x, "nvfp4", gs, swizzled=swizzled)
            assert bool((q == 0x44).all()), hex(bits)
            assert torch.equal(_bits(s), to_blocked(every_scale) if swizzled else every_scale), hex(bits)


def test_fp8_group128_ue8m0_rounds_scales_up_to_powers_of_two():
    x = _input(7, 1024, torch.bfloat16, 3)
    x[x.isinf()] = 1.0
    _, plain = quantize_reference(x, "fp8_group128")
    q, s = quantize_reference(x, "fp8_group128", ue8m0=True)
    finite = ~plain.isnan()
    mant, _ = torch.frexp(s[finite])
    assert bool((mant == 0.5).all()) and bool((s[finite] >= plain[finite]).all())
    assert bool((s[finite] < 2 * plain[finite]).all())
    # the data with those scales, independently: e4m3(clamp(x / scale)), NaN groups canonical
    rows = x.float().reshape(7, 8, 128)
    want = (rows / s.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    want[rows.isnan().any(-1)] = 0x7F
    assert torch.equal(_bits(q), want.reshape(7, 1024))


def test_refusals_name_what_is_wrong():
    x = torch.zeros(4, 1000, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"K = 1000 .* not a multiple of the nvfp4 block of 16"):
        check_quantize_block_args(x, "nvfp4", None, False, False)
    with pytest.raises(ValueError, match=r"K = 1000 .* fp8_group128 block of 128"):
        check_quantize_block_args(x, "fp8_group128", None, False, False)
    y = torch.zeros(4, 1024, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16, float16 and float32"):
        check_quantize_block_args(y.double(), "mxfp8", None, False, False)
    with pytest.raises(TypeError, match="bfloat16, float16 and float32"):
        check_quantize_block_args(y.to(torch.int32), "mxfp8", None, False, False)
    with pytest.raises(ValueError, match="fmt must be one of"):
        check_quantize_block_args(y, "nvfp8", None, False, False)
    with pytest.raises(ValueError, match="global_scale"):
        check_quantize_block_args(y, "mxfp8", torch.ones(1), False, False)
    with pytest.raises(ValueError, match="global_scale must be a one-element float32"):
        check_quantize_block_args(y, "nvfp4", torch.ones(2), False, False)
    with pytest.raises(ValueError, match="swizzled"):
        check_quantize_block_args(y, "fp8_group128", None, True, False)
    with pytest.raises(ValueError, match="ue8m0"):
        check_quantize_block_args(y, "nvfp4", None, False, True)


def test_the_operators_fake_gives_the_shapes():
    """torch.ops.ubnext.quantize on meta tensors (the fake implementation, as torch.compile traces it):
    the output shapes and dtypes of output_specs, and the same refusals."""
    import ubnext.ops  # noqa: F401 - defines the operators

    x = torch.empty(3, 5, 1040, dtype=torch.bfloat16, device="meta")
    q, s = torch.ops.ubnext.quantize(x, "nvfp4", None, True, False, "unused")
    assert (q.shape, q.dtype, s.shape, s.dtype) == ((3, 5, 520), torch.uint8, (swizzled_count(15, 65),), FP8)
    y = torch.empty(3, 5, 1024, dtype=torch.float16, device="meta")
    q, s = torch.ops.ubnext.quantize(y, "mxfp8", None, False, False, "unused")
    assert (q.shape, q.dtype, s.shape, s.dtype) == ((3, 5, 1024), FP8, (3, 5, 32), E8M0)
    q, s = torch.ops.ubnext.quantize(y, "fp8_group128", None, False, True, "unused")
    assert (q.shape, s.shape, s.dtype) == ((3, 5, 1024), (3, 5, 8), torch.float32)
    assert output_specs(x, "nvfp4", False)[1] == ((3, 5, 65), FP8)
    with pytest.raises(ValueError, match="K = 1040"):
        torch.ops.ubnext.quantize(x, "mxfp8", None, False, False, "unused")


def test_the_fused_quant_operators_fake_gives_the_shapes_and_refusals():
    """torch.ops.ubnext.all_reduce_add_rmsnorm_quant on meta tensors (its fake, as torch.compile traces
    it): q and scales shaped as quantize's, residual_out as the residual; and the entry point's
    refusals: quant with out_dtype or scale, quant's options without quant, K not a multiple of the block."""
    from ubnext import ops

    x = torch.empty(7, 1040, dtype=torch.bfloat16, device="meta")
    w = torch.empty(1040, dtype=torch.bfloat16, device="meta")
    q, r, s = torch.ops.ubnext.all_reduce_add_rmsnorm_quant(x, x, w, 1e-6, "nvfp4", None, True, False, "unused")
    assert (q.shape, q.dtype, r.shape, r.dtype) == ((7, 520), torch.uint8, (7, 1040), torch.bfloat16)
    assert (s.shape, s.dtype) == ((swizzled_count(7, 65),), FP8)
    with pytest.raises(ValueError, match=r"K = 1040 .* mxfp8 block of 32"):
        ops.all_reduce_add_rmsnorm(x, x, w, 1e-6, "unused", quant="mxfp8")
    with pytest.raises(ValueError, match="excludes out_dtype and scale"):
        ops.all_reduce_add_rmsnorm(x, x, w, 1e-6, "unused", quant="nvfp4", out_dtype=FP8)
    with pytest.raises(ValueError, match="excludes out_dtype and scale"):
        ops.all_reduce_add_rmsnorm(x, x, w, 1e-6, "unused", quant="nvfp4", scale=torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match="pass quant="):
        ops.all_reduce_add_rmsnorm(x, x, w, 1e-6, "unused", swizzled=True)
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.all_reduce_add_rmsnorm(x, x, w[:1024], 1e-6, "unused", quant="nvfp4")
    with pytest.raises(RuntimeError, match="not differentiable"):
        ops.all_reduce_add_rmsnorm(x.float().requires_grad_(), x.float(), w.float(), 1e-6, "unused", quant="nvfp4")

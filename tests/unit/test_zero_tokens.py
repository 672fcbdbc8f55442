"""One rule for zero tokens (issue 40 C7): every op takes an input of zero rows and returns empty outputs of
the shapes its torch reference gives (the block formats' padded scales included), with no launch. The
quantizers and the fused op's ``quant=`` form refused ``(0, K)`` while the other ops took it. A one-rank
emulated communicator with the kernel paths on (``UBNEXT_WORLD1_KERNELS``), so that a zero-row call
reaches the kernel paths' code and not the one-rank copy; and the operators' fake implementations,
which torch.compile traces, on meta tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ubnext.comm import Communicator
from ubnext.reference._blockscale import quantize_reference
from ubnext.reference._checks import FP8, quantize_fp8_reference, reference_add_rmsnorm

K = 1024


@pytest.fixture(scope="module")
def comm():
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("UBNEXT_WORLD1_KERNELS", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    comm = Communicator(emulate=True, max_hidden=K)
    yield comm
    comm.close()
    dist.destroy_process_group()
    monkeypatch.undo()


def _shapes(outputs) -> list:
    return [
        None if t is None else (tuple(t.shape), t.dtype)
        for t in (outputs if isinstance(outputs, tuple) else (outputs,))
    ]


def _empty(dtype=torch.bfloat16) -> torch.Tensor:
    return torch.zeros(0, K, dtype=dtype)


@pytest.mark.parametrize(
    "fmt,swizzled", [("nvfp4", False), ("nvfp4", True), ("mxfp8", False), ("mxfp8", True), ("fp8_group128", False)]
)
def test_quantize_takes_zero_tokens(comm, fmt, swizzled):
    x = _empty()
    assert _shapes(comm.quantize(x, fmt, swizzled=swizzled)) == _shapes(quantize_reference(x, fmt, None, swizzled))


@pytest.mark.parametrize("scaling", ["row", "tensor", "static"])
def test_quantize_fp8_takes_zero_tokens(comm, scaling):
    """An empty q, and no scale (an empty tensor has no amax), or the static scale itself."""
    x, scale = _empty(), torch.tensor([0.5]) if scaling == "static" else None
    got = comm.quantize_fp8(x, scaling=scaling, scale=scale)
    assert _shapes(got) == _shapes(quantize_fp8_reference(x, K, scale))
    assert got[1].numel() == (1 if scaling == "static" else 0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "fp8_group128"])
def test_the_fused_quant_form_takes_zero_tokens(comm, fmt):
    x, residual, weight = _empty(), _empty(), torch.ones(K, dtype=torch.bfloat16)
    y, residual_out, _ = reference_add_rmsnorm(x.float(), residual, weight, 1e-6, torch.bfloat16, None)
    want = (*quantize_reference(y, fmt)[:1], residual_out, quantize_reference(y, fmt)[1])
    assert _shapes(comm.all_reduce_add_rmsnorm(x, residual, weight, quant=fmt)) == _shapes(want)


def test_the_other_ops_still_take_zero_tokens(comm):
    x, residual, weight = _empty(), _empty(), torch.ones(K, dtype=torch.bfloat16)
    assert _shapes(comm.all_reduce(x)) == _shapes(x)
    assert _shapes(comm.all_reduce_add_rmsnorm(x, residual, weight))[:2] == _shapes((x, x))
    got = comm.all_reduce_add_rmsnorm(x, residual, weight, out_dtype=FP8)
    assert _shapes(got) == [((0, K), FP8), ((0, K), torch.bfloat16), ((0,), torch.float32)]
    assert _shapes(comm.all_gather(x)) == _shapes(x) and _shapes(comm.reduce_scatter(x)) == _shapes(x)


def test_the_fake_implementations_take_zero_tokens(comm):
    """What torch.compile traces: the operators on meta tensors give the eager call's shapes."""
    x = torch.zeros(0, K, dtype=torch.bfloat16, device="meta")
    q, scales = torch.ops.ubnext.quantize(x, "nvfp4", None, True, False, comm.key)
    assert (tuple(q.shape), tuple(scales.shape)) == ((0, K // 2), (0,))
    q, scale_inv = torch.ops.ubnext.quantize_fp8(x, K, None, comm.key)
    assert (tuple(q.shape), tuple(scale_inv.shape)) == ((0, K), (0,))

"""The error bounds in ubnext/testing.py are tight enough to catch a wrong result: a correct
fp32 rank-order sum passes, a result off by a few units in the last place fails."""

import pytest
import torch

from ubnext import testing as T


def _fp32_sum(inputs):
    acc = torch.zeros_like(inputs[0], dtype=torch.float32)
    for x in inputs:
        acc += x.float()
    return acc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nranks", [2, 4, 8])
def test_allreduce_bound_accepts_fp32_rank_order_sum(dtype, nranks):
    inputs = [T.rank_input(r, 4096, dtype, seed=7) for r in range(nranks)]
    err = (_fp32_sum(inputs).to(dtype).double() - T.reference_sum(inputs)).abs()
    assert (err <= T.allreduce_bound(inputs, dtype)).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_allreduce_bound_rejects_a_missing_rank(dtype):
    inputs = [T.rank_input(r, 4096, dtype, seed=7) for r in range(4)]
    err = (_fp32_sum(inputs[:3]).to(dtype).double() - T.reference_sum(inputs)).abs()
    assert (err > T.allreduce_bound(inputs, dtype)).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_allreduce_bound_rejects_accumulating_in_16_bits(dtype):
    """The pitfall DESIGN.md names (bf16 accumulation cost accuracy) is caught."""
    inputs = [T.rank_input(r, 4096, dtype, seed=7) for r in range(8)]
    acc = torch.zeros(4096, dtype=dtype)
    for x in inputs:
        acc = (acc.float() + x.float()).to(dtype)
    err = (acc.double() - T.reference_sum(inputs)).abs()
    assert (err > T.allreduce_bound(inputs, dtype)).any()


def test_rmsnorm_bound_rejects_wrong_normalisation():
    r = T.rank_input(0, 4 * 256, torch.bfloat16, seed=3).view(4, 256)
    w = torch.ones(256, dtype=torch.bfloat16)
    y = T.rmsnorm_reference(r, w, 1e-6)
    out = y.to(torch.bfloat16)
    assert ((out.double() - y).abs() <= T.rmsnorm_bound(y, torch.bfloat16, 256)).all()
    wrong = T.rmsnorm_reference(r, w, 1e-1).to(torch.bfloat16)  # eps off: a different norm
    assert ((wrong.double() - y).abs() > T.rmsnorm_bound(y, torch.bfloat16, 256)).any()


def test_fp8_check_rejects_a_wrong_scale():
    y = T.rank_input(0, 2 * 128, torch.float64, seed=5).view(2, 128)
    si = (y.abs().amax(-1) / 448).float()
    q = (y / si.double().unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    T.check_fp8(q, si, y, 128, per_token=True, dtype=torch.float32)
    with pytest.raises(AssertionError):
        T.check_fp8(q, si * 2, y, 128, per_token=True, dtype=torch.float32)

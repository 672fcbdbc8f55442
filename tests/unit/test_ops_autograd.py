"""The fused op's closed-form RMSNorm backward against autograd in float64; and the Python
entry points attach autograd only when a gradient is wanted."""

import torch

from ubnext import ops
from ubnext.comm import rmsnorm


def test_rmsnorm_backward_matches_autograd():
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(5, 3, 64, dtype=torch.float64, generator=gen).requires_grad_()
    w = (torch.rand(64, dtype=torch.float64, generator=gen) + 0.5).requires_grad_()
    g = torch.randn(5, 3, 64, dtype=torch.float64, generator=gen)
    want_r, want_w = torch.autograd.grad(rmsnorm(r, w, 1e-6), (r, w), g)
    got_r, got_w = ops.rmsnorm_backward(r.detach(), w.detach(), 1e-6, g)
    # float64 throughout: the two formulas agree to rounding (a few ulp of values of order 10)
    assert torch.allclose(got_r, want_r, rtol=0, atol=1e-12)
    assert torch.allclose(got_w, want_w, rtol=0, atol=1e-12)


def test_requires_grad():
    """The entry points ask it of each argument when grad mode is on; what is not a tensor does
    not (the operator's checks then name it: worker case bad_input)."""
    assert not ops._requires_grad(None) and not ops._requires_grad(torch.ones(3))
    assert ops._requires_grad(torch.ones(3, requires_grad=True))

"""The fused op's closed-form RMSNorm backward against autograd in float64; and the Python
entry points attach autograd only when a gradient is wanted."""

import torch

from ubnext import ops
from ubnext._checks import rmsnorm


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


def _recorders(monkeypatch):
    """Stand-ins for every operator and autograd Function the entry points may call; each records
    its name, so a test sees which route a call took without a communicator."""
    seen = []

    def recorder(name, result):
        def call(*args):
            seen.append(name)
            return result(*args)
        return call

    pair = lambda *args: (args[0], args[0])  # noqa: E731 - (out, residual_out)
    triple = lambda *args: (args[0], args[0], args[0])  # noqa: E731 - (out, residual_out, scale_inv)
    for name, result in (("_ALL_REDUCE", lambda *a: a[0]), ("_LINEAR_ALL_REDUCE", lambda *a: a[0]),
                         ("_FUSED", pair)):
        monkeypatch.setattr(ops, name, (recorder(name + " packet", result), recorder(name + " direct", result)))
    for name, result in (("_AllReduceGrad", lambda *a: a[0]), ("_LinearAllReduceGrad", lambda *a: a[0]),
                         ("_FusedGrad", triple)):
        monkeypatch.setattr(getattr(ops, name), "apply", recorder(name, result))
    return seen


def test_entry_points_take_autograd_only_when_a_gradient_is_wanted(monkeypatch):
    """The autograd Functions run only in grad mode with an input that requires grad; otherwise the
    operator is called directly (no Python autograd kernel on the hot path)."""
    seen = _recorders(monkeypatch)
    x, w = torch.ones(4, 8), torch.ones(8)
    xg = torch.ones(4, 8, requires_grad=True)

    def calls(a, weight):
        ops.all_reduce(a, "k")
        ops.linear_all_reduce(a, torch.ones(8, 8), "k")
        ops.all_reduce_add_rmsnorm(a, x, weight, 1e-6, "k")

    calls(x, w)
    assert seen == ["_ALL_REDUCE direct", "_LINEAR_ALL_REDUCE direct", "_FUSED direct"]
    seen.clear()
    calls(xg, w)
    assert seen == ["_AllReduceGrad", "_LinearAllReduceGrad", "_FusedGrad"]
    seen.clear()
    ops.all_reduce_add_rmsnorm(x, x, w.requires_grad_(), 1e-6, "k")  # the norm weight alone
    assert seen == ["_FusedGrad"]
    for mode in (torch.no_grad, torch.inference_mode):
        seen.clear()
        with mode():
            calls(xg, w)
        assert seen == ["_ALL_REDUCE direct", "_LINEAR_ALL_REDUCE direct", "_FUSED direct"], mode


def test_entry_points_call_the_packet_while_compiling(monkeypatch):
    """Dynamo cannot trace the dispatcher's bare callable: under torch.compile the entry points call
    the OpOverloadPacket, in eager mode the callable behind it."""
    seen = _recorders(monkeypatch)
    x = torch.ones(4, 8)
    monkeypatch.setattr(ops, "_is_compiling", lambda: True)
    ops.all_reduce(x, "k")
    ops.linear_all_reduce(x, torch.ones(8, 8), "k")
    ops.all_reduce_add_rmsnorm(x, x, torch.ones(8), 1e-6, "k")
    assert seen == ["_ALL_REDUCE packet", "_LINEAR_ALL_REDUCE packet", "_FUSED packet"]


def test_the_direct_callable_is_the_packets_own():
    """What the entry points call in eager mode is what torch.ops.ubnext.<op>(...) forwards to."""
    for name in ("all_reduce", "all_reduce_out", "linear_all_reduce", "all_reduce_add_rmsnorm",
                 "all_reduce_add_rmsnorm_fp8"):
        packet, direct = getattr(ops, {"all_reduce": "_ALL_REDUCE", "all_reduce_out": "_ALL_REDUCE_OUT",
                                       "linear_all_reduce": "_LINEAR_ALL_REDUCE", "all_reduce_add_rmsnorm": "_FUSED",
                                       "all_reduce_add_rmsnorm_fp8": "_FUSED_FP8"}[name])
        assert packet is getattr(torch.ops.ubnext, name) and direct is packet._op

"""The fused op's closed-form RMSNorm backward against autograd in float64; the Python entry
points attach autograd only when a gradient is wanted; and those whose output has no gradient
refuse an input that requires one. (The gradients of the collectives themselves need peers: the
worker's case exchange_grad, at 2, 3 and 4 ranks.)"""

import pytest
import torch

from tests.unit.test_misuse import _bare_communicator
from ubnext import ops
from ubnext.reference._checks import rmsnorm


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
    for name, result in (
        ("_ALL_REDUCE", lambda *a: a[0]),
        ("_LINEAR_ALL_REDUCE", lambda *a: a[0]),
        ("_FUSED", pair),
        ("_ALL_GATHER", lambda *a: a[0]),
        ("_REDUCE_SCATTER", lambda *a: a[0]),
    ):
        monkeypatch.setattr(ops, name, (recorder(name + " packet", result), recorder(name + " direct", result)))
    # what a plain eager call runs without the dispatcher (ops._plain): the operator's implementation
    for name, result in (
        ("_all_reduce_impl", lambda *a: a[0]),
        ("_linear_all_reduce_impl", lambda *a: a[0]),
        ("_fused_impl", pair),
    ):
        monkeypatch.setattr(ops, name, recorder(name, result))
    for name, result in (
        ("_AllReduceGrad", lambda *a: a[0]),
        ("_LinearAllReduceGrad", lambda *a: a[0]),
        ("_FusedGrad", triple),
        ("_AllGatherGrad", lambda *a: a[0]),
        ("_ReduceScatterGrad", lambda *a: a[0]),
    ):
        monkeypatch.setattr(getattr(ops, name), "apply", recorder(name, result))
    return seen


def test_entry_points_take_autograd_only_when_a_gradient_is_wanted(monkeypatch):
    """The autograd Functions run only in grad mode with an input that requires grad; otherwise the
    operator is called directly (no Python autograd kernel on the hot path), and its implementation
    without the dispatcher where the dispatcher would add nothing (tests/unit/test_eager_direct.py)."""
    seen = _recorders(monkeypatch)
    x, w = torch.ones(4, 8), torch.ones(8)
    xg = torch.ones(4, 8, requires_grad=True)

    def calls(a, weight):
        ops.all_reduce(a, "k")
        ops.linear_all_reduce(a, torch.ones(8, 8), "k")
        ops.all_reduce_add_rmsnorm(a, x, weight, 1e-6, "k")
        ops.all_gather(a, "k")
        ops.reduce_scatter(a, 0.5, "k")

    direct = [
        "_all_reduce_impl",
        "_linear_all_reduce_impl",
        "_fused_impl",
        "_ALL_GATHER direct",
        "_REDUCE_SCATTER direct",
    ]
    calls(x, w)
    assert seen == direct
    seen.clear()
    calls(xg, w)
    assert seen == ["_AllReduceGrad", "_LinearAllReduceGrad", "_FusedGrad", "_AllGatherGrad", "_ReduceScatterGrad"]
    seen.clear()
    ops.all_reduce_add_rmsnorm(x, x, w.requires_grad_(), 1e-6, "k")  # the norm weight alone
    assert seen == ["_FusedGrad"]
    for mode in (torch.no_grad, torch.inference_mode):
        seen.clear()
        with mode():
            calls(xg, w)
        assert seen == direct, mode


def test_entry_points_call_the_packet_while_compiling(monkeypatch):
    """Dynamo cannot trace the dispatcher's bare callable: under torch.compile the entry points call
    the OpOverloadPacket, in eager mode the callable behind it."""
    seen = _recorders(monkeypatch)
    x = torch.ones(4, 8)
    monkeypatch.setattr(ops, "_is_compiling", lambda: True)
    ops.all_reduce(x, "k")
    ops.linear_all_reduce(x, torch.ones(8, 8), "k")
    ops.all_reduce_add_rmsnorm(x, x, torch.ones(8), 1e-6, "k")
    ops.all_gather(x, "k")
    ops.reduce_scatter(x, 1.0, "k")
    assert seen == [
        "_ALL_REDUCE packet",
        "_LINEAR_ALL_REDUCE packet",
        "_FUSED packet",
        "_ALL_GATHER packet",
        "_REDUCE_SCATTER packet",
    ]


def test_the_direct_callable_is_the_packets_own():
    """What the entry points call in eager mode is what torch.ops.ubnext.<op>(...) forwards to."""
    for name, attribute in (
        ("all_reduce", "_ALL_REDUCE"),
        ("all_reduce_out", "_ALL_REDUCE_OUT"),
        ("linear_all_reduce", "_LINEAR_ALL_REDUCE"),
        ("all_reduce_add_rmsnorm", "_FUSED"),
        ("all_reduce_add_rmsnorm_fp8", "_FUSED_FP8"),
        ("all_gather", "_ALL_GATHER"),
        ("all_gather_out", "_ALL_GATHER_OUT"),
        ("reduce_scatter", "_REDUCE_SCATTER"),
        ("reduce_scatter_out", "_REDUCE_SCATTER_OUT"),
        ("quantize_fp8", "_QUANTIZE_FP8"),
        ("quantize", "_QUANTIZE"),
    ):
        packet, direct = getattr(ops, attribute)
        assert packet is getattr(torch.ops.ubnext, name) and direct is packet._op


# communicator methods whose output has no gradient: the quantisers (issue 40 W2, C14) and the out= forms
NOT_DIFFERENTIABLE = {
    "quantize_fp8": (lambda c, x: c.quantize_fp8(x), "comm.quantize_fp8's e4m3 output", "on x.detach()"),
    "quantize nvfp4": (
        lambda c, x: c.quantize(x, "nvfp4", swizzled=True),
        "comm.quantize's nvfp4 output",
        "on x.detach()",
    ),
    "all_gather out": (
        lambda c, x: c.all_gather(x, out=torch.empty(8, 64, device="meta")),
        "all_gather(..., out=...)",
        "without out= to get a gradient",
    ),
    "reduce_scatter out": (
        lambda c, x: c.reduce_scatter(x, out=torch.empty(2, 64, device="meta")),
        "reduce_scatter(..., out=...)",
        "without out= to get a gradient",
    ),
}


@pytest.mark.parametrize("what", sorted(NOT_DIFFERENTIABLE))
def test_an_input_that_requires_grad_is_refused_where_no_gradient_exists(what):
    """Refused in grad mode, with the error the fused op's quant= form gives (ops.not_differentiable),
    rather than outputs marked requires_grad whose backward leaves x.grad None (torch only warns that
    no autograd kernel was registered). Under no_grad, or detached, the call goes through (meta
    tensors: the fake implementation answers, and the refusal needs no communicator)."""
    call, what_it_is, instead = NOT_DIFFERENTIABLE[what]
    comm = _bare_communicator()
    x = torch.empty(4, 64, device="meta", requires_grad=True)
    with pytest.raises(RuntimeError) as refused:
        call(comm, x)
    assert str(refused.value) == str(ops.not_differentiable(what_it_is, instead))
    assert str(refused.value).startswith(f"{what_it_is} is not differentiable; call it under torch.no_grad() or")
    if what.startswith("quantize"):  # the out= forms' fakes look the communicator up
        with torch.no_grad():
            outputs = call(comm, x)
        assert not any(t.requires_grad for t in outputs)
        call(comm, x.detach())


def test_the_fused_quant_form_refuses_with_the_same_error():
    """One message for every refusal (ops.not_differentiable): the fused op's quant= form's."""
    x = torch.empty(4, 64, device="meta", requires_grad=True)
    with pytest.raises(RuntimeError) as refused:
        ops.all_reduce_add_rmsnorm(x, x.detach(), torch.ones(64, device="meta"), 1e-6, "k", quant="nvfp4")
    assert str(refused.value) == str(
        ops.not_differentiable("the quantised (nvfp4) output of ubnext's fused norm", "without quant=")
    )

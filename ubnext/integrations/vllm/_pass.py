"""The post-grad pass for vLLM's graphs: vLLM's tensor-parallel all-reduce followed by vLLM's RMSNorm
becomes one ``torch.ops.ubnext_vllm.all_reduce_add_rmsnorm`` call (ubnext/integrations/vllm/_ops.py).

What it matches (the graph vLLM 0.32/0.33 compiles once the plugin is on, docs/VLLM.md):

- the all-reduce: ``vllm::all_reduce(Tensor tensor, str group_name)``, which vLLM's
  ``GroupCoordinator.all_reduce`` writes when ``use_custom_op_collectives()`` is true (CUDA; on CPU the
  plugin makes it true). Its group name (``tp:0``) goes into the rewritten call unchanged. A
  ``_c10d_functional.all_reduce`` names torch's group, not vLLM's: it is left alone and counted.
- the norm after it, as vLLM's IR writes it when ``ir_enable_torch_wrap`` is on (vLLM's default
  under ``VLLM_COMPILE``; the plugin turns it on for the CPU platform's ``DYNAMO_TRACE_ONCE``):
  ``vllm_ir::fused_add_rms_norm`` (its ``maybe_inplace`` overload inside ``auto_functionalized``, or the
  functional default) with the all-reduce as ``x``, or ``vllm_ir::rms_norm`` of the all-reduce (the
  embedding's all-reduce before the first layer's norm: the fused op runs with a zero residual, and
  its residual sum, the all-reduce rounded once, replaces the all-reduce's other uses).

What it refuses, counted with the reason (``fusion_counts()["refused"]``): an all-reduce read by
something else too (a fused add norm needs it alone), a ``variance_size`` (a norm over part of the
row), a weight of another dtype than the activations, a dtype other than bf16/fp16/fp32, a mutated
input read after the norm. Any eps, world size and size go to ubnext: the fused op's own planner
decides the path at run time, and takes torch.distributed where no kernel path fits. A static FP8
or NVFP4 quantisation after the norm stays vLLM's (counted as ``quant after norm left in vLLM``).

The pass's uuid is the hash of this file, of ``_ops.py`` and of ``ubnext/ops/__init__.py``, so a
compiled graph cached by Inductor or vLLM is keyed apart from one rewritten by another version.
Nothing here imports vLLM: the unit tests run it on a stored vLLM graph with stand-in operators."""

from __future__ import annotations

import collections
import hashlib
import operator
import os
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ... import ops as ubnext_ops
from . import _ops

__all__ = ["UbnextVllmPass", "rewrite", "describe_graph", "recorded_graphs", "pass_uuid"]

ALL_REDUCE = "vllm::all_reduce.default"
C10D_ALL_REDUCE = "_c10d_functional::all_reduce.default"
RMS_NORM = "vllm_ir::rms_norm.default"
ADD_RMS_NORM = "vllm_ir::fused_add_rms_norm.default"
ADD_RMS_NORM_INPLACE = "vllm_ir::fused_add_rms_norm.maybe_inplace"
FLASHINFER_EPS = (1e-5, 1e-6)  # what vLLM's AllReduceFusionPass matches (CUDA, through FlashInfer)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_AUTO_FUNCTIONALIZED = torch.ops.higher_order.auto_functionalized

# the last graphs the pass saw, before its rewrite (describe_graph's form), for the client tier
_recorded: collections.deque[list[dict[str, Any]]] = collections.deque(maxlen=4)


def op_name(target: Any) -> str:
    """``ns::name.overload`` of an operator overload, '' for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name}.{target._overloadname}"
    return ""


def _arguments(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by schema name, defaults filled in."""
    named: dict[str, Any] = {}
    for i, arg in enumerate(op._schema.arguments):
        if i < len(args):
            named[arg.name] = args[i]
        elif arg.name in kwargs:
            named[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            named[arg.name] = arg.default_value
    return named


class _Norm:
    """One vLLM norm node: its kind, its arguments, and the nodes that read its outputs."""

    def __init__(self, node: fx.Node) -> None:
        self.node = node
        self.op: Any
        if node.target is _AUTO_FUNCTIONALIZED:
            self.op = node.args[0]
            self.kind = op_name(self.op)
            self.args = _arguments(self.op, (), dict(node.kwargs))
        else:
            self.op = node.target
            self.kind = op_name(node.target)
            self.args = _arguments(node.target, node.args, dict(node.kwargs))

    @property
    def has_residual(self) -> bool:
        return self.kind != RMS_NORM

    def outputs(self) -> dict[int, list[fx.Node]]:
        """Output index -> the getitem nodes that read it (a bare rms_norm: index 0 is the node)."""
        if not self.has_residual:
            return {0: [self.node]}
        found: dict[int, list[fx.Node]] = {}
        for user in self.node.users:
            if user.target is operator.getitem:
                found.setdefault(int(user.args[1]), []).append(user)  # type: ignore[arg-type]
            else:
                found.setdefault(-1, []).append(user)
        return found


def _norm_of(node: fx.Node) -> _Norm | None:
    if node.op != "call_function":
        return None
    if node.target is _AUTO_FUNCTIONALIZED and op_name(node.args[0]) == ADD_RMS_NORM_INPLACE:
        return _Norm(node)
    if op_name(node.target) in (RMS_NORM, ADD_RMS_NORM):
        return _Norm(node)
    return None


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def refusal(ar: fx.Node, norm: _Norm | None) -> str | None:
    """Why the all-reduce ``ar`` and its norm cannot become the fused op (None: they can)."""
    if norm is None:
        return "no vLLM RMSNorm reads the all-reduce"
    x = _val(ar.args[0])
    if x is None:
        return "the all-reduce's input has no fake value"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (the fused op takes bf16, fp16, fp32)"
    if norm.args.get("x") is not ar:
        return "the all-reduce is the norm's residual, not its input"
    if norm.args.get("variance_size") is not None:
        return "variance_size set (a norm over part of the row)"
    weight = _val(norm.args.get("weight"))
    if weight is not None and weight.dtype != x.dtype:
        return f"norm weight {weight.dtype} with activations {x.dtype} (vLLM rounds to the weight's dtype)"
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        return "norm weight not one value per hidden element"
    if norm.has_residual:
        if len(ar.users) != 1:
            return "the all-reduce is read by something else than the norm too"
        residual = _val(norm.args.get("x_residual"))
        if residual is None or residual.dtype != x.dtype or tuple(residual.shape) != tuple(x.shape):
            return "residual of another dtype or shape than the all-reduce"
        outputs = norm.outputs()
        if set(outputs) - {0, 1}:
            return "a mutated input of the in-place norm is read after it"
    return None


def _call(graph: fx.Graph, target: Any, args: tuple, like: Any) -> fx.Node:
    """A new node with its fake value (``like``: a fake tensor of the graph, whose mode makes it)."""
    node = graph.call_function(target, args)
    fake = [_val(a) for a in args]
    if target is operator.getitem:
        node.meta["val"] = fake[0][fake[1]]
    else:
        with like.fake_mode:
            node.meta["val"] = target(*fake)
    return node


def _zeros(graph: fx.Graph, x: fx.Node, like: Any) -> fx.Node:
    """Zeros of ``x``'s shape and dtype, as ``aten.full`` (Inductor lowers it; ``zeros_like`` is decomposed
    before the post-grad passes and has no lowering), symbolic sizes read with ``aten.sym_size``."""
    shape: list[Any] = []
    for i, size in enumerate(like.shape):
        if isinstance(size, int):
            shape.append(size)
        else:
            node = graph.call_function(torch.ops.aten.sym_size.int, (x, i))
            node.meta["val"] = size
            shape.append(node)
    zeros = graph.call_function(
        torch.ops.aten.full.default, (shape, 0.0), {"dtype": like.dtype, "device": like.device, "pin_memory": False}
    )
    with like.fake_mode:
        zeros.meta["val"] = torch.full(like.shape, 0.0, dtype=like.dtype, device=like.device)
    return zeros


def _rewrite_site(graph: fx.Graph, ar: fx.Node, norm: _Norm, group: str) -> None:
    x_partial = ar.args[0]
    assert isinstance(x_partial, fx.Node)
    like = _val(x_partial)
    with graph.inserting_before(norm.node):
        weight = norm.args.get("weight")
        if weight is None:  # a norm without weight: ones give the same bits
            weight = graph.call_function(
                torch.ops.aten.full.default, ([like.shape[-1]], 1.0), {"dtype": like.dtype, "device": like.device}
            )
            with like.fake_mode:
                weight.meta["val"] = torch.full([like.shape[-1]], 1.0, dtype=like.dtype, device=like.device)
        if norm.has_residual:
            residual = norm.args["x_residual"]
        else:
            residual = _zeros(graph, x_partial, like)
        fused = _call(graph, _ops.FUSED_OP, (x_partial, residual, weight, float(norm.args["epsilon"]), group), like)
        out = _call(graph, operator.getitem, (fused, 0), like)
        residual_out = _call(graph, operator.getitem, (fused, 1), like)
    if norm.has_residual:
        outputs = norm.outputs()
        for node in outputs.get(0, []):
            node.replace_all_uses_with(out)
        for node in outputs.get(1, []):
            node.replace_all_uses_with(residual_out)
        for node in [*outputs.get(0, []), *outputs.get(1, [])]:
            graph.erase_node(node)
        graph.erase_node(norm.node)
        graph.erase_node(ar)
    else:
        norm.node.replace_all_uses_with(out)
        graph.erase_node(norm.node)
        ar.replace_all_uses_with(residual_out)
        graph.erase_node(ar)


def _quant_after(norm: _Norm) -> str | None:
    """The name of a quantisation that reads the norm's output, if any."""
    if norm.has_residual:
        consumers = [user for getitem in norm.outputs().get(0, []) for user in getitem.users]
    else:
        consumers = list(norm.node.users)
    for node in consumers:
        name = op_name(node.target)
        if node.target is _AUTO_FUNCTIONALIZED:
            name = op_name(node.args[0])
        if "quant" in name:
            return name
    return None


def rewrite(graph: fx.Graph) -> int:
    """Rewrite ``graph``'s vLLM all-reduce + RMSNorm sites in place; returns how many were fused."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    ars = [n for n in graph.nodes if n.op == "call_function" and op_name(n.target) in (ALL_REDUCE, C10D_ALL_REDUCE)]
    if not ars:
        return 0
    _recorded.append(describe_graph(graph))
    fused = 0
    for ar in ars:
        if op_name(ar.target) == C10D_ALL_REDUCE:
            _ops.note_site("refused: _c10d_functional.all_reduce names torch's group, not vLLM's")
            continue
        norms = [m for m in (_norm_of(u) for u in ar.users) if m is not None and m.args.get("x") is ar]
        norm = norms[0] if len(norms) == 1 else None
        reason = refusal(ar, norm) if len(norms) <= 1 else "two norms read the all-reduce"
        if reason is not None:
            _ops.note_site(f"refused: {reason}")
            eps = norm.args.get("epsilon") if norm is not None else None
            if norm is not None and eps in FLASHINFER_EPS and norm.args.get("variance_size") is None:
                _ops.note_site(f"refused: {reason} [FlashInfer's pass would have fused it on CUDA]")
            continue
        assert norm is not None
        quant = _quant_after(norm)
        if quant:
            _ops.note_site(f"refused: quant after norm left in vLLM ({quant}); the norm fused")
        group = _arguments(ar.target, ar.args, dict(ar.kwargs))["group_name"]
        _rewrite_site(graph, ar, norm, str(group))
        _ops.note_site("fused" if norm.has_residual else "fused (no residual: the embedding's all-reduce)")
        fused += 1
    if fused:
        stable_topological_sort(graph)
        graph.lint()
    return fused


def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in (__file__, _ops.__file__, ubnext_ops.__file__):
        with open(os.path.abspath(path), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


_UUID: list[str] = []


def pass_uuid() -> str:
    if not _UUID:
        _UUID.append("ubnext.integrations.vllm-" + _source_hash())
    return _UUID[0]


class UbnextVllmPass(CustomGraphPass):
    """The pass as Inductor's ``post_grad_custom_post_pass`` takes it. ``chained``: a pass the user had
    there, run first."""

    def __init__(self, chained: Any = None) -> None:
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)
        rewrite(graph)

    def uuid(self) -> Any:
        if self.chained is None:
            return pass_uuid()
        # a chained pass without a uuid is named by its class, never by repr (an address: a new cache key
        # in every process)
        chained = self.chained
        name = (
            chained.uuid() if hasattr(chained, "uuid") else f"{type(chained).__module__}.{type(chained).__qualname__}"
        )
        return (pass_uuid(), name)


# -- a graph as data: what the client tier stores and the unit tests rebuild ------------------------


def _encode(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": {k: _encode(v) for k, v in value.items()}}
    if isinstance(value, torch._ops.OpOverload):
        return {"op": op_name(value)}
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return {"repr": str(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"repr": repr(value)}


def _encode_val(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return {"shape": [int(s) if isinstance(s, int) else str(s) for s in val.shape], "dtype": str(val.dtype)}
    if isinstance(val, (list, tuple)):
        return [_encode_val(v) for v in val]
    return None if val is None else repr(val)


def describe_graph(graph: fx.Graph) -> list[dict[str, Any]]:
    """The graph as JSON-able data: each node's op, name, target, arguments and fake value's shape."""
    rows = []
    for node in graph.nodes:
        if node.op == "call_function":
            target = op_name(node.target) or getattr(node.target, "__name__", repr(node.target))
        else:
            target = str(node.target)
        rows.append(
            {
                "op": node.op,
                "name": node.name,
                "target": target,
                "args": _encode(node.args),
                "kwargs": _encode(dict(node.kwargs))["dict"],
                "val": _encode_val(node.meta.get("val")),
            }
        )
    return rows


def recorded_graphs() -> list[list[dict[str, Any]]]:
    """The last graphs the pass saw in this process, before its rewrite."""
    return list(_recorded)

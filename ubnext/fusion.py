"""Fusion without rewriting the model: an Inductor post-grad pass that finds, in every graph
``torch.compile`` compiles, a sum all-reduce followed by the residual add and an RMSNorm, and runs
``torch.ops.ubnext.all_reduce_add_rmsnorm`` there; a sum all-reduce with no norm after it runs
``torch.ops.ubnext.all_reduce``.

    import ubnext
    ubnext.fusion.enable()
    model = torch.compile(model)

Where it looks. After AOTAutograd every all-reduce is ``_c10d_functional.all_reduce`` followed by
``wait_tensor``, whichever way the model wrote it: a DTensor redistribution from ``Partial`` to
``Replicate`` (torch's ``RowwiseParallel``), ``torch.distributed._functional_collectives.all_reduce``,
or ``torch.distributed.all_reduce`` traced by Dynamo. The norm is what ``nn.RMSNorm``,
``F.rms_norm`` and the hand-written ``x * rsqrt(mean(x^2) + eps) * w`` decompose to: pow (or
x * x), mean over the last dimension, add eps, rsqrt, two multiplications, in fp32 (with
``convert_element_type`` nodes around it for 16-bit activations) or in the activations' dtype.
The walk is written by hand rather than with Inductor's pattern matcher: the matcher needs one
traced pattern per combination of casts, operand orders and weight (vLLM registers one per
variant), and says nothing about a near miss, while this pass must say why a site was left alone.

What it rewrites. The fused op returns the residual sum and the normed tensor; both replace their
counterparts, so every other use of the residual sum (the next residual add) reads the fused op's.
Anything else computed from the residual sum stays in the graph and now reads the fused op's
residual sum: in a forward graph compiled for training, the norm's rsqrt, saved for the backward,
is recomputed by Inductor from it (one more read of the residual per norm, no new operator). So
inference graphs, training forward graphs and training backward graphs are all rewritten; a
backward graph holds the all-reduce of a column-parallel layer's input gradient, which no norm
follows: it becomes ``ubnext.all_reduce``.

What it leaves alone (counted in ``stats()`` and logged once at debug level): an all-reduce with
another reduce op, of another dtype than bf16/fp16/fp32, or of a non-contiguous tensor. A sum
all-reduce whose norm the fused op cannot take (a mean over another dimension, a weight of another
dtype, an output promoted to fp32, the reduced tensor used elsewhere too) is rewritten as a plain
``ubnext.all_reduce`` and its norm left as it was.

Numerics: the fused op sums the ranks' partial sums and the residual in fp32 and rounds once to
the activations' dtype, where the composite all-reduce rounds after its sum and the add rounds
again; the norm is computed in fp32 from the rounded residual sum and rounded once (the contract
of ``Communicator.all_reduce_add_rmsnorm``, bounds in ``ubnext/testing.py``).

The pass is a ``CustomGraphPass`` whose uuid is the hash of this file and of ``ubnext/ops.py``
(the operators it emits), so Inductor's FX graph cache stays on and keys rewritten graphs apart
from plain ones. ``enable()`` chains it after whatever ``post_grad_custom_post_pass`` holds;
``disable()`` gives that back. Both affect graphs compiled afterwards: code already compiled
keeps what it was compiled with (``torch._dynamo.reset()`` drops it). A graph loaded from the FX
graph cache does not run the pass again and is not counted in ``stats()``.
"""

from __future__ import annotations

import hashlib
import logging
import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_custom_graph_passes

from . import ops
from ._checks import DTYPE_CODES

__all__ = ["enable", "disable", "is_enabled", "stats"]

log = logging.getLogger("ubnext")

aten = torch.ops.aten
_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_CAST = torch.ops.prims.convert_element_type.default
_FUSED = torch.ops.ubnext.all_reduce_add_rmsnorm.default
_PLAIN = torch.ops.ubnext.all_reduce.default

FUSED, PLAIN = "all_reduce_add_rmsnorm", "all_reduce"


def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in (__file__, ops.__file__):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


class FusionPass(CustomGraphPass):
    """The post-grad pass ``enable()`` installs (see the module docstring)."""

    _uuid: Optional[str] = None

    def __call__(self, graph: fx.Graph) -> None:
        rewrite(graph)

    def uuid(self) -> str:
        if FusionPass._uuid is None:
            FusionPass._uuid = "ubnext.fusion-" + _source_hash()
        return FusionPass._uuid


_PASS = FusionPass()
_UNSET = object()
_before: Any = _UNSET  # what post_grad_custom_post_pass held before enable(); _UNSET while disabled
_installed: Any = None  # what enable() put there
_counts: Counter = Counter()
_not_fused: Counter = Counter()
_left_alone: Counter = Counter()
_graphs: Counter = Counter()
_logged: set = set()


def enable() -> None:
    """Rewrite the all-reduces of every graph Inductor compiles from now on (see the module
    docstring); a pass already in ``torch._inductor.config.post_grad_custom_post_pass`` runs first."""
    global _before, _installed
    if _before is not _UNSET:
        return
    _before = inductor_config.post_grad_custom_post_pass
    _installed = (*get_custom_graph_passes(_before), _PASS)
    inductor_config.post_grad_custom_post_pass = _installed


def disable() -> None:
    """Stop rewriting graphs compiled from now on and give ``post_grad_custom_post_pass`` back
    what it held before ``enable()``; passes installed after ``enable()`` are kept."""
    global _before, _installed
    if _before is _UNSET:
        return
    current = inductor_config.post_grad_custom_post_pass
    if current is _installed:
        inductor_config.post_grad_custom_post_pass = _before
    else:  # changed since enable(): take only ours out
        rest = tuple(p for p in get_custom_graph_passes(current) if p is not _PASS)
        inductor_config.post_grad_custom_post_pass = rest or None
    _before, _installed = _UNSET, None


def is_enabled() -> bool:
    return _before is not _UNSET


def stats(reset: bool = False) -> dict:
    """Sites rewritten since the process started (or the last ``stats(reset=True)``):
    ``{"all_reduce_add_rmsnorm": n, "all_reduce": n, "not_fused": {reason: n}, "left_alone":
    {reason: n}, "graphs": {"inference" | "training forward" | "training backward": n}}``.
    ``not_fused`` counts the all-reduces rewritten without a norm and why the norm was not taken;
    ``left_alone`` the all-reduces not rewritten and why; ``graphs`` the graphs with a rewrite."""
    out = {FUSED: _counts[FUSED], PLAIN: _counts[PLAIN], "not_fused": dict(_not_fused),
           "left_alone": dict(_left_alone), "graphs": dict(_graphs)}
    if reset:
        for counter in (_counts, _not_fused, _left_alone, _graphs):
            counter.clear()
    return out


def _note(counter: Counter, reason: str, what: str) -> None:
    counter[reason] += 1
    if (what, reason) not in _logged:
        _logged.add((what, reason))
        log.debug("ubnext.fusion: %s: %s", what, reason)


# -- the graph walk --------------------------------------------------------------------------------


@dataclass
class _Norm:
    """A matched residual add + RMSNorm after an all-reduce."""

    add: fx.Node  # the residual sum
    residual: fx.Node
    weight: Optional[fx.Node]  # None: a norm without weight
    eps: float
    out: fx.Node  # the normed tensor in the activations' dtype


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is(node, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _other(node: fx.Node, known):
    """The other operand of a binary op one of whose first two operands is ``known``."""
    a, b = node.args[:2]
    return b if a is known else a if b is known else None


def _user(node: fx.Node, match):
    return next((u for u in node.users if match(u)), None)


def _cast_to(node: fx.Node, dtype) -> Optional[fx.Node]:
    """``node``'s only user when it is a cast to ``dtype``."""
    user = next(iter(node.users)) if len(node.users) == 1 else None
    return user if _is(user, _CAST) and user.args[1] == dtype else None


def _graph_kind(graph: fx.Graph) -> str:
    names = [n.name for n in graph.find_nodes(op="placeholder")]
    if any(name.startswith("tangents") for name in names):
        return "training backward"
    return "training forward" if any(name.startswith("primals") for name in names) else "inference"


def _left_alone_reason(ar: fx.Node) -> Optional[str]:
    x, reduce_op, group = ar.args[:3]
    if reduce_op != "sum":
        return f"reduce op {reduce_op!r} (ubnext sums)"
    xv = _val(x)
    if not isinstance(xv, torch.Tensor):
        return "no tensor metadata on the all-reduce's input"
    if xv.dtype not in DTYPE_CODES:
        return f"dtype {xv.dtype} (ubnext takes bfloat16, float16 and float32)"
    if not xv.is_contiguous():
        return "a non-contiguous input"
    if not isinstance(group, str):
        return "the group is not named by a string"
    if len(ar.users) != 1 or not _is(next(iter(ar.users)), _WAIT):
        return "the all-reduce is not waited on exactly once"
    return None


def _match_norm(ar: fx.Node, wait: fx.Node):
    """The residual add + RMSNorm that the fused op can take after ``wait``, else why not (a str)."""
    xv = _val(ar.args[0])
    add = next(iter(wait.users)) if len(wait.users) == 1 else None
    if not (_is(add, aten.add.Tensor) and len(add.args) == 2 and not add.kwargs):
        return ("no residual add after the all-reduce" if len(wait.users) <= 1
                else "the reduced tensor is used by more than the residual add")
    residual = _other(add, wait)
    rv = _val(residual)
    if residual is wait or not isinstance(rv, torch.Tensor) or rv.shape != xv.shape or rv.dtype != xv.dtype:
        return "the residual is not a tensor of the reduced tensor's shape and dtype"
    if not rv.is_contiguous():
        return "a non-contiguous residual"
    hidden = xv.shape[-1]
    if not isinstance(hidden, int):
        return "a symbolic hidden size"
    # the norm reads the residual sum as it is, or through one cast to fp32
    sources = [add, *(u for u in add.users if _is(u, _CAST) and u.args[1] == torch.float32)]
    reasons = []
    for src in sources:
        for square in list(src.users):
            found = _match_rmsnorm(src, square, xv, hidden)
            if isinstance(found, _Norm):
                found.add, found.residual = add, residual
                return found
            if found:
                reasons.append(found)
    return reasons[0] if reasons else "no RMSNorm of the residual sum"


def _match_rmsnorm(src: fx.Node, square: fx.Node, xv, hidden: int):
    """The RMSNorm of ``src`` that starts at ``square``; None when ``square`` starts no norm, a
    reason (str) when it starts one the fused op cannot take."""
    if not ((_is(square, aten.pow.Tensor_Scalar) and square.args[0] is src and square.args[1] == 2)
            or (_is(square, aten.mul.Tensor) and square.args[0] is src and square.args[1] is src)):
        return None
    mean = _user(square, lambda u: _is(u, aten.mean.dim))
    if mean is None:
        return None
    dims = mean.args[1] if len(mean.args) > 1 else mean.kwargs.get("dim")
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if list(dims or ()) not in ([-1], [len(xv.shape) - 1]) or not keepdim:
        return "an RMSNorm over another dimension than the last"
    plus_eps = _user(mean, lambda u: _is(u, aten.add.Scalar, aten.add.Tensor))
    eps = _other(plus_eps, mean) if plus_eps is not None else None
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps >= 0 and math.isfinite(eps)):
        return "an eps that is not a constant number >= 0"
    rsqrt = _user(plus_eps, lambda u: _is(u, aten.rsqrt.default))
    normed = rsqrt and _user(rsqrt, lambda u: _is(u, aten.mul.Tensor) and _other(u, rsqrt) is src)
    if not normed:
        return "mean(x^2) + eps is not followed by rsqrt and a product with x"
    # then, through an optional cast to the activations' dtype, the weight (a [hidden] vector)
    out = _cast_to(normed, xv.dtype) or normed
    scale = next(iter(out.users)) if len(out.users) == 1 else None
    weight = _other(scale, out) if _is(scale, aten.mul.Tensor) else None
    wv = _val(weight)
    if isinstance(wv, torch.Tensor) and tuple(wv.shape) == (hidden,):
        if wv.dtype != xv.dtype:
            return f"a norm weight of dtype {wv.dtype} with {xv.dtype} activations"
        if not wv.is_contiguous():
            return "a non-contiguous norm weight"
        out = _cast_to(scale, xv.dtype) or scale
    else:
        weight = None
    ov = _val(out)
    if not isinstance(ov, torch.Tensor) or ov.dtype != xv.dtype or ov.shape != xv.shape:
        return "the norm's output is not of the activations' dtype and shape (promoted to fp32?)"
    return _Norm(None, None, weight, float(eps), out)  # type: ignore[arg-type]


# -- the rewrite -----------------------------------------------------------------------------------


def _call(graph: fx.Graph, target, args: tuple, kwargs: Optional[dict] = None, *, like) -> fx.Node:
    """A new node with its fake value, as the nodes around it carry one (``like``: a fake tensor of
    the graph, whose mode makes the value)."""
    node = graph.call_function(target, args, kwargs or {})
    fake = [_val(a) if isinstance(a, fx.Node) else a for a in args]
    if target is operator.getitem:
        node.meta["val"] = fake[0][fake[1]]
    else:
        with like.fake_mode:
            node.meta["val"] = target(*fake, **(kwargs or {}))
    return node


def _erase_unused(graph: fx.Graph, nodes, position: dict) -> None:
    """Erase the matched nodes nothing reads any more, users before what they read. Not
    eliminate_dead_code: it keeps wait_tensor (a side effect), and with it the replaced all-reduce."""
    for node in sorted(nodes, key=position.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)


def _rewrite_fused(graph: fx.Graph, ar: fx.Node, wait: fx.Node, norm: _Norm, position: dict) -> None:
    x, _, group = ar.args[:3]
    xv = _val(x)
    with graph.inserting_before(norm.add):
        weight = norm.weight
        if weight is None:  # a norm without weight: the fused op's weight of ones gives the same bits
            weight = _call(graph, aten.full.default, ([xv.shape[-1]], 1.0),
                           {"dtype": xv.dtype, "device": xv.device}, like=xv)
        fused = _call(graph, _FUSED, (x, norm.residual, weight, norm.eps, group), like=xv)
        out = _call(graph, operator.getitem, (fused, 0), like=xv)
        residual_out = _call(graph, operator.getitem, (fused, 1), like=xv)
    norm.out.replace_all_uses_with(out)
    norm.add.replace_all_uses_with(residual_out)
    # what lies between the residual sum and the output, if nothing else reads it
    between, frontier = set(), [norm.out]
    while frontier:
        node = frontier.pop()
        if node not in between:
            between.add(node)
            frontier.extend(a for a in node.all_input_nodes if position.get(a, -1) > position[norm.add])
    _erase_unused(graph, [*between, norm.add, wait, ar], position)


def _rewrite_plain(graph: fx.Graph, ar: fx.Node, wait: fx.Node, position: dict) -> None:
    x, _, group = ar.args[:3]
    with graph.inserting_before(wait):
        reduced = _call(graph, _PLAIN, (x, group), like=_val(x))
    wait.replace_all_uses_with(reduced)
    _erase_unused(graph, [wait, ar], position)


def rewrite(graph: fx.Graph) -> None:
    """The pass itself: rewrite ``graph``'s sum all-reduces in place (see the module docstring)."""
    from torch._inductor.pattern_matcher import stable_topological_sort

    sites = list(graph.find_nodes(op="call_function", target=_ALL_REDUCE))
    if not sites:
        return
    position = {n: i for i, n in enumerate(graph.nodes)}
    rewritten = 0
    for ar in sites:
        reason = _left_alone_reason(ar)
        if reason:
            _note(_left_alone, reason, "all-reduce left as it is")
            continue
        wait = next(iter(ar.users))
        norm = _match_norm(ar, wait)
        if isinstance(norm, _Norm):
            _rewrite_fused(graph, ar, wait, norm, position)
            _counts[FUSED] += 1
        else:
            _note(_not_fused, norm, "all-reduce rewritten without a norm")
            _rewrite_plain(graph, ar, wait, position)
            _counts[PLAIN] += 1
        rewritten += 1
    if rewritten:
        _graphs[_graph_kind(graph)] += 1
        # a norm weight made after the residual add (a cast in the graph) precedes the fused op now
        stable_topological_sort(graph)
        graph.lint()

"""Fusion without rewriting the model: an Inductor post-grad pass that finds, in every graph
``torch.compile`` compiles, a sum all-reduce followed by the residual add and an RMSNorm, and runs
``torch.ops.ubnext.all_reduce_add_rmsnorm`` there, or its FP8 form
``all_reduce_add_rmsnorm_fp8`` where a static or per-token FP8 quantisation written in torch ops
follows the norm; a sum all-reduce with no norm after it runs ``torch.ops.ubnext.all_reduce``.
The matching is in ubnext/fusion/_match.py, the rewrite here.

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

FP8. Where the normed tensor's only use is an FP8 quantisation that computes exactly what the
fused op's FP8 form computes (the forms in ubnext/fusion/_match.py: static, ``(y.float() /
scale).clamp(-448, 448).to(torch.float8_e4m3fn)``, and per token, with the scales
``(amax / 448).clamp(min=1e-12)``), the FP8 form replaces the norm and the quantisation: the FP8
values, the per-token scales (as the graph's ``[..., 1]`` tensor) and the residual sum are the
bits of the same torch code run eagerly on the fused op's normed output. A quantisation that would
give other bits (a multiplication by the reciprocal scale, a quotient in bf16, another FP8 format,
a scale computed in the graph from the activations, the normed tensor used unquantised too) stays
in torch after the plain fused op, counted in ``stats()["fp8_not_fused"]`` and logged once.

What it leaves alone (counted in ``stats()`` and logged once at debug level): an all-reduce with
another reduce op, of another dtype than bf16/fp16/fp32, or of a non-contiguous tensor. A sum
all-reduce whose norm the fused op cannot take (a mean over another dimension, a weight of another
dtype, an output promoted to fp32, the reduced tensor used elsewhere too) is rewritten as a plain
``ubnext.all_reduce`` and its norm left as it was.

Numerics: the fused op sums the ranks' partial sums and the residual in fp32 and rounds once to
the activations' dtype, where the composite all-reduce rounds after its sum and the add rounds
again; the norm is computed in fp32 from the rounded residual sum and rounded once (the contract
of ``Communicator.all_reduce_add_rmsnorm``, bounds in ``ubnext/testing.py``).

The pass is a ``CustomGraphPass`` whose uuid is the hash of this file, of the matching
(``ubnext/fusion/_match.py``) and of ``ubnext/ops/__init__.py`` (the operators it emits), so Inductor's FX
graph cache stays on and keys rewritten graphs apart from plain ones. ``enable()`` chains it after whatever ``post_grad_custom_post_pass`` holds;
``disable()`` gives that back. Both affect graphs compiled afterwards: code already compiled
keeps what it was compiled with (``torch._dynamo.reset()`` drops it). A graph loaded from the FX
graph cache does not run the pass again and is not counted in ``stats()``.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
from collections import Counter
from typing import Any

import torch
import torch.fx as fx
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_custom_graph_passes

from .. import ops
from ._match import Norm, Quant, left_alone_reason, match_fp8, match_norm, val

__all__ = ["enable", "disable", "is_enabled", "stats"]

log = logging.getLogger("ubnext")

aten = torch.ops.aten
_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_FUSED = torch.ops.ubnext.all_reduce_add_rmsnorm.default
_FUSED_FP8 = torch.ops.ubnext.all_reduce_add_rmsnorm_fp8.default
_PLAIN = torch.ops.ubnext.all_reduce.default

FUSED, FUSED_FP8, PLAIN = "all_reduce_add_rmsnorm", "all_reduce_add_rmsnorm_fp8", "all_reduce"


def _source_hash() -> str:
    digest = hashlib.sha256()
    # this package's files (the pass and what it matches) and every file of ubnext/ops/, where the
    # operators it emits are defined
    for folder in (os.path.dirname(__file__), os.path.dirname(ops.__file__)):
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


class FusionPass(CustomGraphPass):
    """The post-grad pass ``enable()`` installs (see the module docstring)."""

    _uuid: str | None = None

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
_fp8_not_fused: Counter = Counter()
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
    ``{"all_reduce_add_rmsnorm": n, "all_reduce_add_rmsnorm_fp8": n, "all_reduce": n,
    "not_fused": {reason: n}, "left_alone": {reason: n}, "fp8_not_fused": {reason: n}, "graphs":
    {"inference" | "training forward" | "training backward": n}}``. ``not_fused`` counts the
    all-reduces rewritten without a norm and why the norm was not taken; ``left_alone`` the
    all-reduces not rewritten and why; ``fp8_not_fused`` the FP8 quantisations after a fused norm
    left in torch (the norm fused in its plain form) and why; ``graphs`` the graphs with a rewrite."""
    out = {
        FUSED: _counts[FUSED],
        FUSED_FP8: _counts[FUSED_FP8],
        PLAIN: _counts[PLAIN],
        "not_fused": dict(_not_fused),
        "left_alone": dict(_left_alone),
        "fp8_not_fused": dict(_fp8_not_fused),
        "graphs": dict(_graphs),
    }
    if reset:
        for counter in (_counts, _not_fused, _left_alone, _fp8_not_fused, _graphs):
            counter.clear()
    return out


def _note(counter: Counter, reason: str, what: str) -> None:
    counter[reason] += 1
    if (what, reason) not in _logged:
        _logged.add((what, reason))
        log.debug("ubnext.fusion: %s: %s", what, reason)


def _graph_kind(graph: fx.Graph) -> str:
    names = [n.name for n in graph.find_nodes(op="placeholder")]
    if any(name.startswith("tangents") for name in names):
        return "training backward"
    return "training forward" if any(name.startswith("primals") for name in names) else "inference"


# -- the rewrite -----------------------------------------------------------------------------------


def _call(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None, *, like) -> fx.Node:
    """A new node with its fake value, as the nodes around it carry one (``like``: a fake tensor of
    the graph, whose mode makes the value)."""
    node = graph.call_function(target, args, kwargs or {})
    fake = [val(a) if isinstance(a, fx.Node) else a for a in args]
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


def _rewrite_fused(
    graph: fx.Graph, ar: fx.Node, wait: fx.Node, norm: Norm, quant: Quant | None, position: dict
) -> None:
    """The fused op in place of the all-reduce, the residual add and the norm, and with ``quant``
    its FP8 form in place of the quantisation too."""
    x, _, group = ar.args[:3]
    xv = val(x)
    with graph.inserting_before(norm.add):
        weight = norm.weight
        if weight is None:  # a norm without weight: the fused op's weight of ones gives the same bits
            weight = _call(
                graph, aten.full.default, ([xv.shape[-1]], 1.0), {"dtype": xv.dtype, "device": xv.device}, like=xv
            )
        if quant is None:
            fused = _call(graph, _FUSED, (x, norm.residual, weight, norm.eps, group), like=xv)
        else:
            fused = _call(graph, _FUSED_FP8, (x, norm.residual, weight, norm.eps, quant.scale, group), like=xv)
        out, residual_out, *scale_inv = (
            _call(graph, operator.getitem, (fused, i), like=xv) for i in range(3 if quant else 2)
        )
        if quant is not None and quant.scale_out is not None:  # per token: the graph's [..., 1] scales
            quant.scale_out.replace_all_uses_with(_call(graph, aten.unsqueeze.default, (scale_inv[0], -1), like=xv))
    replaced = norm.out if quant is None else quant.q
    replaced.replace_all_uses_with(out)
    norm.add.replace_all_uses_with(residual_out)
    # what lies between the residual sum and the outputs, if nothing else reads it
    between, frontier = set(), [replaced, *([quant.scale_out] if quant and quant.scale_out else [])]
    while frontier:
        node = frontier.pop()
        if node not in between:
            between.add(node)
            frontier.extend(a for a in node.all_input_nodes if position.get(a, -1) > position[norm.add])
    _erase_unused(graph, [*between, norm.add, wait, ar], position)


def _rewrite_plain(graph: fx.Graph, ar: fx.Node, wait: fx.Node, position: dict) -> None:
    x, _, group = ar.args[:3]
    with graph.inserting_before(wait):
        reduced = _call(graph, _PLAIN, (x, group), like=val(x))
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
        reason = left_alone_reason(ar)
        if reason:
            _note(_left_alone, reason, "all-reduce left as it is")
            continue
        wait = next(iter(ar.users))
        norm = match_norm(ar, wait)
        if isinstance(norm, Norm):
            quant = match_fp8(norm, val(ar.args[0]), position)
            if isinstance(quant, str):
                _note(_fp8_not_fused, quant, "FP8 quantisation after a fused norm left in torch")
                quant = None
            _rewrite_fused(graph, ar, wait, norm, quant, position)
            _counts[FUSED if quant is None else FUSED_FP8] += 1
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

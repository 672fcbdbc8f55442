"""What ubnext.fusion matches (ubnext/fusion/__init__.py rewrites it): in a post-grad graph, a sum
all-reduce the ubnext operators can take, the residual add and RMSNorm after it, and an FP8
quantisation of the normed tensor written in torch ops. Each matcher reads the graph only and
returns what it found or why it did not (a str), which the pass counts in ``stats()``.

The FP8 quantisation is taken where it computes exactly what the fused op's FP8 form computes
(``quantize_fp8_reference`` in ubnext/reference/_checks.py), so that the rewrite gives the same bits as the
torch code run eagerly on the fused op's normed output:

    static:     q = (y.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    per token:  yf = y.float(); amax = yf.abs().amax(-1, keepdim=True)
                s = (amax / 448).clamp(min=1e-12); q = (yf / s).clamp(-448, 448).to(torch.float8_e4m3fn)

``y`` is the normed tensor in the activations' dtype (``.float()`` is absent for fp32
activations), ``scale`` a one-element fp32 tensor (a buffer, an input), the clamp either
``clamp(-448, 448)`` or its two halves in either order. Near misses are left in torch, each for a
reason that the bits would differ: a multiplication by the reciprocal ``y.float() * (1 / scale)``
rounds the quotient twice (one FP8 step apart for some inputs, e.g. y = 1.0078125, scale =
93.81818); ``y / scale`` with a 16-bit ``y`` and a zero-dimensional scale divides in the 16-bit
type, rounding the quotient before the FP8 cast (one FP8 step apart for about 2% of the values);
a per-token scale computed in 16 bits rounds it; a scale computed from ``y`` itself (per-tensor
dynamic scaling) is not a static scale. Division here is true division: on the CPU torch divides
``amax / 448`` exactly as the fused op does; on CUDA eager torch multiplies by the reciprocal of a
Python-number divisor, so there the per-token scale of the composite may differ from the fused
op's (correctly rounded) one in the last bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard, cast

import torch
import torch.fx as fx

from ..reference._checks import DTYPE_CODES, FP8, FP8_MAX, FP8_TINY_SCALE_INV

aten = torch.ops.aten
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_CAST = torch.ops.prims.convert_element_type.default
_FP8_DTYPES = tuple(
    d
    for d in (
        getattr(torch, name, None) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    )
    if d is not None
)
# what lies between a normed tensor and an FP8 cast of it, in the forms above and their near misses
_QUANT_STEPS = (
    _CAST,
    aten.div.Tensor,
    aten.mul.Tensor,
    aten.reciprocal.default,
    aten.abs.default,
    aten.amax.default,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
)


@dataclass
class Norm:
    """A matched residual add + RMSNorm after an all-reduce."""

    add: fx.Node  # the residual sum
    residual: fx.Node
    weight: fx.Node | None  # None: a norm without weight
    eps: float
    out: fx.Node  # the normed tensor in the activations' dtype


def val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _is(node: object, *targets: object) -> TypeGuard[fx.Node]:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _other(node: fx.Node, known):
    """The other operand of a binary op one of whose first two operands is ``known``."""
    a, b = node.args[:2]
    return b if a is known else a if b is known else None


def _user(node: fx.Node, match):
    return next((u for u in node.users if match(u)), None)


def _cast_to(node: fx.Node, dtype) -> fx.Node | None:
    """``node``'s only user when it is a cast to ``dtype``."""
    user = next(iter(node.users)) if len(node.users) == 1 else None
    return user if _is(user, _CAST) and user.args[1] == dtype else None


def left_alone_reason(ar: fx.Node) -> str | None:
    x, reduce_op, group = ar.args[:3]
    if reduce_op != "sum":
        return f"reduce op {reduce_op!r} (ubnext sums)"
    xv = val(x)
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


def match_norm(ar: fx.Node, wait: fx.Node):
    """The residual add + RMSNorm that the fused op can take after ``wait``, else why not (a str)."""
    xv = val(ar.args[0])
    add = next(iter(wait.users)) if len(wait.users) == 1 else None
    if not (_is(add, aten.add.Tensor) and len(add.args) == 2 and not add.kwargs):
        return (
            "no residual add after the all-reduce"
            if len(wait.users) <= 1
            else "the reduced tensor is used by more than the residual add"
        )
    residual = _other(add, wait)
    rv = val(residual)
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
            if isinstance(found, Norm):
                found.add, found.residual = add, residual
                return found
            if found:
                reasons.append(found)
    return reasons[0] if reasons else "no RMSNorm of the residual sum"


def _match_rmsnorm(src: fx.Node, square: fx.Node, xv, hidden: int):
    """The RMSNorm of ``src`` that starts at ``square``; None when ``square`` starts no norm, a
    reason (str) when it starts one the fused op cannot take."""
    if not (
        (_is(square, aten.pow.Tensor_Scalar) and square.args[0] is src and square.args[1] == 2)
        or (_is(square, aten.mul.Tensor) and square.args[0] is src and square.args[1] is src)
    ):
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
    wv = val(weight)
    if isinstance(wv, torch.Tensor) and tuple(wv.shape) == (hidden,):
        if wv.dtype != xv.dtype:
            return f"a norm weight of dtype {wv.dtype} with {xv.dtype} activations"
        if not wv.is_contiguous():
            return "a non-contiguous norm weight"
        # weight is a tensor only when scale is the product that read it (_is above): a Node
        scale = cast(fx.Node, scale)
        out = _cast_to(scale, xv.dtype) or scale
    else:
        weight = None
    ov = val(out)
    if not isinstance(ov, torch.Tensor) or ov.dtype != xv.dtype or ov.shape != xv.shape:
        return "the norm's output is not of the activations' dtype and shape (promoted to fp32?)"
    return Norm(None, None, weight, float(eps), out)  # type: ignore[arg-type]


# -- the FP8 quantisation of the normed tensor -----------------------------------------------------


@dataclass
class Quant:
    """A matched FP8 quantisation of the normed tensor."""

    q: fx.Node  # the FP8 values
    scale: fx.Node | None  # static: the one-element fp32 scale tensor; None: per token
    scale_out: fx.Node | None  # per token: the [..., 1] scale tensor the graph computed


def _is_number(value, want: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and float(value) == want


def _quantised(y: fx.Node) -> bool:
    """Whether an FP8 cast follows ``y`` through the elementwise steps a quantisation takes."""
    frontier, seen = [y], set()
    for _ in range(8):
        frontier = [u for n in frontier for u in n.users if u not in seen and _is(u, *_QUANT_STEPS)]
        seen.update(frontier)
        if any(_is(u, _CAST) and u.args[1] in _FP8_DTYPES for u in frontier):
            return True
    return False


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _clamp_bounds(node: fx.Node):
    """(low, high, last node) of the clamp that follows ``node``: one ``clamp`` or its two halves
    in either order, each the only user of the one before; None for a bound not there."""
    low = high = None
    for _ in range(2):
        step = _only_user(node)
        if _is(step, aten.clamp.default) and low is None and high is None:
            args = [*step.args[1:], None, None]
            return step.kwargs.get("min", args[0]), step.kwargs.get("max", args[1]), step
        if _is(step, aten.clamp_min.default) and low is None:
            low, node = step.args[1], step
        elif _is(step, aten.clamp_max.default) and high is None:
            high, node = step.args[1], step
        else:
            break
    return low, high, node


def _saturated_cast(quotient: fx.Node):
    """The FP8 values: ``quotient`` clamped to [-448, 448] and cast to e4m3; else why not (a str)."""
    low, high, clamped = _clamp_bounds(quotient)
    if not (_is_number(low, -FP8_MAX) and _is_number(high, FP8_MAX)):
        return "no clamp to [-448, 448] between the quotient and the FP8 cast"
    cast = _only_user(clamped)
    if not (_is(cast, _CAST) and cast.args[1] in _FP8_DTYPES):
        return "the clamped quotient is not cast to FP8 alone"
    if cast.args[1] != FP8:
        return f"an FP8 format other than float8_e4m3fn ({cast.args[1]})"
    return cast


def _per_token_scale(absolute: fx.Node, last_dim: int):
    """The scale node ``(amax(|y|, -1, keepdim=True) / 448).clamp(min=1e-12)`` that starts at
    ``absolute``, else why not (a str)."""
    amax = _only_user(absolute)
    if not _is(amax, aten.amax.default):
        return "|y| is not reduced by amax alone"
    # aten.amax.default's dim is an int[] in the schema: the graph holds a list of ints (or None)
    dims = cast("Sequence[int] | None", amax.args[1] if len(amax.args) > 1 else amax.kwargs.get("dim"))
    keepdim = amax.args[2] if len(amax.args) > 2 else amax.kwargs.get("keepdim", False)
    if not dims:
        return (
            "a per-tensor scale computed from the normed tensor (dynamic scaling; the fused op's is "
            "static or per token)"
        )
    if list(dims) not in ([-1], [last_dim]) or not keepdim:
        return "a per-token amax over another dimension than the last, or without keepdim"
    div = _only_user(amax)
    clamp = _only_user(div) if _is(div, aten.div.Tensor) and div.args[0] is amax else None
    if not (
        # clamp is set only where div is the division node (the line above)
        _is_number(cast(fx.Node, div).args[1] if clamp else None, FP8_MAX)
        and _is(clamp, aten.clamp_min.default)
        and _is_number(clamp.args[1], FP8_TINY_SCALE_INV)
    ):
        return "a per-token scale other than (amax / 448).clamp(min=1e-12), or its steps used elsewhere"
    return clamp


def _static_scale(scale, xv, add: fx.Node, position: dict):
    """``scale`` when the fused op can take it as its static scale, else why not (a str)."""
    sv = val(scale)
    if not (isinstance(sv, torch.Tensor) and sv.numel() == 1 and sv.dtype == torch.float32 and sv.device == xv.device):
        return "a static scale that is not a one-element fp32 tensor on the activations' device"
    # the fused op computes the residual sum: a scale computed from it could not be its input
    frontier, seen = [scale], set()
    while frontier:
        node = frontier.pop()
        if node is add:
            return "a scale computed from the residual sum (dynamic scaling; the fused op's is static or per token)"
        if node not in seen and position.get(node, -1) > position[add]:
            seen.add(node)
            frontier.extend(node.all_input_nodes)
    return scale


def match_fp8(norm: Norm, xv, position: dict):
    """The FP8 quantisation of ``norm.out`` that the fused op's FP8 form computes bit for bit
    (the module docstring); None when no FP8 cast follows the norm; else why not (a str)."""
    y = norm.out
    if not _quantised(y):
        return None
    # y's fp32 value: y itself, or its casts to fp32 (one per .float() the model wrote)
    floats = [y] if xv.dtype == torch.float32 else list(y.users)
    if not all(f is y or (_is(f, _CAST) and f.args[1] == torch.float32) for f in floats):
        if all(_is(u, *_QUANT_STEPS) for u in y.users):
            return f"the quantisation computes in {xv.dtype}, not on y.float()"
        return "the normed tensor is used unquantised too (the FP8 form returns only the FP8 values)"
    uses = [u for f in floats for u in f.users]
    divs = [u for u in uses if _is(u, aten.div.Tensor) and u.args[0] in floats]
    absolute = [u for u in uses if _is(u, aten.abs.default)]
    if len(divs) != 1 or len(absolute) > 1 or len(uses) != 1 + len(absolute):
        if any(_is(u, aten.mul.Tensor) for u in uses):
            return "a multiplication by the reciprocal scale (the fused op divides: one FP8 step apart at times)"
        return "the normed tensor is used unquantised too (the FP8 form returns only the FP8 values)"
    quotient = divs[0]
    qv = val(quotient)
    if not isinstance(qv, torch.Tensor) or qv.dtype != torch.float32 or qv.shape != xv.shape:
        return "the quotient is not an fp32 tensor of the activations' shape"
    if absolute:
        scale_out = _per_token_scale(absolute[0], len(xv.shape) - 1)
        if isinstance(scale_out, str):
            return scale_out
        if quotient.args[1] is not scale_out:
            return "y is divided by another scale than its own per-token one"
        scale = None
    else:
        scale_out = None
        scale = _static_scale(quotient.args[1], xv, norm.add, position)
        if isinstance(scale, str):
            return scale
    q = _saturated_cast(quotient)
    return q if isinstance(q, str) else Quant(q, scale, scale_out)

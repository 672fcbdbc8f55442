"""The torch operators behind every public ubnext call (``torch.ops.ubnext.*``).

``ubnext.all_reduce``, ``Communicator.all_reduce`` and the rest validate their arguments and
then call one of these operators, so an eager call and a call inside ``torch.compile`` run the
same implementation: Dynamo sees an opaque operator with a fake (meta) implementation and never
traces the host logic (pool state, the error word, path choice), which reads data. An eager call
with nothing for the dispatcher to do (no mode, profiler, subclass, meta tensor or gradient:
``_plain``) calls that implementation without the dispatcher's round trip; every other call, and
every out= form, goes through the operator.

The operators name their communicator by a string key: a process group's name (the cached
communicator of that group, ``ubnext.get_communicator``) or ``Communicator.key`` (a
communicator constructed by the user). They are defined with ``torch.library.Library`` rather
than the ``custom_op`` decorator: the dispatcher then calls the Python implementation directly,
which costs a few microseconds less per call on the host.

Autograd is attached by the Python entry points at the end of this module, only when a gradient
is wanted: the gradient of an allreduce of partial sums is the identity; the fused norm's
backward is recomputed in closed form from the saved ``residual_out``; all-gather and
reduce-scatter are each other's adjoint, as in torch's functional collectives. The quantisers and
the out= forms refuse an input that requires grad (``not_differentiable``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..reference._blockscale import check_fused_quant_args, check_quantize_block_args, output_specs
from ..reference._checks import (
    FP8,
    check_all_gather_args,
    check_all_reduce_args,
    check_fused_args,
    check_linear_args,
    check_out_overlap,
    check_quantize_args,
    check_reduce_scatter_args,
    check_same_device,
    fp8_output,
    rmsnorm_backward,
)
from ..runtime import _lifecycle
from ._dispatch import dispatcher_callable
from ._target import OpTarget

__all__ = [
    "all_reduce",
    "all_reduce_out",
    "all_reduce_add_rmsnorm",
    "linear_all_reduce",
    "all_gather",
    "all_gather_out",
    "reduce_scatter",
    "reduce_scatter_out",
    "quantize_fp8",
    "quantize",
    "communicator_for",
    "rmsnorm_backward",
    "not_differentiable",
]

_lib = torch.library.Library("ubnext", "DEF")  # noqa: TOR901 - the operators are defined here once
_lib.define("all_reduce(Tensor x, str comm, str torch_symm_op='') -> Tensor")
_lib.define("all_reduce_out(Tensor x, Tensor(a!) out, str comm) -> ()")
_lib.define("linear_all_reduce(Tensor x, Tensor weight, str comm) -> Tensor")
# the FP8 variant is a separate operator, so that the common one neither takes the FP8 arguments
# nor returns an empty scale_inv: both cost host time on every call (docs/PERF.md)
_lib.define("all_reduce_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, str comm) -> (Tensor, Tensor)")
_lib.define(
    "all_reduce_add_rmsnorm_fp8(Tensor x, Tensor residual, Tensor weight, float eps, Tensor? scale, "
    "str comm) -> (Tensor, Tensor, Tensor)"
)
# the block-scaled outputs (quant=fmt: ubnext/reference/_blockscale.py's formats): (q, residual_out, scales)
_lib.define(
    "all_reduce_add_rmsnorm_quant(Tensor x, Tensor residual, Tensor weight, float eps, str fmt, "
    "Tensor? global_scale, bool swizzled, bool ue8m0, str comm) -> (Tensor, Tensor, Tensor)"
)
# FSDP2's collectives (ubnext.fsdp) and the FP8 quantisation of its weights
_lib.define("all_gather(Tensor x, str comm) -> Tensor")
_lib.define("all_gather_out(Tensor x, Tensor(a!) out, str comm) -> ()")
_lib.define("reduce_scatter(Tensor x, float factor, str comm) -> Tensor")
_lib.define("reduce_scatter_out(Tensor x, Tensor(a!) out, float factor, str comm) -> ()")
_lib.define("quantize_fp8(Tensor x, int hidden, Tensor? scale, str comm) -> (Tensor, Tensor)")
# block-scaled formats for the next GEMM (ubnext/reference/_blockscale.py): nvfp4, mxfp8, fp8_group128
_lib.define(
    "quantize(Tensor x, str fmt, Tensor? global_scale, bool swizzled, bool ue8m0, str comm) -> (Tensor, Tensor)"
)


# the communicator an operator's ``comm`` argument names (see the module docstring), as the contract
# the operators may call (_target.OpTarget, which mypy checks the Communicator against); the
# registry's own function, without a frame of ours around it, since every operator call asks
communicator_for: Callable[[str], OpTarget] = _lifecycle.lookup


# -- implementations (real tensors) --------------------------------------------------------------


def _all_reduce_impl(x, comm, torch_symm_op=""):
    c = communicator_for(comm)
    if torch_symm_op:
        return c._all_reduce_torch_symm(x, torch_symm_op)
    return c._all_reduce(x, torch.empty_like(x))


def _all_reduce_out_impl(x, out, comm):
    if out is not x:  # the same object is the in-place form: nothing to compare
        check_out_overlap("all_reduce", x, out)
    communicator_for(comm)._all_reduce(x, out)


def _linear_all_reduce_impl(x, weight, comm):
    return communicator_for(comm)._linear_all_reduce(x, weight)


def _fused_impl(x, residual, weight, eps, comm):
    return communicator_for(comm)._all_reduce_add_rmsnorm(x, residual, weight, eps)


def _fused_fp8_impl(x, residual, weight, eps, scale, comm):
    return communicator_for(comm)._all_reduce_add_rmsnorm(x, residual, weight, eps, scale, fp8=True)


def _fused_quant_impl(x, residual, weight, eps, fmt, global_scale, swizzled, ue8m0, comm):
    return communicator_for(comm)._all_reduce_add_rmsnorm_quant(
        x, residual, weight, eps, fmt, global_scale, swizzled, ue8m0
    )


def _world_size(comm: str) -> int:
    return communicator_for(comm).world_size


def _gathered_shape(x, world_size: int) -> tuple:
    return (world_size * x.shape[0], *x.shape[1:])


def _all_gather_impl(x, comm):
    c = communicator_for(comm)
    check_all_gather_args(x, None, c.world_size)
    out = x.new_empty(_gathered_shape(x, c.world_size))
    c._all_gather(x, out)
    return out


def _all_gather_out_impl(x, out, comm):
    c = communicator_for(comm)
    check_out_overlap("all_gather", x, out, c.rank)
    c._all_gather(x, out)


def _reduce_scatter_impl(x, factor, comm):
    c = communicator_for(comm)
    check_reduce_scatter_args(x, None, c.world_size)
    out = x.new_empty((x.shape[0] // c.world_size, *x.shape[1:]))
    c._reduce_scatter(x, out, factor)
    return out


def _reduce_scatter_out_impl(x, out, factor, comm):
    check_out_overlap("reduce_scatter", x, out, None)
    communicator_for(comm)._reduce_scatter(x, out, factor)


def _quantize_fp8_impl(x, hidden, scale, comm):
    return communicator_for(comm)._quantize_fp8(x, hidden, scale)


def _quantize_impl(x, fmt, global_scale, swizzled, ue8m0, comm):
    return communicator_for(comm)._quantize_blocks(x, fmt, global_scale, swizzled, ue8m0)


for _name, _fn in (
    ("all_reduce", _all_reduce_impl),
    ("all_reduce_out", _all_reduce_out_impl),
    ("linear_all_reduce", _linear_all_reduce_impl),
    ("all_reduce_add_rmsnorm", _fused_impl),
    ("all_reduce_add_rmsnorm_fp8", _fused_fp8_impl),
    ("all_reduce_add_rmsnorm_quant", _fused_quant_impl),
    ("all_gather", _all_gather_impl),
    ("all_gather_out", _all_gather_out_impl),
    ("reduce_scatter", _reduce_scatter_impl),
    ("reduce_scatter_out", _reduce_scatter_out_impl),
    ("quantize_fp8", _quantize_fp8_impl),
    ("quantize", _quantize_impl),
):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


# -- fake implementations (tracing) --------------------------------------------------------------
# They also run for a real call with any argument on the meta device (the dispatcher picks the Meta
# kernel for the whole call), so each checks that its tensors share x's device: otherwise a CPU call
# with a meta weight would return uninitialised outputs without running anything.


@torch.library.register_fake("ubnext::all_reduce", lib=_lib)
def _(x, comm, torch_symm_op=""):
    check_all_reduce_args(x)
    return torch.empty_like(x)


@torch.library.register_fake("ubnext::all_reduce_out", lib=_lib)
def _(x, out, comm):
    check_all_reduce_args(x, out)
    check_same_device("x out", x, out)
    check_out_overlap("all_reduce", x, out, by_storage=True)


@torch.library.register_fake("ubnext::linear_all_reduce", lib=_lib)
def _(x, weight, comm):
    check_linear_args(x, weight)
    check_same_device("x weight", x, weight)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("ubnext::all_reduce_add_rmsnorm", lib=_lib)
def _(x, residual, weight, eps, comm):
    check_fused_args(x, residual, weight, eps, False, None)
    check_same_device("x residual weight", x, residual, weight)
    return torch.empty_like(x), torch.empty_like(residual)


@torch.library.register_fake("ubnext::all_reduce_add_rmsnorm_fp8", lib=_lib)
def _(x, residual, weight, eps, scale, comm):
    check_fused_args(x, residual, weight, eps, True, scale)
    check_same_device("x residual weight scale", x, residual, weight, scale)
    scale_inv = x.new_empty(1 if scale is not None else x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, dtype=FP8), torch.empty_like(residual), scale_inv


@torch.library.register_fake("ubnext::all_reduce_add_rmsnorm_quant", lib=_lib)
def _(x, residual, weight, eps, fmt, global_scale, swizzled, ue8m0, comm):
    check_fused_quant_args(x, residual, weight, eps, fmt, global_scale, swizzled, ue8m0)
    check_same_device("x residual weight global_scale", x, residual, weight, global_scale)
    (q_shape, q_dtype), (s_shape, s_dtype) = output_specs(x, fmt, swizzled)
    return x.new_empty(q_shape, dtype=q_dtype), torch.empty_like(residual), x.new_empty(s_shape, dtype=s_dtype)


@torch.library.register_fake("ubnext::all_gather", lib=_lib)
def _(x, comm):
    world_size = _world_size(comm)
    check_all_gather_args(x, None, world_size)
    return x.new_empty(_gathered_shape(x, world_size))


@torch.library.register_fake("ubnext::all_gather_out", lib=_lib)
def _(x, out, comm):
    check_same_device("x out", x, out)
    c = communicator_for(comm)
    check_all_gather_args(x, out, c.world_size)
    check_out_overlap("all_gather", x, out, c.rank, by_storage=True)


@torch.library.register_fake("ubnext::reduce_scatter", lib=_lib)
def _(x, factor, comm):
    world_size = _world_size(comm)
    check_reduce_scatter_args(x, None, world_size)
    return x.new_empty((x.shape[0] // world_size, *x.shape[1:]))


@torch.library.register_fake("ubnext::reduce_scatter_out", lib=_lib)
def _(x, out, factor, comm):
    check_same_device("x out", x, out)
    check_reduce_scatter_args(x, out, _world_size(comm))
    check_out_overlap("reduce_scatter", x, out, None, by_storage=True)


@torch.library.register_fake("ubnext::quantize_fp8", lib=_lib)
def _(x, hidden, scale, comm):
    check_quantize_args(x, hidden, scale)
    check_same_device("x scale", x, scale)
    return torch.empty_like(x, dtype=FP8), x.new_empty(
        1 if scale is not None else x.numel() // hidden, dtype=torch.float32
    )


@torch.library.register_fake("ubnext::quantize", lib=_lib)
def _(x, fmt, global_scale, swizzled, ue8m0, comm):
    check_quantize_block_args(x, fmt, global_scale, swizzled, ue8m0)
    check_same_device("x global_scale", x, global_scale)
    (q_shape, q_dtype), (s_shape, s_dtype) = output_specs(x, fmt, swizzled)
    return x.new_empty(q_shape, dtype=q_dtype), x.new_empty(s_shape, dtype=s_dtype)


# -- autograd --------------------------------------------------------------------------------------
# Autograd lives in the Python entry points below, not in the dispatcher: a Python autograd
# kernel (torch.library.register_autograd) runs on every call, grad or not, and costs about
# 6 us of host time per call here; these Functions run only when a gradient is wanted. Calling
# torch.ops.ubnext.* directly on tensors that require grad gives outputs that require grad and whose
# backward leaves the inputs' grad None (torch's autograd-not-implemented fallback: a warning only):
# call the entry points.


def _requires_grad(t) -> bool:
    """Whether ``t`` requires grad; False for what is not a tensor, which the operator's checks name."""
    return getattr(t, "requires_grad", False)


_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._is_torch_function_mode_enabled
_profiling = torch.autograd._profiler_enabled
# functorch's transforms (vmap, grad, jvp, functionalize) wrap tensors that are still torch.Tensor by type
_transforms = torch._C._are_functorch_transforms_active
_jit_tracing = torch._C._get_tracing_state


def _plain(*tensors: torch.Tensor | None) -> bool:
    """Whether an eager call on ``tensors`` (None: an optional one not given) may run its operator's
    implementation without the dispatcher's round trip (about 2 us a call): only where the dispatcher
    would do nothing else. Not while Dynamo or torch.jit.trace traces, inside a functorch transform
    (its wrapped tensors are torch.Tensor by type), under a Python dispatch or function mode or the
    profiler, nor for a subclass or a meta tensor. The caller passes every tensor, and calls this only
    where no gradient is wanted and nothing is mutated. docs/ARCHITECTURE.md says why each case."""
    if (
        _is_compiling()
        or _dispatch_modes()
        or _function_modes()
        or _profiling()
        or _transforms()
        or _jit_tracing() is not None
    ):
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TYPES or t.is_meta):
            return False
    return True


# a Parameter dispatches as a plain tensor (its __torch_function__ is torch's disabled one, and it has
# no __torch_dispatch__): a layer's weight must not send its every call through the dispatcher
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


# (OpOverloadPacket, its dispatcher callable) of each operator the entry points below call; an
# entry point calls `(packet if _is_compiling() else direct)(...)`
_ALL_REDUCE = dispatcher_callable("all_reduce")
_ALL_REDUCE_OUT = dispatcher_callable("all_reduce_out")
_LINEAR_ALL_REDUCE = dispatcher_callable("linear_all_reduce")
_FUSED = dispatcher_callable("all_reduce_add_rmsnorm")
_FUSED_FP8 = dispatcher_callable("all_reduce_add_rmsnorm_fp8")
_FUSED_QUANT = dispatcher_callable("all_reduce_add_rmsnorm_quant")
_ALL_GATHER = dispatcher_callable("all_gather")
_ALL_GATHER_OUT = dispatcher_callable("all_gather_out")
_REDUCE_SCATTER = dispatcher_callable("reduce_scatter")
_REDUCE_SCATTER_OUT = dispatcher_callable("reduce_scatter_out")
_QUANTIZE_FP8 = dispatcher_callable("quantize_fp8")
_QUANTIZE = dispatcher_callable("quantize")


def not_differentiable(what: str, instead: str) -> RuntimeError:
    """The error of an entry point whose output has no gradient (a quantised output, an out= form),
    called in grad mode on an input that requires one: refused, rather than an output that requires
    grad and whose backward leaves the input's grad None."""
    return RuntimeError(f"{what} is not differentiable; call it under torch.no_grad() or {instead}")


class _AllReduceGrad(torch.autograd.Function):
    """The gradient of an allreduce of partial sums is the identity."""

    @staticmethod
    def forward(ctx, x, comm, torch_symm_op):
        return _ALL_REDUCE[0](x, comm, torch_symm_op)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _LinearAllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, comm):
        ctx.save_for_backward(x, weight)
        return _LINEAR_ALL_REDUCE[0](x, weight, comm)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight)
        grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None


class _AllGatherGrad(torch.autograd.Function):
    """torch's functional collectives' rule (all_gather_into_tensor's backward): the gradient of an
    all-gather is the reduce-scatter (sum) of the output's gradient, each rank its own shard."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _ALL_GATHER[0](x, comm)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad.contiguous(), 1.0, ctx.comm), None


class _ReduceScatterGrad(torch.autograd.Function):
    """Rank r's output is ``factor`` x the sum of every rank's shard r, so the gradient of each rank's
    input is ``factor`` x the all-gather of the output's gradient: torch's functional collectives'
    backward (reduce_scatter_tensor's all-gather) for "sum", scaled by 1/world for "avg" and by f for
    PREMUL_SUM(f). (torch's functional reduce_scatter refuses "avg" at backward, and
    torch.distributed.nn.functional.reduce_scatter gives "avg" the sum's gradient: the world size too
    large.)"""

    @staticmethod
    def forward(ctx, x, factor, comm):
        ctx.factor, ctx.comm = factor, comm
        return _REDUCE_SCATTER[0](x, factor, comm)

    @staticmethod
    def backward(ctx, grad):
        gathered = all_gather(grad.contiguous(), ctx.comm)
        return (gathered if ctx.factor == 1.0 else gathered * ctx.factor), None, None


class _FusedGrad(torch.autograd.Function):
    """residual_out = allreduce(x) + residual; out = rmsnorm(residual_out) * weight. The
    backward recomputes the norm from the saved residual_out."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, fp8, scale, comm):
        out, residual_out, scale_inv = _fused(x, residual, weight, eps, fp8, scale, comm)
        if scale_inv is None:
            scale_inv = x.new_empty(0, dtype=torch.float32)  # a Function's outputs are tensors
        ctx.save_for_backward(residual_out, weight)
        ctx.eps, ctx.fp8 = eps, fp8
        ctx.mark_non_differentiable(scale_inv)
        return out, residual_out, scale_inv

    @staticmethod
    def backward(ctx, grad_out, grad_residual_out, grad_scale_inv):
        residual_out, weight = ctx.saved_tensors
        if ctx.fp8 and grad_out is not None and bool(grad_out.ne(0).any()):
            raise RuntimeError("the FP8 output of ubnext's fused norm is not differentiable")
        r = residual_out.float()
        if grad_out is None or ctx.fp8:
            grad_r, grad_w = torch.zeros_like(r), torch.zeros_like(weight, dtype=torch.float32)
        else:
            grad_r, grad_w = rmsnorm_backward(r, weight.float(), ctx.eps, grad_out.float())
        if grad_residual_out is not None:
            grad_r = grad_r + grad_residual_out.float()
        # the gradient reaches x (through the allreduce, whose gradient is the identity) and
        # residual unchanged
        grad = grad_r.to(residual_out.dtype)
        return grad, grad, grad_w.to(weight.dtype), None, None, None, None


# -- Python entry points (the public API and ubnext.nn call these) -------------------------------
# ``comm`` is a process group's name or a Communicator's key (see the module docstring).


def all_reduce(x: torch.Tensor, comm: str, torch_symm_op: str = "") -> torch.Tensor:
    """Allreduce by the communicator's path choice, or by a named torch symmetric-memory op
    (``one_shot_all_reduce``, ``two_shot_all_reduce_``, ``multimem_all_reduce_``) where
    that op exists, else by the path choice."""
    if torch.is_grad_enabled() and _requires_grad(x):
        return _AllReduceGrad.apply(x, comm, torch_symm_op)
    if _plain(x):
        return _all_reduce_impl(x, comm, torch_symm_op)
    packet, direct = _ALL_REDUCE
    return (packet if _is_compiling() else direct)(x, comm, torch_symm_op)


def all_reduce_out(x: torch.Tensor, out: torch.Tensor, comm: str) -> torch.Tensor:
    """Allreduce into ``out`` (which may be ``x``); like torch's out= variants, not differentiable."""
    if torch.is_grad_enabled() and (_requires_grad(x) or _requires_grad(out)):
        raise not_differentiable("all_reduce(..., out=...)", "without out= to get a gradient")
    packet, direct = _ALL_REDUCE_OUT
    (packet if _is_compiling() else direct)(x, out, comm)
    return out


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, comm: str) -> torch.Tensor:
    if torch.is_grad_enabled() and (_requires_grad(x) or _requires_grad(weight)):
        return _LinearAllReduceGrad.apply(x, weight, comm)
    if _plain(x, weight):
        return _linear_all_reduce_impl(x, weight, comm)
    packet, direct = _LINEAR_ALL_REDUCE
    return (packet if _is_compiling() else direct)(x, weight, comm)


def all_reduce_add_rmsnorm(
    x,
    residual,
    weight,
    eps: float,
    comm: str,
    out_dtype=None,
    scale: torch.Tensor | None = None,
    quant: str | None = None,
    global_scale: torch.Tensor | None = None,
    swizzled: bool = False,
    ue8m0: bool = False,
):
    if quant is not None or global_scale is not None or swizzled or ue8m0:
        return _fused_quant(
            x, residual, weight, float(eps), comm, out_dtype, scale, quant, global_scale, bool(swizzled), bool(ue8m0)
        )
    fp8 = (out_dtype is not None or scale is not None) and fp8_output(x, out_dtype, scale)
    if torch.is_grad_enabled() and (_requires_grad(x) or _requires_grad(residual) or _requires_grad(weight)):
        out, residual_out, scale_inv = _FusedGrad.apply(x, residual, weight, float(eps), fp8, scale, comm)
        return out, residual_out, (scale_inv if fp8 else None)
    return _fused(x, residual, weight, float(eps), fp8, scale, comm)


def _fused(x, residual, weight, eps: float, fp8: bool, scale, comm: str):
    """(out, residual_out, scale_inv or None) through the operator for the output's kind."""
    if fp8:
        if _plain(x, residual, weight, scale):
            return _fused_fp8_impl(x, residual, weight, eps, scale, comm)
        packet, direct = _FUSED_FP8
        return (packet if _is_compiling() else direct)(x, residual, weight, eps, scale, comm)
    if _plain(x, residual, weight):
        out, residual_out = _fused_impl(x, residual, weight, eps, comm)
    else:
        packet, direct = _FUSED
        out, residual_out = (packet if _is_compiling() else direct)(x, residual, weight, eps, comm)
    return out, residual_out, None


def _fused_quant(
    x, residual, weight, eps: float, comm: str, out_dtype, scale, quant, global_scale, swizzled: bool, ue8m0: bool
):
    """(q, residual_out, scales) of the block-scaled form; no gradient (a quantised output has none)."""
    if quant is None:
        raise ValueError(
            "global_scale, swizzled and ue8m0 describe a block-scaled output: pass quant= "
            "('nvfp4', 'mxfp8' or 'fp8_group128') with them"
        )
    if out_dtype is not None or scale is not None:
        raise ValueError(
            f"quant={quant!r} writes its own output format and scales: it excludes out_dtype and "
            "scale (the per-token / static FP8 form); pass one or the other"
        )
    if torch.is_grad_enabled() and (_requires_grad(x) or _requires_grad(residual) or _requires_grad(weight)):
        raise not_differentiable(f"the quantised ({quant}) output of ubnext's fused norm", "without quant=")
    packet, direct = _FUSED_QUANT
    return (packet if _is_compiling() else direct)(x, residual, weight, eps, quant, global_scale, swizzled, ue8m0, comm)


def all_gather(x: torch.Tensor, comm: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along the first dimension; its gradient reduce-scatters the
    output's (_AllGatherGrad)."""
    if torch.is_grad_enabled() and _requires_grad(x):
        return _AllGatherGrad.apply(x, comm)
    packet, direct = _ALL_GATHER
    return (packet if _is_compiling() else direct)(x, comm)


def all_gather_out(x: torch.Tensor, out: torch.Tensor, comm: str) -> torch.Tensor:
    """All-gather into ``out``; like torch's out= variants, not differentiable."""
    if torch.is_grad_enabled() and (_requires_grad(x) or _requires_grad(out)):
        raise not_differentiable("all_gather(..., out=...)", "without out= to get a gradient")
    packet, direct = _ALL_GATHER_OUT
    (packet if _is_compiling() else direct)(x, out, comm)
    return out


def reduce_scatter(x: torch.Tensor, factor: float, comm: str) -> torch.Tensor:
    """This rank's shard of ``factor`` x the sum over the ranks; its gradient all-gathers the
    output's, times ``factor`` (_ReduceScatterGrad)."""
    if torch.is_grad_enabled() and _requires_grad(x):
        return _ReduceScatterGrad.apply(x, factor, comm)
    packet, direct = _REDUCE_SCATTER
    return (packet if _is_compiling() else direct)(x, factor, comm)


def reduce_scatter_out(x: torch.Tensor, out: torch.Tensor, factor: float, comm: str) -> torch.Tensor:
    """Reduce-scatter into ``out``; like torch's out= variants, not differentiable."""
    if torch.is_grad_enabled() and (_requires_grad(x) or _requires_grad(out)):
        raise not_differentiable("reduce_scatter(..., out=...)", "without out= to get a gradient")
    packet, direct = _REDUCE_SCATTER_OUT
    (packet if _is_compiling() else direct)(x, out, factor, comm)
    return out


def quantize_fp8(x: torch.Tensor, hidden: int, scale: torch.Tensor | None, comm: str):
    """(q, scale_inv) in e4m3; no gradient (a quantised output has none)."""
    if torch.is_grad_enabled() and _requires_grad(x):
        raise not_differentiable("comm.quantize_fp8's e4m3 output", "on x.detach()")
    packet, direct = _QUANTIZE_FP8
    return (packet if _is_compiling() else direct)(x, hidden, scale, comm)


def quantize(x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None, swizzled: bool, ue8m0: bool, comm: str):
    """(q, scales) in a block-scaled format; no gradient (a quantised output has none)."""
    if torch.is_grad_enabled() and _requires_grad(x):
        raise not_differentiable(f"comm.quantize's {fmt} output", "on x.detach()")
    packet, direct = _QUANTIZE
    return (packet if _is_compiling() else direct)(x, fmt, global_scale, swizzled, ue8m0, comm)

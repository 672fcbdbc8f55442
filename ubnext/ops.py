"""The torch operators behind every public ubnext call (``torch.ops.ubnext.*``).

``ubnext.all_reduce``, ``Communicator.all_reduce`` and the rest validate their arguments and
then call one of these operators, so an eager call and a call inside ``torch.compile`` take the
same path: Dynamo sees an opaque operator with a fake (meta) implementation and never traces the
host logic (pool state, the error word, path choice), which reads data.

The operators name their communicator by a string key: a process group's name (the cached
communicator of that group, ``ubnext.get_communicator``) or ``Communicator.key`` (a
communicator constructed by the user). They are defined with ``torch.library.Library`` rather
than the ``custom_op`` decorator: the dispatcher then calls the Python implementation directly,
which costs a few microseconds less per call on the host.

Autograd: the gradient of an allreduce of partial sums is the identity; the fused norm's backward
is recomputed in torch from the saved ``residual_out``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _lifecycle
from .comm import FP8, Communicator, check_all_reduce_args, check_fused_args, fp8_output, rmsnorm

__all__ = ["all_reduce", "all_reduce_add_rmsnorm", "linear_all_reduce", "communicator_for"]

_lib = torch.library.Library("ubnext", "DEF")  # noqa: TOR901 - the operators are defined here once
_lib.define("all_reduce(Tensor x, str comm, str torch_symm_op='') -> Tensor")
_lib.define("all_reduce_out(Tensor x, Tensor(a!) out, str comm) -> ()")
_lib.define("linear_all_reduce(Tensor x, Tensor weight, str comm) -> Tensor")
_lib.define("all_reduce_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, bool fp8, "
            "Tensor? scale, str comm) -> (Tensor, Tensor, Tensor)")


def communicator_for(key: str) -> Communicator:
    """The communicator an operator's ``comm`` argument names (see the module docstring)."""
    return _lifecycle.lookup(key)


# -- implementations (real tensors) --------------------------------------------------------------


def _all_reduce_impl(x, comm, torch_symm_op=""):
    c = communicator_for(comm)
    if torch_symm_op:
        return c._all_reduce_torch_symm(x, torch_symm_op)
    return c._all_reduce(x, torch.empty_like(x))


def _all_reduce_out_impl(x, out, comm):
    communicator_for(comm)._all_reduce(x, out)


def _linear_all_reduce_impl(x, weight, comm):
    c = communicator_for(comm)
    # the GEMM writes straight into the pool, where the allreduce runs in place
    y = c.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    torch.matmul(x, weight.t(), out=y)
    return c._all_reduce(y, y)


def _fused_impl(x, residual, weight, eps, fp8, scale, comm):
    out, residual_out, scale_inv = communicator_for(comm)._all_reduce_add_rmsnorm(
        x, residual, weight, eps, FP8 if fp8 else x.dtype, scale)
    if scale_inv is None:
        scale_inv = torch.empty(0, dtype=torch.float32, device=x.device)
    return out, residual_out, scale_inv


for _name, _fn in (("all_reduce", _all_reduce_impl), ("all_reduce_out", _all_reduce_out_impl),
                   ("linear_all_reduce", _linear_all_reduce_impl), ("all_reduce_add_rmsnorm", _fused_impl)):
    _lib.impl(_name, _fn, "CompositeExplicitAutograd")


# -- fake implementations (tracing) --------------------------------------------------------------


@torch.library.register_fake("ubnext::all_reduce", lib=_lib)
def _(x, comm, torch_symm_op=""):
    check_all_reduce_args(x)
    return torch.empty_like(x)


@torch.library.register_fake("ubnext::all_reduce_out", lib=_lib)
def _(x, out, comm):
    check_all_reduce_args(x, out)


@torch.library.register_fake("ubnext::linear_all_reduce", lib=_lib)
def _(x, weight, comm):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.register_fake("ubnext::all_reduce_add_rmsnorm", lib=_lib)
def _(x, residual, weight, eps, fp8, scale, comm):
    check_fused_args(x, residual, weight, eps, fp8, scale)
    out = torch.empty_like(x, dtype=FP8 if fp8 else x.dtype)
    if not fp8:
        scale_inv = x.new_empty(0, dtype=torch.float32)
    elif scale is not None:
        scale_inv = x.new_empty(1, dtype=torch.float32)
    else:
        scale_inv = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return out, torch.empty_like(residual), scale_inv


# -- autograd --------------------------------------------------------------------------------------


def _identity_backward(ctx, grad):
    return grad, None, None


torch.library.register_autograd("ubnext::all_reduce", _identity_backward, lib=_lib)


def _linear_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad.matmul(weight)
    grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
    return grad_x, grad_w, None


torch.library.register_autograd("ubnext::linear_all_reduce", _linear_backward,
                                setup_context=_linear_setup, lib=_lib)


def _fused_setup(ctx, inputs, output):
    _, _, weight, eps, fp8, _, _ = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps, ctx.fp8 = eps, fp8


def _fused_backward(ctx, grad_out, grad_residual_out, grad_scale_inv):
    residual_out, weight = ctx.saved_tensors
    if ctx.fp8 and grad_out is not None and bool(grad_out.ne(0).any()):
        raise RuntimeError("the FP8 output of ubnext's fused norm is not differentiable")
    with torch.enable_grad():
        r = residual_out.detach().float().requires_grad_()
        w = weight.detach().float().requires_grad_()
        y = rmsnorm(r, w, ctx.eps)
        g_out = torch.zeros_like(y) if (grad_out is None or ctx.fp8) else grad_out.float()
        grad_r, grad_w = torch.autograd.grad(y, (r, w), g_out)
    if grad_residual_out is not None:
        grad_r = grad_r + grad_residual_out.float()
    # residual_out = allreduce(x) + residual: the gradient reaches x (through the allreduce,
    # whose gradient is the identity) and residual unchanged
    grad = grad_r.to(residual_out.dtype)
    return grad, grad, grad_w.to(weight.dtype), None, None, None, None


torch.library.register_autograd("ubnext::all_reduce_add_rmsnorm", _fused_backward,
                                setup_context=_fused_setup, lib=_lib)


# -- Python entry points by process-group name (ubnext.nn uses these) ----------------------------


def all_reduce(x: torch.Tensor, group_name: str, torch_symm_op: str = "") -> torch.Tensor:
    """Allreduce by the communicator's path choice, or by a named torch symmetric-memory op
    (``one_shot_all_reduce``, ``two_shot_all_reduce_``, ``multimem_all_reduce_``) where
    that op exists, else by the path choice."""
    return torch.ops.ubnext.all_reduce(x, group_name, torch_symm_op)


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.ops.ubnext.linear_all_reduce(x, weight, group_name)


def all_reduce_add_rmsnorm(x, residual, weight, eps: float, group_name: str, *, out_dtype=None,
                           scale: Optional[torch.Tensor] = None):
    fp8 = fp8_output(x, out_dtype, scale)
    out, residual_out, scale_inv = torch.ops.ubnext.all_reduce_add_rmsnorm(
        x, residual, weight, float(eps), fp8, scale, group_name)
    return out, residual_out, (scale_inv if fp8 else None)

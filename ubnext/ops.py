"""torch custom ops, so that compiled modules call ubnext without a graph break.

The ops name the process group by its ``group_name`` (custom ops take no Python objects) and
run on the cached communicator of that group. Each has a fake implementation for tracing and
an autograd formula: the gradient of an allreduce of partial sums is the identity, and the
fused norm's backward is recomputed in torch from the saved ``residual_out``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .comm import FP8, Communicator, rmsnorm

__all__ = ["all_reduce", "all_reduce_add_rmsnorm", "linear_all_reduce", "communicator_for"]


def communicator_for(group_name: str) -> Communicator:
    from . import get_communicator

    group = dist.distributed_c10d._resolve_process_group(group_name)
    return get_communicator(group)


# -- all_reduce ---------------------------------------------------------------------------------


@torch.library.custom_op("ubnext::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group_name: str, torch_symm_op: str) -> torch.Tensor:
    comm = communicator_for(group_name)
    if torch_symm_op:
        return comm.all_reduce_torch_symm(x, torch_symm_op)
    return comm.all_reduce(x)


@_all_reduce.register_fake
def _(x, group_name, torch_symm_op):
    return torch.empty_like(x)


def _identity_backward(ctx, grad):
    return grad, None, None


_all_reduce.register_autograd(_identity_backward)


def all_reduce(x: torch.Tensor, group_name: str, torch_symm_op: str = "") -> torch.Tensor:
    """Allreduce by the communicator's path choice, or by a named torch symmetric-memory op
    (``one_shot_all_reduce``, ``two_shot_all_reduce_``, ``multimem_all_reduce_``) where
    that op exists, else by the path choice."""
    return torch.ops.ubnext.all_reduce(x, group_name, torch_symm_op)


# -- row-parallel GEMM straight into the pool, then allreduce in place -------------------------


@torch.library.custom_op("ubnext::linear_all_reduce", mutates_args=())
def _linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> torch.Tensor:
    comm = communicator_for(group_name)
    y = comm.empty(*x.shape[:-1], weight.shape[0], dtype=x.dtype)
    torch.matmul(x, weight.t(), out=y)
    return comm.all_reduce(y, out=y)


@_linear_all_reduce.register_fake
def _(x, weight, group_name):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = grad.matmul(weight)
    grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
    return grad_x, grad_w, None


_linear_all_reduce.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear_all_reduce(x: torch.Tensor, weight: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.ops.ubnext.linear_all_reduce(x, weight, group_name)


# -- fused allreduce + residual add + RMSNorm (+FP8) ---------------------------------------------


@torch.library.custom_op("ubnext::all_reduce_add_rmsnorm", mutates_args=())
def _fused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fp8: bool,
           scale: Optional[torch.Tensor], group_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    comm = communicator_for(group_name)
    out, residual_out, scale_inv = comm.all_reduce_add_rmsnorm(
        x, residual, weight, eps, out_dtype=FP8 if fp8 else None, scale=scale)
    if scale_inv is None:
        scale_inv = torch.empty(0, dtype=torch.float32, device=x.device)
    return out, residual_out, scale_inv


@_fused.register_fake
def _(x, residual, weight, eps, fp8, scale, group_name):
    out = torch.empty_like(x, dtype=FP8 if fp8 else x.dtype)
    if not fp8:
        scale_inv = x.new_empty(0, dtype=torch.float32)
    elif scale is not None:
        scale_inv = x.new_empty(1, dtype=torch.float32)
    else:
        scale_inv = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return out, torch.empty_like(residual), scale_inv


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


_fused.register_autograd(_fused_backward, setup_context=_fused_setup)


def all_reduce_add_rmsnorm(x, residual, weight, eps: float, group_name: str, *, out_dtype=None, scale=None):
    fp8 = out_dtype == FP8
    out, residual_out, scale_inv = torch.ops.ubnext.all_reduce_add_rmsnorm(
        x, residual, weight, float(eps), fp8, scale, group_name)
    return out, residual_out, (scale_inv if fp8 else None)

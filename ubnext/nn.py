"""Tensor-parallel Linear with a choice of allreduce (``symmetric_ar_type``).

Sharded like TransformerEngine's Linear:

* ``parallel_mode='column'``: weight ``[out/tp, in]``, bias ``[out/tp]``; the output stays
  sharded; the backward all-reduces the input gradient.
* ``parallel_mode='row'``: weight ``[out, in/tp]``, bias ``[out]`` added once after the
  allreduce; the input is sharded along its last dimension; the output is all-reduced by
  ``symmetric_ar_type``:

  - ``None`` / ``'nccl'``: torch.distributed;
  - ``'ubnext'``: the ubnext allreduce, with the GEMM writing straight into the pool;
  - ``'ubnext_add_rms'``: the layer owns the RMSNorm weight that follows the residual add;
    ``forward(x, residual)`` returns ``(normed, residual_out)`` (linear -> allreduce -> add ->
    norm, fused);
  - ``'one_shot'``, ``'two_shot'``, ``'multimem_all_reduce'``: torch symmetric-memory ops where
    they exist (CUDA), else the ubnext fallback chain.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import ops

__all__ = ["Linear", "SYMMETRIC_AR_TYPES"]

log = logging.getLogger("ubnext")

SYMMETRIC_AR_TYPES = (None, "nccl", "ubnext", "ubnext_add_rms", "one_shot", "two_shot", "multimem_all_reduce")
_TORCH_SYMM_OPS = {"one_shot": "one_shot_all_reduce", "two_shot": "two_shot_all_reduce_",
                   "multimem_all_reduce": "multimem_all_reduce_"}


class _AllReduceTorch(torch.autograd.Function):
    """torch.distributed allreduce of partial sums; its gradient is the identity."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduces the gradient (column-parallel input)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Linear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group=None,
                 parallel_mode: str | None = None, symmetric_ar_type: str | None = None,
                 eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        if parallel_mode not in (None, "row", "column"):
            raise ValueError(f"parallel_mode must be None, 'row' or 'column', got {parallel_mode!r}")
        if symmetric_ar_type not in SYMMETRIC_AR_TYPES:
            raise ValueError(f"symmetric_ar_type must be one of {SYMMETRIC_AR_TYPES}, got {symmetric_ar_type!r}")
        if symmetric_ar_type not in (None, "nccl") and parallel_mode != "row":
            raise ValueError(f"symmetric_ar_type={symmetric_ar_type!r} applies to parallel_mode='row' only")
        self.tp_group = tp_group
        if parallel_mode is None:
            tp = 1
        else:
            if not dist.is_initialized():
                raise RuntimeError("a tensor-parallel Linear needs torch.distributed to be initialised")
            tp = dist.get_world_size(tp_group)
        self.tp_size = tp
        # the name under which torch.ops.ubnext.* find the group's communicator: resolved once
        self._group_name = self._group().group_name if parallel_mode is not None else ""
        self.parallel_mode = parallel_mode
        self.symmetric_ar_type = symmetric_ar_type
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        local_in, local_out = in_features, out_features
        if parallel_mode == "column":
            if out_features % tp:
                raise ValueError(f"out_features={out_features} is not divisible by the TP size {tp}")
            local_out = out_features // tp
        elif parallel_mode == "row":
            if in_features % tp:
                raise ValueError(f"in_features={in_features} is not divisible by the TP size {tp}")
            local_in = in_features // tp
        factory = {"device": device, "dtype": dtype}
        self.weight = torch.nn.Parameter(torch.empty(local_out, local_in, **factory))
        self.bias = torch.nn.Parameter(torch.empty(local_out, **factory)) if bias else None
        self.norm_weight = (torch.nn.Parameter(torch.ones(out_features, **factory))
                            if symmetric_ar_type == "ubnext_add_rms" else None)
        self.reset_parameters()
        if symmetric_ar_type in ("ubnext", "ubnext_add_rms"):
            comm = ops.communicator_for(self._group_name)
            comm.register_hidden(out_features)

    def reset_parameters(self) -> None:
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def _group(self):
        return self.tp_group if self.tp_group is not None else dist.group.WORLD

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if (residual is not None) != (self.symmetric_ar_type == "ubnext_add_rms"):
            raise ValueError("forward(x, residual) takes a residual exactly when symmetric_ar_type='ubnext_add_rms'")
        if self.parallel_mode == "column":
            return F.linear(_CopyToTensorParallel.apply(x, self._group()), self.weight, self.bias)
        if self.parallel_mode != "row":
            return F.linear(x, self.weight, self.bias)
        x = x.contiguous()
        kind = self.symmetric_ar_type
        if kind == "ubnext_add_rms":
            partial = F.linear(x, self.weight)
            if self.bias is not None:
                residual = residual + self.bias  # added once, before the fused norm
            normed, residual_out, _ = ops.all_reduce_add_rmsnorm(
                partial, residual.contiguous(), self.norm_weight, self.eps, self._group_name)
            return normed, residual_out
        if kind == "ubnext":
            y = ops.linear_all_reduce(x, self.weight, self._group_name)
        elif kind in _TORCH_SYMM_OPS:
            y = ops.all_reduce(F.linear(x, self.weight).contiguous(), self._group_name, _TORCH_SYMM_OPS[kind])
        else:
            y = _AllReduceTorch.apply(F.linear(x, self.weight), self._group())
        return y + self.bias if self.bias is not None else y

"""Tensor-parallel Linear with a choice of allreduce (``symmetric_ar_type``).

Sharded like TransformerEngine's Linear:

* ``parallel_mode='column'``: weight ``[out/tp, in]``, bias ``[out/tp]``; the output stays
  sharded; the backward all-reduces the input gradient, through torch.distributed (``None`` /
  ``'nccl'``) or ubnext's path choice and fallback chain (``'ubnext'``).
* ``parallel_mode='row'``: weight ``[out, in/tp]``, bias ``[out]`` added once after the
  allreduce; the input is sharded along its last dimension; the output is all-reduced by
  ``symmetric_ar_type``:

  - ``None`` / ``'nccl'``: torch.distributed;
  - ``'ubnext'``: the ubnext allreduce, with the GEMM writing straight into the pool;
  - ``'ubnext_add_rms'``: the layer owns the RMSNorm weight that follows the residual add;
    ``forward(x, residual)`` returns ``(normed, residual_out)`` (linear -> allreduce -> add ->
    norm, fused); with ``quant='nvfp4' | 'mxfp8' | 'fp8_group128'`` (and ``quant_swizzled``,
    ``quant_ue8m0``) it returns ``(q, residual_out, scales)`` for the next block-scaled GEMM
    instead (``forward(x, residual, global_scale=...)`` for two-level NVFP4; no gradient);
  - ``'one_shot'``, ``'two_shot'``, ``'multimem_all_reduce'``: torch symmetric-memory ops where
    they exist (CUDA), else the ubnext fallback chain.

Rank r of a group of tp holds rows ``[r*out/tp, (r+1)*out/tp)`` of the dense weight and bias
(column), or columns ``[r*in/tp, (r+1)*in/tp)`` of the dense weight and the whole bias (row):
``Linear.from_dense`` takes that shard of an ``nn.Linear``. ``layer.comm`` is the group's
communicator and ``layer.last_path`` the path of the layer's last allreduce.
"""

from __future__ import annotations

import logging
import math
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import ops
from .reference._blockscale import BLOCKS

__all__ = ["Linear", "SYMMETRIC_AR_TYPES"]

log = logging.getLogger("ubnext")

SYMMETRIC_AR_TYPES = (None, "nccl", "ubnext", "ubnext_add_rms", "one_shot", "two_shot", "multimem_all_reduce")
_TORCH_SYMM_OPS = {
    "one_shot": "one_shot_all_reduce",
    "two_shot": "two_shot_all_reduce_",
    "multimem_all_reduce": "multimem_all_reduce_",
}


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
    """Identity forward; all-reduces the gradient (column-parallel input), through ubnext's
    path choice (``group_name`` given) or torch.distributed, and records the path in the layer."""

    @staticmethod
    def forward(ctx, x, layer, group_name):
        ctx.layer, ctx.group_name = layer, group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.group_name:
            grad = ops.all_reduce(grad.contiguous(), ctx.group_name)
            ctx.layer._record()
        else:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.layer._group())
            ctx.layer._record("torch")
        return grad, None, None


class Linear(torch.nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group=None,
        parallel_mode: str | None = None,
        symmetric_ar_type: str | None = None,
        eps: float = 1e-6,
        device=None,
        dtype=None,
        quant: str | None = None,
        quant_swizzled: bool = False,
        quant_ue8m0: bool = False,
    ):
        super().__init__()
        if quant is not None or quant_swizzled or quant_ue8m0:
            if symmetric_ar_type != "ubnext_add_rms":
                raise ValueError(
                    "quant= names the block-scaled output of the fused norm: it needs "
                    f"symmetric_ar_type='ubnext_add_rms', got {symmetric_ar_type!r}"
                )
            if quant not in BLOCKS:
                raise ValueError(f"quant must be one of {sorted(BLOCKS)}, got {quant!r}")
            if out_features % BLOCKS[quant]:
                raise ValueError(
                    f"K = {out_features} (out_features, the normed row) is not a multiple of the "
                    f"{quant} block of {BLOCKS[quant]} elements"
                )
        self.quant, self.quant_swizzled, self.quant_ue8m0 = quant, bool(quant_swizzled), bool(quant_ue8m0)
        if parallel_mode not in (None, "row", "column"):
            raise ValueError(f"parallel_mode must be None, 'row' or 'column', got {parallel_mode!r}")
        if symmetric_ar_type not in SYMMETRIC_AR_TYPES:
            raise ValueError(f"symmetric_ar_type must be one of {SYMMETRIC_AR_TYPES}, got {symmetric_ar_type!r}")
        if (
            symmetric_ar_type not in (None, "nccl")
            and parallel_mode != "row"
            and not (symmetric_ar_type == "ubnext" and parallel_mode == "column")
        ):
            raise ValueError(
                f"symmetric_ar_type={symmetric_ar_type!r} applies to parallel_mode='row' only "
                "(a column-parallel layer takes None, 'nccl' or 'ubnext' for its backward)"
            )
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
        self.norm_weight = (
            torch.nn.Parameter(torch.ones(out_features, **factory)) if symmetric_ar_type == "ubnext_add_rms" else None
        )
        self.reset_parameters()
        self._last_path: list[str | None] = [None]  # a holder: the backward records into it too
        if symmetric_ar_type in ("ubnext", "ubnext_add_rms"):
            # the messages this layer reduces: its output rows (row), its input rows' gradient (column)
            self.comm.register_hidden(out_features if parallel_mode == "row" else in_features)

    @classmethod
    def from_dense(
        cls,
        linear: torch.nn.Linear,
        *,
        parallel_mode: str,
        tp_group=None,
        symmetric_ar_type: str | None = None,
        eps: float = 1e-6,
        norm_weight: torch.Tensor | None = None,
        device=None,
    ) -> Linear:
        """This rank's shard of an existing ``nn.Linear`` (the layout in the module docstring),
        in its dtype, on ``device`` (default: the dense weight's). ``norm_weight``: the RMSNorm
        weight that ``symmetric_ar_type='ubnext_add_rms'`` owns (default ones)."""
        weight = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            tp_group=tp_group,
            parallel_mode=parallel_mode,
            symmetric_ar_type=symmetric_ar_type,
            eps=eps,
            device=device if device is not None else weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            layer.weight.copy_(layer.shard_of(weight))
            if linear.bias is not None:
                # the layer was built with a bias because the dense one has one
                cast(torch.nn.Parameter, layer.bias).copy_(layer.shard_of(linear.bias))
            if norm_weight is not None:
                if layer.norm_weight is None:
                    raise ValueError("norm_weight is for symmetric_ar_type='ubnext_add_rms'")
                layer.norm_weight.copy_(norm_weight)
        return layer

    def shard_of(self, dense: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a dense weight ``[out, in]`` or bias ``[out]`` of this layer."""
        expected = (self.out_features, self.in_features) if dense.dim() == 2 else (self.out_features,)
        if tuple(dense.shape) != expected:
            raise ValueError(f"expected a dense tensor of shape {expected}, got {tuple(dense.shape)}")
        dim = self.shard_dim("weight" if dense.dim() == 2 else "bias")
        if dim is None:
            return dense
        part = dense.shape[dim] // self.tp_size
        return dense.narrow(dim, dist.get_rank(self.tp_group) * part, part)

    def shard_dim(self, name: str) -> int | None:
        """The dimension along which parameter ``name`` is split over the ranks; None: replicated
        (the whole tensor on every rank). The layout of the module docstring, in one place."""
        if self.parallel_mode == "column" and name in ("weight", "bias"):
            return 0
        if self.parallel_mode == "row" and name == "weight":
            return 1
        return None

    @property
    def comm(self):
        """The communicator of the layer's group (ubnext.get_communicator's), or None without
        tensor parallelism. The 'ubnext' kinds create it when the layer is built; for the others
        the first access creates it, which every rank of the group must do (it is collective)."""
        return ops.communicator_for(self._group_name) if self.parallel_mode is not None else None

    @property
    def last_path(self) -> str | None:
        """The path of the layer's last allreduce: its output's (row) or its input gradient's
        (column, in the backward); None before the first, and not updated by calls inside
        torch.compile'd code (there the path is the compiled graph's business)."""
        return self._last_path[0]

    def _record(self, path: str | None = None) -> None:
        """Keep the path of the allreduce just made (default: the communicator's last path)."""
        if torch.compiler.is_compiling():
            return  # nothing here may be traced: the communicator's state is host state
        self._last_path[0] = path if path is not None else ops.communicator_for(self._group_name).last_path

    def reset_parameters(self) -> None:
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            torch.nn.init.uniform_(self.bias, -bound, bound)

    def _group(self):
        return self.tp_group if self.tp_group is not None else dist.group.WORLD

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, global_scale: torch.Tensor | None = None
    ):
        if global_scale is not None and self.quant != "nvfp4":
            raise ValueError("global_scale is two-level NVFP4's per-tensor scale: it needs quant='nvfp4'")
        if (residual is not None) != (self.symmetric_ar_type == "ubnext_add_rms"):
            raise ValueError("forward(x, residual) takes a residual exactly when symmetric_ar_type='ubnext_add_rms'")
        if self.parallel_mode == "column":
            through = self._group_name if self.symmetric_ar_type == "ubnext" else ""
            return F.linear(_CopyToTensorParallel.apply(x, self, through), self.weight, self.bias)
        if self.parallel_mode != "row":
            return F.linear(x, self.weight, self.bias)
        if x.dim() > 0 and x.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"x has {x.shape[-1]} features in its last dimension, but a row-parallel layer takes "
                f"this rank's shard of its input: {self.weight.shape[1]} features (in_features="
                f"{self.in_features} / {self.tp_size} ranks)"
            )
        x = x.contiguous()
        kind = self.symmetric_ar_type
        if kind == "ubnext_add_rms":
            residual = cast(torch.Tensor, residual)  # not None: checked against symmetric_ar_type above
            partial = F.linear(x, self.weight)
            if self.bias is not None:
                residual = residual + self.bias  # added once, before the fused norm
            if self.quant is not None:
                q, residual_out, scales = ops.all_reduce_add_rmsnorm(
                    partial,
                    residual.contiguous(),
                    self.norm_weight,
                    self.eps,
                    self._group_name,
                    quant=self.quant,
                    global_scale=global_scale,
                    swizzled=self.quant_swizzled,
                    ue8m0=self.quant_ue8m0,
                )
                self._record()
                return q, residual_out, scales
            normed, residual_out, _ = ops.all_reduce_add_rmsnorm(
                partial, residual.contiguous(), self.norm_weight, self.eps, self._group_name
            )
            self._record()
            return normed, residual_out
        if kind == "ubnext":
            y = ops.linear_all_reduce(x, self.weight, self._group_name)
        elif kind in _TORCH_SYMM_OPS:
            y = ops.all_reduce(F.linear(x, self.weight).contiguous(), self._group_name, _TORCH_SYMM_OPS[kind])
        else:
            y = _AllReduceTorch.apply(F.linear(x, self.weight), self._group())
        self._record("torch" if kind in (None, "nccl") else None)
        return y + self.bias if self.bias is not None else y

"""The fused allreduce + residual add + RMSNorm, with its FP8 output, on the kernels or, where
they cannot run it, as the chosen allreduce followed by the same arithmetic in torch.

``FusedNormOps`` is one of the Communicator's parts (ubnext/comm/__init__.py). It reads ``_calls``
(Planner), ``_pool``, ``_algo``, ``_debug``, ``batch_invariant`` and ``key``, and sets ``last_path``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import kernels, ops
from ..reference._blockscale import block_flags, check_fused_quant_args, output_specs
from ..reference._checks import FP8, check_fused_args, reference_add_rmsnorm

# Why each value the debug check compares must be the same on every rank (_check_fused_call_across_ranks).
_SAME_EVERYWHERE = {
    "eps": "every rank must pass the same eps",
    "static FP8 scale": "every rank must quantise with the same scale, or each returns its own FP8 values",
    "NVFP4 global scale": "every rank must quantise with the same global scale, or each returns its own values",
    "residual": (
        "in tensor parallelism the residual stream is replicated, so every rank must pass the same "
        "residual: the one-shot paths add each rank's own (the ranks' outputs then differ), the two-shot "
        "paths each element's owner's (the outputs then match no rank's residual)"
    ),
    "weight": "the RMSNorm weight is replicated: every rank must pass the same one",
}
_CHECKSUMMED = {"residual": "checksums of its bits: ", "weight": "checksums of its bits: "}
_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32}


def bits_checksum(t: torch.Tensor) -> int:
    """An exact checksum of a 16- or 32-bit tensor's bits (UBNEXT_DEBUG): each element's bit pattern times its
    position + 1, summed in int64 (wrapping, so the same on every device and in any order). Equal tensors
    give equal sums; a changed or moved element goes unseen only where the differences cancel mod 2^64."""
    bits = t.reshape(-1).view(_INT_OF_WIDTH[t.element_size()]).to(torch.int64)
    return int((bits * torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)).sum())


def _value_text(scale: torch.Tensor | None) -> str | None:
    """A one-element scale's value as text (repr: equal texts, equal fp32 values; NaN equals NaN)."""
    return None if scale is None else repr(float(scale.reshape(-1)[0]))


# the contract (ubnext/comm/_contracts.py): needs State, Prepared, Planned, Executing, AllReducing, Quantizing
if TYPE_CHECKING:
    from ._contracts import AllReducing, Executing, Planned, Prepared, Quantizing, State

    class Part(State, Prepared, Planned, Executing, AllReducing, Quantizing): ...
else:
    Part = object


class FusedNormOps(Part):
    """The Communicator's fused norm."""

    def all_reduce_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float = 1e-6,
        *,
        out_dtype: torch.dtype | None = None,
        scale: torch.Tensor | None = None,
        quant: str | None = None,
        global_scale: torch.Tensor | None = None,
        swizzled: bool = False,
        ue8m0: bool = False,
    ):
        """``residual_out = allreduce(x) + residual``; ``out = rmsnorm(residual_out) * weight``.

        Returns ``(out, residual_out, scale_inv)``. ``out_dtype`` defaults to ``x.dtype``; with
        ``torch.float8_e4m3fn`` the output is FP8 with a static scale (``scale``: a one-element
        fp32 tensor holding the dequantisation scale) or per-token scales, and ``scale_inv``
        satisfies ``y ≈ out.float() * scale_inv`` (one value, or one per token). ``scale_inv``
        is None for non-FP8 outputs.

        ``quant`` (``"nvfp4"``, ``"mxfp8"`` or ``"fp8_group128"``, with ``global_scale``, ``swizzled``
        and ``ue8m0`` as in ``quantize``) returns ``(q, residual_out, scales)`` instead: bitwise
        ``quantize(out, quant, ...)`` of this call's unquantised ``out``, and the same ``residual_out``
        (docs/QUANTIZE.md). It excludes ``out_dtype`` and ``scale``; K must be a multiple of the block.
        """
        return ops.all_reduce_add_rmsnorm(
            x, residual, weight, eps, self.key, out_dtype, scale, quant, global_scale, swizzled, ue8m0
        )

    def _all_reduce_add_rmsnorm_quant(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        fmt: str,
        global_scale: torch.Tensor | None,
        swizzled: bool,
        ue8m0: bool,
    ) -> tuple[torch.Tensor, ...]:
        """torch.ops.ubnext.all_reduce_add_rmsnorm_quant's implementation, returning ``(q, residual_out,
        scales)``: one kernel, whose row output quantises each normed vector where it computes it, with
        the standalone quantizer's own device code (csrc/device/norm.cuh store_row_out, blockscale.cuh
        quantize_block_vals), so that q and scales are bitwise ``quantize`` of the unquantised call's
        ``out`` (the "fusion changes no bit" rule). Past the pool the add + RMSNorm kernel does the
        same after torch.distributed's sum; without kernels, torch's ops then ``quantize``. Checked
        before the collective, so that every rank refuses alike."""
        check_fused_quant_args(x, residual, weight, eps, fmt, global_scale, swizzled, ue8m0)
        return self._all_reduce_add_rmsnorm(x, residual, weight, eps, block=(fmt, global_scale, swizzled, ue8m0))

    def _all_reduce_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        fp8: bool = False,
        block: tuple | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The fused op itself: torch.ops.ubnext.all_reduce_add_rmsnorm's implementation, returning
        ``(out, residual_out)``; with ``fp8`` all_reduce_add_rmsnorm_fp8's, returning
        ``(out, residual_out, scale_inv)``; with ``block`` = (fmt, global_scale, swizzled, ue8m0)
        (checked by the caller) the block-scaled form's, returning ``(q, residual_out, scales)``."""
        block_bits = block_flags(block[0], block[2], block[3]) if block else 0
        try:
            signature = (
                "all_reduce_add_rmsnorm",
                x.shape,
                x.dtype,
                residual.shape,
                residual.dtype,
                weight.shape,
                weight.dtype,
                eps,
                fp8,
                scale is None,
                block_bits,
                self._algo,
            )
        except AttributeError:  # not a tensor (an operator passes None through): say which
            check_fused_args(x, residual, weight, eps, fp8, scale)
            raise
        call = self._calls.get(signature)
        if (
            call is None
            or scale is not None
            or not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous())
        ):
            check_fused_args(x, residual, weight, eps, fp8, scale)  # what a remembered signature does not vouch for
        device = self.device
        if x.device != device or residual.device != device or weight.device != device:
            self._check_device("x residual weight", x, residual, weight)
        self._check_usable()
        if self._debug:
            self._check_fused_call_across_ranks(x, residual, weight, eps, fp8, block_bits, scale, block)
        if call is None:  # a remembered signature has more than one rank and elements to reduce
            if self._copy_at_world_size_1 or x.numel() == 0:
                self.last_path = "torch"
                return self._fused_in_torch(x, residual, weight, eps, scale, fp8, block)
            flags = kernels.F_FUSED_NORM | block_bits
            if fp8:
                flags |= kernels.F_FP8_STATIC if scale is not None else kernels.F_FP8_PER_TOKEN
            call = self._call_for(signature, x.shape, x.dtype, hidden=x.shape[-1], eps=eps, flags=flags)
        path = self.last_path = call.path
        launch = call.launch
        if launch is None and self.batch_invariant:
            # the rank-order fp32 sum (_allreduce.py); the norm kernel (or torch's ops) adds the
            # residual to it before the one rounding, as the kernel paths do
            summed = self._rank_order_sum(x.reshape(-1), torch.float32).view(x.shape)
            if call.norm is None:
                return self._fused_in_torch(summed, residual, weight, eps, scale, fp8, block)
            self.last_path = f"{self.last_path}+norm"
            launch, inp = call.norm, summed
        elif launch is None:
            # s in fp32 (one arithmetic on every path: residual_out = T(s + residual), one rounding; an
            # allreduce of x itself would round s to x's dtype first): twice the bytes for 16-bit types
            reduced = torch.empty(x.shape, dtype=torch.float32, device=x.device)
            self._all_reduce_by(call, x.float(), reduced)
            if call.norm is None:
                return self._fused_in_torch(reduced, residual, weight, eps, scale, fp8, block)
            # past the pool: the add + RMSNorm (+FP8) kernel on torch.distributed's sum, the fused
            # paths' row math in one kernel instead of torch's separate ops
            self.last_path = f"{self.last_path}+norm"  # what reduced it (torch_symm may hand over to torch)
            launch, inp = call.norm, reduced
        else:
            # lamport reads x anywhere; the NVLS/two-shot kernels reduce through the pool and
            # overwrite their input, so x is always staged (never the caller's x)
            inp = x if path == "lamport" else self._pool.staging(x.shape, x.dtype).copy_(x)  # type: ignore[union-attr]  # a kernel path: there is a pool
        residual_out = torch.empty_like(residual)
        if block:
            (q_shape, q_dtype), (s_shape, s_dtype) = output_specs(x, block[0], block[2])
            q = torch.empty(q_shape, dtype=q_dtype, device=x.device)
            scales = torch.empty(s_shape, dtype=s_dtype, device=x.device)
            self._launch(launch, inp, q, residual, residual_out, weight, block[1], scales)
            return q, residual_out, scales
        if not fp8:
            out = torch.empty_like(x)
            self._launch(launch, inp, out, residual, residual_out, weight)
            return out, residual_out
        out = torch.empty_like(x, dtype=FP8)
        if scale is not None:
            scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
        else:
            scale_inv = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)  # one per token
        self._launch(launch, inp, out, residual, residual_out, weight, scale, scale_inv)
        return out, residual_out, scale_inv

    def _check_fused_call_across_ranks(
        self, x, residual, weight, eps, fp8: bool, block_bits: int, scale, block
    ) -> None:
        """UBNEXT_DEBUG: before the call runs, its signature and the values each rank passes that must be
        the same on every rank, in one all-gather: eps (the kernels compare it too, csrc/device/barrier.cuh,
        but not the torch paths), the static FP8 scale's and the NVFP4 global scale's values, and exact
        checksums of the residual and of the norm weight. Different ones would give each rank its own
        answer, silently. Inside a CUDA graph capture the values are left out: reading them would
        synchronise the device."""
        values = not self._capturing
        fields = (
            ("arguments", ("all_reduce_add_rmsnorm", tuple(x.shape), str(x.dtype), fp8, block_bits)),
            ("eps", float(eps)),
            ("static FP8 scale", _value_text(scale) if values else None),
            ("NVFP4 global scale", _value_text(block[1] if block else None) if values else None),
            ("residual", bits_checksum(residual) if values else None),
            ("weight", bits_checksum(weight) if values else None),
        )
        seen = self._allgather(tuple(value for _, value in fields))
        for i, (name, _) in enumerate(fields):
            per_rank = [s[i] for s in seen]
            if all(v == per_rank[0] for v in per_rank):
                continue
            detail = ", ".join(f"rank {r}: {v}" for r, v in enumerate(per_rank))
            if i == 0:
                raise ValueError(f"ubnext: ranks called with different arguments ({detail})")
            raise ValueError(
                f"ubnext: ranks called all_reduce_add_rmsnorm with different arguments: {name} differs "
                f"({_CHECKSUMMED.get(name, '')}{detail}); {_SAME_EVERYWHERE[name]}"
            )

    def _fused_in_torch(self, reduced, residual, weight, eps, scale, fp8, block=None):
        """add + RMSNorm (+FP8) of an already reduced x, in torch, as the fused op returns it; a
        block-scaled form quantises the normed output with ``quantize``, the fused kernels' arithmetic."""
        outputs = reference_add_rmsnorm(reduced, residual, weight, eps, FP8 if fp8 else residual.dtype, scale)
        if block:
            q, scales = self._quantize_blocks(outputs[0], *block)
            return q, outputs[1], scales
        return outputs if fp8 else outputs[:2]

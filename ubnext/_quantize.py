"""FP8 (e4m3) quantisation of a local tensor with its scale_inv (FSDP2's FP8 all-gather weights):
one kernel where ubnext's kernels run, else quantize_fp8_reference, the same contract.

``QuantizeOps`` is one of the Communicator's parts (ubnext/comm.py). It reads ``_calls``
(Planner), ``_pool`` and ``key``.
"""

from __future__ import annotations

import math

import torch

from . import kernels, ops, plan  # noqa: F401 - ops defines the torch.ops.ubnext operators called here
from ._checks import FP8, check_quantize_args, fp8_scale_inv, quantize_fp8_reference
from ._executor import Call

# Above this many bytes, one scale over the whole tensor is not left to one CTA (the kernel's row is
# one block's work): the amax comes first, from torch's own reduction over every SM, and the kernel
# then quantises with that scale as a static one, its rows split over the grid. Below it, one launch
# of one CTA costs less than the extra reductions' launches.
ONE_CTA_BYTES = 64 << 10
# rows of at most this many vectors when a one-scale tensor is split over the grid for the launch
SPLIT_ROW_VECTORS = 1024


def split_row(n: int, elem: int) -> int:
    """The row length (elements) that splits ``n`` elements, with one scale for all, over the grid:
    whole 16-byte vectors, dividing ``n``, at most SPLIT_ROW_VECTORS vectors. The rows only share
    out the work: with a static scale every element is quantised alone, so any split gives the
    same bits."""
    per_vector = 16 // elem
    return per_vector * math.gcd(n // per_vector, SPLIT_ROW_VECTORS)


class QuantizeOps:
    """The Communicator's FP8 quantisation."""

    def quantize_fp8(self, x: torch.Tensor, *, scaling: str = "row", scale: torch.Tensor | None = None):
        """``(q, scale_inv)``: ``x`` as e4m3 and its dequantisation scales, written by one kernel, so
        that ``x ~= q.float() * scale_inv`` (per row: ``scale_inv[:, None]``). ``scaling``: "row"
        (one scale per row of the last dimension), "tensor" (one for the whole tensor), or
        "static" (``scale``: a one-element fp32 tensor, returned as scale_inv). Local: no peer is
        involved. Scales per row are ``max(amax / 448, 1e-12)``; values saturate to +-448. One scale
        for a tensor past ONE_CTA_BYTES: its amax comes from torch's reduction first, and the kernel
        quantises with it as a static scale over the whole grid (the same bits)."""
        if scaling not in ("row", "tensor", "static"):
            raise ValueError(f"scaling must be 'row', 'tensor' or 'static', got {scaling!r}")
        if (scaling == "static") != (scale is not None):
            raise ValueError("scale is required with scaling='static' and meaningless otherwise")
        hidden = x.shape[-1] if scaling == "row" and x.dim() else x.numel()
        return torch.ops.ubnext.quantize_fp8(x, hidden, scale, self.key)

    def _quantize_fp8(self, x: torch.Tensor, hidden: int, scale: torch.Tensor | None):
        """torch.ops.ubnext.quantize_fp8's implementation: the kernel where ubnext kernels run,
        else quantize_fp8_reference, the same contract (bitwise: true division, saturation)."""
        check_quantize_args(x, hidden, scale)
        if x.device != self.device:
            self._check_device("x", x)
        self._check_usable()
        n = x.numel()
        whole_vectors = (hidden * x.element_size()) % 16 == 0
        if scale is None and hidden == n and n * x.element_size() > ONE_CTA_BYTES and whole_vectors:
            # one scale for the whole tensor: its amax first (two-phase, every SM), then the static path
            # (the kernel's per-token arithmetic; abs: a NaN amax is the positive NaN the kernel gives)
            lo, hi = torch.aminmax(x)
            scale = fp8_scale_inv(torch.maximum(-lo, hi).abs().float()).reshape(1)
        if scale is not None and whole_vectors:
            hidden = split_row(n, x.element_size())
        flags = kernels.F_FP8_STATIC if scale is not None else kernels.F_FP8_PER_TOKEN
        signature = ("quantize_fp8", n, x.dtype, hidden, flags)
        call = self._calls.get(signature)
        if call is None:
            view = self._pool_view()
            problem = view.unavailable or (
                plan.TOO_LARGE if n * x.element_size() > plan.KERNEL_MAX_BYTES else None) or (
                None if whole_vectors else f"rows of {hidden} {x.dtype} elements are not whole 16-byte vectors")
            if problem:
                self._log_once("quantize_fp8", f"quantize_fp8 runs in torch: {problem}")
            launch = None if problem else self._launch_for("quantize_fp8", x.dtype, n, hidden, 0.0, flags)
            call = Call("torch" if problem else "quantize_fp8", launch)
            if len(self._calls) < 4096:
                self._calls[signature] = call
        if call.launch is None:
            q, scale_inv = quantize_fp8_reference(x, hidden, scale)
            return q, scale_inv
        src = x if x.data_ptr() % 16 == 0 else x.clone()
        q = torch.empty(x.shape, dtype=FP8, device=x.device)
        scale_inv = torch.empty(1 if scale is not None else n // hidden, dtype=torch.float32, device=x.device)
        self._run(call.launch, (src.data_ptr(), q.data_ptr(), 0, 0, 0,
                                0 if scale is None else scale.data_ptr(), scale_inv.data_ptr()))
        return q, scale_inv



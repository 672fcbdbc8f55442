"""FP8 (e4m3) quantisation of a local tensor with its scale_inv (FSDP2's FP8 all-gather weights):
one kernel where ubnext's kernels run, else quantize_fp8_reference, the same contract.

``QuantizeOps`` is one of the Communicator's parts (ubnext/comm.py). It reads ``_calls``
(Planner), ``_pool`` and ``key``.
"""

from __future__ import annotations

import torch

from . import kernels, ops  # noqa: F401 - ops defines the torch.ops.ubnext operators called here
from ._checks import FP8, check_quantize_args, quantize_fp8_reference
from ._executor import Call


class QuantizeOps:
    """The Communicator's FP8 quantisation."""

    def quantize_fp8(self, x: torch.Tensor, *, scaling: str = "row", scale: torch.Tensor | None = None):
        """``(q, scale_inv)``: ``x`` as e4m3 and its dequantisation scales, written by one kernel, so
        that ``x ~= q.float() * scale_inv`` (per row: ``scale_inv[:, None]``). ``scaling``: "row"
        (one scale per row of the last dimension), "tensor" (one for the whole tensor), or
        "static" (``scale``: a one-element fp32 tensor, returned as scale_inv). Local: no peer is
        involved. Scales per row are ``max(amax / 448, 1e-12)``; values saturate to +-448."""
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
        flags = kernels.F_FP8_STATIC if scale is not None else kernels.F_FP8_PER_TOKEN
        signature = ("quantize_fp8", n, x.dtype, hidden, flags)
        call = self._calls.get(signature)
        if call is None:
            view = self._pool_view()
            problem = view.unavailable or (
                None if (hidden * x.element_size()) % 16 == 0 else
                f"rows of {hidden} {x.dtype} elements are not whole 16-byte vectors")
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
        self._run(call.launch, (self._pool.base, src.data_ptr(), q.data_ptr(), 0, 0, 0,
                                0 if scale is None else scale.data_ptr(), scale_inv.data_ptr()))
        return q, scale_inv



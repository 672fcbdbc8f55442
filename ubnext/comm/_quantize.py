"""Quantisation of a local tensor, one kernel where ubnext's kernels run, else the torch reference of
the same contract: FP8 (e4m3) with its scale_inv (``quantize_fp8``, FSDP2's FP8 all-gather weights;
quantize_fp8_reference), and the block-scaled formats of the GEMMs after a norm (``quantize``:
NVFP4, MXFP8, per-token-group FP8; ubnext/reference/_blockscale.py, docs/QUANTIZE.md).

``QuantizeOps`` is one of the Communicator's parts (ubnext/comm/__init__.py). It reads ``_calls``
(Planner), ``mode``, ``_pool_error``, ``_capturing``, ``_kernels_tried`` and ``key``. Local, as
documented: no peer, and never the pool's collective set-up either (``_local_call``), so a
quantisation may be any rank's first call.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .. import kernels, ops, plan
from ..errors import UbnextError
from ..reference._blockscale import block_flags, check_quantize_block_args, output_specs, quantize_reference
from ..reference._checks import FP8, check_quantize_args, fp8_scale_inv, quantize_fp8_reference
from ._executor import GPU_BLOCK, Call

# Above this many bytes, one scale over the whole tensor is not left to one CTA (the kernel's row is
# one block's work): the amax comes first, from torch's own reduction over every SM, and the kernel
# then quantises with that scale as a static one, its rows split over the grid. Below it, one launch
# of one CTA costs less than the extra reductions' launches.
ONE_CTA_BYTES = 64 << 10
# rows of at most this many vectors when a one-scale tensor is split over the grid for the launch
SPLIT_ROW_VECTORS = 1024


# 16-byte loads each thread of the quantisation kernels keeps in flight (csrc/kernels/quantize.cu kInFlight)
IN_FLIGHT = 4
# The grid of a local kernel (no peer, no barrier between blocks) is not bounded by residency: blocks
# that do not fit wait for a free SM. Only the hardware's gridDim.x limit bounds it.
LOCAL_GRID_MAX = 2**31 - 1


def row_group_threads(row_vectors: int, block: int) -> int:
    """Threads per row of the per-row kernel (quantize.cu row_group_threads): the largest power of two
    G with G * IN_FLIGHT <= row_vectors that divides ``block``, at least 1."""
    g = 1
    while 2 * g * IN_FLIGHT <= row_vectors and block % (2 * g) == 0:
        g *= 2
    return g


def quantize_geometry(n: int, elem: int, hidden: int, static: bool, block: int, max_blocks: int) -> tuple[int, int]:
    """(grid, block) of ubnext_quantize_fp8: static, one trip of IN_FLIGHT vectors per thread; per
    row, one group of row_group_threads per row, block // G rows per block. At most ``max_blocks``
    (LOCAL_GRID_MAX on a GPU); the kernel strides over whatever the grid leaves."""
    vectors = n * elem // 16
    if static:
        want = -(-vectors // (block * IN_FLIGHT))
    else:
        per_block = block // row_group_threads(hidden * elem // 16, block)
        want = -(-(n // hidden) // per_block)
    return max(1, min(want, max_blocks)), block


def split_row(n: int, elem: int) -> int:
    """The row length (elements) that splits ``n`` elements, with one scale for all, over the grid:
    whole 16-byte vectors, dividing ``n``, at most SPLIT_ROW_VECTORS vectors. The rows only share
    out the work: with a static scale every element is quantised alone, so any split gives the
    same bits."""
    per_vector = 16 // elem
    return per_vector * math.gcd(n // per_vector, SPLIT_ROW_VECTORS)


# the contract (ubnext/comm/_contracts.py): needs State, Prepared, Executing; provides Quantizing
if TYPE_CHECKING:
    from ._contracts import Executing, Prepared, Quantizing, State

    class Part(State, Prepared, Executing, Quantizing): ...
else:
    Part = object


class QuantizeOps(Part):
    """The Communicator's quantisation."""

    def quantize_fp8(self, x: torch.Tensor, *, scaling: str = "row", scale: torch.Tensor | None = None):
        """``(q, scale_inv)``: ``x`` as e4m3 and its dequantisation scales, written by one kernel, so
        that ``x ~= q.float() * scale_inv`` (per row: ``scale_inv[:, None]``). ``scaling``: "row"
        (one scale per row of the last dimension), "tensor" (one for the whole tensor), or
        "static" (``scale``: a one-element fp32 tensor, returned as scale_inv). Local: no peer is
        involved. No gradient: an ``x`` that requires grad is refused in grad mode. Scales per row
        are ``max(amax / 448, 1e-12)``; values saturate to +-448. One scale for a tensor past
        ONE_CTA_BYTES: its amax comes from torch's reduction first, and the kernel quantises with it
        as a static scale over the whole grid (the same bits). Zero tokens give an empty q and no scale
        (one, the static scale, with "static"), as every op takes zero tokens."""
        if scaling not in ("row", "tensor", "static"):
            raise ValueError(f"scaling must be 'row', 'tensor' or 'static', got {scaling!r}")
        if (scaling == "static") != (scale is not None):
            raise ValueError("scale is required with scaling='static' and meaningless otherwise")
        hidden = x.shape[-1] if scaling == "row" and x.dim() else x.numel()
        if hidden == 0 and x.dim() and x.shape[-1]:
            # zero tokens (issue 40 C7): an empty q, and scales for no row ("row", "tensor": an empty tensor
            # has no amax to take), or the static scale itself
            hidden = x.shape[-1]
        return ops.quantize_fp8(x, hidden, scale, self.key)

    def _local_call(
        self,
        signature: tuple,
        algo: str,
        label: str,
        x: torch.Tensor,
        hidden: int,
        flags: int,
        static: bool,
        problem: str | None = None,
    ) -> Call:
        """The path and launch of a quantisation signature, made once and remembered: the kernel
        where this rank's kernels load, else the torch reference (the same bits; ``problem``: the
        call's own reason for it). Made without the pool or a peer (a zeroed descriptor, the kernels
        loaded here: Preparation._prepare_kernels), so a local op never enters the collective
        set-up, whichever rank calls it first."""
        if self._capturing and not self._kernels_tried:  # gpu mode: this call is captured (_check_usable)
            raise UbnextError(
                "ubnext: this communicator's first quantisation is inside CUDA graph capture, but loading its "
                "kernels synchronises the device, which a capture cannot contain: call comm.prepare(), or the "
                "quantisation once, before capturing"
            )
        n = x.numel()
        problem = (
            problem
            or (self._pool_error if self.mode == "torch" else self._prepare_kernels())
            or (plan.TOO_LARGE if n * x.element_size() > plan.KERNEL_MAX_BYTES else None)
        )
        if problem:
            self._log_once(algo, f"{label} runs in torch: {problem}")
        launch = (
            None
            if problem
            else self._launch_for(
                algo, x.dtype, n, hidden, 0.0, flags, self._local_geometry(n, x.element_size(), hidden, static)
            )
        )
        call = Call("torch" if problem else algo, launch)
        if len(self._calls) < 4096:
            self._calls[signature] = call
        return call

    def _local_geometry(self, n: int, elem: int, hidden: int, static: bool) -> tuple[int, int]:
        if self.mode == "emulator" and not self._count_geometry:
            block, max_blocks = 64, 4  # as Executor._geometry: emulated threads are fibers on 2 cores
        else:
            block, max_blocks = GPU_BLOCK, LOCAL_GRID_MAX
        return quantize_geometry(n, elem, hidden, static, block, max_blocks)

    def _quantize_fp8(
        self, x: torch.Tensor, hidden: int, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """torch.ops.ubnext.quantize_fp8's implementation: the kernel where ubnext kernels run,
        else quantize_fp8_reference, the same contract (bitwise: true division, saturation)."""
        check_quantize_args(x, hidden, scale)
        if x.device != self.device:
            self._check_device("x", x)
        self._check_usable()
        n = x.numel()
        if n == 0:  # zero tokens: empty outputs, no launch (the reference's shapes)
            return quantize_fp8_reference(x, hidden, scale)
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
            call = self._local_call(
                signature,
                "quantize_fp8",
                "quantize_fp8",
                x,
                hidden,
                flags,
                scale is not None,
                None if whole_vectors else f"rows of {hidden} {x.dtype} elements are not whole 16-byte vectors",
            )
        if call.launch is None:
            q, scale_inv = quantize_fp8_reference(x, hidden, scale)
            return q, scale_inv
        src = x if x.data_ptr() % 16 == 0 else x.clone()
        q = torch.empty(x.shape, dtype=FP8, device=x.device)
        scale_inv = torch.empty(1 if scale is not None else n // hidden, dtype=torch.float32, device=x.device)
        self._run(
            call.launch,
            (src.data_ptr(), q.data_ptr(), 0, 0, 0, 0 if scale is None else scale.data_ptr(), scale_inv.data_ptr()),
        )
        return q, scale_inv

    def quantize(
        self,
        x: torch.Tensor,
        fmt: str,
        *,
        global_scale: torch.Tensor | None = None,
        swizzled: bool = False,
        ue8m0: bool = False,
    ):
        """``(q, scales)``: ``x`` (bf16, fp16 or fp32, rows of its last dimension K) in a block-scaled
        format for the next GEMM, written by one kernel; local, no peer; no gradient (an ``x`` that
        requires grad is refused in grad mode). ``fmt``:

        - ``"nvfp4"``: ``q`` uint8 ``[..., K/2]`` (two e2m1 per byte, the even element low), ``scales``
          e4m3 ``[..., K/16]``; ``global_scale`` (one-element fp32) for the two-level form;
        - ``"mxfp8"``: ``q`` e4m3 ``[..., K]``, ``scales`` e8m0 ``[..., K/32]``;
        - ``"fp8_group128"``: ``q`` e4m3 ``[..., K]``, ``scales`` fp32 ``[..., K/128]``
          (``max(amax / 448, 1e-12)``; ``ue8m0=True``: rounded up to powers of two).

        ``swizzled=True`` (nvfp4, mxfp8) gives the scales 1-D in torchao's ``to_blocked`` layout,
        padding included. Bitwise torchao's ``nvfp4_quantize`` / ``to_mx(..., RCEIL)`` (docs/QUANTIZE.md);
        ``ubnext.reference._blockscale.quantize_reference`` is the same arithmetic in torch."""
        return ops.quantize(x, fmt, global_scale, bool(swizzled), bool(ue8m0), self.key)

    def _quantize_blocks(
        self, x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None, swizzled: bool, ue8m0: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """torch.ops.ubnext.quantize's implementation: the kernel (csrc/kernels/blockscale.cu) where
        ubnext kernels run, else quantize_reference, the same arithmetic."""
        check_quantize_block_args(x, fmt, global_scale, swizzled, ue8m0)
        if x.device != self.device:
            self._check_device("x", x)
        self._check_usable()
        n, k = x.numel(), x.shape[-1]
        if n == 0:  # zero tokens: empty outputs, no launch (the reference's shapes and padding)
            return quantize_reference(x, fmt, global_scale, swizzled, ue8m0)
        flags = block_flags(None, swizzled, ue8m0)
        signature = ("quantize_" + fmt, n, x.dtype, k, flags)
        call = self._calls.get(signature)
        if call is None:  # flat over the grid, one trip of IN_FLIGHT vectors per thread, as the static FP8 mode
            call = self._local_call(signature, "quantize_" + fmt, f"quantize({fmt})", x, k, flags, True)
        if call.launch is None:
            return quantize_reference(x, fmt, global_scale, swizzled, ue8m0)
        (q_shape, q_dtype), (s_shape, s_dtype) = output_specs(x, fmt, swizzled)
        src = x if x.data_ptr() % 16 == 0 else x.clone()  # contiguous (checked); the kernel loads 16 bytes
        q = torch.empty(q_shape, dtype=q_dtype, device=x.device)
        scales = torch.empty(s_shape, dtype=s_dtype, device=x.device)
        self._run(
            call.launch,
            (
                src.data_ptr(),
                q.data_ptr(),
                0,
                0,
                0,
                0 if global_scale is None else global_scale.data_ptr(),
                scales.data_ptr(),
            ),
        )
        return q, scales

"""The operators' contract with the communicator their ``comm`` argument names.

An operator finds its communicator at run time by a string key (``ops.communicator_for``, the
registry in ``runtime/_lifecycle.py``), as vLLM's ``torch.ops.vllm.all_reduce`` finds its
``GroupCoordinator`` by name. The operators sit below ``comm/`` and cannot import it, so what they
may call is declared here, and ``communicator_for`` is typed to return it. mypy then checks both
sides: an operator that calls anything else fails ``attr-defined``, and the registry's
``Communicator`` must match every member below, or the assignment of ``communicator_for`` fails.
"""

from __future__ import annotations

from typing import Protocol

import torch


class OpTarget(Protocol):
    """The members of a Communicator that the operators' implementations and fakes call (each is
    that operator's implementation on the Communicator, documented there)."""

    rank: int
    world_size: int
    last_path: str | None

    def _all_reduce(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor: ...

    def _all_reduce_torch_symm(self, x: torch.Tensor, op_name: str) -> torch.Tensor: ...

    def _linear_all_reduce(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def _all_reduce_add_rmsnorm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        scale: torch.Tensor | None = None,
        fp8: bool = False,
    ) -> tuple[torch.Tensor, ...]: ...

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
    ) -> tuple[torch.Tensor, ...]: ...

    def _all_gather(self, x: torch.Tensor, out: torch.Tensor) -> None: ...

    def _reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, factor: float) -> None: ...

    def _quantize_fp8(
        self, x: torch.Tensor, hidden: int, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _quantize_blocks(
        self, x: torch.Tensor, fmt: str, global_scale: torch.Tensor | None, swizzled: bool, ue8m0: bool
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

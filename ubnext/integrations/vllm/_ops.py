"""The operator the vLLM pass writes into compiled graphs, and what it counts.

``torch.ops.ubnext_vllm.all_reduce_add_rmsnorm(x, residual, weight, eps, group)`` names its group by
vLLM's name (``tp:0``), never by torch's process-group number: at run time the name is looked up in
this process's table of ubnext-served vLLM groups (``serve``), so a compiled graph loaded later
from a cache reaches the communicator that serves that vLLM group in this process, or fails with
an error naming the group, and never another group. The call goes through the served object's
``fused`` method (the communicator subclass of ``_communicator.py``), which counts it.

Nothing here imports vLLM: the unit tests serve a stand-in."""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from typing import Any, Protocol

import torch

from ...errors import UbnextError

__all__ = ["FUSED_OP", "serve", "served", "fusion_counts", "note_site", "reset_counts"]


class Served(Protocol):
    """What the operator needs of a served group: the communicator subclass's ``fused``."""

    def fused(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


_lib = torch.library.Library("ubnext_vllm", "DEF")  # noqa: TOR901 - defined once, here
_lib.define(
    "all_reduce_add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps, str group) -> (Tensor, Tensor)"
)

_lock = threading.Lock()
_served: dict[str, weakref.ref[Any]] = {}
# sites the pass saw in this process's graphs: "fused" / "fused_no_residual", and "refused: <reason>"
_sites: Counter[str] = Counter()


def serve(group: str, obj: Served) -> None:
    """Make ``obj`` (the communicator subclass of vLLM group ``group``) what the operator reaches."""
    with _lock:
        _served[group] = weakref.ref(obj)


def unserve(group: str, obj: Served) -> None:
    with _lock:
        ref = _served.get(group)
        if ref is not None and ref() is obj:
            del _served[group]


def served(group: str) -> Served:
    ref = _served.get(group)
    obj = ref() if ref is not None else None
    if obj is None:
        raise UbnextError(
            f"vLLM group {group!r} is not served by ubnext in this process: the compiled graph names it, but no "
            "ubnext communicator was built for it (UBNEXT_VLLM unset in the workers, or the group was destroyed)"
        )
    return obj


def _fused_impl(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return served(group).fused(x, residual, weight, eps)


def _fused_fake(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


_lib.impl("all_reduce_add_rmsnorm", _fused_impl, "CompositeExplicitAutograd")
torch.library.register_fake("ubnext_vllm::all_reduce_add_rmsnorm", _fused_fake, lib=_lib)

FUSED_OP = torch.ops.ubnext_vllm.all_reduce_add_rmsnorm.default


def note_site(what: str) -> None:
    _sites[what] += 1


def fusion_counts() -> dict[str, Any]:
    """The sites the pass found in this process: fused ones and refused ones, with reasons."""
    fused = {k: v for k, v in _sites.items() if not k.startswith("refused: ")}
    refused = {k[len("refused: ") :]: v for k, v in _sites.items() if k.startswith("refused: ")}
    return {"fused": fused, "refused": refused}


def reset_counts() -> None:
    _sites.clear()

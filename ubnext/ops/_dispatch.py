"""How the entry points reach an operator: the OpOverloadPacket, or the dispatcher's callable behind it."""

from __future__ import annotations

from typing import Any

import torch


def dispatcher_callable(name: str) -> tuple[Any, Any]:
    """(the operator's OpOverloadPacket, the dispatcher's own callable behind it).
    ``torch.ops.ubnext.<name>(...)`` passes two Python frames before the dispatcher (the namespace's
    attribute lookups and OpOverloadPacket.__call__, which only forwards to this callable): about
    0.3 us per call here (docs/PERF.md). Both reach the same dispatcher entry, with the same
    __torch_function__ handling, so modes, subclasses and the profiler see the same operator. Dynamo
    cannot trace the bare callable, so entry points take the packet while
    ``torch.compiler.is_compiling()``."""
    packet = getattr(torch.ops.ubnext, name)
    return packet, getattr(packet, "_op", packet)  # OpOverloadPacket._op: torch 2.0 to 2.13 at least

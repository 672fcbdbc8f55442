"""What ptxas reports per kernel (registers, spills, stack, shared memory), read from NVRTC's program
log: the spill test and ``python -m ubnext.kernels build --fail-on-spill`` judge a build by it."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class KernelResources:
    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    stack_bytes: int


_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(sm_\w+)'")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str, arch: str) -> list[KernelResources]:
    """Per-kernel resources from ptxas -v output (NVRTC's program log)."""
    out: list[KernelResources] = []
    current = None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            current = KernelResources(m.group(1), arch, 0, 0, 0, 0, 0)
            out.append(current)
            continue
        if current is None:
            continue
        m = _PTXAS_SPILL.search(line)
        if m:
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = _PTXAS_USED.search(line)
        if m:
            current.registers = int(m.group(1))
        m = _PTXAS_SMEM.search(line)
        if m:
            current.shared_bytes = int(m.group(1))
    return out

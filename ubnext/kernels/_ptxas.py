"""What ptxas reports per kernel (registers, spills, stack, shared memory), read from NVRTC's program
log: the frame test and ``python -m ubnext.kernels build --fail-on-spill`` judge a build by it
(``frame_problems``)."""

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
_PTXAS_PROPS = re.compile(r"Function properties for (\w+)")
_PTXAS_CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str, arch: str) -> list[KernelResources]:
    """Per-kernel resources from ptxas -v output (NVRTC's program log). A function that is not inlined
    has its own "Function properties" block after the kernels: its figures are not the kernel's (they
    once overwrote the kernel's 256-byte frame with the function's 0). A kernel's stack is the larger of
    its own frame and its cumulative stack size, which counts the frames of the functions it calls."""
    out: list[KernelResources] = []
    current = None
    props_for = None  # whose "Function properties" the lines read now describe
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            current = KernelResources(m.group(1), arch, 0, 0, 0, 0, 0)
            out.append(current)
            props_for = current.name  # the kernel's own lines follow, until another function's block
            continue
        m = _PTXAS_PROPS.search(line)
        if m:
            props_for = m.group(1)
            continue
        if current is None or props_for != current.name:
            continue
        m = _PTXAS_SPILL.search(line)
        if m:
            current.stack_bytes, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = _PTXAS_USED.search(line)
        if m:
            current.registers = int(m.group(1))
        m = _PTXAS_CUMULATIVE.search(line)
        if m:
            current.stack_bytes = max(current.stack_bytes, int(m.group(1)))
        m = _PTXAS_SMEM.search(line)
        if m:
            current.shared_bytes = int(m.group(1))
    return out


def frame_problems(resources: list[KernelResources]) -> list[str]:
    """One line per kernel that spills registers or has any stack frame. The protocol's latency assumes
    neither: a spill is a local-memory round trip on the path, and a frame is per-thread local memory, such
    as the 256-byte copy of the descriptor that a helper which stops being inlined makes when the kernel's
    descriptor parameter is not __grid_constant__ (csrc/device/entry.cuh)."""
    return [
        f"{r.name} ({r.arch}): {r.stack_bytes} bytes stack frame, {r.spill_stores} bytes spill stores, "
        f"{r.spill_loads} bytes spill loads"
        for r in resources
        if r.stack_bytes or r.spill_stores or r.spill_loads
    ]

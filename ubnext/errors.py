"""ubnext's exceptions, and the words a kernel leaves in the pool's error slot (csrc/device/desc.cuh)
turned into the message a user reads. A leaf at import time: it imports no other ubnext module (the
call flags' names come from ubnext.kernels when a mismatch message is made)."""

from __future__ import annotations

import struct

_OP_NAMES = {
    1: "lamport",
    2: "nvls_oneshot",
    3: "nvls_twoshot",
    4: "nvls_lamport",
    5: "twoshot",
    6: "allgather",
    7: "reduce_scatter",
}
# csrc/device/desc.cuh: error codes and the call header's words
ERR_TIMEOUT, ERR_MISMATCH, ERR_PEER_LEFT = 1, 2, 3
ERR_INTERRUPTED = 4  # UBNEXT_ERR_INTERRUPTED: a host abort on Ctrl-C (ubnext/runtime/_watchdog.py)
# (field 4, UBNEXT_HDR_EPS: a fused call's RMSNorm eps, its fp32 bits; barrier.cuh header_eps)
_HEADER_FIELDS = {0: "op/dtype/flags", 1: "element count", 2: "hidden size", 3: "in offset", 4: "eps"}
_HEADER_DTYPES = {1: "bf16", 2: "fp16", 3: "fp32", 4: "bytes"}


CLOSED = (
    "communicator is closed: make a new ubnext.Communicator (collective), or call "
    "ubnext.get_communicator() again for a group's cached one"
)


class UbnextError(RuntimeError):
    """A ubnext collective failed."""


class UbnextTimeoutError(UbnextError):
    """A wait across ranks passed UBNEXT_TIMEOUT; the message names op, rank and peer."""


def _header_value(field: int, value: int) -> str:
    """One call-header word as the user would write it."""
    if field == 0:
        dtype = _HEADER_DTYPES.get((value >> 8) & 0xFF, f"dtype {(value >> 8) & 0xFF}")
        return f"({', '.join([str(_OP_NAMES.get(value & 0xFF, value & 0xFF)), dtype, *_flag_names(value >> 16)])})"
    if field == 3:
        return f"+{value * 16:#x}"
    if field == 4:
        return _f32_text(value)
    return str(value)


def _flag_names(flags: int) -> list[str]:
    """A call's flags word (ubnext.kernels F_*) as the output form the caller asked for: the user
    wrote quant="mxfp8", not 0x29. Bits without a name are shown as such."""
    from . import kernels as k

    if not flags:
        return ["plain (no norm, no quantisation)"]
    formats = {
        k.F_BLOCK_NVFP4: "NVFP4 output",
        k.F_BLOCK_MXFP8: "MXFP8 output",
        k.F_BLOCK_GROUP128: "FP8 group-128 output",
    }
    bits = (
        (k.F_FUSED_NORM, "fused add+RMSNorm"),
        (k.F_FP8_STATIC, "FP8 output with a static scale"),
        (k.F_FP8_PER_TOKEN, "FP8 output with per-token scales"),
        (k.F_MULTICAST, "multicast"),
        (k.F_BLOCK_SWIZZLED, "swizzled scales"),
        (k.F_BLOCK_UE8M0, "ue8m0 scales"),
        (k.F_RANK_ORDER, "rank-order sum (batch-invariant)"),
    )
    names = [name for bit, name in bits if flags & bit]
    if flags & k.F_BLOCK_FMT_MASK:
        names.insert(sum(1 for bit, _ in bits[:4] if flags & bit), formats[flags & k.F_BLOCK_FMT_MASK])
    unknown = flags & ~(sum(bit for bit, _ in bits) | k.F_BLOCK_FMT_MASK)
    if unknown:
        names.append(f"unknown flags {unknown:#x}")
    return names


def _f32_text(bits: int) -> str:
    """An fp32 given by its bits, in the fewest digits that give those bits back (the eps a caller wrote,
    1e-05 rather than 9.99999974738e-06)."""
    value = struct.unpack("<f", struct.pack("<I", bits))[0]
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.pack("<f", float(text)) == struct.pack("<I", bits):
            return text
    return repr(value)


def kernel_error(words, timeout_s: float, seen_by: int) -> UbnextError:
    """The exception for the pool's error words ``{code, op, rank, peer, field, mine, theirs, aborted}``
    (``timeout_s``: the kernels' bound; ``seen_by``: the rank that read them)."""
    code, op, rank, peer, field, mine, theirs, aborted = (int(v) & 0xFFFFFFFF for v in words)
    op_name = _OP_NAMES.get(op, f"op {op}")
    if code == ERR_TIMEOUT:
        # peer == rank: a wait for this rank's own blocks (the fused row split, csrc/device/norm.cuh)
        awaited = f"peer {peer}" if peer != rank else "its own blocks sharing a token row"
        cause = (
            f"rank {rank} timed out in {op_name} after {timeout_s:g} s (UBNEXT_TIMEOUT, else the "
            f"process group's timeout) waiting for {awaited}"
        )
    elif code == ERR_MISMATCH:
        name = _HEADER_FIELDS.get(field, f"header word {field}")
        cause = (
            f"ranks called {op_name} with different arguments: rank {rank} with {name} "
            f"{_header_value(field, mine)} but rank {peer} with {name} {_header_value(field, theirs)}; "
            "every rank must make the same calls with the same arguments"
        )
        if field == 3:  # only the offset depends on where the pool placed a tensor, not on the call's arguments
            cause += (
                ", and pool tensors it reduces in place must sit at the same offset on every rank "
                "(allocate and free them in the same order)"
            )
    elif code == ERR_PEER_LEFT:
        cause = (
            f"rank {rank} stopped waiting in {op_name} for peer {peer}, which has left: it closed its "
            "communicator or its process exited (an exception or an early end on that rank; its "
            "output says which)"
        )
    elif code == ERR_INTERRUPTED:
        cause = f"rank {rank} was interrupted (SIGINT, Ctrl-C) while it waited in a ubnext kernel"
    else:
        cause = f"{op_name} reported error code {code:#x} on rank {rank} (peer {peer})"
    if aborted:
        # this rank stopped because the communicator had been aborted (csrc/device/barrier.cuh)
        msg = f"ubnext: the communicator was aborted on every rank (seen by rank {seen_by}) because {cause}"
    else:
        msg = f"ubnext {op_name}: {cause}"
    return UbnextTimeoutError(msg) if code == ERR_TIMEOUT else UbnextError(msg)

"""ubnext's exceptions, and the words a kernel leaves in the pool's error slot (csrc/device/desc.cuh)
turned into the message a user reads. A leaf: it imports no other ubnext module."""

from __future__ import annotations

import struct

_OP_NAMES = {1: "lamport", 2: "nvls_oneshot", 3: "nvls_twoshot", 4: "nvls_lamport", 5: "twoshot", 6: "allgather",
             7: "reduce_scatter"}
# csrc/device/desc.cuh: error codes and the call header's words
ERR_TIMEOUT, ERR_MISMATCH, ERR_PEER_LEFT = 1, 2, 3
# (field 4, UBNEXT_HDR_EPS: a fused call's RMSNorm eps, its fp32 bits; barrier.cuh header_eps)
_HEADER_FIELDS = {0: "op/dtype/flags", 1: "element count", 2: "hidden size", 3: "in offset", 4: "eps"}
_HEADER_DTYPES = {1: "bf16", 2: "fp16", 3: "fp32", 4: "bytes"}


CLOSED = ("communicator is closed: make a new ubnext.Communicator (collective), or call "
          "ubnext.get_communicator() again for a group's cached one")


class UbnextError(RuntimeError):
    """A ubnext collective failed."""


class UbnextTimeoutError(UbnextError):
    """A wait across ranks passed UBNEXT_TIMEOUT; the message names op, rank and peer."""


def _header_value(field: int, value: int) -> str:
    """One call-header word as the user would write it."""
    if field == 0:
        dtype = _HEADER_DTYPES.get((value >> 8) & 0xFF, f"dtype {(value >> 8) & 0xFF}")
        return f"({_OP_NAMES.get(value & 0xFF, value & 0xFF)}, {dtype}, flags {value >> 16:#x})"
    if field == 3:
        return f"+{value * 16:#x}"
    if field == 4:
        return _f32_text(value)
    return str(value)


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
        cause = (f"rank {rank} timed out in {op_name} after {timeout_s:g} s (UBNEXT_TIMEOUT, else the "
                 f"process group's timeout) waiting for {awaited}")
    elif code == ERR_MISMATCH:
        name = _HEADER_FIELDS.get(field, f"header word {field}")
        cause = (f"ranks called {op_name} with different arguments: rank {rank} with {name} "
                 f"{_header_value(field, mine)} but rank {peer} with {name} {_header_value(field, theirs)}; "
                 "every rank must make the same calls, and pool tensors it reduces in place must sit "
                 "at the same offset on every rank (allocate and free them in the same order)")
    elif code == ERR_PEER_LEFT:
        cause = (f"rank {rank} stopped waiting in {op_name} for peer {peer}, which has left: it closed its "
                 "communicator or its process exited (an exception or an early end on that rank; its "
                 "output says which)")
    else:
        cause = f"{op_name} reported error code {code:#x} on rank {rank} (peer {peer})"
    if aborted:
        # this rank stopped because the communicator had been aborted (csrc/device/barrier.cuh)
        msg = f"ubnext: the communicator was aborted on every rank (seen by rank {seen_by}) because {cause}"
    else:
        msg = f"ubnext {op_name}: {cause}"
    return UbnextTimeoutError(msg) if code == ERR_TIMEOUT else UbnextError(msg)

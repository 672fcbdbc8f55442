"""Pass file descriptors between the rank processes of one node (SCM_RIGHTS over Unix sockets).

Used for the emulator's memfd pool and for cuMem POSIX-fd handles. The ranks already share a
host-side ``allgather(obj) -> [obj of every rank]`` (torch.distributed or MPI); it carries the
socket addresses, the fds themselves travel over the sockets.

Protocol: every rank listens on a fresh abstract-namespace socket and publishes (address, pid)
by allgather; every sending rank connects to each peer and sends one message carrying its rank
and its fd; every rank accepts one connection per sender. Connections complete in the listen
backlog and a Unix stream socket keeps its data after the sender closes it, so "send to all,
then accept all" cannot deadlock. The receiver checks SO_PEERCRED against the published pid,
so another process on the host cannot slip in a descriptor.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Callable

from . import envs

__all__ = ["exchange_fds"]

_MSG = struct.Struct("<i")
FD_EXCHANGE_TIMEOUT_S = 300.0  # when UBNEXT_TIMEOUT is unset


def exchange_fds(fd: int, rank: int, nranks: int, allgather: Callable[[object], list],
                 only_from: int | None = None) -> list[int]:
    """Every rank's ``fd``, as descriptors owned by the caller (the caller closes all of them;
    its own entry is a dup of ``fd``, which the caller still owns too).

    Collective over the ranks of ``allgather``. With ``only_from=r`` only rank r's fd is shared
    (the others pass any ``fd``, e.g. -1) and every other entry of the result is -1.
    Raises OSError/TimeoutError after closing everything it opened.
    """
    if not 0 <= rank < nranks:
        raise ValueError(f"rank {rank} outside [0, {nranks})")
    senders = list(range(nranks)) if only_from is None else [only_from]
    # every rank arrives from the same allgather, so only a dead peer makes this wait long
    timeout = envs.get("UBNEXT_TIMEOUT") or FD_EXCHANGE_TIMEOUT_S
    result = [-1] * nranks
    listener, address, listen_error = None, None, None
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        listener.bind(f"\0ubnext-fds-{os.getpid()}-{os.urandom(8).hex()}")
        listener.listen(max(1, nranks))
        listener.settimeout(timeout)
        address = listener.getsockname()
    except OSError as exc:
        listen_error = exc  # still take part in the allgather below, or the peers pair it wrongly
    try:
        peers = allgather((address, os.getpid()))
        if listen_error is not None:
            raise listen_error
        deaf = [r for r, (a, _) in enumerate(peers) if a is None]
        if deaf:
            raise OSError(f"ubnext fd exchange: rank(s) {deaf} could not open a socket")
        if rank in senders:
            result[rank] = os.dup(fd)
            for peer in range(nranks):
                if peer != rank:
                    _send(peers[peer][0], rank, fd, timeout)
        expected = [r for r in senders if r != rank]
        for _ in expected:
            try:
                conn, _addr = listener.accept()
            except socket.timeout:
                missing = [r for r in expected if result[r] == -1]
                raise TimeoutError(f"ubnext fd exchange: rank {rank} timed out after {timeout:g} s "
                                   f"(UBNEXT_TIMEOUT) waiting for peer(s) {missing}") from None
            with conn:
                conn.settimeout(timeout)
                pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                msg, fds, _flags, _ = socket.recv_fds(conn, _MSG.size, 1)
                sender = _MSG.unpack(msg)[0] if len(msg) == _MSG.size else -1
                if len(fds) != 1 or sender not in expected or result[sender] != -1 or peers[sender][1] != pid:
                    for f in fds:
                        os.close(f)
                    raise OSError(f"rank {rank}: unexpected fd message (sender {sender}, pid {pid}, "
                                  f"{len(fds)} fds)")
                result[sender] = fds[0]
    except BaseException:
        for f in result:
            if f >= 0:
                os.close(f)
        raise
    finally:
        if listener is not None:
            listener.close()
    return result


def _send(address: str, rank: int, fd: int, timeout: float) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.connect(address)
        socket.send_fds(s, [_MSG.pack(rank)], [fd])

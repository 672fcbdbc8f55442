"""Pass file descriptors between the rank processes of one node (SCM_RIGHTS over Unix sockets).

Used for the emulator's memfd pool and for cuMem POSIX-fd handles. The ranks already share a
host-side ``allgather(obj) -> [obj of every rank]`` (torch.distributed or MPI); it carries the
socket addresses, the fds themselves travel over the sockets.

Protocol: every rank listens on a fresh abstract-namespace socket and publishes (address, pid,
namespaces) by allgather; every sending rank connects to each peer and sends one message
carrying its rank and its fd; every rank says by a second allgather whether its sends worked, and
only then accepts one connection per sender. Connections complete in the listen backlog and a
Unix stream socket keeps its data after the sender closes it, so "send to all, then accept all"
cannot deadlock, and no rank waits in accept for a message that a failed peer never sent. The
receiver checks SO_PEERCRED against the published pid, so another process on the host cannot
slip in a descriptor.

Both need the ranks in one PID and one network namespace: SO_PEERCRED gives the sender's pid as
seen from the receiver's PID namespace (pid_namespaces(7)), which is not the pid the sender
published from its own, and abstract socket addresses belong to a network namespace
(network_namespaces(7)). Containers that share GPUs but not these namespaces exist; ranks in
different namespaces are told apart from the published namespaces before any socket is used,
every rank raises the same error saying what to change, and the pool set-up then fails on every
rank alike, so ubnext uses torch.distributed.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Callable
from typing import cast

from .. import envs

__all__ = ["exchange_fds"]

_MSG = struct.Struct("<i")
FD_EXCHANGE_TIMEOUT_S = 300.0  # when UBNEXT_TIMEOUT is unset


def exchange_fds(
    fd: int, rank: int, nranks: int, allgather: Callable[[object], list], only_from: int | None = None
) -> list[int]:
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
        peers = allgather((address, *_identity()))
        if listen_error is not None:
            raise listen_error
        deaf = [r for r, (a, *_) in enumerate(peers) if a is None]
        if deaf:
            raise OSError(f"ubnext fd exchange: rank(s) {deaf} could not open a socket")
        # every rank sees the same table, so every rank raises this alike, before any socket use
        _check_namespaces([p[2] for p in peers])
        send_error = None
        if rank in senders:
            result[rank] = os.dup(fd)
            try:
                for peer in range(nranks):
                    if peer != rank:
                        _send(peers[peer][0], rank, peer, fd, timeout)
            except OSError as exc:  # voted: the peers must not wait in accept for what never comes
                send_error = str(exc)
        unsent = [(r, e) for r, e in enumerate(allgather(send_error)) if e]
        if unsent:
            raise OSError(f"ubnext fd exchange: rank {unsent[0][0]} could not send: {unsent[0][1]}")
        expected = [r for r in senders if r != rank]
        for _ in expected:
            try:
                # listener is set: it is None only with a listen_error, raised above
                conn, _addr = cast(socket.socket, listener).accept()
            except TimeoutError:
                missing = [r for r in expected if result[r] == -1]
                raise TimeoutError(
                    f"ubnext fd exchange: rank {rank} timed out after {timeout:g} s "
                    f"(UBNEXT_TIMEOUT) waiting for peer(s) {missing}"
                ) from None
            with conn:
                conn.settimeout(timeout)
                pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                msg, fds, _flags, _ = socket.recv_fds(conn, _MSG.size, 1)
                sender = _MSG.unpack(msg)[0] if len(msg) == _MSG.size else -1
                if len(fds) != 1 or sender not in expected or result[sender] != -1 or peers[sender][1] != pid:
                    for f in fds:
                        os.close(f)
                    published = peers[sender][1] if sender in expected else None
                    hint = (
                        ""
                        if published in (None, pid)
                        else (
                            f": rank {sender} published pid {published}; the ranks may run in different PID "
                            f"namespaces, and {_PID_WHY}. {_PID_FIX}"
                        )
                    )
                    raise OSError(
                        f"rank {rank}: unexpected fd message (sender {sender}, pid {pid}, {len(fds)} fds){hint}"
                    )
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


# what to change, when the ranks' namespaces differ (containers that share the GPUs and no more)
_PID_FIX = (
    "Run the ranks in one PID namespace (docker --pid=host or --pid=container:<first rank's>, "
    "one Kubernetes pod with shareProcessNamespace); until then ubnext uses torch.distributed"
)
_NET_FIX = (
    "Run the ranks in one network namespace (docker --network=host or "
    "--network=container:<first rank's>, one Kubernetes pod); until then ubnext uses torch.distributed"
)
_PID_WHY = "SO_PEERCRED reports a peer's pid as seen from the receiver's PID namespace"
_NET_WHY = "an abstract Unix socket is reachable only from its own network namespace"


def _identity() -> tuple[int, tuple[str | None, str | None]]:
    """This process's pid and its (PID, network) namespaces, as /proc/self/ns names them
    ("pid:[4026531836]": equal names, one namespace); None for one that cannot be read."""
    return os.getpid(), (_namespace("pid"), _namespace("net"))


def _namespace(kind: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return None


def _check_namespaces(namespaces: list[tuple[str | None, str | None]]) -> None:
    """Raise, saying what to change, when the ranks' PID or network namespaces differ."""
    for i, (kind, why, fix) in enumerate((("PID", _PID_WHY, _PID_FIX), ("network", _NET_WHY, _NET_FIX))):
        seen: dict[str, list[int]] = {}
        for r, ns in enumerate(namespaces):
            name = ns[i]
            if name is not None:
                seen.setdefault(name, []).append(r)
        if len(seen) > 1:
            groups = "; ".join(f"rank(s) {ranks} in {name}" for name, ranks in seen.items())
            raise OSError(
                f"ubnext fd exchange: the ranks run in different {kind} namespaces ({groups}), and {why}. {fix}"
            )


def _send(address: str, rank: int, peer: int, fd: int, timeout: float) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        try:
            s.connect(address)
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            # the peer listens (it published its address), so it is out of reach, not gone
            raise OSError(
                f"rank {rank} cannot reach rank {peer}'s socket ({exc}): the ranks may run in different "
                f"network namespaces, and {_NET_WHY}. {_NET_FIX}"
            ) from exc
        socket.send_fds(s, [_MSG.pack(rank)], [fd])

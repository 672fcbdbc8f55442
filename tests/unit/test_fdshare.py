"""The fd exchange (ubnext/pool/_fdshare.py) between ranks that cannot use it: ranks in different PID or
network namespaces (containers that share the GPUs and nothing else). Ranks are threads of this
process with real sockets; what differs between containers (the published pid, the namespaces, a
socket address out of reach) is simulated per thread. Every rank must get the same PoolSetupError
from the voted phase (pool._backend._share_fd), which sends the communicator to torch.distributed,
with what to check in it, and no rank may wait for the exchange's timeout."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ubnext.pool import PoolSetupError
from ubnext.pool._backend import _share_fd

NRANKS = 3
this_rank = threading.local()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _run_ranks(publish=lambda rank, obj: obj):
    """Every rank's _share_fd of a memfd, as threads; `publish(rank, obj)` is what the peers see of
    a rank's allgather contribution. Returns each rank's result or exception, and the seconds taken."""
    slots, barrier = [None] * NRANKS, threading.Barrier(NRANKS)

    def make(rank):
        def allgather(obj):
            slots[rank] = publish(rank, obj)
            barrier.wait(timeout=60)
            result = list(slots)
            barrier.wait(timeout=60)
            return result

        return allgather

    results = [None] * NRANKS

    def rank_main(rank):
        this_rank.value = rank
        try:
            fds = _share_fd(os.memfd_create(f"r{rank}"), None, rank, NRANKS, make(rank), "making", "sharing")
            for f in fds:
                os.close(f)
            results[rank] = fds
        except Exception as exc:  # noqa: BLE001 - compared below
            results[rank] = exc

    start = time.monotonic()
    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(NRANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank hangs in the fd exchange"
    return results, time.monotonic() - start


def _agreed_error(results) -> str:
    assert all(isinstance(r, PoolSetupError) for r in results), results
    assert len({str(r) for r in results}) == 1, f"the ranks disagree: {results}"
    return str(results[0])


def test_the_exchange_works_between_threads():
    """The simulation's baseline: without a difference, every rank gets every descriptor."""
    before = _open_fds()
    results, _ = _run_ranks()
    assert all(isinstance(r, list) and len(r) == NRANKS and min(r) >= 0 for r in results), results
    assert _open_fds() == before


def test_a_pid_from_another_pid_namespace(monkeypatch):
    """Rank 1 runs in a container with a PID namespace of its own, where it is pid 1, and its
    namespace cannot be read (no /proc/self/ns): the receivers' SO_PEERCRED check sees the pid
    from their own namespace and refuses its descriptor. The error says what to check, every rank
    raises it alike, at once."""
    real_getpid, real_readlink = os.getpid, os.readlink
    monkeypatch.setattr(os, "getpid", lambda: 1 if getattr(this_rank, "value", None) == 1 else real_getpid())
    monkeypatch.setattr(
        os,
        "readlink",
        lambda path, *a, **k: (
            (_ for _ in ()).throw(PermissionError(path))
            if getattr(this_rank, "value", None) is not None and path.startswith("/proc/self/ns/")
            else real_readlink(path, *a, **k)
        ),
    )
    monkeypatch.setenv("UBNEXT_TIMEOUT", "30")
    before = _open_fds()
    results, seconds = _run_ranks()
    message = _agreed_error(results)
    assert f"pid {real_getpid()}" in message and "published pid 1" in message, message
    assert "different PID namespaces" in message and "--pid=host" in message, message
    assert "ubnext uses torch.distributed" in message, message
    assert seconds < 15, f"took {seconds:.0f} s"
    assert _open_fds() == before


def test_ranks_in_different_pid_namespaces_are_told_before_any_socket(monkeypatch):
    """Where the namespaces can be read, a rank in another PID namespace is found from the
    published names alone, on every rank alike, naming which ranks are where."""
    real_readlink = os.readlink

    def readlink(path, *args, **kwargs):
        if getattr(this_rank, "value", None) == 2 and path == "/proc/self/ns/pid":
            return "pid:[4026599999]"
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", readlink)
    before = _open_fds()
    results, _ = _run_ranks()
    message = _agreed_error(results)
    assert "different PID namespaces" in message and "rank(s) [2] in pid:[4026599999]" in message, message
    assert "SO_PEERCRED" in message and "torch.distributed" in message, message
    assert _open_fds() == before


@pytest.mark.parametrize("namespaces_readable", [True, False])
def test_a_rank_in_another_network_namespace(monkeypatch, namespaces_readable):
    """Rank 1 listens in a network namespace of its own: its abstract socket address means nothing
    in the others' (simulated by what they see of it: an address nobody listens on). Where the
    namespaces can be read, every rank is told before any socket is used; where they cannot, the
    senders' connections are refused, and the peers must hear of it at once rather than wait in
    accept for the exchange's timeout (UBNEXT_TIMEOUT)."""
    real_readlink = os.readlink

    def readlink(path, *args, **kwargs):
        if getattr(this_rank, "value", None) is not None and path.startswith("/proc/self/ns/"):
            if not namespaces_readable:
                raise PermissionError(path)
            if this_rank.value == 1 and path.endswith("/net"):
                return "net:[4026588888]"
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", readlink)
    monkeypatch.setenv("UBNEXT_TIMEOUT", "30")

    def publish(rank, obj):
        # (address, ...): an abstract address reads back as bytes
        if rank == 1 and isinstance(obj, tuple) and isinstance(obj[0], bytes) and obj[0].startswith(b"\0ubnext-fds-"):
            return (b"\0ubnext-fds-in-another-network-namespace", *obj[1:])
        return obj

    before = _open_fds()
    results, seconds = _run_ranks(publish)
    message = _agreed_error(results)
    assert "network namespace" in message and "--network=host" in message, message
    assert "torch.distributed" in message, message
    assert seconds < 15, f"the ranks waited {seconds:.0f} s for the exchange's timeout"
    assert _open_fds() == before

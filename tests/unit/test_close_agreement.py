"""Issue 36 R5: an explicit close() agrees across ranks before its pool goes (docs/ARCHITECTURE.md,
"Closing agrees across ranks"): every rank checks in under the communicator's close key in the process
group's store, and the teardown waits for every rank's key, for the kernels' timeout at most. Ranks are
threads here, the store a HashStore standing in for the process group's, the pool a recorder."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ubnext import UbnextTimeoutError
from ubnext.comm import Communicator

BOUND_S = 0.4  # the kernels' timeout, as the ranks agreed on it at pool creation (pool.timeout_s)


class _Group:
    group_name = "close-test"


class _Pool:
    """What close() asks of a pool: the departure mark, the error word, the agreed timeout, the teardown."""

    def __init__(self, timeout_s: float = BOUND_S, failed: bool = False, departed: tuple[int, ...] = ()):
        self.timeout_s = timeout_s
        self.err_view = [1 if failed else 0]
        self.departed_at = self.closed_at = None
        self.departed = list(departed)  # the peers whose departure word this rank's sync region holds

    def departed_peers(self):
        return self.departed

    def announce_departure(self):
        self.departed_at = time.monotonic()

    def close(self):
        self.closed_at = time.monotonic()


def _rank(rank: int, pool: _Pool | None, world_size: int = 2) -> Communicator:
    """A communicator as far as close() needs it: rank ``rank`` of ``world_size``, on the CPU."""
    comm = object.__new__(Communicator)
    comm.group, comm.rank, comm.world_size, comm.device = _Group(), rank, world_size, torch.device("cpu")
    comm._setup_serial, comm._broken, comm._closed = 0, None, False
    comm._pool, comm._calls, comm._symm_buffers = pool, {}, {}
    return comm


@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    hash_store = dist.HashStore()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: hash_store)
    return hash_store


class _DepartureOnlyStore:
    """A store that takes the departure key (one write, no wait: issue 40 H2) and fails the test on
    anything else: no agreement, no wait."""

    def __init__(self):
        self.written: list[str] = []

    def set(self, key, value):
        if not key.startswith("ubnext/departed/"):
            raise AssertionError(f"close() talked to the peers: set {key}")
        self.written.append(key)

    def __getattr__(self, name):
        raise AssertionError(f"close() talked to the peers: store.{name}")


@pytest.fixture
def no_store(monkeypatch):
    """A process group whose store takes only the departure key: any other use fails the test."""
    import torch.distributed as dist

    departure_only = _DepartureOnlyStore()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: departure_only)
    return departure_only


def _close_in_threads(comms, delays):
    """Close each communicator on a thread of its own after its delay; each one's outcome."""
    outcomes = [None] * len(comms)

    def run(i):
        time.sleep(delays[i])
        try:
            comms[i].close()
            outcomes[i] = "ok"
        except Exception as exc:  # noqa: BLE001 - compared by the test
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "a close hangs"
    return outcomes


def test_close_waits_for_every_rank_before_the_teardown(store):
    """Rank 1 closes 0.25 s after rank 0: rank 0's pool goes only after rank 1 has finished its work
    (its departure mark, made before it checks in), and neither raises."""
    pools = [_Pool(timeout_s=10.0), _Pool(timeout_s=10.0)]
    outcomes = _close_in_threads([_rank(0, pools[0]), _rank(1, pools[1])], delays=[0.0, 0.25])
    assert outcomes == ["ok", "ok"], outcomes
    assert pools[0].closed_at >= pools[1].departed_at, "rank 0 tore its pool down before rank 1 came to close"
    assert pools[0].closed_at - pools[0].departed_at >= 0.2, "rank 0 did not wait for rank 1"


def test_close_gives_up_after_the_bound_naming_the_missing_rank(store):
    """Rank 1 never closes: rank 0 waits the bound, tears its pool down all the same (a close must not
    hang), then raises naming the op, itself and the missing rank."""
    pool = _Pool()
    comm = _rank(0, pool)
    start = time.monotonic()
    with pytest.raises(
        UbnextTimeoutError,
        match=r"while closing the communicator, rank 0 waited 0.4 s for "
        r"rank\(s\) \[1\] of the group, which never reached it",
    ):
        comm.close()
    took = time.monotonic() - start
    assert BOUND_S <= took < BOUND_S + 5, f"the close took {took:.2f} s for a bound of {BOUND_S} s"
    assert pool.closed_at is not None and comm.closed, "the pool outlived a close that gave up"
    comm.close()  # closed: nothing more, no second wait


def test_a_rank_closing_after_its_peer_gave_up_is_told_so(store):
    """The verdict is one per close: rank 1, arriving once rank 0 has given up (and its pool is gone),
    raises too rather than reporting a clean close."""
    with pytest.raises(UbnextTimeoutError):
        _rank(0, _Pool()).close()
    late = _Pool()
    with pytest.raises(UbnextTimeoutError, match="rank 1 reached the step only after a peer had given up"):
        _rank(1, late).close()
    assert late.closed_at is not None


def test_a_peer_that_left_without_closing_ends_the_wait_early(store, monkeypatch):
    """Rank 1 left on an error of its own (an exception, the interpreter's exit): its departure word is
    set and it never checks in. Rank 0's close() stops waiting once the grace for a departed peer's
    check-in has passed, far short of a long kernel timeout, and names the rank that left."""
    from ubnext.comm import _prepare

    monkeypatch.setattr(_prepare, "DEPARTED_GRACE_S", 0.3)
    pool = _Pool(timeout_s=30.0, departed=(1,))
    start = time.monotonic()
    with pytest.raises(UbnextTimeoutError, match=r"rank 0 rank 1 left without reaching it"):
        _rank(0, pool).close()
    took = time.monotonic() - start
    assert took < 5, f"close waited {took:.1f} s for a peer that had left (bound 30 s)"
    assert pool.closed_at is not None


def test_a_departed_peer_that_is_closing_is_waited_for(store):
    """close() announces the departure before it checks in: a peer whose word is set but which checks in
    within the grace is a peer closing normally, and both closes succeed."""
    pools = [_Pool(timeout_s=10.0, departed=(1,)), _Pool(timeout_s=10.0, departed=(0,))]
    outcomes = _close_in_threads([_rank(0, pools[0]), _rank(1, pools[1])], delays=[0.0, 0.5])
    assert outcomes == ["ok", "ok"], outcomes


def test_a_failed_communicator_checks_in_without_waiting(store):
    """After an abort (the error word set) a peer may have left for good: close() checks in for the
    peers that do come, and does not wait; a healthy peer closing later finds its key at once."""
    broken = _Pool(failed=True)
    start = time.monotonic()
    _rank(0, broken).close()
    assert time.monotonic() - start < BOUND_S / 2 and broken.closed_at is not None
    start = time.monotonic()
    _rank(1, _Pool()).close()
    assert time.monotonic() - start < BOUND_S / 2, "the healthy rank waited for a peer that had checked in"


def test_a_close_without_a_pool_stays_local(no_store):
    """No op ran, so no pool was made: close() waits for nobody (no collective, no agreement); it only
    sets its departure key, for a peer that would wait for it in a set-up step (issue 40 H2)."""
    comm = _rank(0, None)
    comm.close()
    assert comm.closed
    assert no_store.written == ["ubnext/departed/close-test/0/0"], no_store.written


@pytest.mark.parametrize("how", ["exception in the with-block", "interpreter exit"])
def test_the_departure_paths_leave_without_the_agreement(no_store, how):
    """Leaving on an exception or at interpreter exit (_lifecycle.shutdown's release) marks this rank
    departed and tears down at once: its peers may never close (tests/mpi/test_departure.py)."""
    pool = _Pool()
    comm = _rank(0, pool)
    if how == "interpreter exit":
        comm._release()
    else:
        with pytest.raises(RuntimeError, match="a bug"):
            with comm:
                raise RuntimeError("a bug")
    assert pool.departed_at is not None and pool.closed_at is not None and comm.closed


def test_one_rank_has_no_one_to_wait_for(no_store):
    pool = _Pool()
    comm = _rank(0, pool, world_size=1)
    comm.close()
    assert pool.closed_at is not None

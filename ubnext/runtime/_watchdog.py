"""The flight recorder, the watchdog and Ctrl-C (issue 40 H3, H4).

A wait that nobody explains is the worst way for a job to go wrong: two ranks that made different
calls (a different message size, one rank compiled with fusion and the other not, an all-gather
against an allreduce) each wait in their own kernel until ``UBNEXT_TIMEOUT``, and the error that
ends it names a peer, not the cause. NCCL's watchdog and flight recorder are the anchor.

- **The record.** Every launch counts itself (``Executor._flight_seq``) and keeps its ``Launch``
  (``_flight_how``): that is the whole per-call cost. The watchdog thread, not the call, notes when it
  first saw a call still running, so no clock is read on the hot path (its times are good to one tick).
- **The watchdog.** One daemon thread per process looks at every communicator with a pool every
  ``TICK_S``. A call still running ``UBNEXT_WARN_AFTER`` seconds after it was first seen (default 10;
  0 turns the warning off) is logged once, with each peer's last call: the waiting rank raises the
  communicator's request counter in the process group's store and publishes its own record; every
  rank's watchdog answers a raised counter with its record (one ``store.add`` per communicator per
  tick, off the hot path), so a peer that has gone on to other work is named too.
- **Ctrl-C.** While an emulator launch runs on the main thread, Python's signal wake-up fd points at
  this thread's pipe: a SIGINT that Python's C handler records while the main thread is blocked in
  the launch reaches the thread at once, which aborts the communicator on every rank from the host
  (``SymmetricPool.abort_from_host``, the path a timeout takes) and logs where this rank waited.
  Every kernel wait ends at its next look at the abort flag, the launch returns, and Python raises
  the KeyboardInterrupt. On a GPU the host does not wait inside ubnext (it waits in the caller's
  synchronize), so a Ctrl-C there is Python's own, and a hung kernel ends at ``UBNEXT_TIMEOUT``.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
import weakref

import torch.distributed as dist

from .. import envs
from ..errors import ERR_INTERRUPTED

log = logging.getLogger("ubnext")

TICK_S = 0.25  # how often the thread looks: a warning is late by at most this, a Ctrl-C is not
PEER_ANSWER_S = 1.5  # how long a warning waits for the peers' records (each answers within a tick)

_lock = threading.Lock()
_watched: weakref.WeakSet = weakref.WeakSet()
_thread: threading.Thread | None = None
_stop = threading.Event()
_wakeup_read = _wakeup_write = -1
_forward_fd = -1  # the wake-up fd that was set before ours (asyncio's, say): signals are passed on


class _State:
    """What the thread knows of one communicator's calls."""

    __slots__ = ("seq", "since", "warned", "answered")

    def __init__(self) -> None:
        self.seq = 0  # the call last looked at
        self.since: float | None = None  # when the thread first saw it running
        self.warned = 0  # the call last warned about
        self.answered = 0  # the store's request counter last answered


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def watch(comm) -> None:
    """Watch ``comm`` (a multi-rank communicator whose pool was just made); start the thread once."""
    global _thread, _wakeup_read, _wakeup_write
    with _lock:
        _watched.add(comm)
        _states[comm] = _State()
        if _thread is None or not _thread.is_alive():
            if _wakeup_read < 0:
                _wakeup_read, _wakeup_write = os.pipe()
                os.set_blocking(_wakeup_write, False)  # signal.set_wakeup_fd requires it
            _stop.clear()
            _thread = threading.Thread(target=_run, name="ubnext-watchdog", daemon=True)
            _thread.start()


def stop() -> None:
    """End the thread (interpreter exit, before the process group and its store go)."""
    global _thread
    _stop.set()
    thread, _thread = _thread, None
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=2 * TICK_S)


class interruptible:
    """Around a blocking emulator launch on the main thread: Python's wake-up fd is this module's pipe
    for the launch, so that a Ctrl-C reaches the watchdog thread while the main thread is blocked. A
    no-op off the main thread (only it may set the fd, and only it receives KeyboardInterrupt) and
    before the thread runs."""

    __slots__ = ("previous",)

    def __enter__(self):
        global _forward_fd
        self.previous = None
        if _wakeup_write >= 0 and threading.current_thread() is threading.main_thread():
            self.previous = signal.set_wakeup_fd(_wakeup_write, warn_on_full_buffer=False)
            _forward_fd = self.previous
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.set_wakeup_fd(self.previous)
        return False


def _run() -> None:
    while not _stop.is_set():
        ready, _, _ = select.select([_wakeup_read], [], [], TICK_S)
        if ready:
            _signals(os.read(_wakeup_read, 64))
        now = time.monotonic()
        for comm in list(_watched):
            try:
                _look(comm, now)
            except Exception as exc:  # noqa: BLE001 - the store went away (exit), a closed pool: stop watching it
                log.debug("ubnext watchdog: no longer watching %r (%s)", comm, exc)
                _watched.discard(comm)


def _signals(received: bytes) -> None:
    """Signal numbers from the wake-up pipe: pass them on to the fd set before ours, and on SIGINT
    (when Python's own handler would raise KeyboardInterrupt) abort every communicator whose launch
    is blocking the main thread."""
    if _forward_fd >= 0:
        try:
            os.write(_forward_fd, received)
        except OSError:
            pass
    if signal.SIGINT not in received or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    for comm in list(_watched):
        if comm._flight_seq != comm._flight_done and comm._pool is not None:
            state = _states.get(comm)
            waited = time.monotonic() - state.since if state is not None and state.since is not None else 0.0
            if comm._pool.abort_from_host(ERR_INTERRUPTED):
                log.error(
                    "ubnext rank %d: Ctrl-C while waiting in %s (%.1f s or more): the communicator is "
                    "aborted on every rank",
                    comm.rank,
                    describe(comm),
                    waited,
                )


def describe(comm) -> str:
    """A communicator's last call, as the watchdog names it."""
    how = comm._flight_how
    if how is None:
        return "no call yet"
    n, hidden = how.scalars[0], how.scalars[1]
    return (
        f"call #{comm._flight_seq} (path {how.algo}, kernel {how.name}, {n} elements"
        f"{f', rows of {hidden}' if hidden else ''})"
    )


def _keys(comm) -> tuple[str, str]:
    prefix = f"ubnext/flight/{comm._flight_group}/{comm._setup_serial}"
    return f"{prefix}/request", prefix


def _publish(comm, store, prefix: str, generation: int, state: _State, now: float) -> None:
    since = state.since
    what = describe(comm) + (f", running for {now - since:.1f} s" if since is not None else ", finished")
    store.set(f"{prefix}/{comm.rank}", f"{generation}|{what}")


def _look(comm, now: float) -> None:
    state = _states.get(comm)
    if state is None or comm._flight_seq == 0 or comm._pool is None:
        return
    seq = comm._flight_seq
    running = seq != comm._flight_done and comm._flight_running()
    if not running:
        state.seq, state.since = seq, None
    elif state.seq != seq or state.since is None:
        state.seq, state.since = seq, now
    store = dist.distributed_c10d._get_default_store()
    request, prefix = _keys(comm)
    generation = int(store.add(request, 0))
    if generation > state.answered:  # a peer's watchdog asks: answer with our last call
        _publish(comm, store, prefix, generation, state, now)
        state.answered = generation
    warn_after = envs.get("UBNEXT_WARN_AFTER")
    if not (warn_after and running and now - state.since >= warn_after and state.warned != seq):
        return
    state.warned = seq
    generation = int(store.add(request, 1))
    _publish(comm, store, prefix, generation, state, now)
    state.answered = generation
    peers: dict[int, str] = {}
    deadline = time.monotonic() + PEER_ANSWER_S
    others = [r for r in range(comm.world_size) if r != comm.rank]
    while len(peers) < len(others) and time.monotonic() < deadline:
        for r in others:
            if r not in peers and store.check([f"{prefix}/{r}"]):
                got, _, what = store.get(f"{prefix}/{r}").decode().partition("|")
                if int(got) >= generation:
                    peers[r] = what
        time.sleep(0.05)
    said = "; ".join(
        f"rank {r}: {peers.get(r, 'no answer (not in a ubnext call of this communicator, or gone)')}" for r in others
    )
    log.warning(
        "ubnext watchdog: rank %d has waited %.1f s in %s; its peers' last calls: %s "
        "(UBNEXT_WARN_AFTER=%g; the ranks must make the same calls in the same order)",
        comm.rank,
        now - state.since,
        describe(comm),
        said,
        warn_after,
    )

"""An exclusive lock on a file, with a bounded wait: ranks on one node that find the same
artefact missing (a cubin, the emulator library) build it once; the others wait, then load it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

# NVRTC took 107 s for nvls.cu alone on a loaded 2-core machine (every sm_90 file, side by side,
# 36 s on a quiet one), the emulator build about a minute: a holder that keeps the lock for longer
# than this is stuck, not slow.
BUILD_LOCK_TIMEOUT_S = 600.0
_POLL_S = 0.05


class LockTimeout(TimeoutError):
    """The lock stayed held past the bound; the message names the lock, the task and the holder."""


@contextlib.contextmanager
def exclusive(path: Path, what: str, timeout: float = BUILD_LOCK_TIMEOUT_S):
    """Hold ``path`` locked for ``what`` (a phrase for the error message) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    fh.seek(0)
                    holder = fh.read().strip() or "unknown"
                    raise LockTimeout(
                        f"waited {timeout:.0f} s for the lock {path} to {what}; it is held "
                        f"by {holder}. If that process is gone, delete the lock file."
                    ) from None
                time.sleep(_POLL_S)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} on {os.uname().nodename}")
            fh.flush()
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)

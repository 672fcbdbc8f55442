"""The progress lines of the long first-use builds: the CPU emulator library (44 to 51 s) and each
kernel file's cubin (NVRTC, minutes for all of them), which ran without a word (issue 40 C11), so
that a first run looked hung.

They are INFO records (nothing is wrong) on the logger ``ubnext.build``, shown by default: the
``ubnext`` logger shows WARNING and above unless ``UBNEXT_LOG_LEVEL`` says otherwise, and a wait of a
minute with nothing on the screen is worse than two lines; ``UBNEXT_LOG_LEVEL=error`` silences
them, as it silences every warning, and ``logging.getLogger("ubnext.build")`` is the usual handle."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .. import envs


def level_for(asked: str) -> int:
    """The level of ``ubnext.build`` for ``UBNEXT_LOG_LEVEL=asked``: INFO for the default (warning),
    lower or higher only when asked for."""
    number = logging.getLevelName(asked.upper())
    return min(number, logging.INFO) if number <= logging.WARNING else number


log = logging.getLogger("ubnext.build")
log.setLevel(level_for(envs.get("UBNEXT_LOG_LEVEL")))


@contextmanager
def announce(what: str, where) -> Iterator[None]:
    """One line as the build of ``what`` into ``where`` starts, one with its time when it ends
    (none when it fails: the error says so)."""
    log.info("building %s into %s (first use of these sources here; later runs reuse it)", what, where)
    start = time.monotonic()
    yield
    log.info("built %s in %.1f s", what, time.monotonic() - start)

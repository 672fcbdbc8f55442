"""Sub-allocators of the symmetric pool's data arenas. Neither touches memory; they hand out
``[offset, offset + size)`` ranges.

- :class:`Allocator`: first fit with coalescing. The same sequence of allocations and frees gives
  the same offsets. The graph arena uses it (nothing there is ever freed).
- :class:`RingAllocator`: placement by the sequence of allocations alone, so ranks whose frees
  come at different times (the garbage collector runs at different moments on each rank) still
  get the same offsets, with no agreement between them. The eager arena uses it.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Allocator", "RingAllocator", "NoRoom"]


class NoRoom(MemoryError):
    """The arena has no free range large enough; the caller falls back."""


@dataclass
class _Stats:
    used: int = 0
    peak: int = 0
    allocations: int = 0
    failed: int = 0


def _checked_arena(base: int, size: int, min_align: int) -> tuple[int, int, int]:
    if size < 0 or base < 0:
        raise ValueError(f"arena base/size must be >= 0, got base={base} size={size}")
    if min_align <= 0 or min_align & (min_align - 1):
        raise ValueError(f"alignment must be a power of two, got {min_align}")
    return base, size, min_align


def _checked_request(nbytes: int, align: int, min_align: int) -> int:
    """The alignment an allocation of ``nbytes`` gets (at least the arena's), or a ValueError."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"allocation size must be a positive int, got {nbytes!r}")
    align = max(align, min_align)
    if align & (align - 1):
        raise ValueError(f"alignment must be a power of two, got {align}")
    return align


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) & ~(align - 1)


def _largest_in(free: list[tuple[int, int]], align: int, min_align: int) -> int:
    """The largest allocation aligned to ``align`` that fits in one of the ``free`` ranges."""
    align = max(align, min_align)
    return max((max(0, e - _align_up(s, align)) for s, e in free), default=0)


class Allocator:
    """Ranges of ``[base, base + size)``; offsets returned are absolute (include ``base``)."""

    def __init__(self, base: int, size: int, *, min_align: int = 16):
        self.base, self.size, self.min_align = _checked_arena(base, size, min_align)
        # free ranges sorted by start: parallel lists of starts and ends
        self._free_starts: list[int] = [base] if size else []
        self._free_ends: list[int] = [base + size] if size else []
        self._live: dict[int, int] = {}  # offset -> end
        # two threads may capture graphs at once; re-entrant for a finaliser run by a collection
        self._lock = threading.RLock()
        self.stats = _Stats()

    def alloc(self, nbytes: int, align: int = 16) -> int:
        align = _checked_request(nbytes, align, self.min_align)
        with self._lock:
            return self._alloc(nbytes, align)

    def _alloc(self, nbytes: int, align: int) -> int:
        for i, (start, end) in enumerate(zip(self._free_starts, self._free_ends)):
            offset = (start + align - 1) & ~(align - 1)
            if offset + nbytes <= end:
                self._take(i, offset, offset + nbytes)
                self._live[offset] = offset + nbytes
                self.stats.used += nbytes
                self.stats.peak = max(self.stats.peak, self.stats.used)
                self.stats.allocations += 1
                return offset
        self.stats.failed += 1
        raise NoRoom(
            f"no free range of {nbytes} bytes (align {align}) in the pool arena "
            f"({self.stats.used} of {self.size} bytes used, largest free {self.largest_free()})"
        )

    def _take(self, i: int, lo: int, hi: int) -> None:
        start, end = self._free_starts[i], self._free_ends[i]
        del self._free_starts[i], self._free_ends[i]
        # keep the pieces on both sides of [lo, hi)
        if hi < end:
            self._free_starts.insert(i, hi)
            self._free_ends.insert(i, end)
        if start < lo:
            self._free_starts.insert(i, start)
            self._free_ends.insert(i, lo)

    def free(self, offset: int) -> None:
        with self._lock:
            self._free(offset)

    def _free(self, offset: int) -> None:
        try:
            end = self._live.pop(offset)
        except KeyError:
            raise ValueError(f"offset {offset} is not a live allocation") from None
        self.stats.used -= end - offset
        i = bisect.bisect_left(self._free_starts, offset)
        start = offset
        # coalesce with the free neighbour on the left and on the right
        if i > 0 and self._free_ends[i - 1] == offset:
            i -= 1
            start = self._free_starts[i]
            del self._free_starts[i], self._free_ends[i]
        if i < len(self._free_starts) and self._free_starts[i] == end:
            end = self._free_ends[i]
            del self._free_starts[i], self._free_ends[i]
        self._free_starts.insert(i, start)
        self._free_ends.insert(i, end)

    def largest_free(self, align: int = 256) -> int:
        """The largest allocation that ``alloc(n, align)`` would place now (256: what
        ``SymmetricPool.empty`` asks for)."""
        return _largest_in(self.free_ranges(), align, self.min_align)

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._free_starts, self._free_ends))

    def live(self) -> dict[int, int]:
        return dict(self._live)


class RingAllocator:
    """Each allocation goes right after the previous one (back to the base when it does not fit
    before the end), whatever was freed meanwhile: frees only mark ranges dead. So the offsets are
    a function of the sequence of allocations, the same on every rank of SPMD code, however late
    each rank's garbage collector returns its garbage.

    Where a range still held lies in the way, ``collect`` (the pool passes ``gc.collect``) first
    gives it the chance to die: a rank whose collector has not yet run catches up with one whose
    collector has. Then whatever still lies in the way is skipped. After a collection, what is
    held is what the program holds, the same on every rank of SPMD code, so the skip is too. The
    price is a collection whenever the ring comes round to memory still held (a long-lived pool
    tensor), once per lap.

    Thread-safe: frees come from storage finalizers on whatever thread drops the last reference
    (autograd's, the garbage collector's inside ``collect``)."""

    def __init__(self, base: int, size: int, *, min_align: int = 16, collect: Callable[[], object] | None = None):
        self.base, self.size, self.min_align = _checked_arena(base, size, min_align)
        self._collect = collect
        self._next = base  # where the next allocation goes, if it fits
        self._starts: list[int] = []  # starts of the held ranges, sorted (they never overlap)
        self._live: dict[int, int] = {}  # start -> end
        self._lock = threading.RLock()  # re-entrant: collect() runs finalizers that free
        self.stats = _Stats()

    def _in_the_way(self, lo: int, hi: int) -> int | None:
        """The end of the last held range overlapping [lo, hi), or None."""
        i = bisect.bisect_left(self._starts, hi)
        if i and self._live[self._starts[i - 1]] > lo:
            return self._live[self._starts[i - 1]]
        return None

    def _first_candidate(self, nbytes: int, align: int) -> int:
        at = _align_up(self._next, align)
        return at if at + nbytes <= self.base + self.size else _align_up(self.base, align)

    def _place(self, nbytes: int, align: int) -> int | None:
        """The first offset from the ring's position to the end, then from the base back to the
        position, where nothing held lies in the way."""
        end = self.base + self.size
        origin = _align_up(self._next, align)
        for at, limit in ((origin, end), (_align_up(self.base, align), origin)):
            while at < limit and at + nbytes <= end:
                blocker = self._in_the_way(at, at + nbytes)
                if blocker is None:
                    return at
                at = _align_up(blocker, align)
        return None

    def alloc(self, nbytes: int, align: int = 16) -> int:
        align = _checked_request(nbytes, align, self.min_align)
        if nbytes > self.size:  # never fits: no collection for it
            self.stats.failed += 1
            raise NoRoom(f"{nbytes} bytes exceed the pool arena's ring ({self.size} bytes)")
        with self._lock:
            at = self._first_candidate(nbytes, align)
            if self._collect is not None and self._in_the_way(at, at + nbytes) is not None:
                self._collect()
            offset = self._place(nbytes, align)
            if offset is None:
                self.stats.failed += 1
                raise NoRoom(
                    f"no room for {nbytes} bytes (align {align}) in the pool arena's ring "
                    f"({self.stats.used} of {self.size} bytes held, largest free {self.largest_free()})"
                )
            bisect.insort(self._starts, offset)
            self._live[offset] = offset + nbytes
            self._next = offset + nbytes
            self.stats.used += nbytes
            self.stats.peak = max(self.stats.peak, self.stats.used)
            self.stats.allocations += 1
            return offset

    def free(self, offset: int) -> None:
        with self._lock:
            try:
                end = self._live.pop(offset)
            except KeyError:
                raise ValueError(f"offset {offset} is not a live allocation") from None
            del self._starts[bisect.bisect_left(self._starts, offset)]
            self.stats.used -= end - offset

    def free_ranges(self) -> list[tuple[int, int]]:
        with self._lock:
            out, at = [], self.base
            for start in self._starts:
                if start > at:
                    out.append((at, start))
                at = self._live[start]
            if at < self.base + self.size:
                out.append((at, self.base + self.size))
            return out

    def largest_free(self, align: int = 256) -> int:
        return _largest_in(self.free_ranges(), align, self.min_align)

    def live(self) -> dict[int, int]:
        with self._lock:
            return dict(self._live)

"""First-fit sub-allocator with coalescing, for the symmetric pool's data arena.

Deterministic: the same sequence of calls gives the same offsets, so ranks that allocate and
free in the same program order (SPMD code) hold the same offsets, which the in-place kernels
need. It never touches memory; it only hands out ``[offset, offset + size)`` ranges.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["Allocator", "NoRoom"]


class NoRoom(MemoryError):
    """The arena has no free range large enough; the caller falls back."""


@dataclass
class _Stats:
    used: int = 0
    peak: int = 0
    allocations: int = 0
    failed: int = 0


class Allocator:
    """Ranges of ``[base, base + size)``; offsets returned are absolute (include ``base``)."""

    def __init__(self, base: int, size: int, *, min_align: int = 16):
        if size < 0 or base < 0:
            raise ValueError(f"arena base/size must be >= 0, got base={base} size={size}")
        if min_align <= 0 or min_align & (min_align - 1):
            raise ValueError(f"alignment must be a power of two, got {min_align}")
        self.base = base
        self.size = size
        self.min_align = min_align
        # free ranges sorted by start: parallel lists of starts and ends
        self._free_starts: list[int] = [base] if size else []
        self._free_ends: list[int] = [base + size] if size else []
        self._live: dict[int, int] = {}  # offset -> end
        self.stats = _Stats()

    def alloc(self, nbytes: int, align: int = 16) -> int:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"allocation size must be a positive int, got {nbytes!r}")
        align = max(align, self.min_align)
        if align & (align - 1):
            raise ValueError(f"alignment must be a power of two, got {align}")
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
        align = max(align, self.min_align)
        return max((max(0, e - ((s + align - 1) & ~(align - 1))) for s, e in zip(self._free_starts, self._free_ends)),
                   default=0)

    def free_ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._free_starts, self._free_ends))

    def live(self) -> dict[int, int]:
        return dict(self._live)

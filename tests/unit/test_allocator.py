import random

import pytest

from ubnext.allocator import Allocator, NoRoom


def _check_invariants(a: Allocator, live: dict[int, int]):
    spans = sorted(live.items())
    for (o1, e1), (o2, _) in zip(spans, spans[1:]):
        assert e1 <= o2, "live allocations overlap"
    free = a.free_ranges()
    for (s1, e1), (s2, _) in zip(free, free[1:]):
        assert e1 < s2, "adjacent free ranges were not coalesced"
    # free + live cover the arena exactly once (alignment padding is free space)
    covered = sum(e - s for s, e in free) + sum(e - o for o, e in spans)
    assert covered == a.size
    for o, e in spans:
        assert a.base <= o and e <= a.base + a.size


@pytest.mark.parametrize("seed", range(40))
def test_random_sequences(seed):
    rng = random.Random(seed)
    a = Allocator(4096, 1 << 20)
    live: dict[int, int] = {}
    for _ in range(400):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.choice([1, 15, 16, 17, 255, 256, 4000, 65536, rng.randint(1, 200000)])
            align = rng.choice([16, 256, 4096])
            try:
                off = a.alloc(size, align)
            except NoRoom:
                assert a.largest_free(align) < size, "NoRoom although a large enough range was free"
                continue
            assert off % align == 0
            live[off] = off + size
        _check_invariants(a, live)
    for off in list(live):
        a.free(off)
    assert a.free_ranges() == [(4096, 4096 + (1 << 20))], "freeing everything must coalesce back to one range"
    assert a.stats.used == 0


def test_deterministic_offsets():
    def run():
        a = Allocator(0, 1 << 16)
        out = [a.alloc(100), a.alloc(3000, 256)]
        a.free(out[0])
        out.append(a.alloc(50))
        return out
    assert run() == run()


def test_first_fit_reuses_hole():
    a = Allocator(0, 4096)
    x, y, z = a.alloc(1024), a.alloc(1024), a.alloc(1024)
    a.free(y)
    assert a.alloc(512) == y


def test_no_room_and_stats():
    a = Allocator(0, 1024)
    a.alloc(1000)
    with pytest.raises(NoRoom):
        a.alloc(100)
    assert a.stats.failed == 1 and a.stats.peak == 1000


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_bad_sizes(size):
    with pytest.raises(ValueError):
        Allocator(0, 1024).alloc(size)


def test_bad_free_and_alignment():
    a = Allocator(0, 1024)
    with pytest.raises(ValueError):
        a.free(7)
    with pytest.raises(ValueError):
        a.alloc(16, align=24)


def test_largest_free_counts_the_alignment():
    """A free range that starts off the requested alignment holds less than its length: what
    largest_free reports must be allocatable at that alignment (SymmetricPool.empty asks 256)."""
    a = Allocator(16, 4112, min_align=16)  # one range [16, 4128); at 256 alignment [256, 4128)
    assert a.largest_free(16) == 4112
    assert a.largest_free(256) == 4128 - 256
    a.alloc(a.largest_free(256), 256)  # fits exactly
    with pytest.raises(NoRoom):
        a.alloc(a.largest_free(256) + 1, 256)

import random

import pytest

from ubnext.pool.allocator import Allocator, NoRoom


def _check_invariants(a: Allocator, live: dict[int, int]):
    spans = sorted(live.items())
    for (_, e1), (o2, _) in zip(spans, spans[1:]):
        assert e1 <= o2, "live allocations overlap"
    free = a.free_ranges()
    for (_, e1), (s2, _) in zip(free, free[1:]):
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
    _, y, _ = a.alloc(1024), a.alloc(1024), a.alloc(1024)
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


# ---------------------------------------------------------------------------- the ring (eager arena)


def test_ring_places_by_the_sequence_of_allocations_whatever_the_frees():
    """Two ranks allocate the same sequence; one frees each buffer at once, the other only much
    later (its garbage collector has not run): the offsets are the same."""
    from ubnext.pool.allocator import RingAllocator

    prompt, late = RingAllocator(0, 1 << 16), RingAllocator(0, 1 << 16)
    pending = []
    sizes = [1000, 4096, 300, 8000, 64, 12000, 5000, 700] * 3
    for nbytes in sizes:
        a, b = prompt.alloc(nbytes, 256), late.alloc(nbytes, 256)
        assert a == b
        prompt.free(a)
        pending.append(b)
        if len(pending) == 5:  # the late rank's collector finally runs
            for off in pending:
                late.free(off)
            pending.clear()


def test_ring_collects_before_it_skips_and_skips_what_is_still_held():
    from ubnext.pool.allocator import RingAllocator

    garbage: list[int] = []
    ring = RingAllocator(0, 4096, collect=lambda: [ring.free(o) for o in garbage] and garbage.clear())
    held = ring.alloc(1024)  # [0, 1024): held for good
    assert ring.alloc(2048) == 1024  # [1024, 3072)
    garbage.append(1024)  # dropped, but only the collector would free it
    calls = []
    ring._collect = lambda: (calls.append(1), [ring.free(o) for o in garbage], garbage.clear())
    # 2048 does not fit in [3072, 4096): back to the base, where [0, 1024) is held and [1024, 3072)
    # is garbage: one collection, then the held range is skipped
    assert ring.alloc(2048) == 1024 and calls == [1]
    assert held == 0 and ring.live() == {0: 1024, 1024: 3072}


def test_ring_without_room_raises_and_keeps_its_state():
    from ubnext.pool.allocator import NoRoom, RingAllocator

    ring = RingAllocator(0, 4096, collect=lambda: None)
    a = ring.alloc(3000)
    with pytest.raises(NoRoom):
        ring.alloc(2000)
    assert ring.stats.failed == 1 and ring.live() == {a: a + 3000}
    ring.free(a)
    assert ring.alloc(2000) == 0  # past the end of the last allocation there is no room: the base
    assert ring.largest_free() == 4096 - 2048


@pytest.mark.parametrize("kind", ["ring", "first_fit"])
def test_frees_from_other_threads_never_hand_out_overlapping_ranges(kind):
    """Issue 23 risk "the allocator has no lock": pool tensors are freed from storage finalizers on
    whatever thread drops the last reference (autograd's, NCCL's watchdog, a collection) while
    another thread allocates. Four threads allocating and freeing at once: every live range stays
    disjoint, and the books balance."""
    import random
    import sys
    import threading

    from ubnext.pool.allocator import Allocator, NoRoom, RingAllocator

    arena = RingAllocator(0, 1 << 20) if kind == "ring" else Allocator(0, 1 << 20)
    errors: list = []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows

    def worker(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(3000):
                if mine and rng.random() < 0.5:
                    arena.free(mine.pop(rng.randrange(len(mine))))
                else:
                    try:
                        mine.append(arena.alloc(rng.choice((16, 48, 256, 4096)), 16))
                    except NoRoom:
                        pass
                live = sorted(arena.live().items())
                assert all(e <= s2 for (_, e), (s2, _) in zip(live, live[1:])), "overlapping ranges"
            for off in mine:
                arena.free(off)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors[0]
    assert arena.live() == {} and arena.stats.used == 0


def test_the_pools_collection_runs_even_while_another_thread_collects():
    """Found in review: gc.collect() returns at once, collecting nothing, while another thread's
    collection is under way (a finaliser inside it can hand the interpreter over). The ring would
    then skip garbage a peer rank has already collected, and the ranks' offsets would differ.
    collect_garbage waits for the other collection, then collects: the garbage in the way is
    freed, and the ring places as on a rank whose collector had run."""
    import gc
    import threading

    from ubnext.pool.allocator import RingAllocator
    from ubnext.pool.symmetric import collect_garbage

    ring = RingAllocator(0, 4096, collect=collect_garbage)
    ring.alloc(1024)  # held
    inside, release = threading.Event(), threading.Event()

    class Slow:
        def __del__(self):  # runs inside the other thread's collection, and waits there
            inside.set()
            release.wait(5)

    class Holder:  # a pool tensor whose storage is in a reference cycle
        def __init__(self, offset):
            self.offset, self.me = offset, self

        def __del__(self):
            ring.free(self.offset)

    slow = Slow()
    slow.me = slow
    del slow
    gc.disable()
    try:
        other = threading.Thread(target=gc.collect)
        other.start()
        assert inside.wait(5)
        # garbage made while the other collection runs: only a collection after it frees it
        Holder(ring.alloc(2048))  # [1024, 3072)
        threading.Timer(0.05, release.set).start()  # the other collection ends a little later
        assert ring.alloc(2048) == 1024  # the garbage was collected first, not skipped
        other.join()
    finally:
        gc.enable()

"""Closing a pool never leaves a pool tensor pointing at unmapped memory: the backend releases
its memory when the last view goes (one emulator rank, no GPU)."""

from __future__ import annotations

import gc

import torch

from ubnext.pool import SymmetricPool, plan_layout


def _pool():
    return SymmetricPool(
        layout=plan_layout(1, 1024),
        rank=0,
        group=None,
        device=torch.device("cpu"),
        allgather=lambda obj: [obj],
        timeout_s=30.0,
        backend="emulator",
    )


def test_close_defers_release_until_the_last_view_goes():
    pool = _pool()
    t = pool.empty((1024,), torch.float32)
    view = t[100:200]
    t.fill_(3.0)
    backend = pool.backend
    del t
    pool.close()
    assert not backend.released, "closed while a view of the pool was alive"
    view.add_(1.0)  # mapped: no fault
    assert torch.equal(view, torch.full((100,), 4.0))
    del view
    gc.collect()
    # the last view's finaliser only queues the release (another thread may be capturing a graph
    # in global mode, where a release would break it): the next pool creation or close does it
    assert not backend.released
    _pool().close()
    assert backend.released, "the memory outlived its last view and the next close"


def test_close_without_views_releases_at_once():
    pool = _pool()
    pool.close()
    assert pool.backend.released


def test_a_captured_pool_is_kept_for_its_graphs():
    pool = _pool()
    pool.captured = True
    pool.close()
    assert not pool.backend.released


def test_a_release_that_meets_a_capture_waits_for_its_end(monkeypatch):
    """The last view can die (garbage collection) while another stream captures a graph: releasing
    then (synchronise, unmap) would break the capture, so it waits for the next pool creation or
    close outside capture."""
    import ubnext.runtime._cuda as cu
    from ubnext import pool as pool_mod

    pool = _pool()
    t = pool.empty((64,), torch.float32)
    pool.close()
    monkeypatch.setattr(cu, "capturing", lambda device: True)
    del t
    gc.collect()
    assert not pool.backend.released
    pool_mod.release_deferred()  # still capturing: nothing happens
    assert not pool.backend.released
    monkeypatch.setattr(cu, "capturing", lambda device: False)
    pool_mod.release_deferred()
    assert pool.backend.released


def test_staging_views_are_reused_in_and_out_of_inference_mode():
    """A staging view is made once per shape and kept (the hot path of ubnext.nn.Linear writes its
    GEMM into it): one made under inference_mode must still take in-place writes outside it, and
    close() drops the kept views with the rest, releasing the memory."""
    pool = _pool()
    with torch.inference_mode():
        first = pool.staging((4, 8), torch.bfloat16)
    assert pool.staging((4, 8), torch.bfloat16) is first
    torch.matmul(torch.ones(4, 2, dtype=torch.bfloat16), torch.ones(2, 8, dtype=torch.bfloat16), out=first)
    assert torch.equal(pool.staging((4, 8), torch.bfloat16), torch.full((4, 8), 2.0, dtype=torch.bfloat16))
    assert pool.staging((32,), torch.bfloat16).data_ptr() == first.data_ptr()  # the same fixed region
    backend = pool.backend
    del first
    pool.close()
    gc.collect()
    assert backend.released


def test_comm_empty_inside_capture_takes_the_graph_arena_without_a_host_round_trip(monkeypatch):
    """Issue 23 item 3, lifted by issue 25 item 2: comm.empty no longer agrees on offsets with the
    peers (all_gather_object, a host round trip that breaks a capture): inside a capture it takes
    the graph arena, whose placement is the sequence of allocations alone, and keeps the block
    for the pool's life (a captured graph replays on it)."""
    import ubnext.runtime._cuda as cu
    from ubnext.comm import Communicator

    pool = _pool()
    comm = object.__new__(Communicator)  # one emulator rank, no process group
    comm._closed, comm._pool, comm._pool_error, comm.mode = False, pool, None, "emulator"
    comm.device, comm._logged = torch.device("cpu"), set()

    def all_gather_object(obj):  # what a host round trip meets inside a real capture
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    comm._allgather = all_gather_object
    monkeypatch.setattr(cu, "capturing", lambda device: True)
    t = comm.empty(64, dtype=torch.float32)
    assert pool.contains(t) and pool.captured
    assert list(pool.arenas["graph"].live()) == [pool.offset_of(t)] and pool.arenas["eager"].live() == {}
    del t
    assert len(pool.arenas["graph"].live()) == 1, "a captured block must outlive its Python tensor"

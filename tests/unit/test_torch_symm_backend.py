"""TorchSymmBackend against fake torch symmetric-memory handles (no GPU): the multicast address
must be right under both conventions torch has shipped for ``multicast_ptr``, and a pool that
torch places inside a block is refused (the caller then takes ubnext's own VMM)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed._symmetric_memory as symm_mem

from ubnext import pool

BLOCK = 0x7F00_0000_0000  # rank r's block base: BLOCK + r * STRIDE
STRIDE = 1 << 32
MC_BLOCK = 0x7E00_0000_0000  # the block's multicast base


class FakeTensor:
    def __init__(self, ptr):
        self.ptr = ptr

    def data_ptr(self):
        return self.ptr


class FakeHandle:
    """What rendezvous returns: buffer_ptrs are block bases; multicast_ptr per the convention."""

    def __init__(self, offset, convention):
        self.buffer_ptrs = [BLOCK + r * STRIDE for r in range(2)]
        self.multicast_ptr = MC_BLOCK + (offset if convention == "offset_added" else 0)


class FakeGroup:
    group_name = "fake"

    def rank(self):
        return 1


@pytest.fixture
def fake_symm(monkeypatch):
    state = {}

    def empty(size, dtype, device):
        state["size"] = size
        return FakeTensor(BLOCK + STRIDE + state["offset"])  # rank 1's tensor

    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", lambda t, name: FakeHandle(state["offset"], state["convention"]))
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", lambda name: None, raising=False)
    return state


@pytest.mark.parametrize("convention", ["block_base", "offset_added"])
def test_multicast_address_under_both_conventions(fake_symm, convention):
    fake_symm.update(offset=0, convention=convention)
    b = pool.TorchSymmBackend(3 << 20, FakeGroup(), torch.device("cpu"), lambda obj: [obj, obj])
    assert b.peer_bases == [BLOCK, BLOCK + STRIDE]
    assert b.mc_base == MC_BLOCK  # the multicast address of the pool's byte 0, once
    assert fake_symm["size"] % pool.TORCH_SYMM_SEGMENT == 0 and fake_symm["size"] >= 3 << 20


@pytest.mark.parametrize("convention", ["block_base", "offset_added"])
def test_pool_inside_a_block_is_refused(fake_symm, convention):
    fake_symm.update(offset=1 << 20, convention=convention)
    with pytest.raises(RuntimeError, match="1048576 bytes into its block"):
        pool.TorchSymmBackend(4 << 20, FakeGroup(), torch.device("cpu"), lambda obj: [obj, obj])


def test_a_rank_whose_allocation_fails_stops_every_rank_before_the_rendezvous(monkeypatch):
    """rendezvous is collective: a rank whose symm_mem.empty failed must not leave its peers in it."""
    def empty(*args, **kwargs):
        raise RuntimeError("out of symmetric memory")

    monkeypatch.setattr(symm_mem, "empty", empty)
    monkeypatch.setattr(symm_mem, "rendezvous", lambda t, name: pytest.fail("rendezvous after a failure"))
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", lambda name: None, raising=False)
    with pytest.raises(pool.PoolSetupError, match="symm_mem.empty failed on rank 0: RuntimeError: out of"):
        pool.TorchSymmBackend(4 << 20, FakeGroup(), torch.device("cpu"), lambda obj: [obj, None])

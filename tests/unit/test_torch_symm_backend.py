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


def test_other_torch_symmetric_memory_backends_are_refused(fake_symm, monkeypatch):
    """Issue 23 risk: with TORCH_SYMMMEM=NVSHMEM or NCCL, buffer_ptrs can be null and offsets follow
    other rules: refused with a message naming the backend (SymmetricPool then takes ubnext's VMM,
    agreed across ranks), before anything is allocated."""
    fake_symm.update(offset=0, convention="block_base")
    for name in ("NVSHMEM", "NCCL"):
        monkeypatch.setattr(symm_mem, "get_backend", lambda device, name=name: name)
        fake_symm.pop("size", None)
        with pytest.raises(RuntimeError, match=f"uses its {name} backend"):
            pool.TorchSymmBackend(3 << 20, FakeGroup(), torch.device("cpu"), lambda obj: [obj, obj])
        assert "size" not in fake_symm, "allocated before refusing"
    monkeypatch.setattr(symm_mem, "get_backend", lambda device: "CUDA")
    assert pool.TorchSymmBackend(3 << 20, FakeGroup(), torch.device("cpu"), lambda obj: [obj, obj]).peer_bases


def test_the_pool_leaves_inductors_all_reduce_lowering_alone(monkeypatch):
    """Issue 23 risk: torch's enable_symm_mem_for_group marks a group so that Inductor lowers every
    compiled all_reduce of it to torch's one-shot op (torch/_inductor/comm_lowering.py,
    is_symm_mem_enabled_for_group), which refuses fp16 and odd 2-byte lengths. torch 2.13 deprecates
    it as unneeded: the pool must not call it there, so the group stays unmarked. A real (one-rank,
    gloo) group and torch's real enable/is_enabled functions; only allocation and rendezvous, which
    need CUDA, are faked."""
    import torch.distributed as dist

    assert hasattr(symm_mem.enable_symm_mem_for_group, "__deprecated__"), "this torch still needs the call"
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        monkeypatch.setattr(symm_mem, "empty", lambda size, dtype, device: FakeTensor(BLOCK))
        handle = FakeHandle(0, "block_base")
        handle.buffer_ptrs = [BLOCK]
        monkeypatch.setattr(symm_mem, "rendezvous", lambda t, name: handle)
        b = pool.TorchSymmBackend(3 << 20, group, torch.device("cpu"), lambda obj: [obj])
        assert b.peer_bases == [BLOCK]
        assert not symm_mem.is_symm_mem_enabled_for_group(group.group_name), (
            "the pool marked the group: Inductor would lower its compiled all_reduces to torch's one-shot op"
        )
    finally:
        symm_mem._group_name_to_store.pop(dist.group.WORLD.group_name, None)
        dist.destroy_process_group()

"""Issue 23 item 2: ubnext's own bootstrap with a fake torch.cuda (no GPU). NCCL refuses a
communicator with two ranks on one GPU ("Duplicate GPU detected"), so ranks that share a GPU must
come up on gloo, without a device_id, by a decision every rank takes alike; ranks that each see
one GPU of their own (CUDA_VISIBLE_DEVICES set per rank) keep NCCL."""

from __future__ import annotations

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import ubnext.runtime._cuda
from ubnext.runtime import _lifecycle

pytestmark = pytest.mark.filterwarnings("ignore:Attempted to get default timeout:UserWarning")


class Recorded(Exception):
    """init_process_group was reached; its arguments are in ``kwargs``."""

    def __init__(self, kwargs):
        super().__init__("init_process_group reached")
        self.kwargs = kwargs


def _bootstrap_rank0(monkeypatch, peer_gpu: str, visible: int):
    """Rank 0 of two, under torchrun, bootstrapping while its peer (rank 1, on ``peer_gpu``) does
    the same through the shared store; each rank sees ``visible`` devices and runs on GPU-A. The
    arguments init_process_group got, and what the peer decided."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv("UBNEXT_TIMEOUT", raising=False)
    monkeypatch.setattr(ubnext.runtime._cuda, "gpu_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    current = [None]
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(0, int(d)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="GPU-A"))
    shared = dist.HashStore()
    shared.set_timeout(timedelta(seconds=20))
    monkeypatch.setattr(dist, "rendezvous", lambda url, rank, world_size, **kw: iter([(shared, rank, world_size)]))

    def init_process_group(**kwargs):
        raise Recorded(kwargs)

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    peer = {}
    host = _lifecycle.host_identity()

    def rank1():
        store = dist.PrefixStore("default_pg", shared)
        _lifecycle._agree_on_environment(store, 1, 2, None)  # issue 40 C3: every rank's environment first
        peer["shared"] = _lifecycle._ranks_share_a_gpu(store, 1, 2, f"{host}/{peer_gpu}")

    thread = threading.Thread(target=rank1, daemon=True)
    thread.start()
    with pytest.raises(Recorded) as got:
        _lifecycle.bootstrap()
    thread.join(30)
    return got.value.kwargs, peer.get("shared")


def test_ranks_sharing_a_gpu_bootstrap_with_gloo(monkeypatch, caplog):
    with caplog.at_level("WARNING", logger="ubnext"):
        kwargs, peer_shared = _bootstrap_rank0(monkeypatch, peer_gpu="GPU-A", visible=1)
    assert kwargs["backend"] == "gloo"
    assert "device_id" not in kwargs  # NCCL-style eager init would bind the GPU
    assert peer_shared is True, "the peer decided otherwise"
    assert "several ranks share a GPU" in caplog.text


def test_ranks_on_their_own_gpus_keep_nccl(monkeypatch):
    """One visible GPU per rank, two local ranks: more ranks than devices, yet no GPU is shared."""
    kwargs, peer_shared = _bootstrap_rank0(monkeypatch, peer_gpu="GPU-B", visible=1)
    assert kwargs["backend"] == "nccl" and kwargs["device_id"] == torch.device("cuda", 0)
    assert peer_shared is False
    assert isinstance(kwargs["store"], dist.PrefixStore)  # what init_process_group's env:// made

"""Issue 23 risk "host synchronisation during capture": a capture on the calling thread must never
reach a device synchronisation (it would invalidate the user's capture): not the one that
completes a kernel's error report, nor UBNEXT_DEBUG's after every launch. A communicator with a
GPU device and a faked capture state; torch.cuda.synchronize recorded (this CPU torch has none)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import ubnext.runtime._cuda as cu
from ubnext.comm import Communicator
from ubnext.errors import ERR_TIMEOUT, UbnextError


@pytest.fixture
def gpu_comm(monkeypatch):
    syncs: list = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    comm = object.__new__(Communicator)
    comm.device, comm.rank, comm.mode, comm._broken = torch.device("cuda", 0), 0, "gpu", None
    words = torch.tensor([ERR_TIMEOUT, 5, 0, 1, 0, 0, 0, 0], dtype=torch.int32)
    comm._pool = SimpleNamespace(err_word=words, err_view=words.numpy(), timeout_s=2.0, captured=False)
    return comm, syncs


@pytest.mark.parametrize("capturing", [False, True])
def test_a_kernel_error_is_raised_without_synchronising_inside_a_capture(gpu_comm, monkeypatch, capturing):
    comm, syncs = gpu_comm
    monkeypatch.setattr(cu, "capturing", lambda device: capturing)
    with pytest.raises(UbnextError, match="timed out in twoshot"):
        comm._raise_kernel_error(comm._pool)
    assert syncs == ([] if capturing else [comm.device])


@pytest.mark.parametrize("capturing", [False, True])
def test_debug_mode_does_not_synchronise_a_captured_launch(gpu_comm, monkeypatch, capturing):
    comm, syncs = gpu_comm
    comm._pool.err_view[0] = 0
    monkeypatch.setattr(cu, "launch", lambda *args: None)
    monkeypatch.setattr(cu, "launch_config", lambda *args: None)
    comm._debug, comm._capturing, comm._stream, comm._device_index = True, capturing, 0, 0
    comm._launch_done = "event"
    how = SimpleNamespace(kernel=0, grid=1, block=32, pdl=True, cluster=1, params=None)
    comm._run(how, (0,) * 7)
    assert syncs == ([] if capturing else [comm.device])
    assert comm._pool.captured == capturing

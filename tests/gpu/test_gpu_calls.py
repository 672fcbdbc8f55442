"""GPU-only calls whose rule only a GPU can show, one GPU, no ranks (docs/TESTING.md lists every
GPU-only call and where it is tested): the probe and the arch against torch's view of the device,
the pinned error word written by a kernel through its device address, and torch.as_tensor over a
cuMem mapping of ubnext's own VMM backend (a one-rank pool), released at the next pool creation or
close after its last view (the deferred release, ubnext/pool/_backend.py). Written
without a GPU at hand: their first run is scripts/gpu_check.sh on a GPU node."""

import gc

import pytest
import torch

from ubnext.runtime import _cuda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _cuda.gpu_available(), reason=f"GPU tier: {_cuda.no_gpu_reason()}"),
]


def test_the_probe_and_the_arch_agree_with_torch():
    assert _cuda.no_gpu_reason() == f"{torch.cuda.device_count()} CUDA device(s)"
    major, minor = torch.cuda.get_device_capability(0)
    assert _cuda.device_arch(0) == f"sm_{major}{minor}"


def test_a_kernel_writes_the_pinned_error_word_through_its_device_address():
    """The pool's error word: pinned by torch, its device address from cuMemHostGetDevicePointer,
    wrapped by torch.as_tensor through __cuda_array_interface__ (as the kernels' pointer is) and
    written by a CUDA kernel (torch's fill_); the host reads it without a copy."""
    from ubnext.pool import _Slot
    from ubnext.pool.symmetric import _device_pointer_of_pinned

    word = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    address = _device_pointer_of_pinned(word)
    seen_by_gpu = _Slot(address, word.nbytes, torch.device("cuda", 0), None).tensor(torch.device("cuda", 0))
    assert seen_by_gpu.is_cuda and seen_by_gpu.data_ptr() == address
    seen_by_gpu.view(torch.int32)[1].fill_(0x5EED)
    torch.cuda.synchronize()
    assert word.tolist() == [0, 0x5EED, 0, 0]


def test_torch_wraps_a_cumem_mapping_and_the_pool_goes_with_its_last_view():
    """ubnext's VMM backend on one rank: cuMemCreate, export and import of its own fd, map, set
    access (and a multicast object where the GPU has one); torch.as_tensor over the mapping is a
    CUDA tensor at the mapped address that kernels read and write; close() never releases the memory
    while a view is alive, and the last view's death only queues the release (a finaliser may run
    while another thread captures a CUDA graph, where unmapping would break it): the next pool
    creation or close does it (tests/unit/test_pool_lifetime.py is the emulator's copy)."""
    from ubnext import pool

    backend = pool.VmmBackend(4 << 20, 0, 1, torch.device("cuda", 0), lambda obj: [obj])
    local = backend.local_tensor()
    assert local.is_cuda and local.data_ptr() == backend.peer_bases[0] and local.numel() == backend.size
    view = local[: 1 << 20].view(torch.float32)
    view.fill_(2.0)
    assert view.sum().item() == 2.0 * view.numel()
    del local
    backend.close()
    assert not backend.released, "released while a view is alive"
    assert view.sum().item() == 2.0 * view.numel()
    del view
    gc.collect()
    assert not backend.released, "released by the last view's finaliser, not at the next pool creation or close"
    pool.VmmBackend(4 << 20, 0, 1, torch.device("cuda", 0), lambda obj: [obj]).close()
    assert backend.released, "the memory outlived its last view and the next close"

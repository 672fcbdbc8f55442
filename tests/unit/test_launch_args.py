"""The kernel parameters as cuLaunchKernelEx receives them (``kernelParams``: an array of pointers, one
to each parameter's value), built by _cuda.KernelParams: the descriptor's bytes by value, then
pointer-sized pointers and 4-byte int32 / float32, each the value the kernel ABI expects; the pointers
and scalars packed as cuda.core's own argument handler packs them (it needs no GPU). ctypes only
reads the packed bytes back here; ubnext's GPU path does not use it."""

import ctypes
import threading

import numpy as np
import pytest

from ubnext import kernels, pool
from ubnext.runtime import _cuda
from ubnext.runtime._cuda import KernelParams, pack_kernel_args

_READ = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "f32": ctypes.c_float}
DESC = pool.pack_desc(
    rank=1,
    nranks=2,
    timeout_ns=5,
    err_ptr=0x7000,
    mc_base=0x9000,
    layout=pool.PoolLayout(2, 4096, 8192),
    peer_bases=[0x1_0000_0000, 0x2_0000_0000],
)


def _param_holder():
    for mod in ("cuda.core._kernel_arg_handler", "cuda.core.experimental._kernel_arg_handler"):
        try:
            return __import__(mod, fromlist=["ParamHolder"]).ParamHolder
        except ImportError:
            continue
    pytest.skip("cuda.core's kernel argument handler is not importable")


def _read_back(address: int, signature) -> list:
    """The values a kernelParams array points to, read as the signature's kinds."""
    slots = (ctypes.c_void_p * len(signature)).from_address(address)
    values = []
    for (_, kind), slot in zip(signature, slots):
        if kind == "desc":
            values.append(ctypes.string_at(slot, pool.DESC_STRUCT_BYTES))
        else:
            values.append(_READ[kind].from_address(slot).value)
    return values


def _values():
    """Seven pointers (some above 4 GiB, some 0) and four scalars at the edges of their types."""
    pointers = [(0x7F00_0000_0000 + (i << 8)) if i % 3 else 0 for i in range(7)]
    pointers[1] = 0x1_0000_0001  # would lose its high word if packed as a 32-bit value
    return pointers, [2**31 - 1, -7, 1e-6, 13]


def test_kernel_params_hold_every_argument_of_the_signature():
    pointers, scalars = _values()
    params = KernelParams(DESC, pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], scalars))
    got = _read_back(params.address(pointers), kernels.KERNEL_SIGNATURE)
    assert got[0] == DESC
    assert got[1:8] == pointers
    assert got[8:10] == scalars[:2] and got[11] == scalars[3]
    assert got[10] == float(np.float32(scalars[2]))
    # the next call's pointers replace these; the descriptor and the scalars stay
    got = _read_back(params.address(list(range(16, 16 + 7))), kernels.KERNEL_SIGNATURE)
    assert got[0] == DESC and got[1:8] == list(range(16, 23)) and got[8:10] == scalars[:2]


def test_pointers_and_scalars_are_packed_as_cuda_core_packs_them():
    """The same bytes as cuda.core's ParamHolder makes of the pointers (Python ints) and the scalars
    (numpy scalars): what cuda.core's launch would have passed for them."""
    ParamHolder = _param_holder()
    pointers, scalars = _values()
    packed = pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], scalars)
    holder = ParamHolder([*pointers, *packed])
    theirs = (ctypes.c_void_p * 11).from_address(holder.ptr)
    ours = (ctypes.c_void_p * 12).from_address(KernelParams(DESC, packed).address(pointers))
    sizes = [8] * 7 + [4] * 4
    assert [ctypes.string_at(a, n) for a, n in zip(theirs, sizes)] == [
        ctypes.string_at(a, n) for a, n in zip(list(ours)[1:], sizes)
    ]


def test_each_thread_fills_its_own_buffer():
    """The driver copies the values during the launch call; two threads launching one signature at
    once must still never see each other's pointers."""
    params = KernelParams(DESC, pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], [1, 2, 0.5, 3]))
    mine = params.address([1] * 7)
    seen = {}
    worker = threading.Thread(target=lambda: seen.setdefault("address", params.address([2] * 7)))
    worker.start()
    worker.join()
    assert seen["address"] != mine
    assert _read_back(mine, kernels.KERNEL_SIGNATURE)[1:8] == [1] * 7


def test_scalar_types():
    packed = pack_kernel_args((("p", "ptr"), ("n", "i32"), ("e", "f32")), (5, 7, 0.5))
    assert type(packed[0]) is int
    assert isinstance(packed[1], np.int32) and isinstance(packed[2], np.float32)
    if int(np.__version__.split(".")[0]) >= 2:  # numpy 1.x wraps out-of-range values instead
        with pytest.raises(OverflowError):
            pack_kernel_args((("n", "i32"),), (2**31,))


@pytest.mark.parametrize("pdl_env,major,pdl", [(None, 9, True), ("0", 9, False), (None, 8, False), ("1", 10, True)])
def test_a_cached_launch_passes_the_descriptor_the_scalars_and_the_pdl_rule(monkeypatch, pdl_env, major, pdl):
    """The hot path lays out a call signature's descriptor and scalars once (Executor._launch_for) and
    adds the pointers per call (Executor._run): what reaches _cuda.launch is the loaded kernel's
    handle, the geometry on the call's stream, the attribute on sm_90 and later unless UBNEXT_PDL=0, and
    kernelParams holding all twelve values."""
    from types import SimpleNamespace

    import torch

    from ubnext.comm import Communicator

    if pdl_env is None:
        monkeypatch.delenv("UBNEXT_PDL", raising=False)
    else:
        monkeypatch.setenv("UBNEXT_PDL", pdl_env)
    launched, configs = [], []
    monkeypatch.setattr(kernels, "load_kernel", lambda name, index: SimpleNamespace(handle=0xABC000 + index))
    monkeypatch.setattr(_cuda, "_compute_major", lambda index: major)
    monkeypatch.setattr(_cuda, "launch", lambda *args: launched.append(args))
    monkeypatch.setattr(_cuda, "launch_config", lambda *args: configs.append(args) or "config")
    comm = object.__new__(Communicator)
    comm.mode, comm.world_size, comm._sm_count, comm._device_index = "gpu", 4, 132, 1
    comm._capturing, comm._stream, comm._debug, comm._launch_done = False, 0x5000, False, "done-event"
    comm._pool = SimpleNamespace(has_multicast=True, desc=DESC)
    pointers = tuple(0x7F0000001000 + 16 * i for i in range(7))
    for algo, hidden, flags in (("lamport", 0, 0), ("nvls_twoshot", 0, 0), ("lamport", 512, 13)):
        launch = comm._launch_for(algo, torch.bfloat16, 4096, hidden, 1e-6, flags)
        sent_flags = flags | (kernels.F_MULTICAST if algo == "lamport" else 0)
        comm._run(launch, pointers)
        kernel, config, params, sent_pointers, done = launched.pop()
        assert done == "done-event"  # recorded after the kernel, for the next stream switch
        assert kernel == 0xABC001 and config == "config" and sent_pointers == pointers
        # on the communicator's device, with the call's cluster
        assert configs.pop() == (launch.grid, launch.block, 0x5000, pdl, 1, launch.cluster)
        got = _read_back(params.address(pointers), kernels.KERNEL_SIGNATURE)
        assert got[0] == DESC and tuple(got[1:8]) == pointers
        assert got[8:10] == [4096, hidden] and got[11] == sent_flags and got[10] == float(np.float32(1e-6))
        assert launch.scalars == (4096, hidden, 1e-6, sent_flags) and launch.pdl == pdl
    assert [k for _, k in kernels.KERNEL_SIGNATURE] == ["desc"] + ["ptr"] * 7 + ["i32", "i32", "f32", "i32"]


@pytest.mark.parametrize("max_clusters,cluster", [(2, 8), (1, 1), (0, 1)])
def test_the_row_split_launches_as_a_cluster_when_two_fit(monkeypatch, max_clusters, cluster):
    """The fused Lamport op at 1 x 8192 bf16 on a GPU (issue 38 item 2): 8 CTAs of 128 threads, one thread-block
    cluster of 8 for the row, its cluster-dimension reaching launch_config, as long as the device holds twice
    its clusters at once (cuOccupancyMaxActiveClusters, asked at its shape: launch_rules.h pair_clusters_fit);
    otherwise the same grid without a cluster, whose rows the kernel gives to one CTA each."""
    from types import SimpleNamespace

    import torch

    from ubnext.comm import Communicator

    asked, configs = [], []
    monkeypatch.setattr(kernels, "load_kernel", lambda name, index: SimpleNamespace(handle=0xABC000 + index))
    monkeypatch.setattr(_cuda, "_compute_major", lambda index: 9)
    monkeypatch.setattr(_cuda, "launch", lambda *args: None)
    monkeypatch.setattr(_cuda, "launch_config", lambda *args: configs.append(args) or "config")
    monkeypatch.setattr(
        _cuda, "max_active_clusters", lambda kernel, block, c, index: asked.append((block, c)) or max_clusters
    )
    comm = object.__new__(Communicator)
    comm.mode, comm.world_size, comm._sm_count, comm._device_index = "gpu", 8, 132, 0
    comm._capturing, comm._stream, comm._debug, comm._launch_done = False, 0x5000, False, "done-event"
    comm._pool = SimpleNamespace(has_multicast=True, desc=DESC)
    launch = comm._launch_for("lamport", torch.bfloat16, 8192, 8192, 1e-6, kernels.F_FUSED_NORM)
    assert (launch.grid, launch.block, launch.cluster) == (8, 128, cluster) and asked == [(128, 8)]
    comm._run(launch, (0x7F0000001000,) * 7)
    assert configs.pop() == (8, 128, 0x5000, True, 0, cluster)

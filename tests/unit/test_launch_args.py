"""pack_kernel_args produces what cuda.core's launch packs into the kernel's parameter buffer
(pointer-sized pointers, 4-byte int32 and float32), checked with cuda.core's own argument
handler, which needs no GPU. ctypes only reads the packed bytes back here; ubnext's GPU path
does not use it."""

import ctypes

import numpy as np
import pytest

from ubnext import kernels
from ubnext._cuda import pack_kernel_args


def _param_holder():
    for mod in ("cuda.core._kernel_arg_handler", "cuda.core.experimental._kernel_arg_handler"):
        try:
            return __import__(mod, fromlist=["ParamHolder"]).ParamHolder
        except ImportError:
            continue
    pytest.skip("cuda.core's kernel argument handler is not importable")


_READ = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "f32": ctypes.c_float}


def test_packed_args_match_kernel_signature():
    ParamHolder = _param_holder()
    sig = kernels.KERNEL_SIGNATURE
    values = []
    for i, (_, kind) in enumerate(sig):
        if kind == "ptr":
            values.append((0x7F00_0000_0000 + (i << 8)) if i % 3 else 0)
        elif kind == "i32":
            values.append(-(i + 1) if i % 2 else 2**31 - 1 - i)
        else:
            values.append(1e-6 * (i + 1))
    packed = pack_kernel_args(sig, values)
    holder = ParamHolder(packed)
    addrs = (ctypes.c_void_p * len(packed)).from_address(holder.ptr)
    for (name, kind), value, addr in zip(sig, values, addrs):
        got = _READ[kind].from_address(addr).value
        if kind == "f32":
            assert got == float(np.float32(value)), name
        else:
            assert got == value, name


def test_pointer_above_4gib_is_pointer_sized():
    ParamHolder = _param_holder()
    ptr = 0x1_0000_0001  # would lose its high word if packed as a 32-bit value
    holder = ParamHolder(pack_kernel_args((("p", "ptr"),), (ptr,)))
    (addr,) = (ctypes.c_void_p * 1).from_address(holder.ptr)
    assert ctypes.c_uint64.from_address(addr).value == ptr


def test_scalar_types():
    packed = pack_kernel_args((("p", "ptr"), ("n", "i32"), ("e", "f32")), (5, 7, 0.5))
    assert type(packed[0]) is int
    assert isinstance(packed[1], np.int32) and isinstance(packed[2], np.float32)
    if int(np.__version__.split(".")[0]) >= 2:  # numpy 1.x wraps out-of-range values instead
        with pytest.raises(OverflowError):
            pack_kernel_args((("n", "i32"),), (2**31,))


def test_a_cached_launch_packs_what_the_generic_packer_packs(monkeypatch):
    """The hot path packs a call signature's scalars once (Communicator._launch_for) and adds the
    pointers per call (Communicator._run): what reaches _cuda.launch must be what pack_kernel_args
    makes of all twelve, with the signature's kernel and launch configuration."""
    from types import SimpleNamespace

    import torch

    from ubnext import _cuda
    from ubnext.comm import Communicator

    launched = []
    monkeypatch.setattr(kernels, "load_kernel", lambda name, index: ("kernel", name, index))
    monkeypatch.setattr(_cuda, "launch", lambda *args: launched.append(args))
    comm = object.__new__(Communicator)
    comm.mode, comm.world_size, comm._sm_count, comm._device_index = "gpu", 4, 132, 1
    comm._capturing, comm._stream, comm._debug, comm._launch_done = False, 0x5000, False, "done-event"
    comm._pool = SimpleNamespace(has_multicast=True)
    pointers = tuple(0x7F0000001000 + 16 * i for i in range(8))
    for algo, hidden, flags in (("lamport", 0, 0), ("nvls_twoshot", 0, 0), ("lamport", 512, 13)):
        launch = comm._launch_for(algo, torch.bfloat16, 4096, hidden, 1e-6, flags)
        sent_flags = flags | (kernels.F_MULTICAST if algo == "lamport" else 0)
        generic = pack_kernel_args(kernels.KERNEL_SIGNATURE, list(pointers) + [4096, hidden, 1e-6, sent_flags])
        comm._run(launch, pointers)
        kernel, config, stream, fast, device_index, done = launched.pop()
        assert done == "done-event"  # recorded after the kernel, for the next stream switch
        assert [type(v) for v in fast] == [type(v) for v in generic] and list(fast) == generic
        assert kernel == ("kernel", launch.name, 1) and stream == 0x5000 and device_index == 1
        assert config is _cuda.launch_config(launch.grid, launch.block)
        assert launch.scalars == (4096, hidden, 1e-6, sent_flags)
    assert [k for _, k in kernels.KERNEL_SIGNATURE] == ["ptr"] * 8 + ["i32", "i32", "f32", "i32"]

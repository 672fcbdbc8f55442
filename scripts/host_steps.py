"""Where the host time of one fused call goes: each step of the hot path timed alone.

    UBNEXT_EMULATE=1 UBNEXT_SELFTEST=0 mpirun -np 2 python scripts/host_steps.py

Same set-up as ``python -m ubnext.bench --host`` (the GPU branch over an emulator pool, a fake
current stream, a no-op in place of the launch), 8 x 4096 bf16; best of 5 x 20000 calls of each
step, microseconds per call, printed by rank 0. A profiling aid for docs/PERF.md, not a test.
"""

import time
from unittest import mock

import torch
import torch.distributed as dist

from ubnext import get_communicator, kernels, ops
from ubnext.bench import _FakeStream
from ubnext.runtime import _cuda


def best_us(fn, calls: int = 20000) -> float:
    for _ in range(2000):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    comm = get_communicator()
    comm.register_hidden(4096)
    comm.prepare()
    x = torch.randn(8, 4096, dtype=torch.bfloat16)
    r, w, out = torch.randn_like(x), torch.randn(4096, dtype=torch.bfloat16), torch.empty_like(x)
    rows = {}
    with (
        mock.patch.object(_cuda, "current_stream_handle", lambda index: _FakeStream.cuda_stream),
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: _FakeStream),
        mock.patch.object(kernels, "load_kernel", lambda name, index: name),
        mock.patch.object(_cuda, "launch", lambda *args: None),
        torch.inference_mode(),
    ):
        comm.mode = "gpu"
        try:
            comm._all_reduce_add_rmsnorm(x, r, w, 1e-6)
            launch = next(c.launch for k, c in comm._calls.items() if k[0] == "all_reduce_add_rmsnorm")
            signature = lambda: comm._calls.get(  # noqa: E731
                (
                    "all_reduce_add_rmsnorm",
                    x.shape,
                    x.dtype,
                    r.shape,
                    r.dtype,
                    w.shape,
                    w.dtype,
                    1e-6,
                    False,
                    True,
                    comm._algo,
                )
            )
            rows["method comm.all_reduce_add_rmsnorm"] = best_us(lambda: comm.all_reduce_add_rmsnorm(x, r, w))
            rows["entry point ops.all_reduce_add_rmsnorm"] = best_us(
                lambda: ops.all_reduce_add_rmsnorm(x, r, w, 1e-6, comm.key)
            )
            rows["torch.ops.ubnext.all_reduce_add_rmsnorm"] = best_us(
                lambda: torch.ops.ubnext.all_reduce_add_rmsnorm(x, r, w, 1e-6, comm.key)
            )
            rows["  operator implementation"] = best_us(lambda: ops._fused_impl(x, r, w, 1e-6, comm.key))
            rows["    Communicator._all_reduce_add_rmsnorm"] = best_us(
                lambda: comm._all_reduce_add_rmsnorm(x, r, w, 1e-6)
            )
            rows["      signature lookup"] = best_us(signature)
            rows["      contiguity of 3 tensors"] = best_us(
                lambda: x.is_contiguous() and r.is_contiguous() and w.is_contiguous()
            )
            rows["      device check (3 tensors, as a call)"] = best_us(lambda: comm._check_device("x r w", x, r, w))
            rows["      _check_usable"] = best_us(comm._check_usable)
            rows["      2 x torch.empty_like"] = best_us(lambda: (torch.empty_like(x), torch.empty_like(r)))
            rows["      _launch"] = best_us(lambda: comm._launch(launch, x, out, r, out, w))
            rows["  communicator lookup"] = best_us(lambda: ops.communicator_for(comm.key))
        finally:
            comm.mode = "emulator"
            comm._plans.clear()
            comm._calls.clear()
    if dist.get_rank() == 0:
        for what, us in rows.items():
            print(f"{what:45} {us:6.2f}")
    dist.barrier()


if __name__ == "__main__":
    main()

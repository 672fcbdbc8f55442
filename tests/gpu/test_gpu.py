"""GPU tier: the same multi-rank cases as the emulator tier, on real GPUs, one rank per GPU.

Skips, saying why, without a GPU (and the multi-rank tests without two). Multicast-only paths
are exercised where the pool has a multicast address and fall back (asserted) where not."""

import os

import pytest

from tests.conftest import MPI_WORKER, assert_mpi_ok
from ubnext import _cuda

import torch  # noqa: E402

# every test is collected and reported as skipped, with the reason, on a machine without a GPU
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda.gpu_available(), reason=f"GPU tier: {_cuda.no_gpu_reason()}")]

NGPU = torch.cuda.device_count() if _cuda.gpu_available() else 0
CASES = ["allreduce", "paths", "fused", "fused_paths", "fp8", "rotation", "pool", "bad_input",
         "linear", "compile", "cuda_graph", "misaligned", "fp8_nan", "divergent", "uneven_history",
         "header_race", "kernel_failure", "timeout"]


def test_every_kernel_loads_on_this_gpu():
    from ubnext import kernels

    for names in kernels.sources().values():
        for name in names:
            assert kernels.load_kernel(name, 0) is not None


@pytest.mark.skipif(0 < NGPU < 2, reason="needs at least 2 GPUs for multi-rank tests")
@pytest.mark.parametrize("backend", ["torch_symm", "vmm"])
def test_collectives(mpi, backend):
    np = min(NGPU, 8)
    proc = mpi(np, MPI_WORKER, "gpu", *CASES, env={"UBNEXT_POOL_BACKEND": backend}, timeout=900)
    assert_mpi_ok(proc)


@pytest.mark.skipif(0 < NGPU < 2, reason="needs at least 2 GPUs")
def test_chaos_free_benchmark_runs(mpi):
    from tests.conftest import ROOT

    proc = mpi(min(NGPU, 8), ROOT / "ubnext" / "bench.py", "--sizes", "8k", "1m", "--iters", "20", timeout=600)
    assert_mpi_ok(proc)

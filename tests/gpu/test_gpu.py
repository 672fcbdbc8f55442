"""GPU tier: the same multi-rank cases as the emulator tier, on real GPUs, one rank per GPU.

Skips, saying why, without a GPU (and the multi-rank tests without two). Multicast-only paths
are exercised where the pool has a multicast address and fall back (asserted) where not."""

import os

import pytest
import torch  # noqa: E402

from tests.conftest import MPI_WORKER, assert_mpi_ok
from ubnext.runtime import _cuda

# every test is collected and reported as skipped, with the reason, on a machine without a GPU
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _cuda.gpu_available(), reason=f"GPU tier: {_cuda.no_gpu_reason()}"),
]

NGPU = torch.cuda.device_count() if _cuda.gpu_available() else 0
CASES = [
    "allreduce",
    "paths",
    "fused",
    "fused_paths",
    "fp8",
    "rotation",
    "pool",
    "bad_input",
    "linear",
    "compile",
    "cuda_graph",
    "misaligned",
    "fp8_nan",
    "divergent",
    "uneven_history",
    "header_race",
    "kernel_failure",
    "timeout",
    "late_rank",
    "selftest",
    "subgroups",
    "in_place_past_staging",
    "linear_dense",
    "tp_checkpoint",
    "all_gather",
    "reduce_scatter",
    "quantize_fp8",
    "quantize_blocks",
    "fsdp",
    "fsdp_odd_shards",
    "fsdp_fp8",
    "fsdp_fp8_gemm",
    "exchange_compile",
    "exchange_grad",
    "local_first",
    # the host path (contexts, streams, graphs, lifetimes): only a GPU shows these
    "second_comm",
    "threads",
    "streams",
    "capture_first_use",
    "close_live",
    "device_mix",
    "capture_empty",
    "other_device_thread",
    "torch_symm_prefill",
    "pool_gc_skew",
    "fsdp_steady",
    "fused_past_pool",
    # two communicators' kernels in flight at once, opposite orders: the grid cap's residency rule
    "two_comms_two_streams",
    # issue 26: the batch-invariant mode, and its CUDA-graph replays
    "batch_invariant",
    "batch_invariant_graph",
    # issue 28: the fused block-scaled forms, one kernel each, bitwise quantize of the unquantised output
    "fused_quant",
]


def test_every_kernel_loads_on_this_gpu():
    from ubnext import kernels

    for names in kernels.sources().values():
        for name in names:
            assert kernels.load_kernel(name, 0) is not None


def test_the_raw_stream_handle_is_the_current_streams():
    """The hot path reads the current stream as its raw handle (_cuda.current_stream_handle) where
    torch.cuda.current_stream(...).cuda_stream was read before: the same value on the default stream,
    a side stream, and the capture stream of a CUDA graph."""
    dev = torch.cuda.current_device()

    def same() -> int:
        handle = _cuda.current_stream_handle(dev)
        assert handle == torch.cuda.current_stream(dev).cuda_stream
        return handle

    default = same()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert same() == side.cuda_stream != default
    graph, x = torch.cuda.CUDAGraph(), torch.zeros(4, device="cuda")
    capture = torch.cuda.Stream()
    with torch.cuda.stream(capture):  # warm-up off the default stream, as torch.cuda.graph does
        x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        assert _cuda.capturing(torch.device("cuda", dev))
        captured = same()
        x.add_(1)
    assert captured != default and not _cuda.capturing(torch.device("cuda", dev)) and same() == default


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


@pytest.mark.skipif(NGPU < 1, reason="needs a GPU")
def test_two_ranks_share_one_gpu(mpi):
    """Several ranks on one GPU: the VMM pool must not create a multicast object (its bind would
    wait forever for a second device); unicast paths only, right sums."""
    proc = mpi(
        2,
        MPI_WORKER,
        "gpu",
        "allreduce",
        "paths",
        env={
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
            "UBNEXT_POOL_BACKEND": "vmm",
        },
        timeout=900,
    )
    assert_mpi_ok(proc)


@pytest.mark.skipif(0 < NGPU < 2, reason="needs at least 2 GPUs")
def test_one_visible_gpu_per_rank(mpi, tmp_path):
    """CUDA_VISIBLE_DEVICES set per rank (SLURM's habit): the pool works, or every rank falls back
    saying why; sums right either way."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(NGPU))).split(",")
    wrapper = tmp_path / "isolate.py"
    wrapper.write_text(
        "import os, runpy, sys\n"
        f"visible = {visible!r}\n"
        "rank = int(os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK', '0')))\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = visible[rank % len(visible)]\n"
        f"sys.argv = [{str(MPI_WORKER)!r}] + sys.argv[1:]\n"
        f"runpy.run_path({str(MPI_WORKER)!r}, run_name='__main__')\n"
    )
    proc = mpi(2, wrapper, "gpu", "isolated", timeout=900)
    assert_mpi_ok(proc)


@pytest.mark.skipif(0 < NGPU < 2, reason="needs at least 2 GPUs")
def test_cuda_graph_example(tmp_path):
    """examples/cuda_graph.py as the README's Integrating section runs it (torchrun, one rank per
    GPU): prepare(), warm-up, capture, five replays with refilled inputs, each checked."""
    from tests.conftest import ROOT, run_torchrun

    np = min(NGPU, 8)
    proc = run_torchrun(np, ROOT / "examples" / "cuda_graph.py", timeout=600, cwd=tmp_path)
    assert_mpi_ok(proc)
    assert proc.stdout.count("5 replays of all_reduce and all_reduce_add_rmsnorm ok") == np, proc.stdout

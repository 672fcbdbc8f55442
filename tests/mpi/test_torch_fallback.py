"""The last fallback, torch.distributed (gloo on CPU), under mpirun -np 2 and 4: every op of
the public API, the layers, torch.compile and bad input."""

import pytest

from tests.conftest import MPI_WORKER, assert_mpi_ok

CASES = [
    "allreduce",
    "auto",
    "fused",
    "fused_arithmetic",
    "fp8",
    "pool",
    "bad_input",
    "linear",
    "compile",
    "misaligned",
    "fp8_nan",
    "linear_dense",
    "tp_checkpoint",
    "all_gather",
    "reduce_scatter",
    "quantize_fp8",
    "quantize_blocks",
    "fused_quant",
    "fsdp",
    "fsdp_fp8",
    "exchange_compile",
    "exchange_grad",
    "misuse",
    # issue 26: the batch-invariant mode's rank-ordered fallback, without any pool
    "batch_invariant",
]


@pytest.mark.mpi
@pytest.mark.parametrize("np", [2, 4])
def test_torch_fallback(mpi, np):
    assert_mpi_ok(mpi(np, MPI_WORKER, "torch", *CASES))

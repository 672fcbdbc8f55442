"""The cost model's constants, each with its source, and the published peer figures it prints beside
its rows (``python -m ubnext.bench --model``; the model itself is ``_costmodel``). A test that changes
a constant patches it on ``_costmodel``, whose functions read it there."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Constant:
    value: float
    unit: str
    source: str


HOP_US = Constant(
    0.6,
    "us",
    "NCCL's tuning model: latency per NVLink hop of its LL protocol "
    "(src/graph/tuning.cc, hwLatencies[NVLINK][Ring/Tree][LL] = 0.6; NCCL 5067397, 2026-06)",
)
LAUNCH_US = Constant(
    1.7,
    "us",
    "NCCL's symmetric allreduce of 8 B takes ~2.3 us on 8xH200 (nccl#1940), a kernel with one hop: 2.3 us less HOP_US",
)
SM_GBPS = Constant(
    65 * 2**30 / 1e9,
    "GB/s",
    "NCCL's symmetric-kernel model, bandwidth of one SM on Hopper for allreduce (src/sym_kernels.cc smBw = 65 GiB/s)",
)
NVLINK_GBPS = Constant(
    320 * 2**30 / 1e9,
    "GB/s",
    "NCCL's symmetric-kernel model, peak unicast NVLink bandwidth on Hopper (src/sym_kernels.cc peakBw = 320 GiB/s)",
)
NVLS_GBPS = Constant(
    480 * 2**30 / 1e9,
    "GB/s",
    "NCCL's symmetric-kernel model, peak with multicast on Hopper "
    "(src/sym_kernels.cc peakBw = 480 GiB/s; nccl-tests#212)",
)
HBM_GBPS = Constant(3350.0, "GB/s", "H100 SXM HBM3 bandwidth (NVIDIA H100 datasheet)")
CONSTANTS = {
    "launch_us": LAUNCH_US,
    "hop_us": HOP_US,
    "sm_GBps": SM_GBPS,
    "nvlink_GBps": NVLINK_GBPS,
    "nvls_GBps": NVLS_GBPS,
    "hbm_GBps": HBM_GBPS,
}

# Published figures (shared/DESIGN.md section 9), by (op, bytes or tokens): what users compare with.
PEERS = {
    ("all_reduce", 2048): "NCCL 16.6 us, torch multimem 8.5 us (8xH200, flashinfer#3759)",
    ("all_reduce", 16384): "NCCL symmetric LL ~2.3 us at 8 B (8xH200, nccl#1940)",
    ("all_reduce", 524288): "NCCL 20.8 us, torch multimem 11.3 us (8xH200, flashinfer#3759)",
    ("all_reduce", 2097152): "NCCL 40 us, torch multimem 18.2 us (8xH200, flashinfer#3759)",
    ("all_reduce_add_rmsnorm", 1): "FlashInfer MNNVL LL 4.8 us (TP8, hidden 5120, flashinfer#5178)",
    ("all_reduce_add_rmsnorm", 32): "FlashInfer one-shot 10 us (H100 TP2, 32x8192, vllm#22086)",
    ("all_gather", 2097152): "NCCL symmetric 10.9 us at 2 MiB (Megatron-LM#5596)",
    ("all_gather", 33554432): "NCCL symmetric 95 us at 32 MiB (Megatron-LM#5596)",
    ("reduce_scatter", 2097152): "NCCL symmetric 10.8 us at 2 MiB (Megatron-LM#5596)",
    ("reduce_scatter", 33554432): "NCCL symmetric 100 us at 32 MiB (Megatron-LM#5596)",
}

"""Count records of the peers' kernels (issue 38 item 1): what each published figure ran, as read in
the peer's source, in the counts the calibrated model (``_calibration``) prices.

Every record is one published figure: its kernels in launch order, each with its critical-path counts
and the place in the peer's source they were read from, and the launch mode the figure was measured in.
The counting rules (docs/PERF.md, "The calibrated model"), stated once:

- ``l2``: dependent local round trips on the critical path: a load of this GPU's memory whose value
  the next step needs (a pointer or epoch read before the push, a strong or ``.sys`` load); loads that
  overlap one another count once;
- ``hops``: serialised NVLink crossings (a store to a peer lands one hop later; a load of a peer's
  memory, a remote atomic or a ``multimem.ld_reduce`` is a round trip, two hops; a system-scope
  release or fence that must wait for earlier stores to land adds one);
- ``atomics``: GPU- or system-scope atomics whose result the thread waits for (a ``red``/unused
  ``atomicAdd`` is fire-and-forget and costs nothing here); a poll made of atomics (a CAS loop)
  counts one atomic after its value lands;
- ``waits``: serialised waits of a poll loop: each costs one local round trip after the value it
  waited for landed, whether or not it was already there (a loop that re-loads every outstanding slot
  on each pass is one wait, however many slots);
- ``cluster_syncs``: thread-block-cluster barriers (``cluster_sync_us``: an assumption, no figure times
  one alone);
- ``cta_bytes`` / ``inflight``: the bytes one CTA loads through its limiting path and the bytes its
  threads have in flight between two advances of their control clock; every round after the first
  costs one round trip (two hops for peer or multicast loads, one local round trip for local ones);
- ``nvlink_bytes`` / ``multicast_bytes`` / ``hbm_bytes``: bytes per rank over unicast NVLink,
  through the switch (NCCL's bus bytes for multicast: S/N + S), and through HBM.

Pinned versions read: NCCL 5067397 (github.com/NVIDIA/nccl), FlashInfer fb28d72
(github.com/flashinfer-ai/flashinfer), torch 03a4032 (github.com/pytorch/pytorch), vLLM 036bb68
(github.com/vllm-project/vllm; the issue pins no vLLM version: this is the version read). The figures'
benchmark harness, where it adds launches (copies), was read too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KB = 1024
MB = 1024 * 1024
VEC = 16  # bytes per vector access


@dataclass(frozen=True)
class Kernel:
    name: str
    read: str  # file:line at the pinned version
    l2: int = 0
    hops: int = 0
    atomics: int = 0
    waits: int = 0
    dsm: int = 0
    cluster_syncs: int = 0
    cta_bytes: int = 0
    inflight: int = 0
    remote: bool = True  # cta_bytes come from peers / the switch (round trip: two hops), else local
    nvlink_bytes: int = 0
    multicast_bytes: int = 0
    hbm_bytes: int = 0


@dataclass(frozen=True)
class Record:
    peer: str
    case: str
    hardware: str  # as published
    gpu: str  # H100 | H200 | B200: which HBM figure applies
    arch: str  # hopper | blackwell: which constants apply
    published_us: float
    source: str  # where the figure is published
    mode: str  # graph | graph+pdl | eager: every kernel of the record pays this launch
    mode_note: str
    kernels: tuple[Kernel, ...]
    fit: bool = True  # False: reported, not fitted (a variant of a fitted figure, or a harness the model cannot time)


# ------------------------------------------------------------------ structures, scaled by the model's rules


def copy_kernel(nbytes: int, read: str) -> Kernel:
    """A device-to-device copy the harness adds (torch ``Tensor.copy_``): one launch, one dependent local
    round trip, its bytes read and written through HBM."""
    return Kernel("copy_", read, l2=1, hbm_bytes=2 * nbytes)


def graph_event_node(name: str, read: str) -> Kernel:
    """An event node in a captured graph (an external event wait or an event record) that serialises with
    the kernels around it: priced as one more dependent node launch, with no body (an assumption: no figure
    times an event node alone)."""
    return Kernel(name, read)


def nccl_symmetric_ll(nbytes: int, world: int) -> Kernel:
    """NCCL's symmetric LL allreduce (ncclSymkRun_AllReduce_AGxLL_R): every thread reads its epoch and
    its 8-byte pack, broadcasts the pack to every peer's slot (one hop) and polls its own slots of all
    ranks, re-loading every outstanding slot on each pass (one wait). One CTA of 512 threads handles 4 KB
    per epoch; larger messages loop, each pass one more hop and wait (the next broadcast waits for the
    previous epoch's reduction)."""
    per_pass = 512 * 8
    passes = max(1, math.ceil(nbytes / per_pass))
    return Kernel(
        "ncclSymkRun_AllReduce_AGxLL_R",
        "src/device/symmetric/all_reduce.cuh:505-547 (AGxLL_R: loadPack :538, lla2a.bcast :539, recvReduce<8> "
        ":540); src/include/nccl_device/impl/ll_a2a__funcs.h:23 (epoch load in the session's constructor), "
        ":68 (bcast), :166-195 (recv loop re-loads every slot until its epoch shows)",
        l2=1,
        hops=passes,
        waits=passes,
        nvlink_bytes=2 * nbytes * (world - 1),  # LL: 8 bytes of flag per 8 of data, to every peer
        hbm_bytes=world * 2 * nbytes,
    )


def nccl_ring_ll(nbytes: int, world: int) -> Kernel:
    """NCCL's classic ring allreduce, LL protocol (what torch.distributed runs at 2 KB on 8 GPUs without
    registered buffers; src/graph/tuning.cc models it as baseLat 6.6 us + 2(N-1) x 0.6 us): 2(N-1)
    serialised steps, each a store of a 16-byte LL line to the next rank (one hop) and a poll of the own
    buffer (one wait); the prologue reads the channel and the work batch into shared memory and the
    connection's step (two dependent local round trips)."""
    steps = 2 * (world - 1)
    return Kernel(
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
        "src/device/common.h:356-415 (ncclKernelMain: copyToShmem16 :391/:401, loadWorkBatchToShmem :411, "
        "__syncthreads :415); src/device/all_reduce.h:14-90 (runRing: 2(N-1) steps); src/device/prims_ll.h:108-"
        "123 (readLL: ld.volatile poll), :154 (storeLL)",
        l2=2,
        hops=steps,
        waits=steps,
        nvlink_bytes=2 * nbytes * 2 * (world - 1) // world,
        hbm_bytes=4 * nbytes,
    )


def nccl_nvls(nbytes: int, world: int) -> Kernel:
    """NCCL's symmetric NVLS allreduce (ncclSymkRun_AllReduce_RSxLDMC_AGxSTMC): a multicast barrier, then
    every thread ld_reduces 8 packs of 16 bytes of its rank's share through the switch and multimem-stores
    them (512 threads x 8 x 16 B = 64 KB in flight per CTA), then a releasing barrier. Grid on Hopper:
    divUp(16, N) CTAs (src/sym_kernels.cc:343). Each barrier: a multicast arrive (one hop; the releasing
    one waits for the stores to land, one more) and a poll of the own counter (one wait)."""
    ctas = -(-16 // world)
    share = nbytes // world
    return Kernel(
        "ncclSymkRun_AllReduce_RSxLDMC_AGxSTMC",
        "src/device/symmetric/all_reduce.cuh:430-490 (allreduceMultimem: UnrollPacks = 16*8/BytePerPack :441, "
        "ld_reduce loop :452-456, multimem_st :458-460; bar.sync acquire :479, release :489); "
        "src/sym_kernels.cc:343 (nMaxBlocksNvls = divUp(16, nRanks) on Hopper)",
        hops=1 + 2 + 2,
        waits=2,
        cta_bytes=max(VEC, share // ctas),
        inflight=512 * 8 * VEC,
        multicast_bytes=share + nbytes,
        hbm_bytes=2 * nbytes,
    )


def torch_multimem(nbytes: int, world: int) -> Kernel:
    """torch's ``multimem_all_reduce_`` kernel: a barrier of system-scope CAS signals (a remote CAS round
    trip, then a CAS poll of the own pad), each rank ld_reduces its 1/N share through the switch and
    multimem-stores it (one 16-byte vector in flight per thread), then a releasing barrier. Grid from
    init_elementwise_launch_config: one CTA up to 1024 threads per share, else up to 8 CTAs of 1024."""
    share = nbytes // world
    threads_needed = max(32, -(-share // VEC))
    if threads_needed <= 1024:
        ctas, threads = 1, -(-threads_needed // 32) * 32
    else:
        ctas, threads = min(8, -(-threads_needed // 1024)), 1024
    return Kernel(
        "multimem_all_reduce_kernel",
        "torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemoryOps.cu:99-124 (launch config), :127-156 "
        "(kernel: sync_remote_blocks<relaxed> :137, ld_reduce :150, multimem_st :151, sync_remote_blocks<acq_rel> "
        ":155); CUDASymmetricMemory-inl.h put_signal/wait_signal (CAS loops, system scope) and sync_remote_blocks "
        "(signal_pads[] load per barrier)",
        l2=2,  # signal_pads[target_rank] before each barrier's put
        hops=2 + 2 + 1 + 2,  # remote CAS; ld_reduce round trip; release waits for the stores; remote CAS
        atomics=4,  # each barrier: the remote CAS, then the CAS poll of the own pad
        cta_bytes=max(VEC, share // ctas),
        inflight=threads * VEC,
        multicast_bytes=share + nbytes,
    )


def flashinfer_oneshot(tokens: int, hidden: int, world: int, sm_count: int = 132, *, widen: bool = True) -> Kernel:
    """FlashInfer/TRT-LLM ``allreduce_fusion_kernel_oneshot_lamport`` (AR + residual add + RMSNorm): the
    Lamport comm's constructor reads the workspace pointers, then the flag and sizes (two dependent local
    round trips); every thread loads its input vector (one more: a further row's load waits for the previous
    row's pushes, which may alias it) and pushes it to every rank (one hop);
    its poll re-loads all N slots on each pass (one wait); the row's sum of squares is reduced through the
    cluster (two cluster barriers, and one batch of loads of the siblings' shared memory); block 0 finally
    spins on the arrival counter (one more wait). One vector per thread, a row per cluster (launch config)
    as long as the clusters fit; when the rows outnumber the clusters a thread handles several rows: its
    pushes are all issued first, then one more poll wait and norm per row.
    ``widen``: the launcher trades cluster CTAs for wider CTAs while the clusters outnumber the SMs (fb28d72
    :1739-1745, since FlashInfer 6fb5105, 2025-08-19). Before it (v0.2.11, 7c45412, :1353-1373) the grid was
    cut at the SM count with clusters of 8, so a thread of a 32x8192 call handles two rows, one after the other."""
    threads_per_token = hidden // 8
    cluster = 8
    while threads_per_token % cluster and cluster > 1:
        cluster //= 2
    block = threads_per_token // cluster
    while block < 128 and cluster >= 2:
        block, cluster = block * 2, cluster // 2
    while widen and tokens * cluster > sm_count and cluster > 1 and block <= 512:
        block, cluster = block * 2, cluster // 2
    clusters = max(1, min(sm_count, tokens * cluster) // cluster)
    per_thread_tokens = -(-tokens // clusters)
    s = tokens * hidden * 2
    source = (
        "include/flashinfer/comm/trtllm_allreduce_fusion.cuh:962-980 (LamportComm constructor: workspace pointer, "
        "flag/clear/comm_size loads, unused atomicAdd), :1520-1530 (input load, push to every rank), :1536-1550 "
        "(poll: re-loads all NRanks slots each pass), :1287-1300 (rms_norm: cluster.sync x2), :982-990 (update: "
        "block 0 spins on the counter), :1707-1817 (launch config: cluster of up to 8, one vector a thread, widened "
        "while the clusters outnumber the SMs)"
        if widen
        else "FlashInfer v0.2.11 (7c45412) include/flashinfer/comm/trtllm_allreduce_fusion.cuh:1163-1228 (the same "
        "kernel body: constructor loads, push, clear, poll, fused op), :1353-1373 (launch config: clusters of 8, "
        "the grid cut at the SM count, rows looped by token_stride = num_clusters, :1138-1142)"
    )
    return Kernel(
        "allreduce_fusion_kernel_oneshot_lamport",
        source,
        l2=2 + per_thread_tokens,
        hops=1,
        waits=1 + per_thread_tokens,
        dsm=per_thread_tokens if cluster > 1 else 0,  # the cluster's partials, loaded together
        cluster_syncs=2 * per_thread_tokens if cluster > 1 else 0,
        cta_bytes=block * world * VEC * per_thread_tokens,
        inflight=block * world * VEC,
        remote=False,
        nvlink_bytes=s * (world - 1),
        # in, own push, the peers' pushes landing, the poll's N slots, residual, two outputs, the clear of N slots
        hbm_bytes=s * (1 + 1 + (world - 1) + world + 1 + 2 + world),
    )


def vllm_one_stage(nbytes: int, world: int) -> Kernel:
    """vLLM's ``cross_device_reduce_1stage``: reads the rank pointers (one dependent local round trip),
    start_sync (a byte store to every rank's signal, one hop; every block's thread 0 polls its own flag,
    one wait), every thread loads its 16-byte pack from every rank (a round trip, two hops) in a
    grid-stride loop of 36 CTAs x 512 threads, then end_sync (a counter atomic whose result it uses, the
    last block's flag store to every rank, one hop, and its poll, one wait)."""
    packs = nbytes // VEC
    ctas = min(36, -(-packs // 512))
    return Kernel(
        "cross_device_reduce_1stage",
        "csrc/custom_all_reduce.cuh (vLLM 036bb68): cross_device_reduce_1stage (`auto dp = *_dp`, start_sync, "
        "packed_reduce loop, end_sync<ngpus, true>), start_sync (byte store to sg.signals[i], thread 0 spins on "
        "start.flag), end_sync (atomicAdd(meta->counter), last block stores end flags and spins); "
        "CustomAllreduce::allreduce (threads 512, block_limit 36)",
        l2=1,
        hops=1 + 2 + 1,
        atomics=1,
        waits=2,
        cta_bytes=max(VEC, nbytes * world // ctas),
        inflight=512 * world * VEC,
        nvlink_bytes=nbytes * (world - 1),
        hbm_bytes=nbytes * (world + 1),
    )


# ------------------------------------------------------------------ the published figures

NCCL_1940 = "nccl#1940 (nccl-tests, NCCL 2.27 symmetric kernels, best latency after tuning)"
HARNESS_3759 = "benchmarks/comm/bench_quantized_allreduce.py (FlashInfer fb28d72)"
STRONGSTREAM = "src/misc/strongstream.cc (NCCL 5067397)"
HARNESS_773 = "benchmark/test_fused_allreduce_rms_norm.py (FlagGems-vllm 037ef12)"


def _torch_multimem_record(nbytes: int, label: str, published: float, copy_out: bool) -> Record:
    copies = (copy_kernel(nbytes, f"{HARNESS_3759}:180"),)
    kernels: tuple[Kernel, ...] = (*copies, torch_multimem(nbytes, 8))
    note = (
        "graph node: bench_gpu_time(use_cuda_graph=True, num_iters_within_graph=10) times a replay of 10 calls "
        "by CUDA events, divided by 10 (flashinfer/testing/utils.py:1486-1532); max over ranks, median of 30. "
    )
    if copy_out:
        kernels = (*kernels, copy_kernel(nbytes, f"{HARNESS_3759}:184"))
        note += "The merged script also copies out (:184): reported beside the figure, not fitted"
    else:
        note += "As published with the table: copy in, then the op (the merged script's copy-out is the variant)"
    return Record(
        "torch",
        f"multimem_all_reduce_ {label}" + (" (with copy-out)" if copy_out else ""),
        "8xH200",
        "H200",
        "hopper",
        published,
        "flashinfer#3759 (CUDA graph, median)",
        "graph",
        note,
        kernels,
        fit=not copy_out,
    )


def _flashinfer_replay_record(tokens: int, published: float) -> Record:
    return Record(
        "FlashInfer",
        f"one-shot fused AR+RMSNorm {tokens}x6144 bf16",
        "H100 TP2",
        "H100",
        "hopper",
        published,
        "FlagGems-vllm#773 (vLLM column)",
        "replay",
        f"one op per graph, 1000 replays back to back between two CUDA events, divided by 1000, max over ranks, "
        f"median of 7 ({HARNESS_773}: _capture, _rank_max_latency_us): every op pays a whole graph launch; the "
        "kernel's PDL attribute has no node to overlap inside a one-node graph",
        (flashinfer_oneshot(tokens, 6144, 2),),
    )


def records() -> tuple[Record, ...]:
    """The published figures of issue 38 item 1, each with its count record; launch modes as read in each
    figure's harness (docs/PERF.md, "The calibrated model")."""
    fi_note = (
        "FlashInfer's launcher sets cudaLaunchAttributeProgrammaticStreamSerialization when launch_with_pdl "
        "(trtllm_allreduce_fusion.cuh:1828)"
    )
    nccl_tests = (
        "nccl-tests' time is a host clock over all ops divided by their count, mean over ranks (src/common.cu:553-"
        "589 at d29b43c); the command is not in the thread's text: taken as NVIDIA's latency recipe in "
        "nccl-tests#333 (-G 100 graph launch, -R 2 symmetric buffers, NCCL_GRAPH_MIXING_SUPPORT=0: no event nodes)"
    )
    return (
        Record(
            "NCCL",
            "symmetric LL allreduce 8 B",
            "8xH200",
            "H200",
            "hopper",
            2.3,
            NCCL_1940,
            "graph",
            nccl_tests + "; the eager variant is reported beside it",
            (nccl_symmetric_ll(8, 8),),
        ),
        Record(
            "NCCL",
            "symmetric LL allreduce 8 B (as eager)",
            "8xH200",
            "H200",
            "hopper",
            2.3,
            NCCL_1940,
            "eager",
            "the same figure read as an eager launch (nccl-tests without -G): not fitted, reported",
            (nccl_symmetric_ll(8, 8),),
            fit=False,
        ),
        _torch_multimem_record(2 * KB, "2 KB", 8.5, copy_out=False),
        _torch_multimem_record(2 * KB, "2 KB", 8.5, copy_out=True),
        _torch_multimem_record(2 * MB, "2 MB", 18.2, copy_out=False),
        _torch_multimem_record(2 * MB, "2 MB", 18.2, copy_out=True),
        Record(
            "NCCL",
            "allreduce 2 KB (torch.distributed)",
            "8xH200",
            "H200",
            "hopper",
            16.6,
            "flashinfer#3759 (CUDA graph, median)",
            "graph",
            f"graph node, as torch's 2 KB: the timed function copies the input first ({HARNESS_3759}:149), then "
            "dist.all_reduce (:150); NCCL's default graph mixing (NCCL_GRAPH_MIXING_SUPPORT=1, src/init.cc:2066-"
            "2076) makes each captured launch wait on an external event and record one",
            (
                copy_kernel(2 * KB, f"{HARNESS_3759}:149"),
                graph_event_node("external event wait (serialEvent)", f"{STRONGSTREAM}:245-247"),
                nccl_ring_ll(2 * KB, 8),
                graph_event_node("event record node", f"{STRONGSTREAM}:282 (recordEventOnStream), :330-345"),
            ),
        ),
        _flashinfer_replay_record(6, 6.98),
        _flashinfer_replay_record(138, 12.98),
        Record(
            "FlashInfer",
            "one-shot fused AR+RMSNorm 32x8192 bf16",
            "H100 TP2",
            "H100",
            "hopper",
            10.0,
            "vllm#22086",
            "graph+pdl",
            "graph node + PDL: 10 ops per graph; the stored script (vLLM 100aec2 benchmarks/kernels/"
            "benchmark_fused_collective.py benchmark_operation) times 2 replays (20 ops) by host clock, rank 0, no "
            "barrier; the PR's own version was not found; printed in ms to 3 decimals (9.5-10.5 us). Not fitted: "
            "a host-clock tail of unknown size over 20 ops, and no barrier, are in the figure. " + fi_note,
            (flashinfer_oneshot(32, 8192, 2, widen=False),),
            fit=False,
        ),
        Record(
            "vLLM",
            "custom allreduce one-stage 0.5 MB",
            "H100 TP2",
            "H100",
            "hopper",
            7.0,
            "vllm#24111",
            "graph",
            "graph node: 10 ops per graph on registered graph buffers (no input copy), host clock over 50 replays "
            "(vLLM 048d679 benchmarks/kernels/benchmark_device_communicators.py benchmark_allreduce_single; the "
            "PR's own version was not found); printed in ms to 3 decimals (6.5-7.5 us)",
            (vllm_one_stage(512 * KB, 2),),
        ),
    )

"""Dependent-access chains on one GPU (issue 36): the round trip of one access whose address depends on
the one before, in ns, for the constants of the calibrated cost model (docs/PERF.md). The kernel is the
test-only probe csrc/probes/chains.cu (what it walks and how it times: its header); this module compiles
it with ubnext.kernels' NVRTC helper, loads it with cuda.core into the device's primary context (as
ubnext.kernels does), launches it through ubnext/runtime/_cuda.py's launch path, and checks each walk.

    measure(device_index) -> {name: figure(...) | skipped(...)}   # on a GPU
    rehearse() -> {"status", "compiled", "figures"}               # without one: compiles for sm_90

Figures, each ``{"value": ns per link, "unit": "ns", "method": ...}``:

- ``ld_relaxed_sys_v4``: 16-byte ``ld.relaxed.sys.global.v4.u32`` (relaxed, not acquire) of this GPU's memory;
- ``ld_volatile_v4``: 16-byte ``ld.volatile.global.v4.u32``, the Lamport poll's own load;
- ``atom_add_acq_rel_gpu``: ``atom.acq_rel.gpu.global.add.u32`` of 0, the row split's counter atomic;
- ``dsmem_ld_and_barrier_cluster``: skipped, no clusters yet.
"""

from __future__ import annotations

import numpy as np

from tests.gpu_check.common import figure, skipped

# csrc/probes/chains.cu, named from csrc/kernels (where ubnext.kernels' compile helper looks)
SOURCE = "../probes/chains.cu"
KERNEL = "ubnext_probe_chain"
LINKS = 16384  # 16-byte links: a 256 KiB cycle, L2-resident on any GPU ubnext runs on (50 MB on H100)
STEPS = 4096  # timed links per launch
REPEATS = 3  # launches per chain; the figure is the fastest (the least disturbed)
# figure name -> (the probe's mode, `flags`; what one link is)
CHAINS = {
    "ld_relaxed_sys_v4": (0, "ld.relaxed.sys.global.v4.u32 (16 bytes, relaxed at system scope, not acquire)"),
    "ld_volatile_v4": (1, "ld.volatile.global.v4.u32 (16 bytes; the Lamport poll's load, relaxed.sys in PTX)"),
    "atom_add_acq_rel_gpu": (2, "atom.acq_rel.gpu.global.add.u32 of 0 (the row split's counter atomic)"),
}
NO_CLUSTERS = "distributed-shared-memory load and barrier.cluster: no clusters yet"
RESULT_WORDS = 4  # the probe's out: ns, links timed, index reached, mode


def cycle(links: int = LINKS, seed: int = 36) -> np.ndarray:
    """``links`` x 4 uint32: one random cycle through every link, link i's word 0 the index of the next
    (each link of a random order points to the one after it, the last to the first); the other words 0."""
    order = np.random.default_rng(seed).permutation(links)
    table = np.zeros((links, 4), np.uint32)
    table[order, 0] = np.roll(order, -1)
    return table


def index_after(table: np.ndarray, steps: int) -> int:
    """The link a walk from link 0 reaches after ``steps`` links."""
    i = 0
    nxt = table[:, 0]
    for _ in range(steps % len(table)):  # a single cycle: its length brings the walk back
        i = int(nxt[i])
    return i


def walk_problem(result, mode: int, table: np.ndarray, untimed: int, timed: int) -> str | None:
    """Why a probe's ``out`` (ns, links, index, mode) is not a whole walk of ``untimed + timed`` links in
    ``mode``, or None."""
    ns, links, index, got_mode = (int(v) for v in result)
    if got_mode != mode:
        return f"mode {got_mode}, launched as {mode}"
    if links != timed:
        return f"{links} links timed, {timed} asked"
    want = index_after(table, untimed + timed)
    if index != want:
        return f"the walk ended at link {index}, not {want}: it did not follow the chain"
    if ns <= 0:
        return f"{ns} ns for {timed} links"
    return None


def _compile(arch: str) -> tuple[bytes, str]:
    from ubnext import kernels

    return kernels._nvrtc_compile(SOURCE, arch, "cubin")


def rehearse() -> dict:
    """Without a GPU: compiles the probe for sm_90 (NVRTC, ubnext's options; raises if it does not build)
    and loads nothing. ``compiled``: the cubin's size and ptxas's resources; ``figures``: measure's names,
    each skipped for want of a GPU (what the probe computes is checked on the emulator instead:
    tests/unit/test_chains_probe.py)."""
    from ubnext import kernels

    image, log = _compile("sm_90")
    resources = kernels.parse_ptxas_log(log, "sm_90")
    compiled = {"arch": "sm_90", "cubin_bytes": len(image), "kernels": [r.__dict__ for r in resources]}
    figures = {
        name: skipped(f"rehearsal: compiled for sm_90 ({len(image)} bytes), no GPU to time it on") for name in CHAINS
    }
    figures["dsmem_ld_and_barrier_cluster"] = skipped(NO_CLUSTERS)
    return {"status": "pass", "compiled": compiled, "figures": figures}


def measure(device_index: int) -> dict[str, dict]:
    """Each chain's ns per link on GPU ``device_index``; raises if a walk did not follow its chain."""
    import torch

    from ubnext import kernels, pool
    from ubnext.runtime import _cuda

    arch = _cuda.device_arch(device_index)
    image, _ = _compile(arch)
    with _cuda.primary_context(device_index):
        code = kernels.object_code(image)
        kernel = code.get_kernel(KERNEL)
    handle = _cuda.kernel_handle(kernel)  # `code` and `kernel` stay referenced until the last launch returns
    device = torch.device("cuda", device_index)
    table = cycle()
    links = torch.from_numpy(table.view(np.int32)).to(device)  # the same bits (torch copies no uint32)
    result = torch.zeros(RESULT_WORDS, dtype=torch.int64, device=device)
    stream = _cuda.current_stream_handle(device_index)
    config = _cuda.launch_config(1, 32, stream, False, device_index)  # one warp; thread 0 walks
    figures: dict[str, dict] = {}
    for name, (mode, what) in CHAINS.items():
        params = _cuda.KernelParams(
            bytes(pool.DESC_STRUCT_BYTES),
            _cuda.pack_kernel_args(kernels.KERNEL_SIGNATURE[8:], (STEPS, LINKS, 0.0, mode)),
        )
        per_link = []
        for _ in range(REPEATS):
            result.zero_()
            _cuda.launch(handle, config, params, (links.data_ptr(), result.data_ptr(), 0, 0, 0, 0, 0))
            torch.cuda.synchronize(device)
            out = result.cpu().numpy().view(np.uint64)
            problem = walk_problem(out, mode, table, LINKS, STEPS)
            if problem:
                raise RuntimeError(f"{name}: {problem}")
            per_link.append(int(out[0]) / STEPS)
        figures[name] = figure(
            min(per_link),
            "ns",
            f"one thread of one CTA follows {STEPS} dependent links, one {what} each, through a random "
            f"{LINKS}-link cycle of 16-byte links (256 KiB, L2-resident after an untimed pass over every "
            f"link), timed by %globaltimer inside the kernel (csrc/probes/chains.cu); the fastest of "
            f"{REPEATS} launches, ns per link",
            repeats_ns=per_link,
            steps=STEPS,
            links=LINKS,
        )
    figures["dsmem_ld_and_barrier_cluster"] = skipped(NO_CLUSTERS)
    del kernel, code
    return figures

"""``world1``: a one-rank communicator runs every unicast kernel path on the one GPU, bitwise against the
torch references, on both pool backends (VMM; torch symmetric memory).

The test seam is ``UBNEXT_WORLD1_KERNELS=1`` (ubnext/envs.py): a one-rank communicator's ops then take
their kernel paths instead of copying. Which kernel each op launched is recorded by wrapping the
instance's launch (``_run``), so that an op that quietly copied cannot pass. At one rank the sum is the
input itself, so every plain output is exact, and the fused forms are bitwise the references of
``ubnext.reference._checks`` / ``ubnext.reference._blockscale`` (the kernels' own arithmetic in torch).

The NVLS paths and nvls_lamport need a multicast address, which one GPU cannot make (``cuMulticastCreate``
with one device is refused): they are ``skip`` with that reason on the GPU. In the rehearsal the emulator's
pool has one, so every path runs there."""

from __future__ import annotations

import functools
import os

from tests.gpu_check.common import Context, crash_result, figure, result, skipped

HIDDEN_MAX = 8192
DTYPE_NAMES = ("bf16", "fp16", "fp32")
# (tokens, hidden): one token of 8192 (the Lamport row split: several CTAs per row), a few short rows
FUSED_SHAPES = ((1, 8192), (5, 1024))
PLAIN_SHAPE = (3, 1000)  # a tail that ends inside a vector
QUANT_FORMATS = ("nvfp4", "mxfp8", "fp8_group128")


def _init_one_rank_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


class _Recorder:
    """The names of the kernels a communicator launched since the last ``take``."""

    def __init__(self, comm):
        self.names: list[str] = []
        launch = comm._run

        def recording(how, pointers):
            self.names.append(how.name)
            launch(how, pointers)

        comm._run = recording

    def take(self) -> list[str]:
        names, self.names = self.names, []
        return names


def _same_bits(got, want) -> bool:
    import torch

    got, want = got.detach().cpu().contiguous(), want.detach().cpu().contiguous()
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def _check(got_outputs, want_outputs, launched: list[str], kernel: str) -> str | None:
    if kernel not in launched:
        return f"launched {launched or 'no kernel'}, not {kernel}"
    for i, (got, want) in enumerate(zip(got_outputs, want_outputs)):
        if want is None:
            continue
        if not _same_bits(got, want):
            return f"output {i} differs from the reference"
    return None


def _inputs(shape, dtype, device, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    residual = torch.randn(shape, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


def _fused_cases(comm, recorder, path: str, dtype, dtype_name: str, eps=1e-6) -> dict:
    """Every output form of the fused op on one path: plain, FP8 static and per token, each block format."""
    import torch

    from ubnext.reference._blockscale import quantize_reference
    from ubnext.reference._checks import FP8, reference_add_rmsnorm

    kernel = f"ubnext_{path}_{dtype_name}" if path != "torch" else f"ubnext_add_rmsnorm_{dtype_name}"
    cases = {}
    for tokens, hidden in FUSED_SHAPES:
        x, residual, weight = _inputs((tokens, hidden), dtype, comm.device, seed=tokens * hidden)
        xc, rc, wc = x.cpu(), residual.cpu(), weight.cpu()
        plain_ref = reference_add_rmsnorm(xc.float(), rc, wc, eps, dtype, None)
        tag = f"{tokens}x{hidden}"
        got = comm.all_reduce_add_rmsnorm(x, residual, weight, eps)
        cases[f"fused {tag}"] = _check(got, plain_ref[:2], recorder.take(), kernel)
        scale = torch.tensor([0.01], dtype=torch.float32)
        for form, form_scale in (("fp8_static", scale), ("fp8_per_token", None)):
            want = reference_add_rmsnorm(xc.float(), rc, wc, eps, FP8, form_scale)
            got = comm.all_reduce_add_rmsnorm(
                x,
                residual,
                weight,
                eps,
                out_dtype=FP8,
                scale=None if form_scale is None else form_scale.to(comm.device),
            )
            cases[f"fused {form} {tag}"] = _check(got, want, recorder.take(), kernel)
        if dtype == torch.float32 and path != "torch":
            continue  # the block formats' fused forms: 16-bit inputs (docs/QUANTIZE.md)
        for fmt in QUANT_FORMATS:
            global_scale = torch.tensor([0.5], dtype=torch.float32) if fmt == "nvfp4" else None
            q_ref, s_ref = quantize_reference(plain_ref[0], fmt, global_scale)
            got = comm.all_reduce_add_rmsnorm(
                x,
                residual,
                weight,
                eps,
                quant=fmt,
                global_scale=None if global_scale is None else global_scale.to(comm.device),
            )
            cases[f"fused {fmt} {tag}"] = _check(got, (q_ref, plain_ref[1], s_ref), recorder.take(), kernel)
    return cases


def _path_cases(path: str, emulate: bool) -> dict:
    import torch

    import ubnext

    comm = ubnext.Communicator(emulate=emulate, max_hidden=HIDDEN_MAX, algo=path)
    try:
        pool = comm.pool
        if pool is None:
            return {"status": "fail", "reason": f"no pool: {comm.pool_stats()['reason']}"}
        wanted, got = os.environ.get("UBNEXT_POOL_BACKEND"), comm.pool_stats()["backend"]
        if wanted not in (None, "auto", got):  # a backend that failed falls back with only a log line
            return {"status": "fail", "reason": f"asked for the {wanted} pool, got {got}"}
        if path.startswith("nvls") and not pool.has_multicast:
            return skipped("the pool has no multicast address (cuMulticastCreate with one device is refused)")
        recorder = _Recorder(comm)
        cases = {}
        for dtype_name, dtype in zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32)):
            x, _, _ = _inputs(PLAIN_SHAPE, dtype, comm.device, seed=7)
            got = comm.all_reduce(x)
            cases[f"all_reduce {dtype_name}"] = _check([got], [x], recorder.take(), f"ubnext_{path}_{dtype_name}") or (
                None if comm.last_path == path else f"path {comm.last_path}"
            )
            if path != "nvls_oneshot":  # never fused: its bits may differ across ranks
                cases.update(
                    {f"{k} {dtype_name}": v for k, v in _fused_cases(comm, recorder, path, dtype, dtype_name).items()}
                )
        return cases
    finally:
        comm.close()


def _local_and_exchange_cases(emulate: bool) -> dict:
    """all_gather, reduce_scatter, the quantize forms and the add + RMSNorm kernel (a fused call whose
    allreduce is torch's: ``algo="torch"``), which no path choice changes."""
    import torch

    import ubnext
    from ubnext.reference._blockscale import quantize_reference
    from ubnext.reference._checks import quantize_fp8_reference

    cases = {}
    comm = ubnext.Communicator(emulate=emulate, max_hidden=HIDDEN_MAX)
    try:
        recorder = _Recorder(comm)
        for dtype_name, dtype in zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32)):
            x, _, _ = _inputs((4, 1024), dtype, comm.device, seed=11)
            cases[f"all_gather {dtype_name}"] = _check(
                [comm.all_gather(x)], [x], recorder.take(), "ubnext_allgather_u8"
            )
            cases[f"reduce_scatter {dtype_name}"] = _check(
                [comm.reduce_scatter(x)], [x], recorder.take(), f"ubnext_reduce_scatter_{dtype_name}"
            )
            xc = x.cpu()
            got = comm.quantize_fp8(x)
            cases[f"quantize_fp8 row {dtype_name}"] = _check(
                got, quantize_fp8_reference(xc, 1024, None), recorder.take(), f"ubnext_quantize_fp8_{dtype_name}"
            )
            scale = torch.tensor([0.02], dtype=torch.float32)
            got = comm.quantize_fp8(x, scaling="static", scale=scale.to(comm.device))
            cases[f"quantize_fp8 static {dtype_name}"] = _check(
                got, quantize_fp8_reference(xc, 1024, scale), recorder.take(), f"ubnext_quantize_fp8_{dtype_name}"
            )
            for fmt in QUANT_FORMATS:
                global_scale = torch.tensor([0.5], dtype=torch.float32) if fmt == "nvfp4" else None
                for swizzled in (False, True) if fmt != "fp8_group128" else (False,):
                    got = comm.quantize(
                        x,
                        fmt,
                        global_scale=None if global_scale is None else global_scale.to(comm.device),
                        swizzled=swizzled,
                    )
                    cases[f"quantize {fmt}{' swizzled' if swizzled else ''} {dtype_name}"] = _check(
                        got,
                        quantize_reference(xc, fmt, global_scale, swizzled),
                        recorder.take(),
                        f"ubnext_quantize_{fmt}_{dtype_name}",
                    )
    finally:
        comm.close()
    norm = ubnext.Communicator(emulate=emulate, max_hidden=HIDDEN_MAX, algo="torch")
    try:
        recorder = _Recorder(norm)
        for dtype_name, dtype in zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32)):
            cases.update(
                {
                    f"add_rmsnorm {k} {dtype_name}": v
                    for k, v in _fused_cases(norm, recorder, "torch", dtype, dtype_name).items()
                }
            )
    finally:
        norm.close()
    return cases


def _backend(emulate: bool) -> dict:
    from ubnext import plan

    groups = {path: functools.partial(_path_cases, path, emulate) for path in plan.KERNEL_PATHS}
    groups["local_and_exchange"] = functools.partial(_local_and_exchange_cases, emulate)
    report = {}
    for name, cases in groups.items():
        try:
            report[name] = cases()
        except Exception as exc:  # noqa: BLE001 - the group fails, the other groups still run
            report[name] = crash_result(exc)
    return report


def run(ctx: Context) -> dict:
    os.environ["UBNEXT_WORLD1_KERNELS"] = "1"
    _init_one_rank_group()
    backends = ("emulator",) if ctx.rehearse else ("vmm", "torch_symm")
    report, failures, ran = {}, [], 0
    for backend in backends:
        os.environ["UBNEXT_POOL_BACKEND"] = backend
        report[backend] = _backend(emulate=ctx.rehearse)
        for group, cases in report[backend].items():
            if cases.get("status") in ("skip", "fail"):
                if cases["status"] == "fail":
                    failures.append(f"{backend} {group}: {cases['reason']}")
                continue
            ran += len(cases)
            failures += [f"{backend} {group} {case}: {why}" for case, why in cases.items() if why]
            report[backend][group] = {case: why or "pass" for case, why in cases.items()}
    figures = {"cases": figure(ran, "cases", "ops compared bitwise with their torch reference")}
    for backend in backends:  # what one GPU must run whatever its multicast: never a vacuous pass
        failures += [
            f"{backend} {group}: {report[backend][group].get('reason')}"
            for group in ("lamport", "twoshot", "local_and_exchange")
            if report[backend][group].get("status") == "skip"
        ]
    if ran == 0:
        failures.append("no case ran")
    if failures:
        return result("fail", "; ".join(failures[:20]), figures=figures, backends=report)
    return result("pass", figures=figures, backends=report)

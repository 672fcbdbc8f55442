"""``loopback``: N = 2, 4 and 8 virtual ranks in one process on the one GPU (tests/gpu_check/loopback.py),
the real unicast kernels concurrently for ``ROUNDS`` rounds each (Lamport plain and fused, the row split
included, the two-shot, the all-gather and the reduce-scatter), bitwise against the rank-order reference
and across ranks; a forced mismatch and a forced timeout surface as ubnext's errors; once under
compute-sanitizer (memcheck, racecheck) at N = 2.

This is GPU memory ordering between concurrent grids on one device, not NVLink.

Rehearsal: the emulator runs one launch at a time per process (``g_launch_mutex`` in csrc/emu/sched.cpp,
workers indexed by block, one own rank per registered region), so N virtual ranks cannot run in one
process there. Teaching it concurrent launches was decided against for this change: every launch-level
structure of the emulator (its workers, its traffic and count records, its region ownership) is
per-process today, and the mpi tier already runs these kernels with ranks as processes, normal and under
chaos. The rehearsal builds every case's inputs and references at N = 2, 4 and 8 and checks that the
comparison passes the reference and fails a one-bit change, runs each round's glue against
``loopback.RecordingRanks`` (CPU rows; each launch checked and recorded, not run), then reports ``skip``
saying so.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from tests.gpu_check.common import ROOT, Context, figure, result, run_bounded, skipped

RANK_COUNTS = (2, 4, 8)
SANITIZER_TOOLS = ("memcheck", "racecheck")
SANITIZER_ROUNDS = 1
SANITIZER_MIN_S = 30  # torch and a CUDA context under the tool take most of this
SANITIZER_MAX_S = 60
REHEARSAL_REASON = (
    "the emulator runs one launch at a time per process (csrc/emu/sched.cpp g_launch_mutex): "
    "concurrent virtual ranks need a GPU; the rehearsal built every case's inputs and references "
    "at N = 2, 4, 8 and checked the comparison both ways"
)


def _rehearse() -> dict:
    import torch

    from tests.gpu_check import loopback as L

    for n in RANK_COUNTS:
        for case in L.CASES:
            xs = L.inputs(case, n, 0)
            want = L.reference(case, xs, 0)
            if L.compare(want, want) is not None:
                return result("fail", f"{case.name} N={n}: the reference does not compare equal to itself")
            first = want[0][0] if isinstance(want[0], tuple) else want[0]
            flipped = first.clone()
            flipped.view(torch.uint8)[0] ^= 1
            bad = [(flipped, *w[1:]) if isinstance(w, tuple) else flipped for w in want[:1]] + want[1:]
            if L.compare(bad, want) is None:
                return result("fail", f"{case.name} N={n}: a flipped bit went unnoticed")
    launches = 0
    for n in RANK_COUNTS:  # the GPU run's glue, whole, with launches checked and recorded instead of run
        for case in L.CASES:
            vr = L.RecordingRanks(n, timeout_s=5.0)
            _round(vr, case, 0, vr.max_blocks())
            launches += len(vr.launches)
            if len(vr.launches) != n:
                return result("fail", f"{case.name} N={n}: {len(vr.launches)} launches, not {n}")
    vr = L.RecordingRanks(2, timeout_s=1.0)
    case = L.CASES[0]
    _round(vr, case, 0, vr.max_blocks(), numel_of_rank=lambda r: case.numel if r == 0 else case.numel // 2)
    _round(vr, case, 0, vr.max_blocks(), ranks=[0])
    if [launch[3][0] for launch in vr.launches] != [case.numel, case.numel // 2, case.numel]:
        return result("fail", f"the forced cases launched {vr.launches}")
    return result(
        "skip",
        REHEARSAL_REASON,
        cases=[c.name for c in L.CASES],
        rank_counts=list(RANK_COUNTS),
        figures={"recorded_launches": figure(launches, "launches", "RecordingRanks (rehearsal)")},
    )


def _round(vr, case, round_: int, max_blocks: int, ranks=None, numel_of_rank=None, kernel=None) -> list:
    """One call of ``case`` on every virtual rank; returns what each rank holds afterwards."""
    import torch

    from tests.gpu_check import loopback as L
    from ubnext import kernels
    from ubnext.comm._executor import GPU_BLOCK, launch_geometry, row_cluster

    n, dev = vr.n, vr.device
    xs = [x.to(dev) for x in L.inputs(case, n, round_)]
    elem = xs[0].element_size()
    name = kernels.kernel_name(case.algo, "u8" if case.algo == "allgather" else "bf16")
    pointers, outputs = [], []
    if case.algo == "lamport":
        numel = case.numel
        tokens = numel // L.HIDDEN if case.fused else 0
        grid, block = launch_geometry("lamport", numel, elem, tokens, case.fused, n, GPU_BLOCK, max_blocks)
        scalars = (
            numel,
            L.HIDDEN if case.fused else 0,
            L.EPS if case.fused else 0.0,
            kernels.F_FUSED_NORM if case.fused else 0,
        )
        residual, weight = (t.to(dev) for t in L.norm_operands(round_))
        rows = numel // L.HIDDEN
        for r in range(n):
            out = torch.empty_like(xs[r])
            if case.fused:
                res = residual.repeat(rows)
                res_out = torch.empty_like(res)
                pointers.append(
                    (xs[r].data_ptr(), out.data_ptr(), res.data_ptr(), res_out.data_ptr(), weight.data_ptr(), 0, 0)
                )
                outputs.append((out, res_out, res))
            else:
                pointers.append((xs[r].data_ptr(), out.data_ptr(), 0, 0, 0, 0, 0))
                outputs.append(out)
        if numel_of_rank is not None:  # a forced mismatch: one rank calls with another count
            scalars_of = [(numel_of_rank(r), *scalars[1:]) for r in range(n)]
    elif case.algo == "twoshot":
        grid, block = launch_geometry("twoshot", case.numel, elem, 0, False, n, GPU_BLOCK, max_blocks)
        scalars = (case.numel, 0, 0.0, 0)
        for r in range(n):
            stage = vr.staging(r, case.numel * elem, xs[r].dtype).copy_(xs[r])
            pointers.append((stage.data_ptr(), stage.data_ptr(), 0, 0, 0, 0, 0))
            outputs.append(stage)
    elif case.algo == "allgather":
        nbytes = case.numel * elem
        grid, block = launch_geometry("allgather", nbytes, 1, 0, False, n, GPU_BLOCK, max_blocks)
        scalars = (nbytes, 0, 0.0, 0)
        for r in range(n):
            target = vr.staging(r, n * nbytes, torch.uint8)
            target[r * nbytes : (r + 1) * nbytes].copy_(xs[r].view(torch.uint8))
            pointers.append((target.data_ptr() + r * nbytes, target.data_ptr(), 0, 0, 0, 0, 0))
            outputs.append(target)
    else:  # reduce_scatter
        shard = case.numel // n
        grid, block = launch_geometry("reduce_scatter", shard, elem, 0, False, n, GPU_BLOCK, max_blocks)
        scalars = (shard, 0, 1.0, 0)
        for r in range(n):
            src = vr.staging(r, case.numel * elem, xs[r].dtype).copy_(xs[r])
            out = torch.empty(shard, dtype=xs[r].dtype, device=dev)
            pointers.append((src.data_ptr(), out.data_ptr(), 0, 0, 0, 0, 0))
            outputs.append(out)
    vr.synchronize()  # the inputs, written on the default stream, before the ranks' streams read them
    cluster = row_cluster(case.algo, case.numel // L.HIDDEN if case.fused else 0, grid)  # the row split's
    vr.launch(
        name,
        grid,
        block,
        scalars if numel_of_rank is None else scalars_of,
        pointers,
        ranks=ranks,
        kernel=kernel,
        cluster=cluster,
    )
    if case.fused:
        return [(o[0], o[1]) for o in outputs], xs
    return outputs, xs


def _soak(rounds: int, rank_counts=RANK_COUNTS, cases=None, timeout_s: float = 5.0) -> dict:
    from tests.gpu_check import loopback as L

    report, failures = {}, []
    for n in rank_counts:
        vr = L.VirtualRanks(n, timeout_s=timeout_s)
        for case in cases or L.CASES:
            why = None
            for round_ in range(rounds):
                got, xs = _round(vr, case, round_, vr.max_blocks())
                error = vr.error()
                why = error or L.compare(got, L.reference(case, [x.cpu() for x in xs], round_))
                if why:
                    why = f"round {round_}: {why}"
                    break
            report[f"{case.name} N={n}"] = why or f"pass ({rounds} rounds)"
            if why:
                failures.append(f"{case.name} N={n} {why}")
                vr = L.VirtualRanks(n, timeout_s=timeout_s)  # a failed call leaves the rows' protocol state behind
    return {"cases": report, "failures": failures}


STAMPED_CASES = ("lamport_16k", "lamport_fused_1x8192")
STAMP_RANKS = (2, 8)
STAMP_ROUNDS = 20


def _stamps() -> dict:
    """Per-phase stamps (the test-only build UBNEXT_STAMPS, tests/gpu_check/stamps.py) of the 16 KB
    allreduce and the fused 1 x 8192 on virtual ranks: per phase, the median over rounds and ranks of the
    ns after the entry stamp, with the stamps' order checked. The calibrated model's per-phase figures
    (issue 38) come from here; %globaltimer's step bounds how short a phase can read."""
    import statistics

    from tests.gpu_check import loopback as L
    from tests.gpu_check import stamps as S
    from ubnext import kernels
    from ubnext.runtime import _cuda

    image = S.compile_stamped("lamport.cu", _cuda.device_arch(0))
    with _cuda.primary_context(0):
        code = kernels.object_code(image)
        kernel_object = code.get_kernel("ubnext_lamport_bf16")
    kernel = _cuda.kernel_handle(kernel_object)  # code and kernel_object stay referenced until we return
    figures, problems = {}, []
    for n in STAMP_RANKS:
        vr = L.VirtualRanks(n, timeout_s=5.0)
        for case in (c for c in L.CASES if c.name in STAMPED_CASES):
            phases: dict[str, list[int]] = {}
            for round_ in range(STAMP_ROUNDS):
                got, xs = _round(vr, case, round_, vr.max_blocks(), kernel=kernel)
                why = vr.error() or L.compare(got, L.reference(case, [x.cpu() for x in xs], round_))
                if why:
                    problems.append(f"stamped {case.name} N={n} round {round_}: {why}")
                    break
                for r in range(n):
                    stamps = S.decode(vr.sync_region(r), n)
                    problems += [
                        f"{case.name} N={n} rank {r}: {p}" for p in S.order_problems(stamps, row_split=case.fused)
                    ][:1]
                    relative = S.since_entry(stamps)
                    slots = [ns for ns in relative.pop("slots") if ns is not None]
                    if slots:  # the first and the last peer's data seen
                        relative.update(first_slot_ready=min(slots), last_slot_ready=max(slots))
                    for phase, ns in relative.items():
                        if ns is not None:
                            phases.setdefault(phase, []).append(int(ns))
            for phase, values in phases.items():
                figures[f"{case.name}.N{n}.{phase}"] = figure(
                    statistics.median(values),
                    "ns after entry",
                    f"%globaltimer stamps (UBNEXT_STAMPS build), thread 0 of CTA 0, median of {len(values)} "
                    f"(rounds x ranks), virtual ranks on one GPU",
                )
    return {"figures": figures, "problems": problems}


def _forced_errors() -> dict:
    """A count mismatch and a missing peer, each on fresh rows: ubnext's own error, naming the cause."""
    from tests.gpu_check import loopback as L

    case = L.CASES[0]
    out = {}
    vr = L.VirtualRanks(2, timeout_s=2.0)
    _round(vr, case, 0, vr.max_blocks(), numel_of_rank=lambda r: case.numel if r == 0 else case.numel // 2)
    error = vr.error() or ""
    out["mismatch"] = ("pass: " + error[:300]) if "different arguments" in error else f"fail: got {error or 'no error'}"
    vr = L.VirtualRanks(2, timeout_s=1.0)
    _round(vr, case, 0, vr.max_blocks(), ranks=[0])
    error = vr.error() or ""
    out["timeout"] = (
        ("pass: " + error[:300]) if "timed out" in error and "peer 1" in error else f"fail: got {error or 'no error'}"
    )
    return out


def _sanitized(deadline: float) -> dict:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {t: skipped("compute-sanitizer is not on PATH") for t in SANITIZER_TOOLS}
    out = {}
    for name in SANITIZER_TOOLS:
        left = deadline - time.monotonic()
        if left < SANITIZER_MIN_S:
            out[name] = skipped(f"out of the step's time ({left:.0f} s left)")
            continue
        # --report-api-errors no: cuda-python looks up driver entry points with cuGetProcAddress, and a
        # refused lookup is an API error to the tool, not a memory error (the first GPU run reported 34 of
        # them, all cuGetProcAddress_v2); an API error of our own raises in Python and fails the run anyway.
        command = [
            tool,
            "--tool",
            name,
            "--report-api-errors",
            "no",
            "--error-exitcode",
            "99",
            sys.executable,
            "-m",
            "tests.gpu_check.step_loopback",
            "--sanitized-run",
        ]
        bound = min(SANITIZER_MAX_S, left)
        status, text = run_bounded(command, bound, cwd=ROOT, env=dict(os.environ, CUDA_DEVICE_MAX_CONNECTIONS="32"))
        if status is None:
            out[name] = skipped(
                f"ran past {bound:.0f} s: the tool may serialise the concurrent kernels, which then wait on each other"
            )
            continue
        if status == 0:
            out[name] = figure(
                0,
                "errors",
                f"compute-sanitizer --tool {name} --report-api-errors no, N = 2, {SANITIZER_ROUNDS} rounds per case",
                tail=text[-800:],
            )
        elif "timed out" in text:
            out[name] = skipped(
                f"the ranks timed out under {name}: the tool serialises concurrent kernels ({text[-400:]})"
            )
        elif status == 99:
            out[name] = {"status": "fail", "reason": f"{name} reported errors", "tail": text[-3000:]}
        else:
            out[name] = skipped(f"{name} or the runtime refused (exit {status}): {text[-600:]}")
    return out


def run(ctx: Context) -> dict:
    if ctx.rehearse:
        return _rehearse()
    from tests.gpu_check import loopback as L

    L.raise_max_connections()  # before torch makes the CUDA context
    import torch

    if not torch.cuda.is_available():
        return result("skip", "no GPU")
    deadline = time.monotonic() + ctx.timeout_s - 10
    note = "concurrent grids on one GPU: real GPU memory ordering, not NVLink"
    soak = _soak(L.ROUNDS)
    ctx.save_partial(
        result(
            "fail" if soak["failures"] else "pass",
            "; ".join(soak["failures"][:10]) or None,
            note=note,
            cases=soak["cases"],
            partial="the soak only",
        )
    )
    forced = _forced_errors()
    ctx.save_partial(
        result(
            "fail" if soak["failures"] else "pass",
            "; ".join(soak["failures"][:10]) or None,
            note=note,
            cases=soak["cases"],
            forced=forced,
            partial="the soak and the forced errors",
        )
    )
    try:
        stamped = _stamps()
    except Exception as exc:  # noqa: BLE001 - the stamps are figures: their failure is reported, the rest stands
        stamped = {"figures": {"stamps": skipped(f"{type(exc).__name__}: {exc}")}, "problems": []}
    sanitizer = _sanitized(deadline)
    failures = soak["failures"] + [f"forced {k}: {v}" for k, v in forced.items() if v.startswith("fail")]
    failures += stamped["problems"]
    failures += [f"{k}: {v['reason']}" for k, v in sanitizer.items() if v.get("status") == "fail"]
    fields = dict(
        note=note,
        cases=soak["cases"],
        forced=forced,
        sanitizer=sanitizer,
        figures=stamped["figures"],
        max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
    )
    if failures:
        return result("fail", "; ".join(failures[:10]), **fields)
    return result("pass", **fields)


def _sanitized_run() -> int:
    """The run compute-sanitizer wraps: every case at N = 2 for a few rounds."""
    from tests.gpu_check import loopback as L

    L.raise_max_connections()
    # one case, one round, a short bound: a tool that serialises the two ranks' kernels shows in a second
    soak = _soak(SANITIZER_ROUNDS, rank_counts=(2,), cases=L.CASES[:1], timeout_s=1.0)
    print("\n".join(f"{k}: {v}" for k, v in soak["cases"].items()))
    return 1 if soak["failures"] else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--sanitized-run"]:
        sys.exit(_sanitized_run())
    sys.exit("usage: python -m tests.gpu_check.step_loopback --sanitized-run")

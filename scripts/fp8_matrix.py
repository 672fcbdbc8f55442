"""The torch.compile matrix of FSDP2 with ubnext's FP8 all-gather (issue 13), measured.

    python scripts/fp8_matrix.py [--np 2] [--out docs/FP8_ALLGATHER.md]

runs every cell in its own ``mpirun -np N`` job (ranks on the CPU emulator, or on GPUs where
there are some) and writes the table into the doc between its markers. A cell builds a small
stack, converts its blocks with ``convert_to_fp8_all_gather(scaling=COLUMN)``, shards it with
``fully_shard``, installs ubnext's collectives, applies the row's compilation, and runs two
training steps; it passes when the loss matches the eager run of the same column within 1 %
(inductor may fuse bf16 arithmetic differently). Each cell first tries ``fullgraph=True``:

* ✅  it runs with fullgraph=True and matches eager;
* 🙁  it needed the workaround named (``fullgraph=False``: graph breaks);
* ❌  it fails either way; the first line of the error is shown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROWS = {
    "eager": "eager",
    "blocks": "each block's forward compiled",
    "model": "whole model compiled",
    "model_hooks": "model compiled with the FSDP hooks traced (skip_fsdp_hooks=False)",
}
COLUMNS = {"row": "rowwise dynamic", "tensor": "per-tensor dynamic", "static": "static", "shard": "per-shard dynamic"}
BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"


def run_cell(row: str, column: str, fullgraph: bool) -> float:
    """One cell on this rank: the loss after two steps."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ubnext
    import ubnext.fsdp as UF
    from tests.mpi import worker as W

    comm = ubnext.get_communicator()
    W.COMM, W.MODE = comm, comm.mode
    n = dist.get_world_size()
    model = W._fsdp_stack(seed=5)
    scale = torch.tensor([0.02], device=comm.device) if column == "static" else None
    UF.convert_to_fp8_all_gather(model, scaling=column, scale=scale, include="blocks.*")
    mesh = init_device_mesh(comm.device.type, (n,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    UF.use_ubnext_collectives(model, comm)
    if row == "blocks":
        for block in model.blocks:
            block.compile(fullgraph=fullgraph)
    elif row == "model":
        model.compile(fullgraph=fullgraph)
    elif row == "model_hooks":
        if not hasattr(torch._dynamo.config, "skip_fsdp_hooks"):
            raise RuntimeError(
                f"torch {torch.__version__} always runs FSDP2's hooks outside the graph "
                "(torch._dynamo.disable in fsdp/_fully_shard/_fsdp_common.py; no skip_fsdp_hooks switch)"
            )
        torch._dynamo.config.skip_fsdp_hooks = False
        model.compile(fullgraph=fullgraph)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss = None
    for step in range(2):
        x = W.T.rank_input(dist.get_rank(), W.FSDP_BATCH * W.FSDP_HIDDEN, torch.float32, 30 + step)
        loss = model(x.view(W.FSDP_BATCH, W.FSDP_HIDDEN).to(comm.device)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    total = loss.detach().reshape(1).cpu()
    dist.all_reduce(total)
    return float(total) / n


def _cell_main(row: str, column: str, fullgraph: bool, out: str) -> int:
    import torch.distributed as dist

    try:
        result = {"ok": True, "loss": run_cell(row, column, fullgraph)}
    except Exception as exc:  # noqa: BLE001 - the cell's verdict is the error's first line
        first = (str(exc).strip().splitlines() or [""])[0]
        result = {"ok": False, "error": f"{type(exc).__name__}: {first}"[:200]}
    if not dist.is_initialized() or dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    return 0


def _launch(np_: int, row: str, column: str, fullgraph: bool, timeout: int) -> dict:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ubnext-matrix-{os.getpid()}-{row}-{column}.json"
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("UBNEXT_EMULATE", "0" if _has_gpus(np_) else "1")
    cmd = [
        "mpirun",
        "-np",
        str(np_),
        sys.executable,
        __file__,
        "--cell",
        row,
        column,
        "1" if fullgraph else "0",
        str(out),
    ]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {timeout} s"}
    if out.exists():
        return json.loads(out.read_text())
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"ok": False, "error": f"exit {proc.returncode}: {tail[0][:200]}"}


def _has_gpus(np_: int) -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() >= np_
    except ImportError:
        return False


def measure(np_: int, timeout: int) -> dict:
    cells: dict = {}
    for column in COLUMNS:
        eager = _launch(np_, "eager", column, True, timeout)
        cells[("eager", column)] = ("✅", "") if eager["ok"] else ("❌", eager["error"])
        for row in list(ROWS)[1:]:
            verdict = None
            for fullgraph in (True, False):
                got = _launch(np_, row, column, fullgraph, timeout)
                if got["ok"] and eager["ok"] and abs(got["loss"] - eager["loss"]) <= 0.01 * abs(eager["loss"]):
                    verdict = ("✅", "") if fullgraph else ("🙁", "needs fullgraph=False (graph breaks)")
                    break
                if got["ok"]:
                    got = {"ok": False, "error": f"loss {got['loss']:.6g} differs from eager {eager.get('loss')}"}
                if fullgraph:
                    first_error = got["error"]
            if verdict is None:
                verdict = ("❌", first_error)
            cells[(row, column)] = verdict
            print(f"{row:12s} {column:7s} {verdict[0]} {verdict[1]}", flush=True)
    return cells


def table(cells: dict, np_: int) -> str:
    import torch

    mode = "GPUs" if _has_gpus(np_) else "the CPU emulator (gloo)"
    lines = [
        f"Measured {datetime.date.today().isoformat()} with torch {torch.__version__}, {np_} ranks on {mode}, "
        "by `python scripts/fp8_matrix.py`.",
        "",
        "| | " + " | ".join(COLUMNS.values()) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    notes = []
    for row, title in ROWS.items():
        marks = []
        for column in COLUMNS:
            mark, why = cells[(row, column)]
            if why:
                notes.append(f"- {title}, {COLUMNS[column]}: {mark} {why}")
                mark = f"{mark} [{len(notes)}]"
            marks.append(mark)
        lines.append(f"| {title} | " + " | ".join(marks) + " |")
    if notes:
        lines += ["", *[f"[{i + 1}] {note[2:]}" for i, note in enumerate(notes)]]
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--cell":
        row, column, fullgraph, out = sys.argv[2:6]
        return _cell_main(row, column, fullgraph == "1", out)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    ap.add_argument("--out", default=str(ROOT / "docs" / "FP8_ALLGATHER.md"))
    args = ap.parse_args()
    text = table(measure(args.np, args.timeout), args.np)
    doc = Path(args.out)
    body = doc.read_text() if doc.exists() else f"{BEGIN}\n{END}\n"
    head, rest = body.split(BEGIN, 1)
    doc.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run one step of the check in this process: ``python -m tests.gpu_check.step NAME RESULT.json``.

The harness (``__main__``) starts each step this way, so that a crash, a hang or a poisoned CUDA
context costs that step only. A step that raises is a ``fail`` with its traceback."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from tests.gpu_check.common import STEPS, Context, crash_result, write_json


def main(argv: list[str]) -> int:
    name, result_path = argv[0], Path(argv[1])
    if name not in STEPS:
        raise SystemExit(f"unknown step {name!r}; the steps are {', '.join(STEPS)}")
    try:
        ctx = Context.from_env()
        ctx.result_path = result_path
        outcome = importlib.import_module(f"tests.gpu_check.step_{name}").run(ctx)
    except BaseException as exc:  # noqa: BLE001 - the step's verdict, whatever went wrong
        outcome = crash_result(exc)
    write_json(result_path, outcome)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

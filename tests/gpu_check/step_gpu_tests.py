"""``gpu_tests``: ``pytest tests/gpu``, its summary and each test's outcome (from a JUnit XML report).

On one GPU the multi-rank cases skip (they need two GPUs; ``ranks2`` runs their one-GPU subset), and the
one-GPU tests run: the probe against torch, the pinned error word, a cuMem mapping under torch, the PDL
chains. In the rehearsal (no GPU) every test skips, saying why: the step is a ``skip`` with the counts."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

from tests.gpu_check.common import ROOT, Context, figure, result, run_bounded


def _outcomes(junit_path) -> dict[str, str]:
    outcomes = {}
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        detail = next((child.get("message", "") for child in case if child.tag in ("failure", "error", "skipped")), "")
        outcomes[name] = (kinds[0] if kinds else "passed") + (f": {detail[:300]}" if detail else "")
    return outcomes


def run(ctx: Context) -> dict:
    junit = ctx.out / ".gpu_tests.xml"
    status, output = run_bounded(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", "tests/gpu"],
        ctx.timeout_s - 10,
        cwd=ROOT,
    )
    lines = output.strip().splitlines()
    summary = lines[-1] if lines else "(no output)"
    outcomes = _outcomes(junit) if junit.exists() else {}
    junit.unlink(missing_ok=True)
    counts = {
        kind: sum(1 for o in outcomes.values() if o.startswith(kind))
        for kind in ("passed", "failure", "error", "skipped")
    }
    figures = {kind: figure(n, "tests", "pytest --junitxml") for kind, n in counts.items()}
    if status not in (0, 5) or counts["failure"] or counts["error"]:
        summary = summary if status is not None else f"killed after {ctx.timeout_s - 10:g} s ({summary})"
        return result(
            "fail", f"pytest tests/gpu: {summary}", figures=figures, tests=outcomes, output_tail="\n".join(lines[-60:])
        )
    if counts["passed"] == 0:
        return result("skip", f"every GPU test skipped ({summary})", figures=figures, tests=outcomes)
    return result("pass", summary=summary, figures=figures, tests=outcomes)

"""Regenerate README.md's `python -m ubnext.info` sample, or (``--check``) fail when it has drifted.

    python scripts/readme_info_sample.py          # rewrite the sample in README.md
    python scripts/readme_info_sample.py --check  # exit 1, with a diff, if README.md differs

The sample is what a new user sees on a machine like the development one: ``python -m ubnext.info
--no-build``, no ``UBNEXT_*`` variables set, a fresh home (so the cubin cache is the default
``~/.cache/ubnext``, empty). Paths are written as ``<checkout>`` and ``~``. Versions (Python, torch,
cuda-python, NVRTC) and g++'s path are compared masked: a contributor with another patch release
must not fail, but every other word of the sample must match what info prints. The sample shows a
CPU-only machine (a CPU build of torch): on another kind of machine the check does not apply.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
COMMAND = ["-m", "ubnext.info", "--no-build"]
BEGIN = "```text\n"
# the sample is the text block right after this heading's paragraph
HEADING = "### Check a node first: `python -m ubnext.info`"
VERSION = re.compile(r"\b\d+\.\d+(?:\.\d+)?(?:\+\w+)?\b")


def generate() -> str:
    """info's output as the README shows it."""
    with tempfile.TemporaryDirectory() as home:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UBNEXT_", "NVTE_"))}
        env.update(HOME=home, CUDA_VISIBLE_DEVICES="")  # no GPU shown, also on a GPU node
        out = subprocess.run(
            [sys.executable, *COMMAND], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=True
        ).stdout
    return out.replace(str(ROOT), "<checkout>").replace(home, "~")


def _sample_span(text: str) -> tuple[int, int]:
    at = text.index(HEADING)
    start = text.index(BEGIN, at) + len(BEGIN)
    return start, text.index("```", start)


def readme_sample() -> str:
    text = README.read_text()
    start, end = _sample_span(text)
    return text[start:end]


def comparable(sample: str) -> str:
    """The sample with what differs between machines of the same kind masked: versions, and where
    g++ lives."""
    return re.sub(r"g\+\+ at \S+", "g++ at <path>", VERSION.sub("<version>", sample))


def main(argv: list[str]) -> int:
    fresh = generate()
    if "--check" in argv:
        if comparable(fresh) == comparable(readme_sample()):
            return 0
        diff = difflib.unified_diff(
            readme_sample().splitlines(), fresh.splitlines(), "README.md", "ubnext.info", lineterm=""
        )
        print(
            "README.md's ubnext.info sample has drifted; run python scripts/readme_info_sample.py\n" + "\n".join(diff)
        )
        return 1
    text = README.read_text()
    start, end = _sample_span(text)
    README.write_text(text[:start] + fresh + text[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

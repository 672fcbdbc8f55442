"""Every ubnext source path (``ubnext/....py``) and every ``python -m
ubnext.X`` that README.md, docs/*.md and csrc/emu/README.md name exists: a module that moves takes
the pages that name it along (issue 37). docs/PERF.md is the lead's measurement log, edited by them
only; its paths are checked by ``test_perf_md_paths_are_listed``, which lists the stale ones."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.conftest import ROOT

PAGES = sorted(
    [
        "README.md",
        "csrc/emu/README.md",
        *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md") if p.name != "PERF.md"),
    ]
)
PATH = re.compile(r"(?<![\w/.-])ubnext/(?:\w+/)*\w+\.py\b")
COMMAND = re.compile(r"python -m (ubnext(?:\.\w+)*)")


def _named(page: str) -> tuple[set[str], set[str]]:
    text = (ROOT / page).read_text()
    return set(PATH.findall(text)), set(COMMAND.findall(text))


def _runnable(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    if spec is None:
        return False
    if spec.submodule_search_locations is not None:  # a package runs through its __main__
        return importlib.util.find_spec(module + ".__main__") is not None
    return True


@pytest.mark.parametrize("page", PAGES)
def test_every_path_and_command_a_page_names_exists(page):
    paths, commands = _named(page)
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{page} names paths that do not exist: {missing}"
    broken = sorted(m for m in commands if not _runnable(m))
    assert not broken, f"{page} names `python -m` modules that do not run: {broken}"


# docs/PERF.md is not ours to edit; its stale mentions are listed here so a new one still fails
PERF_STALE: set[str] = set()


def test_perf_md_paths_are_listed():
    paths, commands = _named("docs/PERF.md")
    missing = {p for p in paths if not (ROOT / p).exists()}
    assert missing <= PERF_STALE, f"docs/PERF.md names paths that do not exist: {sorted(missing - PERF_STALE)}"
    assert all(_runnable(m) for m in commands)


def test_the_patterns_find_what_pages_write():
    text = "see `ubnext/comm/_executor.py`, ubnext/envs.py and `python -m ubnext.kernels build`; not xubnext/a.py"
    assert set(PATH.findall(text)) == {"ubnext/comm/_executor.py", "ubnext/envs.py"}
    assert COMMAND.findall(text) == ["ubnext.kernels"]

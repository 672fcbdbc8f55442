"""The package's layout rules (docs/ARCHITECTURE.md): no import cycle among ubnext's modules, counting
imports inside functions (only ``if TYPE_CHECKING:`` imports are exempt), no class longer than 400
lines and no module longer than 600. Each rule is also shown to catch a package that breaks it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ubnext"
MAX_CLASS, MAX_MODULE = 400, 600


def _modules(root: Path) -> dict[str, Path]:
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = (root.name, *f.relative_to(root).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _targets(mods: dict[str, Path], name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package modules an import statement in module ``name`` loads."""
    if isinstance(node, ast.Import):
        candidates = [a.name for a in node.names]
    else:
        package = name if mods[name].name == "__init__.py" else name.rsplit(".", 1)[0]
        base = node.module or ""
        if node.level:
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
        candidates = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    found = []
    for t in candidates:
        while t and t not in mods and "." in t:
            t = t.rsplit(".", 1)[0]
        # a submodule importing its own package's __init__ is how Python loads it anyway
        if t in mods and t != name and not name.startswith(t + "."):
            found.append(t)
    return found


def structure(root: Path) -> tuple[list[list[str]], list[tuple[int, str]], list[tuple[int, str]]]:
    """(import cycles, classes over MAX_CLASS lines, modules over MAX_MODULE lines) of a package."""
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    long_classes, long_modules = [], []
    for name, path in mods.items():
        source = path.read_text()
        tree = ast.parse(source)
        if len(source.splitlines()) > MAX_MODULE:
            long_modules.append((len(source.splitlines()), str(path)))
        exempt = {line for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                  for b in n.body for line in range(b.lineno, b.end_lineno + 1)}
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno not in exempt:
                edges[name].update(_targets(mods, name, n))
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS:
                long_classes.append((n.end_lineno - n.lineno + 1, f"{path}:{n.name}"))
    return _cycles(edges), long_classes, long_modules


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, successors = work[-1]
            w = next(successors, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_ubnext_keeps_the_layout_rules():
    cycles, long_classes, long_modules = structure(PACKAGE)
    assert not cycles, f"import cycles among ubnext's modules: {cycles}"
    assert not long_classes, f"classes over {MAX_CLASS} lines: {long_classes}"
    assert not long_modules, f"modules over {MAX_MODULE} lines: {long_modules}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize("files,want", [
    # a cycle through an import inside a function, and through a subpackage
    ({"__init__.py": "", "a.py": "from . import b\n", "b.py": "def f():\n    from .sub import c\n",
      "sub/__init__.py": "", "sub/c.py": "from .. import a\n"}, [["pkg.a", "pkg.b", "pkg.sub.c"]]),
    # the same under TYPE_CHECKING only: no cycle
    ({"__init__.py": "", "a.py": "from . import b\n",
      "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n"}, []),
])
def test_the_cycle_rule_catches_a_cycle(tmp_path, files, want):
    cycles, _, _ = structure(_write(tmp_path / "pkg", files))
    assert cycles == want


def test_the_length_rules_catch_a_long_class_and_module(tmp_path):
    body = "class Big:\n" + "    x = 1\n" * MAX_CLASS + "\n" * (MAX_MODULE - MAX_CLASS)
    _, long_classes, long_modules = structure(_write(tmp_path / "pkg", {"__init__.py": "", "big.py": body}))
    assert [n for n, _ in long_classes] == [MAX_CLASS + 1]
    assert [n for n, _ in long_modules] == [MAX_MODULE + 1]

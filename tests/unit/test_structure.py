"""The package's layout rules (docs/ARCHITECTURE.md): no import cycle among ubnext's modules, counting
imports inside functions (only ``if TYPE_CHECKING:`` imports are exempt), no class longer than 400
lines and no module longer than 600, and each subpackage (or public module) imports only the layers
its line of docs/ARCHITECTURE.md's tree allows (LAYERS). Each rule is also shown to catch a package
that breaks it."""

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


def imports(root: Path) -> tuple[dict[str, set[str]], list[tuple[int, str]], list[tuple[int, str]]]:
    """(the package modules each module imports, classes over MAX_CLASS lines, modules over MAX_MODULE
    lines) of a package."""
    mods = _modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    long_classes, long_modules = [], []
    for name, path in mods.items():
        source = path.read_text()
        tree = ast.parse(source)
        if len(source.splitlines()) > MAX_MODULE:
            long_modules.append((len(source.splitlines()), str(path)))
        exempt = {
            line
            for n in ast.walk(tree)
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
            for b in n.body
            for line in range(b.lineno, b.end_lineno + 1)
        }
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno not in exempt:
                edges[name].update(_targets(mods, name, n))
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > MAX_CLASS:
                long_classes.append((n.end_lineno - n.lineno + 1, f"{path}:{n.name}"))
    return edges, long_classes, long_modules


def structure(root: Path) -> tuple[list[list[str]], list[tuple[int, str]], list[tuple[int, str]]]:
    """(import cycles, classes over MAX_CLASS lines, modules over MAX_MODULE lines) of a package."""
    edges, long_classes, long_modules = imports(root)
    return _cycles(edges), long_classes, long_modules


# What each part of ubnext may import besides itself: the tree at the top of docs/ARCHITECTURE.md, one
# line per subpackage or public module. A part is a subpackage (every module under ubnext/<part>/) or
# a top-level module; an entry is a part or one module (``pool.layout``). envs and errors are the
# leaves every part may import (errors names the kernels in its messages: it imports kernels inside
# a function). The package itself (ubnext/__init__.py) and bench, the top, import anything.
LEAVES = {"envs", "errors"}
LAYERS = {
    "envs": set(),
    "errors": {"kernels"},
    "runtime": {"kernels"},
    "kernels": {"runtime", "pool.layout"},  # kernels.inspect: the descriptor's size, to check a cubin
    "reference": {"kernels"},  # the kernels' flag constants
    "pool": {"runtime"},
    "plan": set(),
    "ops": {"runtime", "kernels", "reference"},
    "comm": {"runtime", "kernels", "reference", "pool", "plan", "ops"},
    "tuning": {"runtime", "kernels", "reference", "pool", "plan", "ops", "comm", "info"},
    "testing": {"reference"},
    "info": {"runtime", "kernels", "plan", "pool"},
    "nn": {"ops", "reference"},
    "parallel": {"nn"},
    "fsdp": {"runtime", "kernels", "reference", "pool", "plan", "ops", "comm"},
    "fusion": {"ops", "reference"},
    # the top: everything public in ubnext (the public modules of docs/ARCHITECTURE.md), and nothing imports it
    "integrations": {"comm", "ops", "plan", "fusion", "nn", "parallel", "fsdp", "testing", "info"},
}
TOP = {"", "bench"}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(
    edges: dict[str, set[str]], layers: dict[str, set[str]] = LAYERS, leaves: set[str] = LEAVES, top: set[str] = TOP
) -> list[str]:
    """Each import of one part by another that ``layers`` does not allow, and each part it does not name."""
    found = []
    for name, targets in sorted(edges.items()):
        part = _part(name)
        if part in top:
            continue
        if part not in layers:
            found.append(f"{name}: its part {part!r} has no line in LAYERS (docs/ARCHITECTURE.md's tree)")
            continue
        allowed = layers[part] | leaves
        for t in sorted(targets):
            inner = t.split(".", 1)[1] if "." in t else ""
            if _part(t) == part or _part(t) in allowed or any(inner == a or inner.startswith(a + ".") for a in allowed):
                continue
            found.append(f"{name} imports {t}: {part} may import only {sorted(allowed)}")
    return found


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


def test_ubnext_keeps_the_import_rules():
    edges, _, _ = imports(PACKAGE)
    assert not layer_violations(edges)


def test_nothing_in_ubnext_imports_the_integrations():
    """ubnext.integrations sits above everything, the package and bench included: a framework's plugin is
    loaded by the framework, never by ubnext."""
    edges, _, _ = imports(PACKAGE)
    importers = sorted(
        m
        for m, targets in edges.items()
        if _part(m) != "integrations" and any(_part(t) == "integrations" for t in targets)
    )
    assert not importers, f"modules outside ubnext.integrations import it: {importers}"


def test_every_part_has_a_line_in_the_architecture_tree():
    """Each subpackage and public module is on a line of the tree at the top of docs/ARCHITECTURE.md,
    and is a part of LAYERS (or the top)."""
    tree = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text().split("\n## The package\n", 1)[1].split("\n## ")[0]
    parts = {
        p.name if p.is_dir() else p.stem
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")
    }
    assert parts == set(LAYERS) | (TOP - {""}), "LAYERS and ubnext/'s parts differ"
    missing = sorted(p for p in parts if f"{p}/" not in tree and f"{p}.py" not in tree)
    assert not missing, f"docs/ARCHITECTURE.md's tree has no line for {missing}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(
    "files,want",
    [
        # a cycle through an import inside a function, and through a subpackage
        (
            {
                "__init__.py": "",
                "a.py": "from . import b\n",
                "b.py": "def f():\n    from .sub import c\n",
                "sub/__init__.py": "",
                "sub/c.py": "from .. import a\n",
            },
            [["pkg.a", "pkg.b", "pkg.sub.c"]],
        ),
        # the same under TYPE_CHECKING only: no cycle
        (
            {
                "__init__.py": "",
                "a.py": "from . import b\n",
                "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
            },
            [],
        ),
    ],
)
def test_the_cycle_rule_catches_a_cycle(tmp_path, files, want):
    cycles, _, _ = structure(_write(tmp_path / "pkg", files))
    assert cycles == want


def test_the_import_rule_catches_an_import_its_line_does_not_allow(tmp_path):
    root = _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "low/__init__.py": "",
            "low/a.py": "def f():\n    from ..high import b\n",
            "high/__init__.py": "",
            "high/b.py": "from ..low import a\n",
            "envs.py": "",
        },
    )
    edges, _, _ = imports(root)
    layers = {"low": set(), "high": {"low"}, "envs": set()}
    assert layer_violations(edges, layers, leaves={"envs"}, top={""}) == [
        "pkg.low.a imports pkg.high.b: low may import only ['envs']"
    ]
    # one module of a part may be allowed on its own
    assert layer_violations(edges, {**layers, "low": {"high.b"}}, leaves={"envs"}, top={""}) == []


def test_the_length_rules_catch_a_long_class_and_module(tmp_path):
    body = "class Big:\n" + "    x = 1\n" * MAX_CLASS + "\n" * (MAX_MODULE - MAX_CLASS)
    _, long_classes, long_modules = structure(_write(tmp_path / "pkg", {"__init__.py": "", "big.py": body}))
    assert [n for n, _ in long_classes] == [MAX_CLASS + 1]
    assert [n for n, _ in long_modules] == [MAX_MODULE + 1]

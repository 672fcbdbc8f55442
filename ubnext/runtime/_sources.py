"""Where ubnext's kernel sources live.

A wheel or ``pip install .`` carries ``csrc/`` and ``include/`` inside the package, under
``ubnext/_data/`` (``setup.py`` copies them there at build time); an editable install or a
checkout reads them from the repository root. NVRTC and the CPU emulator both compile from here.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # ubnext/, this file being ubnext/runtime/_sources.py


def _locate(name: str) -> Path:
    for candidate in (PACKAGE / "_data" / name, PACKAGE.parent / name):
        if (candidate / "kernels").is_dir() or (name == "include" and (candidate / "ubnext.h").is_file()):
            return candidate
    return PACKAGE / "_data" / name  # missing: the callers report the path they looked in


CSRC = _locate("csrc")
INCLUDE = _locate("include")

"""The stub driver (stub_libcuda.c): a libcuda.so.1 that accepts every call and records launches,
so that cuda.bindings and cuda.core run their real code on a machine without a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("stub_libcuda.c")


def build(directory: Path) -> Path:
    """Compile the stub into ``directory``/libcuda.so.1 (rebuilt when the source is newer) and return
    ``directory``: put it first on LD_LIBRARY_PATH of a new process, before cuda.bindings loads."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "libcuda.so.1"
    if not target.exists() or target.stat().st_mtime < SOURCE.stat().st_mtime:
        cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            raise RuntimeError("no C compiler (gcc or cc, or $CC) to build the stub driver")
        tmp = target.with_name(f".libcuda.so.1.{os.getpid()}")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-Wall", "-o", str(tmp), str(SOURCE), "-ldl"], check=True)
        tmp.replace(target)  # atomic: a concurrent build never leaves a half-written library
    return directory

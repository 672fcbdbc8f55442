"""Issue 40 C11: the first use with an empty cache builds the CPU emulator (44 to 51 s) and NVRTC
compiles the kernels (minutes), which ran without a word. Each build now says what it builds and
where as it starts, and its time as it ends, on the logger ``ubnext.build``, shown by default. The
builds are stubs here (no compiler, no NVRTC): what is tested is what is said, and when."""

from __future__ import annotations

import logging
from pathlib import Path

from ubnext import envs, kernels
from ubnext.runtime import _build_progress, _emu


def _progress(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ubnext.build" and r.levelno == logging.INFO]


def test_the_emulator_build_says_what_where_and_how_long(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        _emu, "_compile", lambda cxx, flags, sources, workdir, out, objects: Path(out).write_bytes(b"lib")
    )
    lib = _emu.build()
    start, end = _progress(caplog)
    assert start.startswith("building the CPU emulator library into ") and str(lib) in start
    assert end.startswith("built the CPU emulator library in ") and end.endswith(" s")
    caplog.clear()
    assert _emu.build() == lib and _progress(caplog) == []  # from the cache: nothing to say


def test_a_kernel_compile_says_what_where_and_how_long(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("UBNEXT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(
        kernels, "_nvrtc_images", lambda fname, arch, wants, defines=(): ({want: want.encode() for want in wants}, "")
    )
    kernels.compile_kernels("lamport.cu", "sm_90")
    start, end = _progress(caplog)
    assert start.startswith("building the kernels of lamport.cu for sm_90 (NVRTC 13.0) into ")
    assert str(tmp_path / "cubin") in start
    assert end.startswith("built the kernels of lamport.cu for sm_90 (NVRTC 13.0) in ")
    caplog.clear()
    kernels.compile_kernels("lamport.cu", "sm_90")
    assert _progress(caplog) == []


def test_shown_by_default_and_silenced_with_the_warnings():
    """The 'ubnext' logger shows WARNING and above by default; the build lines are INFO and pass
    through its handler unless UBNEXT_LOG_LEVEL=error."""
    assert envs.VARIABLES["UBNEXT_LOG_LEVEL"].default == "warning"
    assert _build_progress.level_for("warning") == logging.INFO
    assert _build_progress.level_for("info") == logging.INFO
    assert _build_progress.level_for("debug") == logging.DEBUG
    assert _build_progress.level_for("error") == logging.ERROR
    assert logging.getLogger("ubnext").handlers and logging.getLogger("ubnext.build").propagate

"""Cubins carried to a machine that cannot compile them: ``python -m ubnext.kernels export`` writes
each kernel file's cubin, built here, and a manifest into a folder; a machine with that folder as
UBNEXT_CUBIN_DIR (a borrowed GPU node with its own NVRTC, or none that can compile csrc) loads them
before its cache and before compiling, whenever the sources they were built from are its own."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from .. import envs
from . import Cubin, KernelResources, _cached_or_compiled, _log, _write_atomically, build_many, source_hash, sources

__all__ = ["MANIFEST", "carried_cubin", "export_cubins"]

MANIFEST = "manifest.json"
_MANIFEST_FORMAT = 1


def _read_manifest(folder: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """An export folder's manifest: kernel file -> arch -> its entry; empty where there is none."""
    path = folder / MANIFEST
    if not path.exists():
        return {}
    manifest = json.loads(path.read_text())
    if manifest.get("format") != _MANIFEST_FORMAT:
        raise ValueError(f"{path} has format {manifest.get('format')!r}; this ubnext reads format {_MANIFEST_FORMAT}")
    return manifest["files"]


def carried_cubin(fname: str, arch: str) -> Cubin | None:
    """The cubin of UBNEXT_CUBIN_DIR for this file and arch, when it was built from these sources
    (and is whole); None otherwise, saying why in the log where one is there but unusable."""
    folder = envs.get("UBNEXT_CUBIN_DIR")
    if not folder:
        return None
    folder = Path(folder)
    try:
        entry = _read_manifest(folder).get(fname, {}).get(arch)
    except (OSError, ValueError, KeyError) as exc:
        _log.warning("UBNEXT_CUBIN_DIR=%s: its manifest is unreadable (%s); its cubins are not used", folder, exc)
        return None
    if entry is None:
        return None
    here = source_hash()
    if entry["source_hash"] != here:
        _log.warning(
            "UBNEXT_CUBIN_DIR: ignoring the carried cubin of %s for %s (%s): it was built from sources "
            "%s, this checkout's are %s",
            fname,
            arch,
            folder / entry["cubin"],
            entry["source_hash"],
            here,
        )
        return None
    try:
        image = (folder / entry["cubin"]).read_bytes()
    except OSError as exc:
        _log.warning("UBNEXT_CUBIN_DIR: ignoring the carried cubin of %s for %s: %s", fname, arch, exc)
        return None
    if hashlib.sha256(image).hexdigest() != entry["sha256"]:
        _log.warning(
            "UBNEXT_CUBIN_DIR: ignoring the carried cubin of %s for %s: %s is not the file the manifest "
            "names (its sha256 differs: truncated or replaced)",
            fname,
            arch,
            folder / entry["cubin"],
        )
        return None
    resources = tuple(KernelResources(**r) for r in entry["resources"])
    return Cubin(fname, arch, image, resources, entry["nvrtc"], "carried")


def export_cubins(folder: Path, archs: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Write every kernel file's cubin for each arch into ``folder``, built here (this machine's cache
    or NVRTC, never another carried folder), and the manifest (``MANIFEST``) that UBNEXT_CUBIN_DIR
    reads: per file and arch, the source hash, the NVRTC version, the cubin's file name and sha256,
    and its kernels' ptxas resources. Entries of other files or archs already there are kept.
    Returns the manifest's files."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    before = source_hash()
    built = build_many([(fname, arch) for fname in sorted(sources()) for arch in archs], _cached_or_compiled)
    if source_hash() != before:
        raise RuntimeError("csrc changed while the cubins were built: run the export again")
    files = _read_manifest(folder)
    for (fname, arch), cubin in built.items():
        name = f"{Path(fname).stem}-{arch}.cubin"
        _write_atomically(folder / name, cubin.image)
        files.setdefault(fname, {})[arch] = {
            "source_hash": before,
            "nvrtc": cubin.nvrtc,
            "cubin": name,
            "sha256": hashlib.sha256(cubin.image).hexdigest(),
            "resources": [r.__dict__ for r in cubin.resources],
        }
    manifest = {"format": _MANIFEST_FORMAT, "files": files}
    _write_atomically(folder / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return files

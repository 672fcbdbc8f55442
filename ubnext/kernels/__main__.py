"""``python -m ubnext.kernels build``: compile every kernel ahead of time (no GPU needed) and
print each kernel's registers, spills and shared memory; fills the cubin cache.

``python -m ubnext.kernels export --arch sm_90 --to DIR``: the same cubins, built here, written to
DIR with a manifest, for a machine that cannot compile them (UBNEXT_CUBIN_DIR=DIR there)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import CSRC, MANIFEST, _cache_dir, build_many, export_cubins, nvrtc_version, sources
from ._ptxas import frame_problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ubnext.kernels")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="compile every kernel ahead of time (no GPU needed)")
    build.add_argument("--arch", nargs="+", default=["sm_90", "sm_100"])
    build.add_argument("--fail-on-spill", action="store_true", help="exit 1 if any kernel spills or has a stack frame")
    export = sub.add_parser(
        "export",
        help="write every kernel file's cubin and a manifest to a folder "
        "(UBNEXT_CUBIN_DIR of a machine that cannot compile them)",
    )
    export.add_argument("--arch", nargs="+", required=True)
    export.add_argument("--to", type=Path, required=True, help="the folder (created when missing)")
    args = parser.parse_args(argv)

    files = sources()
    if not files:
        print("no kernel sources found under", CSRC / "kernels")
        return 1
    if args.cmd == "export":
        exported = export_cubins(args.to, args.arch)
        for fname, archs in sorted(exported.items()):
            for arch in args.arch:
                entry = archs[arch]
                print(f"{entry['cubin']:28} {fname:18} {arch:7} NVRTC {entry['nvrtc']} sources {entry['source_hash']}")
        print(f"manifest: {args.to / MANIFEST}")
        return 0
    print(f"NVRTC {nvrtc_version()}; cache {_cache_dir()}")
    print(f"{'kernel':32} {'arch':7} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6} {'smem':>6}")
    problems: list[str] = []
    built = build_many([(fname, arch) for fname in sorted(files) for arch in args.arch])
    for fname, names in sorted(files.items()):
        for arch in args.arch:
            resources = built[fname, arch].resources
            found = {r.name for r in resources}
            missing = [n for n in names if n not in found]
            if missing:
                print(f"error: {fname} for {arch} does not define {missing}")
                return 1
            for r in sorted(resources, key=lambda r: r.name):
                if r.name not in names:
                    continue
                problems += frame_problems([r])
                print(
                    f"{r.name:32} {r.arch:7} {r.registers:5d} {r.spill_stores:9d} {r.spill_loads:9d} {r.stack_bytes:6d} {r.shared_bytes:6d}"
                )
    if args.fail_on_spill and problems:
        print(f"error: {len(problems)} kernels spill or have a stack frame:", *problems, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

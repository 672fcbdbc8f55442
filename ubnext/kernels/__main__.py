"""``python -m ubnext.kernels build``: compile every kernel ahead of time (no GPU needed) and
print each kernel's registers, spills and shared memory; fills the cubin cache."""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from . import CSRC, _cache_dir, compile_kernels, nvrtc_version, sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ubnext.kernels")
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build", help="compile every kernel ahead of time (no GPU needed)")
    build.add_argument("--arch", nargs="+", default=["sm_90", "sm_100"])
    build.add_argument("--fail-on-spill", action="store_true", help="exit 1 if any kernel spills")
    args = parser.parse_args(argv)

    files = sources()
    if not files:
        print("no kernel sources found under", CSRC / "kernels")
        return 1
    print(f"NVRTC {nvrtc_version()}; cache {_cache_dir()}")
    print(f"{'kernel':32} {'arch':7} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'stack':>6} {'smem':>6}")
    spills = 0
    jobs = [(fname, arch) for fname in sorted(files) for arch in args.arch]
    # one NVRTC compile per file and architecture, as many at once as there are cores: NVRTC
    # releases the GIL while it compiles, and the cache publishes each cubin atomically
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        built = dict(zip(jobs, pool.map(lambda job: compile_kernels(*job), jobs)))
    for fname, names in sorted(files.items()):
        for arch in args.arch:
            _, resources = built[fname, arch]
            found = {r.name for r in resources}
            missing = [n for n in names if n not in found]
            if missing:
                print(f"error: {fname} for {arch} does not define {missing}")
                return 1
            for r in sorted(resources, key=lambda r: r.name):
                if r.name not in names:
                    continue
                spills += r.spill_stores + r.spill_loads
                print(f"{r.name:32} {r.arch:7} {r.registers:5d} {r.spill_stores:9d} {r.spill_loads:9d} {r.stack_bytes:6d} {r.shared_bytes:6d}")
    if args.fail_on_spill and spills:
        print(f"error: {spills} bytes of register spills")
        return 1
    return 0




if __name__ == "__main__":
    sys.exit(main())

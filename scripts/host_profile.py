"""Where the host time of one ubnext call goes (issue 38's host bound), on a real GPU: cProfile of
``comm.all_reduce`` and ``comm.all_reduce_add_rmsnorm`` at world 1 through UBNEXT_WORLD1_KERNELS (the
kernel paths, the real driver), 8 x 4096 bf16, the GPU kept busy by a queued ``torch.cuda._sleep`` so
that the host never waits on it. Opt-in, outside the test suite:

    python scripts/host_profile.py [--rehearse] [--calls 2000] [--out DIR]

``--rehearse`` runs the same Python on the CPU emulator (no GPU), so that the device run fails only
on what a GPU alone can show. Writes host_profile.txt (the profiles, the busiest functions first)."""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.gpu_check.step_timings import SHAPE, _inputs, _world1_communicator  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default=os.environ.get("OUT", "build/host_profile"))
    args = parser.parse_args()
    import torch

    comm = _world1_communicator(args.rehearse)
    device = comm.device
    x, residual, weight = _inputs(SHAPE, device)
    out = torch.empty_like(x)
    calls = {
        "comm.all_reduce": lambda: comm.all_reduce(x, out=out),
        "comm.all_reduce_add_rmsnorm": lambda: comm.all_reduce_add_rmsnorm(x, residual, weight, 1e-6),
    }
    report = io.StringIO()
    with torch.inference_mode():
        for name, call in calls.items():
            for _ in range(50):  # warm: the plan, the launch, the caches
                call()
            comm.synchronize()
            if device.type == "cuda":
                torch.cuda._sleep(int(2e9))  # about a second of GPU work queued ahead of the calls
            profile = cProfile.Profile()
            start = time.perf_counter()
            profile.enable()
            for _ in range(args.calls):
                call()
            profile.disable()
            took = time.perf_counter() - start
            comm.synchronize()
            report.write(
                f"===== {name}: {args.calls} calls, {1e6 * took / args.calls:.2f} us per call under the "
                f"profiler, device {torch.cuda.get_device_name() if device.type == 'cuda' else 'emulator'}\n"
            )
            stats = pstats.Stats(profile, stream=report)
            stats.sort_stats("tottime").print_stats(30)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "host_profile.txt").write_text(report.getvalue())
    print(report.getvalue()[:6000])
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

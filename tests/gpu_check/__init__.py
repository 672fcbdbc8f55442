"""The one-GPU check (issue 36): ``scripts/gpu_check.sh`` on one borrowed H100 or H200, and its rehearsal
on the CPU (``--rehearse``: the emulator and the stub driver). ``python -m tests.gpu_check --help``."""

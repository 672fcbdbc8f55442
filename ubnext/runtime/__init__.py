"""The process's runtime: the GPU probe and cuda-python helpers (_cuda), the emulator binding (_emu),
where the kernel sources are (_sources), the build lock and progress (_filelock, _build_progress), the
process lifecycle (_lifecycle: torch.distributed bootstrap, the communicator registry, exit) and the
watchdog thread (_watchdog). The kernel registry and cache is ``ubnext.kernels``, the same layer.
Imports only ``ubnext.envs``, ``ubnext.errors`` and ``ubnext.kernels`` (docs/ARCHITECTURE.md)."""

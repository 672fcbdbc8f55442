"""The mpi tier's order: its longest jobs first, so that with two jobs at a time (pytest-xdist,
scripts/test.sh) no long job starts last and runs alone while the other core idles."""

# the longest jobs on the 2-core runner, longest first (the mpi tier's --durations, docs/PERF.md);
# the others take under 15 s
LONGEST_FIRST = (
    "test_kernels_on_emulator[np2]",
    "test_kernels_on_emulator[np4]",
    "test_kernels_on_emulator[np3-unicast]",
    "test_torch_fallback[4]",
    "test_kernels_on_emulator[np4-chaos]",
    "test_kernels_on_emulator[np3-unicast-chaos]",
    "test_torch_fallback[2]",
    "test_llama_tp_example_compiled_with_fusion[np4-model]",
    "test_wheel_installed_outside_the_checkout",
    "test_broken_protocol_is_caught[no_abort_check]",
    "test_llama_tp_example_under_torchrun",
    "test_kernels_on_emulator[np2-chaos]",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.name, len(rank)))  # stable: the rest keep their order

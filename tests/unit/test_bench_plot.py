"""`python -m ubnext.bench --plot`: the table's rows become a PNG with one line per mode and path."""

from __future__ import annotations

import pytest

from ubnext.tuning._plot import plot_rows


def test_plot_draws_one_line_per_mode_and_path(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    rows = [
        ("cpu-emulator", "lamport", 8192, "20", 5000.0, 0.002, 0.01, True),
        ("cpu-emulator", "lamport", 65536, "20", 28000.0, 0.003, 0.02, True),
        ("cpu-emulator", "nvls_twoshot", 1 << 20, "4", 90000.0, 0.02, 0.03, True),
        ("torch.distributed", "torch", 8192, "20", 8000.0, 0.002, 0.01, True),
        ("torch.distributed", "error", 65536, "timed out", None, None, None, None),
    ]  # not drawn
    drawn = []
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda self, x, y, **kw: drawn.append((kw["label"], list(x), list(y))) or real_plot(self, x, y, **kw),
    )
    out = tmp_path / "bench.png"
    plot_rows(rows, str(out), "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    times = {label: (x, y) for label, x, y in drawn[0::2]}
    assert times == {
        "cpu-emulator lamport": ([8192, 65536], [5000.0, 28000.0]),
        "cpu-emulator nvls_twoshot": ([1 << 20], [90000.0]),
        "torch.distributed torch": ([8192], [8000.0]),
    }
    assert [y for _, _, y in drawn[1::2]][0] == [0.002, 0.003]  # busbw beside each time line


def test_plot_without_timed_rows_says_so(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit, match="no timed rows"):
        plot_rows([("gpu", "error", 8192, "x", None, None, None, None)], str(tmp_path / "x.png"), "t")


def test_ratio_lines_compare_the_fastest_ubnext_path_with_each_peer():
    """`--ratios` (gpu_check.sh writes it into docs/PERF.md): per size, the fastest ubnext kernel path
    within its bound against torch.distributed and torch's symmetric-memory op."""
    from ubnext.bench import ratio_lines

    rows = [
        ("gpu:H100", "lamport", 8192, "200", 4.0, 1.0, 0.0, True),
        ("gpu:H100 (forced twoshot)", "twoshot", 8192, "200", 6.0, 1.0, 0.0, True),
        ("gpu:H100 (forced nvls_twoshot)", "nvls_twoshot", 8192, "200", 3.0, 1.0, 1.0, False),  # over its bound
        ("gpu:H100 (forced torch_symm)", "torch_symm", 8192, "200", 5.0, 1.0, 0.0, True),
        ("torch.distributed", "torch", 8192, "200", 16.0, 1.0, 0.0, True),
        ("gpu:H100", "twoshot", 1 << 20, "200", 20.0, 1.0, 0.0, True),
    ]
    lines = ratio_lines(rows)
    assert lines[2] == "| 8192 | lamport | 4.0 | 16.0 | 0.25 | 5.0 | 0.80 |"
    assert lines[3] == "| 1048576 | twoshot | 20.0 | - | - | - | - |"

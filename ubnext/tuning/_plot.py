"""``python -m ubnext.bench --plot FILE.png``: the timed table drawn as two panels. matplotlib is an
optional dependency (``ubnext[plot]``), imported only here and only when a plot is asked for."""

from __future__ import annotations


def plot_rows(rows: list, filename: str, title: str) -> None:
    """Draw the table's rows: us per call and bus bandwidth against message size, one line per
    (mode, path). A path that ran only at some sizes is drawn at those sizes."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib ({exc}): pip install 'ubnext[plot]'") from None
    matplotlib.use("Agg")  # a file, never a window: ranks run headless
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float, float]]] = {}
    for label, path, nbytes, _, us, busbw, _, _ in rows:
        if us is not None:
            lines.setdefault(f"{label} {path}", []).append((nbytes, us, busbw))
    if not lines:
        raise SystemExit("--plot: no timed rows to draw")
    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in sorted(lines.items()):
        points.sort()
        sizes = [p[0] for p in points]
        ax_time.plot(sizes, [p[1] for p in points], marker="o", label=name)
        ax_bw.plot(sizes, [p[2] for p in points], marker="o", label=name)
    for ax, what in ((ax_time, "us per call (slowest rank's mean)"), (ax_bw, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_bw.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(filename, dpi=110)
    plt.close(fig)

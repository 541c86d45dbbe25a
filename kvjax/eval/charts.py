"""What every chart of the report shares (matplotlib, Agg): the pyplot handle, atomic saving, and the log-scaled
prefix-length axis. Each evaluation draws its own charts (kvjax.eval.suite.*, `Chart`), from metrics.json alone, in
the forms of the method's own charts; colours and labels of the arms come from kvjax.eval.arms.TABLE."""

from __future__ import annotations

import os


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot
    return pyplot


def save(fig, path: str) -> str:
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt().close(fig)
    os.replace(tmp, path)
    return path


def lengths(section: dict) -> list[int]:
    """The lengths a per-length metrics section (throughput, retrieval) is keyed by, ascending."""
    return sorted(int(k) for k in section)


def length_axis(ax, xs) -> None:
    """Log-scaled x axis labelled only at the measured lengths (256, 1K, ...)."""
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
    ax.minorticks_off()

"""The report's charts (matplotlib, Agg), drawn from metrics.json alone, in the seed's forms:
throughput and TTFT vs prefix length, active compute vs prefix length with the saving shaded, tensor distances
(NRMSE and cosine panels), the KL slope chart (one line per frozen window), multiple-choice bars with 95% intervals,
retrieval accuracy vs length."""

from __future__ import annotations

import os

import numpy as np

COLORS = {"target": "#4C72B0", "source": "#DD8452", "mapped": "#55A868", "residual": "#55A868", "ridge": "#8172B3",
          "direct": "#937860", "raw": "#8C8C8C"}
LABELS = {"target": "native target", "source": "native source", "mapped": "mapped (source prefill -> target decode)",
          "residual": "ridge + residual", "ridge": "ridge", "direct": "direct injection", "raw": "unmapped source"}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> str:
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    _plt().close(fig)
    os.replace(tmp, path)
    return path


def _lengths(section: dict) -> list[int]:
    return sorted(int(k) for k in section)


def _length_axis(ax, xs) -> None:
    """Log-scaled x axis labelled only at the measured lengths (256, 1K, ...)."""
    ax.set_xscale("log")
    ax.set_xticks(xs, [f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
    ax.minorticks_off()


def throughput_chart(metrics: dict, path: str, names: dict) -> str:
    plt = _plt()
    tp = metrics["throughput"]
    xs = _lengths(tp)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in ("mapped", "target", "source"):
        ys = [tp[str(x)]["decode_tps"][arm] for x in xs]
        ax.plot(xs, ys, "o-", color=COLORS[arm], label=names.get(arm, LABELS[arm]), lw=2 if arm == "mapped" else 1.5)
    new = tp[str(xs[0])]["new_tokens"]
    ax.set(xlabel="prefix length (tokens)", ylabel="decode tokens / s (median)",
           title=f"Decode throughput after the first token ({new} new tokens)")
    _length_axis(ax, xs)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def ttft_chart(metrics: dict, path: str, names: dict) -> str:
    plt = _plt()
    tp = metrics["throughput"]
    xs = _lengths(tp)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in ("mapped", "target", "source"):
        ax.plot(xs, [tp[str(x)]["ttft_s"][arm] for x in xs], "o-", color=COLORS[arm], label=names.get(arm, LABELS[arm]))
    ax.set(yscale="log", xlabel="prefix length (tokens)", ylabel="seconds (median)",
           title="Time to first token (prefill [+ map] + first token)")
    _length_axis(ax, xs)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def active_compute_chart(metrics: dict, path: str, names: dict) -> str:
    plt = _plt()
    tp = metrics["throughput"]
    xs = _lengths(tp)
    mapped = np.array([tp[str(x)]["active_s"]["mapped"] for x in xs])
    source = np.array([tp[str(x)]["active_s"]["source"] for x in xs])
    target = np.array([tp[str(x)]["active_s"]["target"] for x in xs])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, source, "o-", color=COLORS["source"], label=names.get("source", LABELS["source"]))
    ax.plot(xs, mapped, "o-", color=COLORS["mapped"], lw=2, label=names.get("mapped", LABELS["mapped"]))
    ax.plot(xs, target, "o--", color=COLORS["target"], alpha=0.7, label=names.get("target", LABELS["target"]))
    ax.fill_between(xs, mapped, source, where=mapped <= source, color=COLORS["mapped"], alpha=0.15,
                    interpolate=True, label="active-compute saving vs native source")
    for x, m, s in zip(xs, mapped, source):
        ax.annotate(f"{100 * (1 - m / s):.0f}% less" if s > 0 else "", (x, (m + s) / 2), ha="center", fontsize=8,
                    color=COLORS["mapped"])
    ax.set(xlabel="prefix length (tokens)", ylabel="active device-seconds per request",
           title="Active compute: source prefill + target decode once, map x2")
    _length_axis(ax, xs)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def distances_chart(metrics: dict, path: str) -> str:
    plt = _plt()
    d = metrics["distances"]
    arms = [a for a in ("raw", "ridge", "residual") if a in d["key_cos"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    width = 0.8 / len(arms)
    for ax, metric, title in ((axes[0], "nrmse", "NRMSE (lower is better)"), (axes[1], "cos", "cosine (higher is better)")):
        for i, arm in enumerate(arms):
            vals = [d[f"key_{metric}"][arm], d[f"value_{metric}"][arm]]
            bars = ax.bar(np.arange(2) + (i - (len(arms) - 1) / 2) * width, vals, width, color=COLORS[arm],
                          label=LABELS[arm])
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_xticks(range(2), ["keys (pre-RoPE)", "values"])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_ylim(min(0, min(d["key_cos"][a] for a in arms) - 0.05), 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Mapped vs native target cache ({d['windows']} held-out windows, {d['tokens']} tokens)")
    return _save(fig, path)


def kl_slope_chart(metrics: dict, path: str) -> str:
    plt = _plt()
    kl = metrics["kl"]
    ridge, residual = np.array(kl["per_window"]["ridge"]), np.array(kl["per_window"]["residual"])
    fig, ax = plt.subplots(figsize=(5, 5))
    for r, s in zip(ridge, residual):
        ax.plot([0, 1], [r, s], "-", color=COLORS["mapped"] if s < r else "#C44E52", alpha=0.35, lw=1)
    ax.plot([0, 1], [ridge.mean(), residual.mean()], "o-", color="black", lw=2.5, label="mean")
    lo, hi = kl["residual_minus_ridge_ci95"]
    ax.set_xticks([0, 1], ["ridge", "ridge + residual"])
    ax.set_xlim(-0.3, 1.3)
    ax.set(ylabel="source-teacher KL (nats / token)",
           title=f"{100 * kl['reduction']:.1f}% lower KL; paired 95% CI of the\ndifference [{lo:.4f}, {hi:.4f}]"
                 f" ({len(ridge)} frozen windows)")
    down = int(np.sum(residual < ridge))
    ax.text(0.5, 0.02, f"{down} of {len(ridge)} windows move down", transform=ax.transAxes, ha="center", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def mc_chart(metrics: dict, path: str) -> str:
    plt = _plt()
    mc = metrics["mc"]
    sets = list(mc)
    arms = [a for a in ("target", "direct", "ridge", "residual", "source") if all(a in mc[s]["acc"] for s in sets)]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(sets) + 2), 4.2))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        x = np.arange(len(sets)) + (i - (len(arms) - 1) / 2) * width
        acc = np.array([mc[s]["acc"][arm] for s in sets])
        lo = np.array([mc[s]["acc_ci95"][arm][0] for s in sets])
        hi = np.array([mc[s]["acc_ci95"][arm][1] for s in sets])
        bars = ax.bar(x, 100 * acc, width, yerr=100 * np.stack([acc - lo, hi - acc]), capsize=3, color=COLORS[arm],
                      label=LABELS[arm])
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=6)
    ax.set_xticks(range(len(sets)), [f"{s} ({mc[s]['items']} items)" for s in sets])
    ax.set(ylabel="accuracy (%), 95% bootstrap interval", ylim=(0, 105),
           title="Multiple choice: every arm on the same items")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(len(arms), 3), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return _save(fig, path)


def retrieval_chart(metrics: dict, path: str) -> str:
    plt = _plt()
    rt = metrics["retrieval"]
    xs = _lengths(rt)
    arms = [a for a in ("target", "direct", "ridge", "residual", "source") if a in rt[str(xs[0])]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in arms:
        ax.plot(xs, [100 * rt[str(x)][arm] for x in xs], "o-", color=COLORS[arm], label=LABELS[arm])
    ax.set(xlabel="prompt length (tokens)", ylabel="exact match (%)", ylim=(-3, 103),
           title=f"Needle retrieval ({rt[str(xs[0])]['items']} items per length)")
    _length_axis(ax, xs)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def draw_all(metrics: dict, out_dir: str, names: dict | None = None) -> dict[str, str]:
    """Every chart the metrics allow; returns {chart name: file name in out_dir}."""
    names = names or {}
    charts = {}
    jobs = [("throughput", "throughput", lambda p: throughput_chart(metrics, p, names)),
            ("ttft", "throughput", lambda p: ttft_chart(metrics, p, names)),
            ("active_compute", "throughput", lambda p: active_compute_chart(metrics, p, names)),
            ("distances", "distances", lambda p: distances_chart(metrics, p)),
            ("kl_slope", "kl", lambda p: kl_slope_chart(metrics, p)),
            ("mc", "mc", lambda p: mc_chart(metrics, p)),
            ("retrieval", "retrieval", lambda p: retrieval_chart(metrics, p))]
    for name, section, draw in jobs:
        if metrics.get(section) and (section != "kl" or "residual" in metrics["kl"]):
            draw(os.path.join(out_dir, f"{name}.png"))
            charts[name] = f"{name}.png"
    return charts

"""The speculative cost benchmark's report (launch.bench.spec_cost): its markdown table and its two charts, from the
result dict spec_cost writes (so `spec_cost --replot` redraws a saved run without measuring)."""

from __future__ import annotations

import numpy as np


POSITIONS = (1, 2, 3, 4, 6, 8, 12, 16)  # the draft positions the acceptance table shows


def table(result: dict) -> str:
    lines = []
    for set_name, res in result["sets"].items():
        timed_ = res["costs"] is not None
        lines.append(f"\n{set_name}: {next(iter(res['drafters'].values()))['prompts']} prompts"
                     + (f", plain step {res['costs']['step_ms']:.2f} ms" if timed_ else ""))
        head = "| drafter | identical | tau |"
        if timed_:
            head += (" c_verify (mean) | c_draft | predicted | measured | error | error, parts alone |"
                     " error, widths replayed |")
        lines += [head, "|---" * (head.count("|") - 1) + "|"]
        for name, r in res["drafters"].items():
            line = f"| {name} | {r['identical']}/{r['prompts']} | {r['tau']:.2f} |"
            if timed_:
                line += (f" {r['c_verify_mean']:.2f} | {r['c_draft_per_round']:.2f} | {r['predicted_speedup']:.2f}x |"
                         f" {r['measured_speedup']:.2f}x | {100 * r['error']:+.1f}% | {100 * r['error_parts']:+.1f}% |"
                         f" {100 * r['error_replay']:+.1f}% |")
            lines.append(line)
        shown = [k for k in POSITIONS if k <= max(len(r["accept_given_previous"]) for r in res["drafters"].values())]
        lines += ["draft position k accepted, given k - 1 were:", "| drafter |" + "".join(f" {k} |" for k in shown),
                  "|---" * (len(shown) + 1) + "|"]
        for name, r in res["drafters"].items():
            p = r["accept_given_previous"]
            lines.append(f"| {name} |" + "".join(
                " - |" if k > len(p) or p[k - 1] is None else f" {100 * p[k - 1]:.0f}% |" for k in shown))
        if timed_:
            lines.append("verify scale per draft length (reference round now / parts; median, range over prompts): "
                         + " ".join(f"{b}:{np.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]"
                                    for b, v in res["costs"]["verify_scale"].items() if v))
            if res["costs"].get("draft_scale"):
                lines.append("draft scale per part (its Ignored round now / parts; median, range over prompts): "
                             + " ".join(f"{k}:{np.median(v):.3f} [{min(v):.3f}, {max(v):.3f}]"
                                        for k, v in res["costs"]["draft_scale"].items() if v))
            lines.append("c_draft per part (raw paired difference): " + " ".join(
                f"{k}:{v:.2f} ({res['costs']['c_draft_raw'][k]:+.2f})" for k, v in res["costs"]["c_draft"].items()))
            for path, per_g in res["costs"]["c_verify"].items():
                for g, c in per_g.items():
                    lines.append(f"c_verify(t), {path} path, draft length {g}: "
                                 + " ".join(f"{t}:{v:.2f}" for t, v in c.items()))
    return "\n".join(lines)


def _marker(name: str) -> str:
    """A drafter's marker in the charts, by its kind (x: a small model or a transfer)."""
    return {"lookup": "^", "block": "s", "combined": "o"}.get(name.split("-")[0], "x")


def chart(result: dict, path: str) -> str:
    """Left: c_verify(t) per set (the variable path at the largest draft length; the fixed path's points); right:
    predicted (widths replayed) against measured speed-up per drafter and set, with the +-10% band."""
    from kvjax.eval.charts import plt, save
    fig, (a, b) = plt().subplots(1, 2, figsize=(11, 4.2))
    lo, hi = 1e9, 0.0
    for i, (set_name, res) in enumerate(result["sets"].items()):
        costs = res["costs"]
        if costs is None:
            continue
        color = f"C{i}"
        var = costs["c_verify"]["variable"]
        if var:
            g = max(var, key=int)
            a.plot([int(t) for t in var[g]], list(var[g].values()), "-o", ms=3, color=color,
                   label=f"{set_name}: variable path (b = {g})")
        fixed = [(int(t), v) for per_t in costs["c_verify"]["fixed"].values() for t, v in per_t.items()]
        a.plot([t for t, _ in fixed], [v for _, v in fixed], "s", color=color, mfc="none", ms=7,
               label=f"{set_name}: fixed path at b + 1")
        for name, r in res["drafters"].items():
            marker = _marker(name)
            pred = r.get("predicted_speedup_replay", r["predicted_speedup"])  # older JSON: no replay
            b.plot(pred, r["measured_speedup"], marker, color=color, ms=6)
            b.annotate(name, (pred, r["measured_speedup"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
            lo = min(lo, pred, r["measured_speedup"])
            hi = max(hi, pred, r["measured_speedup"])
    a.axhline(1.0, color="grey", lw=0.8, ls=":")
    a.set_xlabel("tokens verified in one forward (t)")
    a.set_ylabel("c_verify(t): a round, in plain decode steps")
    a.set_title("What a verify round costs (this machine)")
    a.legend(fontsize=7)
    if hi > 0:
        xs = [lo * 0.9, hi * 1.1]
        b.plot(xs, xs, color="grey", lw=0.8)
        b.fill_between(xs, [x * 0.9 for x in xs], [x * 1.1 for x in xs], color="grey", alpha=0.15, label="+-10%")
        from matplotlib.ticker import FormatStrFormatter
        b.set_xscale("log")
        b.set_yscale("log")
        for axis in (b.xaxis, b.yaxis):
            axis.set_major_formatter(FormatStrFormatter("%.2gx"))
            axis.set_minor_formatter(FormatStrFormatter("%.2gx"))
        b.legend(fontsize=7)
    b.set_xlabel("predicted speed-up (tau, widths replayed, parts' costs)")
    b.set_ylabel("measured speed-up (decode phase)")
    b.set_title("The cost model against the clock")
    return save(fig, path)


def accept_chart(result: dict, path: str) -> str:
    """Per set, each drafter's share of rounds accepting draft position k among those that accepted k - 1."""
    from kvjax.eval.charts import plt, save
    sets = result["sets"]
    fig, axes = plt().subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    for ax, (set_name, res) in zip(axes[0], sets.items()):
        for i, (name, r) in enumerate(res["drafters"].items()):
            p = r["accept_given_previous"]
            ks = [k for k in range(1, len(p) + 1) if p[k - 1] is not None]
            ax.plot(ks, [100 * p[k - 1] for k in ks], "-" + _marker(name), ms=4, color=f"C{i}",
                    label=f"{name} (tau {r['tau']:.2f})")
        ax.set_ylim(0, 100)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("rounds accepting k, of those accepting k - 1 (%)")
        ax.set_title(f"{set_name}: where acceptance dies")
        ax.legend(fontsize=7)
    return save(fig, path)

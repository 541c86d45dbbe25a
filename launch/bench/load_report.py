"""What a load run measured (launch.bench.load): each level's summary, the conversation's per-turn TTFT, the decoders'
inter-token gaps around a long prompt's arrival, and the report (report.md table, load.png chart)."""

from __future__ import annotations

import os

import numpy as np


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def summarize(records, wall, concurrency, hung_clients, metrics_text, health, samples) -> dict:
    ok = [r for r in records if not r["error"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    e2e = [r["e2e"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / (len(r["ids"]) - 1) for r in ok if r["ttft"] is not None and len(r["ids"]) > 1]
    tokens = sum(len(r["ids"]) for r in ok)
    active = next((float(line.split()[1]) for line in metrics_text.splitlines()
                   if line.startswith("kvjax_active_slots ")), float("nan"))
    return {"concurrency": concurrency, "requests": len(records), "ok": len(ok),
            "errors": len(records) - len(ok), "error_messages": sorted({r["error"] for r in records if r["error"]})[:5],
            "hung": sum(r["hung"] for r in records) + hung_clients,
            "mismatches": sum(1 for r in ok if not r["match"]), "retries_429": sum(r["retries"] for r in records),
            "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "active_slots_after": active,
            "health_after": health.get("status"), "rss_mb": [(round(t, 1), round(m, 1)) for t, m in samples]}


def turn_summary(records) -> dict:
    """TTFT p50/p99 of turn 1 and of turns >= 2, and per turn ({turn: {n, ttft_p50, ttft_p99, mismatches}})."""
    ok = [r for r in records if not r["error"] and r["ttft"] is not None]
    first = [r["ttft"] for r in ok if r["turn"] == 1]
    later = [r["ttft"] for r in ok if r["turn"] >= 2]
    per = {}
    for t in sorted({r["turn"] for r in records}):
        xs = [r["ttft"] for r in ok if r["turn"] == t]
        per[str(t)] = {"n": len(xs), "ttft_p50": pct(xs, 50), "ttft_p99": pct(xs, 99),
                       "mismatches": sum(1 for r in ok if r["turn"] == t and not r["match"])}
    return {"ttft_turn1_p50": pct(first, 50), "ttft_turn1_p99": pct(first, 99), "ttft_later_p50": pct(later, 50),
            "ttft_later_p99": pct(later, 99), "per_turn": per}


def token_gaps(times: list[float]) -> list[tuple[float, float]]:
    """(start, end) of each gap between a request's consecutive token arrivals."""
    return list(zip(times[:-1], times[1:]))


def arrival_summary(decoders: list[dict], long: dict) -> dict:
    """The decoders' inter-token gaps while the long prompt waited for its first token (gaps ending after its
    submission and starting before its first token: "during") and in an equal window before its submission (gaps
    ending in it: "before"); the long request's TTFT; the decoders still streaming at its first token."""
    t_sub = long["t0"]
    t_first = long["times"][0] if long["times"] else float("nan")
    span = t_first - t_sub
    gaps = [g for r in decoders for g in token_gaps(r["times"])]
    during = [e - s for s, e in gaps if e > t_sub and s < t_first]
    before = [e - s for s, e in gaps if t_sub - span < e <= t_sub]
    p99_before, p99_during = pct(before, 99), pct(during, 99)
    slow = slow_steps([(s, e) for s, e in gaps if e > t_sub and s < t_first], len(decoders), t_sub)
    return {"long_ttft": span,
            "long_match": long["match"], "itl_before_p50": pct(before, 50), "itl_before_p99": p99_before,
            "itl_during_p50": pct(during, 50), "itl_during_p99": p99_during,
            "itl_p99_ratio": p99_during / p99_before if before and during else float("nan"),
            "gaps_before": len(before), "gaps_during": len(during),
            "decoders_streaming_at_long_first_token": sum(1 for r in decoders if r["times"] and
                                                          r["times"][0] <= t_sub and r["times"][-1] >= t_first),
            "slowest_steps_during": slow,
            "decoder_times": [[round(t - t_sub, 4) for t in r["times"]] for r in decoders]}


def slow_steps(gaps: list[tuple[float, float]], decoders: int, t0: float, top: int = 5, tol: float = 0.005):
    """The server's slowest steps among `gaps` (start, end): a step delays every decoder at once, so its gaps end
    together; gaps ending within `tol` s of each other are one step, counted when at least half the decoders waited
    in it. Its p99 comes from a few such steps (one step of 32 decoders is 32 gaps), so this says which: [(end - t0
    in s, decoders, median gap in s)], slowest first."""
    out, group = [], []
    for start, end in sorted(gaps, key=lambda g: g[1]) + [(0.0, float("inf"))]:
        if group and end - group[-1][1] > tol:
            if 2 * len(group) >= decoders:
                lengths = sorted(e - s for s, e in group)
                out.append((round(group[0][1] - t0, 3), len(group), round(lengths[len(lengths) // 2], 4)))
            group = []
        group.append((start, end))
    return sorted(out, key=lambda x: -x[2])[:top]


# ---- report ----------------------------------------------------------------------------------------------------

def level_table(results: dict, conversation: bool) -> list[str]:
    head = ("| topology | clients | requests | ok | errors | hung | != offline | 429 retries | tokens/s | TTFT p50 (s) "
            "| TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) | TPOT p50 (ms) | e2e p50 (s) | e2e p99 (s) |")
    cols = 16
    if conversation:
        head += " TTFT p99 turn 1 (s) | TTFT p99 turns >= 2 (s) | prefix hit rate | reused / looked-up tokens |"
        cols += 4
    rows = [head, "|" + "---|" * cols]
    for topo, levels_ in results.items():
        for r in levels_:
            row = (f"| {topo} | {r['concurrency']} | {r['requests']} | {r['ok']} | {r['errors']} | {r['hung']} | "
                   f"{r['mismatches']} | {r['retries_429']} | {r['tokens_per_s']:.0f} | {r['ttft_p50']:.3f} | "
                   f"{r['ttft_p99']:.3f} | {1e3 * r['itl_p50']:.1f} | {1e3 * r['itl_p99']:.1f} | "
                   f"{1e3 * r.get('tpot_p50', float('nan')):.1f} | {r['e2e_p50']:.2f} | {r['e2e_p99']:.2f} |")
            if conversation:
                row += (f" {r['ttft_turn1_p99']:.3f} | {r['ttft_later_p99']:.3f} | {r['prefix_hit_rate']:.2f} | "
                        f"{r['prefix_reused_frac']:.2f} |")
            rows.append(row)
    return rows


def arrival_table(results: dict) -> list[str]:
    rows = ["| arm | decoders | != offline | errors | hung | long TTFT (s) | ITL p50 / p99 before (ms) "
            "| ITL p50 / p99 during (ms) | p99 during / before | decoders streaming throughout |", "|" + "---|" * 10]
    for arm, (r,) in results.items():
        rows.append(f"| {arm} | {r['concurrency'] - 1} | {r['mismatches']} | {r['errors']} | {r['hung']} | "
                    f"{r['long_ttft']:.3f} | {1e3 * r['itl_before_p50']:.1f} / {1e3 * r['itl_before_p99']:.1f} | "
                    f"{1e3 * r['itl_during_p50']:.1f} / {1e3 * r['itl_during_p99']:.1f} | "
                    f"{r['itl_p99_ratio']:.2f} | {r['decoders_streaming_at_long_first_token']} |")
    rows.append("")
    for arm, (r,) in results.items():  # where the p99 during comes from
        steps = "; ".join(f"+{t:.2f} s: {1e3 * gap:.1f} ms ({n} decoders)" for t, n, gap in
                          r.get("slowest_steps_during", []))
        rows.append(f"- {arm}, slowest steps while the long prompt waited (time after it was sent): {steps or 'none'}")
    return rows


def compare_table(results: dict) -> list[str]:
    """Interleaved repeats (--repeats): per arm and level the medians over the repeats, and tokens/s as a ratio to
    the first arm's in the same repeat (median of the ratios), with what drafting did (kvjax.serve's /metrics)."""
    arms = list(results)
    base = arms[0]
    rows = [f"Medians over the repeats; x {base}: tokens/s over {base}'s in the same repeat, median of the ratios.", "",
            "| arm | clients | repeats | != offline (all) | tokens/s | x " + base + " (min-max) | TTFT p50 (s) "
            "| ITL p50 (ms) | TPOT p50 (ms) | e2e p50 (s) | drafting steps / plain | acceptance length per drafter |",
            "|" + "---|" * 12]
    for arm in arms:
        for c in sorted({r["concurrency"] for r in results[arm]}):
            mine = {r["repeat"]: r for r in results[arm] if r["concurrency"] == c}
            theirs = {r["repeat"]: r for r in results[base] if r["concurrency"] == c}
            ratios = [mine[k]["tokens_per_s"] / theirs[k]["tokens_per_s"] for k in mine if k in theirs
                      and theirs[k]["tokens_per_s"]]
            med = lambda key: float(np.median([r[key] for r in mine.values()]))  # noqa: E731
            steps = " / ".join(f"{sum(r.get(k, 0.0) for r in mine.values()):.0f}" for k in ("draft_steps",
                                                                                              "plain_steps"))
            per: dict = {}
            for r in mine.values():
                for d, v in r.get("drafters", {}).items():
                    t = per.setdefault(d, [0.0, 0.0])
                    t[0], t[1] = t[0] + v["acceptance_length"] * v["rounds"], t[1] + v["rounds"]
            tau = ", ".join(f"{d} {t / n:.2f}" for d, (t, n) in per.items() if n) or "-"
            rows.append(f"| {arm} | {c} | {len(mine)} | {sum(r['mismatches'] + r['errors'] for r in mine.values())} | "
                        f"{med('tokens_per_s'):.0f} | {np.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f}) | "
                        f"{med('ttft_p50'):.3f} | {1e3 * med('itl_p50'):.1f} | {1e3 * med('tpot_p50'):.1f} | "
                        f"{med('e2e_p50'):.2f} | {steps} | {tau} |")
    return rows


def report(results: dict, out_dir: str, command: str, workload: str = "independent") -> None:
    rows = arrival_table(results) if workload == "arrival" else level_table(results, workload == "conversation")
    if workload != "arrival" and any("repeat" in r for levels_ in results.values() for r in levels_):
        rows = compare_table(results) + ["", "Every level and repeat:", ""] + rows
    text = f"# kvjax.serve under load ({workload})\n\n`{command}`\n\n" + "\n".join(rows) + "\n"
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write(text)
    print(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig = arrival_chart(plt, results) if workload == "arrival" else level_chart(plt, results, workload)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "load.png"), dpi=100)
    except Exception as e:  # noqa: BLE001 - the table is the result; a chart failure must not lose it
        print(f"chart not drawn: {e}")


def level_chart(plt, results: dict, workload: str):
    """tokens/s and TTFT p99 per arm against clients; a conversation adds TTFT p99 per turn at the largest level."""
    conversation = workload == "conversation"
    fig, axes = plt.subplots(1, 3 if conversation else 2, figsize=(15 if conversation else 10, 4))
    for topo, levels_ in results.items():  # medians over a level's repeats
        c = sorted({r["concurrency"] for r in levels_})
        med = lambda key, k: float(np.median([r[key] for r in levels_ if r["concurrency"] == k]))  # noqa: E731
        axes[0].plot(c, [med("tokens_per_s", k) for k in c], "o-", label=topo)
        axes[1].plot(c, [med("ttft_p99", k) for k in c], "o-", label=topo)
    for ax, title in zip(axes, ("aggregate tokens/s", "TTFT p99 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    axes[1].set_yscale("log")
    if conversation:
        for topo, levels_ in results.items():
            per = levels_[-1]["per_turn"]
            axes[2].plot([int(t) for t in per], [v["ttft_p99"] for v in per.values()], "o-",
                         label=f"{topo} ({levels_[-1]['concurrency']} clients)")
        axes[2].set_xticks(range(1, max(len(v[-1]["per_turn"]) for v in results.values()) + 1))
        axes[2].set_xlabel("turn")
        axes[2].set_title("TTFT p99 per turn (s)")
        axes[2].legend()
    return fig


def arrival_chart(plt, results: dict):
    """Per arm: the decoders' ITL p99 before / during the long prompt's prefill, and the long prompt's TTFT."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    arms = list(results)
    x = np.arange(len(arms))
    axes[0].bar(x - 0.2, [1e3 * results[k][0]["itl_before_p99"] for k in arms], 0.4, label="before")
    axes[0].bar(x + 0.2, [1e3 * results[k][0]["itl_during_p99"] for k in arms], 0.4, label="during")
    axes[0].set_title("decoders' ITL p99 (ms)")
    axes[0].legend()
    axes[1].bar(x, [results[k][0]["long_ttft"] for k in arms], 0.5)
    axes[1].set_title("long prompt TTFT (s)")
    for ax in axes:
        ax.set_xticks(x, arms)
    return fig

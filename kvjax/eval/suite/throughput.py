"""Evaluation `throughput`: decode tokens/s, time to first token and active compute vs prefix length for the native
target, the native source and the split path with the final map ("mapped"), timed the way the method's report does
(kvjax.eval.decode_throughput). metrics.json `throughput`."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.report import length_label, pct, quality_cost, quality_tag
from kvjax.eval.suite.evaluation import Chart, Evaluation

log = logging.getLogger(__name__)
MAPPED = "mapped"  # the split path's key in the record and metrics (source prefill -> final map -> target decode)
MAPPED_COLOUR = "#55A868"
DEVICES = {"target": 1, "source": 1, MAPPED: 2}  # devices a path holds for a request (reserved seconds)


@dataclasses.dataclass(frozen=True)
class ThroughputEval:
    enabled: bool = True
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096)  # prefix lengths (tokens of held-out text)
    new_tokens: int = 64  # fixed generation length; decode tok/s counts the tokens after the first
    repeats: int = 5  # timed rounds after a warm-up round (arms interleaved); medians are reported
    decode_repeats: int = 5  # decode phase re-runs per round from the same cache (its median): short decodes are noisy
    # target and mapped decode tok/s from this many alternating timings of the two decodes (0: from the rounds)
    paired_decode: int = 15
    batch_size: int = 1  # requests decoded together


def run(ec: ThroughputEval, ctx) -> dict:
    from kvjax.eval.decode_throughput import measure_throughput
    rows = measure_throughput(ctx.source, ctx.target, ctx.map(ctx.final), ctx.heldout.reshape(-1), ec.lengths,
                              new_tokens=ec.new_tokens, repeats=ec.repeats, batch_size=ec.batch_size,
                              decode_repeats=ec.decode_repeats, paired_decode=ec.paired_decode)
    for length, r in rows.items():
        log.info("throughput %5d: decode tok/s %s, TTFT s %s, active s %s", length,
                 {k: round(v, 1) for k, v in r["decode_tps"].items()}, {k: round(v, 4) for k, v in r["ttft_s"].items()},
                 {k: round(v, 4) for k, v in r["active_s"].items()})
    return {str(k): v for k, v in rows.items()}


def metrics(ev: dict, ctx) -> dict:
    from kvjax.eval.arms import SOURCE, TARGET
    out = {}
    for length, row in sorted(ev.items(), key=lambda kv: int(kv[0])):
        row = dict(row)
        row["mapped_over_target_decode"] = row["decode_tps"][MAPPED] / row["decode_tps"][TARGET]
        row["mapped_over_source_decode"] = row["decode_tps"][MAPPED] / row["decode_tps"][SOURCE]
        row["active_saving_vs_source"] = 1.0 - row["active_s"][MAPPED] / row["active_s"][SOURCE]
        if "latency_s" in row:  # records made before end-to-end latency was reported lack it
            # reserved accelerator seconds: every device a path holds, for the whole request (the method's accounting:
            # the split path holds the source's and the target's devices), beside the active compute above
            row["reserved_s"] = {arm: DEVICES[arm] * row["latency_s"][arm] for arm in DEVICES}
            row["mapped_latency_over_source"] = row["latency_s"][MAPPED] / row["latency_s"][SOURCE]
            row["mapped_latency_over_target"] = row["latency_s"][MAPPED] / row["latency_s"][TARGET]
        out[str(length)] = row
    return out


def summary(tp: dict, ctx) -> list[str]:
    ratios = [r["mapped_over_target_decode"] for r in tp.values()]
    vs_src = [r["mapped_over_source_decode"] for r in tp.values()]
    save = [r["active_saving_vs_source"] for r in tp.values()]
    lens = sorted(int(k) for k in tp)
    # the split path answers from the mapped cache, not from either native model's own: its speed and saving are
    # quoted beside what its answers cost, never as a speed-up of the same answer
    return [f"- Decode speed ({length_label(lens[0])}-{length_label(lens[-1])} prefixes): mapped = {min(ratios):.2f}-"
            f"{max(ratios):.2f}x native {ctx.target}, {min(vs_src):.2f}-{max(vs_src):.2f}x native {ctx.source}, "
            f"answering from the {ctx.final} cache, not a native model's own (quality: "
            f"{quality_cost(ctx.metrics, ctx.final)}).",
            f"- Active compute vs native {ctx.source}: {pct(min(save), 0)} to {pct(max(save), 0)} saving "
            f"(negative = the split path costs more), for the {ctx.final} cache's answers (quality above)."]


def report(tp: dict, ctx) -> list[str]:
    from kvjax.eval.arms import SOURCE, TARGET
    first = next(iter(tp.values()))
    out = ["## Speed: decode, TTFT and active compute", "",
           f"Batch {first['batch_size']}, {first['new_tokens']} new tokens (EOS ignored), medians of "
           f"{first['repeats']} interleaved rounds after a compile round (decode phase: median of "
           f"{first.get('decode_repeats', 1)} runs per round). Decode tok/s = tokens after the first / "
           "their time. TTFT = prefill (+ map) + first token. Active compute = source prefill + target decode once, "
           "map and transfer on both participating devices.", "",
           "| prefix | decode tok/s target | source | mapped | mapped / target | TTFT s target | source | mapped "
           "| active s target | source | mapped | saving vs source |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for length, r in tp.items():
        d, t, a = r["decode_tps"], r["ttft_s"], r["active_s"]
        out.append(f"| {length_label(int(length))} | {d[TARGET]:.1f} | {d[SOURCE]:.1f} | {d[MAPPED]:.1f} | "
                   f"{r['mapped_over_target_decode']:.3f} | {t[TARGET]:.3f} | {t[SOURCE]:.3f} | {t[MAPPED]:.3f} | "
                   f"{a[TARGET]:.3f} | {a[SOURCE]:.3f} | {a[MAPPED]:.3f} | {pct(r['active_saving_vs_source'])} |")
    out.append("")
    if all("reserved_s" in r for r in tp.values()):
        out += ["End-to-end latency of a request (prefill [+ map] + every new token) and reserved accelerator seconds "
                "(each device a path holds, for the whole request: the split path holds the source's and the "
                "target's), beside the active compute above:", "",
                "| prefix | latency s target | source | mapped | mapped / source | reserved s target | source | "
                "mapped |", "|---|---|---|---|---|---|---|---|"]
        for length, r in tp.items():
            lat, res = r["latency_s"], r["reserved_s"]
            out.append(f"| {length_label(int(length))} | {lat[TARGET]:.3f} | {lat[SOURCE]:.3f} | {lat[MAPPED]:.3f} | "
                       f"{r['mapped_latency_over_source']:.3f} | {res[TARGET]:.3f} | {res[SOURCE]:.3f} | "
                       f"{res[MAPPED]:.3f} |")
        out.append("")
    for name, alt in (("throughput", "decode throughput"), ("active_compute", "active compute"), ("ttft", "TTFT")):
        if name in ctx.charts:
            out += [f"![{alt}]({ctx.charts[name]})", ""]
    return out


def _series(ctx) -> dict[str, tuple[str, str]]:
    """Legend label and colour of each timed path, the split path first."""
    from kvjax.eval.arms import ARMS, SOURCE, TARGET
    # the split path answers from the final map's cache, not the target's own: its legend says how far from native
    final = ((ctx.metrics or {}).get("run") or {}).get("map", {}).get("final")
    return {MAPPED: (f"{ctx.source} prefill -> {ctx.target} decode ({quality_tag(ctx.metrics, final)})",
                     MAPPED_COLOUR),
            TARGET: (f"native {ctx.target}", ARMS[TARGET].colour),
            SOURCE: (f"native {ctx.source}", ARMS[SOURCE].colour)}


def throughput_chart(tp: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    plt = charts.plt()
    xs = charts.lengths(tp)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm, (label, colour) in _series(ctx).items():
        ys = [tp[str(x)]["decode_tps"][arm] for x in xs]
        ax.plot(xs, ys, "o-", color=colour, label=label, lw=2 if arm == MAPPED else 1.5)
    new = tp[str(xs[0])]["new_tokens"]
    ax.set(xlabel="prefix length (tokens)", ylabel="decode tokens / s (median)",
           title=f"Decode throughput after the first token ({new} new tokens)")
    charts.length_axis(ax, xs)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return charts.save(fig, path)


def ttft_chart(tp: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    plt = charts.plt()
    xs = charts.lengths(tp)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm, (label, colour) in _series(ctx).items():
        ax.plot(xs, [tp[str(x)]["ttft_s"][arm] for x in xs], "o-", color=colour, label=label)
    ax.set(yscale="log", xlabel="prefix length (tokens)", ylabel="seconds (median)",
           title="Time to first token (prefill [+ map] + first token)")
    charts.length_axis(ax, xs)
    ax.grid(alpha=0.3)
    ax.legend()
    return charts.save(fig, path)


def active_compute_chart(tp: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    from kvjax.eval.arms import SOURCE, TARGET
    plt = charts.plt()
    series = _series(ctx)
    xs = charts.lengths(tp)
    mapped = np.array([tp[str(x)]["active_s"][MAPPED] for x in xs])
    source = np.array([tp[str(x)]["active_s"][SOURCE] for x in xs])
    target = np.array([tp[str(x)]["active_s"][TARGET] for x in xs])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, source, "o-", color=series[SOURCE][1], label=series[SOURCE][0])
    ax.plot(xs, mapped, "o-", color=MAPPED_COLOUR, lw=2, label=series[MAPPED][0])
    ax.plot(xs, target, "o--", color=series[TARGET][1], alpha=0.7, label=series[TARGET][0])
    ax.fill_between(xs, mapped, source, where=mapped <= source, color=MAPPED_COLOUR, alpha=0.15,
                    interpolate=True, label="active-compute saving vs native source")
    for x, m, s in zip(xs, mapped, source):
        ax.annotate(f"{100 * (1 - m / s):.0f}% less" if s > 0 else "", (x, (m + s) / 2), ha="center", fontsize=8,
                    color=MAPPED_COLOUR)
    ax.set(xlabel="prefix length (tokens)", ylabel="active device-seconds per request",
           title="Active compute: source prefill + target decode once, map x2")
    charts.length_axis(ax, xs)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return charts.save(fig, path)


def preflight(ec: ThroughputEval, cfg) -> list[str]:
    if ec.enabled and (not ec.lengths or min(ec.lengths) < 2 or ec.new_tokens < 2 or ec.repeats < 1
                       or ec.decode_repeats < 1):
        return ["eval.throughput needs lengths >= 2, new_tokens >= 2, repeats >= 1 and decode_repeats >= 1"]
    return []


def gate(tp: dict, config, map_arm: str) -> list:
    """End-to-end latency of the split path / the native source's, worst prefix length (the split path is timed with
    the run's final map; the maps of one run differ in cost by their map phase alone)."""
    from kvjax.eval.gate import check
    ratios = [r["mapped_latency_over_source"] for r in (tp or {}).values() if "mapped_latency_over_source" in r]
    return check("latency_vs_source", max(ratios) if ratios else None, config.max_latency_vs_source, "max")


EVALUATION = Evaluation(
    name="throughput", settings=ThroughputEval, run=run, metrics=metrics, section=20, report=report,
    summary=summary, charts=(Chart("throughput", throughput_chart), Chart("ttft", ttft_chart),
                             Chart("active_compute", active_compute_chart)), preflight=preflight, gate=gate)

"""Evaluation `ttft`: time to first token of the answering model from a cache built out of the reader's prefill
(reader prefill + final map, + the repair: kvjax.builders.PartialRecompute, and + the answerer reading the prompt's
last tokens: kvjax.builders.NativeTail, both with RunConfig.arms) against the
answerer's own prefill, at several prompt lengths, timed side by side in one run (kvjax.eval.first_token: rotating
order, medians of the timed rounds, per-round ratios). The speed-up this direction is for: small reads, large answers.
Off by default (the forward job's `throughput` times its split path); metrics.json `ttft`."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.report import length_label, quality_cost, quality_tag
from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one

log = logging.getLogger(__name__)
# keys: the answerer's prefill, reader + map, + repair, + the answerer's own read of the prompt's last tokens
NATIVE, MAPPED, PARTIAL, TAIL, PARTIAL_TAIL = "target", "mapped", "partial", "tail", "partial_tail"
STYLE = {NATIVE: ("native {target} prefill", "#4C72B0"), MAPPED: ("{source} prefill + map", "#55A868"),
         PARTIAL: ("{source} prefill + map + repair", "#C44E52"),
         TAIL: ("{source} prefill + map + native tail", "#8C8C8C"),
         PARTIAL_TAIL: ("{source} prefill + map + repair + native tail", "#E6A0C4")}


@dataclasses.dataclass(frozen=True)
class TTFTEval:
    enabled: bool = False
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # prompt lengths (tokens of held-out text)
    repeats: int = 5  # timed rounds after a compile round (builders in rotating order); medians are reported
    repair: bool = True  # also time the repaired cache (partial recomputation, RunConfig.arms settings)
    tail: bool = False  # also time the map + native tail (kvjax.builders.NativeTail, RunConfig.arms.tail_tokens)
    partial_tail: bool = False  # also time the repaired cache + native tail (the arms table's partial_tail)
    batch_size: int = 1  # requests together


def run(ec: TTFTEval, ctx) -> dict:
    from kvjax.builders import Mapped, NativePrefill, NativeTail, PartialRecompute, repaired
    from kvjax.eval.first_token import measure_ttft
    kvmap = ctx.map(ctx.final)
    builders = {NATIVE: NativePrefill(ctx.target), MAPPED: Mapped(ctx.source, ctx.target, kvmap)}
    if ec.repair:
        builders[PARTIAL] = PartialRecompute(ctx.source, ctx.target, kvmap, ctx.cfg.arms.partial_k,
                                             ctx.cfg.arms.partial_mode)
    if ec.tail:
        builders[TAIL] = NativeTail(ctx.source, ctx.target, kvmap, ctx.cfg.arms.tail_tokens)
    if ec.partial_tail:
        builders[PARTIAL_TAIL] = repaired(ctx.source, ctx.target, kvmap, ctx.cfg.arms.partial_k,
                                          ctx.cfg.arms.partial_mode, ctx.cfg.arms.tail_tokens)
    rows = measure_ttft(builders, ctx.heldout.reshape(-1), ec.lengths, repeats=ec.repeats, batch_size=ec.batch_size)
    for length, r in rows.items():
        log.info("ttft %5d: %s", length, {a: round(float(np.median(v)), 4) for a, v in r["rounds"].items()})
    return {"rows": {str(k): v for k, v in rows.items()}, "final": ctx.final, "batch_size": ec.batch_size,
            "repeats": ec.repeats, "repair": {"k": ctx.cfg.arms.partial_k, "mode": ctx.cfg.arms.partial_mode},
            **({"tail_tokens": ctx.cfg.arms.tail_tokens} if ec.tail or ec.partial_tail else {})}


def metrics(ev: dict, ctx) -> dict:
    out = {}
    for length, r in sorted(ev["rows"].items(), key=lambda kv: int(kv[0])):
        rounds = {a: np.asarray(v, np.float64) for a, v in r["rounds"].items()}
        med = {a: float(np.median(v)) for a, v in rounds.items()}
        row = {"ttft_s": med, "speedup": {}, "speedup_rounds": {},
               "phases_s": {a: {k: float(np.median([p[k] for p in ps])) for k in ps[0]}
                            for a, ps in r["phases"].items()}}
        for a in rounds:
            if a != NATIVE:
                per_round = rounds[NATIVE] / rounds[a]  # same round, so machine drift cancels
                row["speedup"][a] = med[NATIVE] / med[a]
                row["speedup_rounds"][a] = [float(per_round.min()), float(np.median(per_round)),
                                            float(per_round.max())]
        out[length] = row
    out_meta = {k: ev[k] for k in ("final", "batch_size", "repeats", "repair", "tail_tokens") if k in ev}
    return {"lengths": out, **out_meta}


def _labels(ctx) -> dict[str, tuple[str, str]]:
    return {a: (label.format(source=ctx.source, target=ctx.target), colour) for a, (label, colour) in STYLE.items()}


def cache_arm(arm: str, tt: dict) -> str:
    """The kvjax.eval.arms cache a timed builder makes (mapped: the final map's; partial: its repair; tail: the map
    with a native tail; partial_tail: the repair with one), whose answers the mc / native_kl evaluations score."""
    return tt["final"] if arm == MAPPED else arm


def summary(tt: dict, ctx) -> list[str]:
    """Each built cache's TTFT ratio in its own line, with the quality of its answers beside it: it answers from
    another cache than the answerer's own, so the ratio is not a speed-up of the same answer, and is never named
    one without that cost."""
    longest = max(tt["lengths"], key=int)
    s = tt["lengths"][longest]["speedup"]
    labels = _labels(ctx)
    return [f"- Time to first token at {length_label(int(longest))}: {labels[a][0]} {s[a]:.2f}x the speed of "
            f"{ctx.target}'s own prefill, answering from the {cache_arm(a, tt)} cache, not {ctx.target}'s own "
            f"(quality: {quality_cost(ctx.metrics, cache_arm(a, tt))})." for a in (MAPPED, PARTIAL, TAIL, PARTIAL_TAIL)
            if a in s]


def report(tt: dict, ctx) -> list[str]:
    arms = [a for a in STYLE if a in next(iter(tt["lengths"].values()))["ttft_s"]]
    labels = _labels(ctx)
    rep = tt["repair"]
    out = ["## Time to first token: reader prefill + map vs the answerer's own prefill", "",
           f"Batch {tt['batch_size']}; TTFT = cache of all but the last prompt token + the answerer's forward over "
           f"that token; medians of {tt['repeats']} timed rounds (builders in rotating order, after a compile round); "
           f"speed-up = native median / arm median, with [min, median, max] of the same-round ratios. Map: "
           f"{tt['final']}; repair: {rep['mode']} {rep['k']} answerer layer(s) recomputed"
           + (f"; native tail: the answerer reads the last {tt['tail_tokens']} tokens" if "tail_tokens" in tt else "")
           + ".", "",
           "| prompt | " + " | ".join(f"{labels[a][0]} s" for a in arms) + " | "
           + " | ".join(f"speed-up {a}" for a in arms if a != NATIVE) + " |",
           "|---|" + "---|" * (2 * len(arms) - 1)]
    for length, r in tt["lengths"].items():
        cells = [f"{r['ttft_s'][a]:.4f}" for a in arms]
        ups = [f"{r['speedup'][a]:.2f}x [{r['speedup_rounds'][a][0]:.2f}, {r['speedup_rounds'][a][1]:.2f}, "
               f"{r['speedup_rounds'][a][2]:.2f}]" for a in arms if a != NATIVE]
        out.append(f"| {length_label(int(length))} | " + " | ".join(cells + ups) + " |")
    out.append("")
    # the built caches answer differently from the answerer's own prefill: a speed-up only beside what that costs
    out += [f"- {labels[a][0]} answers from the {cache_arm(a, tt)} cache, not {ctx.target}'s own: "
            f"{quality_cost(ctx.metrics, cache_arm(a, tt))}." for a in arms if a != NATIVE] + [""]
    if "ttft_reverse" in ctx.charts:
        out += [f"![time to first token]({ctx.charts['ttft_reverse']})", ""]
    return out


def chart(tt: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    plt = charts.plt()
    rows = tt["lengths"]
    xs = charts.lengths(rows)
    labels = _labels(ctx)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for a, (label, colour) in labels.items():
        if a in rows[str(xs[0])]["ttft_s"]:
            if a != NATIVE:  # a built cache answers differently: its legend says how far (kvjax.eval.report)
                label += f" ({quality_tag(ctx.metrics, cache_arm(a, tt))})"
            ax.plot(xs, [rows[str(x)]["ttft_s"][a] for x in xs], "o-", color=colour, label=label)
    for x in xs:
        ax.annotate(f"{rows[str(x)]['speedup'][MAPPED]:.1f}x", (x, rows[str(x)]["ttft_s"][MAPPED]),
                    textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8,
                    color=STYLE[MAPPED][1])
    ax.set(yscale="log", xlabel="prompt length (tokens)", ylabel="seconds (median)",
           title="Time to first token of the answering model")
    charts.length_axis(ax, xs)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return charts.save(fig, path)


def _arm_settings(cfg) -> dict:
    """The RunConfig.arms fields the timed builders read (the repair's; the tail's when one is timed)."""
    out = {"partial_k": cfg.arms.partial_k, "partial_mode": cfg.arms.partial_mode}
    tail = cfg.eval.ttft.tail or cfg.eval.ttft.partial_tail
    return {**out, "tail_tokens": cfg.arms.tail_tokens} if tail else out


def preflight(ec: TTFTEval, cfg) -> list[str]:
    problems = at_least_one("eval.ttft", ec, "repeats", "batch_size")
    if not ec.lengths or min(ec.lengths) < 2:
        problems.append("eval.ttft.lengths must be prompt lengths >= 2 tokens")
    return problems


EVALUATION = Evaluation(
    name="ttft", settings=TTFTEval, run=run, metrics=metrics, section=15, report=report, summary=summary,
    charts=(Chart("ttft_reverse", chart),), depends=lambda cfg: {"arm_settings": _arm_settings(cfg)},
    preflight=preflight)

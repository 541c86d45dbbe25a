"""Evaluation `distances`: how close each map's cache is to the target's native cache (cosine and NRMSE per layer,
keys before RoPE) on the first held-out windows, with the unmapped source ("raw", the direct arm's map) as the
baseline. metrics.json `distances`; the gate's key_cos / value_cos."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one
from kvjax.eval.gate import check

log = logging.getLogger(__name__)
# attn_*: the target's attention outputs from the mapped vs its native cache, same queries
# (kvjax.eval.attention_fidelity); records made before it existed lack them
METRICS = ("key_cos", "value_cos", "key_nrmse", "value_nrmse", "attn_cos", "attn_nrmse")
RAW = "raw"  # the nearest-depth source layer unmapped (the direct arm's map); its key in the record and metrics
RAW_STYLE = ("unmapped source", "#8C8C8C")  # chart label, colour


@dataclasses.dataclass(frozen=True)
class DistancesEval:
    enabled: bool = True
    windows: int = 16  # held-out windows (the first rows of the held-out windows)
    window_len: int = 512
    batch_size: int = 8


def windows_of(heldout: np.ndarray, ec: DistancesEval) -> np.ndarray:
    return heldout[: ec.windows, : ec.window_len]


def run(ec: DistancesEval, ctx) -> dict:
    from kvjax.mapper.injection import injection_kind
    from kvjax.eval.cache_distances import map_distances
    windows = windows_of(ctx.heldout, ec)
    maps = {RAW: ctx.map(RAW), **{m: ctx.map(m) for m in ctx.fitted}}
    result = map_distances(maps, ctx.source, ctx.target, windows, ec.batch_size)
    for name, r in result.items():
        log.info("distances %-8s %s", name, {k: round(v, 4) for k, v in r["mean"].items()})
    return {"maps": result, "windows": len(windows), "window_len": int(windows.shape[1]),
            "raw_kind": injection_kind(ctx.source[0], ctx.target[0])}


def metrics(ev: dict, ctx) -> dict:
    maps = ev["maps"]
    out = {m: {arm: maps[arm]["mean"][m] for arm in maps} for m in METRICS if all(m in maps[a]["mean"] for a in maps)}
    out.update(per_layer={arm: maps[arm]["per_layer"] for arm in maps}, windows=ev["windows"],
               tokens=ev["windows"] * ev["window_len"], raw_kind=ev["raw_kind"])
    return out


def report(d: dict, ctx) -> list[str]:
    arms = list(d["key_cos"])
    out = ["## What the map learned: tensor distances", "",
           f"{d['windows']} held-out windows ({d['tokens']} tokens), means over target layers; keys compared "
           f"before RoPE; attn = the target's attention outputs (its own queries) from the mapped vs its native cache. "
           f"'raw' = the nearest-depth source layer unmapped ({d['raw_kind']}).", "",
           "| | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for metric in (m for m in METRICS if m in d):
        out.append(f"| {metric} | " + " | ".join(f"{d[metric][a]:.3f}" for a in arms) + " |")
    out.append("")
    if "distances" in ctx.charts:
        out += [f"![tensor distances]({ctx.charts['distances']})", ""]
    return out


def chart(d: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    from kvjax.eval.arms import ARMS, in_table_order
    plt = charts.plt()
    arms = ([RAW] if RAW in d["key_cos"] else []) + in_table_order(a for a in d["key_cos"] if a != RAW)
    style = {RAW: RAW_STYLE, **{a: (ARMS[a].label, ARMS[a].colour) for a in arms if a != RAW}}
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    width = 0.8 / len(arms)
    for ax, metric, title in ((axes[0], "nrmse", "NRMSE (lower is better)"),
                              (axes[1], "cos", "cosine (higher is better)")):
        for i, arm in enumerate(arms):
            vals = [d[f"key_{metric}"][arm], d[f"value_{metric}"][arm]]
            bars = ax.bar(np.arange(2) + (i - (len(arms) - 1) / 2) * width, vals, width, color=style[arm][1],
                          label=style[arm][0])
            ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_xticks(range(2), ["keys (pre-RoPE)", "values"])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_ylim(min(0, min(d["key_cos"][a] for a in arms) - 0.05), 1.05)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Mapped vs native target cache ({d['windows']} held-out windows, {d['tokens']} tokens)")
    return charts.save(fig, path)


def preflight(ec: DistancesEval, cfg) -> list[str]:
    from kvjax.eval.arms import BRIDGE, PERHEAD, RESIDUAL, RIDGE
    problems = at_least_one("eval.distances", ec, "batch_size", "windows")
    # the gate's cosine checks read this evaluation's maps
    if cfg.gate.cos_arm not in (None, RAW, RIDGE, RESIDUAL, PERHEAD, BRIDGE):
        problems.append(f"gate.cos_arm={cfg.gate.cos_arm!r}: use {RIDGE}, {RESIDUAL}, {PERHEAD}, {BRIDGE}, {RAW} or "
                        "None (the gated map)")
    return problems


def gate(d: dict, config, map_arm: str) -> list:
    cos_arm = config.cos_arm or map_arm
    return (check("key_cos", d.get("key_cos", {}).get(cos_arm), config.min_key_cos, "min", cos_arm)
            + check("value_cos", d.get("value_cos", {}).get(cos_arm), config.min_value_cos, "min", cos_arm)
            + check("attn_cos", d.get("attn_cos", {}).get(cos_arm), getattr(config, "min_attn_cos", None), "min",
                    cos_arm))


EVALUATION = Evaluation(
    name="distances", settings=DistancesEval, run=run, metrics=metrics, section=30, report=report,
    charts=(Chart("distances", chart),), heldout=lambda ec, cfg: (ec.windows, ec.window_len), preflight=preflight,
    gate=gate)

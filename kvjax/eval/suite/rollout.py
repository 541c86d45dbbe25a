"""Evaluation `rollout` (off by default): the method's 32-step KV-transfer divergence. On frozen held-out windows (the
KL evaluation's rows, their first `prefix_len` tokens) the target greedily generates `steps` tokens from each fitted
map's cache and from its own prefill, and the source teacher scores every step: KL(source || target) per step
(kvjax.eval.divergence). Whether the residual was trained on KL or on its own rollouts is `--config.residual.rollout`.
metrics.json `rollout`."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.report import pct
from kvjax.eval.stats import paired_bootstrap_ci
from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one
from kvjax.eval.suite.kl import first_row

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RolloutEval:
    enabled: bool = False  # off in the default job: `steps` decode steps per window and arm
    windows: int = 64  # the KL evaluation's held-out rows (after the distance windows)
    prefix_len: int = 256  # the map translates the first prefix_len - 1 tokens; the target reads the last
    steps: int = 32  # tokens the target generates greedily (no stop at EOS); every one is scored
    batch_size: int = 8


def run(ec: RolloutEval, ctx) -> dict:
    from kvjax.builders import NativePrefill
    from kvjax.eval.arms import TARGET
    from kvjax.eval.divergence import rollout_table
    windows = np.asarray(ctx.heldout[first_row(ctx.cfg) : first_row(ctx.cfg) + ec.windows, : ec.prefix_len])
    builders = {**{m: ctx.map(m) for m in ctx.fitted}, TARGET: NativePrefill(ctx.target, name=TARGET)}
    table = rollout_table(builders, ctx.source, ctx.target, windows, ec.steps, ec.batch_size)
    for name, d in table.items():
        log.info("rollout divergence %-8s %.4f nats/step over %d steps, %d windows", name, d.mean(), ec.steps,
                 len(windows))
    return {"per_step": {k: v.tolist() for k, v in table.items()}, "windows": len(windows),
            "prefix_len": ec.prefix_len, "steps": ec.steps,
            "residual_training": "rollout" if ctx.cfg.residual.rollout else "kl"}


def metrics(ev: dict, ctx) -> dict:
    from kvjax.eval.arms import RESIDUAL, RIDGE
    d = {k: np.asarray(v, np.float64) for k, v in ev["per_step"].items()}  # [windows, steps]
    per_window = {k: v.mean(1) for k, v in d.items()}
    out = {arm: float(v.mean()) for arm, v in d.items()}
    if RESIDUAL in d:
        ci = paired_bootstrap_ci(per_window[RESIDUAL], per_window[RIDGE], n=ctx.n_boot)
        out.update(change=out[RESIDUAL] / out[RIDGE] - 1.0, residual_minus_ridge=ci.mean,
                   residual_minus_ridge_ci95=[ci.lo, ci.hi],
                   windows_improved=int(np.sum(per_window[RESIDUAL] < per_window[RIDGE])))
    out.update(windows=int(len(per_window[RIDGE])), prefix_len=ev["prefix_len"], steps=ev["steps"],
               residual_training=ev["residual_training"],
               per_step={k: v.mean(0).tolist() for k, v in d.items()},
               per_window={k: v.tolist() for k, v in per_window.items()})
    return out


def _residual_label(ro: dict) -> str:
    return f"ridge + {ro['residual_training']}-trained residual"


def _arms(ro: dict) -> list[str]:
    """The measured caches: the arm table's order, then any other fitted map."""
    from kvjax.eval.arms import in_table_order
    known = in_table_order(ro["per_step"])
    return known + sorted(set(ro["per_step"]) - set(known))


def _label(ro: dict, arm: str) -> str:
    from kvjax.eval.arms import ARMS, RESIDUAL, TARGET
    if arm == RESIDUAL:
        return _residual_label(ro)
    return "native target (its own prefill)" if arm == TARGET else ARMS[arm].label if arm in ARMS else arm


def summary(ro: dict, ctx) -> list[str]:
    from kvjax.eval.arms import RESIDUAL, RIDGE
    if "change" not in ro:
        return []
    lo, hi = ro["residual_minus_ridge_ci95"]
    return [f"- Rollout: {ro['steps']}-step divergence {ro[RIDGE]:.4f} -> {ro[RESIDUAL]:.4f} nats/step "
            f"({pct(ro['change'])} with the {ro['residual_training']}-trained residual; paired 95% CI "
            f"[{lo:.4f}, {hi:.4f}], {ro['windows_improved']} of {ro['windows']} windows improve)."]


def report(ro: dict, ctx) -> list[str]:
    out = ["## Rollout divergence: the target decoding from the mapped cache", "",
           f"{ro['windows']} held-out windows: the source reads {ro['prefix_len']} tokens, the target greedily "
           f"generates {ro['steps']} from the cache of the first {ro['prefix_len'] - 1} and its last token; at every "
           "step KL(source having read the same tokens || target), nats, averaged over steps and windows.", "",
           "| cache | mean divergence |", "|---|---:|"]
    for arm in _arms(ro):
        out.append(f"| {_label(ro, arm)} | {ro[arm]:.4f} |")
    out.append("")
    if "change" in ro:
        lo, hi = ro["residual_minus_ridge_ci95"]
        out += [f"The {_residual_label(ro)} is {pct(ro['change'])} vs the ridge: paired 95% CI of residual - "
                f"ridge [{lo:.4f}, {hi:.4f}], {ro['windows_improved']} of {ro['windows']} windows improve.", ""]
    if "rollout_steps" in ctx.charts:
        out += [f"![rollout divergence per step]({ctx.charts['rollout_steps']})", ""]
    return out


def step_chart(ro: dict, path: str, ctx) -> str:
    """Mean divergence at each generated step, one line per cache."""
    from kvjax.eval import charts
    from kvjax.eval.arms import ARMS
    plt = charts.plt()
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in _arms(ro):
        colour = ARMS[arm].colour if arm in ARMS else None
        ax.plot(np.arange(1, ro["steps"] + 1), ro["per_step"][arm], "-", color=colour, label=_label(ro, arm))
    ax.set(xlabel="generated token", ylabel="KL(source || target), nats",
           title=f"Rollout divergence ({ro['windows']} frozen windows, greedy target)")
    ax.grid(alpha=0.3)
    ax.legend()
    return charts.save(fig, path)


def preflight(ec: RolloutEval, cfg) -> list[str]:
    bad = at_least_one("eval.rollout", ec, "batch_size", "windows", "steps")
    if ec.prefix_len < 2:
        bad.append(f"eval.rollout.prefix_len must be >= 2 (a mapped prefix and a last token), got {ec.prefix_len}")
    return bad


EVALUATION = Evaluation(
    name="rollout", settings=RolloutEval, run=run, metrics=metrics, section=45, report=report, summary=summary,
    charts=(Chart("rollout_steps", step_chart),),
    depends=lambda cfg: {"skip_rows": first_row(cfg), "residual_rollout": cfg.residual.rollout},
    heldout=lambda ec, cfg: (first_row(cfg) + ec.windows, ec.prefix_len), preflight=preflight)

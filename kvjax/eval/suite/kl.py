"""Evaluation `kl`: source-teacher KL of the target reading each fitted map's cache on frozen held-out windows (the
rows after the distance windows), the native target's own KL on the same windows (what a map has to beat) and the
final map's next-token agreement. metrics.json `kl`; the gate's kl, kl_vs_target and kl_reduction."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.report import pct
from kvjax.eval.stats import paired_bootstrap_ci
from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one
from kvjax.eval.gate import check

log = logging.getLogger(__name__)
WORSE = "#C44E52"  # slope chart: a window the residual makes worse


@dataclasses.dataclass(frozen=True)
class KLEval:
    enabled: bool = True
    windows: int = 64  # held-out windows after the distance windows (disjoint rows)
    prefix_len: int = 256  # tokens the source reads and the map translates
    cont_len: int = 64  # continuation tokens scored
    batch_size: int = 8


def first_row(cfg) -> int:
    """The KL windows are the rows after the distance windows, so the two evaluations never share a window (whether
    or not distances runs, so switching it off does not move them)."""
    return cfg.eval.distances.windows


def windows_of(heldout: np.ndarray, ec: KLEval, skip: int) -> np.ndarray:
    return heldout[skip : skip + ec.windows, : ec.prefix_len + ec.cont_len]


def run(ec: KLEval, ctx) -> dict:
    """Each fitted map's KL; the native target's KL to the source on the same windows (the target having read the
    prefix itself) and the final map's next-token agreement come from one pass of the final map."""
    from kvjax.eval.token_agreement import next_token_agreement
    from kvjax.eval.arms import TARGET
    from kvjax.fitting.residual import evaluate_kl
    windows = windows_of(ctx.heldout, ec, first_row(ctx.cfg))
    maps = {m: ctx.map(m) for m in ctx.fitted}
    final = ctx.final
    agree = next_token_agreement(maps[final], ctx.source, ctx.target, windows, ec.prefix_len, ec.batch_size)
    per_window = {name: evaluate_kl(kvmap, ctx.source, ctx.target, windows, ec.prefix_len, ec.batch_size).tolist()
                  for name, kvmap in maps.items() if name != final}
    per_window[final] = agree["kl_mapped"].tolist()
    per_window[TARGET] = agree["kl_native"].tolist()
    for name, kl in per_window.items():
        log.info("KL %-8s %.4f nats/token over %d windows", name, float(np.mean(kl)), len(windows))
    agreement = {"map": final, **{k: agree[k].tolist() for k in ("with_source", "with_target", "target_with_source")}}
    log.info("next-token agreement of %s: with the source %.4f (native target %.4f), with the native target %.4f",
             final, agree["with_source"].mean(), agree["target_with_source"].mean(), agree["with_target"].mean())
    return {"per_window": per_window, "agreement": agreement, "windows": len(windows), "prefix_len": ec.prefix_len,
            "cont_len": ec.cont_len}


def metrics(ev: dict, ctx) -> dict:
    from kvjax.eval.arms import RESIDUAL, RIDGE, TARGET
    pw = {k: np.asarray(v, np.float64) for k, v in ev["per_window"].items()}
    out = {arm: float(v.mean()) for arm, v in pw.items()}
    if RESIDUAL in pw:
        ci = paired_bootstrap_ci(pw[RESIDUAL], pw[RIDGE], n=ctx.n_boot)
        out.update(reduction=1.0 - out[RESIDUAL] / out[RIDGE], residual_minus_ridge=ci.mean,
                   residual_minus_ridge_ci95=[ci.lo, ci.hi],
                   windows_improved=int(np.sum(pw[RESIDUAL] < pw[RIDGE])))
    final = RESIDUAL if RESIDUAL in pw else RIDGE
    if TARGET in pw:  # the native target's own KL to the source: what the mapped cache has to beat
        ci = paired_bootstrap_ci(pw[final], pw[TARGET], n=ctx.n_boot)
        out.update(vs_target=out[final] / out[TARGET], final_minus_target=ci.mean,
                   final_minus_target_ci95=[ci.lo, ci.hi])
    if "agreement" in ev:
        ag = ev["agreement"]
        out["agreement"] = {"map": ag["map"], **{k: float(np.mean(ag[k]))
                                                 for k in ("with_source", "with_target", "target_with_source")}}
    out.update(windows=len(pw[RIDGE]), prefix_len=ev["prefix_len"], cont_len=ev["cont_len"],
               per_window={k: v.tolist() for k, v in pw.items()})
    return out


def summary(kl: dict, ctx) -> list[str]:
    from kvjax.eval.arms import RESIDUAL, RIDGE
    if "reduction" not in kl:
        return []
    lo, hi = kl["residual_minus_ridge_ci95"]
    return [f"- Residual: source-teacher KL {kl[RIDGE]:.4f} -> {kl[RESIDUAL]:.4f} nats/token "
            f"({pct(kl['reduction'])} lower; paired 95% CI of the difference [{lo:.4f}, {hi:.4f}])."]


def report(kl: dict, ctx) -> list[str]:
    from kvjax.eval.arms import RESIDUAL, RIDGE, TARGET
    out = ["## Residual: source-teacher KL on frozen windows", "",
           f"{kl['windows']} held-out windows, {kl['prefix_len']} prefix tokens mapped, KL(source || target from "
           f"mapped cache) averaged over the next {kl['cont_len']} tokens.", ""]
    if "reduction" in kl:
        lo, hi = kl["residual_minus_ridge_ci95"]
        out += [f"Ridge {kl[RIDGE]:.4f} -> ridge + residual {kl[RESIDUAL]:.4f} nats/token: "
                f"{pct(kl['reduction'])} lower, {kl['windows_improved']} of {kl['windows']} windows improve; "
                f"paired 95% CI of residual - ridge [{lo:.4f}, {hi:.4f}].", ""]
    else:
        out += [f"Ridge only (no residual trained): {kl[RIDGE]:.4f} nats/token.", ""]
    if TARGET in kl:
        lo, hi = kl["final_minus_target_ci95"]
        out += [f"The native target (having read the prefix itself): {kl[TARGET]:.4f} nats/token; the final map "
                f"is at {kl['vs_target']:.3f} x that (paired 95% CI of map - native [{lo:.4f}, {hi:.4f}]; below "
                "zero = the mapped cache brings the target closer to the source than its own cache does).", ""]
    if "agreement" in kl:
        ag = kl["agreement"]
        out += [f"Next-token agreement ({ag['map']} map): the target's top token matches the source's at "
                f"{pct(ag['with_source'])} of positions (native target: {pct(ag['target_with_source'])}), and "
                f"the native target's at {pct(ag['with_target'])}.", ""]
    if "kl_slope" in ctx.charts:
        out += [f"![KL slope chart]({ctx.charts['kl_slope']})", ""]
    return out


def slope_chart(kl: dict, path: str, ctx) -> str:
    """One line per frozen window from its ridge KL to its ridge + residual KL."""
    from kvjax.eval import charts
    from kvjax.eval.arms import ARMS, RESIDUAL, RIDGE
    plt = charts.plt()
    ridge, residual = np.array(kl["per_window"][RIDGE]), np.array(kl["per_window"][RESIDUAL])
    fig, ax = plt.subplots(figsize=(5, 5))
    for r, s in zip(ridge, residual):
        ax.plot([0, 1], [r, s], "-", color=ARMS[RESIDUAL].colour if s < r else WORSE, alpha=0.35, lw=1)
    ax.plot([0, 1], [ridge.mean(), residual.mean()], "o-", color="black", lw=2.5, label="mean")
    lo, hi = kl["residual_minus_ridge_ci95"]
    ax.set_xticks([0, 1], [ARMS[RIDGE].label, ARMS[RESIDUAL].label])
    ax.set_xlim(-0.3, 1.3)
    ax.set(ylabel="source-teacher KL (nats / token)",
           title=f"{100 * kl['reduction']:.1f}% lower KL; paired 95% CI of the\ndifference [{lo:.4f}, {hi:.4f}]"
                 f" ({len(ridge)} frozen windows)")
    down = int(np.sum(residual < ridge))
    ax.text(0.5, 0.02, f"{down} of {len(ridge)} windows move down", transform=ax.transAxes, ha="center", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return charts.save(fig, path)


def preflight(ec: KLEval, cfg) -> list[str]:
    return at_least_one("eval.kl", ec, "batch_size", "windows")


def gate(kl: dict, config, map_arm: str) -> list:
    from kvjax.eval.arms import RESIDUAL
    trained = map_arm == RESIDUAL  # the reduction is the residual's over the ridge
    return (check("kl", kl.get(map_arm), config.max_kl, "max")
            + check("kl_vs_target", kl.get("vs_target"), config.max_kl_vs_target, "max")
            + check("kl_reduction", kl.get("reduction") if trained else None, config.min_kl_reduction, "min",
                    "" if trained else "no residual trained"))


EVALUATION = Evaluation(
    name="kl", settings=KLEval, run=run, metrics=metrics, section=40, report=report, summary=summary,
    charts=(Chart("kl_slope", slope_chart, when=lambda kl: "reduction" in kl),),
    depends=lambda cfg: {"skip_rows": first_row(cfg)},
    heldout=lambda ec, cfg: (first_row(cfg) + ec.windows, ec.prefix_len + ec.cont_len), preflight=preflight,
    gate=gate)

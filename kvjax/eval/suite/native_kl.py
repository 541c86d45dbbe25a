"""Evaluation `native_kl`: how far each built cache moves the answering model from its OWN predictions: KL(target
having read the prefix natively || target reading the built cache) and next-token agreement with its native argmax,
on frozen held-out windows, for the mapped caches, direct reuse of the reader's layers and the repaired (partially
recomputed) cache, with paired intervals against direct reuse.

This is the cache-quality metric when small reads and large answers: the reader is the weaker model, so the `kl`
evaluation's source-teacher KL would measure the wrong thing; the answerer's own native predictions are what its
cache should reproduce. Off by default (the forward job measures `kl`); metrics.json `native_kl`."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.report import pct
from kvjax.eval.stats import bootstrap_ci, paired_bootstrap_ci
from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one, unknown_arms
from kvjax.eval.suite.kl import first_row

log = logging.getLogger(__name__)
BASELINE = "direct"  # the arm every other is paired against: the reader's layers reused without a map
NOT_BUILT = ("target", "source")  # native arms: the target's own cache is the reference, the source does not answer


@dataclasses.dataclass(frozen=True)
class NativeKLEval:
    enabled: bool = False
    windows: int = 64  # held-out windows (the same rows as the kl evaluation's: after the distance windows)
    prefix_len: int = 256  # tokens the reader prefills and the map translates
    cont_len: int = 64  # continuation tokens scored
    arms: tuple[str, ...] = ("direct", "ridge", "residual", "partial")  # built caches, kvjax.eval.arms.TABLE
    batch_size: int = 8


def windows_of(heldout: np.ndarray, ec: NativeKLEval, skip: int) -> np.ndarray:
    return heldout[skip : skip + ec.windows, : ec.prefix_len + ec.cont_len]


def run(ec: NativeKLEval, ctx) -> dict:
    from kvjax.eval.token_agreement import agreement_table
    from kvjax.eval.arms import make_arms
    windows = windows_of(ctx.heldout, ec, first_row(ctx.cfg))
    arms = make_arms(ec.arms, ctx.source, ctx.target, ctx.map, ctx.final, ctx.cfg.arms)
    # the builders themselves (batch_fn.func), not the arms' bucketed calls: every window has the same prefix length
    table = agreement_table({a.name: a.batch_fn.func for a in arms}, ctx.source, ctx.target, windows, ec.prefix_len,
                            ec.batch_size)
    out = {name: {"kl": r["kl_to_target"].tolist(), "agree": r["with_target"].tolist(),
                  "first_agree": r["first_with_target"].tolist()} for name, r in table.items()}
    for name, r in out.items():
        log.info("native KL %-8s %.4f nats/token, agreement with native %.4f", name, np.mean(r["kl"]),
                 np.mean(r["agree"]))
    return {"arms": out, "windows": len(windows), "prefix_len": ec.prefix_len, "cont_len": ec.cont_len}


def metrics(ev: dict, ctx) -> dict:
    arms = ev["arms"]
    kl = {a: np.asarray(r["kl"], np.float64) for a, r in arms.items()}
    out = {"kl": {a: float(v.mean()) for a, v in kl.items()},
           "kl_ci95": {a: _ci(v, ctx.n_boot) for a, v in kl.items()},
           "agreement": {a: float(np.mean(r["agree"])) for a, r in arms.items()},
           "first_agreement": {a: float(np.mean(r["first_agree"])) for a, r in arms.items()}}
    if BASELINE in kl:
        out["minus_direct"] = {}
        for a, v in kl.items():
            if a != BASELINE:
                ci = paired_bootstrap_ci(v, kl[BASELINE], n=ctx.n_boot)
                out["minus_direct"][a] = {"mean": ci.mean, "ci95": [ci.lo, ci.hi]}
    if "partial" in kl and ctx.final in kl:  # what the repair adds on top of the map it repairs
        ci = paired_bootstrap_ci(kl["partial"], kl[ctx.final], n=ctx.n_boot)
        out["partial_minus_final"] = {"mean": ci.mean, "ci95": [ci.lo, ci.hi]}
    out.update(final=ctx.final, windows=ev["windows"], prefix_len=ev["prefix_len"], cont_len=ev["cont_len"],
               per_window={a: v.tolist() for a, v in kl.items()})
    return out


def _ci(values, n: int) -> list[float]:
    ci = bootstrap_ci(values, n=n)
    return [ci.lo, ci.hi]


def _verdict(d: dict) -> str:
    lo, hi = d["ci95"]
    return "better" if hi < 0 else "worse" if lo > 0 else "not distinguishable"


def summary(nk: dict, ctx) -> list[str]:
    final = nk["final"]
    diff = nk.get("minus_direct", {}).get(final)
    if diff is None:
        return []
    lo, hi = diff["ci95"]
    return [f"- Cache quality for {ctx.target} (KL to its own native predictions): mapped ({final}) "
            f"{nk['kl'][final]:.4f} vs direct reuse {nk['kl'][BASELINE]:.4f} nats/token; paired 95% CI of mapped - "
            f"direct [{lo:.4f}, {hi:.4f}] ({_verdict(diff)})."]


def report(nk: dict, ctx) -> list[str]:
    from kvjax.eval.arms import ARMS, in_table_order
    arms = in_table_order(nk["kl"])
    out = ["## Cache quality: the answerer's KL to its own native predictions", "",
           f"{nk['windows']} frozen held-out windows; {ctx.source} reads {nk['prefix_len']} prefix tokens, the cache "
           f"is built for {ctx.target}, which then predicts the next {nk['cont_len']} tokens; KL({ctx.target} after "
           f"its own prefill || {ctx.target} from the built cache), nats/token, and how often its top token matches "
           "its native one. Differences are paired by window (95% bootstrap).", "",
           "| arm | KL (95% CI) | agreement | first-token agreement | minus direct reuse (paired 95% CI) |",
           "|---|---|---|---|---|"]
    for a in arms:
        lo, hi = nk["kl_ci95"][a]
        d = nk.get("minus_direct", {}).get(a)
        diff = f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] ({_verdict(d)})" if d else "-"
        out.append(f"| {ARMS[a].label} | {nk['kl'][a]:.4f} [{lo:.4f}, {hi:.4f}] | {pct(nk['agreement'][a])} | "
                   f"{pct(nk['first_agreement'][a])} | {diff} |")
    if "partial_minus_final" in nk:
        d = nk["partial_minus_final"]
        out += ["", f"Repair (partial recomputation, settings `run.settings.arms`) minus the map it repairs "
                f"({nk['final']}): {d['mean']:+.4f} nats/token, paired 95% CI [{d['ci95'][0]:+.4f}, "
                f"{d['ci95'][1]:+.4f}]."]
    out.append("")
    if "native_kl" in ctx.charts:
        out += [f"![native KL]({ctx.charts['native_kl']})", ""]
    return out


def chart(nk: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    from kvjax.eval.arms import ARMS, in_table_order
    plt = charts.plt()
    arms = in_table_order(nk["kl"])
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(arms) + 2), 4))
    mean = np.array([nk["kl"][a] for a in arms])
    lo = np.array([nk["kl_ci95"][a][0] for a in arms])
    hi = np.array([nk["kl_ci95"][a][1] for a in arms])
    bars = ax.bar(range(len(arms)), mean, yerr=np.stack([mean - lo, hi - mean]), capsize=4,
                  color=[ARMS[a].colour for a in arms])
    ax.bar_label(bars, fmt="%.3f", fontsize=8, padding=4)
    ax.set_xticks(range(len(arms)), [ARMS[a].label for a in arms], fontsize=8)
    ax.set(ylabel="KL to native predictions (nats / token)",
           title=f"{ctx.target} reading a cache built from {ctx.source}'s prefill\n({nk['windows']} held-out "
                 "windows; lower is better)")
    ax.grid(axis="y", alpha=0.3)
    return charts.save(fig, path)


def preflight(ec: NativeKLEval, cfg) -> list[str]:
    problems = at_least_one("eval.native_kl", ec, "batch_size", "windows", "cont_len") + unknown_arms(
        "eval.native_kl", ec.arms)
    bad = [a for a in ec.arms if a in NOT_BUILT]
    if bad:
        problems.append(f"eval.native_kl.arms: {bad} build no cache for the target to read; name built caches "
                        "(direct, ridge, residual, partial)")
    if ec.prefix_len < 2:
        problems.append(f"eval.native_kl.prefix_len must be >= 2, got {ec.prefix_len}")
    return problems


EVALUATION = Evaluation(
    name="native_kl", settings=NativeKLEval, run=run, metrics=metrics, section=35, report=report, summary=summary,
    charts=(Chart("native_kl", chart),), depends=lambda cfg: {"skip_rows": first_row(cfg)},
    heldout=lambda ec, cfg: (first_row(cfg) + ec.windows, ec.prefix_len + ec.cont_len), preflight=preflight)

"""Evaluation `agreement`: next-token agreement of every arm, against direct injection (the method's claim: "improved
next-token agreement 30x over direct injection"). On the `kl` evaluation's frozen held-out windows (the rows after the
distance windows, its sizes: eval.kl.*), the target reads each arm's cache of the prefix and predicts the
continuation; at every continuation position its top token is compared with

  with_source   the source's top token (the model that read the prefix: the teacher the map should carry)
  with_target   the native target's top token (the target having read the prefix itself: the answerer's own decode)

and the same for the first token after the prefix only (what a prefill hand-off decides). Built arms: target (its own
prefill cache: with_target 1 up to numerics, with_source the models' baseline agreement), direct, perhead, ridge,
residual, partial. `source` is a reference row, not a built cache: the source is the teacher itself (with_source 1,
with_target = the native target's agreement with the source). Against direct injection, per arm:

  ratio_vs_direct.with_source      arm / direct agreement with the SOURCE's argmax (the method's "30x"; the gate's
                                   agreement_vs_direct)
  ratio_vs_direct.with_target      arm / direct agreement with the NATIVE TARGET's argmax
  disagreement_ratio.{same two}    (1 - direct) / (1 - arm): how many times fewer positions disagree
  minus_direct.{same two}          per-window arm - direct, paired 95% bootstrap interval

An arm that cannot be built in this run (the direct arm when its map is unavailable) is skipped with its reason and
every ratio to it is unmeasured (null). metrics.json `agreement`; the gate's agreement_vs_direct."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.report import pct
from kvjax.eval.stats import bootstrap_ci, paired_bootstrap_ci, ratio_ci
from kvjax.eval.suite.evaluation import Chart, Evaluation, unknown_arms
from kvjax.eval.suite.kl import first_row, windows_of
from kvjax.eval.gate import check

log = logging.getLogger(__name__)
BASELINE = "direct"  # every arm's ratio and paired difference is against direct injection
REFERENCE = "source"  # not a built cache: the teacher itself (a reference row)
KINDS = ("with_source", "with_target")  # agreement with the source's argmax, with the native target's
FIRST = ("first_with_source", "first_with_target")


@dataclasses.dataclass(frozen=True)
class AgreementEval:
    """The windows are the `kl` evaluation's (its rows and sizes: eval.kl.windows / prefix_len / cont_len /
    batch_size), so the final map's agreement here is the one the kl section quotes."""

    enabled: bool = True
    arms: tuple[str, ...] = ("target", "direct", "ridge", "residual", "source")  # kvjax.eval.arms.TABLE


def _sizes(cfg) -> dict:
    kl = cfg.eval.kl
    return {"windows": kl.windows, "prefix_len": kl.prefix_len, "cont_len": kl.cont_len, "batch_size": kl.batch_size}


def _built_arms(ec: AgreementEval, ctx) -> tuple[dict, dict]:
    """({arm: its CacheBuilder}, {arm: why it was skipped}) of the arms that build a cache for the target. All at
    once (one shared source prefill per batch); when that fails, one by one, to skip only the arms that cannot."""
    from kvjax.eval.arms import make_arms
    names = [a for a in ec.arms if a != REFERENCE]
    try:
        arms = make_arms(names, ctx.source, ctx.target, ctx.map, ctx.final, ctx.cfg.arms)
        return {a.name: a.batch_fn.func for a in arms}, {}
    except (ValueError, KeyError, FileNotFoundError, NotImplementedError) as e:
        log.warning("agreement: building the arms %s at once failed (%s); building them one by one", names, e)
    builders, skipped = {}, {}
    for name in names:
        try:
            arm, = make_arms([name], ctx.source, ctx.target, ctx.map, ctx.final, ctx.cfg.arms)
            builders[name] = arm.batch_fn.func
        except (ValueError, KeyError, FileNotFoundError, NotImplementedError) as e:
            skipped[name] = f"{type(e).__name__}: {e}"
            log.warning("agreement: arm %s skipped: %s", name, skipped[name])
    return builders, skipped


def run(ec: AgreementEval, ctx) -> dict:
    from kvjax.eval.token_agreement import agreement_table
    kl = ctx.cfg.eval.kl
    windows = windows_of(ctx.heldout, kl, first_row(ctx.cfg))
    builders, skipped = _built_arms(ec, ctx)
    table = agreement_table(builders, ctx.source, ctx.target, windows, kl.prefix_len, kl.batch_size) \
        if builders else {}
    arms = {name: {k: r[k].tolist() for k in KINDS + FIRST} for name, r in table.items()}
    baseline = next(iter(table.values()))["target_with_source"].tolist() if table else None
    for name, r in arms.items():
        log.info("agreement %-8s with the source %.4f, with the native target %.4f", name, np.mean(r["with_source"]),
                 np.mean(r["with_target"]))
    return {"arms": arms, "target_with_source": baseline, "reference": REFERENCE in ec.arms, "skipped": skipped,
            "windows": len(windows), "prefix_len": kl.prefix_len, "cont_len": kl.cont_len}


def _ci(values, n: int) -> list[float]:
    ci = bootstrap_ci(values, n=n)
    return [ci.lo, ci.hi]


def _disagreement_ratio(direct: float, arm: float) -> float | None:
    """(1 - direct) / (1 - arm); None where the arm never disagrees (unbounded)."""
    return None if 1.0 - arm <= 1e-12 else (1.0 - direct) / (1.0 - arm)


def metrics(ev: dict, ctx) -> dict:
    from kvjax.eval.arms import TARGET
    per = {a: {k: np.asarray(v, np.float64) for k, v in r.items()} for a, r in ev["arms"].items()}
    out = {k: {a: float(r[k].mean()) for a, r in per.items()} for k in KINDS + FIRST}
    out.update({f"{k}_ci95": {a: _ci(r[k], ctx.n_boot) for a, r in per.items()} for k in KINDS})
    if ev.get("target_with_source") is not None:
        out["target_with_source"] = float(np.mean(ev["target_with_source"]))
        if ev.get("reference"):  # the source answering: the teacher itself
            out["with_source"][REFERENCE], out["with_target"][REFERENCE] = 1.0, out["target_with_source"]
            out["first_with_source"][REFERENCE] = 1.0
            # the native target's first token vs the source's, when the target arm was built
            out["first_with_target"][REFERENCE] = out["first_with_source"].get(TARGET)
    others = [a for a in per if a != BASELINE]
    direct = per.get(BASELINE)
    out["minus_direct"], out["ratio_vs_direct"], out["ratio_vs_direct_ci95"], out["disagreement_ratio"] = \
        {}, {}, {}, {}
    for k in KINDS:
        for key in ("minus_direct", "ratio_vs_direct", "ratio_vs_direct_ci95", "disagreement_ratio"):
            out[key][k] = {}
        for a in others:
            if direct is None:  # not built in this run: unmeasured
                out["minus_direct"][k][a] = None
                out["ratio_vs_direct"][k][a] = out["ratio_vs_direct_ci95"][k][a] = None
                out["disagreement_ratio"][k][a] = None
                continue
            ci = paired_bootstrap_ci(per[a][k], direct[k], n=ctx.n_boot)
            out["minus_direct"][k][a] = {"mean": ci.mean, "ci95": [ci.lo, ci.hi]}
            out["ratio_vs_direct"][k][a], out["ratio_vs_direct_ci95"][k][a] = ratio_ci(per[a][k], direct[k],
                                                                                     n=ctx.n_boot)
            out["disagreement_ratio"][k][a] = _disagreement_ratio(float(direct[k].mean()), float(per[a][k].mean()))
    out.update(final=ctx.final, skipped=dict(ev.get("skipped") or {}), windows=ev["windows"],
               prefix_len=ev["prefix_len"], cont_len=ev["cont_len"],
               per_window={a: {k: r[k].tolist() for k in KINDS} for a, r in per.items()})
    return out


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def summary(ag: dict, ctx) -> list[str]:
    final = ag["final"]
    if final not in ag["with_source"]:
        return []
    s = (f"- Next-token agreement with the source: mapped ({final}) {pct(ag['with_source'][final])}"
         + (f", native target {pct(ag['target_with_source'])}" if "target_with_source" in ag else ""))
    if BASELINE in ag["with_source"]:
        s += (f", direct injection {pct(ag['with_source'][BASELINE])}: "
              f"{_ratio(ag['ratio_vs_direct']['with_source'].get(final))} over direct injection (disagreement "
              f"{_ratio(ag['disagreement_ratio']['with_source'].get(final))} lower); with the native target "
              f"{pct(ag['with_target'][final])} vs {pct(ag['with_target'][BASELINE])} "
              f"({_ratio(ag['ratio_vs_direct']['with_target'].get(final))}).")
    else:
        s += f"; direct injection not measured ({ag['skipped'].get(BASELINE, 'not among the arms')})."
    return [s]


def _cell(ag: dict, kind: str, a: str) -> str:
    if a not in ag[kind]:
        return "-"
    ci = ag.get(f"{kind}_ci95", {}).get(a)
    return pct(ag[kind][a]) + (f" [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else "")


def _vs_direct(ag: dict, a: str) -> str:
    if a in (BASELINE, REFERENCE):
        return "-"
    if ag["minus_direct"]["with_source"].get(a) is None:  # direct injection was not built
        return "unmeasured"
    return " / ".join(_ratio(ag["ratio_vs_direct"][k][a]) for k in KINDS)


def _disagree(ag: dict, a: str) -> str:
    if a in (BASELINE, REFERENCE) or a not in ag["disagreement_ratio"]["with_source"]:
        return "-"
    return " / ".join(_ratio(ag["disagreement_ratio"][k][a]) for k in KINDS)


def _minus(ag: dict, a: str) -> str:
    d = ag["minus_direct"]["with_source"].get(a)
    if a in (BASELINE, REFERENCE) or d is None:
        return "-" if a in (BASELINE, REFERENCE) else "unmeasured"
    lo, hi = d["ci95"]
    return f"{100 * d['mean']:+.1f} pts [{100 * lo:+.1f}, {100 * hi:+.1f}]"


def report(ag: dict, ctx) -> list[str]:
    from kvjax.eval.arms import ARMS, in_table_order
    arms = in_table_order(ag["with_source"])
    out = ["## Next-token agreement: every arm against direct injection", "",
           f"{ag['windows']} frozen held-out windows (the kl windows' rows); {ctx.source} reads {ag['prefix_len']} "
           f"prefix tokens, {ctx.target} reads each arm's cache of them and predicts the next {ag['cont_len']} "
           f"tokens; share of positions where its top token is the source's / the native {ctx.target}'s (its own "
           "decode having read the prefix itself). Ratio = arm / direct injection; disagreement ratio = (1 - direct) "
           "/ (1 - arm); intervals are 95% bootstrap, differences paired by window.", "",
           "| arm | with the source (95% CI) | with the native target (95% CI) | first token: source / target | "
           "ratio over direct: source / target | disagreement ratio: source / target | "
           "minus direct, with the source (paired 95% CI) |",
           "|---|---|---|---|---|---|---|"]
    for a in arms:
        first = " / ".join(pct(ag[k].get(a)) for k in FIRST)
        out.append(f"| {ARMS[a].label} | {_cell(ag, 'with_source', a)} | {_cell(ag, 'with_target', a)} | {first} | "
                   f"{_vs_direct(ag, a)} | {_disagree(ag, a)} | {_minus(ag, a)} |")
    out.append("")
    if REFERENCE in ag["with_source"]:
        out += [f"The {ARMS[REFERENCE].label} row is the teacher itself (no cache is built for the target): with the "
                "source 100% by definition, with the native target = the native target's agreement with the source.",
                ""]
    for a, why in ag.get("skipped", {}).items():
        out += [f"Arm {a} was not measured: {why}" + (" (every ratio to direct injection is unmeasured)."
                                                      if a == BASELINE else "."), ""]
    if "agreement" in ctx.charts:
        out += [f"![next-token agreement]({ctx.charts['agreement']})", ""]
    return out


def chart(ag: dict, path: str, ctx) -> str:
    """Per arm, two bars: agreement with the source's and with the native target's top token (95% intervals)."""
    from kvjax.eval import charts
    from kvjax.eval.arms import ARMS, in_table_order
    plt = charts.plt()
    from matplotlib.patches import Patch
    arms = in_table_order(ag["with_source"])
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(arms) + 2), 4.8))
    width, handles = 0.38, []
    for j, (kind, label, hatch) in enumerate((("with_source", "with the source's top token", ""),
                                              ("with_target", "with the native target's top token", "//"))):
        x = np.arange(len(arms)) + (j - 0.5) * width
        mean = np.array([ag[kind][a] for a in arms])
        cis = [ag.get(f"{kind}_ci95", {}).get(a) or [ag[kind][a]] * 2 for a in arms]
        err = np.stack([mean - np.array([c[0] for c in cis]), np.array([c[1] for c in cis]) - mean])
        bars = ax.bar(x, 100 * mean, width, yerr=100 * np.clip(err, 0, None), capsize=3, hatch=hatch,
                      color=[ARMS[a].colour for a in arms], edgecolor="black", linewidth=0.5,
                      alpha=1.0 if j == 0 else 0.6)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=4)
        handles.append(Patch(facecolor="0.6", edgecolor="black", hatch=hatch, alpha=1.0 if j == 0 else 0.6,
                             label=label))
    ax.set_xticks(range(len(arms)), [ARMS[a].label for a in arms], fontsize=8)
    final = ag["final"]
    ratio = ag["ratio_vs_direct"]["with_source"].get(final)
    title = f"Next-token agreement ({ag['windows']} held-out windows, {ag['cont_len']} positions each)"
    if ratio is not None:
        title += f"\n{ARMS[final].label}: {ratio:.2f}x direct injection's agreement with the source"
    ax.set(ylabel="agreement (% of positions), 95% bootstrap", ylim=(0, 112), title=title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles=handles, fontsize=8, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    return charts.save(fig, path)


def preflight(ec: AgreementEval, cfg) -> list[str]:
    """The arms; the window sizes are eval.kl's (its preflight checks them)."""
    problems = unknown_arms("eval.agreement", ec.arms)
    if ec.enabled and cfg is not None and cfg.eval.kl.prefix_len < 2:
        problems.append(f"eval.agreement reads eval.kl's windows: eval.kl.prefix_len must be >= 2, got "
                        f"{cfg.eval.kl.prefix_len}")
    return problems


def gate(ag: dict, config, map_arm: str) -> list:
    """agreement_vs_direct: the gated map's agreement with the source's argmax over direct injection's."""
    ratio = ((ag.get("ratio_vs_direct") or {}).get("with_source") or {}).get(map_arm)
    note = ""
    if ratio is None and ag:
        direct = (ag.get("with_source") or {}).get(BASELINE)
        note = (ag.get("skipped") or {}).get(BASELINE, "direct injection not measured") if direct is None else \
            f"direct injection agrees at {pct(direct)}: the ratio is unbounded" if direct <= 0 else \
            f"{map_arm} not measured"
    return check("agreement_vs_direct", ratio, config.min_agreement_vs_direct, "min", note)


EVALUATION = Evaluation(
    name="agreement", settings=AgreementEval, run=run, metrics=metrics, section=42, report=report, summary=summary,
    charts=(Chart("agreement", chart),), depends=lambda cfg: {"skip_rows": first_row(cfg), "kl_windows": _sizes(cfg)},
    heldout=lambda ec, cfg: (first_row(cfg) + cfg.eval.kl.windows, cfg.eval.kl.prefix_len + cfg.eval.kl.cont_len),
    preflight=preflight,
    gate=gate)

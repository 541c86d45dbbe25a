"""Evaluation `mc`: multiple choice (HellaSwag, PIQA schemas), every arm on the same items (continuation
log-likelihood), with bootstrap intervals, paired differences to the native target and the share of the target-to-
source gap each arm recovers, the final map against each peer map arm (per-head ridge, the method's ridge-only baseline)
and chance-normalised retention (each arm's margin over guessing as a share of the native target's / the source's).
metrics.json `mc`; the gate's mc_retention, mc_gap_recovered, mc_gain_ci_lo and mc_chance_retention."""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import numpy as np

from kvjax.eval.report import pct, pts
from kvjax.eval.stats import bootstrap_ci, paired_bootstrap_ci, ratio_ci
from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one, unknown_arms
from kvjax.eval.gate import check, retention

log = logging.getLogger(__name__)
SETS = ("hellaswag", "piqa")  # the schemas kvjax.eval.load_mc reads; each has its own settings field
PEERS = ("perhead", "ridge")  # maps the final map is compared with, paired by item: the per-head peer, the plain ridge
# options per item of each schema: chance = 1 / choices. Records written since they store it ("choices"); this is for
# the records made before (kvjax.eval.multiple_choice reads 4 endings per HellaSwag item, 2 solutions per PIQA item)
CHOICES = {"hellaswag": 4, "piqa": 2}


@dataclasses.dataclass(frozen=True)
class MCEval:
    enabled: bool = True
    hellaswag: str = "checkpoints/toy/eval/hellaswag.jsonl"  # local JSONL or hub dataset name; "" skips the set
    piqa: str = "checkpoints/toy/eval/piqa.jsonl"  # local JSONL or hub dataset name; "" skips the set
    split: str = "validation"  # split of hub datasets
    limit: int | None = 200  # first N items of each set (None: all)
    normalize: str = "length"  # option score: "length" (per token), "bytes" (acc_norm) or "none" (sum)
    arms: tuple[str, ...] = ("target", "source", "direct", "ridge", "residual", "partial")  # kvjax.eval.arms.TABLE
    batch_size: int = 8  # items scored together (x options rows)


def run(ec: MCEval, ctx) -> dict:
    from kvjax.eval.arms import make_arms, score_mc_arms
    from kvjax.eval.multiple_choice import load_mc
    arms = make_arms(ec.arms, ctx.source, ctx.target, ctx.map, ctx.final, ctx.cfg.arms)
    tokenizer = ctx.tokenizer()
    out = {}
    for schema in SETS:
        where = getattr(ec, schema)
        if not where:
            continue
        items = load_mc(where, schema=schema, split=ec.split, limit=ec.limit)
        results = score_mc_arms(items, tokenizer, arms, ec.normalize, ec.batch_size, desc=schema)
        out[schema] = {"items": len(items), "normalize": ec.normalize, "source": where,
                       "choices": len(items[0].options),  # every item has as many (score_mc_arms checks)
                       "arms": {name: {"correct": r.correct.tolist(), "predictions": r.predictions.tolist()}
                                for name, r in results.items()}}
        log.info("%s (%d items): %s", schema, len(items), {n: round(r.accuracy, 4) for n, r in results.items()})
    return out


def _gap(acc: dict, arm: str) -> float | None:
    from kvjax.eval.arms import SOURCE, TARGET
    gap = acc[SOURCE] - acc[TARGET]
    if arm not in acc or SOURCE not in acc or TARGET not in acc or abs(gap) < 1e-12:
        return None
    return (acc[arm] - acc[TARGET]) / gap


def metrics(ev: dict, ctx) -> dict:
    from kvjax.eval.arms import SOURCE, TARGET
    out = {}
    for name, s in ev.items():
        correct = {arm: np.asarray(v["correct"], np.float64) for arm, v in s["arms"].items()}
        acc = {arm: float(c.mean()) for arm, c in correct.items()}
        m = {"acc": acc, "acc_ci95": {arm: _ci(c, ctx.n_boot) for arm, c in correct.items()}, "items": s["items"],
             "normalize": s["normalize"]}
        if SOURCE in acc and TARGET in acc:
            m["gap_recovered"] = _gap(acc, ctx.final) if ctx.final in acc else None
            m["gap_recovered_by_arm"] = {arm: _gap(acc, arm) for arm in acc if arm not in (TARGET, SOURCE)}
        if TARGET in correct:
            deltas = {arm: paired_bootstrap_ci(c, correct[TARGET], n=ctx.n_boot) for arm, c in correct.items()
                      if arm != TARGET}
            m["delta_vs_target"] = {arm: {"mean": ci.mean, "ci95": [ci.lo, ci.hi]} for arm, ci in deltas.items()}
            if ctx.final in deltas:
                m["delta_vs_target_ci95"] = m["delta_vs_target"][ctx.final]["ci95"]
        if ctx.final in correct:  # is the final map ahead of the other maps on the same items, not only of the target?
            m["delta_vs_peer"] = {}
            for peer in (p for p in PEERS if p in correct and p != ctx.final):
                ci = paired_bootstrap_ci(correct[ctx.final], correct[peer], n=ctx.n_boot)
                m["delta_vs_peer"][peer] = {"mean": ci.mean, "ci95": [ci.lo, ci.hi]}
        choices = s.get("choices") or CHOICES.get(name)  # None: a set of unknown options per item
        if choices:
            m["choices"], m["chance"] = choices, 1.0 / choices
            m["chance_retention"] = _chance_retention(correct, m["chance"], ctx.n_boot)
        out[name] = m
    return out


def _chance_retention(correct: dict, chance: float, n_boot: int) -> dict:
    """{vs_target, vs_source}: {arm: {value, ci95}} for every arm that answers from a built cache: (arm - chance) /
    (reference - chance), the share of the reference's margin over guessing the arm keeps, paired by item. value
    None: the reference is at or below chance; ci95 None: its margin is not distinguishable from zero."""
    from kvjax.eval.arms import SOURCE, TARGET
    out = {}
    for key, ref in (("vs_target", TARGET), ("vs_source", SOURCE)):
        if ref not in correct:
            continue
        out[key] = {}
        for arm, c in correct.items():
            if arm in (TARGET, SOURCE):
                continue
            value, ci = ratio_ci(c - chance, correct[ref] - chance, n=n_boot)
            out[key][arm] = {"value": value, "ci95": ci}
    return out


def _delta(d: dict | None) -> str:
    return f"{100 * d['mean']:+.1f} pts {pts(d['ci95'])}" if d else "n/a"


def _ci(values, n: int) -> list[float]:
    ci = bootstrap_ci(values, n=n)
    return [ci.lo, ci.hi]


def summary(mc: dict, ctx) -> list[str]:
    from kvjax.eval.arms import SOURCE, TARGET
    out = []
    for name, m in mc.items():
        acc, final = m["acc"], ctx.final
        if final in acc and TARGET in acc:
            s = (f"- {name}: target {pct(acc[TARGET])}, mapped ({final}) {pct(acc[final])}"
                 + (f", source {pct(acc[SOURCE])}" if SOURCE in acc else ""))
            if m.get("delta_vs_target_ci95"):
                s += f"; mapped - target paired 95% CI {pts(m['delta_vs_target_ci95'])}"
            for peer, d in (m.get("delta_vs_peer") or {}).items():
                s += f"; mapped - {peer} {pts(d['ci95'])}"
            # a gap to recover only when the reader is the better model (small reads, large answers: it is not)
            if m.get("gap_recovered") is not None and acc.get(SOURCE, 0.0) > acc[TARGET]:
                s += f"; {pct(m['gap_recovered'])} of the target-to-source gap recovered"
            kept = ((m.get("chance_retention") or {}).get("vs_target") or {}).get(final)
            if kept and kept["value"] is not None:
                s += f"; it keeps {_kept(kept)} of the target's margin over chance ({pct(m['chance'])})"
            out.append(s + ".")
    return out


def report(mc: dict, ctx) -> list[str]:
    from kvjax.eval.arms import in_table_order
    arms = in_table_order(a for s in mc.values() for a in s["acc"])
    peers = [p for p in PEERS if any(p in (s.get("delta_vs_peer") or {}) for s in mc.values())]
    out = ["## Quality: multiple choice", "",
           "Every arm scores the same items (continuation log-likelihood); intervals are 95% percentile bootstrap, "
           "differences paired by item.", "",
           "| set | items | " + " | ".join(arms) + " | mapped - target (paired 95% CI) | gap recovered |"
           + "".join(f" mapped - {p} |" for p in peers),
           "|---|---|" + "---|" * len(arms) + "---|---|" + "---|" * len(peers)]
    for name, s in mc.items():
        cells = [f"{pct(s['acc'][a])} [{100 * s['acc_ci95'][a][0]:.1f}, {100 * s['acc_ci95'][a][1]:.1f}]"
                 if a in s["acc"] else "" for a in arms]
        delta = s.get("delta_vs_target", {}).get(ctx.final)
        out.append(f"| {name} | {s['items']} | " + " | ".join(cells) + " | "
                   + (f"{100 * delta['mean']:+.1f} pts {pts(delta['ci95'])}" if delta else "n/a") + " | "
                   + pct(s.get("gap_recovered")) + " |"
                   + "".join(f" {_delta((s.get('delta_vs_peer') or {}).get(p))} |" for p in peers))
    raw_kind = ctx.metrics.get("distances", {}).get("raw_kind", "see distances")
    out += ["", "Arms: target / source = the native models; direct = the source's nearest-depth layers injected "
            f"without a map ({raw_kind}); ridge / residual = the "
            "fitted maps. Gap recovered = (mapped - target) / (source - target).", ""]
    out += _chance_table(mc, arms)
    if "mc" in ctx.charts:
        out += [f"![multiple choice]({ctx.charts['mc']})", ""]
    return out


def _chance_table(mc: dict, arms: list[str]) -> list[str]:
    """Chance-normalised retention: (arm - chance) / (native target - chance) and / (source - chance)."""
    rows = []
    for name, s in mc.items():
        cr = s.get("chance_retention") or {}
        for a in arms:
            cells = [(cr.get(key) or {}).get(a) for key in ("vs_target", "vs_source")]
            if any(cells):
                rows.append(f"| {name} | {pct(s['chance'])} | {a} | " + " | ".join(_kept(c) for c in cells) + " |")
    if not rows:
        return []
    return ["Chance-normalised retention: the share of the reference's margin over guessing (1 / options per item) "
            "that the arm keeps, (arm - chance) / (reference - chance); 95% bootstrap intervals paired by item (n/a: "
            "the reference is at or below chance; no interval: its margin is not distinguishable from zero).", "",
            "| set | chance | arm | vs native target (95% CI) | vs source (95% CI) |", "|---|---|---|---|---|",
            *rows, ""]


def _kept(c: dict | None) -> str:
    if not c or c["value"] is None:
        return "n/a"
    return pct(c["value"]) + (f" [{100 * c['ci95'][0]:.1f}, {100 * c['ci95'][1]:.1f}]" if c["ci95"] else "")


def chart(mc: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    from kvjax.eval.arms import ARMS, in_table_order
    plt = charts.plt()
    sets = list(mc)
    arms = [a for a in in_table_order(ARMS) if all(a in mc[s]["acc"] for s in sets)]
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(sets) + 2), 4.2))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        x = np.arange(len(sets)) + (i - (len(arms) - 1) / 2) * width
        acc = np.array([mc[s]["acc"][arm] for s in sets])
        lo = np.array([mc[s]["acc_ci95"][arm][0] for s in sets])
        hi = np.array([mc[s]["acc_ci95"][arm][1] for s in sets])
        bars = ax.bar(x, 100 * acc, width, yerr=100 * np.stack([acc - lo, hi - acc]), capsize=3,
                      color=ARMS[arm].colour, label=ARMS[arm].label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=6)
    ax.set_xticks(range(len(sets)), [f"{s} ({mc[s]['items']} items)" for s in sets])
    ax.set(ylabel="accuracy (%), 95% bootstrap interval", ylim=(0, 105),
           title="Multiple choice: every arm on the same items")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(len(arms), 3), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return charts.save(fig, path)


def check_sources(ec: MCEval) -> list[str]:
    """Problems with the multiple-choice sources, found before any work."""
    problems = []
    for schema in SETS:
        where = getattr(ec, schema)
        if not where or os.path.isfile(where):
            continue
        if where.endswith((".jsonl", ".json")):
            problems.append(f"eval.mc.{schema}: no such file {where} (give a local JSONL file in the {schema} schema, "
                            "a hub dataset name, or '' to skip the set)")
        elif not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", where):
            problems.append(f"eval.mc.{schema}={where!r} is neither a local JSONL file nor a hub dataset name "
                            "(e.g. Rowan/hellaswag)")
    return problems


def preflight(ec: MCEval, cfg) -> list[str]:
    from kvjax.eval.multiple_choice import NORMALIZE, load_mc
    problems = at_least_one("eval.mc", ec, "batch_size") + unknown_arms("eval.mc", ec.arms)
    if not ec.enabled:
        return problems
    bad_sources = check_sources(ec)
    problems += bad_sources
    if ec.normalize not in NORMALIZE:
        problems.append(f"eval.mc.normalize={ec.normalize!r}: choose from {list(NORMALIZE)}")
    if not bad_sources:  # read the sets now: a wrong schema or an unreachable hub fails before any work
        for schema in SETS:
            where = getattr(ec, schema)
            try:
                if where:
                    load_mc(where, schema=schema, split=ec.split, limit=ec.limit)
            except (ValueError, RuntimeError, OSError) as e:
                problems.append(f"eval.mc.{schema}: {e}")
    return problems


def gate(mc: dict, config, map_arm: str) -> list:
    """Each check on the worst set (named in the check's note)."""
    from kvjax.eval.arms import TARGET
    worst, where = None, ""
    for name, m in mc.items():
        acc = m.get("acc", {})
        if map_arm in acc and TARGET in acc:
            r = retention(acc[map_arm], acc[TARGET])
            if r is not None and (worst is None or r < worst):
                worst, where = r, name
    checks = check("mc_retention", worst, config.min_mc_retention, "min", where)
    gaps = [(m["gap_recovered_by_arm"][map_arm], name) for name, m in mc.items()
            if (m.get("gap_recovered_by_arm") or {}).get(map_arm) is not None]
    worst, where = min(gaps, default=(None, ""))
    checks += check("mc_gap_recovered", worst, config.min_mc_gap_recovered, "min", where)
    lows = [(m["delta_vs_target"][map_arm]["ci95"][0], name) for name, m in mc.items()
            if map_arm in (m.get("delta_vs_target") or {})]
    worst, where = min(lows, default=(None, ""))
    checks += check("mc_gain_ci_lo", worst, config.min_mc_gain_ci_lo, "min", where)
    kept = [(r["value"], name) for name, m in mc.items()
            if (r := ((m.get("chance_retention") or {}).get("vs_target") or {}).get(map_arm))
            and r["value"] is not None]
    worst, where = min(kept, default=(None, ""))
    return checks + check("mc_chance_retention", worst, config.min_chance_retention, "min", where)


EVALUATION = Evaluation(
    name="mc", settings=MCEval, run=run, metrics=metrics, section=10, report=report, summary=summary,
    charts=(Chart("mc", chart),), preflight=preflight, gate=gate)

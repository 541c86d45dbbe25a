"""The launch job's evaluations, as a registry: `EVALUATIONS` below. The job (kvjax.launch) loops over it: one stage
per enabled evaluation (in this order, after the maps are fitted), then one report stage that builds metrics.json,
the gate, the charts and report.md from the evaluations' records. RunConfig.eval is built from it too
(`--config.eval.NAME.FIELD`).

Each evaluation is one module here exporting `EVALUATION = Evaluation(...)` (kvjax.eval.suite.evaluation): its
settings dataclass, how it runs, its metrics.json section, its report section, summary bullets and charts, the
settings outside its own it depends on, the held-out windows it reads, its preflight problems and its gate checks.
Modules import JAX, models and arms inside their functions only: their settings are part of RunConfig, which must
read without an accelerator stack.

Add an evaluation NAME
  1. Write kvjax/eval/suite/NAME.py: a frozen settings dataclass `NameEval` (first field `enabled: bool = True`;
     its defaults are the default job's), `run(settings, ctx: EvalContext) -> dict` (a JSON record of per-item
     results: the report stage derives everything else, so a report rebuilds without models),
     `metrics(record, ctx: MetricsContext) -> dict`, and `EVALUATION = Evaluation(name="NAME", settings=NameEval,
     run=run, metrics=metrics, section=S, ...)` with whichever of report / summary / charts / depends / heldout /
     preflight / gate it needs (kl.py is a compact example; `section` places it in report.md: mc 10, ttft 15,
     throughput 20, speculative 25, dflash 26, distances 30, rank_sweep 32, native_kl 35, kl 40, agreement 42,
     rollout 45, retrieval 50, ruler 55, audio 60).
  2. Add `NAME.EVALUATION` to EVALUATIONS below (the position is the stage order).
  Then `python -m kvjax.launch` runs stage NAME (`--redo=NAME`, `--config.eval.NAME.enabled=false`), writes
  eval/NAME.json and metrics.json key NAME; document that key in docs/metrics.md. A gate threshold is a
  `--config.gate.*` setting: a field of kvjax.eval.gate.GateConfig that the evaluation's `gate` reads.

Add an arm (a way to build the answering model's cache, e.g. a new kvjax.builders builder)
  1. Write the builder's module: calling it on (tokens int [B, T], lengths int [B]) gives the answering model's
     KVCache of each row's tokens[:length]; `.model` is the answering model (cfg, params).
  2. Add one `ArmSpec(name, label, colour, cache=lambda c: Builder(c.source, c.target, c.map("residual")),
     needs="residual")` row to kvjax.eval.arms.TABLE (`needs`: the fitted map it reads, so runs without that map
     leave it out; the row's position is its report column and legend position).
  Every evaluation with an `arms` setting (mc, retrieval) then scores it when named: `--config.eval.mc.arms=
  target,source,NAME`; add it to those settings' defaults (mc.py, retrieval.py) to score it in the default job.
"""

from __future__ import annotations

import dataclasses
import os

from kvjax.eval.suite import (agreement, audio, dflash, distances, kl, mc, native_kl, rank_sweep, retrieval, rollout,
                               ruler, speculative, throughput, ttft)
from kvjax.eval.suite.evaluation import (Chart, ChartContext, EvalContext, Evaluation, MetricsContext,
                                         ReportContext)

EVALUATIONS: tuple[Evaluation, ...] = (
    distances.EVALUATION,
    rank_sweep.EVALUATION,  # off by default (it refits): the reduced-rank ridge at ten ranks, three criteria
    kl.EVALUATION,
    agreement.EVALUATION,  # every arm's next-token agreement with the source / native target, over direct injection
    rollout.EVALUATION,  # off by default: the method's 32-step divergence of the target decoding from each map's cache
    mc.EVALUATION,
    retrieval.EVALUATION,
    ruler.EVALUATION,  # off by default: RULER-style multi-task retrieval (unseen needle formats, multi-key, VT)
    throughput.EVALUATION,
    native_kl.EVALUATION,  # small reads, large answers (off by default): the answerer's KL to its own predictions
    ttft.EVALUATION,  # ... and its time to first token from the reader's prefill
    speculative.EVALUATION,  # ... and speculative decoding, the reader drafting (plain, and from a transferred cache)
    dflash.EVALUATION,  # off by default: lossless block drafting (kvjax.drafter) for one model, vs its greedy decode
    audio.EVALUATION,  # off by default (--config=toy_audio): a model that listened hands its audio cache over
)
BY_NAME = {e.name: e for e in EVALUATIONS}
NAMES = tuple(BY_NAME)
BOOTSTRAP = 10_000  # default bootstrap resamples for the 95% intervals (eval.bootstrap)

__all__ = ["EVALUATIONS", "BY_NAME", "NAMES", "Evaluation", "EvalContext", "MetricsContext", "ReportContext", "Chart",
           "ChartContext", "eval_config_type", "settings_of", "stage_settings", "run", "heldout_needed", "preflight",
           "build_metrics", "evaluate_gate", "draw_charts", "render_report"]


def eval_config_type() -> type:
    """RunConfig.eval's type: one field per evaluation (its settings, defaults as the default job's), then the
    bootstrap resamples."""
    fields = [(e.name, e.settings, dataclasses.field(default=e.settings())) for e in EVALUATIONS]
    fields.append(("bootstrap", int, dataclasses.field(default=BOOTSTRAP)))
    cls = dataclasses.make_dataclass("EvalConfig", fields, frozen=True)
    cls.__module__ = "kvjax.run.config"  # where configs import it from
    return cls


def settings_of(e: Evaluation, cfg, fitted: tuple[str, ...]):
    """The evaluation's settings as it runs: an `arms` setting keeps only the arms this run can build (a run
    without a residual has no residual arm)."""
    from kvjax.eval.arms import available
    ec = getattr(cfg.eval, e.name)
    if "arms" in {f.name for f in dataclasses.fields(ec)}:
        ec = dataclasses.replace(ec, arms=available(ec.arms, fitted))
    return ec


def stage_settings(e: Evaluation, cfg, fitted: tuple[str, ...]) -> dict:
    """What the evaluation's stage depends on (kvjax.job: a change reruns it): its settings, the final map, the
    arms it can build and whatever else it declares."""
    from kvjax.config_flags import to_dict
    ec = settings_of(e, cfg, fitted)
    out = {e.name: to_dict(getattr(cfg.eval, e.name)), "final": fitted[-1]}
    if "arms" in out[e.name]:
        from kvjax.eval.arms import ARMS
        out["arms"] = list(ec.arms)
        fields = [f for a in ARMS if a in ec.arms for f in ARMS[a].reads_settings]
        if fields:
            settings = to_dict(cfg.arms)
            out["arm_settings"] = {f: settings[f] for f in fields}
    return {**out, **e.depends(cfg)}


def run(e: Evaluation, cfg, ctx: EvalContext) -> dict:
    return e.run(settings_of(e, cfg, ctx.fitted), ctx)


def heldout_needed(cfg) -> tuple[int, int, list[str]]:
    """(rows, tokens per row, names) of the held-out windows the enabled evaluations read."""
    rows, length, names = 0, 0, []
    for e in EVALUATIONS:
        ec = getattr(cfg.eval, e.name)
        r, n = e.heldout(ec, cfg)
        if ec.enabled and (r or n):
            rows, length, names = max(rows, r), max(length, n), names + [e.name]
    return rows, length, names


def preflight(cfg) -> list[str]:
    """Every evaluation's problems with its settings (and the inputs it names), before any work."""
    return [p for e in EVALUATIONS for p in e.preflight(getattr(cfg.eval, e.name), cfg)]


def build_metrics(records: dict, run_info: dict, n_boot: int, final: str) -> dict:
    """metrics.json without the gate (evaluate_gate reads this, then the job adds metrics["gate"]). `records`:
    name -> eval/NAME.json of the evaluations that ran."""
    from kvjax.eval.report import SCHEMA_VERSION
    ctx = MetricsContext(n_boot, final)
    metrics = {"schema_version": SCHEMA_VERSION, "run": run_info}
    for e in EVALUATIONS:
        if e.name in records:
            metrics[e.name] = e.metrics(records[e.name], ctx)
    return metrics


def evaluate_gate(metrics: dict, config, map_arm: str | None = None):
    """The quality gate (kvjax.eval.gate.GateResult) of the map `map_arm` (default: the residual) on held-out `metrics`
    (the metrics.json layout): every evaluation's checks, in registry order; an evaluation that did not run gives
    unmeasured checks."""
    from kvjax.eval.arms import RESIDUAL
    from kvjax.eval.gate import judge
    map_arm = map_arm or RESIDUAL
    checks = [c for e in EVALUATIONS for c in e.gate(metrics.get(e.name) or {}, config, map_arm)]
    return judge(checks, config, map_arm)


def _in_report_order() -> list[Evaluation]:
    return sorted(EVALUATIONS, key=lambda e: e.section)


def draw_charts(metrics: dict, out_dir: str, source: str, target: str) -> dict[str, str]:
    """Every chart the metrics allow, in report order; returns {chart name: file name in out_dir}. `source`,
    `target`: the models' display names."""
    ctx, drawn = ChartContext(source, target, metrics), {}
    for e in _in_report_order():
        section = metrics.get(e.name)
        for chart in e.charts:
            if section and chart.when(section):
                chart.draw(section, os.path.join(out_dir, f"{chart.name}.png"), ctx)
                drawn[chart.name] = f"{chart.name}.png"
    return drawn


def render_report(metrics: dict, charts: dict[str, str]) -> str:
    """report.md: kvjax.eval.report's frame around the evaluations' summary bullets and sections."""
    from kvjax.eval import report
    run_info = metrics["run"]
    ctx = ReportContext(metrics, charts, metrics["gate"]["map"], run_info["source"]["name"],
                        run_info["target"]["name"])
    ordered = [e for e in _in_report_order() if metrics.get(e.name)]
    lines = report.header(metrics)
    lines += ["## Summary", "", report.gate_bullet(metrics["gate"])]
    lines += [line for e in ordered for line in e.summary(metrics[e.name], ctx)] + [""]
    lines += [line for e in ordered for line in e.report(metrics[e.name], ctx)]
    lines += report.gate_section(metrics["gate"]) + report.setup_section(run_info)
    return "\n".join(lines) + "\n"

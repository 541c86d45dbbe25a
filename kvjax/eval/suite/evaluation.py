"""What one evaluation of the launch job is (the record each module of kvjax.eval.suite exports) and the contexts the
job hands it.

No JAX at import time, here or at the top of an evaluation module: an evaluation's settings dataclass is a field of
RunConfig (kvjax.run.config), which reads without an accelerator stack. An evaluation imports the models, maps and
arms it runs inside its functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple


def _nothing(*_) -> list:
    return []


def _no_settings(*_) -> dict:
    return {}


def _no_windows(*_) -> tuple[int, int]:
    return 0, 0


@dataclasses.dataclass(frozen=True)
class EvalContext:
    """What the job hands an evaluation's `run`: models, maps, held-out data, tokenizer and the run's settings."""

    cfg: Any  # the whole RunConfig: settings outside the evaluation's own (seed, another evaluation's windows)
    source: tuple  # (DecoderConfig, Params) of the model that reads
    target: tuple  # (DecoderConfig, Params) of the model that answers
    map: Callable[[str], Any]  # a KVMap by name, loaded on first use: "raw" (injection), "direct", a fitted map
    fitted: tuple[str, ...]  # the maps this run fits, in order; the last is the final map (gated, timed)
    heldout: Any  # int [N, T] held-out token windows (data/heldout.npy)
    tokenizer: Callable[[], Any]  # the pair's tokenizer
    # a directory of the evaluation's own for what it makes beyond its record (the audio evaluation's audio map,
    # which the server loads); created on first use
    artifacts: str = ""

    @property
    def final(self) -> str:
        return self.fitted[-1]


class MetricsContext(NamedTuple):
    n_boot: int  # bootstrap resamples for the 95% intervals (eval.bootstrap)
    final: str  # the final map's arm name


class ReportContext(NamedTuple):
    metrics: dict  # the whole metrics.json (gate included): a section may quote another evaluation's numbers
    charts: dict  # chart name -> file name in the run directory (only the charts that were drawn)
    final: str  # the gated map's arm name
    source: str  # display names of the two models
    target: str


class Chart(NamedTuple):
    name: str  # file stem (NAME.png) and the key in metrics.run.charts / ReportContext.charts
    draw: Callable  # (its metrics section, path, ChartContext) -> path
    when: Callable[[dict], bool] = bool  # drawn only when this holds for the (non-empty) metrics section


class ChartContext(NamedTuple):
    source: str  # display names of the two models
    target: str
    # the whole metrics.json: a chart that draws the speed of an arm answering from another cache
    # labels it with that arm's quality, which other evaluations measure (kvjax.eval.report.quality_tag)
    metrics: dict | None = None


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation of `python -m kvjax.launch`: stage NAME, eval/NAME.json, metrics.json key NAME, settings
    `--config.eval.NAME.*`. Every function is pure apart from `run` (which computes) and the chart `draw`s (which
    write their file)."""

    name: str
    settings: type  # frozen dataclass of its settings (an `enabled: bool` field first); defaults = the default job
    run: Callable[[Any, EvalContext], dict]  # (settings, ctx) -> JSON record of per-item / per-window results
    metrics: Callable[[dict, MetricsContext], dict]  # record -> its metrics.json section (schema: docs/metrics.md)
    section: int  # place of its report.md section and summary lines (lower first; see kvjax.eval.suite)
    report: Callable[[dict, ReportContext], list[str]] = _nothing  # metrics section -> its report.md lines
    summary: Callable[[dict, ReportContext], list[str]] = _nothing  # metrics section -> its "## Summary" bullets
    charts: tuple[Chart, ...] = ()
    # settings outside its own that its result depends on (the stage hash: changing them reruns it), from RunConfig
    depends: Callable[[Any], dict] = _no_settings
    # (rows, length) of the held-out windows it reads: rows [0, rows) of at least `length` tokens (0, 0: none)
    heldout: Callable[[Any, Any], tuple[int, int]] = _no_windows
    preflight: Callable[[Any, Any], list[str]] = _nothing  # (settings, RunConfig) -> problems, before any work
    # (its metrics section or {} when it did not run, GateConfig, gated map) -> kvjax.eval.gate.Check list
    # (kvjax.eval.gate.check)
    gate: Callable[[dict, Any, str], list] = _nothing


def at_least_one(prefix: str, settings, *fields: str) -> list[str]:
    """Problems with integer settings that must be >= 1 (named as --config.PREFIX.FIELD)."""
    return [f"{prefix}.{f} must be >= 1, got {getattr(settings, f)}" for f in fields if getattr(settings, f) < 1]


def unknown_arms(prefix: str, names) -> list[str]:
    """A problem when `names` holds a name that is not in the arm table (kvjax.eval.arms)."""
    from kvjax.eval.arms import ARMS
    bad = [a for a in names if a not in ARMS]
    return [f"{prefix}.arms: unknown arms {bad}; choose from {list(ARMS)}"] if bad else []

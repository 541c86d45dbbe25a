"""A run directory's layout, read from the config alone (no models, no files, no JAX): the stages a run has, in
order, and where the fitted maps are. The job (kvjax.job: its plan, the space estimate), the server (the final map)
and the compile-only plan (kvjax.plan) read it before any work.

MAP_DIRS is the one table of the fitted maps' directories in a run directory, by arm name (kvjax.eval.arms): the
job's outputs, its loading and sizing of maps and the server's final map all read it.
"""

from __future__ import annotations

from kvjax.eval import suite
from kvjax.run.config import RunConfig

MAP_DIRS = {"ridge": "map_ridge", "residual": "map", "perhead": "map_perhead", "bridge": "map_bridge"}
EVALS = suite.NAMES  # the evaluation registry (kvjax.eval.suite), one stage each
STAGES = ("calibrate", "ridge", "residual", "perhead", "bridge", *EVALS, "report")  # every stage there is, in order
COLLECTIVE = ("ridge", "residual")  # the data-parallel stages: every process of a multi-process run takes part


def fitted_maps(cfg: RunConfig) -> tuple[str, ...]:
    """The maps this run fits, each named after the stage that fits it (and its arm in kvjax.eval.arms), the final
    map last: the one the gate judges and throughput times."""
    peers = (("perhead",) if cfg.peers.perhead_topk > 0 else ()) + (("bridge",) if cfg.peers.bridge_topk > 0 else ())
    # the peers before the run's own maps: the final one is last
    return (*peers, "ridge", "residual") if cfg.residual.steps > 0 else (*peers, "ridge")


def final_arm(cfg: RunConfig) -> str:
    return fitted_maps(cfg)[-1]


def stage_names(cfg) -> tuple[str, ...]:
    """The stages `cfg` runs, in order: calibrate, ridge, residual (when it trains), the peer maps fitted, each enabled
    evaluation in the registry's order, report."""
    peers = (("perhead",) if cfg.peers.perhead_topk > 0 else ()) + (("bridge",) if cfg.peers.bridge_topk > 0 else ())
    evals = tuple(ev.name for ev in suite.EVALUATIONS if getattr(cfg.eval, ev.name).enabled)
    return ("calibrate", "ridge", *(("residual",) if cfg.residual.steps > 0 else ()), *peers, *evals, "report")

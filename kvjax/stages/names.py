"""The stages a config runs, in order, by name: read from the config alone (no models, no files), for what needs
them before any work: the run directory's space estimate (kvjax.stages.disk), the job's plan (kvjax.stages.plan) and
the compile-only plan (kvjax.plan)."""

from __future__ import annotations

from kvjax.eval import suite


def stage_names(cfg) -> tuple[str, ...]:
    """calibrate, ridge, residual (when it trains), the peer maps fitted, each enabled evaluation in the registry's
    order, report."""
    peers = (("perhead",) if cfg.peers.perhead_topk > 0 else ()) + (("bridge",) if cfg.peers.bridge_topk > 0 else ())
    evals = tuple(ev.name for ev in suite.EVALUATIONS if getattr(cfg.eval, ev.name).enabled)
    return ("calibrate", "ridge", *(("residual",) if cfg.residual.steps > 0 else ()), *peers, *evals, "report")

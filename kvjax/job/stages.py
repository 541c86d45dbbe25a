"""The job's plan: every stage a config runs with the settings it depends on, so that its hash is known before any
work and a rerun reuses what a finished stage wrote (kvjax.job.markers). No JAX here."""

from __future__ import annotations

from kvjax import corpus
from kvjax.config_flags import to_dict
from kvjax.eval import suite
from kvjax.job.markers import Stage, model_identity
from kvjax.run.config import RunConfig
from kvjax.run.layout import MAP_DIRS, fitted_maps


def plan(cfg: RunConfig) -> dict[str, Stage]:
    """Every stage with the settings it depends on (hashes are known before any work). A stage's hash is that of
    its settings and its upstream stages' hashes (kvjax.job.markers.Stage): what is written here decides whether
    a rerun reuses a finished stage, so a change to it makes every earlier run directory recompute."""
    models = {role: {"path": getattr(cfg, role).path, "dtype": getattr(cfg, role).dtype,
                     "identity": model_identity(getattr(cfg, role).path)} for role in ("source", "target")}
    d = to_dict(cfg)
    data = {"data": cfg.data.hashed(), "tokenizer": models["target"]["identity"].get("tokenizer.json"),
            "windows": {k: d["map"][k] for k in ("calib_windows", "select_windows", "window_len")}, "seed": cfg.seed}
    texts = cfg.data.train_text + (cfg.data.heldout_text if not cfg.data.heldout_windows else ())
    if any(corpus.dataset(s) for s in texts):  # a dataset's local files (a hub dataset: its name), as read now
        data["corpus"] = {s: corpus.identity(s) for s in dict.fromkeys(texts) if corpus.dataset(s)}
    calibrate = Stage("calibrate", data, [], ["data"])
    ridge = Stage("ridge", {"models": models, "map": d["map"], "seed": cfg.seed}, [calibrate], [MAP_DIRS["ridge"]])
    stages = {"calibrate": calibrate, "ridge": ridge}
    final = ridge
    if cfg.residual.steps > 0:
        final = stages["residual"] = Stage("residual", {"residual": cfg.residual.hashed()}, [ridge],
                                           [MAP_DIRS["residual"], "residual"])
    peers = []
    if cfg.peers.perhead_topk > 0:  # the per-head ridge peer (kvjax.fitting.perhead), on the same calibration windows
        own = {k: v for k, v in d["peers"].items() if k.startswith("perhead_")}  # other peers' fields: not its hash
        peers.append(Stage("perhead", {"models": models, "peers": own, "batch_size": cfg.map.batch_size},
                           [calibrate], [MAP_DIRS["perhead"]]))
        stages["perhead"] = peers[-1]
    if cfg.peers.bridge_topk > 0:  # the bridge map (kvjax.fitting.bridge), on the ridge's pairing and windows
        own = {k: v for k, v in d["peers"].items() if k.startswith("bridge_")}
        peers.append(Stage("bridge", {"models": models, "peers": own, "batch_size": cfg.map.batch_size},
                           [calibrate, ridge], [MAP_DIRS["bridge"]]))
        stages["bridge"] = peers[-1]
    evals = []
    for ev in suite.EVALUATIONS:
        if getattr(cfg.eval, ev.name).enabled:
            stages[ev.name] = Stage(ev.name, suite.stage_settings(ev, cfg, fitted_maps(cfg)),
                                    [calibrate, ridge, final, *peers], [f"eval/{ev.name}.json"])
            evals.append(stages[ev.name])
    stages["report"] = Stage("report", {"gate": cfg.gate.hashed(), "bootstrap": cfg.eval.bootstrap,
                                        "names": [cfg.source.name, cfg.target.name]},
                             evals + [final], ["report.md", "metrics.json", "gate.json"])
    return stages

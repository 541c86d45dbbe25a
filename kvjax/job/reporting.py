"""Stage report -> metrics.json, report.md, the charts and gate.json: the evaluations' records (eval/*.json) turned
into metrics, judged by the quality gate, rendered (kvjax.eval.suite), with what the run was (run_info)."""

from __future__ import annotations

import logging
import os
import time

import jax

import kvjax
from kvjax.config_flags import to_dict
from kvjax.eval import suite
from kvjax.eval.gate import save_gate
from kvjax.hf import load_hf_config
from kvjax.mapper.artifact import read_manifest
from kvjax.job.markers import Stage, read_json, write_json
from kvjax.run.layout import EVALS, MAP_DIRS, final_arm, fitted_maps

log = logging.getLogger("kvjax.launch")


def run(job, stage: Stage) -> None:
    """`job`: the run's kvjax.job.execute.Job (its plan and the seconds of the stages it ran)."""
    cfg = job.cfg
    records = {name: read_json(job.run.path("eval", f"{name}.json")) for name in EVALS if name in job.stages}
    final = final_arm(cfg)
    metrics = suite.build_metrics(records, run_info(job), cfg.eval.bootstrap, final)
    gate = suite.evaluate_gate(metrics, cfg.gate, final)
    metrics["gate"] = gate.to_json()
    drawn = suite.draw_charts(metrics, job.run.root, cfg.source.name, cfg.target.name)
    metrics["run"]["charts"] = drawn
    write_json(job.run.path("metrics.json"), metrics)
    text = suite.render_report(metrics, drawn)
    tmp = job.run.path("report.md.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, job.run.path("report.md"))
    # last: gate.json is what says a run finished to its readers (kvjax.serve serves a run's map only beside it)
    save_gate(job.run.path("gate.json"), gate)
    log.info("quality gate: %s", gate.summary())


def run_info(job) -> dict:
    """metrics.json's "run": the config, the models, the final map, the data, the devices, the stages' seconds and
    each fitted map's cost."""
    cfg = job.cfg
    manifest = read_manifest(job.run.path(MAP_DIRS[final_arm(cfg)]))  # the final map's directory
    data = read_json(job.run.path("data", "data.json"))
    info = {"config": cfg.name, "output_dir": cfg.output_dir, "settings": to_dict(cfg)}
    for role in ("source", "target"):
        mc = getattr(cfg, role)
        mcfg = load_hf_config(mc.path)
        info[role] = {"name": mc.name, "path": mc.path, "dtype": mc.dtype, "params_m": mcfg.num_params() / 1e6,
                      "layers": mcfg.num_layers, "kv_heads": mcfg.num_kv_heads, "head_dim": mcfg.head_dim,
                      "fingerprint": mcfg.fingerprint()}
    mi = manifest["info"]
    info["map"] = {"pairing": mi["pairing"], "rank": mi["rank"], "lambdas": mi["lambdas"],
                   "heldout_r2": mi["heldout_r2"], "residual_rank": manifest["spec"]["residual_rank"],
                   "residual_steps": mi.get("residual_steps", 0),
                   "residual_context": max(manifest[k][0].get("context", 0) for k in ("layers", "value_layers")),
                   "residual_context_kinds": "".join(c for c, k in (("k", "layers"), ("v", "value_layers"))
                                                     if manifest[k][0].get("context", 0)),
                   "residual_attention": manifest["layers"][0].get("heads", 0),
                   "ridge_trained": bool(cfg.residual.train_ridge and mi.get("residual_steps", 0)),
                   "final": final_arm(cfg)}
    info["data"] = {"train_text": data["train_text"], "train_tokens": data["train_tokens"],
                    "calib_tokens": mi["calib_tokens"], "heldout_windows": data["heldout_windows"]}
    info["devices"] = f"{jax.device_count()} x {jax.devices()[0].platform} ({jax.devices()[0].device_kind})"
    info["versions"] = {"kvjax": kvjax.__version__, "jax": jax.__version__}
    info["stage_seconds"] = {name: job.run.seconds(s) or job.seconds.get(name, 0.0)
                             for name, s in job.stages.items() if name != "report"}
    info["maps"] = map_costs(job, info["stage_seconds"])
    info["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return info


def map_costs(job, stage_seconds: dict) -> dict:
    """Per fitted map: its size in bytes and the wall seconds of the stages that fitted it (the residual's
    include the ridge it starts from)."""
    out = {}
    for name in fitted_maps(job.cfg):
        seconds = stage_seconds.get(name) or 0.0
        if name == "residual":
            seconds += stage_seconds.get("ridge") or 0.0
        out[name] = {"size_bytes": map_size_bytes(read_manifest(job.run.path(MAP_DIRS[name])), job.map(name),
                                                  name), "fit_seconds": seconds}
    return out


def map_size_bytes(manifest: dict, kvmap, name: str) -> int:
    """Bytes of a fitted map's float32 parameters as the method stores them: the ridge's mu, w_in, w_out, bias per
    target layer and kind; the residual adds its network (a context map's down_prev, a cross-position map's attention too); the per-head peer its
    per-head blocks (its manifest)."""
    if "size_bytes" in manifest["info"]:
        return int(manifest["info"]["size_bytes"])
    parts = ("mu", "w_in", "w_out", "bias") + (("down", "res_bias", "up", "down_prev", "att_q", "att_k", "att_v",
                                                 "att_o") if name == "residual" else ())
    return int(sum(4 * getattr(m, p).size for m in (*kvmap.keys, *kvmap.values) for p in parts
                   if getattr(m, p) is not None))

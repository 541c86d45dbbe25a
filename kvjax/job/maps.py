"""The stages that fit maps: ridge -> map_ridge/ (both models over the calibration windows, a ridge per target layer
for K and V), residual -> map/ (the residual on source-teacher KL, resumable from its orbax checkpoints in
residual/), perhead -> map_perhead/ (the per-head ridge peer), bridge -> map_bridge/ (the head-matched,
attention-weighted bridge map on the ridge's pairing). Directories: kvjax.run.layout.MAP_DIRS."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.fitting.bridge import fit_bridge
from kvjax.fitting.fit import fit_map
from kvjax.fitting.perhead import fit_perhead
from kvjax.fitting.residual import train_residual
from kvjax.hf import tokenizer_fingerprint
from kvjax.mapper.artifact import read_manifest, save_map
from kvjax.job.markers import Stage, read_json
from kvjax.run.layout import MAP_DIRS

log = logging.getLogger("kvjax.launch")


def ridge(job, stage: Stage) -> None:
    """`job`: the run's kvjax.job.context.Context (for this and the other stages here)."""
    cfg = job.cfg
    source, target = job.models()
    pairing = "depth" if cfg.map.pairing == "depth" else int(cfg.map.pairing[3:])
    calib, select = np.asarray(job.data("calib")), np.asarray(job.data("select"))
    kvmap, report = fit_map(source, target, calib, select, pairing=pairing, rank=cfg.map.rank,
                            residual_rank=cfg.map.residual_rank, batch_size=cfg.map.batch_size,
                            seed=cfg.seed, mesh=job.parallel_mesh(),
                            tokenizers=tuple(tokenizer_fingerprint(m.path) for m in (cfg.source, cfg.target)))
    data = read_json(job.run.path("data", "data.json"))
    info = {"source": cfg.source.path, "target": cfg.target.path, "config": cfg.name,
            "calib_sha256": data["sha256"]["calib"], "calib_tokens": report["calib_tokens"],
            "heldout_tokens": report["heldout_tokens"], "pairing": report["pairing"], "rank": cfg.map.rank,
            "lambdas": [[r["key"]["lambda"], r["value"]["lambda"]] for r in report["layers"]],
            "heldout_r2": [[r["key"]["heldout_r2"], r["value"]["heldout_r2"]] for r in report["layers"]],
            "residual_steps": 0}
    save_map(job.run.path(MAP_DIRS["ridge"]), kvmap, info=info)
    log.info("ridge: pairing %s, held-out R^2 (key, value) per layer %s", report["pairing"],
             [[round(x, 3) for x in r] for r in info["heldout_r2"]])


def residual(job, stage: Stage) -> None:
    source, target = job.models()
    workdir = job.run.path("residual")
    job.run.claim_workdir(stage, workdir)
    kvmap, history = train_residual(job.map("ridge"), source, target, np.asarray(job.data("train_tokens")),
                                    job.cfg.residual, workdir=workdir, mesh=job.parallel_mesh(),
                                    tokenizer=job.tokenizer())
    info = dict(read_manifest(job.run.path(MAP_DIRS["ridge"]))["info"], residual_steps=job.cfg.residual.steps,
                residual=dataclasses.asdict(job.cfg.residual))
    save_map(job.run.path(MAP_DIRS["residual"]), kvmap, info=info)
    job.forget_map("residual")
    if history:
        log.info("residual: training KL %.4f -> %.4f over steps %d..%d", history[0]["kl"], history[-1]["kl"],
                 history[0]["step"], history[-1]["step"])


def perhead(job, stage: Stage) -> None:
    source, target = job.models()
    peers = job.cfg.peers
    kvmap, report = fit_perhead(source, target, np.asarray(job.data("calib")), k=peers.perhead_topk,
                                lam=peers.perhead_lambda, batch_size=job.cfg.map.batch_size)
    info = {"source": job.cfg.source.path, "target": job.cfg.target.path, "config": job.cfg.name,
            "peer": "per-head ridge (Heo et al.)", **report}
    save_map(job.run.path(MAP_DIRS["perhead"]), kvmap, info=info)
    log.info("perhead: top-%d source layers per head, lambda %g, pairing (union per layer) %s, %d bytes, fit "
             "%.1fs", peers.perhead_topk, peers.perhead_lambda, report["pairing"], report["size_bytes"],
             report["fit_seconds"])


def bridge(job, stage: Stage) -> None:
    source, target = job.models()
    peers = job.cfg.peers
    pairing = read_manifest(job.run.path(MAP_DIRS["ridge"]))["info"]["pairing"]  # the ridge's source layers
    kvmap, report = fit_bridge(source, target, np.asarray(job.data("calib")), np.asarray(job.data("select")),
                               k=peers.bridge_topk, pairing=pairing, weighted=peers.bridge_weighted,
                               clip=peers.bridge_clip or None, batch_size=job.cfg.map.batch_size)
    info = {"source": job.cfg.source.path, "target": job.cfg.target.path, "config": job.cfg.name,
            "peer": "bridge (head-matched, attention-weighted ridge)", **report}
    save_map(job.run.path(MAP_DIRS["bridge"]), kvmap, info=info)
    job.forget_map("bridge")
    log.info("bridge: top-%d source heads per target head on pairing %s (%s), held-out R^2 (key, value) per layer "
             "%s, %d bytes, fit %.1fs", peers.bridge_topk, report["pairing"],
             f"attention-weighted, clip {peers.bridge_clip:g}" if peers.bridge_weighted else "unweighted",
             [[round(x, 3) for x in r] for r in report["heldout_r2"]], report["size_bytes"], report["fit_seconds"])

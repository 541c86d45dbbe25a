"""The main job's programs, stage by stage, for a RunConfig on a slice: what `python -m kvjax.launch` would compile.

The stages are the job's own plan (kvjax.run.layout): calibrate (host work only: tokenizing and cutting windows),
ridge / residual / perhead / bridge (kvjax.plan.fitting), one stage per enabled evaluation (kvjax.plan.evals, one
entry per evaluation of the registry), report (host work only). Every stage holds both models once loaded
(kvjax.job.context loads the pair on first use), so a stage's resident set is both models' weights plus its
largest program's working memory.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.plan import evals, fitting, shapes
from kvjax.plan.hardware import PlanError, Slice
from kvjax.plan.program import Program
from kvjax.plan.programs import Builder
from kvjax.run.preflight import ROLES
from kvjax.run.layout import stage_names
from kvjax.run.layout import final_arm, fitted_maps

HOST_ONLY = ("calibrate", "report")  # stages that compile nothing


def mesh_for(cfg, sl: Slice):
    """The job's mesh on the slice's devices (kvjax.run.preflight.make_mesh's rule: data x model, model = the rest)."""
    from kvjax import sharding
    n = len(sl.devices)
    data = cfg.mesh.data
    model = cfg.mesh.model or n // max(data, 1)
    if data < 1 or data * model != n:
        raise PlanError(f"mesh data={data} x model={cfg.mesh.model or 'rest'} does not fit the {n} devices of "
                        f"{sl.name}; pass --config.mesh.data / --config.mesh.model that multiply to {n}")
    return sharding.make_mesh(data, model, list(sl.devices))


def with_depth(mcfg, layers: int | None):
    """The model's config with `layers` decoder layers (None: as it is): every other shape unchanged, a sparse MoE's
    layer pattern kept (kvjax.plan: a program compiled at two depths, its memory extrapolated to the real one)."""
    if layers is None or layers == mcfg.num_layers:
        return mcfg
    extra = {}
    if hasattr(mcfg, "mlp_only_layers"):
        extra["mlp_only_layers"] = tuple(i for i in mcfg.mlp_only_layers if i < layers)
    return dataclasses.replace(mcfg, num_layers=layers, **extra)


def pair(cfg, sl: Slice, depths: tuple[int, int] | None = None) -> Builder:
    """Both models abstract on the job's mesh of the slice (their dtypes as the config sets them); `depths`:
    (source layers, target layers) instead of their own."""
    mesh = mesh_for(cfg, sl)
    models, where = {}, {}
    for i, role in enumerate(ROLES):
        mc = getattr(cfg, role)
        mcfg, where[role] = shapes.model_config(mc, role)
        mcfg = with_depth(mcfg, None if depths is None else depths[i])
        models[role] = shapes.model(mcfg, jnp.dtype(mc.dtype), mesh)
    return Builder(models["source"], models["target"], mesh, cfg.source.dtype, sources=where)


def depths(cfg) -> tuple[int, int]:
    """(source layers, target layers) of the config's models."""
    return tuple(shapes.model_config(getattr(cfg, role), role)[0].num_layers for role in ROLES)


def stage_programs(cfg, sl: Slice, only: tuple[str, ...] = (), depths: tuple[int, int] | None = None
                   ) -> tuple[Builder, dict[str, list[Program]]]:
    """{stage: its programs} for every stage the config runs (host-only stages: none), in the job's order; with
    `depths`, for the models cut to those many layers (`with_depth`)."""
    b = pair(cfg, sl, depths)
    m = cfg.map
    kvmap = shapes.kvmap(b.source.cfg, b.target.cfg, b.mesh, pairing=m.pairing, rank=m.rank,
                         residual_rank=m.residual_rank)
    maps = {name: kvmap for name in fitted_maps(cfg)}
    if cfg.residual.steps > 0 and (cfg.residual.context or cfg.residual.attention_heads):
        maps["residual"] = shapes.kvmap(b.source.cfg, b.target.cfg, b.mesh, pairing=m.pairing, rank=m.rank,
                                        residual_rank=m.residual_rank, context=cfg.residual.context,
                                        attention_heads=cfg.residual.attention_heads,
                                        attention_dim=cfg.residual.attention_dim)
    out: dict[str, list[Program]] = {}
    for name in stage_names(cfg):
        if only and name not in only:
            continue
        sb = b.at(name)
        if name in HOST_ONLY:
            out[name] = []
        elif name == "ridge":
            out[name] = fitting.ridge(sb, cfg)
        elif name == "residual":
            out[name] = fitting.residual(sb, cfg, kvmap)
        elif name == "perhead":
            out[name] = fitting.perhead(sb, cfg)
        elif name == "bridge":
            out[name] = fitting.bridge(sb, cfg)
        else:
            out[name] = evals.programs(name, sb, cfg, maps, final_arm(cfg))
    return b, out

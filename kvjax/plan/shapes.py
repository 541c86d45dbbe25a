"""What a plan compiles with instead of data: each model's config (from its checkpoint or a shipped config.json),
and abstract params, caches and maps — jax.ShapeDtypeStructs carrying the shardings the job would give the real
arrays on the slice's mesh (the same logical-axis tables: kvjax.models.params, kvjax.cache, kvjax.mapper.kvmap).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax import sharding
from kvjax.cache import KVCache, axes as cache_axes, init_cache
from kvjax.mapper.kvmap import KVMap, LinearMap, kvmap_shardings, spec_for
from kvjax.mapper.pairing import depth_pairing
from kvjax.models.config import load_config
from kvjax.models.model import Model
from kvjax.models.params import abstract_params, param_shardings
from kvjax.plan.hardware import PlanError


def model_config(mc, role: str):
    """(config, where it was read) of a RunConfig's ModelConfig: the checkpoint's config.json when the checkpoint is
    here (its path, or the directory its environment variable names), else the shipped config.json of `shapes`."""
    path = mc.path or (os.environ.get(mc.env, "") if mc.env else "")
    for where in (path, mc.shapes):
        if where and os.path.isfile(os.path.join(where, "config.json")):
            if where == mc.shapes and _model_type(where) == "ultravox":  # an audio LM's shapes: its text model's
                from kvjax.hf.ultravox import audio_configs
                return audio_configs(where).lm, where
            return load_config(os.path.join(where, "config.json")), where
    name = mc.name or role
    raise PlanError(f"no shapes for the {role} ({name}): pass --config.{role}.shapes=DIR (a directory with the "
                    f"model's config.json, e.g. configs/models/{name.split(' ')[0]}) or --config.{role}.path=CHECKPOINT")


def _model_type(where: str) -> str | None:
    import json
    with open(os.path.join(where, "config.json")) as f:
        return json.load(f).get("model_type")


def abstract(tree, shardings):
    """ShapeDtypeStructs of `tree` (arrays or ShapeDtypeStructs) placed by `shardings` (a matching tree)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def replicated(shape, dtype, mesh: Mesh) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=NamedSharding(mesh, P()))


def batch_sharded(shape, dtype, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """An input split over the mesh's data axis on its first dimension (replicated where it does not divide)."""
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding.data_sharding(mesh, tuple(shape)))


def model(cfg, dtype, mesh: Mesh) -> Model:
    """The model with abstract params sharded as kvjax.models.params.param_shardings places them."""
    params = abstract_params(cfg, jnp.dtype(dtype))
    return Model(cfg, abstract(params, param_shardings(cfg, mesh)))


def cache(cfg, batch: int, capacity: int, dtype, mesh: Mesh, keys_transposed: bool = False) -> KVCache:
    """An abstract empty cache, sharded by its logical axes (batch over 'data', kv heads over 'model')."""
    c = jax.eval_shape(lambda: init_cache(cfg, batch, capacity, jnp.dtype(dtype), keys_transposed=keys_transposed))
    return abstract(c, sharding.tree_shardings(c, cache_axes(c), mesh))


def pairing_for(scfg, tcfg, how: str) -> tuple[tuple[int, ...], ...]:
    """The map's pairing: "depth" as the ridge stage pairs; "topK" picks K source layers per target layer by held-out
    R^2 at calibration, so a plan (which has no data) takes the K nearest in depth: the same shapes."""
    if how == "depth":
        return depth_pairing(scfg.num_layers, tcfg.num_layers)
    k = int(how[3:])
    base = depth_pairing(scfg.num_layers, tcfg.num_layers)
    return tuple(tuple(min(max(s - k // 2, 0), scfg.num_layers - k) + j for j in range(k)) for (s,) in base)


def kvmap(scfg, tcfg, mesh: Mesh, *, pairing="depth", rank: int | None = None, residual_rank: int = 16,
          context: int = 0, attention_heads: int = 0, attention_dim: int = 0) -> KVMap:
    """An abstract map of the ridge stage's shapes (float32, replicated as kvjax.mapper.kvmap places maps): per
    target layer and kind, mu [Fx], w_in [Fx, r], w_out [r, Fy] (r = the rank, or Fy at full rank), the residual's
    down [Fx, h] / up [h, Fy]; a context map's down_prev and a cross-position map's attention when asked."""
    pairs = pairing_for(scfg, tcfg, pairing) if isinstance(pairing, str) else tuple(pairing)
    f32 = jnp.float32
    s = lambda *shape: jax.ShapeDtypeStruct(shape, f32)  # noqa: E731
    fy = tcfg.num_kv_heads * tcfg.head_dim

    def one(p):
        fx = len(p) * scfg.num_kv_heads * scfg.head_dim
        r = fy if rank is None else min(rank, fy)
        extra = {}
        if context:
            extra["down_prev"] = s(context, fx, residual_rank)
        if attention_heads:
            extra.update(att_q=s(attention_heads, fx, attention_dim), att_k=s(attention_heads, fx, attention_dim),
                         att_v=s(attention_heads, fx, attention_dim), att_o=s(attention_heads, attention_dim,
                                                                               residual_rank))
        return LinearMap(mu=s(fx), scale=s(), w_in=s(fx, r), w_out=s(r, fy), bias=s(fy), down=s(fx, residual_rank),
                         res_bias=s(residual_rank), up=s(residual_rank, fy), **extra)

    layers = tuple(one(p) for p in pairs)
    m = KVMap(keys=layers, values=layers, spec=spec_for(scfg, tcfg, pairs, rank, residual_rank))
    return abstract(m, kvmap_shardings(m, mesh))


def nbytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract tree (its shard of each leaf; replicated leaves whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):  # a static argument (a config, a flag)
            continue
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        n = 1
        for d in shape:
            n *= d
        total += n * _itemsize(x.dtype)
    return total


def _itemsize(dtype) -> int:
    """Bytes per element; a PRNG key's (`key<fry>`) are its two uint32s."""
    try:
        return jnp.dtype(dtype).itemsize
    except TypeError:
        return 8


def nbytes(tree) -> int:
    """Bytes of an abstract tree, all of it."""
    total = 0
    for x in jax.tree.leaves(tree):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            continue
        n = 1
        for d in x.shape:
            n *= d
        total += n * _itemsize(x.dtype)
    return total


@dataclasses.dataclass(frozen=True)
class Pair:
    """The two models of a run, abstract, on one mesh, and where their shapes came from."""

    source: Model
    target: Model
    source_from: str
    target_from: str
    mesh: Mesh
    dtype: str  # the cache dtype the job uses (the source's parameter dtype)

"""Mesh and logical-axis rules.

Every tensor kvjax creates carries logical axis names, declared by the module that defines its pytree
(``kvjax.models.params.param_axes``, ``kvjax.cache.axes``, ``kvjax.mapper.kvmap.LINEAR_MAP_AXES``; each also offers
its own ``*_shardings`` / ``shard_*``). One table maps the names to mesh axes, and this module only applies it, so it
knows no kvjax type; the same code runs on one device, on fake CPU devices and on a pod. A dimension that the mesh
axis does not divide is replicated, and `describe` reports it.
"""

from __future__ import annotations

import logging
from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "model")

# logical axis -> mesh axis (or None = replicated)
RULES: dict[str, str | None] = {
    "batch": "data",
    "tokens": "data",
    "vocab": "model",
    "embed": None,
    "heads": "model",
    "kv_heads": "model",
    "ffn": "model",
    # Qwen3-MoE experts [E, D, F]: each expert's FFN width splits over 'model' as a dense MLP's does and the expert
    # axis is replicated, so a routed token's chosen experts are on every device (no all-to-all; see
    # kvjax.models.qwen3_moe). Name 'model' here for expert parallelism (the width then replicates).
    "experts": None,
    "head_dim": None,
    "layers": None,
    "cache_seq": None,
    "rank": None,
    # the cache map (its axes: kvjax.mapper.kvmap.LINEAR_MAP_AXES): small next to the models (~2M floats per target
    # layer and kind for 32B->8B), so replicated; name a mesh axis here to split it
    "map_in": None,  # input features: paired source layers x kv_heads x head_dim
    "map_rank": None,  # ridge rank / residual width
    "map_out": None,  # target features: kv_heads x head_dim
}


def make_mesh(data: int = 1, model: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'model') mesh; `model` defaults to all devices not used by `data`."""
    devices = list(devices if devices is not None else jax.devices())
    if model is None:
        if len(devices) % data:
            raise ValueError(f"data={data} does not divide the {len(devices)} available devices")
        model = len(devices) // data
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, have {len(devices)}; "
                         "set XLA_FLAGS=--xla_force_host_platform_device_count=N for fake CPU devices")
    arr = np.asarray(devices).reshape(data, model)
    return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def spec_for(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules=None) -> P:
    """PartitionSpec for a tensor with logical `axes`, replicating dims the mesh axis does not divide."""
    rules = RULES if rules is None else rules
    out, used = [], set()
    for name, dim in zip(axes, shape):
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is None or mesh_axis in used or dim % mesh.shape[mesh_axis]:
            if mesh_axis is not None and mesh_axis not in used and dim % mesh.shape[mesh_axis]:
                log.debug("replicating axis %s (size %d) not divisible by mesh axis %s (%d)",
                          name, dim, mesh_axis, mesh.shape[mesh_axis])
            out.append(None)
        else:
            out.append(mesh_axis)
            used.add(mesh_axis)
    return P(*out)


def named_sharding(axes, shape, mesh: Mesh, rules=None) -> NamedSharding:
    return NamedSharding(mesh, spec_for(axes, shape, mesh, rules))


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(tree, axes_tree, mesh: Mesh, rules=None):
    """NamedShardings for `tree` (arrays or ShapeDtypeStructs) from a matching tree of logical-axis tuples."""
    return jax.tree.map(lambda axes, x: named_sharding(axes, x.shape, mesh, rules), axes_tree, tree,
                        is_leaf=_is_axes)


def shard(tree, axes_tree, mesh: Mesh, rules=None):
    """device_put `tree` onto `mesh` according to its logical axes."""
    return jax.device_put(tree, tree_shardings(tree, axes_tree, mesh, rules))


def constrain(x: jax.Array, axes: Sequence[str | None], rules=None) -> jax.Array:
    """with_sharding_constraint by logical axes inside jit, when a mesh is active (``jax.set_mesh``)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec_for(axes, x.shape, mesh, rules))


def describe(tree, axes_tree, mesh: Mesh, rules=None) -> list[str]:
    """Human-readable sharding table: name, shape, spec (for logs and WORKSPACE notes)."""
    rows = []
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat_axes = jax.tree.leaves(axes_tree, is_leaf=_is_axes)
    for (path, x), axes in zip(flat, flat_axes):
        rows.append(f"{jax.tree_util.keystr(path):24s} {str(tuple(x.shape)):24s} {spec_for(axes, x.shape, mesh, rules)}")
    return rows


# ---- shardings for the map-fitting job ---------------------------------------------------------------------------

def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def data_sharding(mesh: Mesh, shape: Sequence[int], rules=None) -> NamedSharding:
    """Sharding of a batch [B, ...] over the 'batch' rule's mesh axis (the data-parallel axis). Unlike weights, a
    batch that does not divide is an error, not silently replicated: every data shard must get its own rows."""
    axis = (rules or RULES)["batch"]
    if axis is not None and shape[0] % mesh.shape[axis]:
        raise ValueError(f"batch of {shape[0]} rows does not split over the {mesh.shape[axis]}-way {axis!r} mesh "
                         f"axis; use a batch size that is a multiple of {mesh.shape[axis]}")
    return named_sharding(("batch",) + (None,) * (len(shape) - 1), shape, mesh, rules)


def optimizer_shardings(opt, params, shardings, mesh: Mesh):
    """Shardings for ``opt.init(params)``: every parameter-shaped entry (Adam moments, ...) takes its parameter's
    sharding, everything else (step counts, scalars) is replicated."""
    import optax
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731  (entries of frozen params hold no state)
    abstract = jax.eval_shape(opt.init, params)
    return optax.tree_map_params(opt, lambda x, s: x if masked(x) else s, abstract, shardings,
                                 transform_non_params=lambda _: replicated(mesh), is_leaf=masked)


def on_mesh(tree, mesh: Mesh) -> bool:
    """Whether every array leaf already lives on `mesh` with a NamedSharding."""
    return all(isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh
               for x in jax.tree.leaves(tree))


def place(tree, shardings):
    """device_put a tree onto `shardings`; in a multi-process run leaves that are not yet global arrays go through
    host memory (every process must pass the same values, e.g. after kvjax.distributed.broadcast_from_primary)."""
    if jax.process_count() > 1:
        tree = jax.tree.map(lambda x: x if isinstance(x, jax.Array) and not x.is_fully_addressable
                            else np.asarray(x), tree)
    return jax.device_put(tree, shardings)

"""Where a pool of the server keeps its arrays: one device, or a mesh the models shard over as the job shards them.

A model too large for one chip (Qwen3-32B in bf16 is 64 GB; a v5e chip holds 16) is served over a mesh: the weights,
the map and the caches carry the logical axes their modules declare (kvjax.models.params, kvjax.mapper.kvmap,
kvjax.cache) and kvjax.sharding's rules place them, exactly as the job and `python -m kvjax.plan --serve` do, so the
plan's compiled programs are the server's. Everything else a pool puts on its devices (token ids, lengths, the audio
adapter) is replicated. One device is the mesh-less case of the same interface, so the engine has no branch on it.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax import cache as kv_cache
from kvjax import sharding
from kvjax.mapper.kvmap import kvmap_axes
from kvjax.models.params import abstract_params, param_axes


class Placement:
    """One device (a jax.Device) or a mesh (a jax.sharding.Mesh). Hashable: pools are keyed by their placement."""

    def __init__(self, where: jax.Device | Mesh):
        self.where = where
        self.mesh = where if isinstance(where, Mesh) else None
        self._replicated = NamedSharding(where, P()) if self.mesh is not None else where

    def __eq__(self, other) -> bool:
        return isinstance(other, Placement) and self.where == other.where

    def __hash__(self) -> int:
        return hash(self.where)

    def __repr__(self) -> str:
        if self.mesh is None:
            return str(self.where)
        return "mesh " + " x ".join(f"{a}={n}" for a, n in self.mesh.shape.items())

    def _put(self, tree, axes_tree):
        return jax.device_put(tree, self._replicated) if self.mesh is None else sharding.shard(tree, axes_tree,
                                                                                                self.mesh)

    def put(self, tree):
        """Replicated over the placement's devices (token ids, lengths, small adapters)."""
        return jax.device_put(tree, self._replicated)

    def params(self, cfg, params):
        """A model's weights, sharded by their logical axes (heads and FFN over 'model')."""
        return self._put(params, param_axes(cfg))

    def kvmap(self, kvmap):
        return self._put(kvmap, kvmap_axes(kvmap))

    def cache(self, cache: kv_cache.KVCache) -> kv_cache.KVCache:
        """A cache moved here, sharded by its logical axes (kv heads over 'model', batch over 'data')."""
        return self._put(cache, kv_cache.axes(cache))

    def empty_cache(self, cfg, batch: int, capacity: int, dtype, keys_transposed: bool) -> kv_cache.KVCache:
        """A zero cache made in place: each device writes only its own shard (a 128-slot cache of Qwen3-8B at 4K
        is 77 GB; made on one device and then split, it would not fit there)."""
        make = lambda: kv_cache.init_cache(cfg, batch, capacity, dtype, keys_transposed=keys_transposed)  # noqa: E731
        if self.mesh is None:
            with jax.default_device(self.where):
                return jax.jit(make)()
        shape = jax.eval_shape(make)
        return jax.jit(make, out_shardings=sharding.tree_shardings(shape, kv_cache.axes(shape), self.mesh))()


    def bytes_per_device(self, abstract, axes_tree) -> int:
        """What a tree of ShapeDtypeStructs takes on each device once placed here by its logical axes."""
        leaves = jax.tree.leaves(abstract)
        if self.mesh is None:
            return sum(x.size * x.dtype.itemsize for x in leaves)
        shards = jax.tree.leaves(sharding.tree_shardings(abstract, axes_tree, self.mesh))
        return sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize for x, sh in zip(leaves, shards))

    def memory(self) -> float:
        """Bytes each device offers its programs (0 when it does not say: a CPU device)."""
        device = self.mesh.devices.flat[0] if self.mesh is not None else self.where
        try:
            return float((device.memory_stats() or {}).get("bytes_limit", 0.0))
        except Exception:  # a backend without memory statistics
            return 0.0


def held(place: Placement, models: dict, slots: int, capacity: int, prefill_batch: int) -> dict[str, int]:
    """Bytes per device the server holds for as long as it runs, before XLA's temporaries: each model's weights
    (`models`: role -> (config, dtype); the first is the answerer, whose cache the slots are), the slots' cache, and
    the caches of the largest prefill batch (every model's, at the full context)."""
    out = {}
    for role, (cfg, dtype) in models.items():
        out[f"{role} weights"] = place.bytes_per_device(abstract_params(cfg, dtype), param_axes(cfg))
    cache = lambda cfg, dtype, b: jax.eval_shape(  # noqa: E731
        lambda: kv_cache.init_cache(cfg, b, capacity, dtype, keys_transposed=True))
    answerer = next(iter(models.values()))
    slot_cache = cache(*answerer, slots)
    out["slots' cache"] = place.bytes_per_device(slot_cache, kv_cache.axes(slot_cache))
    for role, (cfg, dtype) in models.items():
        c = cache(cfg, dtype, prefill_batch)
        out[f"{role} prefill cache"] = place.bytes_per_device(c, kv_cache.axes(c))
    return out


def replicated_like(where):
    """The replicated sharding on the devices of `where` (a Sharding), for inputs beside sharded weights."""
    return NamedSharding(where.mesh, P()) if isinstance(where, NamedSharding) else where

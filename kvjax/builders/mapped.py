"""Mapped caches: the source reads the prompt, a KVMap translates its cache into the target's coordinates.

`Mapped` runs the source prefill and then the map (XLA, or the Pallas map-and-insert kernel); `Pipelined` runs both as
one program, each target layer mapped as soon as its paired source layers exist (kvjax.builders.pipelined). Several
mapped builders over the same source share one `SourcePrefill`, so scoring arms side by side pays for the source's
prefill (what a large source costs most) once per batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.builders.base import CacheBuilder, Clock
from kvjax.cache import KVCache
from kvjax.mapper.kvmap import KVMap, apply_map, check_models
from kvjax.models.decoder import prefill_jit

map_jit = jax.jit(apply_map, static_argnames=("capacity", "dtype", "length", "impl", "interpret"))


class SourcePrefill(CacheBuilder):
    """The source reads the prompt: a native-prefill builder whose latest cache is kept (with `memo`, the default
    when builders share one) while the same batch is asked for again, so the source arm and every mapped builder
    holding this object pay for one source prefill per batch; without `memo` (a builder's own, e.g. when timing)
    every call prefills."""

    def __init__(self, source, memo: bool = True, name: str = "source"):
        self.model, self.memo, self.name = tuple(source), memo, name
        self._key, self._cache = None, None

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        """A memoised cache serves any capacity up to its own: the map reads only the prompt's slots."""
        key = (tokens.shape, tokens.tobytes(), lengths.tobytes()) if self.memo else None
        if key is None or key != self._key or self._cache.capacity < capacity:
            cfg, params = self.model
            _, cache, _, _ = prefill_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), capacity=capacity,
                                      logits=False)
            self._cache, self._key = clock("source_prefill", cache), key
        return self._cache


class Mapped(CacheBuilder):
    """Source prefill, then `kvmap` (impl "xla", "pallas" or "auto": kvjax.kernels.map_insert.resolve_impl)."""

    def __init__(self, source, target, kvmap: KVMap, name: str = "mapped", impl: str = "xla",
                 shared: SourcePrefill | None = None):
        check_models(kvmap, source[0], target[0])
        self.model, self.kvmap, self.name, self.impl = tuple(target), kvmap, name, impl
        self.source = shared if shared is not None else SourcePrefill(source, memo=False)

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        source_cache = self.source.build(tokens, lengths, tokens.shape[1], clock)  # the map reads slots 0..T-1
        return clock("map", map_jit(self.kvmap, source_cache, capacity=capacity, length=tokens.shape[1],
                                    impl=self.impl))

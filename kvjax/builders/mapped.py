"""Mapped caches: the source reads the prompt, a KVMap translates its cache into the target's coordinates.

`Mapped` runs the source prefill and then the map (XLA, or the Pallas map-and-insert kernel); `Pipelined` runs both as
one program, each target layer mapped as soon as its paired source layers exist (kvjax.builders.pipelined). Several
mapped builders over the same source share one `SourcePrefill`, so scoring arms side by side pays for the source's
prefill (what a large source costs most) once per batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import aot
from kvjax.builders.base import CacheBuilder, Clock, Resumable
from kvjax.builders.native import prefill_cache
from kvjax.cache import KVCache, init_cache
from kvjax.mapper.kvmap import KVMap, apply_map, check_models, map_span
from kvjax.models.decoder import prefill_jit

map_jit = aot.jit(apply_map, static_argnames=("capacity", "dtype", "length", "impl", "interpret"))
span_jit = aot.jit(map_span, static_argnames=("width",), donate_argnames=("target_cache",))


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
            self._cache = clock("source_prefill", prefill_cache(self.model, tokens, lengths, capacity))
            self._key = key
        return self._cache


class Mapped(CacheBuilder, Resumable):
    """Source prefill, then `kvmap` (impl "xla", "pallas" or "auto": kvjax.kernels.map_insert.resolve_impl).
    Resumable: its state is (source cache, mapped target cache); the source keeps its own keys and values of what it
    read because it attends to them when it reads the rest (and a context map reads the positions before a span)."""

    def __init__(self, source, target, kvmap: KVMap, name: str = "mapped", impl: str = "xla",
                 shared: SourcePrefill | None = None):
        check_models(kvmap, source[0], target[0])
        self.model, self.kvmap, self.name, self.impl = tuple(target), kvmap, name, impl
        self.source = shared if shared is not None else SourcePrefill(source, memo=False)

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        # the map reads slots 0..T-1; the source prefills at the answerer's capacity all the same, so that it runs
        # the program of the source's own native arm (one compile) and a shared prefill serves both
        source_cache = self.source.build(tokens, lengths, capacity, clock)
        return clock("map", map_jit(self.kvmap, source_cache, capacity=capacity, length=tokens.shape[1],
                                    impl=self.impl))

    def start(self, batch: int, capacity: int) -> tuple[KVCache, KVCache]:
        cfg, params = self.source.model
        dtype = params.embed.dtype  # the map writes the source's dtype (apply_map's default)
        source = init_cache(cfg, batch, capacity, dtype)
        return source, init_cache(self.model[0], batch, capacity, dtype).replace(origin=f"mapped:{self.kvmap.map_id}")

    def resume(self, state, tokens, lengths, fresh: bool = False) -> tuple[KVCache, KVCache]:
        if type(self.source) is not SourcePrefill:  # e.g. an AudioPrefill: its prompt is not just these tokens
            raise TypeError(f"{self!r} reads the prompt through {self.source!r}, which cannot be read in pieces; "
                            "only a text source (SourcePrefill) can")
        (source, target), (cfg, params) = state, self.source.model
        start = jnp.copy(source.lengths)  # the prefill donates the source cache
        _, source, _, _ = prefill_jit(params, cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32),
                                      source, fresh=fresh, logits=None)
        return source, span_jit(self.kvmap, source, target, start, width=int(tokens.shape[1]))

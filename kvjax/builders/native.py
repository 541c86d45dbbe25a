"""Native prefill: the model reads the prompt itself. The one jitted "init a cache and prefill" of the library;
the traceable `prefill_cache` is what other compiled programs (calibration statistics, KL training) inline."""

from __future__ import annotations


import jax
import jax.numpy as jnp

from kvjax.builders.base import CacheBuilder, Clock
from kvjax.cache import LAYER_AXES, KVCache, init_cache
from kvjax.models.decoder import forward
from kvjax.sharding import constrain


def prefill(params, cfg, tokens: jax.Array, lengths: jax.Array | None = None, capacity: int | None = None,
            dtype=None) -> tuple[jax.Array, KVCache]:
    """(logits [B, V] at each row's last real token, the model's cache) after reading tokens int [B, T]
    (right-padded to `lengths`) into an empty cache of `capacity` positions (default T; traceable). Under an active
    mesh (jax.set_mesh) the cache is sharded by its logical axes (batch over 'data', kv heads over 'model')."""
    capacity = tokens.shape[1] if capacity is None else capacity
    cache = init_cache(cfg, tokens.shape[0], capacity, dtype or params.embed.dtype)
    cache = cache.map_layers(lambda a: constrain(a, LAYER_AXES))
    return forward(params, cfg, tokens, cache, lengths, last_only=True, fresh=True)


def prefill_cache(params, cfg, tokens: jax.Array, lengths: jax.Array | None = None, capacity: int | None = None,
                  dtype=None) -> KVCache:
    """`prefill`'s cache alone (XLA drops the unembedding the logits would need)."""
    return prefill(params, cfg, tokens, lengths, capacity, dtype)[1]


prefill_cache_jit = jax.jit(prefill_cache, static_argnames=("cfg", "capacity", "dtype"))


class NativePrefill(CacheBuilder):
    """The answering model prefills the prompt itself (the native arms: "target", "source")."""

    def __init__(self, model, name: str = "native", dtype=None):
        self.model, self.name, self.dtype = tuple(model), name, dtype

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        cfg, params = self.model
        dtype = None if self.dtype is None else jnp.dtype(self.dtype)
        return clock("prefill", prefill_cache_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), capacity,
                                                  dtype))



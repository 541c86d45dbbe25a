"""Native prefill: the model reads the prompt itself, through the models floor's one prefill program
(kvjax.models.decoder.prefill_jit). Code that inlines a prefill into a compiled program of its own (calibration
statistics, KL training) traces kvjax.models.decoder.prefill_forward instead."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.builders.base import CacheBuilder, Clock, Resumable, as_batch, bucket
from kvjax.cache import KVCache, init_cache
from kvjax.models.decoder import prefill_jit


def prefill_cache(model, tokens, lengths, capacity: int, dtype=None) -> KVCache:
    """The model's own cache of the prompt: the one prefill program every native read runs (the answerer's arm, the
    source under a map), so that they share its compilations."""
    cfg, params = model
    _, cache, _, _ = prefill_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), capacity=capacity,
                                 dtype=dtype, logits=None)
    return cache


class NativePrefill(CacheBuilder, Resumable):
    """The answering model prefills the prompt itself (the native arms: "target", "source"). Resumable: its state
    is the model's own cache."""

    def __init__(self, model, name: str = "native", dtype=None):
        self.model, self.name, self.dtype = tuple(model), name, dtype

    def _dtype(self):
        return None if self.dtype is None else jnp.dtype(self.dtype)

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        return clock("prefill", prefill_cache(self.model, tokens, lengths, capacity, self._dtype()))

    def start(self, batch: int, capacity: int) -> tuple[KVCache]:
        cfg, params = self.model
        return (init_cache(cfg, batch, capacity, self._dtype() or params.embed.dtype),)

    def resume(self, state, tokens, lengths, fresh: bool = False) -> tuple[KVCache]:
        cfg, params = self.model
        _, cache, _, _ = prefill_jit(params, cfg, jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32),
                                     state[0], fresh=fresh, logits=None)
        return (cache,)

    def with_features(self, tokens, lengths=None, *, layers: tuple[int, ...], capacity: int | None = None,
                      clock: Clock | None = None) -> tuple[KVCache, jax.Array]:
        """The cache, and the model's hidden states at `layers` over the prompt (kvjax.models.decoder.
        forward's `features`: [B, T, len(layers) * D]): what a drafter that reads the model's features starts
        from."""
        tokens, lengths = as_batch(tokens, lengths)
        capacity = bucket(tokens.shape[1]) if capacity is None else int(capacity)
        if capacity < tokens.shape[1]:
            raise ValueError(f"capacity {capacity} is smaller than the {tokens.shape[1]} prompt tokens")
        cfg, params = self.model
        _, cache, features, _ = prefill_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths),
                                         capacity=capacity, dtype=self._dtype(), logits=None,
                                         features=tuple(int(i) for i in layers))
        if clock is not None:
            clock("prefill", (cache, features))
        return cache, features

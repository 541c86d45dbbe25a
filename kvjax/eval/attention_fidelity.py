"""Attention-output fidelity: what the target's attention reads out of a mapped cache vs out of its own cache.

Key / value cosines score the cache entries one by one; what the target actually uses is softmax(q.K) V, where a
small error in a key that many queries weight heavily matters more than a large one in a key nobody attends to.
Per target layer, the target's own queries (its native forward pass over the window, so every layer sees the same
queries whichever cache is scored) attend causally over the window's keys and values twice, once from the native
cache and once from the mapped one; the score is the cosine of the two attention outputs per token (all query heads
flattened, before the output projection). Public reports find this cosine predicts task retention where per-entry
cosines and calibration R^2 do not.
"""

from __future__ import annotations

import functools

import jax

from kvjax import aot
from kvjax.models.decoder import Stack, causal_attention, forward


@functools.partial(aot.jit, static_argnames=("cfg",))
def native_attention(params, cfg, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The target's queries q [L, B, T, Hq, hd] and attention outputs [L, B, T, Hq, hd] of its own forward pass over
    tokens int [B, T] (from position 0)."""
    return forward(params, cfg, tokens, logits=None, tap=Stack(lambda s: (s.q, s.attn))).tapped


@aot.jit
def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention outputs [L, B, T, Hq, hd] of queries q [L, B, T, Hq, hd] over a cache's k / v
    [L, B, Hkv, C >= T, hd] (keys after RoPE, as the cache holds them)."""
    t = q.shape[2]
    per_layer = lambda q, k, v: causal_attention(q, k[:, :, :t].transpose(0, 2, 1, 3),  # noqa: E731
                                                 v[:, :, :t].transpose(0, 2, 1, 3))
    return jax.vmap(per_layer)(q, k, v)

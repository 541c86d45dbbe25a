"""Per-layer cache features the map works in: keys before RoPE (content space) and values, heads flattened
(kvjax.kernels.features on a KVCache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.kernels.features import content_features


def layer_features(cache: KVCache, layer: int, rope, t: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(keys, values) of one layer as float32 [B, T, Hkv*hd]; keys un-rotated to their pre-RoPE content with the
    model's `rope` (its config's .rope)."""
    t = cache.capacity if t is None else t
    return (content_features(cache.keys[layer][:, :, :t], rope),
            content_features(cache.values[layer][:, :, :t], None))


def paired_features(cache: KVCache, layers: tuple[int, ...], rope, t: int | None = None):
    """Features of several source layers concatenated: (keys, values) [B, T, len(layers)*Hkv*hd]."""
    feats = [layer_features(cache, s, rope, t) for s in layers]
    return (jnp.concatenate([f[0] for f in feats], -1), jnp.concatenate([f[1] for f in feats], -1))

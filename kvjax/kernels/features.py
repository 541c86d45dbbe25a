"""The coordinates a cache map works in, on plain arrays: keys un-rotated to their pre-RoPE content, heads
flattened, and back. Shared by the map's XLA implementation (kvjax.kernels.map_insert.map_insert_reference, which
`apply_map` and the pipelined path run) and by calibration (`layer_features` below, on a KVCache), so the features a map is fitted
on are the features it is applied to.

Each model's keys are un-rotated and re-rotated with its own RoPE description (kvjax.models.rope.Rope: theta and
any frequency scaling), so a map between models with different RoPE is exact. RoPE angles are host constants:
computed inside the jit, XLA recomputed cos/sin in every consumer fusion, per layer and head (un-rotating 6 layers
of 2 x 64 at 2K tokens: 6.7 ms vs 0.7 ms).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.models.rope import apply_rope, as_rope, rope_table, unapply_rope


@functools.lru_cache(maxsize=64)
def slot_angles(t: int, head_dim: int, rope, offset: int = 0):
    """cos, sin [1, 1, t, hd] for cache slots offset..offset+t-1 (slot i holds position i), host constants. `rope`:
    the model's kvjax.models.rope.Rope (scaling included) or a plain theta."""
    cos, sin = rope_table(offset + t, head_dim, as_rope(rope))
    return cos[None, None, offset:], sin[None, None, offset:]


def content_features(x: jax.Array, rope, offset: int = 0) -> jax.Array:
    """One layer's keys (`rope`: the model's Rope, un-rotated from positions offset.. to content space) or values
    (`rope` None), x [B, H, n, hd] -> float32 [B, n, H*hd]."""
    b, _, n, _ = x.shape
    x = x.astype(jnp.float32)
    if rope is not None:
        x = unapply_rope(x, *slot_angles(n, x.shape[-1], rope, offset))
    return x.transpose(0, 2, 1, 3).reshape(b, n, -1)


def cache_layout(features: jax.Array, kv_heads: int, rope, offset: int = 0) -> jax.Array:
    """[B, n, Hkv*hd] -> [B, Hkv, n, hd]; with `rope` (the model's Rope), keys rotated to positions
    offset..offset+n-1."""
    b, n, f = features.shape
    x = features.reshape(b, n, kv_heads, f // kv_heads).transpose(0, 2, 1, 3)
    if rope is not None:
        x = apply_rope(x, *slot_angles(n, x.shape[-1], rope, offset))
    return x


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

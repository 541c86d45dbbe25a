"""Rotary position embeddings (the HF "default" rope type), and their exact inverse."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + (head_dim,), float32 (half-split layout, as transformers)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` [..., hd] by the angles behind cos/sin (broadcast against x); computed in x's dtype."""
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def unapply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Exact inverse of apply_rope (rotation by the negative angle), in float32 for accuracy."""
    return apply_rope(x.astype(jnp.float32), cos, -sin).astype(x.dtype)

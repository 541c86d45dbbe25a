"""Rotary position embeddings, and their exact inverse.

A model's RoPE is described once (`Rope`, a config's `.rope`): the forward pass rotates queries and keys with it and
the cache map un-rotates source keys and re-rotates target keys with each model's own description, so two models
with different RoPE (theta, and in later families frequency scaling) map onto each other exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Rope:
    """A rotary embedding (HF rope_type "default"): frequency theta^(-2i/hd) per pair of lanes. Hashable, so configs
    and map specs carry it as static data."""

    theta: float

    def inv_freq(self, head_dim: int) -> jax.Array:
        """[hd/2] float32, computed as transformers does (float32 powers)."""
        return 1.0 / (self.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))

    def inv_freq_host(self, head_dim: int) -> np.ndarray:
        """[hd/2] float64 on the host, for tables computed once."""
        return 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))


def as_rope(rope) -> Rope:
    """A Rope from a Rope or a bare theta (map specs store the theta of a plain RoPE)."""
    return rope if isinstance(rope, Rope) else Rope(float(rope))


def rope_angles(positions: jax.Array, head_dim: int, rope) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape positions.shape + (head_dim,), float32 (half-split layout, as transformers). `rope`: a Rope
    or a theta."""
    inv_freq = as_rope(rope).inv_freq(head_dim)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rope_table(t: int, head_dim: int, rope) -> tuple[np.ndarray, np.ndarray]:
    """`rope_angles` for positions 0..t-1 as host constants (numpy, float64 rounded once to float32). Inside a jit,
    angles computed there are fused into every consumer and recomputed per layer and head; a table is computed once.
    It agrees with rope_angles to ~1e-7 at small positions; at 2K, XLA's float32 cos/sin are off by ~6e-5 and the
    table is the more accurate of the two."""
    inv_freq = as_rope(rope).inv_freq_host(head_dim)
    emb = np.tile(np.arange(t, dtype=np.float64)[:, None] * inv_freq, 2)  # [t, hd], halves as in rope_angles
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` [..., hd] by the angles behind cos/sin (broadcast against x); computed in x's dtype."""
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def unapply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Exact inverse of apply_rope (rotation by the negative angle), in float32 for accuracy."""
    return apply_rope(x.astype(jnp.float32), cos, -sin).astype(x.dtype)

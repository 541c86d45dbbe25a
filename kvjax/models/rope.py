"""Rotary position embeddings, and their exact inverse.

A model's RoPE is described once (`Rope`, a config's `.rope`): the forward pass rotates queries and keys with it and
the cache map un-rotates source keys and re-rotates target keys with each model's own description, so two models
with different RoPE (theta, Llama 3's frequency scaling) map onto each other exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.hfconfig import ConfigError, rope_settings


KINDS = ("default", "llama3")  # HF rope_type values kvjax implements


@dataclasses.dataclass(frozen=True)
class Rope:
    """A rotary embedding: one frequency per pair of lanes, theta^(-2i/hd), optionally rescaled. Hashable, so configs
    and map specs carry it as static data.

    kind "default": the plain frequencies. kind "llama3" (Llama 3.1+): frequencies whose wavelength exceeds
    original_max_positions / low_freq_factor are divided by `factor`, those shorter than
    original_max_positions / high_freq_factor are kept, and the band between is interpolated smoothly (as
    transformers' _compute_llama3_parameters; its attention factor is 1, so only the frequencies change)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"rope kind {self.kind!r} is not implemented; kvjax implements {list(KINDS)}")
        if self.kind == "llama3" and not (self.factor > 0 and self.high_freq_factor > self.low_freq_factor > 0
                                          and self.original_max_positions > 0):
            raise ValueError(f"llama3 rope scaling needs factor > 0, high_freq_factor > low_freq_factor > 0 and "
                             f"original_max_positions > 0, got {self}")

    def inv_freq(self, head_dim: int) -> jax.Array:
        """[hd/2] float32, computed as transformers does (float32 powers)."""
        if self.kind == "llama3":  # a constant per (Rope, head_dim), rescaled on the host in float32 (jit-safe)
            f32 = np.float32
            plain = f32(1) / (f32(self.theta) ** (np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)))
            return jnp.asarray(self._llama3(plain, f32))
        return 1.0 / (self.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))

    def inv_freq_host(self, head_dim: int) -> np.ndarray:
        """[hd/2] float64 on the host, for tables computed once."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
        return self._llama3(inv, np.float64) if self.kind == "llama3" else inv

    def _llama3(self, inv: np.ndarray, dtype) -> np.ndarray:
        """transformers' llama3 rescaling of plain frequencies `inv`, step for step, in `dtype`."""
        inv = inv.astype(dtype)
        old = self.original_max_positions
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = dtype(2 * np.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / dtype(self.factor), inv)
        smooth = (dtype(old) / wavelen - dtype(self.low_freq_factor)) / dtype(self.high_freq_factor
                                                                                - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / dtype(self.factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(dtype)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def to_hf(self) -> dict:
        """config.json's `rope_parameters` (transformers 5 layout)."""
        out = {"rope_type": self.kind, "rope_theta": self.theta}
        if self.kind == "llama3":
            out.update(factor=self.factor, low_freq_factor=self.low_freq_factor,
                       high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_positions)
        return out

    @classmethod
    def from_json(cls, d) -> "Rope":
        """A Rope from `to_json`'s dict, or from a bare theta (what map manifests stored before scaling existed)."""
        return cls(**d) if isinstance(d, dict) else cls(float(d))


def rope_from_hf(d: dict, source: str = "config.json") -> Rope:
    """The Rope of an HF config.json dict: `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (older
    files; its rope_type may be spelled `type`). A rope_type kvjax does not implement is a ConfigError naming the ones
    it does: a model run with the wrong frequencies would load fine and answer wrongly."""
    theta, scaling = rope_settings(d, source)
    if scaling is None:
        return Rope(theta)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ConfigError(f"{source}: rope_type {kind!r} is not supported; kvjax implements {list(KINDS)} "
                          f"(rope settings: {scaling})")
    try:
        fields = dict(factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
                      high_freq_factor=float(scaling["high_freq_factor"]),
                      original_max_positions=int(scaling["original_max_position_embeddings"]))
    except KeyError as e:
        raise ConfigError(f"{source}: llama3 rope scaling needs {e.args[0]!r} (rope settings: {scaling})") from None
    try:
        return Rope(theta, "llama3", **fields)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def as_rope(rope) -> Rope:
    """A Rope from a Rope or a bare theta (a plain RoPE)."""
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

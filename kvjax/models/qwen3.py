"""The Qwen3 family (Qwen3ForCausalLM): QK-norm attention without biases, SwiGLU MLP, plain RoPE.

Its config is kvjax.models.config.Qwen3Config; its tensors are described once by `param_specs` (shapes, logical
axes, init, HF names and layouts), which loading, saving, sharding and init all read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.models.config import Qwen3Config
from kvjax.models.decoder import rms_norm
from kvjax.models.family import Family, register
from kvjax.models.params import ParamSpec, decoder_specs, spec
from kvjax.models.rope import apply_rope
from kvjax.sharding import constrain


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [D]
    q: jax.Array  # [D, Hq, hd]
    k: jax.Array  # [D, Hkv, hd]
    v: jax.Array  # [D, Hkv, hd]
    q_norm: jax.Array  # [hd]
    k_norm: jax.Array  # [hd]
    o: jax.Array  # [Hq, hd, D]
    mlp_norm: jax.Array  # [D]
    gate: jax.Array  # [D, F]
    up: jax.Array  # [D, F]
    down: jax.Array  # [F, D]


def param_specs(cfg: Qwen3Config) -> dict[str, ParamSpec]:
    """Flat description ``{"embed": ..., "layers.0.q": ..., ...}`` of every tensor: the shared decoder table plus
    the per-head RMS norms of q and k."""
    hd = cfg.head_dim
    return decoder_specs(cfg, attn_extra=lambda i, layer, attn: {
        layer + "q_norm": spec((hd,), ("head_dim",), "ones", attn + "q_norm.weight"),
        layer + "k_norm": spec((hd,), ("head_dim",), "ones", attn + "k_norm.weight")})


def qkv(lp: LayerParams, cfg: Qwen3Config, x, cos, sin):
    """Normalised, rotated q [B, T, Hq, hd], k [B, T, Hkv, hd] and v [B, T, Hkv, hd] of one layer."""
    eps = cfg.rms_norm_eps
    h = rms_norm(x, lp.attn_norm, eps)
    q = rms_norm(jnp.einsum("btd,dhk->bthk", h, lp.q), lp.q_norm, eps)
    k = rms_norm(jnp.einsum("btd,dhk->bthk", h, lp.k), lp.k_norm, eps)
    v = jnp.einsum("btd,dhk->bthk", h, lp.v)
    q = constrain(apply_rope(q, cos, sin), ("batch", None, "heads", None))
    return q, apply_rope(k, cos, sin), v


def finish(lp: LayerParams, cfg: Qwen3Config, x, attn):
    """Output projection and the SwiGLU MLP, each with its residual."""
    x = x + jnp.einsum("bthk,hkd->btd", attn, lp.o)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    gate = jnp.einsum("btd,df->btf", h, lp.gate)
    up = jnp.einsum("btd,df->btf", h, lp.up)
    x = x + jnp.einsum("btf,fd->btd", constrain(jax.nn.silu(gate) * up, ("batch", None, "ffn")), lp.down)
    return constrain(x, ("batch", None, None))



QWEN3 = register(Family(name="qwen3", config=Qwen3Config, model_types=("qwen3",), layer=LayerParams,
                        param_specs=param_specs, qkv=qkv, finish=finish, architectures=("Qwen3ForCausalLM",)))

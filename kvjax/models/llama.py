"""The Llama family (LlamaForCausalLM, Llama 2/3.x and their pruned/distilled kin such as Minitron): no QK-norm,
optional q/k/v/o and MLP biases, SwiGLU MLP, RoPE with Llama 3's frequency scaling or plain.

Its config (`LlamaConfig`) is read from an HF config.json in either the transformers 5 layout (`rope_parameters`) or
the older one (`rope_theta` + `rope_scaling`); its tensors are described once by `param_specs`, which loading, saving,
sharding and init all read. Biases are optional fields of the layer pytree: None when the config has none, so a
bias-free checkpoint carries no zero tensors and its forward pass no extra adds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.models.hfconfig import ConfigError, check_shape, decoder_fields
from kvjax.models.decoder import rms_norm
from kvjax.models.family import Family, check_architectures, register
from kvjax.models.params import ParamSpec, decoder_specs, spec
from kvjax.models.rope import Rope, apply_rope, rope_from_hf
from kvjax.sharding import constrain

ARCHITECTURES = ("LlamaForCausalLM",)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama model's shapes and math; hashable (a static argument of every jitted function)."""

    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F, the SwiGLU width
    num_layers: int  # L
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads % num_kv_heads == 0)
    head_dim: int  # may differ from hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope: Rope = Rope(500_000.0)  # theta and any scaling (kvjax.models.rope)
    attention_bias: bool = False  # q/k/v/o projections have biases
    mlp_bias: bool = False  # gate/up/down projections have biases
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        check_shape(self)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        return int(sum(np.prod(s.shape) for s in param_specs(self).values()))

    def fingerprint(self) -> str:
        """Hash of the fields that define the model's math (not token ids); recorded in map artifacts."""
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rms_norm_eps", "attention_bias", "mlp_bias", "tie_word_embeddings")
        blob = json.dumps({"family": "llama", "rope": self.rope.to_json(), **{k: getattr(self, k) for k in keys}},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ---- HF config.json <-> LlamaConfig -------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "LlamaConfig":
        check_architectures(LLAMA, d, source)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (Llama uses 'silu')")
        return cls(**decoder_fields(d, source, max_position_embeddings=8192), rope=rope_from_hf(d, source),
                   attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)))

    def to_hf_dict(self) -> dict[str, Any]:
        eos = list(self.eos_token_ids)
        return {
            "architectures": list(ARCHITECTURES),
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf(),
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "mlp_bias": self.mlp_bias,
            "pretraining_tp": 1,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [D]
    q: jax.Array  # [D, Hq, hd]
    k: jax.Array  # [D, Hkv, hd]
    v: jax.Array  # [D, Hkv, hd]
    o: jax.Array  # [Hq, hd, D]
    mlp_norm: jax.Array  # [D]
    gate: jax.Array  # [D, F]
    up: jax.Array  # [D, F]
    down: jax.Array  # [F, D]
    q_bias: jax.Array | None = None  # [Hq, hd]   (attention_bias)
    k_bias: jax.Array | None = None  # [Hkv, hd]
    v_bias: jax.Array | None = None  # [Hkv, hd]
    o_bias: jax.Array | None = None  # [D]
    gate_bias: jax.Array | None = None  # [F]   (mlp_bias)
    up_bias: jax.Array | None = None  # [F]
    down_bias: jax.Array | None = None  # [D]


def _heads_bias(heads: int, hd: int) -> dict:
    """HF [heads*hd] <-> ours [heads, hd]."""
    return dict(to_hf=lambda b: np.asarray(b).reshape(heads * hd), from_hf=lambda b: np.asarray(b).reshape(heads, hd))


def param_specs(cfg: LlamaConfig) -> dict[str, ParamSpec]:
    """Flat description ``{"embed": ..., "layers.0.q": ..., ...}`` of every tensor: the shared decoder table plus
    the optional q/k/v/o and MLP biases."""
    d, f, hd, hq, hkv = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads

    def biases(i, layer, attn, mlp):  # biases start random like weights (init_params knows "ones" and "normal")
        out = {}
        if cfg.attention_bias:
            out.update({
                layer + "q_bias": spec((hq, hd), ("heads", "head_dim"), "normal", attn + "q_proj.bias",
                                       **_heads_bias(hq, hd)),
                layer + "k_bias": spec((hkv, hd), ("kv_heads", "head_dim"), "normal", attn + "k_proj.bias",
                                       **_heads_bias(hkv, hd)),
                layer + "v_bias": spec((hkv, hd), ("kv_heads", "head_dim"), "normal", attn + "v_proj.bias",
                                       **_heads_bias(hkv, hd)),
                layer + "o_bias": spec((d,), ("embed",), "normal", attn + "o_proj.bias"),
            })
        if cfg.mlp_bias:
            out.update({
                layer + "gate_bias": spec((f,), ("ffn",), "normal", mlp + "gate_proj.bias"),
                layer + "up_bias": spec((f,), ("ffn",), "normal", mlp + "up_proj.bias"),
                layer + "down_bias": spec((d,), ("embed",), "normal", mlp + "down_proj.bias"),
            })
        return out

    return decoder_specs(cfg, layer_extra=biases)


def _plus(x, bias):
    """x + bias, or x when the checkpoint has no bias (decided at trace time)."""
    return x if bias is None else x + bias.astype(x.dtype)


def qkv(lp: LayerParams, cfg: LlamaConfig, x, cos, sin):
    """Rotated q [B, T, Hq, hd], k [B, T, Hkv, hd] and v [B, T, Hkv, hd] of one layer (no QK-norm)."""
    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q = _plus(jnp.einsum("btd,dhk->bthk", h, lp.q), lp.q_bias)
    k = _plus(jnp.einsum("btd,dhk->bthk", h, lp.k), lp.k_bias)
    v = _plus(jnp.einsum("btd,dhk->bthk", h, lp.v), lp.v_bias)
    q = constrain(apply_rope(q, cos, sin), ("batch", None, "heads", None))
    return q, apply_rope(k, cos, sin), v


def finish(lp: LayerParams, cfg: LlamaConfig, x, attn):
    """Output projection and the SwiGLU MLP, each with its residual."""
    x = x + _plus(jnp.einsum("bthk,hkd->btd", attn, lp.o), lp.o_bias)
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    gate = _plus(jnp.einsum("btd,df->btf", h, lp.gate), lp.gate_bias)
    up = _plus(jnp.einsum("btd,df->btf", h, lp.up), lp.up_bias)
    hidden = constrain(jax.nn.silu(gate) * up, ("batch", None, "ffn"))
    x = x + _plus(jnp.einsum("btf,fd->btd", hidden, lp.down), lp.down_bias)
    return constrain(x, ("batch", None, None))


LLAMA = register(Family(name="llama", config=LlamaConfig, model_types=("llama",), layer=LayerParams,
                        param_specs=param_specs, qkv=qkv, finish=finish, architectures=ARCHITECTURES))

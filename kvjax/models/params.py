"""Qwen3 parameters: one abstract description drives shapes, logical axes, initial values and HF names.

Each layer keeps its own arrays (a tuple of LayerParams): on CPU and GPU, slicing one layer out of a stacked
``[L, ...]`` array inside jit costs a copy of its weights on every decode step, which halves decode speed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax.models.config import Qwen3Config
from kvjax.sharding import shard, tree_shardings


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


@struct.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None  # [D, V]; None when the head is tied to `embed`


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Everything known about one tensor before it exists."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis names, see kvjax.sharding.RULES
    init: str  # "ones" | "normal"
    hf_name: str  # HF tensor name
    to_hf: Callable[[np.ndarray], np.ndarray]  # our layout -> HF layout
    from_hf: Callable[[np.ndarray], np.ndarray]  # HF layout -> ours


def _t(x):
    return np.asarray(x).T


def param_specs(cfg: Qwen3Config) -> dict[str, ParamSpec]:
    """Flat description ``{"embed": ..., "layers.0.q": ..., ...}`` of every tensor."""
    d, f, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads

    def proj_in(heads):  # HF [heads*hd, D] <-> ours [D, heads, hd]
        return dict(to_hf=lambda w: np.asarray(w).reshape(d, heads * hd).T,
                    from_hf=lambda w: np.asarray(w).T.reshape(d, heads, hd))

    def spec(shape, axes, init, name, **conv):
        conv = conv or dict(to_hf=np.asarray, from_hf=np.asarray)
        return ParamSpec(shape, axes, init, name, **conv)

    specs = {"embed": spec((v, d), ("vocab", "embed"), "normal", "model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        attn, mlp, layer = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        specs.update({
            layer + "attn_norm": spec((d,), ("embed",), "ones", f"model.layers.{i}.input_layernorm.weight"),
            layer + "q": spec((d, hq, hd), ("embed", "heads", "head_dim"), "normal", attn + "q_proj.weight",
                              **proj_in(hq)),
            layer + "k": spec((d, hkv, hd), ("embed", "kv_heads", "head_dim"), "normal", attn + "k_proj.weight",
                              **proj_in(hkv)),
            layer + "v": spec((d, hkv, hd), ("embed", "kv_heads", "head_dim"), "normal", attn + "v_proj.weight",
                              **proj_in(hkv)),
            layer + "q_norm": spec((hd,), ("head_dim",), "ones", attn + "q_norm.weight"),
            layer + "k_norm": spec((hd,), ("head_dim",), "ones", attn + "k_norm.weight"),
            layer + "o": spec((hq, hd, d), ("heads", "head_dim", "embed"), "normal", attn + "o_proj.weight",
                              to_hf=lambda w: np.asarray(w).reshape(hq * hd, d).T,
                              from_hf=lambda w: np.asarray(w).T.reshape(hq, hd, d)),
            layer + "mlp_norm": spec((d,), ("embed",), "ones", f"model.layers.{i}.post_attention_layernorm.weight"),
            layer + "gate": spec((d, f), ("embed", "ffn"), "normal", mlp + "gate_proj.weight", to_hf=_t, from_hf=_t),
            layer + "up": spec((d, f), ("embed", "ffn"), "normal", mlp + "up_proj.weight", to_hf=_t, from_hf=_t),
            layer + "down": spec((f, d), ("ffn", "embed"), "normal", mlp + "down_proj.weight", to_hf=_t, from_hf=_t),
        })
    specs["final_norm"] = spec((d,), ("embed",), "ones", "model.norm.weight")
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = spec((d, v), ("embed", "vocab"), "normal", "lm_head.weight", to_hf=_t, from_hf=_t)
    return specs


def hf_shape(spec: ParamSpec) -> tuple[int, ...]:
    """Shape of the HF tensor for this spec."""
    return tuple(spec.to_hf(np.zeros(spec.shape, np.float32)).shape)


def from_flat(cfg: Qwen3Config, flat: dict) -> Params:
    """Params from ``{"embed": ..., "layers.3.q": ...}`` (leaves may be arrays, specs or anything else)."""
    fields = [f.name for f in dataclasses.fields(LayerParams)]
    layers = tuple(LayerParams(**{n: flat[f"layers.{i}.{n}"] for n in fields}) for i in range(cfg.num_layers))
    return Params(embed=flat["embed"], layers=layers, final_norm=flat["final_norm"],
                  lm_head=None if cfg.tie_word_embeddings else flat["lm_head"])


def to_flat(params: Params) -> dict:
    flat = {"embed": params.embed, "final_norm": params.final_norm}
    for i, lp in enumerate(params.layers):
        flat.update({f"layers.{i}.{f.name}": getattr(lp, f.name) for f in dataclasses.fields(LayerParams)})
    if params.lm_head is not None:
        flat["lm_head"] = params.lm_head
    return flat


def param_axes(cfg: Qwen3Config) -> Params:
    """A Params-shaped pytree of logical-axis tuples (leaves are tuples, so use ``is_leaf`` on them)."""
    return from_flat(cfg, {k: s.axes for k, s in param_specs(cfg).items()})


def abstract_params(cfg: Qwen3Config, dtype=jnp.float32) -> Params:
    return from_flat(cfg, {k: jax.ShapeDtypeStruct(s.shape, dtype) for k, s in param_specs(cfg).items()})


def param_shardings(cfg: Qwen3Config, mesh: jax.sharding.Mesh, rules=None) -> Params:
    """Params-shaped tree of NamedShardings for a model (pass to ``kvjax.load_hf(path, shardings=...)`` so each
    tensor goes straight to its devices; the way to load params in a multi-process run)."""
    return tree_shardings(abstract_params(cfg), param_axes(cfg), mesh, rules)


def shard_params(params: Params, cfg: Qwen3Config, mesh: jax.sharding.Mesh, rules=None) -> Params:
    """device_put `params` onto `mesh` by their logical axes (heads and FFN over 'model' under the default rules)."""
    return shard(params, param_axes(cfg), mesh, rules)


def init_params(cfg: Qwen3Config, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random initial weights (norm weights one, matrices N(0, std)); used for training and tests."""
    specs = param_specs(cfg)
    keys = jax.random.split(key, len(specs))
    flat = {}
    for k, (name, s) in zip(keys, sorted(specs.items())):
        if s.init == "ones":
            flat[name] = jnp.ones(s.shape, dtype)
        else:
            flat[name] = (std * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype)
    return from_flat(cfg, flat)

"""Model parameters: one abstract description per family (its ParamSpec table) drives shapes, logical axes,
initial values and HF names.

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

from kvjax.models.family import family_of
from kvjax.sharding import shard, tree_shardings


@struct.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: tuple  # one family-specific layer pytree per layer (e.g. kvjax.models.qwen3.LayerParams)
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
    # a tensor HF stores in pieces (Qwen3-MoE: one tensor per expert): our axis 0 stacks these HF tensors, each
    # converted by to_hf/from_hf; empty: the one tensor `hf_name`
    hf_parts: tuple[str, ...] = ()


def spec(shape, axes, init, name, hf_parts=(), **conv) -> ParamSpec:
    """A ParamSpec whose HF layout equals ours unless `conv` gives to_hf/from_hf."""
    conv = conv or dict(to_hf=np.asarray, from_hf=np.asarray)
    return ParamSpec(shape, axes, init, name, hf_parts=tuple(hf_parts), **conv)


def transpose() -> dict:
    """HF [out, in] <-> ours [in, out]."""
    return dict(to_hf=lambda w: np.asarray(w).T, from_hf=lambda w: np.asarray(w).T)


def proj_in(d: int, heads: int, hd: int) -> dict:
    """HF [heads*hd, D] <-> ours [D, heads, hd]."""
    return dict(to_hf=lambda w: np.asarray(w).reshape(d, heads * hd).T,
                from_hf=lambda w: np.asarray(w).T.reshape(d, heads, hd))


def decoder_specs(cfg, attn_extra: Callable | None = None, layer_extra: Callable | None = None
                  ) -> dict[str, ParamSpec]:
    """The ParamSpec table every decoder family shares (HF's Llama/Qwen layout: embedding, per layer the RMS norms,
    q/k/v/o and the SwiGLU gate/up/down, the final norm, an untied head), from the config fields all families have.
    A family adds its own tensors per layer: `attn_extra(i, layer, attn)` (after v: Qwen3's QK-norms) and
    `layer_extra(i, layer, attn, mlp)` (after down: Llama's biases), each returning ``{key: ParamSpec}``, where
    `layer` is the key prefix ("layers.3.") and `attn` / `mlp` the HF name prefixes."""
    d, f, v, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    specs = {"embed": spec((v, d), ("vocab", "embed"), "normal", "model.embed_tokens.weight")}
    for i in range(cfg.num_layers):
        attn, mlp, layer = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"layers.{i}."
        specs.update({
            layer + "attn_norm": spec((d,), ("embed",), "ones", f"model.layers.{i}.input_layernorm.weight"),
            layer + "q": spec((d, hq, hd), ("embed", "heads", "head_dim"), "normal", attn + "q_proj.weight",
                              **proj_in(d, hq, hd)),
            layer + "k": spec((d, hkv, hd), ("embed", "kv_heads", "head_dim"), "normal", attn + "k_proj.weight",
                              **proj_in(d, hkv, hd)),
            layer + "v": spec((d, hkv, hd), ("embed", "kv_heads", "head_dim"), "normal", attn + "v_proj.weight",
                              **proj_in(d, hkv, hd)),
            **(attn_extra(i, layer, attn) if attn_extra else {}),
            layer + "o": spec((hq, hd, d), ("heads", "head_dim", "embed"), "normal", attn + "o_proj.weight",
                              to_hf=lambda w: np.asarray(w).reshape(hq * hd, d).T,
                              from_hf=lambda w: np.asarray(w).T.reshape(hq, hd, d)),
            layer + "mlp_norm": spec((d,), ("embed",), "ones", f"model.layers.{i}.post_attention_layernorm.weight"),
            layer + "gate": spec((d, f), ("embed", "ffn"), "normal", mlp + "gate_proj.weight", **transpose()),
            layer + "up": spec((d, f), ("embed", "ffn"), "normal", mlp + "up_proj.weight", **transpose()),
            layer + "down": spec((f, d), ("ffn", "embed"), "normal", mlp + "down_proj.weight", **transpose()),
            **(layer_extra(i, layer, attn, mlp) if layer_extra else {}),
        })
    specs["final_norm"] = spec((d,), ("embed",), "ones", "model.norm.weight")
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = spec((d, v), ("embed", "vocab"), "normal", "lm_head.weight", **transpose())
    return specs


def param_specs(cfg) -> dict[str, ParamSpec]:
    """Flat description ``{"embed": ..., "layers.0.q": ..., ...}`` of every tensor of cfg's family."""
    return family_of(cfg).param_specs(cfg)


def hf_shape(spec: ParamSpec) -> tuple[int, ...]:
    """Shape of the HF tensor for this spec (of each of its parts, for a stacked spec)."""
    return tuple(spec.to_hf(np.zeros(spec.shape[1:] if spec.hf_parts else spec.shape, np.float32)).shape)


def hf_names(spec: ParamSpec) -> tuple[str, ...]:
    """The HF tensors that hold this spec's tensor."""
    return spec.hf_parts or (spec.hf_name,)


def to_hf_tensors(spec: ParamSpec, a: np.ndarray) -> dict[str, np.ndarray]:
    """Our array as its HF tensors, name -> array."""
    if spec.hf_parts:
        return {name: spec.to_hf(a[i]) for i, name in enumerate(spec.hf_parts)}
    return {spec.hf_name: spec.to_hf(a)}


def from_hf_tensors(spec: ParamSpec, get: Callable[[str], np.ndarray], dtype) -> np.ndarray:
    """Our array (C order, `dtype`) from its HF tensors, read one at a time by `get(name)`."""
    if not spec.hf_parts:
        return np.array(spec.from_hf(get(spec.hf_name)), dtype=dtype, order="C")
    out = np.empty(spec.shape, dtype)
    for i, name in enumerate(spec.hf_parts):
        out[i] = spec.from_hf(get(name))
    return out


def from_flat(cfg, flat: dict) -> Params:
    """Params from ``{"embed": ..., "layers.3.q": ...}`` (leaves may be arrays, specs or anything else)."""
    family = family_of(cfg)

    def layer(i):
        kind = family.layer if family.layer_for is None else family.layer_for(cfg, i)
        # a field absent from the table keeps its default (Llama's biases: None when the config has none)
        return kind(**{f.name: flat[k] for f in dataclasses.fields(kind) if (k := f"layers.{i}.{f.name}") in flat})

    layers = tuple(layer(i) for i in range(cfg.num_layers))
    return Params(embed=flat["embed"], layers=layers, final_norm=flat["final_norm"],
                  lm_head=None if cfg.tie_word_embeddings else flat["lm_head"])


def to_flat(params: Params) -> dict:
    flat = {"embed": params.embed, "final_norm": params.final_norm}
    for i, lp in enumerate(params.layers):
        flat.update({f"layers.{i}.{f.name}": getattr(lp, f.name) for f in dataclasses.fields(lp)})
    if params.lm_head is not None:
        flat["lm_head"] = params.lm_head
    return flat


def param_axes(cfg) -> Params:
    """A Params-shaped pytree of logical-axis tuples (leaves are tuples, so use ``is_leaf`` on them)."""
    return from_flat(cfg, {k: s.axes for k, s in param_specs(cfg).items()})


def abstract_params(cfg, dtype=jnp.float32) -> Params:
    return from_flat(cfg, {k: jax.ShapeDtypeStruct(s.shape, dtype) for k, s in param_specs(cfg).items()})


def param_shardings(cfg, mesh: jax.sharding.Mesh, rules=None) -> Params:
    """Params-shaped tree of NamedShardings for a model (pass to ``kvjax.load_hf(path, shardings=...)`` so each
    tensor goes straight to its devices; the way to load params in a multi-process run)."""
    return tree_shardings(abstract_params(cfg), param_axes(cfg), mesh, rules)


def shard_params(params: Params, cfg, mesh: jax.sharding.Mesh, rules=None) -> Params:
    """device_put `params` onto `mesh` by their logical axes (heads and FFN over 'model' under the default rules)."""
    return shard(params, param_axes(cfg), mesh, rules)


def init_params(cfg, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
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

"""Model families: what makes Qwen3, Llama, Qwen3-MoE, ... different, behind one seam.

A family is its config type (a frozen dataclass read from an HF config.json), its `ParamSpec` table (shapes, logical
axes, init, HF names: kvjax.models.params), its per-layer params pytree, and its layer pieces as public functions:

  qkv(lp, cfg, x, cos, sin) -> q [B, T, Hq, hd], k [B, T, Hkv, hd] (both after RoPE), v [B, T, Hkv, hd]
  finish(lp, cfg, x, attn)  -> x after the output projection, the MLP and their residuals

Everything else (attention over the cache, the KV-cache pytree, prefill/decode, generation, the cache map, the
evaluations) is shared: kvjax.models.decoder dispatches on the config's type at trace time, which costs nothing at
run time. A config also describes its RoPE (`cfg.rope`, kvjax.models.rope.Rope), which the forward pass and the
map's key un-rotation both use.

Adding a family is one module that defines these and calls `register`, plus one import line in
kvjax/models/__init__.py; no edit to the decoder, the mapper or the evaluations.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from kvjax.models.hfconfig import ConfigError


class DecoderConfig(Protocol):
    """A model's config as code shared by every family reads it (the decoder, the cache, the map, the builders, the
    evaluations): the type such code is annotated with. Each family's config class (Qwen3Config, LlamaConfig,
    Qwen3MoeConfig, ...) is one: a frozen, hashable dataclass (a static argument of jitted functions) with these
    fields and methods; what only one family has stays behind its own layer pieces."""

    vocab_size: int
    hidden_size: int  # D
    num_layers: int  # L
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None

    @property
    def rope(self):  # kvjax.models.rope.Rope: theta and any scaling
        ...

    def fingerprint(self) -> str:  # hash of the fields that define the model's math
        ...

    def to_hf_dict(self) -> dict:  # the HF config.json it reads back from
        ...


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # e.g. "qwen3"
    config: type  # frozen config dataclass with from_hf_dict / to_hf_dict / fingerprint / rope
    model_types: tuple[str, ...]  # HF config.json "model_type" values this family reads
    layer: type  # per-layer params pytree (a flax struct dataclass)
    param_specs: Callable  # cfg -> {"embed": ParamSpec, "layers.0.q": ..., ...}
    qkv: Callable  # (lp, cfg, x, cos, sin) -> (q, k, v)
    finish: Callable  # (lp, cfg, x, attn) -> x
    architectures: tuple[str, ...] = ()  # HF config.json "architectures" it reads, e.g. ("LlamaForCausalLM",)
    # (cfg, i) -> the layer pytree type of layer i, for families whose layers differ (Qwen3-MoE: dense and sparse
    # MLPs); None: every layer is `layer`
    layer_for: Callable | None = None


_BY_CONFIG: dict[type, Family] = {}
_BY_MODEL_TYPE: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make a family known (called once by its module at import)."""
    _BY_CONFIG[family.config] = family
    for t in family.model_types:
        _BY_MODEL_TYPE[t] = family
    return family


def family_of(cfg) -> Family:
    """The family of a config object (static under jit: the lookup happens at trace time)."""
    try:
        return _BY_CONFIG[type(cfg)]
    except KeyError:
        raise TypeError(f"{type(cfg).__name__} is not the config of a registered model family "
                        f"({', '.join(f.name for f in _BY_CONFIG.values())}); pass a config from "
                        "kvjax.load_hf_config or a family's config class") from None


def supported() -> str:
    """The checkpoints kvjax reads, for error messages: "Qwen3ForCausalLM (model_type 'qwen3'), ..."."""
    return ", ".join(f"{'/'.join(f.architectures) or f.name} (model_type {'/'.join(map(repr, f.model_types))})"
                     for f in sorted(_BY_CONFIG.values(), key=lambda f: f.name))


def family_for_model_type(model_type, source: str = "config.json") -> Family:
    """The family that reads an HF config.json of this model_type, or a ConfigError naming the supported ones."""
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported; kvjax reads {supported()} "
                          "checkpoints")
    return _BY_MODEL_TYPE[model_type]


def check_architectures(family: Family, d: dict, source: str) -> None:
    """A ConfigError naming the supported checkpoints when config.json's "architectures" are not this family's
    (e.g. a LlamaForSequenceClassification head under model_type 'llama')."""
    archs = d.get("architectures") or []
    if archs and not set(archs) & set(family.architectures):
        raise ConfigError(f"{source}: architectures {archs} are not supported (model_type "
                          f"{d.get('model_type')!r}); kvjax reads {supported()} checkpoints")


def families() -> tuple[Family, ...]:
    return tuple(_BY_CONFIG.values())

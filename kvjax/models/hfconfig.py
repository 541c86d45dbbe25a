"""What every model family's config reads from an HF config.json the same way (shapes, norm epsilon, tied head,
context length, special tokens, RoPE settings in either layout) and the error it raises: the bottom of the models
floor, imported by the configs, the family registry and RoPE alike (so none of them imports another in a circle).
No JAX here: configs are read and checked without it."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config.json that kvjax cannot run faithfully."""


SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim")


def check_shape(cfg) -> None:
    """The shape checks every family's config runs in __post_init__ (a ConfigError naming the field)."""
    for name in SHAPE_FIELDS:
        if int(getattr(cfg, name)) <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {getattr(cfg, name)!r}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ConfigError(f"num_attention_heads ({cfg.num_heads}) must be a multiple of num_key_value_heads "
                          f"({cfg.num_kv_heads}) for grouped-query attention")
    if cfg.head_dim % 2:
        raise ConfigError(f"head_dim must be even for rotary embeddings, got {cfg.head_dim}")


def decoder_fields(d: dict[str, Any], source: str, max_position_embeddings: int) -> dict[str, Any]:
    """The config fields every family reads from an HF config.json the same way (shapes, norm epsilon, tied head,
    context length, special tokens); `max_position_embeddings` is the family's default when the file has none."""
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    try:
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        return dict(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", max_position_embeddings)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            pad_token_id=d.get("pad_token_id"),
        )
    except KeyError as e:
        raise ConfigError(f"{source}: required field {e.args[0]!r} is missing") from None


def rope_settings(d: dict[str, Any], source: str) -> tuple[float, Any]:
    """(theta, scaling-or-None) from either the v4 (rope_theta/rope_scaling) or v5 (rope_parameters) layout."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if theta is None:
        theta = 10_000.0
    return float(theta), scaling

"""Qwen3 model configuration: a frozen, hashable dataclass read from an HF ``config.json``.

The config is a static argument of every jitted function, so it holds only what determines shapes and math.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from kvjax.models.family import family_for_model_type, supported
from kvjax.models.hfconfig import ConfigError, check_shape, decoder_fields, rope_settings

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F, the SwiGLU width
    num_layers: int  # L
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads % num_kv_heads == 0)
    head_dim: int  # may differ from hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40_960
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        check_shape(self)

    @property
    def rope(self):
        """The model's RoPE description (kvjax.models.rope.Rope; imported here so configs read without JAX)."""
        from kvjax.models.rope import Rope
        return Rope(self.rope_theta)

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        d, f, l, hd = self.hidden_size, self.intermediate_size, self.num_layers, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + 2 * hd
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + l * per_layer + d + head

    def fingerprint(self) -> str:
        """Hash of the fields that define the model's math (not token ids); recorded in map artifacts."""
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings")
        blob = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    # ---- HF config.json <-> Qwen3Config -------------------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "Qwen3Config":
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        if model_type != "qwen3" or (archs and not set(archs) & set(SUPPORTED_ARCHITECTURES)):
            raise ConfigError(f"{source}: kvjax reads {supported()} checkpoints; got model_type={model_type!r}, "
                              f"architectures={archs}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act={act!r} is not supported (Qwen3 uses 'silu')")
        if d.get("attention_bias", False):
            raise ConfigError(f"{source}: attention_bias=true is not supported (Qwen3 checkpoints have no q/k/v/o bias)")
        if d.get("use_sliding_window", False):
            raise ConfigError(f"{source}: use_sliding_window=true is not supported; kvjax implements full attention "
                              "only. Set use_sliding_window to false if the checkpoint was trained without it.")
        layer_types = d.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            raise ConfigError(f"{source}: layer_types other than 'full_attention' are not supported: "
                              f"{sorted(set(layer_types))}")
        theta, scaling = rope_settings(d, source)
        if scaling is not None:
            raise ConfigError(f"{source}: rope scaling {scaling!r} is not supported; kvjax implements plain RoPE "
                              "(rope_type 'default'). Remove rope_scaling or use a checkpoint without it.")
        return cls(**decoder_fields(d, source, max_position_embeddings=40_960), rope_theta=theta)

    def to_hf_dict(self) -> dict[str, Any]:
        eos = list(self.eos_token_ids)
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }


def load_config(path: str):
    """The config of an HF config.json, read by the family its model_type names (kvjax.models.family)."""
    with open(path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); re-download or re-save the checkpoint") from None
    if d.get("model_type") == "qwen3" or "model_type" not in d:  # Qwen3's own checks explain a wrong architecture
        return Qwen3Config.from_hf_dict(d, source=path)
    return family_for_model_type(d.get("model_type"), path).config.from_hf_dict(d, source=path)

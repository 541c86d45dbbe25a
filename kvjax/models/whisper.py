"""The Whisper audio encoder (OpenAI Whisper as transformers' `WhisperEncoder`; Ultravox's audio tower) as pure
functions over a params pytree: log-mel frames [B, M, T] -> hidden states [B, ceil(T / 2), D].

  conv1 (kernel 3, pad 1) -> GELU -> conv2 (kernel 3, stride 2, pad 1) -> GELU -> + positions[:ceil(T / 2)]
  -> L pre-norm layers: x + out(attn(LN(x))) (q, v and out biases, no k bias, bidirectional),
                        x + fc2(act(fc1(LN(x))))
  -> final LayerNorm

The positions are a stored table (`embed_positions.weight`, sinusoids at init). Inputs shorter than the 30 s window
(2 * max_source_positions mel frames) take the first positions, as Ultravox's encoder does (transformers' own
WhisperEncoder accepts only the full window). A batch whose rows have different valid lengths (`frames` [B]) gives
every row what it gives alone: mel frames past a row's length are zeroed before conv1 and conv1's outputs past it
before conv2 (so each convolution sees the zero padding it would see alone), attention masks the keys past the row's
encoded length, and the output there is zero. (Ultravox masks attention the same way but lets a batch's padding frames
reach a row's last frame through the convolutions; here a row never depends on its batch.)

Log-mel features come from transformers' `WhisperFeatureExtractor` (kvjax.models.audio_lm.log_mel says how).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import aot
from kvjax.models.decoder import NEG_INF
from kvjax.models.hfconfig import ConfigError
from kvjax.models.params import ParamSpec, proj_in, spec, transpose
from kvjax.sharding import constrain

# the activations of HF's ACT2FN that Whisper checkpoints name in "activation_function"
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class WhisperEncoderConfig:
    """A Whisper encoder's shapes and math, read from a Whisper config.json; hashable (static under jit)."""

    num_mel_bins: int  # M: 80 (Whisper v1/v2) or 128 (large-v3, large-v3-turbo)
    d_model: int  # D
    num_layers: int  # L ("encoder_layers")
    num_heads: int  # "encoder_attention_heads"
    ffn_dim: int  # F ("encoder_ffn_dim")
    max_source_positions: int = 1500  # P: encoder positions; the window is 2P mel frames (30 s at 100 frames/s)
    activation: str = "gelu"  # the MLP's ("activation_function"); the conv stem always uses exact GELU
    layer_norm_eps: float = 1e-5  # torch.nn.LayerNorm's default, which Whisper uses

    def __post_init__(self):
        for name in ("num_mel_bins", "d_model", "num_layers", "num_heads", "ffn_dim", "max_source_positions"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"Whisper encoder: {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.d_model % self.num_heads:
            raise ConfigError(f"Whisper encoder: d_model ({self.d_model}) must be a multiple of "
                              f"encoder_attention_heads ({self.num_heads})")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"Whisper encoder: activation_function {self.activation!r} is not supported; kvjax "
                              f"reads {sorted(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def max_frames(self) -> int:
        """The longest input in mel frames (30 s for every released Whisper)."""
        return 2 * self.max_source_positions

    def num_params(self) -> int:
        return int(sum(np.prod(s.shape) for s in encoder_specs(self).values()))

    def to_hf_dict(self) -> dict[str, Any]:
        """The encoder's fields of a Whisper config.json (what from_hf_dict reads; an Ultravox `audio_config`)."""
        return {"model_type": "whisper", "num_mel_bins": self.num_mel_bins, "d_model": self.d_model,
                "encoder_layers": self.num_layers, "encoder_attention_heads": self.num_heads,
                "encoder_ffn_dim": self.ffn_dim, "max_source_positions": self.max_source_positions,
                "activation_function": self.activation}

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "WhisperEncoderConfig":
        """From a Whisper config.json (WhisperModel / WhisperForConditionalGeneration; an Ultravox `audio_config`)."""
        if d.get("model_type", "whisper") != "whisper":
            raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not a Whisper encoder; pass the "
                              "directory of a Whisper checkpoint (model_type 'whisper')")
        try:
            return cls(num_mel_bins=int(d.get("num_mel_bins", 80)), d_model=int(d["d_model"]),
                       num_layers=int(d["encoder_layers"]), num_heads=int(d["encoder_attention_heads"]),
                       ffn_dim=int(d["encoder_ffn_dim"]), max_source_positions=int(d.get("max_source_positions", 1500)),
                       activation=str(d.get("activation_function", "gelu")))
        except KeyError as e:
            raise ConfigError(f"{source}: required Whisper field {e.args[0]!r} is missing") from None


@struct.dataclass
class EncoderLayer:
    attn_norm: jax.Array  # [D]  self_attn_layer_norm
    attn_norm_bias: jax.Array  # [D]
    q: jax.Array  # [D, H, hd]
    q_bias: jax.Array  # [H, hd]
    k: jax.Array  # [D, H, hd]  (no bias: Whisper's k_proj has none)
    v: jax.Array  # [D, H, hd]
    v_bias: jax.Array  # [H, hd]
    o: jax.Array  # [H, hd, D]  out_proj
    o_bias: jax.Array  # [D]
    mlp_norm: jax.Array  # [D]  final_layer_norm (of the layer)
    mlp_norm_bias: jax.Array  # [D]
    fc1: jax.Array  # [D, F]
    fc1_bias: jax.Array  # [F]
    fc2: jax.Array  # [F, D]
    fc2_bias: jax.Array  # [D]


@struct.dataclass
class EncoderParams:
    conv1: jax.Array  # [3, M, D]  (kernel tap, in, out)
    conv1_bias: jax.Array  # [D]
    conv2: jax.Array  # [3, D, D]
    conv2_bias: jax.Array  # [D]
    positions: jax.Array  # [P, D]
    layers: tuple  # L EncoderLayer
    final_norm: jax.Array  # [D]  layer_norm
    final_norm_bias: jax.Array  # [D]


@struct.dataclass
class AudioEncoder:
    """A Whisper encoder as one value (like kvjax.Model): its static config and its params."""

    cfg: WhisperEncoderConfig = struct.field(pytree_node=False)
    params: EncoderParams = None

    def __repr__(self) -> str:
        c = self.cfg
        return (f"AudioEncoder(Whisper, {c.num_layers} layers, d_model {c.d_model}, {c.num_mel_bins} mel bins, "
                f"{c.num_params() / 1e6:.2f}M)")


def _conv() -> dict:
    """HF Conv1d [out, in, k] <-> ours [k, in, out] (reversing the axes is its own inverse)."""
    return dict(to_hf=lambda w: np.asarray(w).transpose(2, 1, 0), from_hf=lambda w: np.asarray(w).transpose(2, 1, 0))


def _heads(h: int, hd: int) -> dict:
    """HF bias [H*hd] <-> ours [H, hd]."""
    return dict(to_hf=lambda b: np.asarray(b).reshape(h * hd), from_hf=lambda b: np.asarray(b).reshape(h, hd))


def encoder_specs(cfg: WhisperEncoderConfig, prefix: str = "model.encoder.") -> dict[str, ParamSpec]:
    """Flat description ``{"conv1": ..., "layers.0.q": ...}`` of every encoder tensor; HF names under `prefix`
    ("model.encoder." in WhisperForConditionalGeneration, "encoder." in WhisperModel, "audio_tower." in Ultravox,
    "" for a bare WhisperEncoder). Init kinds: "ones", "zeros", "normal", "sinusoids" (init_encoder)."""
    d, m, f, h, hd, p = cfg.d_model, cfg.num_mel_bins, cfg.ffn_dim, cfg.num_heads, cfg.head_dim, prefix
    specs = {
        "conv1": spec((3, m, d), (None, None, "embed"), "normal", p + "conv1.weight", **_conv()),
        "conv1_bias": spec((d,), ("embed",), "zeros", p + "conv1.bias"),
        "conv2": spec((3, d, d), (None, None, "embed"), "normal", p + "conv2.weight", **_conv()),
        "conv2_bias": spec((d,), ("embed",), "zeros", p + "conv2.bias"),
        "positions": spec((cfg.max_source_positions, d), (None, "embed"), "sinusoids", p + "embed_positions.weight"),
    }
    for i in range(cfg.num_layers):
        layer, hf = f"layers.{i}.", f"{p}layers.{i}."
        specs.update({
            layer + "attn_norm": spec((d,), ("embed",), "ones", hf + "self_attn_layer_norm.weight"),
            layer + "attn_norm_bias": spec((d,), ("embed",), "zeros", hf + "self_attn_layer_norm.bias"),
            layer + "q": spec((d, h, hd), ("embed", "heads", "head_dim"), "normal", hf + "self_attn.q_proj.weight",
                              **proj_in(d, h, hd)),
            layer + "q_bias": spec((h, hd), ("heads", "head_dim"), "zeros", hf + "self_attn.q_proj.bias",
                                   **_heads(h, hd)),
            layer + "k": spec((d, h, hd), ("embed", "heads", "head_dim"), "normal", hf + "self_attn.k_proj.weight",
                              **proj_in(d, h, hd)),
            layer + "v": spec((d, h, hd), ("embed", "heads", "head_dim"), "normal", hf + "self_attn.v_proj.weight",
                              **proj_in(d, h, hd)),
            layer + "v_bias": spec((h, hd), ("heads", "head_dim"), "zeros", hf + "self_attn.v_proj.bias",
                                   **_heads(h, hd)),
            layer + "o": spec((h, hd, d), ("heads", "head_dim", "embed"), "normal", hf + "self_attn.out_proj.weight",
                              to_hf=lambda w: np.asarray(w).reshape(h * hd, d).T,
                              from_hf=lambda w: np.asarray(w).T.reshape(h, hd, d)),
            layer + "o_bias": spec((d,), ("embed",), "zeros", hf + "self_attn.out_proj.bias"),
            layer + "mlp_norm": spec((d,), ("embed",), "ones", hf + "final_layer_norm.weight"),
            layer + "mlp_norm_bias": spec((d,), ("embed",), "zeros", hf + "final_layer_norm.bias"),
            layer + "fc1": spec((d, f), ("embed", "ffn"), "normal", hf + "fc1.weight", **transpose()),
            layer + "fc1_bias": spec((f,), ("ffn",), "zeros", hf + "fc1.bias"),
            layer + "fc2": spec((f, d), ("ffn", "embed"), "normal", hf + "fc2.weight", **transpose()),
            layer + "fc2_bias": spec((d,), ("embed",), "zeros", hf + "fc2.bias"),
        })
    specs["final_norm"] = spec((d,), ("embed",), "ones", p + "layer_norm.weight")
    specs["final_norm_bias"] = spec((d,), ("embed",), "zeros", p + "layer_norm.bias")
    return specs


def encoder_from_flat(cfg: WhisperEncoderConfig, flat: dict) -> EncoderParams:
    """EncoderParams from ``{"conv1": ..., "layers.3.q": ...}`` (leaves may be arrays, specs or anything else)."""
    layers = tuple(EncoderLayer(**{f.name: flat[f"layers.{i}.{f.name}"] for f in dataclasses.fields(EncoderLayer)})
                   for i in range(cfg.num_layers))
    top = {f.name: flat[f.name] for f in dataclasses.fields(EncoderParams) if f.name != "layers"}
    return EncoderParams(layers=layers, **top)


def encoder_to_flat(params: EncoderParams) -> dict:
    flat = {f.name: getattr(params, f.name) for f in dataclasses.fields(EncoderParams) if f.name != "layers"}
    for i, lp in enumerate(params.layers):
        flat.update({f"layers.{i}.{f.name}": getattr(lp, f.name) for f in dataclasses.fields(lp)})
    return flat


def encoder_axes(cfg: WhisperEncoderConfig) -> EncoderParams:
    """An EncoderParams-shaped pytree of logical-axis tuples (leaves are tuples: use ``is_leaf``)."""
    return encoder_from_flat(cfg, {k: s.axes for k, s in encoder_specs(cfg).items()})


def sinusoids(length: int, channels: int, max_timescale: float = 10_000.0) -> np.ndarray:
    """Whisper's position table [length, channels]: sines then cosines of geometric timescales (what HF's
    WhisperEncoder initialises embed_positions with)."""
    if channels % 2:
        raise ConfigError(f"sinusoidal positions need an even width, got d_model={channels}")
    inc = math.log(max_timescale) / (channels // 2 - 1)
    scaled = np.arange(length)[:, None] * np.exp(-inc * np.arange(channels // 2))[None, :]
    return np.concatenate([np.sin(scaled), np.cos(scaled)], axis=1).astype(np.float32)


def init_spec(s: ParamSpec, key: jax.Array, dtype, std: float) -> jax.Array:
    """A random initial value of one spec (init kinds "ones", "zeros", "normal", "sinusoids")."""
    if s.init == "ones":
        return jnp.ones(s.shape, dtype)
    if s.init == "zeros":
        return jnp.zeros(s.shape, dtype)
    if s.init == "sinusoids":
        return jnp.asarray(sinusoids(*s.shape), dtype)
    return (std * jax.random.normal(key, s.shape, jnp.float32)).astype(dtype)


def init_encoder(cfg: WhisperEncoderConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> AudioEncoder:
    """Random initial weights (norms one, biases zero, positions sinusoids, matrices N(0, std)): training, tests."""
    specs = encoder_specs(cfg)
    keys = jax.random.split(key, len(specs))
    flat = {name: init_spec(s, k, dtype, std) for k, (name, s) in zip(keys, sorted(specs.items()))}
    return AudioEncoder(cfg, encoder_from_flat(cfg, flat))


def encoded_length(frames):
    """Encoder positions of `frames` mel frames: conv2's stride 2 ((frames - 1) // 2 + 1; works on arrays)."""
    return (frames - 1) // 2 + 1


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _conv1d(x: jax.Array, w: jax.Array, b: jax.Array, stride: int) -> jax.Array:
    """x [B, T, C], w [3, C, D] -> [B, (T - 1) // stride + 1, D] (padding 1 each side, as Whisper's convs)."""
    y = jax.lax.conv_general_dilated(x, w.astype(x.dtype), (stride,), [(1, 1)],
                                     dimension_numbers=("NWC", "WIO", "NWC"))
    return y + b.astype(x.dtype)


def _attention(lp: EncoderLayer, x: jax.Array, key_mask: jax.Array) -> jax.Array:
    """Bidirectional self-attention of x [B, T, D] over the keys where key_mask [B, T] -> [B, T, D]."""
    q = jnp.einsum("btd,dhk->bthk", x, lp.q) + lp.q_bias
    k = jnp.einsum("btd,dhk->bthk", x, lp.k)
    v = jnp.einsum("btd,dhk->bthk", x, lp.v) + lp.v_bias
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) * (q.shape[-1] ** -0.5)
    probs = jax.nn.softmax(jnp.where(key_mask[:, None, None, :], scores, NEG_INF), axis=-1).astype(v.dtype)
    attn = jnp.einsum("bhqs,bshk->bqhk", probs, v)
    return jnp.einsum("bthk,hkd->btd", attn, lp.o) + lp.o_bias


def encoder_layer(lp: EncoderLayer, cfg: WhisperEncoderConfig, x: jax.Array, key_mask: jax.Array) -> jax.Array:
    """One pre-norm encoder layer: x [B, T, D] -> [B, T, D]."""
    eps = cfg.layer_norm_eps
    x = x + _attention(lp, layer_norm(x, lp.attn_norm, lp.attn_norm_bias, eps), key_mask)
    h = layer_norm(x, lp.mlp_norm, lp.mlp_norm_bias, eps)
    h = ACTIVATIONS[cfg.activation](jnp.einsum("btd,df->btf", h, lp.fc1) + lp.fc1_bias)
    return x + jnp.einsum("btf,fd->btd", h, lp.fc2) + lp.fc2_bias


def encode_forward(params: EncoderParams, cfg: WhisperEncoderConfig, features: jax.Array,
                   frames: jax.Array | None = None) -> jax.Array:
    """The encoder, traceable: log-mel features [B, M, T] (transformers' `input_features` layout; T <= 2P) with
    `frames` [B] valid frames per row (default T) -> hidden states [B, (T - 1) // 2 + 1, D], zero past each row's
    encoded_length(frames). Computes in the params' dtype (norms and softmax in float32)."""
    b, _, t = features.shape
    dtype = params.conv1.dtype
    if frames is None:
        frames = jnp.full((b,), t, jnp.int32)
    x = constrain(features.transpose(0, 2, 1).astype(dtype), ("batch", None, None))  # [B, T, M]
    valid = (jnp.arange(t)[None, :] < frames[:, None])[..., None]  # [B, T, 1]
    x = jax.nn.gelu(_conv1d(jnp.where(valid, x, 0), params.conv1, params.conv1_bias, 1), approximate=False)
    x = jax.nn.gelu(_conv1d(jnp.where(valid, x, 0), params.conv2, params.conv2_bias, 2), approximate=False)
    t2 = x.shape[1]  # [B, T2, D]
    x = x + params.positions[:t2].astype(dtype)
    keep = jnp.arange(t2)[None, :] < encoded_length(frames)[:, None]  # [B, T2]
    for lp in params.layers:
        x = encoder_layer(lp, cfg, x, keep)
    x = layer_norm(x, params.final_norm, params.final_norm_bias, cfg.layer_norm_eps)
    return jnp.where(keep[..., None], x, 0)


encode_jit = aot.jit(encode_forward, static_argnames=("cfg",))


def check_features(cfg: WhisperEncoderConfig, features, frames, what: str = "encode") -> tuple[np.ndarray, int]:
    """Host checks of encoder inputs (the compiled program cannot raise): features [B, M, T] with M the encoder's mel
    bins and 1 <= T <= 2P, frames [B] in 1..T. Returns (frames as int32 numpy, T)."""
    shape = tuple(getattr(features, "shape", ()))
    if len(shape) != 3 or shape[1] != cfg.num_mel_bins:
        raise ValueError(f"{what}: input_features must be [B, {cfg.num_mel_bins}, T] log-mel frames (the encoder's "
                         f"num_mel_bins; WhisperFeatureExtractor(feature_size={cfg.num_mel_bins}), see "
                         f"kvjax.models.audio_lm.log_mel), got shape {list(shape)}")
    b, _, t = shape
    if not 1 <= t <= cfg.max_frames:
        raise ValueError(f"{what}: {t} mel frames; the encoder takes 1..{cfg.max_frames} (30 s, 2 * "
                         f"max_source_positions); split longer audio with kvjax.models.audio_lm.audio_chunks")
    host = np.full((b,), t, np.int32) if frames is None else np.asarray(jax.device_get(frames))
    if host.shape != (b,) or not np.issubdtype(host.dtype, np.integer) or host.min() < 1 or host.max() > t:
        raise ValueError(f"{what}: frames must be [B] = [{b}] integers in 1..{t} (valid mel frames per row, e.g. the "
                         f"feature extractor's attention_mask.sum(-1)), got {host}")
    return host.astype(np.int32), t


def encode(encoder: AudioEncoder, input_features, frames=None) -> jax.Array:
    """Hidden states [B, (T - 1) // 2 + 1, d_model] of log-mel `input_features` [B, M, T] (T <= 2P frames; what
    WhisperFeatureExtractor returns), `frames` [B] valid frames per row (default T; rows past their length are
    padding and come out zero). Each distinct T compiles once: pad a batch to a few fixed lengths to reuse them
    (with per-row frames, padding changes nothing)."""
    frames, _ = check_features(encoder.cfg, input_features, frames)
    return encode_jit(encoder.params, encoder.cfg, jnp.asarray(input_features), frames)

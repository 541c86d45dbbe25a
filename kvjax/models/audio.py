"""Audio-language models (Ultravox): a Whisper encoder, Ultravox's frame stacking and projector, and a language model
of any kvjax family, whose prefill reads text with audio segments and produces the ordinary KVCache (so the cache
map, the builders and generation take it unchanged).

Ultravox (fixie-ai/ultravox, ultravox/model/ultravox_model.py and ultravox_processing.py; followed at commit
648efe7 of 2025-08-09, the v0.6 code, whose projector is unchanged since v0.5 (ec03371, 2025-02-06)):

  audio [N samples, 16 kHz] --WhisperFeatureExtractor--> log-mel [M, F frames] --Whisper encoder--> [ceil(F/2), C]
  --stack every S frames (zero-pad the tail)--> [ceil(F/2S), S*C]
  --RMSNorm(ln_pre) -> Linear(S*C -> H, no bias) -> SwiGLU (x, gate = halves; x * silu(gate)) -> H/2
  --RMSNorm(ln_mid) -> Linear(H/2 -> D, no bias)--> audio embeddings [ceil(F/2S), D]

  v0.5 and later (config "projector_ln_mid": true) normalise after the SwiGLU as above; v0.4.1 and earlier
  (projector_ln_mid false, Ultravox's default) instead normalise after linear_2 (ln_post). RMSNorms are LlamaRMSNorm
  with eps 1e-6 (Ultravox's default; not read from the config). A projector_act other than "swiglu" keeps the width H.

  The text's `<|audio|>` placeholder becomes audio_token_count(F) = ceil(F / (2 S)) positions (Ultravox's processor:
  ceil(audio_lens / (encoder_ds_factor * stack_factor))) whose embeddings are the audio embeddings, in order; the
  other positions keep the language model's token embeddings. Audio longer than the encoder's 30 s window is split
  into 30 s chunks (audio_chunks), each encoded alone, their tokens consecutive under the one placeholder.

Log-mel features (`log_mel`) come from transformers' WhisperFeatureExtractor, called as Ultravox's processor calls it
(one clip at a time; `log_mel` then zero-pads the clips to the longest):

  from transformers import WhisperFeatureExtractor
  fe = WhisperFeatureExtractor(feature_size=128)  # the encoder's num_mel_bins: 128 for large-v3(-turbo), else 80
  out = fe([audio], sampling_rate=16_000, padding="longest", pad_to_multiple_of=fe.hop_length, truncation=False,
           return_attention_mask=True, return_tensors="np")
  features, frames = out.input_features, out.attention_mask.sum(-1)  # [1, M, T] float32, [1] valid frames

Audio must be mono float at 16 kHz (resample first); clips shorter than two hops (320 samples) are zero-padded to
that. transformers is needed only for this (`pip install 'kvjax[audio]'`); everything else here is JAX.

Checkpoints: `load_audio_encoder` reads the encoder of an HF Whisper directory (WhisperModel or
WhisperForConditionalGeneration; encoder tensors only) or of an Ultravox directory; `load_ultravox` reads Ultravox's
layout: config.json (model_type "ultravox", `audio_config` (Whisper), `text_config` (the LM, any kvjax family) and/or
`text_model_id`, `hidden_size`, `stack_factor`, `projector_act`, `projector_ln_mid`, `norm_init`,
`audio_token_index`) and safetensors with `audio_tower.*`, `multi_modal_projector.*` and `language_model.*`. The
released checkpoints hold no language_model.* tensors (they name the LM by text_model_id): pass its directory as
`text_path`. `audio_configs` reads the same config.json without any weights: the encoder's, the projector's and the
language model's configs (configs/models/ holds the released checkpoints' config.json files).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import aot
from kvjax.hf import CheckpointError, load_hf, load_hf_config, open_weights, resolve
from kvjax.models.decoder import embed, prefill_jit, rms_norm
from kvjax.models.family import family_for_model_type
from kvjax.models.hfconfig import ConfigError
from kvjax.models.model import Model
from kvjax.models.params import ParamSpec, from_flat, from_hf_tensors, hf_names, hf_shape, param_specs, spec, transpose
from kvjax.models.whisper import (AudioEncoder, WhisperEncoderConfig, check_features, encode_forward, encoder_from_flat,
                                  encoder_specs, init_spec)

SAMPLING_RATE = 16_000  # Whisper's, and so Ultravox's
PLACEHOLDER = "<|audio|>"
IGNORED = ("rotary_emb.inv_freq",)  # buffers some exporters write


# ---- features ------------------------------------------------------------------------------------------------------

def log_mel(audios: Sequence[np.ndarray], num_mel_bins: int = 128, sampling_rate: int = SAMPLING_RATE,
            feature_extractor=None) -> tuple[np.ndarray, np.ndarray]:
    """Log-mel features of mono 16 kHz clips by transformers' WhisperFeatureExtractor, each clip extracted alone as
    Ultravox's processor extracts one example's audio (its length rounded up to a hop, no truncation; a clip's last
    frame would differ if the extractor saw the batch's zero padding after it), then zero-padded to the longest:
    (features float32 [B, M, T], frames int32 [B] valid frames per row). `feature_extractor`: one loaded from a
    checkpoint (WhisperFeatureExtractor.from_pretrained(dir)); default one of `num_mel_bins` bins."""
    try:
        from transformers import WhisperFeatureExtractor
    except ImportError:
        raise ImportError("kvjax.models.audio.log_mel uses transformers' WhisperFeatureExtractor; install it with "
                          "`pip install 'kvjax[audio]'` (or pass precomputed log-mel features)") from None
    fe = feature_extractor or WhisperFeatureExtractor(feature_size=num_mel_bins)
    if sampling_rate != fe.sampling_rate:
        raise ValueError(f"log_mel: audio at {sampling_rate} Hz; Whisper reads {fe.sampling_rate} Hz: resample first "
                         "(e.g. librosa.resample or torchaudio.functional.resample)")
    hop = fe.hop_length
    feats, frames = [], []
    for i, a in enumerate(audios):
        a = np.asarray(a, np.float32)
        if a.ndim != 1 or not a.size:
            raise ValueError(f"log_mel: clip {i} must be a non-empty mono waveform [samples], got shape {a.shape}")
        a = np.pad(a, (0, max(0, 2 * hop - a.size)))  # Ultravox: at least two hops
        out = fe([a], sampling_rate=sampling_rate, padding="longest", pad_to_multiple_of=hop, truncation=False,
                 return_attention_mask=True, return_tensors="np")
        feats.append(np.asarray(out["input_features"][0], np.float32))  # [M, T_i]
        frames.append(int(np.asarray(out["attention_mask"]).sum()))
    if not feats:
        raise ValueError("log_mel: no clips given")
    t = max(f.shape[1] for f in feats)
    return np.stack([np.pad(f, ((0, 0), (0, t - f.shape[1]))) for f in feats]), np.asarray(frames, np.int32)


def audio_chunks(features: np.ndarray, frames, window: int = 3000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Ultravox's split of audio longer than the encoder's window: each clip of features [B, M, T] with `frames` [B]
    becomes ceil(frames / window) chunks of at most `window` frames (2 * max_source_positions: 3000), encoded alone.
    Returns (chunk features [N, M, min(T, window)], chunk frames [N], chunks per clip [B]); a clip's chunks are
    consecutive, so its audio tokens stay consecutive under its one placeholder."""
    features = np.asarray(features)
    frames = np.asarray(frames, np.int64)
    width = min(features.shape[2], window)
    out, lens, per = [], [], []
    for i, f in enumerate(frames):
        offsets = range(0, int(f), window)
        for off in offsets:
            chunk = features[i, :, off:off + width]
            out.append(np.pad(chunk, ((0, 0), (0, width - chunk.shape[1]))))
            lens.append(min(int(f) - off, window))
        per.append(len(offsets))
    return np.stack(out), np.asarray(lens, np.int32), np.asarray(per, np.int32)


def audio_token_count(frames, stack_factor: int = 8, window: int | None = None):
    """Audio tokens (LM positions) of a clip of `frames` mel frames: ceil(frames / (2 * stack_factor)), Ultravox's
    formula (the encoder halves the frames, the projector stacks `stack_factor` of them). With `window`, a clip longer
    than it is counted as audio_chunks splits it (each chunk rounded up alone). Works on ints and arrays."""
    per = 2 * stack_factor
    if window is None:
        return (frames + per - 1) // per
    return (frames // window) * ((window + per - 1) // per) + ((frames % window) + per - 1) // per


# ---- projector ------------------------------------------------------------------------------------------------------

PROJECTOR_ACTS = ("swiglu", "gelu", "silu", "swish", "relu")


@dataclasses.dataclass(frozen=True)
class ProjectorConfig:
    """Ultravox's multi-modal projector: stacked encoder frames -> the LM's embedding space."""

    audio_dim: int  # C: the encoder's d_model
    text_dim: int  # D: the language model's hidden_size
    hidden_size: int = 4096  # H: linear_1's width (Ultravox config "hidden_size")
    stack_factor: int = 8  # S
    act: str = "swiglu"  # "projector_act"
    ln_mid: bool = False  # "projector_ln_mid": true from v0.5 (norm after the activation), else after linear_2
    eps: float = 1e-6  # Ultravox's RMSNorm default
    norm_init: float = 0.4  # initial norm weights ("norm_init")

    def __post_init__(self):
        if self.act not in PROJECTOR_ACTS:
            raise ConfigError(f"Ultravox projector_act {self.act!r} is not supported; kvjax reads {PROJECTOR_ACTS}")
        if self.act == "swiglu" and self.hidden_size % 2:
            raise ConfigError(f"Ultravox hidden_size ({self.hidden_size}) must be even for a SwiGLU projector")
        for name in ("audio_dim", "text_dim", "hidden_size", "stack_factor"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"Ultravox projector: {name} must be a positive integer, got {getattr(self, name)}")

    @property
    def in_dim(self) -> int:
        return self.audio_dim * self.stack_factor

    @property
    def mid_dim(self) -> int:
        return self.hidden_size // 2 if self.act == "swiglu" else self.hidden_size

    @classmethod
    def from_ultravox(cls, d: dict[str, Any], audio_dim: int, text_dim: int) -> "ProjectorConfig":
        """From an Ultravox config.json; absent fields take UltravoxConfig's defaults (what its to_diff_dict drops)."""
        return cls(audio_dim=audio_dim, text_dim=text_dim, hidden_size=int(d.get("hidden_size", 4096)),
                   stack_factor=int(d.get("stack_factor", 8)), act=str(d.get("projector_act", "swiglu")),
                   ln_mid=bool(d.get("projector_ln_mid", False)), norm_init=float(d.get("norm_init", 0.4)))


@struct.dataclass
class ProjectorParams:
    ln_pre: jax.Array  # [S*C]
    linear_1: jax.Array  # [S*C, H]
    linear_2: jax.Array  # [H', D]  (H' = H / 2 after SwiGLU)
    ln_mid: jax.Array | None = None  # [H']  (projector_ln_mid)
    ln_post: jax.Array | None = None  # [D]  (not projector_ln_mid)


@struct.dataclass
class Projector:
    cfg: ProjectorConfig = struct.field(pytree_node=False)
    params: ProjectorParams = None


def projector_specs(cfg: ProjectorConfig, prefix: str = "multi_modal_projector.") -> dict[str, ParamSpec]:
    """The projector's tensors with Ultravox's names (init "norm" is norm_init, see init_projector)."""
    specs = {
        "ln_pre": spec((cfg.in_dim,), (None,), "norm", prefix + "ln_pre.weight"),
        "linear_1": spec((cfg.in_dim, cfg.hidden_size), (None, "ffn"), "normal", prefix + "linear_1.weight",
                         **transpose()),
        "linear_2": spec((cfg.mid_dim, cfg.text_dim), (None, "embed"), "normal", prefix + "linear_2.weight",
                         **transpose()),
    }
    if cfg.ln_mid:
        specs["ln_mid"] = spec((cfg.mid_dim,), (None,), "norm", prefix + "ln_mid.weight")
    else:
        specs["ln_post"] = spec((cfg.text_dim,), ("embed",), "norm", prefix + "ln_post.weight")
    return specs


def init_projector(cfg: ProjectorConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Projector:
    """Random initial weights: norms at norm_init (Ultravox's), matrices N(0, std)."""
    specs = projector_specs(cfg)
    keys = jax.random.split(key, len(specs))
    flat = {name: (jnp.full(s.shape, cfg.norm_init, dtype) if s.init == "norm" else init_spec(s, k, dtype, std))
            for k, (name, s) in zip(keys, sorted(specs.items()))}
    return Projector(cfg, ProjectorParams(**flat))


def stack_frames(x: jax.Array, stack_factor: int) -> jax.Array:
    """[B, T, C] -> [B, ceil(T / S), S * C]: each output frame is S consecutive frames side by side (frame-major),
    the tail zero-padded (Ultravox's StackAudioFrames)."""
    b, t, c = x.shape
    pad = -t % stack_factor
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    return x.reshape(b, (t + pad) // stack_factor, stack_factor * c)


def _activation(act: str, h: jax.Array) -> jax.Array:
    if act == "swiglu":
        x, gate = jnp.split(h, 2, axis=-1)  # Ultravox's SwiGLU: the first half is the value, the second the gate
        return jax.nn.silu(gate) * x
    if act == "gelu":
        return jax.nn.gelu(h, approximate=False)
    return jax.nn.relu(h) if act == "relu" else jax.nn.silu(h)


def project_forward(params: ProjectorParams, cfg: ProjectorConfig, states: jax.Array) -> jax.Array:
    """Encoder states [B, T, C] -> audio embeddings [B, ceil(T / S), D] (in the projector params' dtype)."""
    x = stack_frames(states.astype(params.linear_1.dtype), cfg.stack_factor)  # [B, N, S*C]
    x = rms_norm(x, params.ln_pre, cfg.eps)
    h = _activation(cfg.act, jnp.einsum("bni,ih->bnh", x, params.linear_1))  # [B, N, H']
    if params.ln_mid is not None:
        h = rms_norm(h, params.ln_mid, cfg.eps)
    y = jnp.einsum("bnh,hd->bnd", h, params.linear_2)  # [B, N, D]
    return y if params.ln_post is None else rms_norm(y, params.ln_post, cfg.eps)


# ---- the audio-language model ----------------------------------------------------------------------------------------

@struct.dataclass
class AudioLM:
    """An audio-language model as one pytree: Whisper encoder, projector, language model (a kvjax Model of any
    family). `audio_token_index`: the placeholder's id after expansion (None: pass audio masks explicitly)."""

    encoder: AudioEncoder
    projector: Projector
    lm: Model
    audio_token_index: int | None = struct.field(pytree_node=False, default=None)

    @property
    def stack_factor(self) -> int:
        return self.projector.cfg.stack_factor

    def __repr__(self) -> str:
        return f"AudioLM({self.encoder!r}, projector {self.projector.cfg.hidden_size}, {self.lm!r})"


def audio_embeddings_forward(alm: AudioLM, features: jax.Array, frames: jax.Array) -> jax.Array:
    """Audio embeddings [N, ceil(ceil(T / 2) / S), D] of N clips (features [N, M, T], frames [N]); clip i's first
    audio_token_count(frames[i]) rows are its tokens (traceable)."""
    states = encode_forward(alm.encoder.params, alm.encoder.cfg, features, frames)  # [N, T2, C], zero past each clip
    return project_forward(alm.projector.params, alm.projector.cfg, states)


def merge_audio(lm_params, tokens: jax.Array, audio_mask: jax.Array, audio: jax.Array, counts: jax.Array) -> jax.Array:
    """Prompt embeddings [B, T, D]: the LM's token embeddings, except at the audio positions (audio_mask [B, T]),
    which take the audio tokens in order: the k-th audio position in row-major order gets the k-th token of the
    clips' tokens laid end to end (clip i: audio[i, :counts[i]]). Traceable; ids under the mask are not read."""
    b, t = tokens.shape
    text = embed(lm_params, jnp.where(audio_mask, 0, tokens))  # [B, T, D]
    rank = jnp.cumsum(audio_mask.reshape(-1).astype(jnp.int32)) - 1  # [B*T] index among the audio positions
    ends = jnp.cumsum(counts)  # [N]
    clip = jnp.minimum(jnp.searchsorted(ends, rank, side="right"), audio.shape[0] - 1)
    offset = jnp.clip(rank - (ends - counts)[clip], 0, audio.shape[1] - 1)
    rows = audio[clip, offset].reshape(b, t, -1).astype(text.dtype)
    return jnp.where(audio_mask[..., None], rows, text)


def prompt_embeddings_forward(alm: AudioLM, tokens: jax.Array, audio_mask: jax.Array, features: jax.Array,
                              frames: jax.Array) -> jax.Array:
    """The audio-language prompt's input embeddings [B, T, D] (traceable): encoder, projector, merge."""
    audio = audio_embeddings_forward(alm, features, frames)
    return merge_audio(alm.lm.params, tokens, audio_mask, audio, audio_token_count(frames, alm.stack_factor))


prompt_embeddings_jit = aot.jit(prompt_embeddings_forward)


def _prompt_inputs(alm: AudioLM, tokens, input_features, frames, audio_mask, lengths, what: str):
    """Host checks of an audio-language prompt (the compiled program cannot raise); numpy inputs for it."""
    tokens = np.asarray(jax.device_get(tokens))
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{what}: tokens must be an integer array [B, T], got {tokens.dtype}{list(tokens.shape)}")
    b, t = tokens.shape
    new = np.full((b,), t) if lengths is None else np.asarray(jax.device_get(lengths))
    if new.shape != (b,) or new.min() < 1 or new.max() > t:
        raise ValueError(f"{what}: lengths must be [B] = [{b}] integers in 1..{t} (real tokens per row), got {new}")
    real = np.arange(t)[None, :] < new[:, None]
    if audio_mask is None:
        if alm.audio_token_index is None:
            raise ValueError(f"{what}: this model has no audio_token_index; pass audio_mask [B, T] (True at the audio "
                             "positions, as expand_audio returns it)")
        audio_mask = tokens == alm.audio_token_index
    audio_mask = np.asarray(jax.device_get(audio_mask), bool)
    if audio_mask.shape != (b, t):
        raise ValueError(f"{what}: audio_mask must be [B, T] = [{b}, {t}], got {list(audio_mask.shape)}")
    if (audio_mask & ~real).any():
        raise ValueError(f"{what}: audio positions past a row's length ({np.argwhere(audio_mask & ~real)[0].tolist()});"
                         " the audio tokens must be among each row's real tokens")
    bad = real & ~audio_mask & ((tokens < 0) | (tokens >= alm.lm.cfg.vocab_size))
    if bad.any():
        at = np.argwhere(bad)[0].tolist()
        raise ValueError(f"{what}: token ids must be in [0, {alm.lm.cfg.vocab_size}) (the LM's vocab_size) outside "
                         f"the audio positions, got {int(tokens[tuple(at)])} at {at}; is audio_mask right?")
    if input_features is None:
        if audio_mask.any():
            raise ValueError(f"{what}: the prompt has {int(audio_mask.sum())} audio positions but no input_features "
                             "were given")
        return tokens.astype(np.int32), new.astype(np.int32), audio_mask, None, None
    frames, _ = check_features(alm.encoder.cfg, input_features, frames, what)
    want = int(audio_token_count(frames.astype(np.int64), alm.stack_factor).sum())
    if int(audio_mask.sum()) != want:
        raise ValueError(f"{what}: the prompt has {int(audio_mask.sum())} audio positions but the clips' frames "
                         f"{frames.tolist()} make {want} audio tokens (ceil(frames / {2 * alm.stack_factor}) each); "
                         "expand each placeholder with kvjax.models.audio.expand_audio (or audio_prompt)")
    return tokens.astype(np.int32), new.astype(np.int32), audio_mask, np.asarray(input_features), frames


def prompt_embeddings(alm: AudioLM, tokens, input_features, frames=None, *, audio_mask=None) -> jax.Array:
    """The input embeddings [B, T, D] of an audio-language prompt (what the language model reads; e.g. to run
    another implementation on them, or for distillation). Arguments as prefill_audio's."""
    tokens, _, mask, features, frames = _prompt_inputs(alm, tokens, input_features, frames, audio_mask, None,
                                                       "prompt_embeddings")
    if features is None:
        return embed(alm.lm.params, jnp.asarray(tokens))
    return prompt_embeddings_jit(alm, tokens, mask, features, frames)


def prefill_audio(alm: AudioLM, tokens, input_features=None, frames=None, *, audio_mask=None, lengths=None,
                  capacity: int | None = None, dtype=None, last_only: bool = True):
    """Prefill an audio-language prompt into a new KVCache: (logits [B, V] at each row's last real token (or
    [B, T, V] without `last_only`), the ordinary kvjax.KVCache of the language model, `capacity` positions
    (default T), `dtype` (default the LM's)).

    tokens int [B, T] (right-padded; `lengths` [B] real tokens per row): the prompt with each `<|audio|>` expanded to
    its clip's audio_token_count positions (expand_audio / audio_prompt), marked by `audio_mask` [B, T] (default:
    tokens == the model's audio_token_index). input_features [N, M, F] (log_mel; N clips in the order their
    positions appear, row by row; F <= the encoder's window, split longer audio with audio_chunks) with `frames` [N]
    valid frames per clip. Without audio this is exactly the plain prefill (kvjax.models.decoder.prefill_jit)."""
    tokens, lengths, mask, features, frames = _prompt_inputs(alm, tokens, input_features, frames, audio_mask, lengths,
                                                             "prefill_audio")
    t = tokens.shape[1]
    if capacity is not None and capacity < t:
        raise ValueError(f"prefill_audio: the prompt has {t} positions but capacity is {capacity}; pass capacity >= "
                         "prompt + new tokens")
    # the encoder, projector and merge in one program, then the library's one prefill program over the embeddings
    embeds = None if features is None else prompt_embeddings_jit(alm, tokens, mask, features, frames)
    out = prefill_jit(alm.lm.params, alm.lm.cfg, None if embeds is not None else tokens, lengths, capacity=capacity,
                      dtype=dtype, last_only=last_only, embeds=embeds)
    return out.logits, out.cache


def expand_audio(ids: Sequence[int], placeholder_id: int, audio_tokens: Sequence[int],
                 fill_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Token ids with one `placeholder_id` per clip -> (ids int32 [T'] with the k-th placeholder repeated
    audio_tokens[k] times (as `fill_id`, default the placeholder itself), audio mask bool [T'])."""
    ids = list(ids)
    where = [i for i, x in enumerate(ids) if x == placeholder_id]
    if len(where) != len(audio_tokens):
        raise ValueError(f"expand_audio: {len(where)} audio placeholders (id {placeholder_id}) but "
                         f"{len(audio_tokens)} clips; put one placeholder per clip")
    out, mask, last = [], [], 0
    for i, n in zip(where, audio_tokens):
        out += ids[last:i] + [placeholder_id if fill_id is None else fill_id] * int(n)
        mask += [False] * (i - last) + [True] * int(n)
        last = i + 1
    out += ids[last:]
    mask += [False] * (len(ids) - last)
    return np.asarray(out, np.int32), np.asarray(mask, bool)


def audio_prompt(tokenizer, text: str, audio_tokens: Sequence[int], fill_id: int,
                 placeholder: str = PLACEHOLDER) -> tuple[np.ndarray, np.ndarray]:
    """Ultravox's processor: `text` split around each `placeholder` (not in the vocabulary), the pieces tokenized
    without special tokens (add BOS / the chat template to `text` first), the k-th placeholder replaced by
    audio_tokens[k] copies of `fill_id` (Ultravox uses the tokenizer's EOS). `tokenizer`: a tokenizers.Tokenizer
    (kvjax.load_tokenizer). Returns (ids int32 [T], audio mask bool [T])."""
    parts = text.split(placeholder)
    if len(parts) != len(audio_tokens) + 1:
        raise ValueError(f"audio_prompt: {len(parts) - 1} {placeholder} placeholders in the text but "
                         f"{len(audio_tokens)} clips")
    ids, mask = [], []
    for k, part in enumerate(parts):
        piece = tokenizer.encode(part, add_special_tokens=False).ids if part else []
        ids += piece
        mask += [False] * len(piece)
        if k < len(audio_tokens):
            ids += [fill_id] * int(audio_tokens[k])
            mask += [True] * int(audio_tokens[k])
    return np.asarray(ids, np.int32), np.asarray(mask, bool)


# ---- checkpoints -----------------------------------------------------------------------------------------------------

def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path} has no config.json; pass a Whisper or Ultravox checkpoint directory")
    with open(cfg_path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); re-download or re-save the "
                                  "checkpoint") from None


def _read_ultravox(path: str, what: str) -> tuple[dict, str]:
    """An Ultravox config.json (and its name, for messages), with the checks every reader of one makes."""
    d = _read_config(path)
    source = os.path.join(path, "config.json")
    if d.get("model_type") != "ultravox":
        raise CheckpointError(f"{source}: model_type {d.get('model_type')!r} is not 'ultravox'; {what} reads "
                              "Ultravox checkpoints (a plain LM: kvjax.load_hf; a Whisper encoder: load_audio_encoder)")
    if d.get("audio_latency_block_size") is not None:
        raise CheckpointError(f"{source}: audio_latency_block_size {d['audio_latency_block_size']!r} (Ultravox's "
                              "block-causal streaming mask in the encoder) is not supported; kvjax's encoder attends "
                              "over the whole clip (audio_latency_block_size null)")
    return d, source


def _check_vocab(d: dict, lm_cfg, source: str) -> None:
    vocab = d.get("vocab_size")
    if vocab is not None and int(vocab) != lm_cfg.vocab_size:
        raise CheckpointError(f"{source}: vocab_size {vocab} but the language model has {lm_cfg.vocab_size}; is "
                              "text_path the checkpoint named by text_model_id?")


def _prefixed(specs: dict[str, ParamSpec], prefix: str) -> dict[str, ParamSpec]:
    return {k: dataclasses.replace(s, hf_name=prefix + s.hf_name, hf_parts=tuple(prefix + p for p in s.hf_parts))
            for k, s in specs.items()}


def _read(specs: dict[str, ParamSpec], tensors: dict, prefix: str, dtype, source: str,
          extra: tuple[str, ...] = ()) -> dict:
    """Our arrays of `specs` from the checkpoint's tensors; every tensor under `prefix` must be one of them (or in
    `extra`), so a config that does not match the weights is an error, not a silent drop."""
    expected = {n for s in specs.values() for n in hf_names(s)}
    missing = sorted(expected - set(tensors))
    unexpected = sorted(n for n in tensors if n.startswith(prefix) and n not in expected and n not in extra
                        and not n.endswith(IGNORED))
    for kind, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            raise CheckpointError(f"{source}: {kind} tensors under {prefix or 'the root'!r} ({len(names)}): "
                                  f"{names[:8]}{' ...' if len(names) > 8 else ''}; does config.json match the weights?")
    np_dtype = np.dtype(jnp.dtype(dtype))
    flat = {}
    for name, s in specs.items():
        for n in hf_names(s):
            if tensors[n].shape(n) != hf_shape(s):
                raise CheckpointError(f"{source}: tensor {n!r} has shape {list(tensors[n].shape(n))}, config.json "
                                      f"implies {list(hf_shape(s))}; the config does not match the weights")
        flat[name] = jnp.asarray(from_hf_tensors(s, lambda n: tensors[n].get(n), np_dtype))
    return flat


ENCODER_PREFIXES = ("model.encoder.", "encoder.", "audio_tower.", "")


def _encoder_prefix(tensors: dict, source: str) -> str:
    for p in ENCODER_PREFIXES:
        if p + "conv1.weight" in tensors:
            return p
    raise CheckpointError(f"{source}: no Whisper encoder tensors (looked for conv1.weight under "
                          f"{[p or '(root)' for p in ENCODER_PREFIXES]}); is this a Whisper or Ultravox checkpoint?")


def _load_encoder(cfg: WhisperEncoderConfig, tensors: dict, dtype, source: str) -> AudioEncoder:
    prefix = _encoder_prefix(tensors, source)
    flat = _read(encoder_specs(cfg, prefix), tensors, prefix, dtype, source)
    return AudioEncoder(cfg, encoder_from_flat(cfg, flat))


def load_audio_encoder(path: str, dtype=jnp.float32) -> AudioEncoder:
    """The Whisper encoder of an HF checkpoint directory: WhisperModel / WhisperForConditionalGeneration (model_type
    "whisper"; the decoder's tensors are not read), a bare WhisperEncoder, or an Ultravox directory (its audio
    tower). `dtype`: the parameter dtype (float32 or bfloat16)."""
    path = resolve(path)
    d = _read_config(path)
    source = os.path.join(path, "config.json")
    if d.get("model_type") == "ultravox":
        d, source = d.get("audio_config") or {}, source + " audio_config"
    if d.get("model_type") != "whisper":
        raise CheckpointError(f"{source}: model_type {d.get('model_type')!r}; load_audio_encoder reads Whisper "
                              "checkpoints (WhisperModel, WhisperForConditionalGeneration) and Ultravox's audio tower")
    return _load_encoder(WhisperEncoderConfig.from_hf_dict(d, source), open_weights(path), dtype, path)


def _text_config(d: dict, source: str):
    """A kvjax family config from an Ultravox text_config (its model_type; "llama" when absent, as Ultravox)."""
    return family_for_model_type(d.get("model_type", "llama"), source).config.from_hf_dict(d, source=source)


def load_ultravox(path: str, dtype=jnp.float32, text_path: str | None = None,
                  audio_path: str | None = None, lm: Model | None = None) -> AudioLM:
    """An Ultravox checkpoint directory as an AudioLM (encoder, projector, language model).

    The language model comes from the directory's language_model.* tensors with its `text_config`, or, when given
    (and always when the directory has none, as in the released checkpoints, which name it by `text_model_id`), from
    the HF checkpoint `text_path`, or `lm`, a language model already loaded (e.g. the job's own); likewise the
    encoder from audio_tower.* or `audio_path`. `dtype`: the parameter dtype of all three (`lm` is taken as it is)."""
    path = resolve(path)
    d, source = _read_ultravox(path, "load_ultravox")
    tensors = open_weights(path)
    has = {p: any(n.startswith(p) for n in tensors) for p in ("audio_tower.", "language_model.")}

    if audio_path is not None:
        encoder = load_audio_encoder(audio_path, dtype)
    elif has["audio_tower."]:
        if not d.get("audio_config"):
            raise CheckpointError(f"{source} has no audio_config for its audio_tower.* tensors; re-save the config "
                                  "with the Whisper config inlined")
        encoder = _load_encoder(WhisperEncoderConfig.from_hf_dict(d["audio_config"], source + " audio_config"),
                                {n: f for n, f in tensors.items() if n.startswith("audio_tower.")}, dtype, path)
    else:
        raise CheckpointError(f"{path} holds no audio_tower.* tensors (audio_model_id {d.get('audio_model_id')!r}); "
                              "pass audio_path= a local directory of that Whisper checkpoint")

    if lm is not None:
        pass
    elif text_path is not None:
        lm = load_hf(text_path, dtype)
    elif has["language_model."]:
        if not d.get("text_config"):
            raise CheckpointError(f"{source} has no text_config for its language_model.* tensors; re-save the "
                                  "config with the LM's config inlined, or pass text_path= the LM's directory")
        cfg = _text_config(d["text_config"], source + " text_config")
        extra = ("language_model.lm_head.weight",) if cfg.tie_word_embeddings else ()
        flat = _read(_prefixed(param_specs(cfg), "language_model."), tensors, "language_model.", dtype, path, extra)
        lm = Model(cfg, from_flat(cfg, flat))
    else:
        raise CheckpointError(f"{path} holds no language_model.* tensors (text_model_id {d.get('text_model_id')!r}): "
                              "pass text_path= a local directory of that checkpoint")

    pcfg = ProjectorConfig.from_ultravox(d, encoder.cfg.d_model, lm.cfg.hidden_size)
    names = set(tensors)
    for flag, present, absent in ((True, "ln_mid", "ln_post"), (False, "ln_post", "ln_mid")):
        if pcfg.ln_mid != flag and f"multi_modal_projector.{present}.weight" in names \
                and f"multi_modal_projector.{absent}.weight" not in names:
            raise CheckpointError(f"{source}: projector_ln_mid is {str(pcfg.ln_mid).lower()} but the weights have "
                                  f"multi_modal_projector.{present}.weight (Ultravox "
                                  f"{'v0.5+' if flag else 'v0.4.1 and earlier'}); set \"projector_ln_mid\": "
                                  f"{str(flag).lower()}")
    projector = Projector(pcfg, ProjectorParams(**_read(projector_specs(pcfg), tensors, "multi_modal_projector.",
                                                        dtype, path)))
    _check_vocab(d, lm.cfg, source)
    index = d.get("audio_token_index")
    return AudioLM(encoder, projector, lm, None if index is None else int(index))


class AudioConfigs(NamedTuple):
    """What an Ultravox checkpoint's config.json says about its shapes: the encoder's, the projector's and the
    language model's configs (a kvjax family config), and the audio placeholder's id (None when it names none)."""

    encoder: WhisperEncoderConfig
    projector: ProjectorConfig
    lm: Any
    audio_token_index: int | None


def _named_sibling(path: str, model_id: str | None) -> str | None:
    """The directory next to `path` named as the hub id's repository ("meta-llama/Llama-3.2-1B-Instruct" ->
    ../Llama-3.2-1B-Instruct), when it holds a config.json: how a directory of configs (configs/models/) keeps a
    checkpoint beside the models it names."""
    if not model_id:
        return None
    sibling = os.path.join(os.path.dirname(os.path.abspath(path)), str(model_id).rstrip("/").split("/")[-1])
    return sibling if os.path.isfile(os.path.join(sibling, "config.json")) else None


def _local_dir(path: str, what: str) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{what} {path!r} is not a directory; pass a local directory that holds its config.json")
    return path


def audio_configs(path: str, text_path: str | None = None, audio_path: str | None = None) -> AudioConfigs:
    """The configs of an Ultravox checkpoint directory from its config.json alone (no weights are read; a directory
    holding only config.json is enough): its shapes for planning, abstract params or a cost model.

    The encoder's config comes from `audio_path`'s config.json when given (a Whisper or an Ultravox directory), else
    the inlined `audio_config` (the v0.5 releases inline it), else the config.json of the directory next to `path`
    named as `audio_model_id`'s repository. The language model's likewise: `text_path`, else `text_config`, else the
    directory next to `path` named as `text_model_id`'s repository (the released checkpoints name their LM by id:
    configs/models/ultravox-v0_5-llama-3_1-8b finds configs/models/Llama-3.1-8B-Instruct)."""
    path = _local_dir(path, "audio_configs: the Ultravox checkpoint")
    d, source = _read_ultravox(path, "audio_configs")

    if audio_path is None and d.get("audio_config"):
        encoder = WhisperEncoderConfig.from_hf_dict(d["audio_config"], source + " audio_config")
    else:
        where = audio_path if audio_path is not None else _named_sibling(path, d.get("audio_model_id"))
        if where is None:
            raise CheckpointError(f"{source} has no audio_config (audio_model_id {d.get('audio_model_id')!r}); pass "
                                  "audio_path= a directory with that Whisper checkpoint's config.json")
        where = _local_dir(where, "audio_configs: audio_path")
        a, a_source = _read_config(where), os.path.join(where, "config.json")
        if a.get("model_type") == "ultravox":
            a, a_source = a.get("audio_config") or {}, a_source + " audio_config"
        encoder = WhisperEncoderConfig.from_hf_dict(a, a_source)

    if text_path is None and d.get("text_config"):
        lm = _text_config(d["text_config"], source + " text_config")
    else:
        where = text_path if text_path is not None else _named_sibling(path, d.get("text_model_id"))
        if where is None:
            raise CheckpointError(f"{source} has no text_config (text_model_id {d.get('text_model_id')!r}); pass "
                                  "text_path= a directory with that checkpoint's config.json")
        lm = load_hf_config(_local_dir(where, "audio_configs: text_path"))

    _check_vocab(d, lm, source)
    index = d.get("audio_token_index")
    return AudioConfigs(encoder, ProjectorConfig.from_ultravox(d, encoder.d_model, lm.hidden_size), lm,
                        None if index is None else int(index))


def save_ultravox(path: str, encoder: AudioEncoder, projector: Projector, text_model_id: str | None = None,
                  audio_token_index: int | None = None, vocab_size: int | None = None, extra: dict | None = None,
                  dtype=None) -> None:
    """Write an encoder and projector in Ultravox's layout (config.json with `audio_config` inlined, the LM named by
    `text_model_id` as the released checkpoints name it; model.safetensors with audio_tower.* and
    multi_modal_projector.*), so load_ultravox(path, text_path=...) reads them back. `extra`: more config fields
    (e.g. how it was trained). Written to a temporary name, then renamed: never half-written."""
    import shutil

    from safetensors.numpy import save_file

    from kvjax.models.params import to_hf_tensors
    from kvjax.models.whisper import encoder_to_flat
    pc = projector.cfg
    tensors = {}
    for specs, flat in ((encoder_specs(encoder.cfg, "audio_tower."), encoder_to_flat(encoder.params)),
                        (projector_specs(pc), {k: getattr(projector.params, k) for k in projector_specs(pc)})):
        for name, s in specs.items():
            a = np.asarray(jax.device_get(flat[name]))
            for n, t in to_hf_tensors(s, a if dtype is None else a.astype(np.dtype(jnp.dtype(dtype)))).items():
                tensors[n] = np.ascontiguousarray(t)  # safetensors writes a transposed view's memory as it lies
    config = {"model_type": "ultravox", "architectures": ["UltravoxModel"], "audio_config": encoder.cfg.to_hf_dict(),
              "text_model_id": text_model_id, "hidden_size": pc.hidden_size, "stack_factor": pc.stack_factor,
              "projector_act": pc.act, "projector_ln_mid": pc.ln_mid, "norm_init": pc.norm_init,
              "audio_token_index": audio_token_index, "audio_latency_block_size": None,
              **({} if vocab_size is None else {"vocab_size": vocab_size}), **(extra or {})}
    tmp = path.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


__all__ = ["AudioConfigs", "AudioLM", "Projector", "ProjectorConfig", "ProjectorParams", "audio_chunks",
           "audio_configs", "audio_embeddings_forward", "audio_prompt", "audio_token_count", "expand_audio",
           "init_projector", "load_audio_encoder", "load_ultravox", "log_mel", "merge_audio", "prefill_audio",
           "project_forward", "projector_specs", "prompt_embeddings", "prompt_embeddings_forward", "save_ultravox",
           "stack_frames"]

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

Checkpoints (Whisper, Ultravox) are read and written by kvjax.hf.ultravox.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import aot
from kvjax.models.decoder import embed, prefill_jit, rms_norm
from kvjax.models.hfconfig import ConfigError
from kvjax.models.model import Model
from kvjax.models.params import ParamSpec, spec, transpose
from kvjax.models.whisper import AudioEncoder, check_features, encode_forward, init_spec

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
        raise ImportError("kvjax.models.audio_lm.log_mel uses transformers' WhisperFeatureExtractor; install it with "
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
                         "expand each placeholder with kvjax.models.audio_lm.expand_audio (or audio_prompt)")
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
    out = prefill_jit(alm.lm.params, alm.lm.cfg, tokens if embeds is None else embeds, lengths, capacity=capacity,
                      dtype=dtype, logits="last" if last_only else "all")
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

"""Spoken requests: `input_audio` content parts of /v1/chat/completions, answered through the audio cache transfer.

The split audio path (the run's gate passed, `load`): the source's audio adapter (an Ultravox encoder + projector
around the source model, cfg.eval.audio.source_adapter) listens to the prompt, the AUDIO map (the one the `audio`
evaluation trains: RUN/eval/audio/audio_map; the run's final text map, with a warning, when there is none)
translates its cache, and the text-only target answers, as offline
`generate_from(Mapped(source, target, audio_map, shared=AudioPrefill(alm).set_audio(...)), ...)`.

The native audio path (the gate failed and the server takes the native path for text, `load_native`): the
answerer's OWN audio adapter (cfg.eval.audio.target_adapter, around the target model) listens and the target answers
from its own cache, as offline `generate_from(AudioPrefill(target_alm).set_audio(...), ...)`. Its prompts are the
same as the split path's (the source adapter's placeholder id; the two adapters must stack frames alike and share
the encoder window, else the server refuses to start). With no target adapter, spoken requests get a 400 naming
--config.eval.audio.target_adapter.

A request's prompt is the adapter's template (cfg.eval.audio: open_id, close):

    [open_id] [audio positions of part 1] [part 2] ... [tokens of `close`] [tokens of the text]

every audio part's positions in the order the parts appear (each ceil(frames / (2 * stack_factor)) placeholder ids),
then the text of every text part and string content, in message order, joined by "\\n". Roles and the chat template
are not used: text before an audio part goes after the audio like the rest.

Audio: base64 WAV (RIFF), mono, 16-bit PCM, 16 kHz, at most the encoder's window (2 * max_source_positions mel
frames of 10 ms) and `max_bytes` decoded bytes per part (default twice a full window's PCM + 64 KiB), at most
MAX_PARTS parts per request. Anything else is a 4xx saying what is wrong and what to send (413 for too many bytes).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import logging
import os
import struct
from typing import Any

import numpy as np

from kvjax.serve.protocol import ApiError, AudioPart

log = logging.getLogger("kvjax.serve")

SAMPLE_RATE = 16_000  # Whisper's (kvjax.models.audio_lm.SAMPLING_RATE)
HOP = 160  # samples per mel frame (WhisperFeatureExtractor.hop_length)
MAX_PARTS = 4  # input_audio parts per request
HEADER_SLACK = 64 * 1024  # bytes a WAV may hold besides its samples (headers, metadata chunks)
PCM, EXTENSIBLE, FLOAT = 1, 0xFFFE, 3
PCM_GUID_TAIL = b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"  # KSDATAFORMAT_SUBTYPE_PCM after its tag


def read_wav(raw: bytes, where: str) -> np.ndarray:
    """The samples (int16 [N]) of a mono 16-bit PCM 16 kHz WAV file; anything else a 400 naming what to send."""
    send = "send a mono 16-bit PCM WAV at 16 kHz"
    if len(raw) < 12 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise ApiError(400, f"{where}: the audio is not a WAV file (no RIFF/WAVE header; starts with {raw[:12]!r}); "
                            f"{send}", param=where)
    fmt, data, at = None, None, 12
    while at + 8 <= len(raw):
        cid, size = raw[at:at + 4], struct.unpack("<I", raw[at + 4:at + 8])[0]
        body = raw[at + 8:at + 8 + size]
        if cid == b"fmt ":
            fmt = body
        elif cid == b"data":
            data = body
            break
        at += 8 + size + (size & 1)  # chunks are word-aligned
    if fmt is None or len(fmt) < 16:
        raise ApiError(400, f"{where}: the WAV file has no valid 'fmt ' chunk; {send}", param=where)
    tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == EXTENSIBLE and len(fmt) >= 40 and fmt[26:40] == PCM_GUID_TAIL:
        tag = struct.unpack("<H", fmt[24:26])[0]
    if channels != 1:
        raise ApiError(400, f"{where}: the WAV has {channels} channels; the encoder takes mono: mix it down to one "
                            f"channel ({send})", param=where)
    if tag != PCM or bits != 16:
        what = "32-bit float" if tag == FLOAT else (f"{bits}-bit PCM" if tag == PCM else f"format tag {tag}")
        raise ApiError(400, f"{where}: the WAV holds {what} samples; convert it to 16-bit PCM ({send})", param=where)
    if rate != SAMPLE_RATE:
        raise ApiError(400, f"{where}: the WAV's sample rate is {rate} Hz; resample it to 16 kHz ({SAMPLE_RATE} Hz, "
                            "what the Whisper encoder reads)", param=where)
    if data is None:
        raise ApiError(400, f"{where}: the WAV file has no 'data' chunk; {send}", param=where)
    n = len(data) // 2
    if n == 0:
        raise ApiError(400, f"{where}: the WAV holds no samples; send at least one", param=where)
    return np.frombuffer(data[:2 * n], "<i2")


def frames_of(samples: int) -> int:
    """Mel frames the feature extractor makes of `samples` samples (kvjax.models.audio_lm.log_mel pads a clip to at
    least two hops, then to a whole hop)."""
    return -(-max(samples, 2 * HOP) // HOP)


@dataclasses.dataclass
class AudioServing:
    """What the server answers spoken requests with: `alm` (kvjax.models.audio_lm.AudioLM: the source's adapter around
    the source model, or on the native audio path the answerer's own around the target), `kvmap` (the audio map;
    None: the native audio path, the answerer listens itself), the prompt template (`open_id`, `close_ids`),
    `map_path` and `adapter` (where the map and the listening adapter came from, for the logs and /v1/models) and
    the limits. `feature_extractor`: a WhisperFeatureExtractor of the encoder's mel bins (made on first use)."""

    alm: Any
    kvmap: Any
    open_id: int
    close_ids: tuple[int, ...]
    map_path: str = ""
    max_bytes: int = 0  # decoded bytes per audio part (0: twice a full window's PCM + HEADER_SLACK)
    max_parts: int = MAX_PARTS
    feature_extractor: Any = None
    adapter: str = ""

    def __post_init__(self):
        if not self.max_bytes:
            self.max_bytes = 2 * self.window * HOP * 2 + HEADER_SLACK
        if self.feature_extractor is None:
            try:
                from transformers import WhisperFeatureExtractor
            except ImportError:
                raise ValueError("audio input needs transformers' WhisperFeatureExtractor: `pip install "
                                 "'kvjax[audio]'`, or serve text only with --config.eval.audio.enabled=false") from None
            self.feature_extractor = WhisperFeatureExtractor(feature_size=self.alm.encoder.cfg.num_mel_bins)

    @property
    def path(self) -> str:
        """Which audio path answers: "split" (the source's adapter listens, the audio map, the target answers) or
        "native_target" (the answerer's own adapter listens; the gate failed)."""
        return "split" if self.kvmap is not None else "native_target"

    def describe(self) -> str:
        """One line for the startup log."""
        if self.kvmap is None:
            return (f"native_target audio path: the answerer's own adapter {self.adapter} listens and the target "
                    "answers (the map failed its gate)")
        return f"split audio path: the source's adapter {self.adapter} listens, map {self.map_path}, the target answers"

    @property
    def window(self) -> int:
        """The encoder's longest input in mel frames (10 ms each)."""
        return int(self.alm.encoder.cfg.max_frames)

    @property
    def placeholder(self) -> int:
        return int(self.alm.audio_token_index)

    @property
    def max_body(self) -> int:
        """The largest request body: every part at the byte limit in base64, and 1 MiB of the rest."""
        return self.max_parts * (-(-self.max_bytes // 3) * 4) + (1 << 20)

    def info(self) -> dict:
        return {"path": self.path, "adapter": self.adapter, "map": self.map_path if self.kvmap is not None else None,
                "sample_rate": SAMPLE_RATE, "max_seconds": self.window * HOP / SAMPLE_RATE,
                "max_bytes": self.max_bytes, "max_parts": self.max_parts}

    def decode(self, part: AudioPart) -> np.ndarray:
        """One part's samples as float32 in [-1, 1), every check passed (a 4xx saying what is wrong otherwise)."""
        where = part.where
        if part.format.lower() != "wav":
            raise ApiError(400, f"{where}: audio format {part.format!r} is not supported; send format 'wav' (mono "
                                "16-bit PCM at 16 kHz)", param=where)
        data = part.data
        if data.startswith("data:") and "," in data:  # a data URL: its payload
            data = data.split(",", 1)[1]
        size = len(data) // 4 * 3
        if size > self.max_bytes:
            raise ApiError(413, f"{where}: the audio is about {size} bytes; this server takes at most "
                                f"{self.max_bytes} bytes per audio part (the encoder reads "
                                f"{self.window * HOP / SAMPLE_RATE:g} s of 16 kHz mono 16-bit PCM): send a shorter "
                                "clip", param=where, code="audio_too_large")
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ApiError(400, f"{where}: input_audio.data is not valid base64 ({e}); send the WAV file's bytes "
                                "base64-encoded (standard alphabet, with padding)", param=where) from None
        samples = read_wav(raw, where)
        frames = frames_of(samples.size)
        if frames > self.window:
            raise ApiError(400, f"{where}: the audio is {samples.size / SAMPLE_RATE:.2f} s ({frames} mel frames); the "
                                f"encoder's window is {self.window * HOP / SAMPLE_RATE:g} s ({self.window} frames): "
                                "send a shorter clip or split it into several input_audio parts", param=where,
                           code="audio_too_long")
        return samples.astype(np.float32) / 32768.0

    def clips(self, parts) -> list[np.ndarray]:
        """Every part checked and turned into its log-mel features (float32 [M, frames]), in order. Runs off the event
        loop (the feature extractor takes milliseconds per second of audio)."""
        from kvjax.models.audio_lm import log_mel
        if len(parts) > self.max_parts:
            raise ApiError(400, f"{len(parts)} input_audio parts; this server takes at most {self.max_parts} per "
                                "request", param="messages")
        waves = [self.decode(p) for p in parts]
        out = []
        for w in waves:  # one clip at a time, as kvjax.models.audio_lm.log_mel extracts each
            f, n = log_mel([w], self.alm.encoder.cfg.num_mel_bins, feature_extractor=self.feature_extractor)
            out.append(np.ascontiguousarray(f[0, :, :int(n[0])]))
        return out

    def audio_tokens(self, clip: np.ndarray) -> int:
        """The prompt positions of one clip (kvjax.models.audio_lm.audio_token_count)."""
        from kvjax.models.audio_lm import audio_token_count
        return int(audio_token_count(int(clip.shape[1]), self.alm.stack_factor, self.window))

    def prompt(self, clips: list[np.ndarray], text_ids: list[int]) -> list[int]:
        """[open_id] [each clip's placeholders] [close] [text] (the module docstring)."""
        if self.placeholder in text_ids:
            raise ApiError(400, f"the text holds token id {self.placeholder}, which this server's audio prompts "
                                "reserve for audio positions; remove that character from the text", param="messages")
        ids = [self.open_id]
        for c in clips:
            ids += [self.placeholder] * self.audio_tokens(c)
        ids += list(self.close_ids) + list(text_ids)
        if ids[-1] == self.placeholder:  # the last prompt token is decoded by the answerer as text: never audio
            raise ApiError(400, "the prompt ends with audio and this adapter's template has no text after it; add a "
                                "text part after the audio", param="messages")
        return ids


def load(cfg, source, target_cfg, tokenizer, text_map) -> AudioServing:
    """The audio serving of run config `cfg` (cfg.eval.audio): the source's adapter around the loaded `source`
    model and the run's audio map (RUN/eval/audio/audio_map), or `text_map` with a warning when the run has none."""
    from kvjax.eval.suite.audio import AUDIO_MAP, load_adapter
    from kvjax.mapper.artifact import MANIFEST, load_map
    ec = cfg.eval.audio
    alm = load_adapter(ec.source_adapter, tuple(source), ec.placeholder)
    path = os.path.join(cfg.output_dir, "eval", "audio", AUDIO_MAP)
    if os.path.isfile(os.path.join(path, MANIFEST)):
        kvmap = load_map(path, source[0], target_cfg)
    else:
        log.warning("no audio map at %s (`python -m kvjax.launch --config=%s` trains it in its audio evaluation): "
                    "spoken requests are answered through the run's text map", path, cfg.name)
        kvmap, path = text_map, f"{path} missing: the text map"
    return AudioServing(alm, kvmap, int(ec.open_id), _close(ec, tokenizer), path, adapter=ec.source_adapter)


def _close(ec, tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.encode(ec.close, add_special_tokens=False).ids) if ec.close else ()


TARGET_FLAG = "--config.eval.audio.target_adapter"


def load_native(cfg, source, target, tokenizer) -> tuple[AudioServing | None, str]:
    """The native audio path of run config `cfg` (its map failed the gate): (the answerer's own adapter
    cfg.eval.audio.target_adapter around the loaded `target` model, ""), or (None, why) when that adapter is unset or
    not an adapter directory (spoken requests then get a 400 saying why). The adapter takes the source adapter's
    placeholder id (loaded around `source`, as the `audio` evaluation does), so a spoken prompt is the same on both
    paths; adapters that stack frames differently or have different encoder windows are a ValueError (the server
    refuses to start)."""
    from kvjax.eval.suite.audio import load_adapter
    ec = cfg.eval.audio
    if not ec.target_adapter:
        return None, (f"eval.audio.target_adapter (the answerer's own audio adapter) is unset: pass {TARGET_FLAG}=DIR "
                      "(Ultravox's layout) to answer spoken requests on the native path")
    if not os.path.isfile(os.path.join(ec.target_adapter, "config.json")):
        return None, (f"eval.audio.target_adapter {ec.target_adapter!r} is not an audio adapter directory (no "
                      f"config.json in Ultravox's layout): pass {TARGET_FLAG}=DIR of the answerer's own audio adapter "
                      "to answer spoken requests on the native path")
    src_alm = load_adapter(ec.source_adapter, tuple(source), ec.placeholder)
    tgt_alm = load_adapter(ec.target_adapter, tuple(target), src_alm.audio_token_index)
    got = (tgt_alm.stack_factor, int(tgt_alm.encoder.cfg.max_frames))
    want = (src_alm.stack_factor, int(src_alm.encoder.cfg.max_frames))
    if got != want:
        raise ValueError(f"eval.audio: the answerer's audio adapter {ec.target_adapter} (stack_factor {got[0]}, "
                         f"encoder window {got[1]} mel frames) and the source's {ec.source_adapter} (stack_factor {want[0]}, "
                         f"window {want[1]}) must stack frames alike and share the encoder window (a spoken prompt's "
                         "audio positions are the same on both audio paths): pass "
                         f"{TARGET_FLAG}=DIR of a matching adapter, or serve text only with "
                         "--config.eval.audio.enabled=false")
    return AudioServing(tgt_alm, None, int(ec.open_id), _close(ec, tokenizer), adapter=ec.target_adapter), ""

"""Caches of prompts that hold audio: an audio-language model (kvjax.models.audio_lm.AudioLM) reads the spoken prompt.

A prompt with audio is ordinary token ids in which each clip's audio positions hold the model's placeholder id
(`audio_token_index`, expanded to the clip's audio_token_count; kvjax.models.audio_lm.audio_prompt), plus the clips'
log-mel features. The builders keep the CacheBuilder contract (tokens + lengths -> the answering model's cache), so
generation, evaluation arms and the server take them unchanged: the clips of the next call are given first with
`set_audio` (in the order their placeholders appear, row by row), as a SourcePrefill is given its batch.

  AudioPrefill(alm)                           the audio-LM reads the prompt itself: the source's audio path, or the
                                              answerer's own ("native") audio path
  Mapped(alm.lm, target, kvmap, shared=AudioPrefill(alm))
                                              the audio-LM listens, a KVMap translates its cache into a TEXT-ONLY
                                              answerer's coordinates (kvjax.builders.Mapped, unchanged)

A prompt without placeholders is read as text (exactly the plain prefill), so the same builder serves text requests.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.builders.base import CacheBuilder, Clock
from kvjax.cache import KVCache
from kvjax.models.audio_lm import AudioLM, prefill_audio


class AudioPrefill(CacheBuilder):
    """An audio-language model prefills a prompt with audio (its placeholder positions) into its LM's cache.

    `set_audio(features [N, M, F], frames [N])` gives the clips of the next builds; with `memo` (default) the latest
    cache is kept while the same batch and clips are asked for again, so a source arm and the mapped arms that share
    this object pay for one listening per batch."""

    def __init__(self, alm: AudioLM, name: str = "audio", memo: bool = True):
        if alm.audio_token_index is None:
            raise ValueError("AudioPrefill: the audio-language model has no audio_token_index (its placeholder id); "
                             "set \"audio_token_index\" in its config.json")
        self.alm, self.model, self.name, self.memo = alm, (alm.lm.cfg, alm.lm.params), name, memo
        self._clips: tuple[np.ndarray, np.ndarray] | None = None
        self._key, self._cache = None, None

    def set_audio(self, features, frames) -> "AudioPrefill":
        """The clips (log-mel features [N, M, F], valid frames [N]) of the prompts of the next builds; None, None:
        text-only prompts. Returns self."""
        self._clips = None if features is None else (np.asarray(features, np.float32), np.asarray(frames, np.int32))
        return self

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        clips = self._clips
        key = None
        if self.memo:
            key = (tokens.shape, tokens.tobytes(), lengths.tobytes(),
                   None if clips is None else (clips[0].shape, clips[0].tobytes(), clips[1].tobytes()))
        if key is None or key != self._key or self._cache.capacity < capacity:
            features, frames = (None, None) if clips is None else clips
            mask = (tokens == self.alm.audio_token_index) & (np.arange(tokens.shape[1])[None, :] < lengths[:, None])
            _, cache = prefill_audio(self.alm, tokens, features, frames, audio_mask=mask, lengths=np.maximum(lengths, 1),
                                     capacity=capacity)
            # a row of length 0 (a scorer's empty prefix) holds nothing: its length goes back to 0
            cache = cache.replace(lengths=jnp.asarray(lengths, cache.lengths.dtype)) if lengths.min() == 0 else cache
            self._cache, self._key = clock("listen", cache), key
        return self._cache

"""Train a cache map on audio-prompt caches: the residual of a text map, trained further on what a listening source
writes, against the source's own predictions (the method's audio transfer: "a mapper plus rank-16 residual translated
it into the frozen 1B decoder").

The ridge part cannot be refitted on audio: it regresses the target's native cache on the source's at the same
positions, and a text-only target has no native cache of audio positions. So the ridge stays the text map's (fitted
on text, frozen), and only the residual moves (kvjax.fitting.residual's TRAINABLE leaves), on source-teacher KL as
the text residual: the source audio-LM reads [prompt with audio][text], its next-token distributions on the text are
the teacher; the text-only answerer reads the same text after the MAPPED cache of the prompt (the student).

The source and its encoder are frozen, so their work is done once (`audio_pool`: the source's cache of each prompt and
its log-probabilities on the text); a step is then the map, the answerer's forward and the backward pass.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import aot
from kvjax.mapper.kl import kl
from kvjax.mapper.kvmap import KVMap, apply_map
from kvjax.models.audio_lm import AudioLM, prompt_embeddings_jit
from kvjax.models.decoder import forward, prefill_jit
from kvjax.models.model import Model

log = logging.getLogger(__name__)


class AudioPool(NamedTuple):
    """The frozen source's work on audio prompts, per example (host arrays, sliced into batches by index)."""

    caches: list  # per batch: the source's KVCache of [prompt with audio][text], lengths = the prompt's
    teacher: list  # per batch: float32 [b, C, V] the source's logits predicting text[0..C-1]
    text: list  # per batch: int32 [b, C + 1] the prompt's last token, then text[0..C-1] (what the student reads)


def _prompt_then_text(p: np.ndarray, n: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Rows [prompt][text], right-padded: prompts p [b, P] of lengths n [b], each followed by its text x [b, C]."""
    rows = np.zeros((len(p), p.shape[1] + x.shape[1]), np.int32)
    for r in range(len(p)):
        rows[r, :n[r]], rows[r, n[r]:n[r] + x.shape[1]] = p[r, :n[r]], x[r]
    return rows


def _text_logits(logits: jax.Array, n: np.ndarray, c: int) -> np.ndarray:
    """float32 [b, C, V]: the logits predicting each row's C text tokens (the prompt's last token predicts the
    first) out of a prefill's [b, T, V] over `_prompt_then_text` rows."""
    at = (n - 1)[:, None] + np.arange(c)[None]
    return np.asarray(jnp.take_along_axis(logits, jnp.asarray(at)[..., None], 1), np.float32)


def _nll(logits: jax.Array, text: jax.Array) -> jax.Array:
    """Mean NLL of text[:, 1:] under logits [b, C, V] predicting it."""
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1)
    return -jnp.take_along_axis(logp, jnp.asarray(text)[:, 1:, None], -1).mean()


def audio_pool(source: AudioLM, prompts: np.ndarray, prompt_lengths: np.ndarray, texts: np.ndarray,
               features: np.ndarray, frames: np.ndarray, batch_size: int = 16) -> AudioPool:
    """The source audio-LM's cache and teacher logits for each example: prompts int [N, P] (right-padded, the audio
    positions holding source.audio_token_index, one clip per row, the prompt's LAST token text), prompt_lengths [N],
    texts int [N, C] (what follows the prompt), features [N, M, F] / frames [N] (the clips)."""
    caches, teacher, text = [], [], []
    c = texts.shape[1]
    for i in range(0, len(prompts), batch_size):
        sl = slice(i, i + batch_size)
        p, n, x = prompts[sl], prompt_lengths[sl], texts[sl]
        b = len(p)
        rows = _prompt_then_text(p, n, x)
        mask = np.zeros(rows.shape, bool)
        mask[:, :p.shape[1]] = (p == source.audio_token_index) & (np.arange(p.shape[1])[None] < n[:, None])
        embeds = prompt_embeddings_jit(source, rows, mask, features[sl], frames[sl])
        out = prefill_jit(source.lm.params, source.lm.cfg, embeds, jnp.asarray(n + c, jnp.int32), logits="all")
        teacher.append(_text_logits(out.logits, n, c))
        # the cache holds the prompt's first n - 1 positions for the student (it reads the last prompt token itself)
        caches.append(out.cache.replace(lengths=jnp.asarray(n - 1, out.cache.lengths.dtype)))
        last = p[np.arange(b), n - 1]
        text.append(np.concatenate([last[:, None], x], axis=1).astype(np.int32))
    return AudioPool(caches, teacher, text)


def transcript_teacher(source: Model, prompts: np.ndarray, prompt_lengths: np.ndarray, texts: np.ndarray,
                       batch_size: int = 16) -> list:
    """Teacher logits from the source READING each clip's transcript instead of hearing it (Ultravox's own
    distillation target): prompts int [N, P] (right-padded transcript prompts, the same template and last token as
    the audio prompts), prompt_lengths [N], texts [N, C]; per batch of `audio_pool`'s layout, float32 [b, C, V].
    Swapped into a pool (`pool._replace(teacher=...)`), the map learns to make the answerer predict what the words
    imply, not what the source made of the sound (its mishearings included)."""
    cfg, params = source
    out = []
    c = texts.shape[1]
    for i in range(0, len(prompts), batch_size):
        p, n, x = prompts[i:i + batch_size], prompt_lengths[i:i + batch_size], texts[i:i + batch_size]
        rows = _prompt_then_text(p, n, x)
        logits = prefill_jit(params, cfg, jnp.asarray(rows), jnp.asarray(n + c, jnp.int32), logits="all").logits
        out.append(_text_logits(logits, n, c))
    return out


def _student_logits(kvmap: KVMap, target: Model, cache, text: jax.Array) -> jax.Array:
    """The answerer's logits [b, C, V] reading `text` [b, C + 1] (all but its last token) after the mapped cache
    (traceable)."""
    tcfg, tparams = target
    mapped = apply_map(kvmap, cache, capacity=cache.capacity)  # rows keep their lengths: text goes after them
    return forward(tparams, tcfg, text[:, :-1], mapped).logits


def student_kl(kvmap: KVMap, target: Model, cache, teacher: jax.Array, text: jax.Array) -> jax.Array:
    """Mean KL of the answerer reading `text` [b, C + 1] after the mapped cache vs the teacher [b, C, V]
    (traceable)."""
    return kl(teacher, _student_logits(kvmap, target, cache, text)).mean()


@functools.partial(aot.jit, static_argnames=("tcfg",))
def _kl_jit(kvmap, tcfg, tparams, cache, teacher, text):
    return student_kl(kvmap, (tcfg, tparams), cache, teacher, text)


def audio_optimizer(kvmap: KVMap, steps: int, lr: float, train_ridge: bool = False):
    """The text residual's optimizer (only its TRAINABLE leaves move; with `train_ridge` the ridge too, at the text
    residual's ridge_lr scale), with a 5% warmup."""
    from kvjax.fitting.residual import make_optimizer
    from kvjax.fitting.residual_config import ResidualConfig
    return make_optimizer(ResidualConfig(steps=steps, lr=lr, warmup_steps=max(1, steps // 20), grad_clip=1.0,
                                         train_ridge=train_ridge), kvmap)


def training_step(opt, tcfg):
    """The compiled step train_audio_map runs: (map, optimizer state, answerer params, pool cache, teacher logits,
    text) -> (map, state, loss); the answerer's config is closed over (static)."""
    @aot.jit
    def step(kvmap, state, tparams, cache, teacher, text):
        loss, g = jax.value_and_grad(student_kl)(kvmap, (tcfg, tparams), cache, teacher, text)
        upd, state = opt.update(g, state, kvmap)
        return optax.apply_updates(kvmap, upd), state, loss
    return step


def train_audio_map(kvmap: KVMap, target: Model, pool: AudioPool, steps: int, lr: float, seed: int = 0,
                    progress: bool = True, train_ridge: bool = False) -> tuple[KVMap, list[float]]:
    """Continue training `kvmap`'s residual (the ridge and every other leaf frozen; with `train_ridge` the ridge's
    weights move too, at the text residual's ridge_lr scale, from their text fit) on the pool's batches, one batch a
    step in a seeded order; returns (the map, the loss per step)."""
    from tqdm import tqdm

    opt = audio_optimizer(kvmap, steps, lr, train_ridge)
    state = opt.init(kvmap)
    step = training_step(opt, target[0])

    order = np.random.default_rng(seed).permutation(np.resize(np.arange(len(pool.caches)), steps))
    losses = []
    for i in tqdm(order, desc="audio map", unit="step", disable=not progress):
        kvmap, state, loss = step(kvmap, state, target[1], pool.caches[i], jnp.asarray(pool.teacher[i]),
                                  jnp.asarray(pool.text[i]))
        losses.append(float(loss))
    return kvmap, losses


@functools.partial(aot.jit, static_argnames=("tcfg",))
def _nll_jit(kvmap, tcfg, tparams, cache, text):
    return _nll(_student_logits(kvmap, (tcfg, tparams), cache, text), text)


def pool_nll(kvmap: KVMap, target: Model, pool: AudioPool) -> float:
    """Mean negative log-likelihood (nats / token) of the TRUE text after each prompt, the answerer reading it after
    the mapped cache: a held-out measure that depends on no teacher, so maps trained against different teachers
    compare on it."""
    vals = [float(_nll_jit(kvmap, target[0], target[1], c, jnp.asarray(x))) for c, x in zip(pool.caches, pool.text)]
    return float(np.mean(vals))


def teacher_nll(pool: AudioPool) -> float:
    """The same NLL under the pool's own teacher logits: the source listening for `audio_pool(source, ...)`, the
    answerer's own audio path for `audio_pool(answerer_alm, ...)` (the two ends the map sits between)."""
    return float(np.mean([float(_nll(t, x)) for t, x in zip(pool.teacher, pool.text)]))


def pool_kl(kvmap: KVMap, target: Model, pool: AudioPool) -> float:
    """Mean student KL over the pool (held-out pools: the map's quality on audio caches it was not trained on)."""
    vals = [float(_kl_jit(kvmap, target[0], target[1], c, jnp.asarray(t), jnp.asarray(x))) for c, t, x in
            zip(pool.caches, pool.teacher, pool.text)]
    return float(np.mean(vals))


def prompt_rows(audio_tokens: np.ndarray, open_id: int, placeholder: int, close_ids: list[int],
                width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Audio prompts [open][placeholder x audio_tokens[i]][close...] right-padded to `width` (default the longest):
    (ids int32 [N, width], lengths [N])."""
    lengths = 1 + np.asarray(audio_tokens) + len(close_ids)
    width = int(lengths.max()) if width is None else width
    out = np.zeros((len(audio_tokens), width), np.int32)
    for i, a in enumerate(audio_tokens):
        out[i, 0], out[i, 1:1 + a], out[i, 1 + a:1 + a + len(close_ids)] = open_id, placeholder, close_ids
    return out, lengths.astype(np.int32)


__all__ = ["AudioPool", "audio_pool", "pool_kl", "pool_nll", "prompt_rows", "student_kl", "teacher_nll",
           "train_audio_map", "transcript_teacher"]

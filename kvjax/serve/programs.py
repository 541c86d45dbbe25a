"""The compiled programs of the serving engine: prefill a batch of new prompts into caches, insert them into free
slots of the one batched decode cache, and advance every slot by one token.

Why these shapes. The decode cache is fixed ([L, slots, Hkv, capacity, hd]), so one decode program serves every mix
of requests; a slot joins or leaves between two steps by writing its row (insert) or by being masked (step). The
prefill side pads a batch's prompts to a bucket of the token axis and its batch to a power of two, so a few programs
cover every prompt. Each row is computed exactly as the offline `kvjax.split_generate` computes it (the same
builders, prefill of all but the last prompt token, the last token read by the first decode step), and padding rows
or positions only ever meet masked attention, so a greedy answer does not depend on what else is in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import aot
from kvjax.builders import Mapped, NativePrefill
from kvjax.cache import KVCache, init_cache, window_sizes
from kvjax.models.decoder import forward


def buckets(capacity: int) -> tuple[int, ...]:
    """Prefill lengths (the token axis a batch is padded to): the attention windows of a cache of `capacity`
    (about two per octave from 128), with 64 in front for short prompts: a handful of compiles, <= 1.5x padding."""
    return tuple(sorted({min(64, capacity), *window_sizes(capacity)}))


def bucket_for(n: int, sizes: tuple[int, ...]) -> int:
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} prompt tokens do not fit the largest prefill bucket {sizes[-1]}")


def batch_size_for(n: int, max_batch: int) -> int:
    """The padded prefill batch: the next power of two (capped at max_batch)."""
    return min(max_batch, 1 << max(0, (n - 1).bit_length()))


def prefill_builder(source, target, kvmap, split: bool):
    """The cache builder of the served path: source prefill + map (split) or the target's own prefill (the map's
    gate failed): the same builders `split_generate` / `native_generate` use."""
    return Mapped(source, target, kvmap) if split else NativePrefill(target)


def audio_builder(source, target, kvmap, alm, clips: list[np.ndarray]):
    """The cache builder of a batch of spoken prompts: the source's audio-language model (alm, around `source`)
    listens to `clips` (log-mel [M, frames] each, in the order of their placeholder runs, row by row), `kvmap` (the
    audio map) translates its cache: offline `Mapped(source, target, kvmap, shared=AudioPrefill(alm).set_audio(..))`.
    The clips are zero-padded to a multiple of 128 frames (kvjax.eval.audio.clip_inputs; per-clip frames are passed,
    so padding is masked): a few encoder programs cover every length."""
    return Mapped(source, target, kvmap, name="audio", shared=own_audio_builder(alm, clips))


def own_audio_builder(alm, clips: list[np.ndarray]):
    """An audio-language model (alm) listens to `clips` (as `audio_builder`) and its own LM's cache answers: offline
    `AudioPrefill(alm).set_audio(..)`. The server's native audio path (alm: the answerer's own adapter), and the
    listening half of the split one."""
    from kvjax.builders.audio import AudioPrefill
    from kvjax.eval.audio import clip_inputs
    features, frames, _ = clip_inputs(clips, alm.stack_factor, alm.encoder.cfg.max_frames)
    return AudioPrefill(alm, name="audio", memo=False).set_audio(features, frames)


def prefill_batch(builder, prompts: list[list[int]], bucket: int, batch: int) -> KVCache:
    """The answering model's cache of every prompt but its last token, rows padded to `batch` (padding rows hold one
    token) and positions to `bucket`: KVCache [L, batch, Hkv, bucket, hd]."""
    tokens = np.zeros((batch, bucket), np.int32)
    lengths = np.ones((batch,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p) - 1] = p[:-1]
        lengths[i] = len(p) - 1
    return builder(tokens, lengths, capacity=bucket)


def empty_slots(cfg, slots: int, capacity: int, dtype, place=None) -> KVCache:
    """The decode slots' cache, keys held transposed (kvjax.cache: decode reads them without repacking), made where
    `place` (a kvjax.serve.placement.Placement) keeps it."""
    if place is not None:
        return place.empty_cache(cfg, slots, capacity, dtype, keys_transposed=True)
    return init_cache(cfg, slots, capacity, dtype, keys_transposed=True)


@functools.partial(aot.jit, donate_argnames=("cache",))
def insert(cache: KVCache, new: KVCache, slots: jax.Array) -> KVCache:
    """Write the rows of `new` (b rows of T <= capacity positions) into rows `slots` [b] of `cache`, in place (the
    cache is donated: a scatter into its own buffers, no copy of the other slots). A slot index >= the number of
    slots drops its row (padding rows of a prefill batch). `new`'s keys are brought to the layout `cache` holds."""
    t = new.capacity
    new = new.with_keys_transposed(cache.keys_transposed)

    def put(bufs, news, axis):
        where = (slots,) + (slice(None),) * (axis - 1) + (slice(0, t),)  # rows `slots`, positions [0, t)
        return tuple(b.at[where].set(n.astype(b.dtype), mode="drop") for b, n in zip(bufs, news))

    lengths = cache.lengths.at[slots].set(new.lengths, mode="drop")
    return cache.replace(keys=put(cache.keys, new.keys, 3 if cache.keys_transposed else 2),
                         values=put(cache.values, new.values, 2), lengths=lengths)


def _sample_rows(logits, temperature, top_p, seeds, counters):
    """One token per row with the row's own temperature, top-p and key (seed, tokens generated so far): a seeded
    request samples the same tokens whatever else shares the batch."""
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    x = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[:, None]
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens (as kvjax.generation.sample)
    sorted_x = jnp.where(before < top_p[:, None], sorted_x, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, sorted_x)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def row_buckets(slots: int) -> tuple[int, ...]:
    """The decode step's row counts: powers of two below `slots`, and `slots`."""
    return tuple(sorted({1 << i for i in range(max(slots - 1, 0).bit_length()) if 1 << i < slots} | {slots}))


@functools.partial(aot.jit, static_argnames=("cfg", "rows"), donate_argnames=("cache",))
def step(params, cfg, cache: KVCache, tokens, active, temperature, top_p, seeds, counters, rows: int | None = None):
    """Every slot reads its input token (int32 [S]: a new request's last prompt token, else its latest generated
    one) and picks the next: (next tokens int32 [S], cache). Greedy rows (temperature 0) take the argmax, as
    `kvjax.generation.sample` does. Free slots (`active` False) compute too (one program for every mix) but their
    length is reset to 0, so they never grow and never widen the attention window of the others.

    `rows` (static, a `row_buckets` size): compute only slots [0, rows), which must hold every active slot; the
    others keep their cache and get token 0. The engine fills the lowest free slots first, so at low load a step
    reads a few rows of the cache instead of all of them (one program per bucket)."""
    s = tokens.shape[0]
    rows = s if rows is None else rows
    logits, cache = forward(params, cfg, tokens[:rows, None], cache)
    logits = logits[:, 0]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature[:rows] > 0
    nxt = jax.lax.cond(jnp.any(sampled & active[:rows]),
                       lambda: jnp.where(sampled, _sample_rows(logits, temperature[:rows], top_p[:rows],
                                                               seeds[:rows], counters[:rows]), greedy),
                       lambda: greedy)
    nxt = jnp.pad(nxt, (0, s - rows))
    return nxt, cache.replace(lengths=jnp.where(active, cache.lengths, 0))

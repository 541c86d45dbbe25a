"""Generation loops: the whole decode loop runs inside one compiled call (lax.while_loop), greedy or sampled.

`generate` prefills and decodes in one program; `generate_from` decodes from the cache a builder makes
(kvjax.builders: the model's own prefill, a mapped cache, a partial recomputation, ...), which is how every
transferred cache is answered from.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import aot
from kvjax.builders import CacheBuilder, Clock
from kvjax.cache import KVCache, cache_jit
from kvjax.generation.prompts import prepare
from kvjax.generation.sampling import Sampling, sample
from kvjax.models.family import DecoderConfig
from kvjax.models.decoder import decode, decode_jit, prefill_forward
from kvjax.models.params import Params


def decode_loop(params: Params, cfg: DecoderConfig, cache: KVCache, logits: jax.Array, max_new_tokens: int,
                key: jax.Array, sampling: Sampling, eos_ids: tuple[int, ...], pad_id: int):
    """From the logits [B, V] of each row's last cached token, produce max_new_tokens tokens [B, N] (traceable).

    Rows stop at their first EOS (kept in the output); later positions hold `pad_id`. The loop ends early when
    every row has stopped. Returns (tokens, cache, number of tokens produced per row).

    The loop holds the keys transposed (kvjax.cache, `keys_transposed`: decode attention reads them without
    repacking them every step), converting once on entry and back on exit.
    """
    b = logits.shape[0]
    cache = cache.with_keys_transposed(True)
    eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

    def pick(logits, key, done):
        tok = sample(logits, key, sampling)
        return jnp.where(done, pad_id, tok), done | jnp.isin(tok, eos)

    key, sub = jax.random.split(key)
    done0 = jnp.zeros((b,), bool)
    tok, done = pick(logits, sub, done0)
    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(tok)
    count = jnp.ones((b,), jnp.int32)

    def cond(state):
        i, _, _, _, done, _, _ = state
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(state):
        i, out, cache, tok, done, count, key = state
        logits, cache = decode(params, cfg, tok, cache)
        key, sub = jax.random.split(key)
        nxt, new_done = pick(logits, sub, done)
        count = count + (~done).astype(jnp.int32)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        return i + 1, out, cache, nxt, new_done, count, key

    _, out, cache, _, _, count, _ = jax.lax.while_loop(cond, body, (1, out, cache, tok, done, count, key))
    return out, cache.with_keys_transposed(False), count


def greedy_continuation(params: Params, cfg: DecoderConfig, cache: KVCache, last: jax.Array, n: int) -> jax.Array:
    """The model reads `last` [B] (each row's last prompt token) after `cache` (room for n more positions), then
    decode_loop picks n tokens greedily with no stop at EOS: int32 [B, n] (traceable). The rollouts of training and
    evaluation (kvjax.fitting.residual, kvjax.eval.divergence, kvjax.eval.needle_retrieval) continue a built cache
    with it."""
    logits, cache = decode(params, cfg, last, cache)
    return decode_loop(params, cfg, cache, logits, n, jax.random.key(0), Sampling(), (), 0)[0]


def _generate(params, cfg, tokens, lengths, key, *, max_new_tokens, capacity, sampling, eos_ids, pad_id,
              cache_dtype):
    logits, cache, _, _ = prefill_forward(params, cfg, tokens, lengths, capacity=capacity, dtype=cache_dtype)
    out, _, _ = decode_loop(params, cfg, cache, logits, max_new_tokens, key, sampling, eos_ids, pad_id)
    return out


_generate_jit = aot.jit(_generate, static_argnames=("cfg", "max_new_tokens", "capacity", "sampling", "eos_ids",
                                                    "pad_id", "cache_dtype"))


def generate(params: Params, cfg: DecoderConfig, prompt, max_new_tokens: int, *, prompt_lengths=None,
             temperature: float = 0.0, top_p: float = 1.0, key: jax.Array | None = None,
             eos_token_ids=None, pad_token_id: int | None = None, cache_dtype=None) -> jax.Array:
    """Generate max_new_tokens tokens after each prompt; returns int32 [B, N].

    `prompt`: int array [B, T] (right-padded, with `prompt_lengths` [B]) or a list of token lists of any lengths.
    Greedy by default; temperature > 0 samples and needs an explicit PRNG `key`. Each row stops at EOS
    (`eos_token_ids`, default from the config; pass () to never stop); later positions hold the pad id (default
    the config's pad_token_id, else the first EOS, else 0).
    """
    p = prepare(prompt, cfg, max_new_tokens, prompt_lengths=prompt_lengths, temperature=temperature, top_p=top_p,
                key=key, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
    dtype = jnp.dtype(cache_dtype or params.embed.dtype)
    return _generate_jit(params, cfg, jnp.asarray(p.tokens), jnp.asarray(p.lengths), p.key,
                         max_new_tokens=int(max_new_tokens), capacity=p.capacity, sampling=p.sampling, eos_ids=p.eos,
                         pad_id=p.pad, cache_dtype=dtype)


@functools.partial(cache_jit, static_argnames=("cfg", "n", "sampling", "eos", "pad"))
def decode_from(params, cfg, cache, logits, key, n, sampling, eos, pad):
    """decode_loop's tokens [B, n] from a built cache and the logits of each row's last prompt token (compiled)."""
    return decode_loop(params, cfg, cache, logits, n, key, sampling, eos, pad)[0]


def _timed_decode(clock: Clock, repeats: int, *args):
    """The decode phase; with timings and repeats > 1 it is re-run from the same cache (not donated) and the median
    time kept: short decodes are too brief to time once. The tokens are the first run's."""
    phases = clock.phases
    out = clock("decode", decode_from(*args))
    if repeats > 1 and "decode" in phases:
        times = [phases["decode"]]
        for _ in range(repeats - 1):
            t0 = time.perf_counter()
            jax.block_until_ready(decode_from(*args))
            times.append(time.perf_counter() - t0)
        phases["decode"] = float(np.median(times))
    return out


def generate_from(builder: CacheBuilder, prompts, max_new_tokens: int, *, temperature: float = 0.0,
                  top_p: float = 1.0, key=None, eos_token_ids=None, pad_token_id: int | None = None,
                  clock: Clock | None = None, decode_repeats: int = 1):
    """The answering model of `builder` generates after each prompt from the cache the builder makes: the builder
    reads all but each prompt's last token, the model runs that token (the first new token's logits), then decodes.
    `prompts`: list of token lists (>= 2 tokens each) or int array [B, T]. Returns tokens int32 [B, N]. With an
    enabled `clock` (kvjax.builders.Clock) each phase is timed with block_until_ready into clock.phases (the
    builder's phases, first_token, decode); `decode_repeats` > 1 then re-runs the decode phase from the same cache
    and keeps its median time."""
    cfg, params = builder.model
    clock = clock if clock is not None else Clock(enabled=False)
    p = prepare(prompts, cfg, max_new_tokens, temperature=temperature, top_p=top_p, key=key,
                eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, min_length=2,
                what=f"generating from {builder!r}")
    cache = builder(p.prefix, p.prefix_lengths, capacity=p.capacity, clock=clock)
    logits, cache = clock("first_token", decode_jit(params, cfg, jnp.asarray(p.last), cache))
    return _timed_decode(clock, decode_repeats, params, cfg, cache, logits, p.key, int(max_new_tokens), p.sampling,
                         p.eos, p.pad)


def alternating_decode_seconds(builders: dict[str, CacheBuilder], prompts, max_new_tokens: int,
                               repeats: int) -> dict[str, list[float]]:
    """Seconds of the decode phase (greedy, max_new_tokens - 1 tokens after the first, no EOS stop) of one answering
    model from each builder's cache, timed alternately `repeats` times each (the order rotating every round: a, b,
    then b, a, ...) from caches prefilled once, so that drifts in the machine's speed hit every arm alike: the paired
    measurement behind "decodes at the answerer's own speed". The builders must answer with the same model.
    Compiles first (not timed)."""
    models = {id(b.model[1]) for b in builders.values()}
    if len(models) != 1:
        raise ValueError(f"alternating_decode_seconds: the builders {sorted(builders)} answer with different models; "
                         "it compares decodes of one model from different caches")
    cfg, params = next(iter(builders.values())).model
    p = prepare(prompts, cfg, max_new_tokens, eos_token_ids=(), min_length=2, what="alternating_decode_seconds")
    args = {}
    for arm, builder in builders.items():
        logits, cache = decode_jit(params, cfg, jnp.asarray(p.last),
                                   builder(p.prefix, p.prefix_lengths, capacity=p.capacity))
        args[arm] = (params, cfg, cache, logits, p.key, int(max_new_tokens), p.sampling, p.eos, p.pad)
        jax.block_until_ready(decode_from(*args[arm]))  # compile
    arms = list(args)
    times = {arm: [] for arm in arms}
    for r in range(repeats):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
            t0 = time.perf_counter()
            jax.block_until_ready(decode_from(*args[arm]))
            times[arm].append(time.perf_counter() - t0)
    return times

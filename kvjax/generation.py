"""Generation loops: the whole loop runs inside one compiled call (lax.while_loop), greedy or sampled."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.builders.native import prefill
from kvjax.cache import KVCache
from kvjax.models.config import Qwen3Config
from kvjax.models.params import Params
from kvjax.models.decoder import forward

CACHE_ALIGN = 128


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick the next token. temperature 0 is greedy (argmax); otherwise softmax(logits / T) restricted to
    the smallest set of tokens whose probability reaches top_p."""

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens int32 [B] from logits [B, V]."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
        sorted_logits = jnp.where(before < sampling.top_p, sorted_logits, -jnp.inf)
        choice = jax.random.categorical(key, sorted_logits, axis=-1)
        return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def decode_loop(params: Params, cfg: Qwen3Config, cache: KVCache, logits: jax.Array, max_new_tokens: int,
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
        logits, cache = forward(params, cfg, tok[:, None], cache)
        key, sub = jax.random.split(key)
        nxt, new_done = pick(logits[:, 0], sub, done)
        count = count + (~done).astype(jnp.int32)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        return i + 1, out, cache, nxt, new_done, count, key

    _, out, cache, _, _, count, _ = jax.lax.while_loop(cond, body, (1, out, cache, tok, done, count, key))
    return out, cache.with_keys_transposed(False), count


def _generate(params, cfg, tokens, lengths, key, *, max_new_tokens, capacity, sampling, eos_ids, pad_id,
              cache_dtype):
    logits, cache = prefill(params, cfg, tokens, lengths, capacity, cache_dtype)
    out, _, _ = decode_loop(params, cfg, cache, logits, max_new_tokens, key, sampling, eos_ids, pad_id)
    return out


_generate_jit = jax.jit(_generate, static_argnames=("cfg", "max_new_tokens", "capacity", "sampling", "eos_ids",
                                                    "pad_id", "cache_dtype"))


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad a list of token lists: (tokens int32 [B, T], lengths int32 [B])."""
    if not len(prompts) or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), lengths.max()), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def generate(params: Params, cfg: Qwen3Config, prompt, max_new_tokens: int, *, prompt_lengths=None,
             temperature: float = 0.0, top_p: float = 1.0, key: jax.Array | None = None,
             eos_token_ids: Sequence[int] | None = None, pad_token_id: int | None = None,
             cache_dtype=None) -> jax.Array:
    """Generate max_new_tokens tokens after each prompt; returns int32 [B, N].

    `prompt`: int array [B, T] (right-padded, with `prompt_lengths` [B]) or a list of token lists of any lengths.
    Greedy by default; temperature > 0 samples and needs an explicit PRNG `key`. Each row stops at EOS
    (`eos_token_ids`, default from the config; pass () to never stop); later positions hold the pad id.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    sampling = Sampling(float(temperature), float(top_p))
    if sampling.temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs an explicit key=jax.random.key(seed)")
    if isinstance(prompt, (list, tuple)) and prompt and not np.isscalar(prompt[0]):
        tokens, lengths = pad_prompts(prompt)
    else:
        tokens = np.asarray(prompt, np.int32)
        if tokens.ndim == 1:
            tokens = tokens[None]
        lengths = np.full((tokens.shape[0],), tokens.shape[1], np.int32)
    if prompt_lengths is not None:
        lengths = np.asarray(prompt_lengths, np.int32)
        if lengths.shape != (tokens.shape[0],) or lengths.min() < 1 or lengths.max() > tokens.shape[1]:
            raise ValueError(f"prompt_lengths must be [B] in 1..{tokens.shape[1]}, got {lengths}")
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size}), got range "
                         f"[{tokens.min()}, {tokens.max()}]")
    eos = tuple(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    pad = pad_token_id if pad_token_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else
                                                          (eos[0] if eos else 0))
    capacity = math.ceil((tokens.shape[1] + max_new_tokens) / CACHE_ALIGN) * CACHE_ALIGN
    dtype = jnp.dtype(cache_dtype or params.embed.dtype)
    return _generate_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths),
                         key if key is not None else jax.random.key(0), max_new_tokens=int(max_new_tokens),
                         capacity=capacity, sampling=sampling, eos_ids=eos, pad_id=int(pad), cache_dtype=dtype)

"""Split-path generation: the source reads the prompt, the map translates its cache, the target answers."""

from __future__ import annotations

import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.generation import CACHE_ALIGN, Sampling, decode_loop, pad_prompts
from kvjax.mapper.calibrate import Model, native_cache
from kvjax.mapper.kvmap import KVMap, apply_map, check_models
from kvjax.models.qwen3 import forward


_source_prefill = jax.jit(native_cache, static_argnames=("cfg",))


@functools.partial(jax.jit, static_argnames=("capacity", "length"))
def _map(kvmap, source_cache, capacity, length):
    return apply_map(kvmap, source_cache, capacity=capacity, length=length)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _first(params, cfg, last_tokens, cache):
    logits, cache = forward(params, cfg, last_tokens[:, None], cache)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("cfg", "n", "sampling", "eos", "pad"))
def _decode(params, cfg, cache, logits, key, n, sampling, eos, pad):
    return decode_loop(params, cfg, cache, logits, n, key, sampling, eos, pad)[0]


def split_generate(source: Model, target: Model, kvmap: KVMap, prompts, max_new_tokens: int, *,
                   temperature: float = 0.0, top_p: float = 1.0, key=None, eos_token_ids=None,
                   pad_token_id: int | None = None, timings: bool = False):
    """Source prefill -> map -> target decode. The source reads each prompt but its last token; the target reads
    that last token from the mapped cache and produces every generated token (greedy by default).

    `prompts`: list of token lists (>= 2 tokens each) or int array [B, T]. Returns tokens int32 [B, N], and with
    `timings` also a dict of per-phase seconds (source_prefill, map, first_token, decode), each measured with
    block_until_ready (so phases do not overlap; use timings=False for the fastest path).
    """
    (scfg, sparams), (tcfg, tparams) = source, target
    check_models(kvmap, scfg, tcfg)
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs an explicit key=jax.random.key(seed)")
    tokens, lengths = pad_prompts(prompts) if isinstance(prompts, (list, tuple)) else (
        np.asarray(prompts, np.int32), np.full((len(prompts),), np.shape(prompts)[1], np.int32))
    if lengths.min() < 2:
        raise ValueError("split_generate needs prompts of at least 2 tokens (the source reads all but the last)")
    eos = tuple(tcfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
    pad = pad_token_id if pad_token_id is not None else (tcfg.pad_token_id or (eos[0] if eos else 0))
    t = tokens.shape[1] - 1
    capacity = math.ceil((t + 1 + max_new_tokens) / CACHE_ALIGN) * CACHE_ALIGN
    last = jnp.asarray(tokens[np.arange(len(tokens)), lengths - 1])
    phases, clock = {}, time.perf_counter()

    def mark(name, value):
        nonlocal clock
        if timings:
            jax.block_until_ready(value)
            now = time.perf_counter()
            phases[name], clock = now - clock, now
        return value

    src_cache = mark("source_prefill", _source_prefill(sparams, scfg, jnp.asarray(tokens[:, :t]),
                                                       jnp.asarray(lengths - 1)))
    cache = mark("map", _map(kvmap, src_cache, capacity, t))
    logits, cache = mark("first_token", _first(tparams, tcfg, last, cache))
    out = mark("decode", _decode(tparams, tcfg, cache, logits, key if key is not None else jax.random.key(0),
                                 int(max_new_tokens), Sampling(float(temperature), float(top_p)), eos, int(pad)))
    return (out, phases) if timings else out

"""Log-likelihood scoring from a prefix cache, and held-out loss.

Scoring is split so the cache of the context can come from anywhere (a native prefill, or a cache mapped from
another model): the prefix cache holds context[:-1]; `continuation_logprobs` runs the last context token followed by
the continuation tokens from that cache, so the first continuation token is predicted from the last context token's
logits, exactly as in one forward pass over context + continuation.

Shapes are bucketed (token axes rounded up to multiples of BUCKET) so scoring many items compiles a handful of times.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvjax import aot
from kvjax.builders.base import bucket
from kvjax.builders import NativePrefill
from kvjax.cache import KVCache, cache_jit, check_compatible, init_cache
from kvjax.models.family import DecoderConfig
from kvjax.models.params import Params
from kvjax.models.decoder import forward

def fit_capacity(cache: KVCache, capacity: int) -> KVCache:
    """The cache with its time axis zero-padded or cut to `capacity` (which must hold every row's valid part)."""
    if capacity == cache.capacity:
        return cache
    longest = int(jnp.max(cache.lengths))
    if capacity < longest:
        raise ValueError(f"capacity {capacity} is smaller than the cache's longest row ({longest})")
    if capacity < cache.capacity:
        return cache.map_layers(lambda a: a[:, :, :capacity])
    pad = [(0, 0)] * 2 + [(0, capacity - cache.capacity), (0, 0)]
    return cache.map_layers(lambda a: jnp.pad(a, pad))


def native_prefix_cache(params: Params, cfg: DecoderConfig, context_ids, batch: int, capacity: int | None = None,
                        dtype=None) -> KVCache:
    """A cache of `batch` identical rows holding context_ids[:-1] (the scorers run the last token themselves).

    capacity defaults to the bucketed prefix length; the scorers re-fit it to what they need (`fit_capacity`)."""
    if len(context_ids) == 0:
        raise ValueError("the context needs at least one token")
    prefix = np.asarray(context_ids[:-1], np.int32)
    capacity = capacity or bucket(len(prefix))
    if len(prefix) > capacity:
        raise ValueError(f"a context of {len(context_ids)} tokens does not fit capacity {capacity}")
    dtype = jnp.dtype(dtype or params.embed.dtype)
    if len(prefix) == 0:
        return init_cache(cfg, batch, capacity, dtype)
    tokens = np.zeros((batch, min(bucket(len(prefix)), capacity)), np.int32)  # a handful of compiled widths
    tokens[:, : len(prefix)] = prefix
    return NativePrefill((cfg, params), dtype=dtype)(tokens, np.full((batch,), len(prefix), np.int32),
                                                     capacity=capacity)


@functools.partial(cache_jit, static_argnames=("cfg",))
def _continuation_logprobs(params, cfg, cache, tokens, cont_lengths):
    """tokens [B, 1 + C] = last context token then the continuation; (sum logprob [B], per-token logprob [B, C])."""
    logits = forward(params, cfg, tokens, cache, lengths=1 + cont_lengths).logits
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)  # position j predicts token j + 1
    token_logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]  # [B, C]
    mask = jnp.arange(tokens.shape[1] - 1)[None, :] < cont_lengths[:, None]
    token_logp = jnp.where(mask, token_logp, 0.0)
    return token_logp.sum(axis=1), token_logp


def continuation_logprobs(params: Params, cfg: DecoderConfig, prefix_cache: KVCache, last_tokens, continuations,
                          cont_lengths, return_tokens: bool = False):
    """Log-probability of each row's continuation given its cached prefix and last context token.

    prefix_cache: B rows holding context[:-1] (any capacity; re-fitted to a bucketed one, the input is not changed);
    last_tokens int [B]; continuations int [B, C] right-padded; cont_lengths int [B] (>= 1).
    Returns (sum_logprob float32 [B], n_tokens int32 [B]) as numpy arrays, plus the per-token log-probabilities
    [B, C] (0 past each row's length) with `return_tokens`.
    """
    check_compatible(cfg, prefix_cache)
    conts = np.asarray(continuations, np.int32)
    lengths = np.asarray(cont_lengths, np.int32)
    b, c = conts.shape
    if np.asarray(last_tokens).shape != (b,) or lengths.shape != (b,) or prefix_cache.batch_size != b:
        raise ValueError(f"need last_tokens [B], cont_lengths [B] and a cache of batch B = {b} (continuations "
                         f"{conts.shape}); got {np.shape(last_tokens)}, {lengths.shape}, {prefix_cache.batch_size}")
    if lengths.min() < 1 or lengths.max() > c:
        raise ValueError(f"cont_lengths must be in [1, {c}], got {lengths}")
    tokens = np.zeros((b, 1 + bucket(c)), np.int32)  # bucketed token axis: one compile per few lengths
    tokens[:, 0] = last_tokens
    tokens[:, 1 : 1 + c] = conts
    cache = fit_capacity(prefix_cache, bucket(int(jnp.max(prefix_cache.lengths)) + tokens.shape[1]))
    total, per_token = _continuation_logprobs(params, cfg, cache, jnp.asarray(tokens), jnp.asarray(lengths))
    out = (np.asarray(total), lengths)
    return (*out, np.asarray(per_token)[:, :c]) if return_tokens else out


@functools.partial(aot.jit, static_argnames=("cfg",))
def _window_losses(params, cfg, windows):
    logits = forward(params, cfg, windows[:, :-1]).logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean(axis=1)


def window_losses(params: Params, cfg: DecoderConfig, windows, batch_size: int = 8) -> np.ndarray:
    """Mean next-token cross-entropy (nats) of each window int [N, T+1] -> float [N]. The last batch is padded by
    repeating windows (one compiled shape)."""
    windows = np.asarray(windows, np.int32)
    n = len(windows)
    out = []
    for start in range(0, n, batch_size):
        batch = windows[np.minimum(np.arange(start, start + batch_size), n - 1)]
        out.append(np.asarray(_window_losses(params, cfg, jnp.asarray(batch))))
    return np.concatenate(out)[:n]


def heldout_loss(params: Params, cfg: DecoderConfig, windows, batch_size: int = 8) -> float:
    """Mean cross-entropy (nats per token) over windows int [N, T+1] (all windows have T predicted tokens)."""
    return float(window_losses(params, cfg, windows, batch_size).mean())

"""Calibration: run both models on the same windows and stream (source, target) feature pairs into statistics."""

from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.cache import KVCache, init_cache
from kvjax.mapper.features import layer_features, paired_features
from kvjax.mapper.pairing import Pairing
from kvjax.mapper.ridge import Stats, chunk_stats, to_stats
from kvjax.models.config import Qwen3Config
from kvjax.models.params import Params
from kvjax.models.qwen3 import forward

Model = tuple[Qwen3Config, Params]


def native_cache(params: Params, cfg: Qwen3Config, tokens: jax.Array, lengths: jax.Array | None = None) -> KVCache:
    """The model's own cache after prefilling windows int [B, T] (right-padded to `lengths`; traceable)."""
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1], params.embed.dtype)
    return forward(params, cfg, tokens, cache, lengths, last_only=True, fresh=True)[1]


@functools.partial(jax.jit, static_argnames=("scfg", "tcfg", "pairing"))
def _window_stats(sparams, tparams, scfg, tcfg, pairing: Pairing, tokens, mask):
    src = native_cache(sparams, scfg, tokens)
    tgt = native_cache(tparams, tcfg, tokens)
    flat_mask = mask.reshape(-1)
    out = []
    for t, layers in enumerate(pairing):
        xk, xv = paired_features(src, layers, scfg.rope_theta)
        yk, yv = layer_features(tgt, t, tcfg.rope_theta)
        flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
        out.append((chunk_stats(flat(xk), flat(yk), flat_mask), chunk_stats(flat(xv), flat(yv), flat_mask)))
    return out


def collect_stats(source: Model, target: Model, pairing: Pairing, batches: Iterable[np.ndarray],
                  desc: str = "calibrate", total: int | None = None) -> tuple[list[Stats], list[Stats]]:
    """Sum statistics over batches of token windows int [B, T] (EOS-padded rows count fully). Returns per target
    layer (key stats, value stats)."""
    (scfg, sparams), (tcfg, tparams) = source, target
    k_stats: list[Stats] | None = None
    v_stats: list[Stats] | None = None
    for tokens in tqdm(batches, desc=desc, unit="batch", total=total, leave=False):
        tokens = jnp.asarray(tokens, jnp.int32)
        mask = jnp.ones(tokens.shape, jnp.float32)
        sums = _window_stats(sparams, tparams, scfg, tcfg, pairing, tokens, mask)
        batch_k = [to_stats(k) for k, _ in sums]
        batch_v = [to_stats(v) for _, v in sums]
        if k_stats is None:
            k_stats, v_stats = batch_k, batch_v
        else:
            for acc, new in zip(k_stats + v_stats, batch_k + batch_v):
                acc += new
    if k_stats is None:
        raise ValueError("no calibration batches")
    return k_stats, v_stats


def batches_of(windows: np.ndarray, batch_size: int):
    """Consecutive batches [B, T] of a window array [N, T] (the last one may be smaller)."""
    for i in range(0, len(windows), batch_size):
        yield np.asarray(windows[i : i + batch_size])

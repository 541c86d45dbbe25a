"""Evaluation arms: the ways a prompt's cache can be made for the model that answers.

  target    the target reads the prompt itself (native small model)
  source    the source reads and answers (native large model)
  direct    the target answers from the source's nearest-depth layers copied as they are (no map); when the KV
            widths differ, each layer's features are cut or zero-padded to the target's width (the "raw" baseline)
  ridge     the target answers from the source cache mapped by the ridge map
  residual  the same with the ridge + residual map

Scoring every arm item by item lets the mapped arms share one source prefill per item (`SourcePrefix`), which is
what a large source costs most.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.cache import KVCache
from kvjax.eval import multiple_choice, retrieval
from kvjax.eval.likelihood import native_prefix_cache
from kvjax.eval.multiple_choice import MCItem, MCResult, PrefixFn
from kvjax.eval.retrieval import RetrievalItem, RetrievalResult
from kvjax.mapper.calibrate import Model
from kvjax.mapper.kvmap import KVMap, LinearMap, apply_map, direct_map, spec_for
from kvjax.mapper.pairing import depth_pairing
from kvjax.models.config import Qwen3Config


class Arm(NamedTuple):
    name: str
    model: Model  # the model that scores / answers
    prefix_fn: PrefixFn  # (context_ids, rows) -> that model's cache of context_ids[:-1], `rows` identical rows


def injection_map(source: Qwen3Config, target: Qwen3Config) -> KVMap:
    """The direct-injection baseline as a map: each target layer gets its nearest-depth source layer's features
    unchanged (kvjax.mapper.kvmap.direct_map) or, when widths differ, cut / zero-padded to the target's width."""
    pairing = depth_pairing(source.num_layers, target.num_layers)
    if (source.num_kv_heads, source.head_dim) == (target.num_kv_heads, target.head_dim):
        return direct_map(source, target, pairing)
    fx, fy = source.num_kv_heads * source.head_dim, target.num_kv_heads * target.head_dim
    m = min(fx, fy)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    layer = LinearMap(mu=f32(np.zeros(fx)), scale=f32(1.0), w_in=f32(np.eye(fx, m)), w_out=f32(np.eye(m, fy)),
                      bias=f32(np.zeros(fy)), down=f32(np.zeros((fx, 1))), res_bias=f32(np.zeros(1)),
                      up=f32(np.zeros((1, fy))))
    layers = (layer,) * target.num_layers
    return KVMap(keys=layers, values=layers, spec=spec_for(source, target, pairing, None, 1))


def injection_kind(source: Qwen3Config, target: Qwen3Config) -> str:
    same = (source.num_kv_heads, source.head_dim) == (target.num_kv_heads, target.head_dim)
    return "copy" if same else "width-matched (cut / zero-padded)"


_apply = jax.jit(apply_map)


def repeat_rows(cache: KVCache, rows: int) -> KVCache:
    """A 1-row cache repeated to `rows` identical rows."""
    if rows == 1:
        return cache
    return cache.replace(k=jnp.repeat(cache.k, rows, axis=1), v=jnp.repeat(cache.v, rows, axis=1),
                         lengths=jnp.repeat(cache.lengths, rows))


class SourcePrefix:
    """The source's 1-row cache of context[:-1], kept for the most recent context so that every arm scoring the
    same item reuses one source prefill."""

    def __init__(self, source: Model):
        self.source = source
        self._key, self._cache = None, None

    def __call__(self, context_ids) -> KVCache:
        key = tuple(int(t) for t in context_ids[:-1])
        if key != self._key:
            cfg, params = self.source
            self._cache, self._key = native_prefix_cache(params, cfg, context_ids, 1), key
        return self._cache


def make_arms(names, source: Model, target: Model, maps: dict[str, KVMap]) -> list[Arm]:
    """Arms in the order of `names`; mapped arms ("direct", "ridge", "residual") need their map in `maps`."""
    shared = SourcePrefix(source)
    (tcfg, tparams) = target
    arms = []
    for name in names:
        if name == "target":
            fn = lambda ctx, rows: repeat_rows(native_prefix_cache(tparams, tcfg, ctx, 1), rows)  # noqa: E731
            arms.append(Arm(name, target, fn))
        elif name == "source":
            arms.append(Arm(name, source, lambda ctx, rows: repeat_rows(shared(ctx), rows)))
        elif name in maps:
            kvmap = maps[name]
            fn = lambda ctx, rows, kvmap=kvmap: repeat_rows(_apply(kvmap, shared(ctx)), rows)  # noqa: E731
            arms.append(Arm(name, target, fn))
        else:
            raise ValueError(f"arm {name!r}: no map of that name (have {sorted(maps)}); arms are target, source, "
                             "direct, ridge, residual")
    return arms


def score_mc_arms(items: list[MCItem], tokenizer, arms: list[Arm], normalize: str = "length",
                  progress: bool = True, desc: str = "multiple choice") -> dict[str, MCResult]:
    """Every arm on every item (items outer, arms inner, so the mapped arms share the item's source prefill)."""
    if not items or len({len(it.options) for it in items}) != 1:
        raise ValueError("need a non-empty list of items that all have the same number of options")
    rows = {a.name: [] for a in arms}
    for item in tqdm(items, desc=desc, unit="item", disable=not progress):
        for arm in arms:
            cfg, params = arm.model
            rows[arm.name].append(multiple_choice.score_item(item, tokenizer, params, cfg, arm.prefix_fn))
    labels = np.asarray([it.label for it in items])
    out = {}
    for name, r in rows.items():
        logprobs, n_tokens, n_bytes = (np.stack(col) for col in zip(*r))
        out[name] = MCResult(logprobs, n_tokens, n_bytes, labels, normalize)
    return out


def score_retrieval_arms(items: list[RetrievalItem], arms: list[Arm], progress: bool = True,
                         desc: str = "retrieval") -> dict[str, RetrievalResult]:
    """Exact-match retrieval for every arm (items outer, arms inner)."""
    if not items:
        raise ValueError("no retrieval items")
    rows = {a.name: [] for a in arms}
    for item in tqdm(items, desc=desc, unit="item", disable=not progress):
        for arm in arms:
            cfg, params = arm.model
            rows[arm.name].append(retrieval.score_item(item, params, cfg, arm.prefix_fn))
    out = {}
    for name, r in rows.items():
        generated, correct, logprob = zip(*r)
        out[name] = RetrievalResult(np.asarray(correct, np.float64), list(generated), np.asarray(logprob))
    return out

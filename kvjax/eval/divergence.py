"""Rollout divergence of a built cache (the method's "32-step KV-transfer divergence"): the target greedily generates n
tokens from the cache a builder made of a prefix, and at every step the source, having read the same prefix and the
same continuation itself, scores the target's next-token distribution: KL(source teacher || target), per step.

Teacher-forced KL (kvjax.eval.suite.kl) scores the target on the text's own continuation; this scores it on the
states it actually decodes from, where an error in the cache compounds through its own tokens. The continuation is a
fixed n tokens (no stop at EOS), like the residual's rollout training (kvjax.fitting.residual.rollout_windows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import aot
from kvjax.builders import CacheBuilder, Mapped, SourcePrefill
from kvjax.cache import KVCache
from kvjax.generation import greedy_continuation
from kvjax.mapper.kl import kl
from kvjax.mapper.kvmap import KVMap
from kvjax.models.decoder import forward


@functools.partial(aot.jit, static_argnames=("target_cfg", "source_cfg", "n"))
def rollout_kl(target_params, source_params, target_cfg, source_cfg, cache: KVCache, source_cache: KVCache,
               last: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """(KL [B, n] per step, the greedy tokens [B, n]): the target reads `last` [B] (each prefix's last token) after
    `cache` (its cache of the prefix before it, room for n more positions) and greedily continues
    (kvjax.generation.greedy_continuation); then both models read `last` and the first n - 1 generated tokens in one
    pass, the target after `cache` (its logits are the ones it picked its tokens from), the source after
    `source_cache` (its own cache of that prefix): the teacher at every step."""
    toks = greedy_continuation(target_params, target_cfg, cache, last, n)
    read = jnp.concatenate([last[:, None], toks[:, :-1]], axis=1)  # [B, n]
    student = forward(target_params, target_cfg, read, cache).logits
    # the teacher reads the same n tokens: its cache needs n more slots
    source_cache = source_cache.map_layers(lambda a: jnp.pad(a, ((0, 0),) * 2 + ((0, n),) + ((0, 0),)))
    teacher = forward(source_params, source_cfg, read, source_cache).logits
    return kl(teacher, student), toks


def rollout_table(builders: dict, source, target, prefixes: np.ndarray, n: int = 32,
                  batch_size: int = 8) -> dict[str, np.ndarray]:
    """Per-step rollout divergence [N, n] (nats) of each builder (name -> CacheBuilder of the target's cache, or a
    KVMap meaning kvjax.builders.Mapped) on prefixes int [N, P]: each builder makes the cache of prefix[:P-1], the
    target reads prefix[P-1] and generates n tokens greedily. The source reads every prefix once per batch
    (kvjax.builders.SourcePrefill, shared by the mapped builders and the teacher)."""
    prefixes = np.asarray(prefixes)
    if prefixes.ndim != 2 or prefixes.shape[1] < 2 or n < 1:
        raise ValueError(f"prefixes must be [N, P] with P >= 2 and n >= 1, got shape {prefixes.shape} and n = {n}")
    (scfg, sparams), (tcfg, tparams) = source, target
    shared = SourcePrefill(source)
    builders = {name: Mapped(source, target, b, name=name, shared=shared) if isinstance(b, KVMap) else b
                for name, b in builders.items()}
    rows = {name: [] for name in builders}
    for i in range(0, len(prefixes), batch_size):
        batch = prefixes[i : i + batch_size].astype(np.int32)
        context, last = batch[:, :-1], jnp.asarray(batch[:, -1])
        for name, builder in builders.items():
            cache = builder(context, capacity=context.shape[1] + n)
            source_cache = shared(context, capacity=context.shape[1])  # what the mapped builders read: no new prefill
            rows[name].append(np.asarray(rollout_kl(tparams, sparams, tcfg, scfg, cache, source_cache, last, n)[0]))
    return {name: np.concatenate(r) for name, r in rows.items()}


def rollout_divergence(builder: CacheBuilder | KVMap, source, target, prefixes: np.ndarray, n: int = 32,
                       batch_size: int = 8) -> np.ndarray:
    """`rollout_table` of one builder or map: KL [N, n] per window and step."""
    return rollout_table({"arm": builder}, source, target, prefixes, n, batch_size)["arm"]

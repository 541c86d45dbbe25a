"""Next-token agreement of the mapped path: does the target, reading a mapped prefix cache, pick the same next token
as the source (the model whose understanding the map should carry) and as the native target (itself, having read
the prefix)? Complements source-teacher KL with a metric people can read as a percentage."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.mapper.calibrate import native_cache
from kvjax.mapper.kl import kl
from kvjax.mapper.kvmap import KVMap
from kvjax.mapper.residual import student_logits
from kvjax.models.qwen3 import forward_nocache


@functools.partial(jax.jit, static_argnames=("source_cfg", "target_cfg", "prefix"))
def _window_agreement(kvmap, source_params, target_params, source_cfg, target_cfg, tokens, prefix: int):
    teacher = forward_nocache(source_params, source_cfg, tokens[:, :-1])[:, prefix - 1 :]
    native = forward_nocache(target_params, target_cfg, tokens[:, :-1])[:, prefix - 1 :]
    src_cache = native_cache(source_params, source_cfg, tokens[:, : prefix - 1])
    student = student_logits(kvmap, (target_cfg, target_params), src_cache, tokens, prefix)
    pick = student.argmax(-1)
    return {"with_source": (pick == teacher.argmax(-1)).mean(-1),
            "with_target": (pick == native.argmax(-1)).mean(-1),
            "target_with_source": (native.argmax(-1) == teacher.argmax(-1)).mean(-1),
            "kl_mapped": kl(teacher, student).mean(-1),
            "kl_native": kl(teacher, native).mean(-1)}


def next_token_agreement(kvmap: KVMap, source, target, windows: np.ndarray, prefix: int,
                         batch_size: int = 8) -> dict[str, np.ndarray]:
    """Per-window metrics [N] over the continuation windows[:, prefix:] of held-out windows int [N, prefix + cont]:

    with_source         fraction of positions where the target-from-mapped-cache argmax == the source's argmax
    with_target         ... == the native target's argmax (the target having read the prefix itself)
    target_with_source  native target argmax == source argmax (the baseline the map should beat)
    kl_mapped           KL(source || target from mapped cache), nats/token
    kl_native           KL(source || native target), nats/token (how far apart the two models are to begin with)

    `source`, `target` are (config, params) pairs."""
    if windows.ndim != 2 or not 1 < prefix < windows.shape[1]:
        raise ValueError(f"windows must be [N, T] with 1 < prefix < T, got shape {windows.shape} and prefix {prefix}")
    (scfg, sparams), (tcfg, tparams) = source, target
    rows = []
    for i in range(0, len(windows), batch_size):
        batch = jnp.asarray(windows[i : i + batch_size], jnp.int32)
        rows.append(jax.device_get(_window_agreement(kvmap, sparams, tparams, scfg, tcfg, batch, prefix)))
    return {k: np.concatenate([r[k] for r in rows]).astype(np.float64) for k in rows[0]}

"""Next-token agreement of a built cache: does the target, reading a prefix cache made by a builder (a map, a partial
recomputation, ...), pick the same next token as the source (the model whose understanding the map should carry) and
as the native target (itself, having read the prefix)? Complements source-teacher KL with a metric people can read
as a percentage."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import aot
from kvjax.builders import CacheBuilder, Mapped
from kvjax.cache import cache_jit
from kvjax.mapper.kl import kl
from kvjax.mapper.kvmap import KVMap
from kvjax.models.decoder import forward


@functools.partial(aot.jit, static_argnames=("source_cfg", "target_cfg", "prefix"))
def _references(source_params, target_params, source_cfg, target_cfg, tokens, prefix: int):
    """The source's (teacher) and the native target's logits at the continuation positions."""
    teacher = forward(source_params, source_cfg, tokens[:, :-1]).logits[:, prefix - 1 :]
    native = forward(target_params, target_cfg, tokens[:, :-1]).logits[:, prefix - 1 :]
    return teacher, native


@functools.partial(cache_jit, static_argnames=("cfg",))
def _student(params, cfg, cache, continuation):
    """The target's logits for the last prefix token and the continuation, read from the built cache."""
    return forward(params, cfg, continuation, cache).logits


@aot.jit
def _compare(teacher, native, student):
    pick = student.argmax(-1)
    return {"with_source": (pick == teacher.argmax(-1)).mean(-1),
            "with_target": (pick == native.argmax(-1)).mean(-1),
            "first_with_source": (pick[:, 0] == teacher[:, 0].argmax(-1)).astype(jnp.float32),
            "first_with_target": (pick[:, 0] == native[:, 0].argmax(-1)).astype(jnp.float32),
            "target_with_source": (native.argmax(-1) == teacher.argmax(-1)).mean(-1),
            "kl_mapped": kl(teacher, student).mean(-1),
            "kl_native": kl(teacher, native).mean(-1),
            "kl_to_target": kl(native, student).mean(-1)}


def next_token_agreement(builder: CacheBuilder | KVMap, source, target, windows: np.ndarray, prefix: int,
                         batch_size: int = 8) -> dict[str, np.ndarray]:
    """Per-window metrics [N] over the continuation windows[:, prefix:] of held-out windows int [N, prefix + cont],
    the target reading windows[:, :prefix - 1] from the cache `builder` makes (a KVMap means kvjax.builders.Mapped):

    with_source         fraction of positions where the target-from-built-cache argmax == the source's argmax
    with_target         ... == the native target's argmax (the target having read the prefix itself)
    target_with_source  native target argmax == source argmax (the baseline the map should beat)
    first_with_source   1 if the first token after the prefix (what a prefill hand-off decides) == the source's
    first_with_target   ... == the native target's
    kl_mapped           KL(source || target from the built cache), nats/token
    kl_native           KL(source || native target), nats/token (how far apart the two models are to begin with)
    kl_to_target        KL(native target || target from the built cache), nats/token: how far the built cache moves
                        the target from its own predictions (the cache quality when small reads and large answers)

    `source`, `target` are (config, params) pairs."""
    return agreement_table({"arm": builder}, source, target, windows, prefix, batch_size)["arm"]


def agreement_table(builders: dict, source, target, windows: np.ndarray, prefix: int,
                    batch_size: int = 8) -> dict[str, dict[str, np.ndarray]]:
    """`next_token_agreement` for several builders (name -> CacheBuilder or KVMap) on the same windows, the source's
    and the native target's logits computed once per batch for all of them."""
    if windows.ndim != 2 or not 1 < prefix < windows.shape[1]:
        raise ValueError(f"windows must be [N, T] with 1 < prefix < T, got shape {windows.shape} and prefix {prefix}")
    (scfg, sparams), (tcfg, tparams) = source, target
    builders = {name: Mapped(source, target, b) if isinstance(b, KVMap) else b for name, b in builders.items()}
    rows = {name: [] for name in builders}
    for i in range(0, len(windows), batch_size):
        batch = np.asarray(windows[i : i + batch_size], np.int32)
        teacher, native = _references(sparams, tparams, scfg, tcfg, jnp.asarray(batch), prefix)
        for name, builder in builders.items():
            cache = builder(batch[:, : prefix - 1], capacity=batch.shape[1])
            student = _student(tparams, tcfg, cache, jnp.asarray(batch[:, prefix - 1 : -1]))
            rows[name].append(jax.device_get(_compare(teacher, native, student)))
    return {name: {k: np.concatenate([r[k] for r in rs]).astype(np.float64) for k in rs[0]}
            for name, rs in rows.items()}

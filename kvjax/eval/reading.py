"""How much of the source-target gap is *reading*? A prefix cache, mapped or not, can only change what the target
takes from the prefix; the rest of the gap is the target's own modelling of the continuation. This splits the
source-teacher KL on a continuation into those two parts by letting both models read either the whole prefix or
only its last `short` tokens:

    kl_full   KL(source, full prefix || target, full prefix)    the gap the map starts from (native target)
    kl_local  KL(source, short prefix || target, short prefix)  the gap with (almost) nothing to read
    source_reading  KL(source full || source short)             how much the prefix moves the source
    target_reading  KL(target full || target short)             ... and the target

If the target could read like the source, its KL would fall roughly to kl_local: `1 - kl_local / kl_full` is an
estimate (not a bound) of the most any map can remove. Continuation tokens are always read natively.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.mapper.residual import kl
from kvjax.models.qwen3 import forward_nocache


@functools.partial(jax.jit, static_argnames=("cfg", "cont"))
def _cont_logits(params, cfg, tokens, cont: int):
    """Logits [B, cont, V] predicting tokens[:, -cont:], reading everything before them."""
    return forward_nocache(params, cfg, tokens[:, :-1])[:, -cont:].astype(jnp.float32)


@jax.jit
def _ce(logits, targets):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]


def reading_gap(source, target, windows: np.ndarray, prefix: int, short: int = 16,
                batch_size: int = 8) -> dict[str, np.ndarray]:
    """Per-window metrics [N] (nats/token) on the continuation windows[:, prefix:] of int windows [N, prefix + cont]:
    kl_full, kl_local, source_reading, target_reading (module docstring) and ce_{source,target}_{full,short}.
    `source` and `target` are (cfg, params) pairs sharing a tokenizer."""
    windows = np.asarray(windows)
    cont = windows.shape[1] - prefix
    if not 1 <= short <= prefix or cont < 1:
        raise ValueError(f"need 1 <= short ({short}) <= prefix ({prefix}) < window length ({windows.shape[1]})")
    out: dict[str, list] = {}
    for i in range(0, len(windows), batch_size):
        tokens = jnp.asarray(windows[i : i + batch_size], jnp.int32)
        targets = tokens[:, prefix:]
        logits = {}
        for role, (cfg, params) in (("source", source), ("target", target)):
            logits[role, "full"] = _cont_logits(params, cfg, tokens, cont)
            logits[role, "short"] = _cont_logits(params, cfg, tokens[:, prefix - short :], cont)
        rows = {"kl_full": kl(logits["source", "full"], logits["target", "full"]),
                "kl_local": kl(logits["source", "short"], logits["target", "short"]),
                "source_reading": kl(logits["source", "full"], logits["source", "short"]),
                "target_reading": kl(logits["target", "full"], logits["target", "short"])}
        for (role, view), lg in logits.items():
            rows[f"ce_{role}_{view}"] = _ce(lg, targets)
        for k, v in rows.items():
            out.setdefault(k, []).append(np.asarray(v.mean(-1)))
    return {k: np.concatenate(v) for k, v in out.items()}

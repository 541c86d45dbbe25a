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
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import aot
from kvjax.mapper.kl import kl
from kvjax.models.decoder import forward


@functools.partial(aot.jit, static_argnames=("cfg", "cont"))
def _cont_logits(params, cfg, tokens, cont: int):
    """Logits [B, cont, V] predicting tokens[:, -cont:], reading everything before them."""
    return forward(params, cfg, tokens[:, :-1]).logits[:, -cont:].astype(jnp.float32)


@aot.jit
def _ce(logits, targets):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]


def reading_gap(source, target, windows: np.ndarray, prefix: int, short: int = 16,
                batch_size: int = 8) -> dict[str, np.ndarray]:
    """Per-window metrics [N] (nats/token) on the continuation windows[:, prefix:] of int windows [N, prefix + cont]:
    kl_full, kl_local, source_reading, target_reading (module docstring) and ce_{source,target}_{full,short}.
    `source` and `target` are (cfg, params) pairs sharing a tokenizer."""
    return reading_gaps(source, target, windows, prefix, (short,), batch_size)[short]


def reading_gaps(source, target, windows: np.ndarray, prefix: int, shorts: Sequence[int],
                 batch_size: int = 8, by_position: bool = False) -> dict[int, dict[str, np.ndarray]]:
    """reading_gap for several local views at once, {short: metrics}: the full-prefix logits are computed once.
    With `by_position`, every metric is [N, cont] (one value per continuation position) instead of its mean [N]."""
    windows = np.asarray(windows)
    cont = windows.shape[1] - prefix
    shorts = tuple(dict.fromkeys(shorts))
    if not shorts or not all(1 <= s <= prefix for s in shorts) or cont < 1:
        raise ValueError(f"need 1 <= short ({', '.join(map(str, shorts)) or 'none given'}) <= prefix ({prefix}) < "
                         f"window length ({windows.shape[1]})")
    out: dict[int, dict[str, list]] = {s: {} for s in shorts}
    for i in range(0, len(windows), batch_size):
        tokens = jnp.asarray(windows[i : i + batch_size], jnp.int32)
        targets = tokens[:, prefix:]
        full = {role: _cont_logits(params, cfg, tokens, cont)
                for role, (cfg, params) in (("source", source), ("target", target))}
        for short in shorts:
            local = {role: _cont_logits(params, cfg, tokens[:, prefix - short :], cont)
                     for role, (cfg, params) in (("source", source), ("target", target))}
            rows = {"kl_full": kl(full["source"], full["target"]),
                    "kl_local": kl(local["source"], local["target"]),
                    "source_reading": kl(full["source"], local["source"]),
                    "target_reading": kl(full["target"], local["target"])}
            for role in ("source", "target"):
                rows[f"ce_{role}_full"], rows[f"ce_{role}_short"] = _ce(full[role], targets), _ce(local[role], targets)
            for k, v in rows.items():
                out[short].setdefault(k, []).append(np.asarray(v if by_position else v.mean(-1)))
    return {s: {k: np.concatenate(v) for k, v in m.items()} for s, m in out.items()}


"""A mapped prompt whose last tokens the answerer reads itself: recomputation along positions, not layers.

The source reads the whole prompt and the map translates it (kvjax.builders.Mapped); then the target reads each
row's last `n` tokens natively on top of the mapped rest, overwriting their mapped entries. The prompt's end is
where its question usually is ("The secret code for apple is"): read natively, the question's queries, keys and
values are the target's own, and only the context it looks things up in comes through the map. The price is a
target prefill of n tokens (n / T of a native prefill, attending over all T), the source's prefill is unchanged, and
the map's own cost does not shrink: it still maps every position (its entries for the tail are overwritten).

The mapped entries of the tail's positions are computed and then thrown away rather than skipped, so the source
prefill and the map are the very programs (and the shared source prefill) of the "residual" arm: the source is
causal and the map per position (a context map reads only earlier positions), so the head's mapped entries are the
same either way.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.builders.base import CacheBuilder, Clock
from kvjax.builders.mapped import Mapped, SourcePrefill
from kvjax.builders.partial import PartialRecompute
from kvjax.cache import KVCache
from kvjax.mapper.kvmap import KVMap
from kvjax.models.decoder import prefill_jit


def split_tail(tokens: np.ndarray, lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(head lengths [B], tail tokens int32 [B, n] right-padded with 0, tail lengths [B]): each row's last
    min(n, length - 1) tokens; a row keeps at least its first token mapped (a row of length 0 keeps nothing)."""
    lengths = np.asarray(lengths, np.int32)
    tail_len = np.clip(np.minimum(n, lengths - 1), 0, None).astype(np.int32)
    head = lengths - tail_len
    idx = head[:, None] + np.arange(n, dtype=np.int32)[None]
    real = np.arange(n)[None] < tail_len[:, None]
    tail = np.where(real, np.take_along_axis(tokens, np.minimum(idx, tokens.shape[1] - 1), axis=1), 0)
    return head, tail.astype(np.int32), tail_len


class NativeTail(CacheBuilder):
    """`kvmap`'s cache of each prompt with its last `n` tokens read by the target itself (n = 0: the mapped cache).

    `base`: the cache the tail is read on top of, when not the map's alone: another builder for the same target, e.g.
    `PartialRecompute(source, target, kvmap, k)`, whose bottom layers the target has already recomputed over the
    whole prompt (the tail then replaces the last n positions in every layer); `impl` and `shared` are then the
    base's own business, set where it is built."""

    def __init__(self, source, target, kvmap: KVMap, n: int, name: str | None = None, impl: str = "xla",
                 shared: SourcePrefill | None = None, base: CacheBuilder | None = None):
        if n < 0:
            raise ValueError(f"native tail of {n} tokens: pass 0 or more")
        if base is not None and base.model[0] != target[0]:
            raise ValueError(f"a native tail on {base.name!r}: that builder makes another model's cache; pass one "
                             "that builds the target's")
        self.n, self.name = int(n), name or f"tail{n}"
        self.mapped = base if base is not None else Mapped(source, target, kvmap, impl=impl, shared=shared)
        self.model = self.mapped.model

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        mapped = self.mapped.build(tokens, lengths, capacity, clock)
        if self.n == 0:
            return mapped
        head, tail, tail_len = split_tail(tokens, lengths, self.n)
        cfg, params = self.model
        _, cache, _, _ = prefill_jit(params, cfg, jnp.asarray(tail), jnp.asarray(tail_len),
                                     mapped.replace(lengths=jnp.asarray(head)), fresh=False, logits=None)
        return clock("tail", cache.replace(origin=f"tail{self.n}:{mapped.origin}"))


def repaired(source, target, kvmap: KVMap, layers: int = 0, mode: str = "bottom", tail_tokens: int = 0,
             name: str | None = None, impl: str = "xla", shared: SourcePrefill | None = None) -> CacheBuilder:
    """The map's cache with both repairs the answerer can make itself, each optional: `layers` of its layers
    recomputed over the whole prompt (PartialRecompute, `mode` "bottom" or "top"), then its last `tail_tokens`
    positions read natively on top (NativeTail). Neither: the mapped cache (Mapped). The one place the two compose,
    for the evaluation arms, the TTFT evaluation and speculative KV transfer alike."""
    own = None if tail_tokens else name  # the outermost builder carries the name
    if layers:
        base = PartialRecompute(source, target, kvmap, layers, mode, name=own, impl=impl, shared=shared)
    else:
        base = Mapped(source, target, kvmap, name=own or "mapped", impl=impl, shared=shared)
    return NativeTail(source, target, kvmap, tail_tokens, name=name, base=base) if tail_tokens else base

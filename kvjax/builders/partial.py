"""Partial recomputation: the target recomputes some of its layers natively, the rest of its cache comes from a map.

The method's claim: "Recomputing two target layers removed the nonlinear ceiling of an affine cache map". A linear map
cannot reproduce what the target's own nonlinear layers would have written; letting the target run a few layers over the
prompt itself repairs that at a fraction of its prefill. Two placements:

  bottom k   the target's layers 0..k-1 run natively over the prompt; layers k.. come from the map. Costs k target
             layers (the map still serves the layers above).
  top k      the target runs over the prompt reading the mapped keys/values in its layers 0..L-k-1 (queries and
             MLPs computed, K/V taken from the map) and recomputes the K/V of its top k layers from the hidden states
             that reading produced. Costs a full pass of target queries and MLPs, so its value is quality, not speed.

Both are one function, `recompute`: layer i uses its own K/V if i is in `layers`, else the mapped cache's; the
target runs up to its highest recomputed layer and stops there. Any other set of layers is a placement too
(`PartialRecompute(..., layers=(0, 2))`: layer 0 natively, layer 1 read from the map, layer 2 recomputed from what
reading it produced).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import aot
from kvjax.builders.base import CacheBuilder, Clock
from kvjax.builders.mapped import Mapped, SourcePrefill
from kvjax.cache import KVCache
from kvjax.mapper.kvmap import KVMap
from kvjax.models.decoder import forward, prefill_jit

MODES = ("bottom", "top")


def recompute_layers(num_layers: int, k: int, mode: str) -> tuple[int, ...]:
    """The target layers a placement recomputes: bottom k -> (0..k-1), top k -> (L-k..L-1)."""
    if mode not in MODES:
        raise ValueError(f"partial recomputation mode must be one of {MODES}, got {mode!r}")
    if not 0 <= k <= num_layers:
        raise ValueError(f"k = {k} recomputed layers: the target has {num_layers}; pass 0..{num_layers}")
    return tuple(range(k)) if mode == "bottom" else tuple(range(num_layers - k, num_layers))


def check_layers(num_layers: int, layers) -> tuple[int, ...]:
    """An explicit placement: distinct target layers, sorted."""
    out = tuple(sorted({int(i) for i in layers}))
    if len(out) != len(tuple(layers)) or any(not 0 <= i < num_layers for i in out):
        raise ValueError(f"recomputed layers {tuple(layers)}: pass distinct layers of the target's 0..{num_layers - 1}")
    return out


def recompute(params, cfg, tokens: jax.Array, lengths: jax.Array, mapped: KVCache, layers: tuple[int, ...]
              ) -> KVCache:
    """`mapped` (a target cache holding the prompt, slots 0..T-1) with the K/V of `layers` recomputed by the target
    running over tokens int [B, T] (traceable; `layers` static and non-empty): the model's forward pass up to the
    highest recomputed layer, from position 0 over the prompt alone, the other layers reading the mapped
    keys/values (forward's `reads`) instead of computing and writing their own."""
    depth = max(layers) + 1
    reads = tuple(i for i in range(depth) if i not in layers)
    out = forward(params, cfg, tokens, mapped.replace(lengths=jnp.zeros_like(mapped.lengths)), lengths=lengths,
                  logits=None, fresh=True, reads=reads, depth=depth)
    return out.cache.replace(origin=f"partial{list(layers)}:{mapped.origin}")


recompute_jit = aot.jit(recompute, static_argnames=("cfg", "layers"), donate_argnames=("mapped",))


class PartialRecompute(CacheBuilder):
    """A mapped cache in which the target recomputes `k` of its layers (`mode` "bottom" or "top"; or the explicit
    `layers`, then k and mode are theirs). k = 0 is the mapped cache itself; k = L (all layers) is the target's own
    prefill."""

    def __init__(self, source, target, kvmap: KVMap, k: int = 0, mode: str = "bottom", name: str | None = None,
                 impl: str = "xla", shared: SourcePrefill | None = None, layers=None):
        n = target[0].num_layers
        if layers is None:
            self.layers = recompute_layers(n, k, mode)
        else:
            self.layers = check_layers(n, layers)
            k, mode = len(self.layers), ("bottom" if self.layers == recompute_layers(n, len(self.layers), "bottom")
                                         else "top" if self.layers == recompute_layers(n, len(self.layers), "top")
                                         else "set")
        self.k, self.mode = k, mode
        self.name = name or (f"partial_{mode}{k}" if mode != "set" else "partial_" + "_".join(map(str, self.layers)))
        self.mapped = Mapped(source, target, kvmap, impl=impl, shared=shared)
        self.model = self.mapped.model

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        cfg, params = self.model
        if len(self.layers) == cfg.num_layers:  # nothing left to map: the native prefill, at its cost
            _, cache, _, _ = prefill_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), capacity=capacity,
                                      logits=None)
            return clock("recompute", cache)
        mapped = self.mapped.build(tokens, lengths, capacity, clock)
        if not self.layers:
            return mapped
        return clock("recompute", recompute_jit(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), mapped,
                                                self.layers))




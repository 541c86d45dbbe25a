"""Source prefill with the cache map interleaved: each target layer is mapped as soon as the source layers it is
paired with have produced their keys and values, inside the prefill program (kvjax.models.decoder.prefill_jit, with
the map as its layer tap).

Compared with prefill-then-map (kvjax.builders.Mapped), the pipelined path
- never builds the source cache: each paired source layer's K/V go straight from the layer to the map (and are
  dropped after their last use), the unpaired layers' K/V are never stored;
- stops the source at its deepest paired layer: later layers, the final norm and the unembedding only feed
  source logits the split path never uses;
- issues each layer's map right behind the source layer it waits for, with no host round trip between prefill
  and map, so XLA is free to overlap or interleave them (on one CPU stream they simply run back to back).
The target cache it returns equals apply_map(kvmap, source prefill cache) up to float rounding (same ops).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from kvjax.builders.base import CacheBuilder, Clock
from kvjax.cache import KVCache
from kvjax.kernels.map_insert import map_layer
from kvjax.mapper.kvmap import KVMap, MapSpec, check_models
from kvjax.models.family import DecoderConfig
from kvjax.models.decoder import LayerTap, prefill_jit
from kvjax.models.params import Params


@struct.dataclass
class MapTap(LayerTap):
    """The map as a tap of the prefill program (kvjax.models.decoder.LayerTap): each target layer is mapped right
    after the last source layer it is paired with, each source layer's K/V are kept only until their last use, and
    the pass need not go past the deepest paired layer (`depth`). A pytree: the KVMap's arrays are its leaves, the
    rest static."""

    kvmap: KVMap
    length: int = struct.field(pytree_node=False)  # T: the prompt slots mapped
    capacity: int = struct.field(pytree_node=False)
    dtype: object = struct.field(pytree_node=False)  # of the target cache
    cache_dtype: object = struct.field(pytree_node=False)  # what the source cache would store (the map reads it)
    impl: str = struct.field(pytree_node=False)
    interpret: bool = struct.field(pytree_node=False)
    block_t: int | None = struct.field(pytree_node=False)

    @property
    def spec(self) -> MapSpec:
        return self.kvmap.spec

    @property
    def depth(self) -> int:
        return max(s for layers in self.spec.pairing for s in layers) + 1

    def start(self):
        return {}, {}  # source layer -> (k, v) in cache layout; target layer -> its mapped (k, v) buffers

    def layer(self, i, seen, state):
        kv, mapped = dict(state[0]), dict(state[1])
        k, v, kvmap = seen.k, seen.v, self.kvmap
        pairing = self.spec.pairing
        last_use = {s: max(max(p) for p in pairing if s in p) for p in pairing for s in p}
        if i in last_use:
            to_cache = lambda a: a.astype(self.cache_dtype).transpose(0, 2, 1, 3)  # noqa: E731  [B, Hs, T, hd]
            kv[i] = (to_cache(k), to_cache(v))
        for tl, layers in enumerate(pairing):
            if max(layers) == i:
                mapped[tl] = map_layer([kv[s][0] for s in layers], [kv[s][1] for s in layers], kvmap.keys[tl],
                                       kvmap.values[tl], target_kv=self.spec.target_kv, capacity=self.capacity,
                                       dtype=self.dtype, length=self.length, src_rope=self.spec.source_rope,
                                       tgt_rope=self.spec.target_rope, impl=self.impl, block_t=self.block_t,
                                       interpret=self.interpret)
        for s in [s for s, last in last_use.items() if last == i]:
            del kv[s]
        return kv, mapped

    def result(self, state, lengths) -> KVCache:
        mapped = state[1]
        n = len(self.spec.pairing)
        return KVCache(keys=tuple(mapped[tl][0] for tl in range(n)), values=tuple(mapped[tl][1] for tl in range(n)),
                       lengths=jnp.minimum(lengths, self.length), origin="mapped")


def pipelined_prefill_map(source: tuple[DecoderConfig, Params], kvmap: KVMap, tokens, lengths=None, *,
                          capacity: int | None = None, dtype=None, impl: str = "auto", interpret: bool = False,
                          block_t: int | None = None) -> KVCache:
    """Prefill the source on `tokens` int [B, T] (right-padded; `lengths` [B] real tokens per row, default T) and
    map its cache into a target cache of `capacity` positions (default T), layer by layer as the source computes.

    Returns the mapped target KVCache (origin "mapped:<map id>", lengths = `lengths`), i.e. what
    apply_map(kvmap, native source cache, capacity, length=T) returns; the target reads the next token from it.
    `impl`: the map's implementation ("xla", "pallas" — on CPU with `interpret=True` — or "auto", see
    kvjax.kernels.map_insert.resolve_impl); `dtype`: of the target cache (default: the source's)."""
    scfg, sparams = source
    if kvmap.spec.source_fingerprint != scfg.fingerprint():
        raise ValueError(f"this map was fitted for source model {kvmap.spec.source_fingerprint} but the given source "
                         f"is {scfg.fingerprint()}; pass the source model the map belongs to")
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be int [B, T] with T >= 1, got shape {tokens.shape}")
    b, t = tokens.shape
    capacity = t if capacity is None else int(capacity)
    if capacity < t:
        raise ValueError(f"target capacity {capacity} is smaller than the {t} prompt tokens")
    lengths = jnp.full((b,), t, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    cache_dtype = jnp.dtype(sparams.embed.dtype)
    tap = MapTap(kvmap, t, capacity, cache_dtype if dtype is None else jnp.dtype(dtype), cache_dtype, impl,
                 bool(interpret), block_t)
    mapped = prefill_jit(sparams, scfg, tokens, lengths, logits=None, tap=tap, depth=tap.depth).tapped
    return mapped.replace(origin=f"mapped:{kvmap.map_id}")


class Pipelined(CacheBuilder):
    """The source prefill with the map interleaved layer by layer, in one program (same cache as `Mapped` up to float
    rounding); one phase, "prefill_map"."""

    def __init__(self, source, target, kvmap: KVMap, name: str = "pipelined", impl: str = "auto"):
        check_models(kvmap, source[0], target[0])
        self.source, self.model, self.kvmap, self.name, self.impl = tuple(source), tuple(target), kvmap, name, impl

    def build(self, tokens, lengths, capacity: int, clock: Clock) -> KVCache:
        return clock("prefill_map", pipelined_prefill_map(self.source, self.kvmap, tokens, lengths,
                                                          capacity=capacity, impl=self.impl))

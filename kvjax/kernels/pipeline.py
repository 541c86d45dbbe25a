"""Source prefill with the cache map interleaved: each target layer is mapped as soon as the source layers it is
paired with have produced their keys and values, inside one jitted program.

Compared with prefill-then-map (kvjax.mapper.split), the pipelined path
- never builds the source cache: each paired source layer's K/V go straight from the layer to the map (and are
  dropped after their last use), the unpaired layers' K/V are never stored;
- stops the source at its deepest paired layer: later layers, the final norm and the unembedding only feed
  source logits the split path never uses;
- issues each layer's map right behind the source layer it waits for, with no host round trip between prefill
  and map, so XLA is free to overlap or interleave them (on one CPU stream they simply run back to back).
The target cache it returns equals apply_map(kvmap, source prefill cache) up to float rounding (same ops).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp

from kvjax.cache import KVCache
from kvjax.kernels.map_insert import map_layer
from kvjax.mapper.kvmap import KVMap
from kvjax.models.config import Qwen3Config
from kvjax.models.params import Params
from kvjax.models.decoder import causal_attention, embed, finish, head_angles, qkv


def _prefill_map(sparams: Params, scfg: Qwen3Config, kvmap: KVMap, tokens, lengths, capacity: int, dtype,
                 impl: str, interpret: bool, block_t: int | None) -> KVCache:
    b, t = tokens.shape
    spec = kvmap.spec
    hkv, hd = spec.target_kv
    n_target = len(spec.pairing)
    cache_dtype = sparams.embed.dtype  # what native_cache stores
    dtype = dtype or cache_dtype
    mapped: dict[int, tuple[jax.Array, jax.Array]] = {}  # target layer -> its (k, v) buffers
    ready_after: dict[int, list[int]] = {}  # source layer -> target layers that become mappable after it
    for tl, layers in enumerate(spec.pairing):
        ready_after.setdefault(max(layers), []).append(tl)
    last_use = {s: max(max(spec.pairing[tl]) for tl in range(n_target) if s in spec.pairing[tl])
                for s in {s for p in spec.pairing for s in p}}
    deepest = max(ready_after)

    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))  # a fresh cache: row starts at 0
    cos, sin = head_angles(scfg, positions)
    x = embed(sparams, tokens)
    kv: dict[int, tuple[jax.Array, jax.Array]] = {}
    for i, lp in enumerate(sparams.layers[:deepest + 1]):
        q, k, v = qkv(lp, scfg, x, cos, sin)  # k post-RoPE, [B, T, Hs, hd]
        if i in last_use:
            to_cache = lambda a: a.astype(cache_dtype).transpose(0, 2, 1, 3)  # noqa: E731  [B, Hs, T, hd]
            kv[i] = (to_cache(k), to_cache(v))
        for tl in ready_after.get(i, []):
            layers = spec.pairing[tl]
            mapped[tl] = map_layer([kv[s][0] for s in layers], [kv[s][1] for s in layers], kvmap.keys[tl],
                                   kvmap.values[tl], target_kv=(hkv, hd), capacity=capacity, dtype=dtype, length=t,
                                   src_rope=spec.source_rope, tgt_rope=spec.target_rope, impl=impl, block_t=block_t,
                                   interpret=interpret)
        for s in [s for s, last in last_use.items() if last == i]:
            del kv[s]
        if i < deepest:
            x = finish(lp, scfg, x, causal_attention(q, k, v))
    return KVCache(keys=tuple(mapped[tl][0] for tl in range(n_target)),
                   values=tuple(mapped[tl][1] for tl in range(n_target)), lengths=jnp.minimum(lengths, t),
                   origin=f"mapped:{kvmap.map_id}")


_prefill_map_jit = jax.jit(_prefill_map, static_argnames=("scfg", "capacity", "dtype", "impl", "interpret",
                                                          "block_t"))


def pipelined_prefill_map(source: tuple[Qwen3Config, Params], kvmap: KVMap, tokens, lengths=None, *,
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
    dtype = None if dtype is None else jnp.dtype(dtype)
    return _prefill_map_jit(sparams, scfg, kvmap, tokens, lengths, capacity, dtype, impl, bool(interpret), block_t)

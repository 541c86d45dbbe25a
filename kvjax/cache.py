"""The KV cache: one pytree shared by every model (and by the cache map).

Fixed-capacity buffers, one per layer for keys and one for values, plus the number of valid positions per row. Keys
are stored after RoPE (as transformers does). Capacity and the origin of the contents are static metadata, so a
jitted function specialises on them and a mapped cache can never pass unnoticed for a natively computed one. Yet the
same program serves every origin: the library's entry points that take caches are `cache_jit`s, which compile once
for all origins and label what they return with the origin of what they were given (a map's arms would otherwise
each recompile the answerer's programs: a third of the compile time of the default job).

Why one buffer per layer (as the params are, kvjax.models.params): on XLA:CPU a dot cannot read a slice of a larger
buffer in place, so a stacked [L, B, Hkv, C, hd] cache made every decode step copy each layer's attention window
out of it first; at batch 16-64 that copy was about a quarter of the step (1.33-1.39x faster without it, `python -m
experiments.cache_layout`). A layer's own buffer whose window is the whole capacity is read where it lies.
`k` / `v` still give the stacked [L, ...] view (a copy: for inspection, tests and the map's whole-cache stages).

Keys may be held transposed, [B, Hkv, hd, T] per layer (`keys_transposed`, static): the layout kvjax.generate's decode
loop and the server's slots run on. Why: decode's scores q . k^T read a layer's keys with the head dimension contracted; from [T, hd] rows
XLA:CPU's batched dot repacks (transposes) the keys on every step, from [hd, T] it reads them as they lie: the eight
layers' decode attention 1.334 -> 1.073 ms a step at batch 1 (`python -m experiments.cache_layout --batches 1
--profile --rounds 2`), decode at batch 16 / 64 1.47x / 1.65x (`python -m experiments.cache_layout --batches 1 4
16 64 --rounds 4`; 2026-12-02). The loop converts once on entry and back on exit (one pass over the keys);
the map, the builders and the evaluation helpers hand over and read [B, Hkv, T, hd].
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import aot
from kvjax.sharding import shard

LAYOUT = "LBHTD"  # the stacked view: [layers, batch, kv_heads, time, head_dim]; each layer's buffer is BHTD
AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")  # logical axes of the stacked view
LAYER_AXES = AXES[1:]  # logical axes of one layer's buffer
MIN_WINDOW = 128


def unstack(a: jax.Array) -> tuple:
    """[L, ...] -> L arrays [...]."""
    return tuple(a[i] for i in range(a.shape[0]))


@struct.dataclass
class KVCache:
    keys: tuple  # per layer [B, Hkv, T, hd], post-RoPE keys
    values: tuple  # per layer [B, Hkv, T, hd]
    lengths: jax.Array  # [B] int32: positions [0, lengths[b]) of row b are valid
    origin: str = struct.field(pytree_node=False, default="native")  # "native" or e.g. "mapped:<map id>"
    keys_transposed: bool = struct.field(pytree_node=False, default=False)  # keys per layer [B, Hkv, hd, T]

    @classmethod
    def from_stacked(cls, k: jax.Array, v: jax.Array, lengths: jax.Array, origin: str = "native") -> KVCache:
        """A cache from stacked [L, B, Hkv, T, hd] keys and values (one copy per layer inside jit)."""
        return cls(keys=unstack(k), values=unstack(v), lengths=lengths, origin=origin)

    @property
    def k(self) -> jax.Array:
        """All layers' keys stacked, [L, B, Hkv, T, hd] (a copy; in this layout whichever way they are held)."""
        return jnp.stack(self.with_keys_transposed(False).keys)

    @property
    def v(self) -> jax.Array:
        """All layers' values stacked, [L, B, Hkv, T, hd] (a copy)."""
        return jnp.stack(self.values)

    def map_layers(self, fn: Callable[[jax.Array], jax.Array], **changes) -> KVCache:
        """The cache with fn applied to every layer's key and value buffer ([B, Hkv, T, hd] each), plus `changes`
        (e.g. lengths=...)."""
        if self.keys_transposed:
            raise ValueError("map_layers on a cache whose keys are held transposed would hand fn two layouts; "
                             "call cache.with_keys_transposed(False) first")
        return self.replace(keys=tuple(map(fn, self.keys)), values=tuple(map(fn, self.values)), **changes)

    def with_stacked(self, k: jax.Array, v: jax.Array, **changes) -> KVCache:
        """The cache holding stacked [L, B, Hkv, T, hd] keys and values instead, plus `changes`."""
        return self.replace(keys=unstack(k), values=unstack(v), keys_transposed=False, **changes)

    def with_keys_transposed(self, transposed: bool) -> KVCache:
        """The cache with each layer's keys held as [B, Hkv, hd, T] (True) or [B, Hkv, T, hd] (False); a copy of the
        keys when that changes their layout (see the module docstring for why decode loops use the first). The value
        buffers are shared with this cache: donate only one of the two."""
        if transposed == self.keys_transposed:
            return self
        return self.replace(keys=tuple(jnp.swapaxes(a, -1, -2) for a in self.keys), keys_transposed=transposed)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def capacity(self) -> int:
        return self.values[0].shape[2]

    @property
    def head_dim(self) -> int:
        return self.values[0].shape[3]

    @property
    def dtype(self):
        return self.keys[0].dtype

    @property
    def is_mapped(self) -> bool:
        return self.origin != "native"

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys, *self.values)) + self.lengths.nbytes

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
                f"capacity={self.capacity}, head_dim={self.head_dim}, dtype={jnp.dtype(self.dtype).name}, "
                f"origin={self.origin!r}{', keys transposed' if self.keys_transposed else ''})")


def init_cache(cfg, batch_size: int, max_len: int, dtype=jnp.float32, keys_transposed: bool = False) -> KVCache:
    """An empty cache for `cfg` with room for `max_len` positions per row. `keys_transposed`: hold each layer's keys
    as [B, Hkv, hd, T], the layout decode reads fastest (module docstring); prefill and decode_step take either, the
    map and the builders hand over the standard one (`with_keys_transposed` converts)."""
    if max_len <= 0 or batch_size <= 0:
        raise ValueError(f"batch_size and max_len must be positive, got {batch_size} and {max_len}")
    shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
    key_shape = (batch_size, cfg.num_kv_heads, cfg.head_dim, max_len) if keys_transposed else shape
    return KVCache(keys=tuple(jnp.zeros(key_shape, dtype) for _ in range(cfg.num_layers)),
                   values=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   lengths=jnp.zeros((batch_size,), jnp.int32), keys_transposed=keys_transposed)


def shard_cache(cache: KVCache, mesh: jax.sharding.Mesh, rules=None) -> KVCache:
    """device_put `cache` onto `mesh` by its logical axes (LAYER_AXES for each layer's buffers; lengths by batch)."""
    return shard(cache, axes(cache), mesh, rules)


def axes(cache: KVCache) -> KVCache:
    """The cache's tree of logical axes (kvjax.sharding)."""
    key_axes = LAYER_AXES[:2] + LAYER_AXES[:1:-1] if cache.keys_transposed else LAYER_AXES  # [B, Hkv, hd, T]
    return cache.replace(keys=(key_axes,) * cache.num_layers, values=(LAYER_AXES,) * cache.num_layers,
                         lengths=("batch",))


def check_compatible(cfg, cache: KVCache) -> None:
    want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    got = (cache.num_layers, cache.num_kv_heads, cache.head_dim)
    if want != got:
        raise ValueError(f"cache of {cache} does not fit this model (needs layers, kv_heads, head_dim = {want}); "
                         "create it with kvjax.init_cache(cfg, ...) for the model you run")


def window_sizes(capacity: int) -> tuple[int, ...]:
    """Static attention windows for a cache: about two per octave, so attention reads at most ~1.5x the live part
    of the cache instead of the whole capacity."""
    sizes, w = [], MIN_WINDOW
    while w < capacity:
        sizes.append(w)
        w = w * 3 // 2 if (w & (w - 1)) == 0 else w * 4 // 3  # 128, 192, 256, 384, 512, 768, ...
        w = -(-w // 64) * 64
    sizes.append(capacity)
    return tuple(sizes)


def slice_batch(cache: KVCache, rows) -> KVCache:
    """The cache of a subset of rows (a slice or an index array)."""
    return cache.replace(keys=tuple(a[rows] for a in cache.keys), values=tuple(a[rows] for a in cache.values),
                         lengths=cache.lengths[rows])  # rows lead in either key layout


def valid(cache: KVCache, row: int) -> tuple[jax.Array, jax.Array]:
    """(k, v) of one row restricted to its valid positions: [L, Hkv, n, hd] each (host-side inspection helper)."""
    n = int(cache.lengths[row])
    keys = cache.with_keys_transposed(False).keys
    return jnp.stack([a[row, :, :n] for a in keys]), jnp.stack([a[row, :, :n] for a in cache.values])


# cache_jit's walks go into tuples, lists and dicts only, not jax.tree.map: that would visit every leaf of the params
# on every call (decode_step runs one per token); caches are passed as arguments or in such containers of them.
def _relabel(tree, origin: str, only: str | None = None):
    """`tree` (a cache, or tuples / lists / dicts holding caches and other values) with its caches labelled
    `origin` (with `only`, just those labelled `only`)."""
    if isinstance(tree, KVCache):
        return tree.replace(origin=origin) if tree.origin != origin and only in (None, tree.origin) else tree
    if isinstance(tree, (tuple, list)):
        out = [_relabel(x, origin, only) for x in tree]
        return type(tree)(*out) if hasattr(tree, "_fields") else type(tree)(out)
    if isinstance(tree, dict):
        return {k: _relabel(v, origin, only) for k, v in tree.items()}
    return tree


def _origins(tree, out: set) -> set:
    if isinstance(tree, KVCache):
        out.add(tree.origin)
    elif isinstance(tree, (tuple, list, dict)):
        for x in (tree.values() if isinstance(tree, dict) else tree):
            _origins(x, out)
    return out


class cache_jit:  # noqa: N801 (used as jax.jit is)
    """jax.jit for a function that takes caches, compiled once for caches of every origin (module docstring).

    A call whose caches (arguments, or inside tuples, lists and dicts of them) share one origin runs the function
    on them labelled "native" and gives the caches it returns that origin back; caches of several origins in one
    call keep what the trace gives them, as does a cache the function labels itself (the map's output). jax.jit's
    own attributes (`lower`, ...) are the jitted function's."""

    def __init__(self, fn: Callable, **jit_kwargs):
        self.jitted = aot.jit(fn, **jit_kwargs)
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        origins = _origins((args, kwargs), set())
        if len(origins) != 1 or origins == {"native"}:
            return self.jitted(*args, **kwargs)
        (origin,) = origins
        args, kwargs = _relabel((args, kwargs), "native")
        return _relabel(self.jitted(*args, **kwargs), origin, only="native")

    def __getattr__(self, name):
        return getattr(self.jitted, name)

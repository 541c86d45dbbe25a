"""The KV cache: one pytree shared by every model (and by the cache map).

Fixed-capacity buffers for all layers at once, plus the number of valid positions per row. Keys are stored after
RoPE (as transformers does). Capacity and the origin of the contents are static metadata, so a jitted function
specialises on them and a mapped cache can never pass unnoticed for a natively computed one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.sharding import shard

LAYOUT = "LBHTD"  # [layers, batch, kv_heads, time, head_dim]
AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")  # logical axes of k and v
MIN_WINDOW = 128


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, Hkv, T, hd], post-RoPE keys
    v: jax.Array  # [L, B, Hkv, T, hd]
    lengths: jax.Array  # [B] int32: positions [0, lengths[b]) of row b are valid
    origin: str = struct.field(pytree_node=False, default="native")  # "native" or e.g. "mapped:<map id>"

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[4]

    @property
    def dtype(self):
        return self.k.dtype

    @property
    def is_mapped(self) -> bool:
        return self.origin != "native"

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.lengths.nbytes

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, batch={self.batch_size}, kv_heads={self.num_kv_heads}, "
                f"capacity={self.capacity}, head_dim={self.head_dim}, dtype={jnp.dtype(self.dtype).name}, "
                f"origin={self.origin!r})")


def init_cache(cfg, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache for `cfg` with room for `max_len` positions per row."""
    if max_len <= 0 or batch_size <= 0:
        raise ValueError(f"batch_size and max_len must be positive, got {batch_size} and {max_len}")
    shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                   lengths=jnp.zeros((batch_size,), jnp.int32))


def shard_cache(cache: KVCache, mesh: jax.sharding.Mesh, rules=None) -> KVCache:
    """device_put `cache` onto `mesh` by its logical axes (AXES for k and v; lengths by batch)."""
    return shard(cache, cache.replace(k=AXES, v=AXES, lengths=("batch",)), mesh, rules)


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
    return cache.replace(k=cache.k[:, rows], v=cache.v[:, rows], lengths=cache.lengths[rows])


def valid(cache: KVCache, row: int) -> tuple[jax.Array, jax.Array]:
    """(k, v) of one row restricted to its valid positions: [L, Hkv, n, hd] each (host-side inspection helper)."""
    n = int(cache.lengths[row])
    return cache.k[:, row, :, :n], cache.v[:, row, :, :n]

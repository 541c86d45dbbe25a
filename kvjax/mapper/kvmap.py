"""The map artifact as a pytree, and applying it: source cache -> target cache.

Per target layer, keys and values each get an affine low-rank map (the frozen ridge fit) plus a small residual
network whose output projection starts at zero, so a fresh residual leaves the ridge map unchanged:

    y = (x - mu) @ w_in @ w_out + bias + up(gelu(down((x - mu) / scale) + sum_c down_prev[c]((x[-1-c] - mu) / scale)))

x is the concatenation of the paired source layers' features (keys un-rotated), y the target layer's features
(keys rotated back with the target's RoPE when written into the cache). A context map (`down_prev` set) also feeds
the residual the features of the C positions before each one (x[-1-c]: the source's cache at position t-1-c; before
the first position, mu), so a target position can be given what the source knew about its neighbours (e.g. the
previous token, which a target that lost the source's previous-token layer cannot put into its keys itself). A map
without it translates each position alone.

A cross-position map (`att_*` set: the C2C / Latent Cache Flow class of translators) adds to the residual's hidden
layer a small causal attention over the source's features of every position so far:

    pre += sum_a softmax_causal(rope(z q_a) rope(z k_a)' / sqrt(d)) (z v_a) o_a,   z = (x - mu) / scale

so a target position can be given anything the source wrote anywhere before it (a per-position map computes from
one position alone; a context map from a fixed few before it). RoPE on the translator's queries and keys makes its
attention position-aware (relative), as the models' own attention is. Its output enters through `up`, which starts
at zero, so a fresh translator leaves the map unchanged. Cost: O(T^2 d) per layer and kind on top of the per-position
map's O(T F r).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from kvjax.cache import KVCache
from kvjax.kernels.map_insert import map_layer, resolve_impl
from kvjax.mapper.pairing import Pairing
from kvjax.mapper.ridge import RidgeFit
from kvjax.models.family import DecoderConfig
from kvjax.models.rope import Rope, apply_rope, rope_table, unapply_rope

ATTENTION_THETA = 10_000.0  # RoPE of the translator's own attention (its head width is its own, not a model's)
ATTENTION_BLOCK = 512  # queries per block: scores [..., heads, 512, T] bound the memory of a long prompt
from kvjax.sharding import tree_shardings


@struct.dataclass
class LinearMap:
    """One target layer, keys or values. Ridge part frozen; residual part (down, up, res_bias) trainable."""

    mu: jax.Array  # [Fx]
    scale: jax.Array  # [] input scale for the residual
    w_in: jax.Array  # [Fx, r]
    w_out: jax.Array  # [r, Fy]
    bias: jax.Array  # [Fy]
    down: jax.Array  # [Fx, h]
    res_bias: jax.Array  # [h]
    up: jax.Array  # [h, Fy], zero at init
    down_prev: jax.Array | None = None  # [C, Fx, h]: the C previous positions into the residual (a context map)
    att_q: jax.Array | None = None  # [A, Fx, d]: a cross-position map's attention (A heads of width d) ...
    att_k: jax.Array | None = None  # [A, Fx, d]
    att_v: jax.Array | None = None  # [A, Fx, d]
    att_o: jax.Array | None = None  # [A, d, h]: ... into the residual's hidden layer

    @property
    def context(self) -> int:
        """How many previous positions the residual reads (0: each position alone)."""
        return 0 if self.down_prev is None else self.down_prev.shape[0]

    @property
    def attends(self) -> bool:
        """Whether the residual attends over every position before each one (a cross-position map): it then reads
        the whole sequence so far, `before` holding all of it."""
        return self.att_q is not None

    def reach(self, start: int) -> int:
        """How many positions before a block starting at `start` the map reads (what `before` must hold)."""
        return start if self.attends else min(self.context, start)

    def __call__(self, x: jax.Array, before: jax.Array | None = None) -> jax.Array:
        """x [..., T, Fx] -> [..., T, Fy]. A context map's first positions also read `before` [..., n, Fx], the
        positions just before the block (oldest first; the last `context` of them are read); positions before
        those, and before the sequence's start (None: the block starts it), read mu. A cross-position map reads
        all of `before`, which must then hold every position from the sequence's start (`reach`)."""
        xc = x - self.mu
        y = (xc @ self.w_in) @ self.w_out + self.bias
        pre = xc @ (self.down / self.scale) + self.res_bias
        if self.context:
            c, t = self.context, x.shape[-2]
            n = 0 if before is None else min(before.shape[-2], c)
            head = [jnp.zeros(x.shape[:-2] + (c - n, x.shape[-1]), xc.dtype)]
            if n:
                head.append(before[..., before.shape[-2] - n :, :].astype(xc.dtype) - self.mu)
            padded = jnp.concatenate([*head, xc], axis=-2)  # [..., C + T, Fx]: row c + i is position i
            for j in range(c):  # position i reads position i - 1 - j = row c + i - 1 - j
                pre = pre + padded[..., c - 1 - j : c - 1 - j + t, :] @ (self.down_prev[j] / self.scale)
        if self.attends:
            seq = xc if before is None else jnp.concatenate([before.astype(xc.dtype) - self.mu, xc], axis=-2)
            pre = pre + self._attend(seq / self.scale, x.shape[-2])
        return y + jax.nn.gelu(pre) @ self.up

    def _attend(self, z: jax.Array, t: int) -> jax.Array:
        """The translator's causal attention: z [..., N, Fx] (centred, scaled) of positions 0..N-1, queries at the
        last t of them -> [..., t, h]. Queries run in blocks of ATTENTION_BLOCK (static slices)."""
        n, d = z.shape[-2], self.att_q.shape[-1]
        cos, sin = (jnp.asarray(a)[:, None, :] for a in rope_table(n, d, ATTENTION_THETA))  # [N, 1, d] host tables
        k = apply_rope(jnp.einsum("...nf,afd->...nad", z, self.att_k), cos, sin)  # [..., N, A, d]
        v = jnp.einsum("...nf,afd->...nad", z, self.att_v)
        out = []
        for lo in range(n - t, n, ATTENTION_BLOCK):
            hi = min(lo + ATTENTION_BLOCK, n)
            q = apply_rope(jnp.einsum("...nf,afd->...nad", z[..., lo:hi, :], self.att_q), cos[lo:hi], sin[lo:hi])
            s = jnp.einsum("...qad,...kad->...aqk", q, k[..., :hi, :, :]) / np.sqrt(d)
            causal = np.arange(hi)[None, :] <= np.arange(lo, hi)[:, None]  # [q, k] host constant
            p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
            o = jnp.einsum("...aqk,...kad->...qad", p, v[..., :hi, :, :])
            out.append(jnp.einsum("...qad,adh->...qh", o, self.att_o))
        return jnp.concatenate(out, axis=-2) if len(out) > 1 else out[0]


@dataclasses.dataclass(frozen=True)
class MapSpec:
    """Static description of a map: which models it joins and how (part of the jit cache key; hashable)."""

    pairing: Pairing
    source_fingerprint: str
    target_fingerprint: str
    source_rope: Rope  # each model's RoPE (scaling included): keys are un-rotated / re-rotated with it
    target_rope: Rope
    source_kv: tuple[int, int]  # (kv_heads, head_dim)
    target_kv: tuple[int, int]
    rank: int | None
    residual_rank: int


@struct.dataclass
class KVMap:
    keys: tuple[LinearMap, ...]  # one per target layer
    values: tuple[LinearMap, ...]
    spec: MapSpec = struct.field(pytree_node=False)

    @property
    def map_id(self) -> str:
        return f"{self.spec.source_fingerprint[:8]}->{self.spec.target_fingerprint[:8]}"


# The map's logical axes (kvjax.sharding.RULES names the mesh axis of each; all replicated today: ~2M floats per
# target layer and kind for 32B->8B, small next to the models)
LINEAR_MAP_AXES = LinearMap(mu=("map_in",), scale=(), w_in=("map_in", "map_rank"), w_out=("map_rank", "map_out"),
                            bias=("map_out",), down=("map_in", "map_rank"), res_bias=("map_rank",),
                            up=("map_rank", "map_out"))


def kvmap_axes(kvmap: KVMap) -> KVMap:
    """A KVMap-shaped tree of logical-axis tuples (leaves are tuples), for ``kvjax.sharding.tree_shardings``."""
    def axes(m):
        a = LINEAR_MAP_AXES if m.down_prev is None else LINEAR_MAP_AXES.replace(down_prev=(None, "map_in", "map_rank"))
        if m.attends:
            a = a.replace(att_q=(None, "map_in", None), att_k=(None, "map_in", None), att_v=(None, "map_in", None),
                          att_o=(None, None, "map_rank"))
        return a
    return kvmap.replace(keys=tuple(map(axes, kvmap.keys)), values=tuple(map(axes, kvmap.values)))


def kvmap_shardings(kvmap: KVMap, mesh: Mesh, rules=None) -> KVMap:
    """A KVMap-shaped tree of NamedShardings placing `kvmap` on `mesh` by its logical axes."""
    return tree_shardings(kvmap, kvmap_axes(kvmap), mesh, rules)


def spec_for(source: DecoderConfig, target: DecoderConfig, pairing: Pairing, rank: int | None,
             residual_rank: int) -> MapSpec:
    return MapSpec(pairing=pairing, source_fingerprint=source.fingerprint(), target_fingerprint=target.fingerprint(),
                   source_rope=source.rope, target_rope=target.rope,
                   source_kv=(source.num_kv_heads, source.head_dim), target_kv=(target.num_kv_heads, target.head_dim),
                   rank=rank, residual_rank=residual_rank)


def linear_map(fit: RidgeFit, residual_rank: int, key: jax.Array, scale: float) -> LinearMap:
    fx, fy = fit.w_in.shape[0], fit.w_out.shape[1]
    down = jax.random.normal(key, (fx, residual_rank), jnp.float32) / np.sqrt(fx)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return LinearMap(mu=f32(fit.mu), scale=f32(scale), w_in=f32(fit.w_in), w_out=f32(fit.w_out), bias=f32(fit.bias),
                     down=down, res_bias=jnp.zeros((residual_rank,), jnp.float32),
                     up=jnp.zeros((residual_rank, fy), jnp.float32))


def ridge_only(kvmap: KVMap) -> KVMap:
    """The map without its residual (every output projection `up` zeroed): exactly its frozen ridge part, e.g. to
    score a trained map against the ridge it started from."""
    strip = lambda layers: tuple(m.replace(up=jnp.zeros_like(m.up)) for m in layers)  # noqa: E731
    return kvmap.replace(keys=strip(kvmap.keys), values=strip(kvmap.values))


def widen_residual(kvmap: KVMap, residual_rank: int, key: jax.Array) -> KVMap:
    """The same map with a wider residual hidden layer: the new units start as `linear_map` starts a residual (random
    `down`, zero `up`), so the widened map computes exactly what `kvmap` does until it trains (e.g. an audio map
    continued from a text map with more room). A per-position residual only."""
    if residual_rank < kvmap.spec.residual_rank:
        raise ValueError(f"widen_residual: {residual_rank} is below the map's residual rank "
                         f"{kvmap.spec.residual_rank}; give a rank at least as large")
    extra = residual_rank - kvmap.spec.residual_rank
    layers = kvmap.keys + kvmap.values
    if any(m.context or m.attends for m in layers):
        raise ValueError("widen_residual: only a per-position residual widens (this map's residual reads context)")
    keys = jax.random.split(key, len(layers))

    def wide(m: LinearMap, k) -> LinearMap:
        fx, fy = m.down.shape[0], m.up.shape[1]
        return m.replace(down=jnp.concatenate([m.down, jax.random.normal(k, (fx, extra), jnp.float32) / np.sqrt(fx)],
                                              1),
                         res_bias=jnp.concatenate([m.res_bias, jnp.zeros((extra,), jnp.float32)]),
                         up=jnp.concatenate([m.up, jnp.zeros((extra, fy), jnp.float32)]))
    out = [wide(m, k) for m, k in zip(layers, keys)]
    n = len(kvmap.keys)
    return kvmap.replace(keys=tuple(out[:n]), values=tuple(out[n:]),
                         spec=dataclasses.replace(kvmap.spec, residual_rank=residual_rank))


def direct_map(source: DecoderConfig, target: DecoderConfig, pairing: Pairing) -> KVMap:
    """The direct-injection baseline: copy each paired source layer's K/V unchanged (keys re-rotated with the
    target's RoPE). Only defined when a pairing has one source layer and the KV shapes agree."""
    if (source.num_kv_heads, source.head_dim) != (target.num_kv_heads, target.head_dim):
        raise ValueError(f"direct injection needs equal KV shapes; source has {source.num_kv_heads} x "
                         f"{source.head_dim}, target {target.num_kv_heads} x {target.head_dim}")
    if any(len(p) != 1 for p in pairing):
        raise ValueError("direct injection takes exactly one source layer per target layer")
    f = source.num_kv_heads * source.head_dim
    eye, zeros = jnp.eye(f, dtype=jnp.float32), jnp.zeros((f,), jnp.float32)
    ident = LinearMap(mu=zeros, scale=jnp.ones((), jnp.float32), w_in=eye, w_out=eye, bias=zeros,
                      down=jnp.zeros((f, 1), jnp.float32), res_bias=jnp.zeros((1,), jnp.float32),
                      up=jnp.zeros((1, f), jnp.float32))
    layers = (ident,) * target.num_layers
    return KVMap(keys=layers, values=layers, spec=spec_for(source, target, pairing, None, 1))


def check_models(kvmap: KVMap, source: DecoderConfig, target: DecoderConfig) -> None:
    """A map is only valid for the models it was fitted on."""
    got = (source.fingerprint(), target.fingerprint())
    want = (kvmap.spec.source_fingerprint, kvmap.spec.target_fingerprint)
    if got != want:
        raise ValueError(f"this map was fitted for source/target models {want} but is applied to {got}; fit a map "
                         "for these models (kvjax.fit_map) or load the map that belongs to them")


def apply_map(kvmap: KVMap, source_cache: KVCache, capacity: int | None = None, dtype=None,
              length: int | None = None, impl: str = "xla", interpret: bool = False) -> KVCache:
    """Translate a source cache into a target cache (traceable; jit it with `length`/`capacity`/`impl` static).

    The first `length` positions (default: the whole source capacity) are mapped; rows keep their lengths. The
    result is tagged origin="mapped:<map id>" so it can never pass for a natively computed cache.
    `impl`: "xla" (jnp), "pallas" (the fused map-and-insert kernel of kvjax.kernels.map_insert, one call per target
    layer, writing that layer's own buffers; on CPU only with `interpret=True`) or "auto" (the kernel on GPU/TPU where
    it supports the shape, XLA on CPU).
    """
    t = source_cache.capacity if length is None else length
    capacity = t if capacity is None else capacity
    if capacity < t:
        raise ValueError(f"target capacity {capacity} is smaller than the {t} mapped positions")
    dtype = dtype or source_cache.dtype
    hkv, hd = kvmap.spec.target_kv
    impl = resolve_impl(impl, source_cache.head_dim, hd, t, interpret, src_len=source_cache.capacity,
                        tgt_len=capacity)
    layers = [map_layer([source_cache.keys[s] for s in paired], [source_cache.values[s] for s in paired], km, vm,
                        target_kv=(hkv, hd), capacity=capacity, dtype=dtype, length=t,
                        src_rope=kvmap.spec.source_rope, tgt_rope=kvmap.spec.target_rope, impl=impl,
                        interpret=interpret)
              for paired, km, vm in zip(kvmap.spec.pairing, kvmap.keys, kvmap.values)]
    return KVCache(keys=tuple(k for k, _ in layers), values=tuple(v for _, v in layers),
                   lengths=jnp.minimum(source_cache.lengths, t), origin=f"mapped:{kvmap.map_id}")


def map_span(kvmap: KVMap, source_cache: KVCache, target_cache: KVCache, start: jax.Array, width: int) -> KVCache:
    """Map the positions each row's source cache gained since `start` (int32 [B]: the row's length before it read
    the new tokens) into `target_cache` at the same positions: the map of a prompt read in pieces (a server's
    cached prefix, then the rest; chunked prefill). Traceable; `width` (static) bounds the new positions per row.

    Row b maps positions start[b] .. source_cache.lengths[b] - 1 and leaves the target's other positions as they
    are; the target's lengths become the source's. Each position is mapped as `apply_map` maps it (the same
    features, the same RoPE tables, the same residual), so a prompt read in pieces gets the cache it gets read
    whole, up to float rounding. A context map reads the `context` positions before the span from the source
    cache (the source keeps the prefix's own keys and values for that, and for its attention); before the
    sequence's start it reads mu, as `apply_map` does. A cross-position map reads every position so far: it maps
    them all and keeps the span's. XLA only: the Pallas map-and-insert kernel writes a span at
    one static offset for every row."""
    if target_cache.keys_transposed or source_cache.keys_transposed:
        raise ValueError("map_span reads and writes caches in the prefill layout (keys not transposed)")
    b, t_src, t_tgt = source_cache.batch_size, source_cache.capacity, target_cache.capacity
    hkv, hd = kvmap.spec.target_kv
    rows = jnp.arange(b)[:, None]

    def positions(offsets):  # [B, n] positions -> (clipped source slots, in range)
        return jnp.clip(offsets, 0, t_src - 1), (offsets >= 0) & (offsets < source_cache.lengths[:, None])

    def angles(rope, slots, head_dim):  # the host RoPE table apply_map uses, read at each row's positions
        cos, sin = rope_table(max(t_src, t_tgt), head_dim, rope)
        return jnp.asarray(cos)[slots][:, :, None], jnp.asarray(sin)[slots][:, :, None]  # [B, n, 1, hd]

    def features(buffers, paired, rope, offsets):  # [B, n, P * Hs * hds] float32, as kernels.features
        slots, _ = positions(offsets)
        out = []
        for s in paired:
            x = buffers[s][rows, :, slots].astype(jnp.float32)  # [B, n, Hs, hds]
            if rope is not None:
                x = unapply_rope(x, *angles(rope, slots, x.shape[-1]))
            out.append(x.reshape(x.shape[0], x.shape[1], -1))
        return jnp.concatenate(out, -1)

    new = start[:, None] + jnp.arange(width)[None, :]  # [B, W]
    slots, live = positions(new)
    dst = jnp.where(live, new, t_tgt)  # positions past a row's span are dropped by the scatter

    def mapped(m, buffers, paired, rope, out, out_rope):
        if m.attends:  # a cross-position map reads every position so far: map them all, keep the span's
            y = m(features(buffers, paired, rope, jnp.broadcast_to(jnp.arange(t_src), (b, t_src))))[rows, slots]
            return write(y, out, out_rope)
        x = features(buffers, paired, rope, new)
        before = None
        if m.context:
            back = start[:, None] - m.context + jnp.arange(m.context)[None, :]  # oldest first, as LinearMap reads
            before = jnp.where((back >= 0)[..., None], features(buffers, paired, rope, back), m.mu)  # mu: no token
        return write(m(x, before), out, out_rope)

    def write(y, out, out_rope):  # y [B, W, Fy] of the span's positions -> the target's buffer
        y = y.reshape(b, width, hkv, hd)  # [B, W, Ht, hdt]
        if out_rope is not None:
            y = apply_rope(y, *angles(out_rope, slots, hd))
        return out.at[rows, :, dst].set(y.astype(out.dtype), mode="drop")

    spec = kvmap.spec
    keys, values = [], []
    for paired, km, vm, k_out, v_out in zip(spec.pairing, kvmap.keys, kvmap.values, target_cache.keys,
                                            target_cache.values):
        keys.append(mapped(km, source_cache.keys, paired, spec.source_rope, k_out, spec.target_rope))
        values.append(mapped(vm, source_cache.values, paired, None, v_out, None))
    return target_cache.replace(keys=tuple(keys), values=tuple(values), lengths=source_cache.lengths,
                                origin=f"mapped:{kvmap.map_id}")

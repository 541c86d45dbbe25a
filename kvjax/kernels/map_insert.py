"""Fused cache map-and-insert: target layers' keys and values computed from the paired source layers' cache blocks
and written straight into the target cache buffers, in place.

Per target layer, batch row and block of `bt` positions (values skip both rotations):

    x   = concat over paired source layers and their heads of unrope(k_src)      [bt, Fx]  (Fx = P * Hs * hds)
    y   = (x - mu) @ w_in @ w_out + bias + gelu((x - mu) @ (down / scale) + res_bias) @ up   [bt, Fy]
    out = rope(y) per target head                                                  -> tgt[layer, b, :, pos, :]

i.e. `kvjax.mapper.kvmap.LinearMap` applied to the features of `kvjax.kernels.features` (keys un-rotated with the
source's RoPE, rotated back with the target's). The feature concatenation and the head split are never
materialised: the first projection is a sum of per-source-head matmuls, the second one matmul per target head.
RoPE angles are computed in the kernel from the block's positions (slot i of a cache holds position i).

One kernel call maps any number of target layers (grid: layers x batch x blocks; each layer's weights and source
layers are picked by the index maps), so a whole map is one call and one compile. Pieces, as in
jax/experimental/pallas/ops:
- `map_insert`: the jitted wrapper (target buffers donated and aliased to the outputs), with `backend`
  ("triton" for GPU, "mosaic_tpu" for TPU; default: the platform of the active mesh's devices, else of the default
  device) and `interpret` (on CPU: the generic interpreter for the GPU body, `pltpu.InterpretParams()` for the TPU
  body).
- `map_insert_reference`: the same operation in plain jnp, from the unpacked maps.
- `insert_layers`: the `impl="xla" | "pallas" | "auto"` switch used by apply_map and the pipelined prefill.
- kvjax.kernels.program: the kernel as a program to compile ahead of time for a TPU slice or a GPU.

The two lowerings share the kernel body; they differ in how blocks are placed, how a vector's halves are swapped
for RoPE (`pltpu.roll` on TPU, split/stack on GPU) and in their layout constraints (`check_supported`):
- Triton: blocks of `bt` slots at any slot (the last one moved back to end at `length`).
- Mosaic: blocks aligned to `bt` (tpu_block) in both caches, since Mosaic only accepts a window whose start it can
  prove is a multiple of the (8 or 16, 128) tile; the edge blocks keep the rows outside the mapped span (the
  target is read there), so any length and offset maps. A 64-wide target head (Llama-3.2-1B) computes its keys in
  128 lanes, [y | rotate_half(y)], from doubled weight columns (pack_maps), so RoPE never rotates part of a vector
  register.
Under a device mesh (jax.set_mesh) the call runs per device with the positions split over the kv heads' mesh axis
(`_sharded_call`): XLA's SPMD partitioner cannot split a Pallas call.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

from kvjax import aot, sharding
from kvjax.cache import AXES
from kvjax.kernels.features import cache_layout, content_features
from kvjax.models.rope import as_rope

BACKENDS = ("triton", "mosaic_tpu")
IMPLS = ("xla", "pallas", "auto")
DEFAULT_BLOCK = {"triton": 64, "mosaic_tpu": 256}
TPU_MIN_BLOCK = 16  # rows of a bf16 (16, 128) tile: the TPU body's blocks start at multiples of their size
Pairing = tuple[tuple[int, ...], ...]
_NEEDS_DEVICE = "Pallas kernels need a GPU or TPU; on CPU pass interpret=True (slow, for tests) or use impl='xla'"


@struct.dataclass
class PackedMap:
    """Key or value maps of n target layers in kernel layout (head-major blocks of each LinearMap's matrices)."""

    mu: jax.Array  # [n, Hin, 1, hds] f32, Hin = paired source layers x source kv heads
    w_in: jax.Array  # [n, Hin, hds, R]
    down: jax.Array  # [n, Hin, hds, H], already divided by the residual's input scale
    res_bias: jax.Array  # [n, 1, H] f32
    w_out: jax.Array  # [n, Ht, R, hdt]
    up: jax.Array  # [n, Ht, H, hdt]
    bias: jax.Array  # [n, Ht, 1, hdt] f32

    def leaves(self) -> tuple[jax.Array, ...]:
        return (self.mu, self.w_in, self.down, self.res_bias, self.w_out, self.up, self.bias)


def padded_size(n: int, backend: str | None) -> int:
    """Inner dimensions (ridge rank R, residual width H) are zero-padded for the backend (exact: the padded columns
    stay 0 through gelu): triton dots need powers of two >= 16, the TPU's lanes multiples of 128."""
    if backend == "triton":
        return max(16, 1 << (n - 1).bit_length())
    if backend == "mosaic_tpu":
        return -(-n // 128) * 128
    return n


def _pad_to(a: jax.Array, axis: int, size: int) -> jax.Array:
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, pad)


def doubles_lanes(backend: str | None, head_dim: int) -> bool:
    """Whether the keys' packed output columns carry each target head twice, [y | rotate_half(y)] (see pack_maps):
    on TPU for a head dim that is not a multiple of the 128 lanes (Llama-3.2-1B's 64), so that the kernel's RoPE
    combines two lane-aligned halves instead of rotating a part of a vector register."""
    return backend == "mosaic_tpu" and head_dim % 128 != 0


def pack_maps(maps: Sequence, in_heads: int, out_heads: int, *, dtype=jnp.float32,
              backend: str | None = None, keys: bool = False) -> PackedMap:
    """Per-target-layer `LinearMap`s (fields mu, scale, w_in, w_out, bias, down, res_bias, up; features head-major,
    as kvjax.kernels.features) -> one PackedMap stacked over the layers (traceable). `dtype`: matmul operand dtype
    (accumulation is always float32). `backend`: pad R and H as that backend's kernel needs (see padded_size).
    `keys`: the key maps, whose output the kernel rotates; where `doubles_lanes`, each target head's columns of
    w_out, up and bias are followed by their rotate_half (a signed permutation of columns: exact)."""
    shapes = {(m.w_in.shape, m.w_out.shape, m.down.shape) for m in maps}
    if len(shapes) != 1:
        raise ValueError(f"one kernel call maps layers of one shape; got maps of shapes {sorted(shapes)} (call it "
                         "once per shape)")
    (fx, r), (_, fy), (_, h) = shapes.pop()
    if fx % in_heads or fy % out_heads:
        raise ValueError(f"map of {fx} -> {fy} features does not split into {in_heads} source / {out_heads} target "
                         "heads; check the pairing and the caches' kv head counts")
    hds, hdt = fx // in_heads, fy // out_heads
    rp, hp = padded_size(r, backend), padded_size(h, backend)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    double = keys and doubles_lanes(backend, hdt)

    def heads(a):  # [rows, Ht * hdt] -> [Ht, rows, hdt] (or [Ht, rows, 2 hdt]: [a | rotate_half(a)] per head)
        a = a.reshape(a.shape[0], out_heads, hdt).transpose(1, 0, 2)
        if double:
            a = jnp.concatenate([a, -a[..., hdt // 2:], a[..., :hdt // 2]], -1)
        return a

    def one(m):
        w_in = _pad_to(f32(m.w_in), 1, rp).reshape(in_heads, hds, rp)
        down = _pad_to(f32(m.down) / f32(m.scale), 1, hp).reshape(in_heads, hds, hp)
        return PackedMap(mu=f32(m.mu).reshape(in_heads, 1, hds), w_in=w_in.astype(dtype), down=down.astype(dtype),
                         res_bias=_pad_to(f32(m.res_bias), 0, hp)[None],
                         w_out=heads(_pad_to(f32(m.w_out), 0, rp)).astype(dtype),
                         up=heads(_pad_to(f32(m.up), 0, hp)).astype(dtype), bias=heads(f32(m.bias)[None]))

    return jax.tree.map(lambda *a: jnp.stack(a), *[one(m) for m in maps])


def inv_freq_row(head_dim: int, rope) -> jax.Array:
    """[1, hd] f32: the per-lane rotary frequency of a Rope (scaling included; or a plain theta), duplicated over the
    two halves as in rope_angles."""
    inv = as_rope(rope).inv_freq(head_dim)
    return jnp.concatenate([inv, inv])[None]


# ---- the kernel ----------------------------------------------------------------------------------------------------

def _rotate_half(x: jax.Array, backend: str) -> jax.Array:
    """[..., hd] -> [-x2, x1] (the RoPE partner of each lane)."""
    half = x.shape[-1] // 2
    if backend == "mosaic_tpu":
        from jax.experimental.pallas import tpu as pltpu
        lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
        return pltpu.roll(x, half, x.ndim - 1) * jnp.where(lane < half, -1.0, 1.0).astype(x.dtype)
    a, b = jnp.split(x, 2, axis=-1)  # triton has no lane slicing or general concatenate, but split/join/trans
    return jnp.stack([-b, a], axis=-1).swapaxes(-1, -2).reshape(x.shape)


def _head(ref, h):
    """Index of head h in a block of heads: [H, bt, hd], or [G, H / G, bt, hd] (the heads split in G groups, as
    the sharded path trades them between devices)."""
    if len(ref.shape) == 3:
        return h
    return h // ref.shape[1], h % ref.shape[1]


def _kernel(*refs, n_src: int, src_heads: int, out_heads: int, bt: int, length: int, dst_offset: int,
            backend: str, first_block: int | None, masked: bool, aliased: bool):
    src_k, src_v = refs[:n_src], refs[n_src:2 * n_src]  # each [Hs, bt, hds] (or [G, Hs / G, bt, hds]: _head)
    inv_s, inv_t, shift_s, shift_t = refs[2 * n_src:2 * n_src + 4]
    kpack, vpack = refs[2 * n_src + 4:2 * n_src + 11], refs[2 * n_src + 11:2 * n_src + 18]
    old_k, old_v = refs[-4:-2] if aliased else (None, None)  # the target buffers: read for the rows `masked` keeps
    out_k, out_v = refs[-2:]  # [Ht, bt, hdt] (or [G, Ht / G, bt, hdt])

    if first_block is None:  # blocks at any slot: the last one ends at `length` (it rewrites rows it overlaps)
        start = dst_offset + jnp.minimum(pl.program_id(2) * bt, length - bt)
    else:  # blocks aligned to bt: the edge blocks keep the rows outside dst_offset .. dst_offset + length
        start = (first_block + pl.program_id(2)) * bt

    def angles(inv_ref, shift_ref):  # the rows' positions: their target slots, plus `shift` (see _sharded)
        pos = (jax.lax.broadcasted_iota(jnp.int32, (bt, inv_ref.shape[1]), 0) + start).astype(jnp.float32)
        ang = (pos + shift_ref[...]) * inv_ref[...]
        return jnp.cos(ang), jnp.sin(ang)

    cos_s, sin_s = angles(inv_s, shift_s)
    cos_t, sin_t = angles(inv_t, shift_t)

    def project(srcs, pack, old, out, keys: bool):
        mu, w_in, down, res_bias, w_out, up, bias = pack
        wdt = w_in.dtype
        z = (jnp.zeros((bt, w_in.shape[2]), jnp.float32),  # ridge low-rank code
             jnp.zeros((bt, down.shape[2]), jnp.float32))  # residual pre-activation
        for p, ref in enumerate(srcs):  # loops over heads stay loops (compile time), over layers unrolled

            def source_head(h, z, p=p, ref=ref):
                j = p * src_heads + h
                x = ref[_head(ref, h)].astype(jnp.float32)  # [bt, hds]
                if keys:
                    x = x * cos_s - _rotate_half(x, backend) * sin_s  # RoPE by the negative angle
                xc = (x - mu[j]).astype(wdt)
                return (z[0] + jnp.dot(xc, w_in[j], preferred_element_type=jnp.float32),
                        z[1] + jnp.dot(xc, down[j], preferred_element_type=jnp.float32))

            z = jax.lax.fori_loop(0, src_heads, source_head, z)
        zl = z[0].astype(wdt)
        a = jax.nn.gelu(z[1] + res_bias[...]).astype(wdt)  # LinearMap's gelu (tanh approximation)

        def target_head(g, carry):
            y = (jnp.dot(zl, w_out[g], preferred_element_type=jnp.float32)
                 + jnp.dot(a, up[g], preferred_element_type=jnp.float32) + bias[g])  # [bt, hdt] (or 2 hdt)
            if keys and y.shape[-1] != out.shape[-1]:  # [y | rotate_half(y)] (pack_maps, doubles_lanes)
                from jax.experimental.pallas import tpu as pltpu
                y = (y * cos_t + pltpu.roll(y, out.shape[-1], 1) * sin_t)[:, :out.shape[-1]]
            elif keys:
                y = y * cos_t + _rotate_half(y, backend) * sin_t
            if masked:
                slot = jax.lax.broadcasted_iota(jnp.int32, y.shape, 0) + start
                keep = (slot >= dst_offset) & (slot < dst_offset + length)
                y = jnp.where(keep, y, old[_head(old, g)].astype(jnp.float32))
            out[_head(out, g)] = y.astype(out.dtype)
            return carry

        jax.lax.fori_loop(0, out_heads, target_head, 0)

    project(src_k, kpack, old_k, out_k, keys=True)
    project(src_v, vpack, old_v, out_v, keys=False)


def check_supported(backend: str, src_head_dim: int, tgt_head_dim: int, length: int, *, src_offset: int = 0,
                    dst_offset: int = 0, src_len: int | None = None, tgt_len: int | None = None,
                    block_t: int | None = None) -> str | None:
    """Why the compiled kernel cannot run this shape on `backend` (None when it can). Interpret mode runs any.
    src_len / tgt_len: the caches' slot counts (None: not checked)."""
    if backend == "triton":
        pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
        if not (pow2(src_head_dim) and pow2(tgt_head_dim) and min(src_head_dim, tgt_head_dim) >= 16):
            return f"the triton kernel needs power-of-two head dims >= 16, got {src_head_dim} and {tgt_head_dim}"
        if length < 16:
            return f"the triton kernel needs >= 16 positions per call, got {length}"
    elif backend == "mosaic_tpu":
        if src_head_dim % 128 or tgt_head_dim % 64:
            return (f"the TPU kernel needs a source head dim that is a multiple of 128 and a target head dim that is "
                    f"a multiple of 64, got {src_head_dim} and {tgt_head_dim}")
        if tpu_block(length, src_offset, dst_offset, src_len, tgt_len, block_t) < TPU_MIN_BLOCK:
            return (f"the TPU kernel reads and writes blocks of >= {TPU_MIN_BLOCK} slots aligned in both caches: "
                    f"src_offset - dst_offset ({src_offset - dst_offset}) and the caches' slot counts ({src_len} "
                    f"and {tgt_len}) must be multiples of {TPU_MIN_BLOCK}")
    else:
        return f"unknown Pallas backend {backend!r}; use one of {BACKENDS}"
    return None


def platform_backend() -> str | None:
    """The Pallas backend ("triton" on GPU, "mosaic_tpu" on TPU, None on CPU) of the devices the program is built
    for: the active mesh's (jax.set_mesh: a TPU slice's devices compile from a CPU process) or the default device's."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "mosaic_tpu"}.get(platform)


def _lookup(table: tuple[int, ...], i):
    """table[i] for a traced scalar i, as scalar selects (index maps cannot read constant arrays)."""
    if len(set(table)) == 1:
        return table[0]
    steps = {b - a for a, b in zip(table, table[1:])}
    if len(steps) == 1:
        return table[0] + steps.pop() * i
    out = jnp.int32(table[0])
    for j, v in enumerate(table[1:], 1):
        out = jnp.where(i == j, v, out)
    return out


def _check_shapes(src_k, src_v, pairing, tgt_k, tgt_v, kpack, vpack, tgt_layers, length, src_offset, dst_offset):
    n_src = len(pairing[0])
    if not pairing or any(len(p) != n_src for p in pairing) or len(pairing) != len(tgt_layers):
        raise ValueError(f"one tuple of source layers, all of one length, per mapped target layer: got "
                         f"pairing={pairing} for tgt_layers={tgt_layers}")
    if len(src_k) != n_src or len(src_v) != n_src:
        raise ValueError(f"one source K and V array per pairing position: got {len(src_k)} K, {len(src_v)} V arrays "
                         f"for {n_src} source layers per target layer")
    _, b, hs, ts, hds = src_k[0].shape
    for p, a in enumerate(tuple(src_k) + tuple(src_v)):
        layers = [pl_[p % n_src] for pl_ in pairing]
        if a.ndim != 5 or a.shape[1:] != (b, hs, ts, hds) or min(layers) < 0 or max(layers) >= a.shape[0]:
            raise ValueError(f"source blocks must be [L, B, Hkv, T, hd] arrays of one shape with the paired layers "
                             f"inside L; got {a.shape} for layers {layers} (expected [*, {b}, {hs}, {ts}, {hds}])")
    if tgt_k.shape != tgt_v.shape or tgt_k.ndim != 5 or tgt_k.shape[1] != b:
        raise ValueError(f"target buffers must be [L, B, Hkv, T, hd] of one shape with batch {b}; got "
                         f"{tgt_k.shape} and {tgt_v.shape}")
    _, _, ht, tt, hdt = tgt_k.shape
    want = (len(tgt_layers), n_src * hs, hds, ht, hdt)
    for name, pack in (("keys", kpack), ("values", vpack)):
        got = (*pack.w_in.shape[:3], pack.w_out.shape[1], pack.w_out.shape[3])
        if name == "keys" and got[-1] == 2 * hdt:  # doubled lanes (pack_maps: doubles_lanes)
            got = (*got[:-1], hdt)
        if got != want:
            raise ValueError(f"{name} packed as (layers, in heads, hd, out heads, hd) {got}, but the caches need "
                             f"{want}; pack with pack_maps(maps, {n_src * hs}, {ht})")
    if min(tgt_layers) < 0 or max(tgt_layers) >= tgt_k.shape[0]:
        raise ValueError(f"tgt_layers {tgt_layers} outside the target's {tgt_k.shape[0]} layers")
    if length < 1 or src_offset < 0 or dst_offset < 0 or src_offset + length > ts or dst_offset + length > tt:
        raise ValueError(f"cannot map {length} positions from source slot {src_offset} (of {ts}) into target slot "
                         f"{dst_offset} (of {tt})")
    if hds % 2 or hdt % 2:
        raise ValueError(f"head dims must be even for RoPE, got {hds} and {hdt}")


def tpu_block(length: int, src_offset: int = 0, dst_offset: int = 0, src_len: int | None = None,
              tgt_len: int | None = None, block_t: int | None = None) -> int:
    """The TPU body's block of positions: a power of two <= block_t (default DEFAULT_BLOCK), no larger than the
    positions need (>= 16), dividing src_offset - dst_offset and the caches' slot counts, so that the source's and
    the target's blocks all start at multiples of it inside the caches (Mosaic only accepts windows it can prove
    tile-aligned, and blocks that divide the cache need no ragged last block)."""
    bt = 1 << ((block_t or DEFAULT_BLOCK["mosaic_tpu"]).bit_length() - 1)
    bt = min(bt, max(16, 1 << (length - 1).bit_length()))
    while (src_offset - dst_offset) % bt or any(n % bt for n in (src_len, tgt_len) if n):
        bt //= 2
    return bt


def map_insert_call(src_k, src_v, tgt_k, tgt_v, kpack: PackedMap, vpack: PackedMap, *, pairing: Pairing,
                    tgt_layers: tuple[int, ...], length: int, src_rope, tgt_rope,
                    src_offset: int = 0, dst_offset: int = 0, block_t: int | None = None,
                    backend: str | None = None, interpret: bool = False):
    """Traceable body of `map_insert`: use it inside other jitted functions (the buffers are updated in place when
    the outermost jit donates them). Under a device mesh (jax.set_mesh) it runs per device (see `_sharded_call`)."""
    src_k = (src_k,) * len(pairing[0]) if isinstance(src_k, jax.Array) else tuple(src_k)
    src_v = (src_v,) * len(pairing[0]) if isinstance(src_v, jax.Array) else tuple(src_v)
    pairing, tgt_layers = tuple(tuple(int(s) for s in p) for p in pairing), tuple(int(t) for t in tgt_layers)
    _check_shapes(src_k, src_v, pairing, tgt_k, tgt_v, kpack, vpack, tgt_layers, length, src_offset, dst_offset)
    backend = backend or platform_backend()
    if backend is None:
        if not interpret:
            raise ValueError(_NEEDS_DEVICE)
        backend = "triton"
    if backend not in BACKENDS:
        raise ValueError(f"unknown Pallas backend {backend!r}; use one of {BACKENDS}")
    args = dict(pairing=pairing, tgt_layers=tgt_layers, length=length, src_rope=src_rope, tgt_rope=tgt_rope,
                src_offset=src_offset, dst_offset=dst_offset, block_t=block_t, backend=backend, interpret=interpret)
    mesh = _sharding_mesh()
    if mesh is not None:
        return _sharded_call(src_k, src_v, tgt_k, tgt_v, kpack, vpack, mesh=mesh, **args)
    return _kernel_call(src_k, src_v, tgt_k, tgt_v, kpack, vpack, **args)


def _sharding_mesh():
    """The active mesh (jax.set_mesh) when it has several devices and its axes are not already manual (inside a
    shard_map): the caches are then sharded by it and the call runs per device."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh if not mesh.empty and mesh.size > 1 and not mesh.manual_axes else None


def _sharded_call(src_k, src_v, tgt_k, tgt_v, kpack, vpack, *, mesh, pairing, tgt_layers, length, src_offset,
                  dst_offset, **kernel_args):
    """The kernel on caches sharded by the mesh rules (kvjax.sharding.RULES: batch over 'data', kv heads over
    'model'), which XLA's SPMD partitioner cannot split for a Pallas call (Mosaic refuses: "cannot be
    automatically partitioned"). Each device of the 'model' axis (M devices) maps every target head for 1/M of
    the positions: the paired source layers' window is traded from a slice of the heads for a slice of the
    positions (one all-to-all per kind; a source whose heads the axis does not divide is whole on every device and
    is sliced instead), the kernel maps that slice of positions (RoPE from pos_shift, the slice's first position),
    and a second all-to-all trades the mapped positions back for the device's own target heads (an all-gather
    where the target's heads are not split), written into the target in place.

    Why not gather the source heads and map only the device's own target heads: that moves all of the source
    window to every device (this moves (S + T) / M of the window bytes S, T per device) and runs the whole first
    projection, the map's larger matmul, on every device (this runs 1/M of it). The windows are laid out with the
    traded axis leading ([M, layers, B, heads / M, positions / M, hd], the kernel's grouped-heads layout: _dims),
    so the all-to-alls need no relayout. Positions per device are rounded up to a multiple of 16 (TPU blocks)."""
    rules = {k: (v if v in mesh.axis_names else None) for k, v in sharding.RULES.items()}
    spec = lambda a: sharding.spec_for(AXES, a.shape, mesh, rules)  # noqa: E731
    axis = rules["kv_heads"]
    m = mesh.shape[axis] if axis else 1
    n_src, n_t = len(pairing[0]), len(tgt_layers)
    if m == 1:  # batch rows split only: each device maps its rows
        body = functools.partial(_kernel_call, pairing=pairing, tgt_layers=tgt_layers, length=length,
                                 src_offset=src_offset, dst_offset=dst_offset, **kernel_args)
        rep = jax.tree.map(lambda _: P(), kpack)
        specs = (tuple(map(spec, src_k)), tuple(map(spec, src_v)), spec(tgt_k), spec(tgt_v), rep, rep)
        return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(spec(tgt_k), spec(tgt_v)),
                             check_vma=False)(src_k, src_v, tgt_k, tgt_v, kpack, vpack)

    per = TPU_MIN_BLOCK * -(-length // (TPU_MIN_BLOCK * m))  # positions per device
    # the distinct source arrays (map_layer passes one per pairing position) and the layers read from each: every
    # layer read is traded once, in one window per kind
    same = lambda p, q: src_k[p] is src_k[q] and src_v[p] is src_v[q]  # noqa: E731
    arrays = [p for p in range(n_src) if not any(same(p, q) for q in range(p))]
    owner = [next(j for j in arrays if same(j, p)) for p in range(n_src)]
    reads = {j: sorted({pr[p] for pr in pairing for p in range(n_src) if owner[p] == j}) for j in arrays}
    slot = {}
    for j in arrays:
        for s in reads[j]:
            slot[(j, s)] = len(slot)
    local_pairing = tuple(tuple(slot[(owner[p], pr[p])] for p in range(n_src)) for pr in pairing)
    src_split, tgt_split = spec(src_k[0])[2] == axis, spec(tgt_k)[2] == axis

    def window(parts, split, me):  # -> [G, n, B, Hs / G, per, hds]: my positions of every read layer's heads
        xs = []
        for a, layers in parts:
            lo = layers[0]
            x = a[lo:lo + len(layers)] if layers == list(range(lo, lo + len(layers))) else \
                jnp.take(a, np.asarray(layers), axis=0)
            xs.append(x[:, :, :, src_offset:src_offset + length])
        x = jnp.pad(jnp.concatenate(xs) if len(xs) > 1 else xs[0], [(0, 0)] * 3 + [(0, m * per - length), (0, 0)])
        n, b, h, _, hd = x.shape
        x = x.reshape(n, b, h, m, per, hd)
        if split:  # trade my heads' positions for my positions of every device's heads
            return jax.lax.all_to_all(jnp.moveaxis(x, 3, 0), axis, 0, 0, tiled=True)
        return jnp.moveaxis(jax.lax.dynamic_slice_in_dim(x, me, 1, 3), 3, 0)

    def body(srcs_k, srcs_v, tgt_k, tgt_v, kpack, vpack):
        me = jax.lax.axis_index(axis)
        wk = window([(a, reads[j]) for a, j in zip(srcs_k, arrays)], src_split, me)
        wv = window([(a, reads[j]) for a, j in zip(srcs_v, arrays)], src_split, me)
        groups = m if tgt_split else 1
        fresh = lambda t: jax.ShapeDtypeStruct((groups, n_t, t.shape[1], t.shape[2], per, t.shape[4]),  # noqa
                                               t.dtype)
        ys = _kernel_call((wk,) * n_src, (wv,) * n_src, fresh(tgt_k), fresh(tgt_v), kpack, vpack,
                          pairing=local_pairing, tgt_layers=tuple(range(n_t)), length=per, src_offset=0,
                          dst_offset=0, pos_shift=dst_offset + me * per, **kernel_args)
        out = []
        for y, tgt in zip(ys, (tgt_k, tgt_v)):
            if tgt_split:  # my positions of every device's heads -> every position of my heads
                y = jax.lax.all_to_all(y, axis, 0, 0, tiled=True)
            else:
                y = jax.lax.all_gather(y[0], axis, axis=0)
            _, _, b, h, _, hd = y.shape
            y = jnp.moveaxis(y, 0, 3).reshape(n_t, b, h, m * per, hd)[:, :, :, :length]
            if tgt_layers == tuple(range(tgt_layers[0], tgt_layers[0] + n_t)):
                tgt = jax.lax.dynamic_update_slice(tgt, y, (tgt_layers[0], 0, 0, dst_offset, 0))
            else:
                for j, t in enumerate(tgt_layers):
                    tgt = jax.lax.dynamic_update_slice(tgt, y[j:j + 1], (t, 0, 0, dst_offset, 0))
            out.append(tgt)
        return tuple(out)

    srcs_k, srcs_v = tuple(src_k[j] for j in arrays), tuple(src_v[j] for j in arrays)
    rep = jax.tree.map(lambda _: P(), kpack)
    specs = (tuple(map(spec, srcs_k)), tuple(map(spec, srcs_v)), spec(tgt_k), spec(tgt_v), rep, rep)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(spec(tgt_k), spec(tgt_v)),
                         check_vma=False)(srcs_k, srcs_v, tgt_k, tgt_v, kpack, vpack)


def _kernel_call(src_k, src_v, tgt_k, tgt_v, kpack, vpack, *, pairing, tgt_layers, length, src_rope, tgt_rope,
                 src_offset, dst_offset, block_t, backend, interpret, pos_shift=None):
    """The pallas_call on whole (or per-device) buffers. `pos_shift` (a traced scalar, default 0) is added to every
    row's position for RoPE: slot j then holds position pos_shift + j. tgt_k / tgt_v given as ShapeDtypeStructs:
    new buffers that the call fills whole (nothing to insert into)."""
    aliased = isinstance(tgt_k, jax.Array)
    n_src, (b, hs, ts, hds), (_, ht, tt, hdt) = len(pairing[0]), _dims(src_k[0]), _dims(tgt_k)
    if not interpret and (why := check_supported(backend, hds, hdt, length, src_offset=src_offset,
                                                 dst_offset=dst_offset, src_len=ts, tgt_len=tt, block_t=block_t)):
        raise ValueError(f"{why}; use impl='xla' (or impl='auto', which falls back to it) for this shape")
    shift = jnp.zeros((), jnp.float32) if pos_shift is None else jnp.asarray(pos_shift).astype(jnp.float32)
    kw = kpack.w_out.shape[3]  # the keys' output lanes: hdt, or 2 hdt where pack_maps doubled them
    if kw != hdt and backend != "mosaic_tpu":
        raise ValueError(f"keys packed with doubled lanes ({kw} for head dim {hdt}) are for the mosaic_tpu body; "
                         f"pack with pack_maps(..., backend={backend!r}, keys=True)")
    inv_t = inv_freq_row(hdt, tgt_rope)
    rows = (inv_freq_row(hds, src_rope), inv_t if kw == hdt else jnp.concatenate([inv_t, inv_t], 1),
            jnp.full((1, hds), shift), jnp.full((1, kw), shift))
    weights = kpack.leaves() + vpack.leaves()
    row_spec = lambda a: pl.BlockSpec(a.shape, lambda l, bi, i: (0, 0))  # noqa: E731
    layer_spec = lambda a, **kw: pl.BlockSpec(  # noqa: E731
        (None, *a.shape[1:]), lambda l, bi, i, n=a.ndim: (l,) + (0,) * (n - 1), **kw)
    src_layers = [tuple(pr[p] for pr in pairing) for p in range(n_src)]
    tgt_layer = lambda l: _lookup(tgt_layers, l)  # noqa: E731

    if backend == "mosaic_tpu":
        # Blocks aligned to bt in both caches (Mosaic proves tile alignment from the index maps). The target's
        # first and last block may hold rows outside dst_offset .. dst_offset + length: the aliased target buffer
        # is then an input blocked like the output, whose index stays on the first block until the last step, so
        # the pipeline reads the two edge blocks once (it skips a copy when a block index repeats) and the kernel
        # keeps their outside rows.
        from jax.experimental.pallas import tpu as pltpu
        bt = tpu_block(length, src_offset, dst_offset, ts, tt, block_t)
        first = dst_offset // bt
        nb = -(-(dst_offset + length) // bt) - first
        masked = bool(dst_offset % bt or (dst_offset + length) % bt)
        step = (src_offset - dst_offset) // bt
        src_spec = lambda p: _block(  # noqa: E731
            src_k[0], bt, lambda l, p=p: _lookup(src_layers[p], l), lambda i: first + step + i)
        out_spec = _block(tgt_k, bt, tgt_layer, lambda i: first + i)
        if masked:
            alias_spec = _block(tgt_k, bt, tgt_layer, lambda i: first + jnp.where(i == nb - 1, nb - 1, 0))
        else:
            alias_spec = pl.BlockSpec(memory_space=pl.ANY)
        w_specs = [layer_spec(w, pipeline_mode=pl.Buffered(1)) for w in weights]  # change once per layer
        block_bytes = bt * (n_src * hs * hds * src_k[0].dtype.itemsize + (1 + masked) * ht * hdt * tgt_k.dtype.itemsize)
        layer_bytes = sum(_vmem_bytes(w.shape[1:], w.dtype) for w in weights)
        temp_bytes = 4 * bt * (8 * max(hds, hdt) + 2 * (kpack.w_in.shape[3] + kpack.down.shape[3]))
        vmem = 2 * 2 * block_bytes + layer_bytes + temp_bytes  # K and V blocks, double-buffered
        params = pltpu.CompilerParams(dimension_semantics=("parallel",) * 3,
                                      vmem_limit_bytes=int(min(100 << 20, max(32 << 20, 1.5 * vmem))))
        interpret_arg = pltpu.InterpretParams() if interpret else False
        first_block, edge_bytes = first, 2 * masked * min(2, nb) * ht * bt * hdt * tgt_k.dtype.itemsize
    else:
        # blocks at any slot (Triton needs no alignment); the last one is moved back to end at `length`, and
        # rewrites rows of the one before it with the same values
        bt = max(1, min(block_t or DEFAULT_BLOCK[backend], 1 << (length.bit_length() - 1)))  # power of two <= length
        nb, masked, first_block, edge_bytes = pl.cdiv(length, bt), False, None, 0
        block_start = lambda i: jnp.minimum(i * bt, length - bt)  # noqa: E731
        src_spec = lambda p: _block(  # noqa: E731
            src_k[0], bt, lambda l, p=p: _lookup(src_layers[p], l), lambda i: src_offset + block_start(i), True)
        out_spec = _block(tgt_k, bt, tgt_layer, lambda i: dst_offset + block_start(i), True)
        from jax.experimental.pallas import triton as pltr
        w_specs = [layer_spec(w) for w in weights]
        alias_spec = out_spec  # triton passes pointers: an aliased input the kernel never loads costs nothing
        params = pltr.CompilerParams(num_warps=8, num_stages=1)
        interpret_arg = bool(interpret)
    grid = (len(tgt_layers), b, nb)

    r, h = kpack.w_in.shape[3], kpack.down.shape[3]
    n_tok = len(tgt_layers) * b * length
    io = 2 * n_tok * (n_src * hs * hds * src_k[0].dtype.itemsize + ht * hdt * tgt_k.dtype.itemsize)
    cost = pl.CostEstimate(flops=2 * n_tok * (r + h) * (2 * n_src * hs * hds + ht * (kw + hdt)),
                           transcendentals=n_tok * (2 * hds + 2 * hdt + 2 * h),
                           bytes_accessed=io + len(tgt_layers) * b * edge_bytes + sum(w.nbytes for w in weights))
    if not aliased and (masked or length != tt):
        raise ValueError(f"new target buffers of {tt} slots must be written whole (length {length})")
    kernel = functools.partial(_kernel, n_src=n_src, src_heads=hs, out_heads=ht, bt=bt, length=length,
                               dst_offset=dst_offset, backend=backend, first_block=first_block, masked=masked,
                               aliased=aliased)
    n_in = 2 * n_src + len(rows) + len(weights)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(tgt_k.shape, tgt_k.dtype), jax.ShapeDtypeStruct(tgt_v.shape, tgt_v.dtype)),
        grid=grid,
        in_specs=[src_spec(p) for p in range(n_src)] * 2 + [row_spec(a) for a in rows] + w_specs
        + [alias_spec, alias_spec] * aliased,
        out_specs=(out_spec, out_spec),
        input_output_aliases={n_in: 0, n_in + 1: 1} if aliased else {},
        compiler_params=params,
        cost_estimate=cost,
        interpret=interpret_arg,
        name="map_insert",
    )(*src_k, *src_v, *rows, *weights, *((tgt_k, tgt_v) if aliased else ()))


def _dims(a) -> tuple[int, int, int, int]:
    """(batch, heads, slots, head dim) of a cache [L, B, H, T, hd] or [G, L, B, H / G, T, hd] (heads in groups)."""
    if a.ndim == 5:
        return a.shape[1], a.shape[2], a.shape[3], a.shape[4]
    return a.shape[2], a.shape[0] * a.shape[3], a.shape[4], a.shape[5]


def _block(a, bt: int, layer, slot, element: bool = False) -> pl.BlockSpec:
    """One layer's and batch row's heads x bt slots x head dim of cache `a` (either layout of _dims): layer(l) is
    the grid's layer l's, slot(i) the grid's block i's index in blocks of bt (`element`: its first slot)."""
    e = pl.Element if element else (lambda n: n)
    if a.ndim == 5:
        return pl.BlockSpec((None, None, e(a.shape[2]), e(bt), e(a.shape[4])),
                            lambda l, bi, i: (layer(l), bi, 0, slot(i), 0))
    return pl.BlockSpec((e(a.shape[0]), None, None, e(a.shape[3]), e(bt), e(a.shape[5])),
                        lambda l, bi, i: (0, layer(l), bi, 0, slot(i), 0))


def _vmem_bytes(shape, dtype) -> int:
    """Bytes of a VMEM buffer: its last two dims padded to the TPU's (8 x packing, 128) tiles."""
    *lead, rows, lanes = (1, *shape) if len(shape) == 1 else shape
    pack = max(1, 4 // jnp.dtype(dtype).itemsize)
    n = -(-rows // (8 * pack)) * 8 * pack * -(-lanes // 128) * 128
    for d in lead:
        n *= d
    return n * jnp.dtype(dtype).itemsize


_STATIC = ("pairing", "tgt_layers", "length", "src_rope", "tgt_rope", "src_offset", "dst_offset", "block_t",
           "backend", "interpret")
map_insert_jit = aot.jit(map_insert_call, donate_argnames=("tgt_k", "tgt_v"), static_argnames=_STATIC)


def map_insert(src_k, src_v, tgt_k, tgt_v, kpack: PackedMap, vpack: PackedMap, *, pairing, tgt_layers,
               length: int, src_rope, tgt_rope, src_offset: int = 0, dst_offset: int = 0,
               block_t: int | None = None, backend: str | None = None, interpret: bool = False):
    """Map target layers `tgt_layers` in one kernel call: layer tgt_layers[j] reads source layers pairing[j]
    (position p of that tuple indexes src_k[p] / src_v[p]; pass one array to use it for every p), `length`
    positions from slot `src_offset`, and writes the mapped keys (with the target's RoPE) and values into
    tgt_k / tgt_v at slots `dst_offset ...`. Slot dst_offset + j holds position dst_offset + j in both models.

    src_k, src_v: [Ls, B, Hs, Ts, hds] (keys post-RoPE); tgt_k, tgt_v: [Lt, B, Ht, Tt, hdt], donated: use the
    returned (tgt_k, tgt_v). kpack, vpack: pack_maps(maps of tgt_layers, P * Hs, Ht, backend=...). `backend`
    defaults to the platform's; `interpret` runs on CPU (the TPU body under pltpu.InterpretParams when
    backend="mosaic_tpu")."""
    return map_insert_jit(src_k, src_v, tgt_k, tgt_v, kpack, vpack,
                           pairing=tuple(tuple(int(s) for s in p) for p in pairing),
                           tgt_layers=tuple(int(t) for t in tgt_layers), length=int(length),
                           src_rope=as_rope(src_rope), tgt_rope=as_rope(tgt_rope), src_offset=int(src_offset),
                           dst_offset=int(dst_offset), block_t=block_t, backend=backend, interpret=bool(interpret))


# ---- reference and the impl switch ---------------------------------------------------------------------------------

def map_insert_reference(src_k, src_v, tgt_k, tgt_v, keys: Sequence, values: Sequence, *, pairing,
                         tgt_layers, length: int, src_rope, tgt_rope, src_offset: int = 0,
                         dst_offset: int = 0):
    """Plain-jnp `map_insert` from the unpacked per-layer maps (callables [..., Fx] -> [..., Fy], e.g. LinearMap):
    kvjax.kernels.features and LinearMap, written into the target buffers with dynamic_update_slice. This is the
    library's one XLA map: apply_map and the pipelined path run it, and the kernel is tested against it."""
    n_src = len(pairing[0])
    src_k = (src_k,) * n_src if isinstance(src_k, jax.Array) else tuple(src_k)
    src_v = (src_v,) * n_src if isinstance(src_v, jax.Array) else tuple(src_v)

    def features(arrays, layers, rope, back=0):  # [B, back + n, P*Hs*hds]: from `back` positions before the block
        return jnp.concatenate([content_features(a[layer, :, :, src_offset - back:src_offset + length], rope,
                                                 dst_offset - back) for a, layer in zip(arrays, layers)], -1)

    def mapped(m, arrays, layers, rope):
        # a context map (LinearMap.down_prev) also reads the positions before a block that does not start at 0, a
        # cross-position map (LinearMap.att_*) all of them
        back = m.reach(src_offset) if hasattr(m, "reach") else 0
        if back == 0:
            return m(features(arrays, layers, rope))
        x = features(arrays, layers, rope, back)
        return m(x[:, back:], x[:, :back])

    for layers, t, km, vm in zip(pairing, tgt_layers, keys, values):
        yk = cache_layout(mapped(km, src_k, layers, src_rope), tgt_k.shape[2], tgt_rope, dst_offset)
        yv = cache_layout(mapped(vm, src_v, layers, None), tgt_v.shape[2], None, dst_offset)
        tgt_k = jax.lax.dynamic_update_slice(tgt_k, yk.astype(tgt_k.dtype)[None], (t, 0, 0, dst_offset, 0))
        tgt_v = jax.lax.dynamic_update_slice(tgt_v, yv.astype(tgt_v.dtype)[None], (t, 0, 0, dst_offset, 0))
    return tgt_k, tgt_v


def resolve_impl(impl: str, src_head_dim: int | None = None, tgt_head_dim: int | None = None,
                 length: int | None = None, interpret: bool = False, **placement) -> str:
    """"xla" | "pallas" | "auto" -> "xla" or "pallas". auto: the kernel on GPU/TPU where it supports the shape,
    XLA on CPU; with `interpret`, the kernel everywhere. `placement`: check_supported's src_offset, dst_offset,
    src_len, tgt_len (on a sharded cache the kernel maps copied windows, where they do not matter)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    if interpret:
        return "pallas"
    backend = platform_backend()
    if backend is None:
        return "xla"
    if _sharding_mesh() is not None:
        placement = {}
    if None not in (src_head_dim, tgt_head_dim, length) and check_supported(backend, src_head_dim, tgt_head_dim,
                                                                            length, **placement):
        return "xla"
    return "pallas"


def insert_layers(src_k, src_v, tgt_k, tgt_v, keys: Sequence, values: Sequence, *, pairing, tgt_layers,
                  length: int, src_rope, tgt_rope, impl: str = "auto", weight_dtype=jnp.float32,
                  src_offset: int = 0, dst_offset: int = 0, block_t: int | None = None,
                  backend: str | None = None, interpret: bool = False):
    """`map_insert` (impl "pallas"), `map_insert_reference` (impl "xla") or the platform's choice ("auto"), from
    unpacked per-layer maps (traceable). Returns (tgt_k, tgt_v)."""
    src0 = src_k if isinstance(src_k, jax.Array) else src_k[0]
    if any(getattr(m, "context", 0) or getattr(m, "attends", False) for m in (*keys, *values)):
        # the kernel maps each position alone; a context map (LinearMap.down_prev) or a cross-position map
        # (LinearMap.att_*) runs the XLA map
        if impl == "pallas":
            raise ValueError("the Pallas map-and-insert kernel maps each position alone and this is a context map "
                             "or a cross-position map (residual.context > 0 or residual.attention_heads > 0); use "
                             "impl='xla' or 'auto'")
        impl = "xla"
    impl = resolve_impl(impl, src0.shape[4], tgt_k.shape[4], length, interpret, src_offset=src_offset,
                        dst_offset=dst_offset, src_len=src0.shape[3], tgt_len=tgt_k.shape[3])
    args = dict(pairing=tuple(tuple(p) for p in pairing), tgt_layers=tuple(tgt_layers), length=length,
                src_rope=src_rope, tgt_rope=tgt_rope, src_offset=src_offset, dst_offset=dst_offset)
    if impl == "xla":
        return map_insert_reference(src_k, src_v, tgt_k, tgt_v, keys, values, **args)
    backend = backend or platform_backend() or ("triton" if interpret else None)
    if backend is None:
        raise ValueError(_NEEDS_DEVICE)
    groups: dict[tuple, list[int]] = {}  # one kernel call per (pairing width, map shapes)
    for j, (p, km, vm) in enumerate(zip(args.pop("pairing"), keys, values)):
        groups.setdefault((len(p), km.w_in.shape, km.down.shape, vm.w_in.shape, vm.down.shape), []).append(j)
    layers = args.pop("tgt_layers")
    for (width, *_), js in groups.items():
        pack = functools.partial(pack_maps, in_heads=width * src0.shape[2], out_heads=tgt_k.shape[2],
                                 dtype=weight_dtype, backend=backend)
        tgt_k, tgt_v = map_insert_call(src_k, src_v, tgt_k, tgt_v, pack([keys[j] for j in js], keys=True),
                                       pack([values[j] for j in js]), pairing=tuple(tuple(pairing[j]) for j in js),
                                       tgt_layers=tuple(layers[j] for j in js), block_t=block_t, backend=backend,
                                       interpret=interpret, **args)
    return tgt_k, tgt_v


def map_layer(src_k: Sequence, src_v: Sequence, kmap, vmap, *, target_kv: tuple[int, int], capacity: int, dtype,
              length: int, src_rope, tgt_rope, impl: str = "auto", block_t: int | None = None,
              interpret: bool = False):
    """One target layer of a per-layer cache (kvjax.cache.KVCache): the buffers of its paired source layers
    (src_k / src_v: one [B, Hs, Ts, hds] array each, in pairing order) through the layer's maps into fresh
    [B, Ht, capacity, hdt] buffers, zero past `length` (target_kv = (Ht, hdt)). Returns (k, v). Traceable:
    `insert_layers` over [1, ...] views of the buffers, which cost no copy."""
    hkv, hd = target_kv
    shape = (1, src_k[0].shape[0], hkv, capacity, hd)
    k, v = insert_layers(tuple(a[None] for a in src_k), tuple(a[None] for a in src_v), jnp.zeros(shape, dtype),
                         jnp.zeros(shape, dtype), (kmap,), (vmap,), pairing=((0,) * len(src_k),), tgt_layers=(0,),
                         length=length, src_rope=src_rope, tgt_rope=tgt_rope, impl=impl, block_t=block_t,
                         interpret=interpret)
    return k[0], v[0]

"""The decoder every model family shares, as pure functions over (Params, KVCache).

The family (kvjax.models.family) supplies a layer's qkv and finish pieces; this module supplies the rest, in reading
order:

  attention       causal attention within fresh sequences (blocked), attention over a static window of one layer's
                  cache (kvjax.cache.window_sizes: decode cost grows with the context, not the capacity), and
                  attention over the cache plus a block not written into it (the speculative verify pass)
  layers_forward  the layer loop, the only one in the library: forward and the block drafter compose it
  forward         the one forward pass: tokens or embeddings in; a cache written, only read, or none; taps that read
                  every layer; hidden states of chosen layers; a stopping depth; logits of every position, of each
                  row's last real token, or none. Prefill, decode, the verify pass, the no-cache forwards of training
                  and scoring, partial recomputation, the drafter's features and the evaluations' attention reads are
                  all calls of it
  programs        prefill_jit (a new or given cache) and decode_jit (one token per row), the cache donated, and
                  their host-checked entry points `prefill` and `decode_step`
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import LAYER_AXES, KVCache, cache_jit, init_cache, window_sizes
from kvjax.models.family import family_of
from kvjax.models.params import Params
from kvjax.models.rope import rope_angles
from kvjax.sharding import constrain

NEG_INF = -1e30  # finite, so fully masked (padding) rows stay NaN-free


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def _group(q: jax.Array, hkv: int) -> jax.Array:
    """q [B, T, Hq, hd] -> [B, Hkv, G*T, hd]: the G query heads sharing a KV head become extra query rows, so
    attention is one plain batched matmul per KV head (no repeated K/V)."""
    b, t, hq, hd = q.shape
    return q.reshape(b, t, hkv, hq // hkv, hd).transpose(0, 2, 3, 1, 4).reshape(b, hkv, (hq // hkv) * t, hd)


def _ungroup(o: jax.Array, t: int) -> jax.Array:
    """[B, Hkv, G*T, hd] -> [B, T, Hq, hd]."""
    b, hkv, gt, hd = o.shape
    return o.reshape(b, hkv, gt // t, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, (gt // t) * hkv, hd)


def _softmax_attend(qg, k, v, mask, keys_transposed: bool = False):
    """qg [B, Hkv, Q, hd], k/v [B, Hkv, S, hd] (k [B, Hkv, hd, S] when `keys_transposed`), mask broadcastable to
    [B, Hkv, Q, S] -> [B, Hkv, Q, hd]."""
    scores = jnp.einsum("bkqd,bkds->bkqs" if keys_transposed else "bkqd,bksd->bkqs", qg, k)
    scores = scores.astype(jnp.float32) * (qg.shape[-1] ** -0.5)
    probs = jax.nn.softmax(jnp.where(mask, scores, NEG_INF), axis=-1).astype(v.dtype)
    return jnp.einsum("bkqs,bksd->bkqd", probs, v)


def _attend_window(q, k, v, q_pos, kv_len, window: int, keys_transposed: bool = False):
    """Causal GQA attention of q [B, T, Hq, hd] over positions [0, window) of one layer of the cache.

    k, v: [B', Hkv, C, hd] the layer's whole buffers (k [B', Hkv, hd, C] when `keys_transposed`; sliced here, so only
    the window is read; a window that is the whole buffer is read in place); q_pos [B, T] absolute positions; kv_len
    [B] valid positions per row.
    """
    b, t, hkv = q.shape[0], q.shape[1], k.shape[1]
    g = q.shape[2] // hkv
    k = _rows_window(k, b, window, 3 if keys_transposed else 2)  # the first B rows (forward says when fewer)
    v = _rows_window(v, b, window)
    key_pos = jnp.arange(window)
    q_pos = jnp.tile(q_pos, (1, g))  # [B, G*T], matching _group's row order
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < kv_len[:, None, None])
    return _ungroup(_softmax_attend(_group(q, hkv), k, v, mask[:, None], keys_transposed), t)


def _rows_window(buf: jax.Array, b: int, window: int, axis: int = 2) -> jax.Array:
    """buf [B', Hkv, C, hd] (positions on `axis`) -> its first b rows and first `window` positions (no slice when
    that is all of it)."""
    if (b, window) == (buf.shape[0], buf.shape[axis]):
        return buf
    return jax.lax.slice_in_dim(buf[:b], 0, window, axis=axis)


def attend(q, k, v, q_pos, kv_len, keys_transposed: bool = False):
    """Attention over the smallest static window of one layer's cache buffers k, v [B', Hkv, C, hd] (k
    [B', Hkv, hd, C] when `keys_transposed`) that holds every row's live positions."""
    return _in_window(v.shape[2], jnp.max(kv_len),
                      lambda w, q, k, v, p, n: _attend_window(q, k, v, p, n, w, keys_transposed), q, k, v, q_pos, kv_len)


def _in_window(capacity: int, needed, fn, *operands):
    """fn(window, *operands) for the smallest static window of a `capacity` cache holding `needed` positions (a
    traced scalar): one lax.switch branch per window size (kvjax.cache.window_sizes)."""
    windows = window_sizes(capacity)
    if len(windows) == 1:
        return fn(windows[0], *operands)
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(windows), needed), len(windows) - 1)
    return jax.lax.switch(index, [lambda *ops, w=w: fn(w, *ops) for w in windows], *operands)


def _attend_window_block(q, k, v, k_new, v_new, start, window: int):
    """Attention of q [B, T, Hq, hd] over one layer's cached positions [0, window) (k, v [B', Hkv, C, hd]) that
    precede each row's `start` AND the block's own keys/values k_new/v_new [B, T, Hkv, hd] (causal within the
    block): one softmax over both."""
    b, t, hkv = q.shape[0], q.shape[1], k.shape[1]
    g = q.shape[2] // hkv
    k = jnp.concatenate([_rows_window(k, b, window), k_new.transpose(0, 2, 1, 3).astype(k.dtype)], axis=2)
    v = jnp.concatenate([_rows_window(v, b, window), v_new.transpose(0, 2, 1, 3).astype(v.dtype)], axis=2)
    cached = jnp.broadcast_to(jnp.arange(window)[None, None, :] < start[:, None, None], (b, g * t, window))
    row_t = jnp.tile(jnp.arange(t), g)  # the block position of each grouped query row (_group's order)
    block = jnp.broadcast_to(jnp.arange(t)[None, None, :] <= row_t[None, :, None], (b, g * t, t))
    mask = jnp.concatenate([cached, block], axis=-1)  # [B, G*T, W + T]
    return _ungroup(_softmax_attend(_group(q, hkv), k, v, mask[:, None]), t)


def attend_block(q, k, v, k_new, v_new, start):
    """`attend` for a block whose keys/values are NOT in the cache: the cached part (one layer's k, v
    [B', Hkv, C, hd]) over the smallest static window that holds every row's `start` positions, the block's own part
    alongside (kvjax.speculative's verify pass)."""
    return _in_window(k.shape[2], jnp.max(start),
                      lambda w, q, kn, vn, s: _attend_window_block(q, k, v, kn, vn, s, w),
                      q, k_new, v_new, start)


def write_block(cache: KVCache, k: jax.Array, v: jax.Array) -> KVCache:
    """Store the k/v [L, B, T, Hkv, hd] of a pass that did not write them (`forward(..., write=False)` with a
    `stack_kv` tap) at each row's positions lengths .. lengths + T - 1 (all layers; positions past the capacity drop).
    `lengths` is left as it is: the caller sets what was accepted."""
    _standard_keys(cache, "write_block")
    positions = cache.lengths[:, None] + jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]  # [B, T]
    return cache.replace(keys=tuple(_write(buf, new, positions) for buf, new in zip(cache.keys, k)),
                         values=tuple(_write(buf, new, positions) for buf, new in zip(cache.values, v)))


def _write(buf: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """One layer's buf [B', Hkv, C, hd] <- new [B, T, Hkv, hd] at buf[b, :, positions[b, t]]; positions >= C drop."""
    rows = jnp.arange(new.shape[0])[:, None]
    return buf.at[rows, :, positions].set(new.astype(buf.dtype), mode="drop")


def _write_keys(buf: jax.Array, new: jax.Array, positions: jax.Array, transposed: bool) -> jax.Array:
    """`_write` for a layer's keys, held [B', Hkv, C, hd] or (`transposed`) [B', Hkv, hd, C]."""
    if not transposed:
        return _write(buf, new, positions)
    rows = jnp.arange(new.shape[0])[:, None]
    return buf.at[rows, :, :, positions].set(new.astype(buf.dtype), mode="drop")


def _standard_keys(cache: KVCache, what: str) -> None:
    if cache.keys_transposed:
        raise ValueError(f"{what} reads keys as [B, Hkv, T, hd]; pass cache.with_keys_transposed(False)")


def _replaced(layers: tuple, i: int, buf: jax.Array) -> tuple:
    return layers[:i] + (buf,) + layers[i + 1:]


def qkv(lp, cfg, x, cos, sin):
    """The layer's q [B, T, Hq, hd], k [B, T, Hkv, hd] (after RoPE) and v [B, T, Hkv, hd]: the family's piece."""
    return family_of(cfg).qkv(lp, cfg, x, cos, sin)


def finish(lp, cfg, x, attn):
    """Output projection, MLP and residuals after attention: the family's piece."""
    return family_of(cfg).finish(lp, cfg, x, attn)


def causal_attention(q, k, v, block: int = 128):
    """Causal GQA attention within sequences that start at position 0: q [B, T, Hq, hd], k/v [B, T, Hkv, hd].

    Queries are processed in blocks of `block`; block i attends only keys [0, end of block i), so the masked upper
    triangle is mostly never computed and each block's scores stay cache-sized (~3x faster than one [T, T] pass).
    """
    t, hkv = q.shape[1], k.shape[2]
    g = q.shape[2] // hkv
    qg = _group(q, hkv).reshape(q.shape[0], hkv, g, t, q.shape[3])  # [B, Hkv, G, T, hd]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, hd]
    outs = []
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        qi = qg[:, :, :, lo:hi].reshape(q.shape[0], hkv, g * (hi - lo), q.shape[3])
        q_pos = jnp.tile(jnp.arange(lo, hi), g)
        mask = jnp.arange(hi)[None, :] <= q_pos[:, None]  # [G*(hi-lo), hi]
        o = _softmax_attend(qi, k[:, :, :hi], v[:, :, :hi], mask)
        outs.append(o.reshape(q.shape[0], hkv, g, hi - lo, q.shape[3]))
    o = jnp.concatenate(outs, axis=3).reshape(q.shape[0], hkv, g * t, q.shape[3])
    return _ungroup(o, t)


def head_angles(cfg, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin for token positions int [B, T] (or [T]), shaped to broadcast over heads: [B or 1, T, 1, hd]."""
    cos, sin = rope_angles(positions, cfg.head_dim, cfg.rope)
    if positions.ndim == 1:
        cos, sin = cos[None], sin[None]
    return cos[:, :, None, :], sin[:, :, None, :]


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D], batch-sharded under a mesh."""
    return constrain(params.embed[tokens], ("batch", None, None))


def unembed(params: Params, x: jax.Array) -> jax.Array:
    if params.lm_head is None:
        return jnp.einsum("btd,vd->btv", x, params.embed)
    return jnp.einsum("btd,dv->btv", x, params.lm_head)


# ---- the forward pass ----------------------------------------------------------------------------------------------

class Seen(NamedTuple):
    """One layer as the forward pass computed it: what a LayerTap reads."""

    q: jax.Array  # [B, T, Hq, hd], after RoPE
    k: jax.Array  # [B, T, Hkv, hd], after RoPE: the layer's own projection of the tokens
    v: jax.Array  # [B, T, Hkv, hd]
    attn: jax.Array  # [B, T, Hq, hd]: the attention output, before the output projection
    out: jax.Array  # [B, T, D]: the layer's output (its residual stream after attention and MLP)


def layers_forward(layers, cfg, x: jax.Array, cos, sin, attention, carry=None, seen=None, remat: bool = False):
    """The decoder's layer loop: x [B, T, D] through `layers` (a family's layer pytrees), each layer's q, k, v from
    the family's qkv, its attention from attention(i, q, k, v, carry) -> (attn [B, T, Hq, hd], carry), then the
    family's finish. seen(i, Seen) is called after each layer; `remat` recomputes each layer in the backward pass
    (jax.checkpoint: training memory; no `seen` then). Returns (x, carry).

    Every forward pass in the library is this loop: `forward` (its attention reads and writes the cache, or attends
    within the tokens) and the block drafter (kvjax.drafter.model: its attention reads a context of features)."""
    if remat and seen is not None:
        raise ValueError("layers_forward: remat recomputes the layers in the backward pass and cannot show them to "
                         "`seen`; pass one or the other")
    for i, lp in enumerate(layers):
        def step(lp, x, carry, i=i):
            q, k, v = qkv(lp, cfg, x, cos, sin)
            attn, carry = attention(i, q, k, v, carry)
            return finish(lp, cfg, x, attn), carry, Seen(q, k, v, attn, None)

        if remat:
            x, carry = jax.checkpoint(lambda lp, x, carry: step(lp, x, carry)[:2])(lp, x, carry)
            continue
        out, carry, view = step(lp, x, carry)
        if seen is not None:
            seen(i, view._replace(out=out))
        x = out
    return x, carry


def keys_values(layers, cfg, x: jax.Array, cos, sin) -> list[tuple[jax.Array, jax.Array]]:
    """Per layer, the keys (after RoPE) and values [B, T, Hkv, hd] its projections make of the same input x
    [B, T, D] (a block drafter's context: every drafter layer reads the verifier's features; XLA drops the unused
    queries)."""
    return [qkv(lp, cfg, x, cos, sin)[1:] for lp in layers]


class LayerTap:
    """Something that reads every layer while a forward pass computes it, in the same compiled program (e.g.
    kvjax.builders.pipelined maps each target layer of a cache map as soon as its source layers exist, and never
    stores the source's cache). start() -> state; layer(i, seen: Seen, state) -> state; result(state, lengths [B]:
    real tokens per row) -> what the pass returns as `tapped`. A tap passed through a compiled program (prefill_jit)
    is a pytree: its arrays are leaves, its settings static (a flax struct dataclass)."""

    def start(self):
        raise NotImplementedError

    def layer(self, i: int, seen: Seen, state):
        raise NotImplementedError

    def result(self, state, lengths):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Stack(LayerTap):
    """The tap that stacks fn(seen) over the layers the pass runs: fn's result (an array or a pytree of them) with a
    leading layer axis [L, ...]. For taps built inside a traced program (fn is compared by identity: a new fn per
    call would recompile a compiled one)."""

    fn: Callable[[Seen], object]

    def start(self):
        return ()

    def layer(self, i, seen, state):
        return state + (self.fn(seen),)

    def result(self, state, lengths):
        return jax.tree.map(lambda *layers: jnp.stack(layers), *state)


stack_kv = Stack(lambda s: (s.k, s.v))  # every layer's own keys and values: ([L, B, T, Hkv, hd], [L, B, T, Hkv, hd])


class Forward(NamedTuple):
    """What a forward pass returns (fields None where not asked for)."""

    logits: jax.Array | None  # [B, T, V], or [B, V] at each row's last real token
    cache: KVCache | None  # with the tokens' keys/values written and `lengths` advanced
    features: jax.Array | None  # [B, T, len(features) * D]
    tapped: object = None  # the tap's result


LOGITS = ("all", "last", None)
# forward's options that shape the program (static under jit)
STATIC_OPTIONS = ("logits", "fresh", "write", "reads", "features", "depth", "remat")


def forward(params: Params, cfg, inputs: jax.Array, cache: KVCache | None = None, *, lengths: jax.Array | None = None,
            logits: str | None = "all", fresh: bool = False, write: bool = True, reads: tuple[int, ...] = (),
            features: tuple[int, ...] = (), tap: LayerTap | None = None, depth: int | None = None,
            remat: bool = False) -> Forward:
    """The model over `inputs` (traceable): token ids int [B, T], or input embeddings float [B, T, D] (e.g. an
    audio-language prompt's, kvjax.models.audio_lm), right-padded with `lengths` [B] real tokens per row (default T).
    Every option but `lengths` (and `tap`'s arrays) is static.

    The cache:
      None         the tokens are whole sequences from position 0, attending only to each other (training, scoring)
      a KVCache    the tokens follow each row's cached positions; every layer writes their keys/values at those
                   positions and attends over the smallest static window of the cache holding every row's live part.
                   `inputs` may have fewer rows (b) than the cache: they are its first b rows, the others are neither
                   read nor written (a server's step over its occupied slots). `fresh` promises that every row
                   starts at position 0 (all lengths 0): attention then runs over the tokens alone (blocked causal).
                   `write` False: nothing is written (the returned cache is None); each layer attends over the cache
                   and the tokens' own keys/values (the verify pass: a `stack_kv` tap returns those, write_block
                   stores them). `reads`: layers that take the keys/values of these positions from the cache (which
                   must hold them, e.g. a mapped cache) instead of computing and writing their own (partial
                   recomputation, kvjax.builders.partial).

    What comes back (Forward): logits "all" [B, T, V], "last" [B, V] at each row's last real token, or None (XLA then
    drops the final norm and the unembedding); `features`, the outputs of the listed layers (the residual stream
    after each, before the final norm: HF's hidden_states[i + 1]) concatenated in the listed order
    [B, T, len(features) * D] (the verifier's features a speculative drafter reads); `tap` (a LayerTap) reads every
    layer as it is computed; `depth` runs only layers 0 .. depth - 1 (then logits must be None, and a cache comes
    back with only those layers written); `remat` recomputes each layer in the backward pass (training)."""
    depth = cfg.num_layers if depth is None else int(depth)
    if logits not in LOGITS:
        raise ValueError(f"forward: logits must be one of {LOGITS}, got {logits!r}")
    if not 1 <= depth <= cfg.num_layers:
        raise ValueError(f"forward: depth must be in 1..{cfg.num_layers} (the model's layers), got {depth}")
    if logits is not None and depth < cfg.num_layers:
        raise ValueError(f"forward: logits need all {cfg.num_layers} layers; pass logits=None with depth={depth}")
    if any(not 0 <= i < depth for i in (*features, *reads)):
        raise ValueError(f"forward: features {features} and reads {reads} must be layers of the {depth} the pass "
                         "runs")
    if cache is None and (reads or fresh or not write):
        raise ValueError("forward: fresh, write=False and reads describe how the pass uses a cache; pass one")
    b, t = inputs.shape[:2]
    if inputs.ndim == 2:
        x = embed(params, inputs)  # [B, T, D]
    else:
        x = constrain(inputs.astype(params.embed.dtype), ("batch", None, None))
    if lengths is None:
        lengths = jnp.full((b,), t, jnp.int32)

    feats, state = {}, None if tap is None else tap.start()

    def seen(i, view):
        nonlocal state
        if tap is not None:
            state = tap.layer(i, view, state)
        if i in features:
            feats[i] = view.out

    layers = params.layers[:depth]
    watch = seen if tap is not None or features else None
    if cache is None:
        cos, sin = head_angles(cfg, jnp.arange(t))
        x, _ = layers_forward(layers, cfg, x, cos, sin, lambda i, q, k, v, c: (causal_attention(q, k, v), c),
                              None, watch, remat)
    else:
        start = cache.lengths[:b]
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        kv_len = start + lengths
        cos, sin = head_angles(cfg, positions)
        if write:
            attention = functools.partial(_attend_writing, positions=positions, kv_len=kv_len, fresh=fresh,
                                          reads=reads)
        else:
            _standard_keys(cache, "forward(write=False)")
            attention = lambda i, q, k, v, c: (attend_block(q, c.keys[i], c.values[i], k, v, start), c)  # noqa: E731
        x, written = layers_forward(layers, cfg, x, cos, sin, attention, cache, watch, remat)
        rows = cache.lengths.shape[0]
        cache = None if not write else written.replace(
            lengths=kv_len if b == rows else cache.lengths.at[:b].set(kv_len))
    out = None
    if logits is not None:
        if logits == "last":
            x = x[jnp.arange(b), jnp.maximum(lengths - 1, 0)][:, None]  # [B, 1, D]
        out = unembed(params, rms_norm(x, params.final_norm, cfg.rms_norm_eps))
        if logits == "last":
            out = out[:, 0]
    return Forward(out, cache, jnp.concatenate([feats[i] for i in features], axis=-1) if features else None,
                   None if tap is None else tap.result(state, lengths))


def _attend_writing(i, q, k, v, cache: KVCache, *, positions, kv_len, fresh: bool, reads: tuple[int, ...]):
    """Layer i's attention in a pass that writes the cache: its k/v stored at `positions`, then attention over the
    cache (or, `fresh`, over the tokens alone); a layer in `reads` takes k/v from the cache instead."""
    if i in reads:
        if fresh:  # the tokens hold positions 0 .. T - 1: attention over the cache's first T
            k, v = _cached(cache, i, q.shape[0], q.shape[1], q.dtype)
            return causal_attention(q, k, v), cache
        return attend(q, cache.keys[i], cache.values[i], positions, kv_len, cache.keys_transposed), cache
    kb = _write_keys(cache.keys[i], k, positions, cache.keys_transposed)
    vb = _write(cache.values[i], v, positions)
    cache = cache.replace(keys=_replaced(cache.keys, i, kb), values=_replaced(cache.values, i, vb))
    if fresh:
        return causal_attention(q, k, v), cache
    return attend(q, kb, vb, positions, kv_len, cache.keys_transposed), cache  # [B, T, Hq, hd]


def _cached(cache: KVCache, i: int, b: int, t: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Layer i's cached k/v at positions 0 .. t - 1 of its first b rows, as [B, T, Hkv, hd] in `dtype`."""
    keys = cache.keys[i][:b]
    keys = keys[..., :t].transpose(0, 3, 1, 2) if cache.keys_transposed else keys[:, :, :t].transpose(0, 2, 1, 3)
    return keys.astype(dtype), cache.values[i][:b, :, :t].transpose(0, 2, 1, 3).astype(dtype)


# ---- programs (jitted, cache donated) ------------------------------------------------------------------------------

def prefill_forward(params: Params, cfg, inputs: jax.Array, lengths: jax.Array | None = None,
                    cache: KVCache | None = None, *, capacity: int | None = None, dtype=None,
                    logits: str | None = "last", **options) -> Forward:
    """`forward` over prompts (traceable; `prefill_jit` is it compiled, the cache donated), by default returning the
    logits at each row's last real token. With `cache` None, into a new empty cache of `capacity` positions (default
    T) and `dtype` (default the params'), sharded by its logical axes under an active mesh (batch over 'data', kv
    heads over 'model'). `options`: forward's. A pass that stops below the top layer (`depth`) returns no cache: its
    upper layers were never computed."""
    if cache is None:
        b, t = inputs.shape[:2]
        cache = init_cache(cfg, b, t if capacity is None else capacity, dtype or params.embed.dtype)
        cache, options = cache.map_layers(lambda a: constrain(a, LAYER_AXES)), {**options, "fresh": True}
    out = forward(params, cfg, inputs, cache, lengths=lengths, logits=logits, **options)
    return out if options.get("depth") in (None, cfg.num_layers) else out._replace(cache=None)


def decode(params, cfg, tokens, cache):
    """One token per row int [B] after the cache (traceable): (logits [B, V], cache)."""
    out = forward(params, cfg, tokens[:, None], cache)
    return out.logits[:, 0], out.cache


prefill_jit = cache_jit(prefill_forward, static_argnames=("cfg", "capacity", "dtype") + STATIC_OPTIONS,
                        donate_argnames=("cache",))
decode_jit = cache_jit(decode, static_argnames=("cfg",), donate_argnames=("cache",))


def _check_cache(cfg, cache: KVCache, tokens, ndim: int, what: str) -> None:
    from kvjax.cache import check_compatible
    if not isinstance(cache, KVCache):
        raise TypeError(f"{what}: cache must be a kvjax.KVCache (kvjax.init_cache), got {type(cache).__name__}")
    check_compatible(cfg, cache)
    if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
        shape = "[B, T]" if ndim == 2 else "[B]"
        raise ValueError(f"{what}: tokens must be an integer array of shape {shape}, got {tokens.dtype}{tokens.shape}")
    if tokens.shape[0] != cache.batch_size:
        raise ValueError(f"{what}: tokens have batch {tokens.shape[0]} but the cache was made for batch "
                         f"{cache.batch_size}")


def _on_host(*arrays):
    """numpy values of `arrays` (None passes through) in one device-to-host transfer; host inputs cost nothing.
    The compiled functions cannot raise, so what they would silently get wrong is checked here, before any compute
    is queued."""
    return [None if a is None else np.asarray(a) for a in jax.device_get(arrays)]


def _int32(value, host: np.ndarray):
    """The int32 argument for a compiled call: a device array as it is, else the host copy (the jitted call uploads
    it more cheaply than a separate jnp.asarray dispatch)."""
    if isinstance(value, jax.Array) and value.dtype == jnp.int32:
        return value
    return host.astype(np.int32, copy=False)


def _check_token_ids(cfg, tokens: np.ndarray, real: np.ndarray, what: str) -> None:
    """Ids outside the vocabulary would be gathered from a clamped embedding row: wrong logits, no error."""
    bad = real & ((tokens < 0) | (tokens >= cfg.vocab_size))
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what}: token ids must be in [0, {cfg.vocab_size}) (the model's vocab_size), got "
                         f"{int(tokens[at])} at index {list(at)}; encode with the tokenizer of this model")


LARGER_CACHE = "create a larger cache: kvjax.init_cache(cfg, batch, max_len) with max_len >= prompt + new tokens"


def prefill(params: Params, cfg, tokens, cache: KVCache, lengths=None, *, last_only: bool = False,
            fresh: bool | None = None):
    """Process prompt tokens int32 [B, T] (right-padded; `lengths` [B] = real tokens per row) after what the cache
    holds. Returns (logits [B, T, V] or, with `last_only`, [B, V] at each row's last real token; cache). The cache
    argument is donated: use the returned one. Before compiling anything, the tokens, `lengths` and cache.lengths
    are read on the host (one small device-to-host copy) to reject ids outside the vocabulary and prompts that
    overflow the cache; `fresh` (whether the cache is empty) defaults to what that read shows."""
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    _check_cache(cfg, cache, tokens, 2, "prefill")
    b, t = tokens.shape
    if t > cache.capacity:
        raise ValueError(f"prefill: {t} tokens do not fit a cache of capacity {cache.capacity}; "
                         "make the cache larger (kvjax.init_cache(cfg, batch, max_len))")
    if lengths is not None and not isinstance(lengths, jax.Array):
        lengths = np.asarray(lengths)
    host_tokens, host_lengths, cached = _on_host(tokens, lengths, cache.lengths)
    new = np.full((b,), t) if host_lengths is None else host_lengths
    if new.shape != (b,) or new.min() < 0 or new.max() > t:
        raise ValueError(f"prefill: lengths must be [B] = [{b}] integers in 0..{t} (real tokens per row), got {new}")
    _check_token_ids(cfg, host_tokens, np.arange(t)[None, :] < new[:, None], "prefill")
    over = np.flatnonzero(cached + new > cache.capacity)
    if over.size:
        r = int(over[0])
        raise ValueError(f"prefill: row {r} holds {int(cached[r])} positions and gets {int(new[r])} more, past the "
                         f"cache capacity {cache.capacity}; {LARGER_CACHE}")
    if fresh is None:
        fresh = not cached.any()
    lengths = None if lengths is None else _int32(lengths, host_lengths)
    out = prefill_jit(params, cfg, _int32(tokens, host_tokens), lengths, cache, logits="last" if last_only else "all",
                      fresh=bool(fresh))
    return out.logits, out.cache


def decode_step(params: Params, cfg, tokens, cache: KVCache):
    """One token per row, int32 [B], appended at each row's own position. Returns (logits [B, V], cache).
    The cache argument is donated: use the returned one. The tokens and cache.lengths are read on the host (one
    small device-to-host copy per step) to reject ids outside the vocabulary and a row whose cache is full, whose
    write would fall outside the buffer: size the cache for prompt + new tokens."""
    tokens = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    _check_cache(cfg, cache, tokens, 1, "decode_step")
    host_tokens, cached = _on_host(tokens, cache.lengths)
    _check_token_ids(cfg, host_tokens, np.ones(host_tokens.shape, bool), "decode_step")
    full = np.flatnonzero(cached >= cache.capacity)
    if full.size:
        raise ValueError(f"decode_step: the cache is full (all {cache.capacity} positions used) in row(s) "
                         f"{full.tolist()}, so the new token's keys/values would not be stored; {LARGER_CACHE}")
    return decode_jit(params, cfg, _int32(tokens, host_tokens), cache)

"""The decoder every model family shares, as pure functions over (Params, KVCache).

The family (kvjax.models.family) supplies a layer's qkv and finish pieces; this module supplies the rest: attention
over the cache, the forward pass, prefill and decode with their input checks. One function, `forward`, serves prefill (many tokens per row) and decode (one token per row): it writes the new
keys/values into the cache at each row's own positions and attends over a static window of the cache that covers
every row's live part (see kvjax.cache.window_sizes), so decode cost grows with the context, not the capacity.
"""

from __future__ import annotations

from typing import NamedTuple

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
    k = _rows_window(k, b, window, 3 if keys_transposed else 2)  # the first B rows (forward_features says when fewer)
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


def verify_forward(params: Params, cfg, tokens: jax.Array, cache: KVCache, feature_layers: tuple[int, ...] = ()):
    """`forward_features` that leaves the cache untouched: tokens [B, T] after each row's cached positions ->
    (logits [B, T, V], k [L, B, T, Hkv, hd], v [L, B, T, Hkv, hd], features or None). `write_block` stores k/v.

    Why: the speculative loop picks how many tokens to verify at run time (lax.switch over the lengths). A branch
    that wrote into the cache would make XLA:CPU copy the whole cache into and out of the conditional (~0.3 ms a
    round on the toy source, a fifth of the verify pass); reading it is free, and one write after the switch
    stores the block. Same numbers as `forward_features` up to float summation order."""
    _standard_keys(cache, "verify_forward")
    b, t = tokens.shape
    start = cache.lengths
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    cos, sin = head_angles(cfg, positions)
    x = embed(params, tokens)
    ks, vs, feats = [], [], {}
    for i, lp in enumerate(params.layers):
        q, k, v = qkv(lp, cfg, x, cos, sin)
        x = finish(lp, cfg, x, attend_block(q, cache.keys[i], cache.values[i], k, v, start))
        ks.append(k)
        vs.append(v)
        if i in feature_layers:
            feats[i] = x
    features = jnp.concatenate([feats[i] for i in feature_layers], axis=-1) if feature_layers else None
    logits = unembed(params, rms_norm(x, params.final_norm, cfg.rms_norm_eps))
    return logits, jnp.stack(ks), jnp.stack(vs), features


def write_block(cache: KVCache, k: jax.Array, v: jax.Array) -> KVCache:
    """Store verify_forward's k/v [L, B, T, Hkv, hd] at each row's positions lengths .. lengths + T - 1 (all layers;
    positions past the capacity drop). `lengths` is left as it is: the caller sets what was accepted."""
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


def layer_forward(lp, cfg, x, cos, sin, cache: KVCache, layer: int, positions, kv_len,
                  fresh: bool = False):
    """One decoder layer over cached context. x [B, T, D]; returns (x, cache with this layer's K/V written, and
    those K/V as computed: k [B, T, Hkv, hd] after RoPE, v [B, T, Hkv, hd]). `fresh`: the cache held nothing before
    these tokens, so attention needs only their own K/V."""
    q, k, v = qkv(lp, cfg, x, cos, sin)
    kb = _write_keys(cache.keys[layer], k, positions, cache.keys_transposed)
    vb = _write(cache.values[layer], v, positions)
    cache = cache.replace(keys=_replaced(cache.keys, layer, kb), values=_replaced(cache.values, layer, vb))
    if fresh:
        attn = causal_attention(q, k, v)
    else:
        attn = attend(q, kb, vb, positions, kv_len, cache.keys_transposed)  # [B, T, Hq, hd]
    return finish(lp, cfg, x, attn), cache, k, v


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


def forward_nocache(params: Params, cfg, tokens: jax.Array, remat: bool = False) -> jax.Array:
    """Logits [B, T, V] of whole sequences from position 0, without a cache (training, scoring)."""
    b, t = tokens.shape
    cos, sin = head_angles(cfg, jnp.arange(t))

    def layer(lp, x):
        q, k, v = qkv(lp, cfg, x, cos, sin)
        return finish(lp, cfg, x, causal_attention(q, k, v))

    if remat:
        layer = jax.checkpoint(layer)
    x = embed(params, tokens)
    for lp in params.layers:
        x = layer(lp, x)
    return unembed(params, rms_norm(x, params.final_norm, cfg.rms_norm_eps))


def unembed(params: Params, x: jax.Array) -> jax.Array:
    if params.lm_head is None:
        return jnp.einsum("btd,vd->btv", x, params.embed)
    return jnp.einsum("btd,dv->btv", x, params.lm_head)


def forward(params: Params, cfg, tokens: jax.Array, cache: KVCache, lengths: jax.Array | None = None,
            last_only: bool = False, fresh: bool = False) -> tuple[jax.Array, KVCache]:
    """Run `tokens` [B, T] (right-padded; `lengths` [B] real tokens per row, default T) after each row's cached
    positions. Returns logits [B, T, V] (or [B, V] at each row's last real token when `last_only`) and the cache with
    `lengths` advanced. `fresh` (static) promises that the cache is empty (all lengths 0): attention then uses
    block-causal attention over the new tokens alone instead of reading the cache."""
    logits, cache, _ = forward_features(params, cfg, tokens, cache, (), lengths, last_only, fresh)
    return logits, cache


def forward_features(params: Params, cfg, tokens: jax.Array, cache: KVCache, feature_layers: tuple[int, ...],
                     lengths: jax.Array | None = None, last_only: bool = False, fresh: bool = False):
    """`forward`, also returning the hidden states of `feature_layers` (static): the OUTPUT of each listed layer
    (its residual stream after attention and MLP, before the final norm; HF's hidden_states[i + 1]) at every input
    position, concatenated in the listed order: [B, T, len(feature_layers) * D] (None when the tuple is empty). A
    speculative drafter that reads the verifier's features (kvjax.speculative) gets them from the verify pass.

    `tokens` may have fewer rows (b) than the cache: they are the cache's first b rows, the others are neither read
    nor written (a server's decode step over its occupied slots only: attention reads b rows, not all of them)."""
    return _forward(params, cfg, tokens, cache, feature_layers, lengths, last_only, fresh)[:3]


def _forward(params, cfg, tokens, cache, feature_layers, lengths, last_only, fresh, tap=None, tap_args=None,
             embeds=None):
    """forward_features, and a `tap` (see LayerTap) that sees every layer's keys and values: (logits, cache,
    features, the tap's result or None). A tap that stops below the top layer leaves logits and cache
    meaningless (the caller drops them). `embeds` [B, T, D], when given, are the input instead of the tokens'
    embeddings (tokens may then be None)."""
    b, t = (tokens if embeds is None else embeds).shape[:2]
    if lengths is None:
        lengths = jnp.full((b,), t, jnp.int32)
    rows = cache.lengths.shape[0]
    start = cache.lengths[:b]
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    kv_len = start + lengths
    cos, sin = head_angles(cfg, positions)
    x = embed(params, tokens) if embeds is None else constrain(embeds.astype(params.embed.dtype),
                                                                ("batch", None, None))  # [B, T, D]
    feats = {}
    tapped = None if tap is None else tap.start()
    for i, lp in enumerate(params.layers[: len(params.layers) if tap is None else tap.depth]):
        x, cache, k, v = layer_forward(lp, cfg, x, cos, sin, cache, i, positions, kv_len, fresh)
        if tap is not None:
            tapped = tap.layer(i, k, v, tapped, tap_args)
        if i in feature_layers:
            feats[i] = x
    features = jnp.concatenate([feats[i] for i in feature_layers], axis=-1) if feature_layers else None
    if last_only:
        x = x[jnp.arange(b), jnp.maximum(lengths - 1, 0)][:, None]  # [B, 1, D]
    logits = unembed(params, rms_norm(x, params.final_norm, cfg.rms_norm_eps))
    if last_only:
        logits = logits[:, 0]
    cache = cache.replace(lengths=kv_len if b == rows else cache.lengths.at[:b].set(kv_len))
    return logits, cache, features, (None if tap is None else tap.result(tapped, lengths))


# ---- public entry points (jitted, cache donated) -----------------------------------------------------------------

class Prefilled(NamedTuple):
    """What the prefill program returns (fields None where not asked for)."""

    logits: jax.Array | None  # [B, V] at each row's last real token (or [B, T, V] without last_only)
    cache: KVCache | None
    features: jax.Array | None  # [B, T, len(feature_layers) * D]
    tapped: object = None  # a LayerTap's result


class LayerTap:
    """Something that reads each layer's keys and values while the prefill program computes them, in the same
    compiled program (e.g. kvjax.builders.pipelined maps each target layer of a cache map as soon as its source layers
    exist, and never stores the source's cache). A tap is static (hashable: its settings); its arrays come in as
    `tap_args`. `depth`: layers the pass runs (below all of them, the prefill program returns no logits and no cache:
    the upper layers were never computed). start() -> state; layer(i, k, v, state, tap_args) -> state, with k
    [B, T, Hkv, hd] after RoPE and v [B, T, Hkv, hd]; result(state, lengths) -> what the program returns as `tapped`."""

    depth: int

    def start(self):
        raise NotImplementedError

    def layer(self, i, k, v, state, tap_args):
        raise NotImplementedError

    def result(self, state, lengths):
        raise NotImplementedError


def prefill_forward(params: Params, cfg, tokens: jax.Array, lengths: jax.Array | None = None,
                    cache: KVCache | None = None, *, capacity: int | None = None, dtype=None, last_only: bool = True,
                    fresh: bool = False, feature_layers: tuple[int, ...] = (), logits: bool = True,
                    tap: LayerTap | None = None, tap_args=None, embeds: jax.Array | None = None) -> Prefilled:
    """The library's one prefill, traceable (`prefill_jit` is it compiled, the cache donated): read tokens int
    [B, T] (right-padded; `lengths` [B] real tokens per row, default T) after what `cache` holds or, with cache None,
    into a new empty cache of `capacity` positions (default T) and `dtype` (default the params'), sharded by its
    logical axes under an active mesh (batch over 'data', kv heads over 'model').

    Returns Prefilled(logits, cache, features, tapped): logits [B, V] at each row's last real token with `last_only`
    (else [B, T, V]), None when `logits` is False (XLA then drops the unembedding); features as forward_features's
    for `feature_layers` (a drafter reading the model's hidden states); `tap` (static, a LayerTap) reads every
    layer's keys and values as they are computed. `fresh` promises a given cache is empty (a new one always is).
    `embeds` [B, T, D]: input embeddings read instead of the tokens' (tokens may then be None), e.g. an
    audio-language prompt's (kvjax.models.audio)."""
    if cache is None:
        b, t = (tokens if embeds is None else embeds).shape[:2]
        cache = init_cache(cfg, b, t if capacity is None else capacity, dtype or params.embed.dtype)
        cache, fresh = cache.map_layers(lambda a: constrain(a, LAYER_AXES)), True
    out, cache, features, tapped = _forward(params, cfg, tokens, cache, feature_layers, lengths, last_only, fresh,
                                            tap, tap_args, embeds)
    whole = tap is None or tap.depth >= cfg.num_layers  # a tap that stopped early left no usable logits or cache
    return Prefilled(out if logits and whole else None, cache if whole else None, features, tapped)


def decode(params, cfg, tokens, cache):
    """One token per row int [B] after the cache (traceable): (logits [B, V], cache)."""
    logits, cache = forward(params, cfg, tokens[:, None], cache)
    return logits[:, 0], cache


prefill_jit = cache_jit(prefill_forward, static_argnames=("cfg", "capacity", "dtype", "last_only", "fresh",
                                                        "feature_layers", "logits", "tap"), donate_argnames=("cache",))
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
    out = prefill_jit(params, cfg, _int32(tokens, host_tokens), lengths, cache, last_only=last_only,
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

"""The block drafter (DFlash-style): one forward pass predicts a whole block of b tokens.

Inputs at a step: the verifier's hidden states at `feature_layers` for every position already decoded (the
*context*), and the block: the last decoded token (not yet read by the verifier) followed by b mask positions. The
context features, concatenated over the feature layers, are projected to the hidden size once (`fc`, then an RMS
norm); every drafter layer turns them into its own keys and values with its k/v projections, and those live in the
drafter's KV cache (a kvjax.KVCache: context positions only, rolled back by `lengths` like the verifier's). The block
attends to the whole live context and to itself bidirectionally (no causal mask inside the block), and the drafter's
final norm plus the verifier's own (frozen, shared) LM head turn mask position j into the token at position
last + j. The verifier's embedding embeds the last token; the mask positions share one learned vector.

The layers are the verifier family's own layers (kvjax.models.family qkv/finish pieces) with the verifier's shapes,
so the shared embedding and head fit, and RoPE uses absolute positions like the verifier.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import KVCache, init_cache, window_sizes
from kvjax.drafter.config import DrafterConfig
from kvjax.models.decoder import NEG_INF, embed, forward, head_angles, keys_values, layers_forward, rms_norm
from kvjax.models.family import family_of
from kvjax.models.params import ParamSpec, spec


@struct.dataclass
class DrafterParams:
    fc: jax.Array  # [F, D]: concatenated verifier features -> hidden
    hidden_norm: jax.Array  # [D]
    mask: jax.Array  # [D]: the input of every masked block position
    layers: tuple  # the verifier family's layer pytrees, num_layers of them
    final_norm: jax.Array  # [D]
    # int32 [Vd]: the draft vocabulary, the verifier tokens the drafter can propose (its head is the verifier's head
    # restricted to them: the most frequent tokens of the verifier's outputs, so the head costs Vd/V of the full one
    # while drafts lose only the rare tokens, which are rarely accepted anyway). Not trained; None while training.
    vocab_ids: jax.Array | None = None


def draft_head(tparams, vocab_ids: jax.Array | None) -> jax.Array:
    """The drafter's output matrix [Vd, D]: rows of the verifier's (tied or untied) LM head for the draft
    vocabulary (the whole vocabulary when vocab_ids is None). Computed once per generate call, outside the loop."""
    full = tparams.embed if tparams.lm_head is None else tparams.lm_head.T
    return full if vocab_ids is None else full[vocab_ids]


def param_specs(dcfg: DrafterConfig) -> dict[str, ParamSpec]:
    """Flat description of every drafter tensor (names are also the keys in its safetensors file); the layers'
    entries come from the family's own table."""
    d, f = dcfg.hidden_size, dcfg.feature_size
    specs = {"fc": spec((f, d), (None, "embed"), "normal", "fc"),
             "hidden_norm": spec((d,), ("embed",), "ones", "hidden_norm"),
             "mask": spec((d,), ("embed",), "normal", "mask"),
             "final_norm": spec((d,), ("embed",), "ones", "final_norm")}
    for name, s in family_of(dcfg.layer).param_specs(dcfg.layer).items():
        if name.startswith("layers."):
            specs[name] = dataclasses.replace(s, hf_name=name)
    return specs


def from_flat(dcfg: DrafterConfig, flat: dict) -> DrafterParams:
    layer = family_of(dcfg.layer).layer
    fields = [f.name for f in dataclasses.fields(layer)]
    layers = tuple(layer(**{n: flat[f"layers.{i}.{n}"] for n in fields}) for i in range(dcfg.num_layers))
    return DrafterParams(fc=flat["fc"], hidden_norm=flat["hidden_norm"], mask=flat["mask"], layers=layers,
                         final_norm=flat["final_norm"])


def with_vocab(params: DrafterParams, vocab_ids) -> DrafterParams:
    return params.replace(vocab_ids=None if vocab_ids is None else jnp.asarray(vocab_ids, jnp.int32))


def to_flat(params: DrafterParams) -> dict:
    flat = {"fc": params.fc, "hidden_norm": params.hidden_norm, "mask": params.mask,
            "final_norm": params.final_norm}
    for i, lp in enumerate(params.layers):
        flat.update({f"layers.{i}.{f.name}": getattr(lp, f.name) for f in dataclasses.fields(lp)})
    return flat


def init_drafter(dcfg: DrafterConfig, key: jax.Array, std: float = 0.02, target_params=None) -> DrafterParams:
    """Random initial weights (norms one, matrices N(0, std)). With `target_params`, the layers start as copies of
    the verifier's last layers (a drafter layer then begins as a layer that already reads this hidden space)."""
    specs = param_specs(dcfg)
    keys = jax.random.split(key, len(specs))
    flat = {name: jnp.ones(s.shape, jnp.float32) if s.init == "ones" else std * jax.random.normal(k, s.shape)
            for k, (name, s) in zip(keys, sorted(specs.items()))}
    params = from_flat(dcfg, flat)
    if target_params is not None:
        params = params.replace(layers=tuple(target_params.layers[-dcfg.num_layers:]))
    return params


# Fields through which a layer writes to the residual stream (attention's output projection, the MLP's down
# projection, and their biases where a family has them): zeroed, they make the layer the identity.
_WRITES = ("o", "o_bias", "down", "down_bias")


def grow(params: DrafterParams, dcfg: DrafterConfig, target_params) -> DrafterParams:
    """A trained drafter `params` with fewer layers as a drafter of `dcfg.num_layers` layers that computes exactly
    what it computed (Net2Net's function-preserving growth): the new layers go on top, each a copy of one of the
    verifier's last layers (so it already reads this hidden space) with its residual writes zeroed, so it adds
    nothing until training moves them. Training the grown drafter then starts from the smaller one's acceptance
    instead of from scratch. The draft vocabulary is kept."""
    have, want = len(params.layers), dcfg.num_layers
    if want < have:
        raise ValueError(f"cannot grow a {have}-layer drafter to {want} layers; pass --layers >= {have}")
    if want - have > len(target_params.layers):
        raise ValueError(f"growing by {want - have} layers needs as many verifier layers to copy; the verifier has "
                         f"{len(target_params.layers)}")
    new = []
    for lp in target_params.layers[len(target_params.layers) - (want - have):]:
        names = [f.name for f in dataclasses.fields(lp)]
        if "o" not in names or "down" not in names:
            raise ValueError(f"growing a drafter needs layers with `o` and `down` projections; "
                             f"{type(lp).__name__} has {names}")
        new.append(lp.replace(**{n: jnp.zeros_like(getattr(lp, n)) for n in _WRITES
                                 if n in names and getattr(lp, n) is not None}))
    return params.replace(layers=tuple(params.layers) + tuple(new))


# ---- verifier features ---------------------------------------------------------------------------------------------

def target_features(tparams, tcfg, tokens: jax.Array, feature_layers: tuple[int, ...]) -> jax.Array:
    """The verifier's outputs of `feature_layers` for whole sequences from position 0, concatenated in the listed
    order: [B, T, F] (training data; at decode time the verify pass returns the same features)."""
    return forward(tparams, tcfg, tokens, logits=None, features=tuple(feature_layers),
                   depth=max(feature_layers) + 1).features


# ---- context: the drafter's cache ----------------------------------------------------------------------------------

def context_hidden(dp: DrafterParams, dcfg: DrafterConfig, features: jax.Array) -> jax.Array:
    """Features [B, T, F] -> the drafter's context hidden states [B, T, D]."""
    return rms_norm(jnp.einsum("btf,fd->btd", features.astype(dp.fc.dtype), dp.fc), dp.hidden_norm,
                    dcfg.layer.rms_norm_eps)


def context_kv(dp: DrafterParams, dcfg: DrafterConfig, features: jax.Array, positions: jax.Array):
    """Per drafter layer, (k, v) [B, T, Hkv, hd] of context features [B, T, F] at absolute `positions` [B, T]."""
    cos, sin = head_angles(dcfg.layer, positions)
    return keys_values(dp.layers, dcfg.layer, context_hidden(dp, dcfg, features), cos, sin)


def init_context(dcfg: DrafterConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
    """An empty drafter cache: one entry per context position per drafter layer."""
    return init_cache(dcfg.layer, batch, capacity, dtype)


def extend_context(dp: DrafterParams, dcfg: DrafterConfig, cache: KVCache, features: jax.Array,
                   n_valid: jax.Array) -> KVCache:
    """Write the context keys/values of features [B, T, F] at each row's positions lengths .. lengths + T and
    advance lengths by n_valid [B] (<= T): entries past the new lengths are dead and get overwritten later, which
    is how a rejected draft rolls back. Writes past the capacity are dropped."""
    t = features.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    rows = jnp.arange(features.shape[0])[:, None]
    k, v = list(cache.keys), list(cache.values)
    for i, (ki, vi) in enumerate(context_kv(dp, dcfg, features, positions)):
        k[i] = k[i].at[rows, :, positions].set(ki.astype(k[i].dtype), mode="drop")
        v[i] = v[i].at[rows, :, positions].set(vi.astype(v[i].dtype), mode="drop")
    return cache.replace(keys=tuple(k), values=tuple(v), lengths=cache.lengths + n_valid.astype(jnp.int32))


# ---- the block forward ---------------------------------------------------------------------------------------------

def _attend(q, k_blk, v_blk, k_ctx, v_ctx, ctx_len, blk_valid):
    """Joint softmax attention of block queries q [B, T, Hq, hd] over context keys k_ctx/v_ctx [B, Hkv, W, hd]
    (live where position < ctx_len [B]) and the block's own keys k_blk/v_blk [B, T, Hkv, hd] (live where
    blk_valid [B, T]), with no causal mask: every block position sees the whole block."""
    b, t, hq, hd = q.shape
    hkv = k_blk.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd)
    s_ctx = jnp.einsum("btkgd,bksd->bkgts", qg, k_ctx)
    s_blk = jnp.einsum("btkgd,bskd->bkgts", qg, k_blk)
    ctx_live = jnp.arange(k_ctx.shape[2])[None, :] < ctx_len[:, None]  # [B, W]
    scores = jnp.concatenate([jnp.where(ctx_live[:, None, None, None], s_ctx, NEG_INF),
                              jnp.where(blk_valid[:, None, None, None], s_blk, NEG_INF)], axis=-1)
    probs = jax.nn.softmax(scores.astype(jnp.float32) * hd ** -0.5, axis=-1).astype(v_blk.dtype)
    w = k_ctx.shape[2]
    o = (jnp.einsum("bkgts,bksd->btkgd", probs[..., :w], v_ctx)
         + jnp.einsum("bkgts,bskd->btkgd", probs[..., w:], v_blk))
    return o.reshape(b, t, hq, hd)


def _attend_cache(q, k_blk, v_blk, cache: KVCache, layer: int, blk_valid):
    """`_attend` over the smallest static window of the drafter cache that holds every row's context (as the
    verifier's decoder does: cost grows with the context, not the capacity)."""
    windows = window_sizes(cache.capacity)

    def at(w):
        return lambda q, kb, vb, kc, vc, n, bv: _attend(q, kb, vb, kc[:, :, :w], vc[:, :, :w], n, bv)

    args = (q, k_blk, v_blk, cache.keys[layer], cache.values[layer], cache.lengths, blk_valid)
    if len(windows) == 1:
        return at(windows[0])(*args)
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(windows), jnp.max(cache.lengths)), len(windows) - 1)
    return jax.lax.switch(index, [at(w) for w in windows], *args)


def block_inputs(dp: DrafterParams, tparams, last: jax.Array, block: int, known=None, known_mask=None):
    """The block's input embeddings [B, block + 1, D]: the verifier's embedding of `last` [B], then the mask vector
    (or, where known_mask [B, block] is set, the embedding of known [B, block]: refinement and its training)."""
    x_last = embed(tparams, last[:, None])
    masks = jnp.broadcast_to(dp.mask.astype(x_last.dtype), (last.shape[0], block, x_last.shape[-1]))
    if known is not None:
        masks = jnp.where(known_mask[..., None], embed(tparams, known), masks)
    return jnp.concatenate([x_last, masks], axis=1)


def draft_logits(dp: DrafterParams, dcfg: DrafterConfig, tparams, cache: KVCache, last: jax.Array, block: int,
                 head: jax.Array, known=None, known_mask=None) -> jax.Array:
    """Logits [B, block, Vd] over the draft vocabulary (`head` [Vd, D], from draft_head) of the `block` tokens after
    `last` [B], which sits at position cache.lengths (the context holds the verifier's features of every earlier
    position). `known` holds verifier token ids."""
    x = block_inputs(dp, tparams, last, block, known, known_mask)
    positions = cache.lengths[:, None] + jnp.arange(block + 1, dtype=jnp.int32)[None, :]
    cos, sin = head_angles(dcfg.layer, positions)
    valid = jnp.ones(positions.shape, bool)
    x, _ = layers_forward(dp.layers, dcfg.layer, x, cos, sin,
                          lambda i, q, k, v, c: (_attend_cache(q, k, v, cache, i, valid), c))
    x = rms_norm(x[:, 1:], dp.final_norm, dcfg.layer.rms_norm_eps)
    return jnp.einsum("btd,vd->btv", x, head).astype(jnp.float32)


def draft(dp: DrafterParams, dcfg: DrafterConfig, tparams, cache: KVCache, last: jax.Array, block: int,
          head: jax.Array, refine: int = 0, threshold: float = 0.5) -> tuple[jax.Array, jax.Array]:
    """Greedy block draft: (verifier token ids int32 [B, block], logits [B, block, Vd] over the draft vocabulary).

    `refine` > 0 runs that many more passes: each keeps the drafted tokens before the first position whose
    probability is under `threshold` as known inputs (embedded instead of masked) and re-predicts the rest, so the
    later positions condition on a confident prefix (the drafter is trained with known prefixes for this)."""
    ids = (lambda i: i) if dp.vocab_ids is None else (lambda i: dp.vocab_ids[i])
    logits = draft_logits(dp, dcfg, tparams, cache, last, block, head)
    tokens = ids(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    for _ in range(refine):
        conf = jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)  # [B, block]
        sure = jnp.cumprod(conf >= threshold, axis=1).astype(bool)  # the confident prefix
        new = draft_logits(dp, dcfg, tparams, cache, last, block, head, tokens, sure)
        logits = jnp.where(sure[..., None], logits, new)
        tokens = ids(jnp.argmax(logits, axis=-1).astype(jnp.int32))
    return tokens, logits


# ---- training forward: many blocks per sequence at once ------------------------------------------------------------

def train_logits(dp: DrafterParams, dcfg: DrafterConfig, tparams, features: jax.Array, tokens: jax.Array,
                 anchors: jax.Array, sizes: jax.Array, block: int, head: jax.Array,
                 known_len: jax.Array | None = None) -> jax.Array:
    """Logits [B, K, block, Vd] of K blocks per sequence, all in one pass (what `draft_logits` computes for each).

    features [B, S, F] of tokens [B, S]; anchors [B, K]: the position of each block's `last` token, whose context is
    positions < anchor; sizes [B, K]: the block size each block is trained at (positions past it are neither seen
    nor predicted, so one drafter serves several block sizes); known_len [B, K]: the first known_len positions of
    the block are given as their true tokens (refinement training), 0 for none."""
    b, s = tokens.shape
    k = anchors.shape[1]
    j = jnp.arange(block + 1, dtype=jnp.int32)
    positions = anchors[:, :, None] + j  # [B, K, block + 1]
    truth = jnp.take_along_axis(tokens[:, None, :], jnp.minimum(positions, s - 1), axis=2)  # [B, K, block + 1]
    known_mask = (j[1:][None, None] <= (known_len if known_len is not None else jnp.zeros_like(sizes))[..., None])
    x = block_inputs(dp, tparams, truth[:, :, 0].reshape(b * k), block, truth[:, :, 1:].reshape(b * k, block),
                     known_mask.reshape(b * k, block))
    x = x.reshape(b, k * (block + 1), -1)
    flat_pos = positions.reshape(b, k * (block + 1))
    cos, sin = head_angles(dcfg.layer, flat_pos)
    blk_valid = (j[None, None] <= sizes[..., None])  # [B, K, block + 1]
    ctx = context_kv(dp, dcfg, features, jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)))
    ctx_live = jnp.arange(s)[None, None, :] < anchors[..., None]  # [B, K, S]
    hd = dcfg.layer.head_dim

    def attention(i, q, kb, vb, carry):  # each block over its context (positions < its anchor) and itself
        kc, vc = ctx[i]
        hq, hkv = q.shape[2], kb.shape[2]
        qg = q.reshape(b, k, block + 1, hkv, hq // hkv, hd)
        kb = kb.reshape(b, k, block + 1, hkv, hd)
        vb = vb.reshape(b, k, block + 1, hkv, hd)
        s_ctx = jnp.einsum("bntkgd,bskd->bnkgts", qg, kc)
        s_blk = jnp.einsum("bntkgd,bnskd->bnkgts", qg, kb)
        scores = jnp.concatenate([jnp.where(ctx_live[:, :, None, None, None], s_ctx, NEG_INF),
                                  jnp.where(blk_valid[:, :, None, None, None], s_blk, NEG_INF)], axis=-1)
        probs = jax.nn.softmax(scores.astype(jnp.float32) * hd ** -0.5, axis=-1).astype(vb.dtype)
        o = (jnp.einsum("bnkgts,bskd->bntkgd", probs[..., :s], vc)
             + jnp.einsum("bnkgts,bnskd->bntkgd", probs[..., s:], vb))
        return o.reshape(b, k * (block + 1), hq, hd), carry

    x, _ = layers_forward(dp.layers, dcfg.layer, x, cos, sin, attention)
    x = rms_norm(x.reshape(b, k, block + 1, -1)[:, :, 1:], dp.final_norm, dcfg.layer.rms_norm_eps)
    return jnp.einsum("bntd,vd->bntv", x, head).astype(jnp.float32)

"""The compiled programs of the serving engine: prefill a batch of new prompts into caches, insert them into free
slots of the one batched decode cache, and advance every slot by one token.

Why these shapes. The decode cache is fixed ([L, slots, Hkv, capacity, hd]), so one decode program serves every mix
of requests; a slot joins or leaves between two steps by writing its row (insert) or by being masked (step). The
prefill side pads a batch's prompts to a bucket of the token axis and its batch to a power of two, so a few programs
cover every prompt. Each row is computed exactly as the offline `kvjax.split_generate` computes it (the same
builders, prefill of all but the last prompt token, the last token read by the first decode step), and padding rows
or positions only ever meet masked attention, so a greedy answer does not depend on what else is in the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import aot
from kvjax.builders import Mapped, NativePrefill
from kvjax.cache import KVCache, init_cache, window_sizes
from kvjax.generation.sampling import sample_rows
from kvjax.models.decoder import forward


def buckets(capacity: int) -> tuple[int, ...]:
    """Prefill lengths (the token axis a batch is padded to): the attention windows of a cache of `capacity`
    (about two per octave from 128), with 64 in front for short prompts: a handful of compiles, <= 1.5x padding."""
    return tuple(sorted({min(64, capacity), *window_sizes(capacity)}))


def bucket_for(n: int, sizes: tuple[int, ...]) -> int:
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} prompt tokens do not fit the largest prefill bucket {sizes[-1]}")


def batch_size_for(n: int, max_batch: int) -> int:
    """The padded prefill batch: the next power of two (capped at max_batch)."""
    return min(max_batch, 1 << max(0, (n - 1).bit_length()))


def prefill_builder(source, target, kvmap, split: bool):
    """The cache builder of the served path: source prefill + map (split) or the target's own prefill (the map's
    gate failed): the same builders `split_generate` / `native_generate` use."""
    return Mapped(source, target, kvmap) if split else NativePrefill(target)


def audio_builder(source, target, kvmap, alm, clips: list[np.ndarray]):
    """The cache builder of a batch of spoken prompts: the source's audio-language model (alm, around `source`)
    listens to `clips` (log-mel [M, frames] each, in the order of their placeholder runs, row by row), `kvmap` (the
    audio map) translates its cache: offline `Mapped(source, target, kvmap, shared=AudioPrefill(alm).set_audio(..))`.
    The clips are zero-padded to a multiple of 128 frames (kvjax.eval.audio_transfer.clip_inputs; per-clip frames are
    passed, so padding is masked): a few encoder programs cover every length."""
    return Mapped(source, target, kvmap, name="audio", shared=own_audio_builder(alm, clips))


def own_audio_builder(alm, clips: list[np.ndarray]):
    """An audio-language model (alm) listens to `clips` (as `audio_builder`) and its own LM's cache answers: offline
    `AudioPrefill(alm).set_audio(..)`. The server's native audio path (alm: the answerer's own adapter), and the
    listening half of the split one."""
    from kvjax.builders.audio_prefill import AudioPrefill
    from kvjax.eval.audio_transfer import clip_inputs
    features, frames, _ = clip_inputs(clips, alm.stack_factor, alm.encoder.cfg.max_frames)
    return AudioPrefill(alm, name="audio", memo=False).set_audio(features, frames)


def prefill_batch(builder, prompts: list[list[int]], bucket: int, batch: int) -> KVCache:
    """The answering model's cache of every prompt but its last token, rows padded to `batch` (padding rows hold one
    token) and positions to `bucket`: KVCache [L, batch, Hkv, bucket, hd]."""
    tokens = np.zeros((batch, bucket), np.int32)
    lengths = np.ones((batch,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p) - 1] = p[:-1]
        lengths[i] = len(p) - 1
    return builder(tokens, lengths, capacity=bucket)


def empty_slots(cfg, slots: int, capacity: int, dtype, place=None) -> KVCache:
    """The decode slots' cache, keys held transposed (kvjax.cache: decode reads them without repacking), made where
    `place` (a kvjax.serve.placement.Placement) keeps it."""
    if place is not None:
        return place.empty_cache(cfg, slots, capacity, dtype, keys_transposed=True)
    return init_cache(cfg, slots, capacity, dtype, keys_transposed=True)


@functools.partial(aot.jit, donate_argnames=("cache",))
def insert(cache: KVCache, new: KVCache, slots: jax.Array) -> KVCache:
    """Write the rows of `new` (b rows of T <= capacity positions) into rows `slots` [b] of `cache`, in place (the
    cache is donated: a scatter into its own buffers, no copy of the other slots). A slot index >= the number of
    slots drops its row (padding rows of a prefill batch). `new`'s keys are brought to the layout `cache` holds."""
    t = new.capacity
    new = new.with_keys_transposed(cache.keys_transposed)

    def put(bufs, news, axis):
        where = (slots,) + (slice(None),) * (axis - 1) + (slice(0, t),)  # rows `slots`, positions [0, t)
        return tuple(b.at[where].set(n.astype(b.dtype), mode="drop") for b, n in zip(bufs, news))

    lengths = cache.lengths.at[slots].set(new.lengths, mode="drop")
    return cache.replace(keys=put(cache.keys, new.keys, 3 if cache.keys_transposed else 2),
                         values=put(cache.values, new.values, 2), lengths=lengths)


def row_buckets(slots: int) -> tuple[int, ...]:
    """The decode step's row counts: powers of two below `slots`, and `slots`."""
    return tuple(sorted({1 << i for i in range(max(slots - 1, 0).bit_length()) if 1 << i < slots} | {slots}))


@functools.partial(aot.jit, static_argnames=("cfg", "rows"), donate_argnames=("cache",))
def step(params, cfg, cache: KVCache, tokens, active, temperature, top_p, seeds, counters, rows: int | None = None):
    """Every slot reads its input token (int32 [S]: a new request's last prompt token, else its latest generated
    one) and picks the next: (next tokens int32 [S], cache). Greedy rows (temperature 0) take the argmax, as
    `kvjax.generation.sample` does. Free slots (`active` False) compute too (one program for every mix) but their
    length is reset to 0, so they never grow and never widen the attention window of the others.

    `rows` (static, a `row_buckets` size): compute only slots [0, rows), which must hold every active slot; the
    others keep their cache and get token 0. The engine fills the lowest free slots first, so at low load a step
    reads a few rows of the cache instead of all of them (one program per bucket)."""
    s = tokens.shape[0]
    rows = s if rows is None else rows
    nxt, cache, _ = _decode(params, cfg, cache, tokens, active, temperature, top_p, seeds, counters, rows, ())
    return jnp.pad(nxt, (0, s - rows)), cache


def _decode(params, cfg, cache, tokens, active, temperature, top_p, seeds, counters, rows: int, layers: tuple):
    """`step`'s work (traceable): (next tokens [rows], cache, the verifier's features of `layers` [rows, 1, F] or
    None)."""
    out = forward(params, cfg, tokens[:rows, None], cache, features=layers)
    logits, cache, feats = out.logits[:, 0], out.cache, out.features
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature[:rows] > 0
    nxt = jax.lax.cond(jnp.any(sampled & active[:rows]),
                       lambda: jnp.where(sampled, sample_rows(logits, temperature[:rows], top_p[:rows],
                                                              _row_keys(seeds[:rows], counters[:rows])), greedy),
                       lambda: greedy)
    return nxt, cache.replace(lengths=jnp.where(active, cache.lengths, 0)), feats


# ---- speculative decoding: a verify round over the slots (kvjax.serve.drafting) ----------------------------------
# A round verifies at a static width (kvjax.speculative.verify_block says why), chosen by the engine before the step
# from what each row would draft, which every step's program looks up ahead for the next (`lookahead`).

def _take_rows(tree, rows: int, slots: int):
    """The first `rows` rows of every per-slot array of a drafter state (leaves whose first axis is the slots);
    other leaves (a drafter's scalar counters) as they are."""
    if rows == slots:
        return tree
    return jax.tree.map(lambda a: a[:rows] if a.ndim and a.shape[0] == slots else a, tree)


def _put_rows(tree, sub, rows: int, slots: int):
    """`tree` with its first `rows` rows replaced by `sub`'s (the inverse of _take_rows); other leaves from `sub`."""
    if rows == slots:
        return sub
    return jax.tree.map(lambda a, b: a.at[:rows].set(b) if a.ndim and a.shape[0] == slots else b, tree, sub)


def _row_keys(seeds, counters):
    """Each row's key: its request's seed and the tokens it generated so far (a seeded request samples the same
    tokens whatever else shares the batch)."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)


def lookahead(drafter, state, tokens, active):
    """What the next round would draft in each row after its input token `tokens` [B] (traceable; a pure look-up,
    the state is not changed): (lengths int32 [B]: the drafts a row would propose, 0 for rows not `active`;
    sources int32 [B]: what drafts them, n >= 1 prompt lookup's copy after a recurring n-gram of n tokens, 0 the
    model drafter (or nothing)). The engine chooses the next step's verify width from them
    (kvjax.serve.scheduler.DraftPolicy): a row's acceptance depends on what drafted it, and a round wider than the
    longest draft verifies nothing more."""
    from kvjax.speculative import CombinedDrafter, LookupDrafter
    b, g = tokens.shape[0], drafter.draft_len
    full = jnp.full((b,), g, jnp.int32)
    if isinstance(drafter, LookupDrafter):
        drafts, sources, _ = drafter.match(state, tokens)
        lengths = jnp.sum(jnp.cumprod((drafts >= 0).astype(jnp.int32), axis=-1), axis=-1)
    elif isinstance(drafter, CombinedDrafter):  # the copy where its n-gram is long enough, the model drafter else
        drafts, n, _ = drafter.lookup.match(state.lookup, tokens)
        copy = n >= drafter.min_match
        sources = jnp.where(copy, n, 0)
        # spliced: the model drafter fills a block after a copy's end; else a copy is drafted alone
        copied = jnp.sum(jnp.cumprod((drafts >= 0).astype(jnp.int32), axis=-1), axis=-1)
        lengths = full if drafter.splice else jnp.where(copy, copied, full)
    else:  # a model drafter: every row drafts g
        lengths, sources = full, jnp.zeros((b,), jnp.int32)
    return jnp.where(active, lengths, 0).astype(jnp.int32), sources.astype(jnp.int32)


@aot.jit
def new_rows_lookahead(drafter, state, tokens, active):
    """`lookahead` of a prefilled batch's drafter state (the rows a batch adds: their first round's drafts)."""
    return lookahead(drafter, state, tokens, active)


def _sampling(sampled: bool):
    """What the drafter drafts with: its own distribution at temperature 1 when some row samples (any q keeps the
    rejection rule exact, and greedy rows accept by argmax whatever was drafted), greedily otherwise."""
    from kvjax.generation.sampling import Sampling
    return Sampling(1.0) if sampled else Sampling()


@functools.partial(aot.jit, static_argnames=("cfg", "rows", "sampled", "width"), donate_argnames=("cache", "state"))
def round_step(params, cfg, cache: KVCache, drafter, state, tokens, active, temperature, top_p, seeds, counters,
               step_id, rows: int, sampled: bool, width: int):
    """A verify round over slots [0, rows): each occupied row's drafter proposes up to g tokens after its input token
    (free slots draft nothing), the target reads the input token and the first width - 1 drafts in one forward over
    its cache (kvjax.speculative.verify_block at the static `width`, which the engine chose from the last step's
    `lookahead`), and each row keeps its accepted drafts and the target's own next token. Greedy rows
    accept a draft while it is the target's argmax (`accept_greedy`: the answer is the target's greedy decode);
    with `sampled` (static: some slot samples) the other rows take the rejection rule with their own temperature,
    top_p and key (`accept_sampled_rows`), so their tokens are distributed as the target's sampling.

    Returns (tokens int32 [S, width], n_new int32 [S]: a row's new tokens are tokens[:n_new] (0 for free slots and
    past `rows`), drafted int32 [S]: drafts verified, the next round's drafts (`lookahead`: lengths [S], sources
    [S]), cache, state). Each row's cache and drafter state roll back to what it accepted; free slots' lengths are
    reset to 0, as in `step`."""
    from kvjax.speculative.loop import accept_greedy, accept_sampled_rows, verify_block
    s = tokens.shape[0]
    live = active[:rows]
    sub = _take_rows(state, rows, s)
    key = jax.random.fold_in(jax.random.key(0), step_id)
    drafts, q, sub = drafter.propose(sub, tokens[:rows], key, _sampling(sampled))
    drafts = jnp.where(live[:, None], drafts, -1)
    drafts, q, logits, cache, feats = verify_block((cfg, params), cache, tokens[:rows], drafts, q,
                                                   tuple(drafter.feature_layers), width)
    n_acc, toks = accept_greedy(logits, drafts)
    if sampled:
        hot = temperature[:rows] > 0
        n_hot, toks_hot = accept_sampled_rows(logits, drafts, q, _row_keys(seeds[:rows], counters[:rows]),
                                              jnp.where(hot, temperature[:rows], 1.0), top_p[:rows])
        n_acc, toks = jnp.where(hot, n_hot, n_acc), jnp.where(hot[:, None], toks_hot, toks)
    n_new = jnp.where(live, n_acc + 1, 0)
    sub = drafter.commit(sub, _full_width(toks, drafter.draft_len + 1), n_new, feats)
    lengths = cache.lengths.at[:rows].add(n_new)  # roll back: the pending token and the accepted drafts stay
    cache = cache.replace(lengths=jnp.where(active, lengths, 0))
    drafted = jnp.sum(jnp.cumprod((drafts >= 0).astype(jnp.int32), axis=-1), axis=-1)
    ahead = lookahead(drafter, sub, toks[jnp.arange(rows), jnp.maximum(n_new - 1, 0)], live)
    pad = lambda a: jnp.pad(a, ((0, s - rows),) + ((0, 0),) * (a.ndim - 1))  # noqa: E731
    return (pad(toks), pad(n_new), pad(drafted), pad(ahead[0]), pad(ahead[1]), cache,
            _put_rows(state, sub, rows, s))


def _full_width(a, width: int):
    """tokens [B, t] padded to [B, width] (a drafter's commit reads g + 1 of them; those past the round's n_new are
    junk by its contract)."""
    return jnp.pad(a, ((0, 0), (0, width - a.shape[1])))


@functools.partial(aot.jit, static_argnames=("cfg", "rows"), donate_argnames=("cache", "state"))
def plain_step(params, cfg, cache: KVCache, drafter, state, tokens, active, temperature, top_p, seeds, counters,
               rows: int):
    """`step` for an engine that drafts, on a step where it does not: one token per slot, and each occupied row's
    drafter state advances over it without drafting (`advance`: the lookup's context grows by the token, the block
    drafter's context by the target's features of it, returned by this same forward). Returns (next tokens [S], the
    next round's drafts (`lookahead`: lengths [S], sources [S]), cache, state)."""
    s = tokens.shape[0]
    nxt, cache, feats = _decode(params, cfg, cache, tokens, active, temperature, top_p, seeds, counters, rows,
                                tuple(drafter.feature_layers))
    sub = drafter.advance(_take_rows(state, rows, s), tokens[:rows], nxt[:, None],
                          active[:rows].astype(jnp.int32), feats)
    lengths, sources = lookahead(drafter, sub, nxt, active[:rows])
    pad = lambda a: jnp.pad(a, (0, s - rows))  # noqa: E731
    return pad(nxt), pad(lengths), pad(sources), cache, _put_rows(state, sub, rows, s)


@functools.partial(aot.jit, donate_argnames=("state",))
def insert_rows(state, new, slots: jax.Array):
    """Write the rows of drafter state `new` (b rows) into rows `slots` [b] of the slots' drafter state, in place;
    a slot index >= the number of slots drops its row (as `insert`). Leaves without a row axis stay as they are."""
    n = state_rows(state)
    return jax.tree.map(lambda a, b: a.at[slots].set(b.astype(a.dtype), mode="drop")
                        if a.ndim and a.shape[0] == n else a, state, new)


def state_rows(state) -> int:
    """The rows of a drafter state: the longest first axis of its leaves (its per-row arrays)."""
    return max(a.shape[0] for a in jax.tree.leaves(state) if a.ndim)


@functools.partial(aot.jit, static_argnames=("cfg", "layers"))
def context_features(params, cfg, cache: KVCache, tokens, start, layers: tuple):
    """The target's features ([B, T, F], `layers`' outputs) of tokens [B, T] at positions start .. start + T - 1,
    reading its cache before `start` [B] (the prefilled cache of a new batch; nothing is written): what the block
    drafter's context starts from (kvjax.serve.drafting)."""
    return forward(params, cfg, tokens, cache.replace(lengths=start), write=False, logits=None,
                   features=layers).features

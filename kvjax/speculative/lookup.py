"""The lookup drafter: drafts by copying what followed the context's latest n-gram match (prompt lookup decoding).

Text often repeats itself: code edits, summaries and answers quote their prompt, and greedy decoding of a small LM
falls into loops (on the toy source's held-out windows prompt lookup accepts 3.5-4.5 tokens a round at draft length
4-8: `python -m launch.bench.speculative`).
The drafter keeps the context as token ids (no weights, no cache), finds the latest earlier occurrence of the
context's last n tokens (n from `max_ngram` down to `min_ngram`: the longest match wins, then the latest), and
proposes the up to `draft_len` tokens that followed it. Where nothing matches it proposes nothing, and the verify
loop then runs the pending token alone (the loop's variable-length path): a round costs about one plain decode step.

The drafts are deterministic, so their distribution q is one-hot: under sampling the rejection rule accepts a draft
x with probability p(x) and otherwise draws from norm(max(0, p - q)), which keeps the output distributed as the
verifier's (kvjax.speculative.loop). Prior art: Saxena's prompt lookup decoding (2023), transformers'
prompt_lookup_num_tokens, vLLM's n-gram speculator. It implements the drafter interface of kvjax.speculative.loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class LookupState:
    history: jax.Array  # [B, H] int32: each row's context; entries at and past `length` are dead
    length: jax.Array  # [B] int32: context tokens held, the pending token excluded


def match_end(history: jax.Array, length: jax.Array, max_ngram: int, min_ngram: int) -> tuple[jax.Array, jax.Array]:
    """For one row: history [H] whose first `length` tokens are the context. Returns (end, n): the latest position
    `end` < length with history[end - n : end] == history[length - n : length] for the largest n in
    [min_ngram, max_ngram] that has a match (so history[end] is what followed that occurrence); n = 0 (end
    unspecified) when no n-gram of at least min_ngram tokens recurs."""
    h = history.shape[0]
    ends = jnp.arange(h)
    run = jnp.ones((h,), bool)
    matched = jnp.zeros((h,), jnp.int32)  # matched[e]: how many tokens before e equal the context's last ones
    for j in range(max_ngram):  # static shifts and one scalar read each: no gathers (a decode round is ~1 ms)
        at = length - 1 - j
        mine = jnp.where(at >= 0, jax.lax.dynamic_index_in_dim(history, jnp.maximum(at, 0), keepdims=False), -2)
        shift = min(j + 1, h)
        theirs = jnp.concatenate([jnp.full((shift,), -1, history.dtype), history[: h - shift]])  # history[e - 1 - j]
        run = run & (theirs == mine)  # token ids are >= 0: the -1 fill (before the start) and -2 never match
        matched = matched + run.astype(jnp.int32)
    matched = jnp.where((ends < length) & (matched >= min_ngram), matched, 0)
    best = jnp.argmax(matched * h + ends)  # longest match first, then the latest occurrence
    return best, matched[best]


def match_end_reference(history: np.ndarray, length: int, max_ngram: int, min_ngram: int) -> tuple[int, int]:
    """Plain-Python `match_end`, for tests."""
    ctx = [int(t) for t in history[:length]]
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > len(ctx):
            continue
        suffix = ctx[len(ctx) - n:]
        for end in range(len(ctx) - 1, n - 1, -1):
            if ctx[end - n:end] == suffix:
                return end, n
    return 0, 0


@struct.dataclass
class LookupDrafter:
    """Prompt lookup: `draft_len` tokens copied from after the latest match of the context's last n-gram.

    vocab_size: the verifier's (for the one-hot draft distribution under sampling). max_ngram / min_ngram: the
    longest and shortest suffix tried (min_ngram 1 lets a single repeated token propose; 2-3 proposes less often and
    more surely)."""

    vocab_size: int = struct.field(pytree_node=False)
    draft_len: int = struct.field(pytree_node=False, default=4)
    max_ngram: int = struct.field(pytree_node=False, default=3)
    min_ngram: int = struct.field(pytree_node=False, default=1)
    feature_layers: tuple = struct.field(pytree_node=False, default=())
    variable_length: bool = struct.field(pytree_node=False, default=True)

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"LookupDrafter needs 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                             f"max_ngram={self.max_ngram}")

    def start(self, tokens, lengths, capacity: int, features=None) -> LookupState:
        tokens = np.asarray(tokens, np.int32)
        history = np.zeros((tokens.shape[0], int(capacity) + self.draft_len + 1), np.int32)
        history[:, : tokens.shape[1]] = tokens
        return LookupState(history=jnp.asarray(history), length=jnp.asarray(lengths, jnp.int32))

    def propose(self, state: LookupState, last, key, sampling):
        drafts, _, state = self.match(state, last)
        q = None
        if sampling.temperature != 0.0:
            q = jax.nn.one_hot(drafts, self.vocab_size, dtype=jnp.float32)  # all zeros where drafts == -1
        return drafts, q, state

    def match(self, state: LookupState, last):
        """propose's drafts [B, draft_len] (-1 past each row's last) with the length of the n-gram each row matched
        [B] (0: no match; how sure the copy is, for a drafter that combines lookup with another,
        kvjax.speculative.combined) and the state holding the pending token."""
        g = self.draft_len
        put = jax.vmap(lambda row, tok, at: jax.lax.dynamic_update_slice(row, tok[None], (at,)))
        history = put(state.history, last.astype(jnp.int32), state.length)  # the pending token is context too
        length = state.length + 1
        end, n = jax.vmap(lambda row, m: match_end(row, m, self.max_ngram, self.min_ngram))(history, length)
        at = end[:, None] + jnp.arange(g)[None]  # what followed the match, up to the context's end
        drafts = jnp.take_along_axis(history, jnp.minimum(at, history.shape[1] - 1), axis=1)
        drafts = jnp.where((n[:, None] > 0) & (at < length[:, None]), drafts, -1)
        return drafts, n, state.replace(history=history)

    def advance(self, state: LookupState, last, tokens, n_new, features=None) -> LookupState:
        """A round that drafted nothing (a plain decode step): the pending token `last` and the verifier's token
        become context as propose + commit would leave them, without the match."""
        put = jax.vmap(lambda row, tok, at: jax.lax.dynamic_update_slice(row, tok[None], (at,)))
        return self.commit(state.replace(history=put(state.history, last.astype(jnp.int32), state.length)), tokens,
                           n_new)

    def commit(self, state: LookupState, tokens, n_new, features=None) -> LookupState:
        # propose wrote the round's pending token at `length`; the accepted drafts follow it, and the verifier's own
        # token (tokens[n_new - 1]) is the next pending one, written by the next propose
        put = jax.vmap(lambda row, toks, at: jax.lax.dynamic_update_slice(row, toks, (at,)))
        live = n_new > 0
        written = put(state.history, tokens[:, : self.draft_len].astype(jnp.int32), state.length + 1)
        return state.replace(history=jnp.where(live[:, None], written, state.history),
                             length=state.length + n_new)

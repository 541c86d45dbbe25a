"""The plain drafter: a small causal LM (a Model as kvjax.load_hf returns it) drafting from its own KV cache.

It implements the drafter interface of kvjax.speculative.loop. Its cache holds the prompt and every token emitted so
far except the pending one, with one twist: when the verifier accepted all gamma drafts, the last draft d_gamma was
never run through the drafter (it was only its output), so it is kept as an `extra` token and the next round's first
drafter step runs [d_gamma, last] as one 2-token forward (rows without an extra run [last] with length 1 in the same
call). That keeps a round at exactly gamma drafter forwards whatever was accepted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.builders import NativePrefill
from kvjax.cache import KVCache
from kvjax.generation import Sampling, draw, sampling_probs
from kvjax.models.decoder import decode, forward


@struct.dataclass
class DraftState:
    cache: KVCache  # the drafter's cache
    extra: jax.Array  # [B] int32: the accepted draft d_gamma not yet in the cache (where has_extra)
    has_extra: jax.Array  # [B] bool
    base: jax.Array  # [B] int32: cache length after this round's first step (before the later drafts)


@struct.dataclass
class ModelDrafter:
    """A draft model proposing `draft_len` tokens per round, one forward per token (the first may carry 2)."""

    model: object  # kvjax Model (cfg static, params leaves)
    draft_len: int = struct.field(pytree_node=False, default=4)
    feature_layers: tuple = struct.field(pytree_node=False, default=())
    # > 0: a row stops drafting at its first token whose drafter probability (softmax of its logits, temperature 1)
    # is below this, and the loop verifies only up to the longest draft (see loop.py, variable_length). The toy
    # target's greedy token agrees with the source's 19% of the time below probability 0.1 and 64-100% above 0.2.
    min_confidence: float = struct.field(pytree_node=False, default=0.0)

    @property
    def variable_length(self) -> bool:
        return self.min_confidence > 0

    def start(self, tokens, lengths, capacity: int, features=None) -> DraftState:
        """Prefill the prompts but their last tokens (tokens [B, T], lengths [B]) into a fresh cache."""
        return self.from_cache(NativePrefill(self.model)(tokens, lengths, capacity=int(capacity)))

    def from_cache(self, cache: KVCache) -> DraftState:
        """A state around a cache the drafter's model already holds (e.g. the prefill a speculative KV transfer also
        maps for the verifier): no second prefill."""
        b = cache.batch_size
        return DraftState(cache=cache, extra=jnp.zeros((b,), jnp.int32), has_extra=jnp.zeros((b,), bool),
                          base=cache.lengths)

    def propose(self, state: DraftState, last, key, sampling: Sampling):
        cfg, params = self.model
        g = self.draft_len
        greedy = sampling.temperature == 0.0
        keys = jax.random.split(key, g)

        def pick(logits, k):  # logits [B, V] -> (token [B], q [B, V] or None, sure [B] bool)
            sure = jnp.max(jax.nn.softmax(logits.astype(jnp.float32), -1), -1) >= self.min_confidence
            if greedy:
                return jnp.argmax(logits, axis=-1).astype(jnp.int32), None, sure
            q = sampling_probs(logits, sampling)
            return draw(q, k), q, sure

        def one(cache):  # no row carries an extra token: a plain 1-token step
            return decode(params, cfg, last, cache)

        def two(cache):  # [extra, last] where a row has an extra, [last, pad] (length 1) where not
            first = jnp.where(state.has_extra[:, None], jnp.stack([state.extra, last], 1),
                              jnp.stack([last, jnp.zeros_like(last)], 1))
            out = forward(params, cfg, first, cache, lengths=1 + state.has_extra.astype(jnp.int32), logits="last")
            return out.logits, out.cache

        # a 2-token step costs ~2x a 1-token one on CPU (small-M GEMMs), so take it only when some row needs it
        logits, cache = jax.lax.cond(jnp.any(state.has_extra), two, one, state.cache)
        tok, q, sure = pick(logits, keys[0])
        base = cache.lengths

        if g == 1:
            drafts, qs, sures = tok[:, None], (None if greedy else q[:, None]), sure[:, None]
        else:
            def step(carry, k):
                tok, cache = carry
                logits, cache = decode(params, cfg, tok, cache)
                nxt, q, sure = pick(logits, k)
                return (nxt, cache), (nxt, q, sure)

            (_, cache), (rest, rest_q, rest_sure) = jax.lax.scan(step, (tok, cache), keys[1:])
            drafts = jnp.concatenate([tok[:, None], rest.T], axis=1)
            qs = None if greedy else jnp.concatenate([q[:, None], rest_q.transpose(1, 0, 2)], axis=1)
            sures = jnp.concatenate([sure[:, None], rest_sure.T], axis=1)
        if self.variable_length:  # -1 from a row's first unsure token on (the tokens were still run: junk, rolled back)
            drafts = jnp.where(jnp.cumprod(sures.astype(jnp.int32), axis=-1) > 0, drafts, -1)
        return drafts, qs, state.replace(cache=cache, base=base)

    def commit(self, state: DraftState, tokens, n_new, features=None) -> DraftState:
        g = self.draft_len
        n_acc = n_new - 1
        live = n_new > 0
        # the cache holds [extra?, last, d_1 .. d_{g-1}]: keep up to the accepted drafts (d_g was never run)
        before = state.base - 1 - state.has_extra.astype(jnp.int32)  # length before this round
        lengths = jnp.where(live, state.base + jnp.minimum(n_acc, g - 1), before)
        full = live & (n_acc == g)
        return state.replace(cache=state.cache.replace(lengths=lengths),
                             extra=jnp.where(live, jnp.where(full, tokens[:, g - 1], 0), state.extra),
                             has_extra=jnp.where(live, full, state.has_extra))

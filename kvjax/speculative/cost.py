"""The cost model of speculative decoding: a run's time predicted from what it did and what each part costs.

A speculative run is a sequence of rounds. A round runs the drafter (propose + commit) and ONE verify forward of t
tokens (the pending token and t - 1 drafts), plus the loop's bookkeeping; plain decoding runs one decode step per
token. So a run that emitted N tokens in R rounds, of which w[t] verified t tokens, and called each drafting part k
(a model drafter, prompt lookup) n_k times, takes

    T_spec = sum_t w[t] * v(t) + sum_k n_k * d_k        against        T_plain = N * s

where s is one step of plain decoding, v(t) one round of the verify loop at width t with a drafter that costs nothing,
and d_k what part k adds to a round. In decode-step units (c_verify(t) = v(t) / s, c_draft = d / s) the speed-up of
a fixed-length drafter (every round at t = b + 1) is the familiar

    speed-up = tau / (c_verify(b + 1) + c_draft(b))        tau = N / R

tau, w and n_k are properties of the drafter and the text: the same on every machine for the same models and
prompts (greedy decoding is deterministic). s, v(t) and d_k are properties of the machine. On the project's CPU
a (b + 1)-token verify of the toy source costs several decode steps (its weights stay in cache, so a step is
compute-bound); on an accelerator, where a step streams the weights from memory, it costs about one. So a speed-up
is stated as a toy's measured tau and w priced at a device's measured costs, and on this CPU the prediction is checked
against the measured speed-up of the same runs (launch/bench/spec_cost.py; the accelerator script prices the parts
at Qwen3-8B shapes on a device).

How the parts are measured: each inside the compiled verify loop itself, so what is measured includes the loop's
bookkeeping and the lax.switch over widths, and no call's dispatch:

    v(t)  `NullDrafter(width=t)`: proposes t - 1 drafts of an id the verifier never predicts (the last of the
          vocabulary), so every round emits one token: time / rounds. `variable_length` picks the loop's path (a
          fixed-length forward, or the switch over widths that variable-length drafters take).
    d     `Ignored(drafter)`: the drafter runs as usual (its proposals computed, its state committed each round), but
          the verifier sees never-accepted ids at full width; time / rounds - v(draft_len + 1) on the same path. This
          counts what the drafter costs the verifier too (a block drafter's verify also returns the features of
          several layers, and its weights share the caches with the verifier's), not only its propose and commit.

The emitted tokens of both are the verifier's own greedy tokens, so the contexts grow as in the real run.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class NullDrafter:
    """Costs nothing; proposes `width - 1` drafts of the id `vocab_size - 1` (never the argmax of a trained verifier;
    if a random one picks it, the round just emits more: costs are per round). Greedy only. `width` may be an int32
    scalar array (a pytree leaf), so one compiled loop measures every width of the variable-length path, or an int32
    [K] array, a schedule: round r verifies width[r % K] (variable-length path), as a real drafter's rounds change
    width from one round to the next."""

    vocab_size: int = struct.field(pytree_node=False)
    draft_len: int = struct.field(pytree_node=False, default=1)
    width: object = 2  # verify forward of `width` tokens: 1 .. draft_len + 1 (an int, an int32 scalar, a schedule)
    variable_length: bool = struct.field(pytree_node=False, default=False)
    feature_layers: tuple = struct.field(pytree_node=False, default=())

    def __post_init__(self):
        if isinstance(self.width, (int, np.integer)):
            if not 1 <= self.width <= self.draft_len + 1:
                raise ValueError(f"NullDrafter width {self.width} must be in 1..draft_len + 1 = {self.draft_len + 1}")
            if self.width < self.draft_len + 1 and not self.variable_length:
                raise ValueError("a fixed-length loop always verifies draft_len + 1 tokens; set variable_length=True "
                                 "to measure a narrower verify")
        elif np.ndim(self.width) == 1 and not self.variable_length:
            raise ValueError("a width schedule changes the width round by round: set variable_length=True")

    def start(self, tokens, lengths, capacity: int, features=None):
        return jnp.zeros((), jnp.int32)  # rounds so far (a schedule's index)

    def propose(self, state, last, key, sampling):
        j = jnp.arange(self.draft_len)[None]
        width = jnp.asarray(self.width)
        if width.ndim == 1:  # a schedule
            width = width[state % width.shape[0]]
        drafts = jnp.where(j < width - 1, self.vocab_size - 1, -1) + jnp.zeros_like(last)[:, None]
        return drafts.astype(jnp.int32), None, state

    def commit(self, state, tokens, n_new, features=None):
        return state + 1


@struct.dataclass
class Ignored:
    """`inner` drafting as usual, its drafts replaced by never-accepted ids at full width (greedy only)."""

    inner: object
    vocab_size: int = struct.field(pytree_node=False)

    @property
    def draft_len(self) -> int:
        return self.inner.draft_len

    @property
    def feature_layers(self) -> tuple:
        return tuple(self.inner.feature_layers)

    @property
    def variable_length(self) -> bool:
        return bool(getattr(self.inner, "variable_length", False))

    def start(self, tokens, lengths, capacity: int, features=None):
        return self.inner.start(tokens, lengths, capacity, features)

    def propose(self, state, last, key, sampling):
        drafts, _, state = self.inner.propose(state, last, key, sampling)
        # a data dependence on the real drafts, so XLA cannot drop the drafter's work; the comparison is never true
        never = jnp.full_like(drafts, self.vocab_size - 1)
        return jnp.where(drafts == -7, drafts, never).astype(jnp.int32), None, state

    def commit(self, state, tokens, n_new, features=None):
        return self.inner.commit(state, tokens, n_new, features)


@struct.dataclass
class Oracle:
    """Drafts the verifier's own greedy continuation (`reference`: [B, >= N] tokens after each prompt, from
    kvjax.generate), so every draft is accepted and every round emits draft_len + 1 tokens (greedy; on the fixed-length
    path, or with `variable_length` on the variable path at full width).
    With `accept` = k only the first k drafts are the greedy tokens (rounds emit k + 1). Beside NullDrafter at the
    same width (one token a round) it measures what accepting costs a round beyond verifying: the cost model prices
    a round by its width alone."""

    reference: object  # int32 [B, L], L >= N + draft_len (pad the tail: rounds past N draft anything)
    draft_len: int = struct.field(pytree_node=False, default=1)
    feature_layers: tuple = struct.field(pytree_node=False, default=())
    variable_length: bool = struct.field(pytree_node=False, default=False)
    accept: int | None = struct.field(pytree_node=False, default=None)  # k: only the first k drafts right (None: all)

    def start(self, tokens, lengths, capacity: int, features=None):
        return jnp.zeros((jnp.shape(self.reference)[0],), jnp.int32)  # tokens emitted so far, per row

    def propose(self, state, last, key, sampling):
        j = jnp.arange(self.draft_len)[None]
        at = jnp.minimum(state[:, None] + j, jnp.shape(self.reference)[1] - 1)
        drafts = jnp.take_along_axis(jnp.asarray(self.reference, jnp.int32), at, axis=1)
        if self.accept is not None:  # from draft k on, another id than the greedy one: the round accepts k
            drafts = jnp.where(j < self.accept, drafts, jnp.where(drafts > 0, drafts - 1, drafts + 1))
        return drafts, None, state

    def commit(self, state, tokens, n_new, features=None):
        return state + n_new


def predict_seconds(widths, verify_seconds: dict, calls: dict, call_seconds: dict) -> float:
    """T_spec = sum_t widths[t] * verify_seconds[t] + sum_k calls[k] * call_seconds[k] (the module docstring).

    widths: rounds per verify width (Stats.widths, index t); verify_seconds: {t: seconds of one round at width t}
    for every width the run used; calls / call_seconds: {part: how many times it ran} / {part: seconds it adds}."""
    missing = [t for t, w in enumerate(widths) if w and t not in verify_seconds]
    if missing:
        raise ValueError(f"no measured verify cost at width(s) {missing}, which the run used")
    if set(calls) - set(call_seconds):
        raise ValueError(f"no measured cost for drafting part(s) {sorted(set(calls) - set(call_seconds))}")
    return (sum(int(w) * verify_seconds[t] for t, w in enumerate(widths) if w)
            + sum(int(n) * call_seconds[k] for k, n in calls.items()))


def speedup(tau: float, c_verify: float, c_draft: float) -> float:
    """The fixed-length form in decode-step units: tau / (c_verify(b + 1) + c_draft(b))."""
    return tau / (c_verify + c_draft)

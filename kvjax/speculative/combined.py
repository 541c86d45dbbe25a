"""The combined drafter: prompt lookup where the text repeats, a model drafter everywhere else, chosen per round and
per row.

Prompt lookup (kvjax.speculative.lookup) is sure when the context's last few tokens occurred before: what followed
them then is often what follows now, and a copied draft is accepted for long stretches (code, quotes, loops). Where
nothing recurs it proposes nothing, and the round is a plain decode step. A model drafter (the block drafter,
kvjax.drafter) always proposes, with a modest acceptance. Each round, each row takes lookup's draft when its matched
n-gram is at least `min_match` tokens long, and the model drafter's draft otherwise; when every row's block is a
copy, the model drafter does not run at all that round (its forward is skipped, not masked), so a round of repeated
text costs what a lookup round costs.

By default the two are spliced (`splice=True`): a copying row follows lookup's copy up to where it ends (a copy is
often shorter than the block) and takes the model drafter's tokens from there, so a short repeat no longer leaves the
rest of the block undrafted; the model drafter runs in every round where some row's block is not filled by a copy.
With `overrule` < 1 the model drafter also cuts a copy short at the first position where its most likely token differs
from the copy with probability >= `overrule` (measured on the toy: no threshold from 0.5 to 0.99 beat never
overruling; docs/speculative.md). `splice=False` is the plain rule: a copying row drafts the copy alone, and a round
in which every row copies does not run the model drafter.

Exactness. The choice depends only on the context (the matched n-gram length, the copy's length, and with
`overrule` the model drafter's distribution, functions of the context too), never on what either drafter draws, so
each drafted position is drawn from the distribution q handed to the verify loop there: lookup's one-hot where the
copy is taken, the model drafter's elsewhere; the loop's rejection rule then keeps the verifier's distribution, and
greedy output is the verifier's own greedy decode (tests/test_speculative.py checks both, spliced rows included).

The model drafter must draft from a state that follows the verifier, not its own drafts: its `propose` leaves its
state unchanged and its `commit` reads the round's emitted tokens and the verifier's features (the block drafter
does). A plain draft model (ModelDrafter) runs its drafts through its own cache in `propose`, so a round whose
lookup draft was taken would leave that cache holding tokens that were never emitted: it is refused.

    drafter = combined(load_block_drafter("checkpoints/toy/drafter", source, draft_len=16), source.cfg.vocab_size)
    tokens, stats = kvjax.speculative_generate(source, drafter, prompts, 128, return_stats=True)
    stats.widths, stats.drafter["model_rounds"]  # rounds per verify width; rounds that ran the block drafter
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.speculative.draft import ModelDrafter
from kvjax.speculative.lookup import LookupDrafter


@struct.dataclass
class CombinedState:
    model: object  # the model drafter's state
    lookup: object  # LookupState
    model_rounds: jax.Array  # int32 scalar: rounds in which the model drafter ran (some row took its draft)
    lookup_rows: jax.Array  # [B] int32: rounds in which each row took lookup's draft


@struct.dataclass
class CombinedDrafter:
    """Lookup's draft for rows whose context's last n-gram (n >= min_match) recurs, `model`'s for the others."""

    model: object  # a drafter object whose propose leaves its state unchanged (e.g. kvjax.drafter.BlockDrafter)
    lookup: LookupDrafter
    min_match: int = struct.field(pytree_node=False, default=2)
    splice: bool = struct.field(pytree_node=False, default=True)  # the model drafter fills after a copy's end
    overrule: float = struct.field(pytree_node=False, default=1.0)  # < 1: a model token this sure cuts a copy short
    variable_length: bool = struct.field(pytree_node=False, default=True)

    @property
    def draft_len(self) -> int:
        return self.model.draft_len

    @property
    def feature_layers(self) -> tuple:
        return tuple(self.model.feature_layers)

    def start(self, tokens, lengths, capacity: int, features=None) -> CombinedState:
        b = len(lengths)
        return CombinedState(model=self.model.start(tokens, lengths, capacity, features),
                             lookup=self.lookup.start(tokens, lengths, capacity),
                             model_rounds=jnp.zeros((), jnp.int32), lookup_rows=jnp.zeros((b,), jnp.int32))

    def propose(self, state: CombinedState, last, key, sampling):
        b, g, vocab = last.shape[0], self.draft_len, self.lookup.vocab_size
        greedy = sampling.temperature == 0.0

        def run(_):  # the model drafter's drafts (and q when sampling); its state is unchanged by propose
            drafts, q, _ = self.model.propose(state.model, last, key, sampling)
            return (drafts.astype(jnp.int32),) + (() if greedy else (q,))

        def skip(_):  # every row's block is a copy: the model drafter's forward is not run this round
            return (jnp.zeros((b, g), jnp.int32),) + (() if greedy else (jnp.zeros((b, g, vocab), jnp.float32),))

        l_drafts, n, l_state = self.lookup.match(state.lookup, last)
        use_lookup = n >= self.min_match  # [B]: depends on the context only (see the module docstring)
        take = jnp.broadcast_to(use_lookup[:, None], (b, g))  # [B, g]: positions drafted by the copy
        if self.splice:  # the copy up to where it ends (lookup's -1), the model drafter's tokens after
            take = take & (jnp.cumsum(l_drafts < 0, axis=1) == 0)
        if self.overrule < 1:  # the model drafter runs every round: its confidences decide where a copy is cut
            drafts, q, _, (top, conf) = self.model.propose_with_confidence(state.model, last, key, sampling)
            take = take & (jnp.cumsum((top != l_drafts) & (conf >= self.overrule), axis=1) == 0)
            skipped = jnp.zeros((), bool)
            model = (drafts.astype(jnp.int32),) + (() if greedy else (q,))
        else:  # nothing for the model drafter to draft when every row's block is the copy's: its forward is skipped
            skipped = jnp.all(take)
            model = jax.lax.cond(skipped, skip, run, None)
        drafts = jnp.where(take, l_drafts, model[0])
        q = None
        if not greedy:  # lookup's q is one-hot (zeros where it drafted nothing, -1)
            q = jnp.where(take[..., None], jax.nn.one_hot(l_drafts, vocab, dtype=jnp.float32), model[1])
        state = state.replace(lookup=l_state, model_rounds=state.model_rounds + (~skipped).astype(jnp.int32),
                              lookup_rows=state.lookup_rows + take[:, 0].astype(jnp.int32))
        return drafts, q, state

    def counters(self, state: CombinedState) -> dict:
        """model_rounds: rounds that ran the model drafter; lookup_rows [B]: rounds each row took lookup's draft."""
        return {"model_rounds": state.model_rounds, "lookup_rows": state.lookup_rows}

    def advance(self, state: CombinedState, last, tokens, n_new, features=None) -> CombinedState:
        """A round that drafted nothing (a plain decode step): both parts advance without drafting."""
        return state.replace(model=self.model.advance(state.model, last, tokens, n_new, features),
                             lookup=self.lookup.advance(state.lookup, last, tokens, n_new))

    def commit(self, state: CombinedState, tokens, n_new, features=None) -> CombinedState:
        return state.replace(model=self.model.commit(state.model, tokens, n_new, features),
                             lookup=self.lookup.commit(state.lookup, tokens, n_new))


def combined(model_drafter, vocab_size: int, *, min_match: int = 2, max_ngram: int = 3, splice: bool = True,
             overrule: float = 1.0) -> CombinedDrafter:
    """A CombinedDrafter of `model_drafter` (e.g. kvjax.drafter.load_block_drafter(...)) and prompt lookup at the same
    draft length; `min_match`: the shortest recurring n-gram whose copy is preferred (1..max_ngram); `splice`: the
    model drafter drafts the positions after a copy's end (False: the copy alone); `overrule` (1: never): the model
    drafter's probability at which its token cuts a copy short (needs propose_with_confidence)."""
    if isinstance(model_drafter, ModelDrafter):
        raise ValueError("a plain draft model (ModelDrafter) keeps its own drafts in its cache, so it cannot share "
                         "rounds with prompt lookup; combine a drafter whose state follows the verifier (the block "
                         "drafter, kvjax.drafter.load_block_drafter)")
    missing = [m for m in ("draft_len", "feature_layers", "start", "propose", "commit")
               if not hasattr(model_drafter, m)]
    if missing:
        raise TypeError(f"model_drafter must be a drafter object (kvjax.speculative.loop); "
                        f"{type(model_drafter).__name__} lacks {', '.join(missing)}")
    if not 1 <= int(min_match) <= int(max_ngram):
        raise ValueError(f"min_match must be in 1..max_ngram={max_ngram}, got {min_match}")
    if not 0.0 < float(overrule) <= 1.0:
        raise ValueError(f"overrule must be in (0, 1] (1: a copy is never cut short), got {overrule}")
    if overrule < 1 and not splice:
        raise ValueError("overrule < 1 cuts a copy short for the model drafter's tokens, which needs splice=True")
    if overrule < 1 and not hasattr(model_drafter, "propose_with_confidence"):
        raise TypeError(f"overrule < 1 needs the model drafter's confidences (propose_with_confidence, as the "
                        f"block drafter has); {type(model_drafter).__name__} lacks it: pass overrule=1")
    lookup = LookupDrafter(vocab_size=int(vocab_size), draft_len=int(model_drafter.draft_len),
                           max_ngram=int(max_ngram), min_ngram=1)
    return CombinedDrafter(model=model_drafter, lookup=lookup, min_match=int(min_match), splice=bool(splice),
                           overrule=float(overrule))

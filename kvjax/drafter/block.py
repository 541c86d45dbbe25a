"""The block drafter as a drafter of the shared verify loop (kvjax.speculative.loop documents the interface).

Per round: `propose` drafts `draft_len` = b tokens in ONE drafter forward (kvjax.drafter.model.draft: the pending
token plus b mask positions over the drafter's context cache); the loop verifies them in one verifier forward that
also returns the verifier's features at [last, d_1 .. d_b]; `commit` appends the first n_new of those features
(the pending token and the accepted drafts) to the drafter's context cache and moves its `lengths` by n_new, so a
rejected tail is never context (its entries sit past `lengths` and are overwritten next round). Nothing in the
drafter depends on the draft being right: the verifier decides every token, so greedy output is the verifier's own
greedy decode whatever the drafter proposes (tests/test_drafter.py checks it token for token).

    drafter = kvjax.drafter.load_block_drafter("checkpoints/toy/drafter", verifier, draft_len=16)  # refine=2
    tokens, stats = kvjax.speculative_generate(verifier, drafter, prompts, 128, return_stats=True)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from kvjax import aot
from kvjax.cache import KVCache
from kvjax.drafter.config import DrafterConfig
from kvjax.drafter.io import DrafterError, load_drafter
from kvjax.drafter.model import DrafterParams, draft, draft_head, extend_context, init_context
from kvjax.generation import Sampling, draw, sampling_probs
from kvjax.models.model import as_model


@struct.dataclass
class BlockState:
    cache: KVCache  # the drafter's context cache: keys/values of the verifier's features, one per decoded position


@struct.dataclass
class BlockDrafter:
    """A trained block drafter bound to its verifier (use `block_drafter` or `load_block_drafter` to build one)."""

    params: DrafterParams
    embed: jax.Array  # [V, D]: the verifier's token embedding (shared, frozen)
    head: jax.Array  # [Vd, D]: the verifier's LM head rows of the draft vocabulary (shared, frozen)
    dcfg: DrafterConfig = struct.field(pytree_node=False)
    draft_len: int = struct.field(pytree_node=False, default=16)
    feature_layers: tuple = struct.field(pytree_node=False, default=())
    max_len: int = struct.field(pytree_node=False, default=4096)  # the largest context cache it will make
    refine: int = struct.field(pytree_node=False, default=0)  # extra refinement passes (kvjax.drafter.model.draft)

    def start(self, tokens, lengths, capacity: int, features=None) -> BlockState:
        """The context cache of the prompts but their last tokens, from the verifier's prefill features."""
        if features is None:
            raise ValueError("the block drafter reads the verifier's features of the prompt: run it through "
                             "kvjax.speculative_generate without builder= (the verifier's own prefill computes them)")
        if capacity > self.max_len:
            raise ValueError(f"prompt + max_new_tokens + draft_len + 1 = {capacity} positions (rounded up) do not fit "
                             f"the drafter's context cache of {self.max_len}; shorten the prompt, ask for fewer "
                             "tokens, or build the drafter with a larger max_len")
        cache = init_context(self.dcfg, features.shape[0], int(capacity), self.params.fc.dtype)
        return BlockState(_extend_jit(self.params, self.dcfg, cache, features, jnp.asarray(lengths, jnp.int32)))

    def propose(self, state: BlockState, last, key, sampling: Sampling):
        return self.propose_with_confidence(state, last, key, sampling)[:3]

    def propose_with_confidence(self, state: BlockState, last, key, sampling: Sampling):
        """`propose`, and at each draft position the drafter's most likely token and its probability ([B, b] each,
        from the drafter's logits alone, never from a draw: kvjax.speculative.combined decides on them and stays
        exact)."""
        verifier = _Embedding(self.embed)
        greedy = sampling.temperature == 0.0
        tokens, logits = draft(self.params, self.dcfg, verifier, state.cache, last, self.draft_len, self.head,
                               refine=self.refine if greedy else 0)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        top = jnp.argmax(probs, axis=-1).astype(jnp.int32)
        sure = (top if self.params.vocab_ids is None else self.params.vocab_ids[top], jnp.max(probs, axis=-1))
        if greedy:
            return tokens, None, state, sure
        full = logits if self.params.vocab_ids is None else (
            jnp.full(logits.shape[:-1] + (self.embed.shape[0],), -jnp.inf, logits.dtype)
            .at[..., self.params.vocab_ids].set(logits))  # tokens outside the draft vocabulary: q = 0
        q = sampling_probs(full, sampling)
        return draw(q, key), q, state, sure

    def commit(self, state: BlockState, tokens, n_new, features=None) -> BlockState:
        # finished rows (n_new == 0) write past their lengths only: dead entries, so their state is unchanged
        return BlockState(extend_context(self.params, self.dcfg, state.cache, features, n_new))

    def advance(self, state: BlockState, last, tokens, n_new, features=None) -> BlockState:
        """A round that drafted nothing (a plain decode step): `last`'s features become context, as in commit."""
        return self.commit(state, tokens, n_new, features)


@struct.dataclass
class _Embedding:
    """The part of the verifier's Params the drafter reads (decoder.embed looks up `.embed`)."""
    embed: jax.Array


_extend_jit = aot.jit(extend_context, static_argnames=("dcfg",))


def block_drafter(verifier, dcfg: DrafterConfig, params: DrafterParams, draft_len: int | None = None,
                  max_len: int | None = None, refine: int = 0) -> BlockDrafter:
    """Bind a drafter to its verifier (a Model or (cfg, params)); raises ValueError if it was built for another
    verifier or `draft_len` (default: its largest trained block) is not a block size it was trained for."""
    vcfg, vparams = as_model(verifier)
    dcfg.check_target(vcfg)
    draft_len = dcfg.max_block if draft_len is None else int(draft_len)
    dcfg.check_block(draft_len)
    return BlockDrafter(params=params, embed=vparams.embed, head=draft_head(vparams, params.vocab_ids), dcfg=dcfg,
                        draft_len=draft_len, feature_layers=tuple(dcfg.feature_layers),
                        max_len=int(max_len or vcfg.max_position_embeddings), refine=int(refine))


def load_block_drafter(path: str, verifier, draft_len: int | None = None, max_len: int | None = None,
                       refine: int = 2) -> BlockDrafter:
    """`block_drafter` of the drafter saved in `path` (kvjax.drafter.io), checked against `verifier` first.

    `refine`: refinement passes per greedy draft (kvjax.drafter.model.draft: the confident prefix fed back, the rest
    drafted again). Each pass is one more drafter forward per round; what they give is acceptance. The default, 2,
    is the setting every published number of the shipped toy drafter was measured with (docs/speculative.md,
    "Refinement"; `python -m launch.bench.spec_cost --prompts 100 --repeats 0 --kinds block combined --refine R`):
    tau at b = 4 / 8 / 16 on held-out windows 2.36 / 2.42 / 2.44 with R = 0, 2.49 / 2.68 / 2.72 with R = 2, and on
    code 2.90 / 3.23 / 3.48 against 3.12 / 3.72 / 4.07; a third pass adds at most 0.06. Where the drafter's forward
    is dear next to the verify pass (on this CPU two passes of the 4-layer drafter cost 3.8-6.7 plain steps a
    round), refine=0 drafts at a third of the cost for those lower acceptances. Sampling (temperature > 0) never
    refines. A drafter trained without known prefixes (kvjax.drafter.train's known_prob) gains nothing from it."""
    vcfg = as_model(verifier).cfg
    dcfg, params = load_drafter(path, vcfg)
    try:
        return block_drafter(verifier, dcfg, params, draft_len, max_len, refine)
    except ValueError as e:
        raise DrafterError(f"{path}: {e}") from None

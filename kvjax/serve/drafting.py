"""Speculative decoding in the decode slots: the drafter, each slot's drafter state, and each step's kind.

With `--speculative=lookup|block|combined` a decode step is either a verify round over the occupied slots
(programs.round_step: the drafter proposes up to g tokens per row, the target checks them in one forward over its
cache, the library's kvjax.speculative.verify_block, and each row keeps its own accepted count and rolls its cache
and drafter state back to it) or a plain step that also advances every row's drafter state over its new token
(programs.plain_step). Both look prompt lookup up ahead for the next step: a round then runs at the narrowest
compiled verify width that holds the longest copy, and no round runs when no row would draft anything. Which one runs is decided per step from measured costs (kvjax.serve.scheduler.DraftPolicy):
a round of g + 1 tokens over many rows can cost more than the tokens it saves.

Drafters (each the library's, kvjax.speculative):
  lookup    prompt lookup (LookupDrafter): copies what followed the latest earlier occurrence of a row's last n-gram
            in its prompt and answer so far; no model, and where nothing recurs it drafts nothing, so the round runs
            at width 1 (the narrowest compiled verify width that holds a round's longest draft)
  block     the block drafter (kvjax.drafter): g tokens in one forward from the target's features; it must have
            been trained for the answering model (the target), with g one of its trained block sizes
  combined  lookup's copy where a row's text repeats, the block drafter's draft elsewhere (kvjax.speculative.combined)

The block drafter's context. Offline it reads the verifier's features of the whole prompt, from the verifier's own
prefill. The served caches come from the map (split path), the prefix cache or chunked prefill, none of which run
the target over the prompt, so a new request's context is the target's features of the prompt's last
`draft_context` tokens, computed by one forward over them that reads the prefilled cache before them
(programs.context_features: the verify pass, which writes nothing). On the split path that is what the target
computes there reading the mapped cache, as it does for every token it decodes. The drafter then sees a shorter
prompt: that changes how many drafts are accepted, never an answer.

Exactness. The target verifies every token from the cache it would decode from (the mapped one on the split path),
so a greedy answer is the target's own greedy decode, token for token as offline (up to float rounding of a
(g + 1)-token forward against one-token steps); a sampled row takes the rejection rule with its own temperature,
top_p and key, so its tokens are distributed as the target's sampling. Which sample a seeded request gets then
depends on the drafts, so on the load: seeds reproduce an answer only with --speculative=none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.serve import programs
from kvjax.serve.config import EngineConfig
from kvjax.serve.metrics import Metrics
from kvjax.serve.placement import Placement
from kvjax.serve.scheduler import DraftPolicy

NARROW = (1, 2, 3, 5, 9, 17, 33, 65)  # the verify widths compiled for a variable-length drafter (and g + 1)


def build_drafter(config: EngineConfig, target):
    """The drafter of `config.speculative` for the target (config, params); a block drafter trained for another model
    or block size raises kvjax.drafter.DrafterError (a ValueError) naming it."""
    from kvjax.speculative import LookupDrafter, combined
    cfg, g = target[0], config.rounds_draft
    lo, hi = config.lookup_ngram
    lookup = LookupDrafter(vocab_size=cfg.vocab_size, draft_len=g, max_ngram=hi, min_ngram=lo)
    if config.speculative == "lookup":
        return lookup
    from kvjax.drafter import load_block_drafter
    block = load_block_drafter(config.drafter, target, draft_len=g, refine=config.draft_refine)
    if config.speculative == "block":
        return block
    return combined(block, cfg.vocab_size, min_match=config.min_match, max_ngram=hi).replace(lookup=lookup)


def verify_widths(draft_len: int, variable: bool) -> tuple[int, ...]:
    """The verify widths a round may run: g + 1 for a fixed-length drafter; for a variable-length one NARROW up to
    g + 1, and g + 1 (a round of short copies runs narrow, one compiled program per width)."""
    top = draft_len + 1
    return (top,) if not variable else tuple(sorted({w for w in NARROW if w < top} | {top}))


class Drafting:
    """The drafter of an engine's decode slots, each slot's drafter state (on the decode device), when a step drafts
    and what the rounds accepted. Only the decode thread calls it."""

    def __init__(self, target, config: EngineConfig, device, metrics: Metrics):
        from kvjax.models.model import Model
        from kvjax.speculative.api import loop_verifier
        self.cfg, self.params = target
        self.config, self.device, self.metrics = config, device, metrics
        self.kind = config.speculative
        self.drafter = self._put(build_drafter(config, target))
        self.g = self.drafter.draft_len
        self.layers = tuple(self.drafter.feature_layers)
        self.widths = verify_widths(self.g, bool(getattr(self.drafter, "variable_length", False)))
        # the verify pass's target (on CPU a tied head as an explicit [D, V] copy: kvjax.speculative.api says why)
        self.round_params = self._put(loop_verifier(Model(self.cfg, self.params)).params)
        self.state = self._fresh(config.slots)
        self.policy = DraftPolicy(config.draft_policy)
        self.rounds = 0
        self.ahead = 0  # the tokens the next round would verify, from the last step (1: nothing to draft; 0: unknown)
        parts = ("lookup", "none") if self.kind == "lookup" else ("block", "none") if self.kind == "block" else (
            "lookup", "block", "none")
        m = metrics  # each drafter's series, bound once (a labels() lookup per row and step adds up)
        self._series = {p: (m.drafted_tokens.labels(drafter=p), m.accepted_tokens.labels(drafter=p),
                            m.acceptance_length.labels(drafter=p)) for p in parts}
        self._steps = {k: m.decode_steps.labels(kind="draft" if k else "plain") for k in (True, False)}

    # ---- drafter state -----------------------------------------------------------------------------------------

    def _fresh(self, rows: int):
        """The drafter state of `rows` empty rows."""
        return self._start([], rows, None)

    def _start(self, prompts: list[list[int]], rows: int, cache):
        """The drafter state of a prefilled batch: `rows` rows, prompts[i] in row i (the rest empty); `cache`: the
        batch's prefilled target cache (each prompt but its last token), which the block drafter's context reads."""
        from kvjax.speculative import CombinedDrafter, LookupDrafter
        capacity = self.config.capacity
        parts = {}
        if isinstance(self.drafter, (LookupDrafter, CombinedDrafter)):  # the whole prompt is lookup's context
            width = max([len(p) - 1 for p in prompts] + [1])
            tokens, lengths = np.zeros((rows, width), np.int32), np.zeros((rows,), np.int32)
            for i, p in enumerate(prompts):
                tokens[i, :len(p) - 1], lengths[i] = p[:-1], len(p) - 1
            lookup = self.drafter if isinstance(self.drafter, LookupDrafter) else self.drafter.lookup
            parts["lookup"] = lookup.start(tokens, lengths, capacity)
        if self.layers:  # the block drafter: the target's features of each prompt's last draft_context tokens
            block = self.drafter if not isinstance(self.drafter, CombinedDrafter) else self.drafter.model
            width = min(self.config.draft_context, cache.capacity) if cache is not None else 1
            tokens, lengths, start = (np.zeros((rows, width), np.int32), np.zeros((rows,), np.int32),
                                      np.zeros((rows,), np.int32))
            for i, p in enumerate(prompts):
                n = min(width, len(p) - 1)
                tokens[i, :n], lengths[i], start[i] = p[len(p) - 1 - n:len(p) - 1], n, len(p) - 1 - n
            if cache is None:
                features = jnp.zeros((rows, width, block.dcfg.feature_size), block.params.fc.dtype)
            else:
                features = programs.context_features(self.params, self.cfg, cache, tokens, start, self.layers)
            parts["block"] = block.start(tokens, lengths, capacity, features)
        if isinstance(self.drafter, CombinedDrafter):
            from kvjax.speculative import CombinedState
            state = CombinedState(model=parts["block"], lookup=parts["lookup"], model_rounds=jnp.zeros((), jnp.int32),
                                  lookup_rows=jnp.zeros((rows,), jnp.int32))
        else:
            state = parts.get("lookup", parts.get("block"))
        return self._put(state)

    def _put(self, tree):
        """`tree` on the decode slots' devices: a Placement's (kvjax.serve.placement: replicated over its devices), or
        one jax.Device."""
        return self.device.put(tree) if isinstance(self.device, Placement) else jax.device_put(tree, self.device)

    def insert(self, placed: list[tuple[int, int, list[int]]], cache) -> None:
        """Start the drafter state of a prefilled batch's requests: `placed` holds (slot, row of `cache`, prompt)
        of each request the slots took; `cache` the batch's prefilled target cache (its rows padded)."""
        rows = cache.batch_size
        prompts = [[0, 0]] * rows
        slots = np.full((rows,), self.config.slots, np.int32)  # rows not placed: dropped
        for slot, row, prompt in placed:
            prompts[row], slots[row] = prompt, slot
        new = self._start(prompts, rows, cache)
        self.state = programs.insert_rows(self.state, new, jnp.asarray(slots))
        self.ahead = 0  # the new rows were not looked ahead

    def compile_insert(self, cache) -> None:
        """Run `insert` for a batch like `cache` with every row dropped (warm-up: compiles it, changes nothing)."""
        new = self._start([[0, 0]] * cache.batch_size, cache.batch_size, cache)
        self.state = programs.insert_rows(self.state, new, jnp.full((cache.batch_size,), self.config.slots,
                                                                    jnp.int32))

    def reset(self) -> None:
        """Every slot's state emptied (the slots' cache was rebuilt after a failed step)."""
        self.state = self._fresh(self.config.slots)
        self.ahead = 0

    # ---- a decode step -----------------------------------------------------------------------------------------

    def choose(self, rows: int, sampled: bool) -> bool:
        """Whether this step drafts: not when prompt lookup's look-ahead says no row would draft anything (the last
        step's `ahead`; unknown after new requests joined), else as DraftPolicy says."""
        if self.ahead == 1 and self.policy.mode != "always":
            return False
        draft = self.policy.choose(rows, sampled)
        if np.isfinite(self.policy.predicted):
            self.metrics.draft_speedup.set(self.policy.predicted)
        return draft

    def step(self, draft: bool, cache, tokens, active, temperature, top_p, seeds, counters, rows: int,
             sampled: bool):
        """One decode step over slots [0, rows): (cache, tokens [S, w] numpy, n_new [S]: each slot's new tokens are
        tokens[s, :n_new[s]], drafted [S], copied [S]: whether the row's draft was prompt lookup's copy)."""
        if not draft:
            nxt, ahead, cache, self.state = programs.plain_step(self.params, self.cfg, cache, self.drafter,
                                                                self.state, tokens, active, temperature, top_p,
                                                                seeds, counters, rows=rows)
            nxt, self.ahead = jax.device_get((nxt, ahead))
            zeros = np.zeros(active.shape, np.int32)
            return cache, nxt[:, None], active.astype(np.int32), zeros, zeros
        self.rounds += 1
        width = self.width(self.ahead, sampled)
        toks, n_new, drafted, copied, ahead, cache, self.state = programs.round_step(
            self.round_params, self.cfg, cache, self.drafter, self.state, tokens, active, temperature, top_p, seeds,
            counters, np.int32(self.rounds), rows=rows, sampled=sampled, width=width)
        toks, n_new, drafted, copied, self.ahead = jax.device_get((toks, n_new, drafted, copied, ahead))
        return cache, toks, n_new, drafted, copied

    def width(self, needed: int, sampled: bool) -> int:
        """The verify width of a round whose longest draft needs `needed` tokens (0: not known): the narrowest
        compiled one that holds them (a sampled round runs the full width: one compiled program per row count)."""
        return self.widths[-1] if sampled or not needed else next(w for w in self.widths if w >= needed)

    def account(self, draft: bool, rows: int, sampled: bool, seconds: float, n_new, drafted, copied,
                occupied) -> None:
        """What a step did: its cost and yield (DraftPolicy) and, for a round, each occupied slot's accepted tokens
        (the metrics per drafter)."""
        self.policy.observe(draft, rows, sampled, seconds, int(np.sum(n_new[occupied])), len(occupied))
        self._steps[draft].inc()
        if not draft:
            return
        totals: dict = {}
        for s in occupied:
            n, d = int(n_new[s]), int(drafted[s])
            if n == 0:  # the request ended before the round
                continue
            part = "none" if not d else "lookup" if (self.kind == "lookup" or copied[s]) else "block"
            t = totals.setdefault(part, [0, 0, []])
            t[0], t[1] = t[0] + d, t[1] + n - 1
            t[2].append(n)
        for part, (d, a, lengths) in totals.items():
            drafted_series, accepted_series, length_series = self._series[part]
            drafted_series.inc(d)
            accepted_series.inc(a)
            for n in lengths:
                length_series.observe(n)

    def warm(self, cache, tokens, active, temperature, top_p, seeds, counters, rows: int):
        """Run each kind of step at `rows` once: a plain step and a round at every verify width (sampled: the full
        width). Warm-up; the caller resets the state after."""
        sampled = bool((temperature > 0).any())
        cache = self.step(False, cache, tokens, active, temperature, top_p, seeds, counters, rows, sampled)[0]
        for width in self.widths[-1:] if sampled else self.widths:
            cache, self.state = programs.round_step(
                self.round_params, self.cfg, cache, self.drafter, self.state, tokens, active, temperature, top_p,
                seeds, counters, np.int32(0), rows=rows, sampled=sampled, width=width)[5:]
        return cache

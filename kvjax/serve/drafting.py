"""Speculative decoding in the decode slots: the drafter, each slot's drafter state, and each step's width.

With `--speculative=lookup|block|combined` a decode step is either a verify round over the occupied slots
(programs.round_step: the drafter proposes up to g tokens per row, the target checks the first width - 1 of them in
one forward over its cache, the library's kvjax.speculative.verify_block, and each row keeps its own accepted count
and rolls its cache and drafter state back to it) or a plain step that also advances every row's drafter state over
its new token (programs.plain_step). Every step also looks ahead at what the next round would draft in each row
(programs.lookahead: how many tokens, and whether a copy of prompt lookup or the model drafter drafts them), and
the scheduler's DraftPolicy (kvjax.serve.scheduler) chooses from that and the measured costs and acceptances the
next step's width: a round of the compiled width that is predicted to emit the most tokens per second, or a plain
step where no round pays (a wide round over many rows costs more than the tokens it saves).

Drafters (each the library's, kvjax.speculative):
  lookup    prompt lookup (LookupDrafter): copies what followed the latest earlier occurrence of a row's last n-gram
            in its prompt and answer so far; no model, and where nothing recurs it drafts nothing (a step where no
            row would draft anything is a plain step)
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

NARROW = (1, 2, 3, 5, 9, 17, 33, 65)  # the verify widths compiled below g + 1 (and g + 1)


def build_drafter(config: EngineConfig, target, block=None):
    """The drafter of `config.speculative` for the target (config, params); a block drafter trained for another model
    or block size raises kvjax.drafter.DrafterError (a ValueError) naming it. `block`: the block drafter of
    block / combined already built (default: loaded from `config.drafter`; the server plan passes an abstract one)."""
    from kvjax.speculative import LookupDrafter, combined
    cfg, g = target[0], config.rounds_draft
    lo, hi = config.lookup_ngram
    lookup = LookupDrafter(vocab_size=cfg.vocab_size, draft_len=g, max_ngram=hi, min_ngram=lo)
    if config.speculative == "lookup":
        return lookup
    if block is None:
        from kvjax.drafter import load_block_drafter
        block = load_block_drafter(config.drafter, target, draft_len=g, refine=config.draft_refine)
    if config.speculative == "block":
        return block
    return combined(block, cfg.vocab_size, min_match=config.min_match, max_ngram=hi).replace(lookup=lookup)


def verify_widths(draft_len: int) -> tuple[int, ...]:
    """The verify widths a round may run: NARROW up to g + 1, and g + 1 (one compiled program per width and row
    count; a round runs the narrowest that pays: DraftPolicy)."""
    top = draft_len + 1
    return tuple(sorted({w for w in NARROW if w < top} | {top}))


def start_state(drafter, config: EngineConfig, target, prompts: list[list[int]], rows: int, cache):
    """The drafter state of a prefilled batch: `rows` rows, prompts[i] in row i (the rest empty); `cache`: the
    batch's prefilled target cache (each prompt but its last token), which the block drafter's context reads (None:
    empty rows, the slots' state at start). Traceable under jax.eval_shape (the server plan's shapes)."""
    from kvjax.speculative import CombinedDrafter, LookupDrafter
    cfg, params = target
    capacity = config.capacity
    parts = {}
    if isinstance(drafter, (LookupDrafter, CombinedDrafter)):  # the whole prompt is lookup's context
        width = max([len(p) - 1 for p in prompts] + [1])
        tokens, lengths = np.zeros((rows, width), np.int32), np.zeros((rows,), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p) - 1], lengths[i] = p[:-1], len(p) - 1
        lookup = drafter if isinstance(drafter, LookupDrafter) else drafter.lookup
        parts["lookup"] = lookup.start(tokens, lengths, capacity)
    layers = tuple(drafter.feature_layers)
    if layers:  # the block drafter: the target's features of each prompt's last draft_context tokens
        block = drafter if not isinstance(drafter, CombinedDrafter) else drafter.model
        width = context_width(config, cache.capacity) if cache is not None else 1
        tokens, lengths, start = (np.zeros((rows, width), np.int32), np.zeros((rows,), np.int32),
                                  np.zeros((rows,), np.int32))
        for i, p in enumerate(prompts):
            n = min(width, len(p) - 1)
            tokens[i, :n], lengths[i], start[i] = p[len(p) - 1 - n:len(p) - 1], n, len(p) - 1 - n
        if cache is None:
            features = jnp.zeros((rows, width, block.dcfg.feature_size), block.params.fc.dtype)
        else:
            features = programs.context_features(params, cfg, cache, tokens, start, layers)
        parts["block"] = block.start(tokens, lengths, capacity, features)
    if isinstance(drafter, CombinedDrafter):
        from kvjax.speculative import CombinedState
        return CombinedState(model=parts["block"], lookup=parts["lookup"], model_rounds=jnp.zeros((), jnp.int32),
                             lookup_rows=jnp.zeros((rows,), jnp.int32))
    return parts.get("lookup", parts.get("block"))


def context_width(config: EngineConfig, bucket: int) -> int:
    """The prompt tokens (its last) whose target features start a new row's block drafter context, for a batch
    prefilled to `bucket` positions."""
    return min(config.draft_context, bucket)


class Drafting:
    """The drafter of an engine's decode slots, each slot's drafter state (on the decode device) and next draft, how
    much a step drafts and what the rounds accepted. Only the decode thread calls it."""

    def __init__(self, target, config: EngineConfig, device, metrics: Metrics):
        from kvjax.models.model import Model
        from kvjax.speculative.api import loop_verifier
        self.cfg, self.params = target
        self.config, self.metrics = config, metrics
        # the slots' placement (kvjax.serve.placement): the drafter and the drafter states replicated on it
        self.place = device if isinstance(device, Placement) else Placement(device)
        self.kind = config.speculative
        self.drafter = self.place.put(build_drafter(config, target))
        self.g = self.drafter.draft_len
        self.widths = verify_widths(self.g)
        # the verify pass's target, its weights placed as the slots' (on CPU a tied head gets an explicit [D, V] copy,
        # made where the embedding is: kvjax.speculative.api says why)
        self.round_params = loop_verifier(Model(self.cfg, self.params)).params
        self.state = self._fresh(config.slots)
        # each slot's next draft (programs.lookahead): its length and source (n >= 1: lookup's copy after a recurring
        # n-gram of n tokens; 0: the model drafter's)
        self.lengths = np.zeros(config.slots, np.int32)
        self.sources = np.zeros(config.slots, np.int32)
        self.policy = DraftPolicy(config.draft_policy, self.widths, config.lookup_ngram[1] + 1, self.g)
        self.rounds = 0
        self.drafted_by = self.sources.copy()  # the sources of the last round's drafts
        parts = ("lookup", "none") if self.kind == "lookup" else ("block", "none") if self.kind == "block" else (
            "lookup", "block", "none")
        m = metrics  # each drafter's series, bound once (a labels() lookup per row and step adds up)
        self._series = {p: (m.drafted_tokens.labels(drafter=p), m.accepted_tokens.labels(drafter=p),
                            m.acceptance_length.labels(drafter=p)) for p in parts}
        self._steps = {k: m.decode_steps.labels(kind="draft" if k else "plain") for k in (True, False)}
        self._costs: dict = {}  # (rows, width) -> the step-cost gauge's series

    # ---- drafter state -----------------------------------------------------------------------------------------

    def _fresh(self, rows: int):
        """The drafter state of `rows` empty rows."""
        return self._start([], rows, None)

    def _start(self, prompts: list[list[int]], rows: int, cache):
        """start_state placed on the slots' devices."""
        return self.place.put(start_state(self.drafter, self.config, (self.cfg, self.params), prompts, rows, cache))

    def insert(self, placed: list[tuple[int, int, list[int]]], cache) -> None:
        """Start the drafter state of a prefilled batch's requests: `placed` holds (slot, row of `cache`, prompt)
        of each request the slots took; `cache` the batch's prefilled target cache (its rows padded)."""
        rows = cache.batch_size
        prompts = [[0, 0]] * rows
        slots = np.full((rows,), self.config.slots, np.int32)  # rows not placed: dropped
        for slot, row, prompt in placed:
            prompts[row], slots[row] = prompt, slot
        new = self._start(prompts, rows, cache)
        last = np.asarray([p[-1] for p in prompts], np.int32)
        ahead = programs.new_rows_lookahead(self.drafter, new, last, slots < self.config.slots)
        lengths, sources = jax.device_get(ahead)
        self.state = programs.insert_rows(self.state, new, jnp.asarray(slots))
        for slot, row, _ in placed:  # their first round's drafts
            self.lengths[slot], self.sources[slot] = lengths[row], sources[row]

    def compile_insert(self, cache) -> None:
        """Run `insert` for a batch like `cache` with every row dropped (warm-up: compiles it, changes nothing)."""
        new = self._start([[0, 0]] * cache.batch_size, cache.batch_size, cache)
        dropped = np.full((cache.batch_size,), self.config.slots, np.int32)
        programs.new_rows_lookahead(self.drafter, new, dropped * 0, dropped < 0)
        self.state = programs.insert_rows(self.state, new, jnp.asarray(dropped))

    def reset(self) -> None:
        """Every slot's state emptied (the slots' cache was rebuilt after a failed step)."""
        self.state = self._fresh(self.config.slots)
        self.lengths[:] = 0

    # ---- a decode step -----------------------------------------------------------------------------------------

    def choose(self, rows: int, active: np.ndarray, temperature: np.ndarray) -> int:
        """The verify width of the next step over slots [0, rows) (0: a plain step), as DraftPolicy says from each
        occupied slot's next draft; active / temperature [S]: the occupied slots and their sampling."""
        occupied = np.flatnonzero(active)
        hot = temperature[occupied] > 0
        width = self.policy.choose(rows, bool(hot.any()), self.lengths[occupied], self.sources[occupied], hot)
        if np.isfinite(self.policy.predicted):
            self.metrics.draft_speedup.set(self.policy.predicted)
        return width

    def step(self, width: int, cache, tokens, active, temperature, top_p, seeds, counters, rows: int,
             sampled: bool):
        """One decode step over slots [0, rows) at verify `width` (0: plain): (cache, tokens [S, w] numpy, n_new [S]:
        each slot's new tokens are tokens[s, :n_new[s]], drafted [S]: the drafts each slot verified)."""
        if not width:
            nxt, lengths, sources, cache, self.state = programs.plain_step(
                self.params, self.cfg, cache, self.drafter, self.state, tokens, active, temperature, top_p, seeds,
                counters, rows=rows)
            nxt, self.lengths[:], self.sources[:] = jax.device_get((nxt, lengths, sources))
            return cache, nxt[:, None], active.astype(np.int32), np.zeros(active.shape, np.int32)
        self.rounds += 1
        self.drafted_by = self.sources.copy()  # what drafted this round's rows (account's metrics)
        toks, n_new, drafted, lengths, sources, cache, self.state = programs.round_step(
            self.round_params, self.cfg, cache, self.drafter, self.state, tokens, active, temperature, top_p, seeds,
            counters, np.int32(self.rounds), rows=rows, sampled=sampled, width=width)
        toks, n_new, drafted, self.lengths[:], self.sources[:] = jax.device_get((toks, n_new, drafted, lengths,
                                                                                  sources))
        return cache, toks, n_new, drafted

    def account(self, width: int, rows: int, sampled: bool, seconds: float, n_new, drafted, occupied,
                temperature) -> None:
        """What a step did: its cost and, for a round, each occupied slot's accepted drafts (DraftPolicy, and the
        metrics per drafter)."""
        self.policy.observe(width, rows, sampled, seconds)
        self._steps[bool(width)].inc()
        series = self._costs.get((rows, width))
        if series is None:
            series = self._costs[rows, width] = self.metrics.step_cost.labels(rows=str(rows), width=str(width))
        series.set(self.policy.cost(rows, sampled, width))
        if not width:
            return
        self.metrics.round_width.observe(width)
        occupied = occupied[n_new[occupied] > 0]  # 0: a slot that was free for the round
        sources = self.drafted_by[occupied]
        self.policy.rounds(drafted[occupied], sources, temperature[occupied] > 0, n_new[occupied] - 1)
        totals: dict = {}
        for s, source in zip(occupied, sources):
            n, d = int(n_new[s]), int(drafted[s])
            part = "none" if not d else "lookup" if (self.kind == "lookup" or source) else "block"
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
        cache = self.step(0, cache, tokens, active, temperature, top_p, seeds, counters, rows, sampled)[0]
        for width in self.widths[-1:] if sampled else self.widths:
            cache, self.state = programs.round_step(
                self.round_params, self.cfg, cache, self.drafter, self.state, tokens, active, temperature, top_p,
                seeds, counters, np.int32(0), rows=rows, sampled=sampled, width=width)[5:]
        return cache

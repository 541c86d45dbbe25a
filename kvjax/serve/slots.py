"""The decode slots: one batched target cache of `slots` rows on the decode device, the request each row holds and
its sampling state. Prefilled batches are written into free rows (in place); every step advances each occupied row
by one token, or with speculative decoding (kvjax.serve.drafting) by each row's accepted drafts and one token, and
answers the requests that end (EOS, stop text, max_tokens, timeout, cancel, error; inside a round's tokens too),
whose rows are free again before the next step. Only the decode thread calls these methods."""

from __future__ import annotations

import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import window_sizes
from kvjax.serve import programs
from kvjax.serve.config import EngineConfig, Event, Request
from kvjax.serve.faults import Faults
from kvjax.serve.metrics import Metrics
from kvjax.serve.scheduler import Scheduler

log = logging.getLogger("kvjax.serve")


class Slots:
    """`target`: (config, params) placed on `device`; `answers`: the scheduler that ends requests."""

    def __init__(self, target, config: EngineConfig, device, answers: Scheduler, metrics: Metrics, faults: Faults):
        self.cfg, self.params = target
        self.config, self.device, self.answers, self.metrics, self.faults = config, device, answers, metrics, faults
        self.eos = frozenset(self.cfg.eos_token_ids)
        self.row_buckets = programs.row_buckets(config.slots)  # the decode step's compiled row counts
        self.cache = programs.empty_slots(self.cfg, config.slots, config.capacity, jnp.dtype(self.params.embed.dtype),
                                          device)
        s = config.slots
        self.req: list[Request | None] = [None] * s
        self._next_in = np.zeros(s, np.int32)
        self._temp = np.zeros(s, np.float32)
        self._top_p = np.ones(s, np.float32)
        self._seed = np.zeros(s, np.int32)
        self._count = np.zeros(s, np.int32)
        self.drafting = None
        if config.drafting:  # the drafter and each slot's drafter state (it loads the block drafter: may raise)
            from kvjax.serve.drafting import Drafting
            self.drafting = Drafting(target, config, device, metrics)

    def active(self) -> int:
        return sum(r is not None for r in self.req)

    def free(self) -> int:
        return sum(r is None for r in self.req)

    def held(self) -> list[Request]:
        return [r for r in self.req if r is not None]

    def insert(self, reqs: list[Request], cache) -> None:
        """Write a prefilled batch into free slots."""
        free = [i for i, r in enumerate(self.req) if r is None]
        slots = np.full((cache.batch_size,), self.config.slots, np.int32)  # padding and dropped rows: nowhere
        placed = []
        for row, r in enumerate(reqs):
            if r.finished:
                continue
            if r.cancelled:
                self.answers.fail(r, 499, "cancelled by the client")
                continue
            s = free.pop(0)
            slots[row] = s
            self.req[s] = r
            placed.append((s, row, r.prompt))
            self._next_in[s] = r.prompt[-1]
            self._temp[s], self._top_p[s], self._seed[s], self._count[s] = r.temperature, r.top_p, r.seed, 0
        if placed:
            self.cache = programs.insert(self.cache, cache, jnp.asarray(slots))
            if self.drafting is not None:
                self.drafting.insert(placed, cache)

    def compile_insert(self, cache) -> None:
        """Run the insert of a batch like `cache` with every row dropped (warm-up: compiles it, changes nothing)."""
        slots = jnp.full((cache.batch_size,), self.config.slots, jnp.int32)
        self.cache = programs.insert(self.cache, cache, slots)
        if self.drafting is not None:
            self.drafting.compile_insert(cache)

    def warm(self) -> None:
        """Run the decode step once per row count, attention window (kvjax.cache.window_sizes) and sampling branch,
        with speculative decoding both kinds of step (warm-up: the results are dropped and every slot is left free
        and empty). On XLA:CPU the first run of a lax.switch / lax.cond branch costs 15-30 ms more than the next,
        which the first request to reach a window would otherwise add to a step of every running request."""
        s = self.config.slots
        active = np.arange(s) == 0
        windows = window_sizes(self.config.capacity)
        for rows in self.row_buckets:  # every window greedy, then the sampling branch once
            for window, temperature in [(w, 0.0) for w in windows] + [(windows[0], 1.0)]:
                # row 0 reads positions [0, window): the smallest window that holds them
                lengths = self.cache.lengths * 0 + np.where(active, window - 1, 0).astype(np.int32)  # placed as is
                self.cache = self.cache.replace(lengths=lengths)
                temp = np.full(s, temperature, np.float32)
                if self.drafting is not None:  # both kinds of step (a plain step, a verify round)
                    self.cache = self.drafting.warm(self.cache, self._next_in, active, temp, self._top_p,
                                                    self._seed, self._count, rows)
                    continue
                _, self.cache = programs.step(self.params, self.cfg, self.cache, self._next_in, active, temp,
                                              self._top_p, self._seed, self._count, rows=rows)
        if self.drafting is not None:  # every slot empty again (placed as the lengths are)
            self.cache = self.cache.replace(lengths=self.cache.lengths * 0)
            self.drafting.reset()
        else:
            self.run_step(self.row_buckets[-1])  # every slot free: lengths back to 0
        jax.block_until_ready(self.cache)

    def _rows(self, active: np.ndarray) -> int:
        """The smallest compiled row count that holds every occupied slot."""
        need = int(np.flatnonzero(active).max()) + 1 if active.any() else 1
        return next(b for b in self.row_buckets if b >= need)

    def run_step(self, rows: int | None = None):
        active = np.array([r is not None for r in self.req])
        rows = self._rows(active) if rows is None else rows
        out, self.cache = programs.step(self.params, self.cfg, self.cache, self._next_in, active,
                                        self._temp, self._top_p, self._seed, self._count, rows=rows)
        return np.asarray(out)

    def step(self) -> None:
        t0 = time.perf_counter()
        active = np.array([r is not None for r in self.req])
        occupied = np.flatnonzero(active)
        rows = self._rows(active)
        width, sampled = 0, False
        try:
            if self.drafting is None:
                out, n_new = self.run_step(rows)[:, None], active.astype(np.int32)
            else:
                sampled = bool((self._temp[active] > 0).any())
                width = self.drafting.choose(rows, active, self._temp)
                self.cache, out, n_new, drafted = self.drafting.step(
                    width, self.cache, self._next_in, active, self._temp, self._top_p, self._seed, self._count,
                    rows, sampled)
        except Exception as e:  # noqa: BLE001 - the batch step itself failed: every slot in it fails, the cache is rebuilt
            log.exception("decode step failed")
            for s, r in enumerate(self.req):
                if r is not None:
                    self.answers.fail(r, 500, f"decode step failed: {type(e).__name__}: {e}")
                    self.req[s] = None
            self.cache = programs.empty_slots(self.cfg, self.config.slots, self.config.capacity, self.cache.dtype,
                                              self.device)
            if self.drafting is not None:
                self.drafting.reset()
            return
        now = time.perf_counter()
        self.metrics.step_seconds.observe(now - t0)
        produced = 0
        for s, r in enumerate(self.req):
            if r is None:
                continue
            try:
                self.faults.check("step", r)
                produced += self._emit(s, r, out[s, :n_new[s]], now)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                log.exception("request %d failed in its decode step", r.id)
                self.answers.fail(r, 500, f"generation failed: {type(e).__name__}: {e}")
            if r.finished:
                self.req[s] = None
        self.metrics.produced(produced, now)
        if self.drafting is not None:
            self.drafting.account(width, rows, sampled, time.perf_counter() - t0, n_new, drafted, occupied,
                                  self._temp)

    def _emit(self, s: int, r: Request, toks, now: float) -> int:
        """The step's new tokens of slot s (one, or a round's accepted drafts and the target's token), in one event;
        the request ends at the first EOS, stop text or max_tokens among them (what follows is dropped). Returns the
        tokens the request took."""
        if r.cancelled:
            self.answers.fail(r, 499, "cancelled by the client")
            return 0
        if not r.generated:
            r.first_token_at = now
            self.metrics.ttft.observe(now - r.submitted)
        else:
            self.metrics.token_latency.observe(now - r.last_token_at)
        r.last_token_at = now
        ids, text, end = [], [], ""
        for tok in toks:
            tok = int(tok)
            if ids:  # a round's later tokens arrive with its first
                self.metrics.token_latency.observe(0.0)
            r.generated.append(tok)
            ids.append(tok)
            eos = tok in self.eos
            delta, stopped = r.text.push(tok, final=eos)
            text.append(delta)
            if eos or stopped:
                end = "stop"
            elif len(r.generated) >= r.max_tokens:
                end = "length"
            if end:
                break
        self._count[s] += len(ids)
        self._next_in[s] = ids[-1]
        r.sink(Event("token", ids=tuple(ids), text="".join(text)))
        if end == "stop":
            self.answers.finish(r, "stop")
        elif end == "length":
            tail = r.text.flush()
            if tail:
                r.sink(Event("token", ids=(), text=tail))
            self.answers.finish(r, "length")
        elif now > r.deadline:
            self.answers.fail(r, 504, f"timed out after {now - r.submitted:.0f} s ({len(r.generated)} tokens "
                                      "generated)")
        return len(ids)

    def sweep(self) -> None:
        """Free the slots of requests cancelled or past their deadline (between steps)."""
        now = time.perf_counter()
        for s, r in enumerate(self.req):
            if r is None:
                continue
            if r.cancelled:
                self.answers.fail(r, 499, "cancelled by the client")
            elif now > r.deadline:
                self.answers.fail(r, 504, f"timed out after {now - r.submitted:.0f} s ({len(r.generated)} tokens "
                                          "generated)")
            if r.finished:
                self.req[s] = None

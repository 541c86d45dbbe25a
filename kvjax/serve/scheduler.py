"""Scheduling: the bounded queue of waiting requests, read in prefill batches of one length bucket, and the answer
that ends each request (its metrics, its last event). One lock (a Condition) guards the queue; the engine's threads
share it for the state they hand each other. With speculative decoding, `DraftPolicy` decides how much each decode
step drafts (a verify round's width, or none), from the measured costs of the steps and acceptances of the drafts."""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import numpy as np

from kvjax.serve.config import EngineConfig, Event, QueueFull, Request
from kvjax.serve.metrics import Metrics


class Scheduler:
    """`bucket_of(n)`: the prefill bucket of a prompt of n + 1 tokens (the last one is decoded, not prefilled);
    `path`: the metrics' label of the path requests are served by (split / native_target)."""

    LOOKAHEAD = 64  # queued requests scanned for prompts of the head's prefill bucket

    def __init__(self, config: EngineConfig, bucket_of: Callable[[int], int], metrics: Metrics, path: str):
        self.config, self.bucket_of, self.metrics, self.path = config, bucket_of, metrics, path
        self.lock = threading.Condition()
        self.waiting: collections.deque[Request] = collections.deque()
        self._e2e = collections.deque(maxlen=64)  # recent end-to-end seconds (Retry-After estimate)

    def submit(self, req: Request) -> None:
        """Queue a request (raises QueueFull past max_queue)."""
        with self.lock:
            if len(self.waiting) >= self.config.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(self.retry_after())
            self.waiting.append(req)
            self.metrics.queue_depth.set(len(self.waiting))
            self.lock.notify_all()

    def retry_after(self) -> int:
        per = float(np.median(self._e2e)) if self._e2e else 1.0
        return max(1, int(np.ceil(per * len(self.waiting) / self.config.slots)))

    def take(self, free: int) -> list[Request]:
        """Up to min(free, max_prefill_batch) live requests from the queue (lock held): the head of the queue and
        those of the next LOOKAHEAD whose prompts fall in its prefill bucket (a batch padded to one length wastes
        nothing on shorter rows) and are of its kind (spoken or text: they prefill through different maps); the
        others keep their places. Expired or cancelled ones are answered on the way."""
        out, skipped, bucket = [], [], None
        now = time.perf_counter()
        limit = min(free, self.config.max_prefill_batch)
        scanned = 0
        while self.waiting and len(out) < limit and scanned < self.LOOKAHEAD:
            r = self.waiting.popleft()
            scanned += 1
            if r.cancelled:
                self.fail(r, 499, "cancelled by the client")
            elif now > r.deadline:
                self.fail(r, 504, f"timed out after {r.deadline - r.submitted:.0f} s waiting in the queue")
            else:
                b = (self.bucket_of(len(r.prompt) - 1), bool(r.audio))
                bucket = b if bucket is None else bucket
                (out if b == bucket else skipped).append(r)
        self.waiting.extendleft(reversed(skipped))
        self.metrics.queue_depth.set(len(self.waiting))
        return out

    def drain(self) -> list[Request]:
        """Empty the queue (lock held); returns what waited."""
        waiting = list(self.waiting)
        self.waiting.clear()
        return waiting

    def finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.finished = True
        self._e2e.append(time.perf_counter() - req.submitted)
        self.metrics.requests.labels(path=self.path, outcome=reason).inc()
        req.sink(Event("finish", reason=reason))

    def fail(self, req: Request, status: int, message: str) -> None:
        if req.finished:
            return
        req.finished = True
        outcome = {499: "cancelled", 504: "timeout"}.get(status, "error")
        self.metrics.requests.labels(path=self.path, outcome=outcome).inc()
        req.sink(Event("error", status=status, message=message))


class DraftPolicy:
    """How much a decode step drafts: the verify width of a round (each row's pending token and up to width - 1 of
    its drafts, kvjax.serve.programs.round_step) or 0, a plain step (programs.plain_step): whichever is predicted to
    emit the most tokens per second. It is the cost model of kvjax.speculative.cost applied to one step, with every
    part measured by the engine itself:

    - Yield. Before a step each occupied row's draft is known (programs.lookahead: its length d and its source, a
      copy of prompt lookup after a recurring n-gram of n tokens or the model drafter's draft). A round of width w
      emits from each row 1 + the drafts it accepts, so it is predicted to emit E(w) = rows + sum over rows of
      P(1) + .. + P(min(d, w - 1)), where P(j) is the measured share of rows that accepted their first j drafts
      among those that verified j, per source and for greedy and sampled rows apart (recent rounds weigh more:
      DECAY per round; PRIOR ** j, worth PRIOR_WEIGHT rows, before any is measured). A plain step emits a token a row.
    - Cost. The median time of the recent steps (WINDOW) of that width at this compiled row count, the whole step
      (the programs and the answers' bookkeeping). A width not measured yet is priced by the line
      c(w) = c(plain) * (1 + slope * (w - 1)), the slope the median of the measured widths' (SLOPE before any).
    - Choice: the largest predicted tokens per second, E(w) / c(w) against rows / c(plain). So drafting follows the
      text (rows whose copies are accepted), the batch (on a compute-bound CPU a wide round over many rows costs
      several plain steps, and drafting turns down as the batch grows), the context and the machine.
    - Measuring: plain steps first (MIN_SAMPLES); then plain and the best other width each run again once their gap
      has passed since they last ran, the gap such that what they lose against the best is EXPLORE_LOSS of a step
      per step (at least MIN_GAP, at most MAX_GAP steps), so every estimate stays current and drafting that stopped
      paying (or starts to) is seen.

    A sampled row (temperature > 0) only runs the widest round (one compiled program per row count). `mode`
    "always" drafts every step, at the narrowest width that holds the longest draft (tests, and measuring rounds)."""

    WINDOW = 16
    MIN_SAMPLES = 3
    EXPLORE_LOSS = 0.01
    MIN_GAP = 16
    MAX_GAP = 256
    PRIOR = 0.5
    PRIOR_WEIGHT = 2.0
    DECAY = 0.99
    SLOPE = 0.25

    def __init__(self, mode: str = "auto", widths: tuple[int, ...] = (2,), sources: int = 1, draft_len: int = 1):
        self.mode, self.widths, self.g = mode, tuple(sorted(widths)), int(draft_len)
        # [source, sampled row, j]: row-rounds that verified >= j drafts of that source, and accepted >= j of them
        self.verified = np.zeros((sources, 2, self.g + 1))
        self.accepted = np.zeros((sources, 2, self.g + 1))
        self._cum = None  # the expected accepted drafts per (source, sampled, drafts verified), from the counts
        self.costs: dict = collections.defaultdict(lambda: collections.deque(maxlen=self.WINDOW))  # (rows, sampled, w)
        self.count: dict = collections.defaultdict(int)  # (rows, sampled) -> steps so far
        self.ran: dict = {}  # (rows, sampled, w) -> the step count when width w last ran
        self.predicted = float("nan")  # the best round's predicted tokens/s over a plain step's (the metrics' gauge)

    # ---- the estimates ---------------------------------------------------------------------------------------------

    def acceptance(self) -> np.ndarray:
        """P(j) per [source, sampled, j] (j = 0 unused): the share of rows that accepted their first j drafts."""
        prior = self.PRIOR ** np.arange(self.g + 1)
        return (self.accepted + self.PRIOR_WEIGHT * prior) / (self.verified + self.PRIOR_WEIGHT)

    def expected(self, width: int, lengths, sources, hot) -> float:
        """Tokens a round of `width` is predicted to emit from rows that would draft `lengths` [R] drafts from
        `sources` [R] (hot [R]: the row samples)."""
        if self._cum is None:
            p = self.acceptance()
            self._cum = np.concatenate([np.zeros(p.shape[:2] + (1,)), np.cumsum(p[..., 1:], axis=-1)], axis=-1)
        m = np.minimum(np.asarray(lengths), width - 1)
        return float(len(m) + self._cum[np.asarray(sources), np.asarray(hot, np.int64), m].sum())

    def cost(self, rows: int, sampled: bool, width: int) -> float:
        """Seconds a step of `width` (0: plain) takes at `rows` (the plain step's must be measured)."""
        own = self.costs.get((rows, sampled, width))
        if own:
            return float(np.median(own))
        plain = float(np.median(self.costs[rows, sampled, 0]))
        slopes = [(float(np.median(c)) / plain - 1.0) / (w - 1) for (r, s, w), c in self.costs.items()
                  if r == rows and s == sampled and w >= 2 and c]
        slope = max(float(np.median(slopes)), 0.0) if slopes else self.SLOPE
        return plain * (1.0 + slope * (width - 1))

    # ---- the choice ----------------------------------------------------------------------------------------------

    def choose(self, rows: int, sampled: bool, lengths, sources, hot) -> int:
        """The next step's verify width (0: a plain step). `rows`: its compiled row count; lengths, sources, hot
        [R]: each occupied row's draft (programs.lookahead) and whether it samples; `sampled`: some row does."""
        top = int(np.max(lengths, initial=0))
        fits = [w for w in self.widths if w >= top + 1] or [self.widths[-1]]
        if self.mode == "always":
            return self.widths[-1] if sampled else fits[0]
        key = (rows, sampled)
        if top == 0 or len(self.costs[rows, sampled, 0]) < self.MIN_SAMPLES:
            return 0  # nothing to draft, or the plain step not measured yet
        # a round wider than the narrowest that holds the longest draft verifies nothing more
        options = [self.widths[-1]] if sampled else [w for w in self.widths if 2 <= w <= fits[0]]
        rate = {0: len(lengths) / self.cost(rows, sampled, 0)}
        for w in options:
            rate[w] = self.expected(w, lengths, sources, hot) / self.cost(rows, sampled, w)
        best = max(rate, key=rate.get)
        self.predicted = max(rate[w] for w in options) / rate[0]
        # measuring: plain and the best other width, each once its gap has passed since it last ran
        others = [w for w in options if w != best]
        candidates = ([0] if best else []) + ([max(others, key=rate.get)] if others else [])
        now = self.count[key]
        for w in sorted(candidates, key=rate.get, reverse=True):
            loss = 1.0 - rate[w] / rate[best]
            gap = min(self.MAX_GAP, max(self.MIN_GAP, int(np.ceil(loss / self.EXPLORE_LOSS))))
            if now - self.ran.get((rows, sampled, w), 0) >= gap:
                return w
        return best

    # ---- what steps did -------------------------------------------------------------------------------------------

    def observe(self, width: int, rows: int, sampled: bool, seconds: float) -> None:
        """A step of `width` (0: plain) at `rows` took `seconds`."""
        self.costs[rows, sampled, width].append(seconds)
        self.count[rows, sampled] += 1
        self.ran[rows, sampled, width] = self.count[rows, sampled]

    def rounds(self, verified, sources, hot, accepted) -> None:
        """A round's rows: verified [R] drafts of `sources` [R] (hot [R]: sampled rows), of which each accepted
        `accepted` [R] (its first ones)."""
        j = np.arange(self.g + 1)[None]
        at = (np.asarray(sources), np.asarray(hot, np.int64))
        self.verified *= self.DECAY
        self.accepted *= self.DECAY
        np.add.at(self.verified, at, (j <= np.asarray(verified)[:, None]) & (j > 0))
        np.add.at(self.accepted, at, (j <= np.asarray(accepted)[:, None]) & (j > 0))
        self._cum = None

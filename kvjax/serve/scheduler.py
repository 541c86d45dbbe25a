"""Scheduling: the bounded queue of waiting requests, read in prefill batches of one length bucket, and the answer
that ends each request (its metrics, its last event). One lock (a Condition) guards the queue; the engine's threads
share it for the state they hand each other. With speculative decoding, `DraftPolicy` decides per decode step
whether it drafts, from the measured costs and yields of both kinds of step."""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

import numpy as np

from kvjax.serve.config import EngineConfig, Event, QueueFull, Request
from kvjax.serve.metrics import Metrics
from kvjax.speculative.cost import speedup


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
    """Whether a decode step drafts (a verify round: kvjax.serve.programs.round_step) or not (a plain
    step that only advances the drafter states, plain_step): whichever is predicted to make more tokens per second.

    The prediction is the cost model of kvjax.speculative.cost in decode-step units: a round emits tau tokens per
    row (accepted drafts + the target's own token) and costs c plain steps, so drafting pays when
    speedup(tau, c) = tau / c > 1. Both are measured from the engine's own recent steps at this row count (the last
    WINDOW of each kind, the whole step: the programs and the answers' bookkeeping): tau the tokens per occupied row
    of the recent rounds, c the median round time over the median plain step time. So they follow the text (a round
    in which nothing is drafted emits one token a row at about a plain step's cost), the context length, the batch
    and the machine. A verify round over many rows costs several plain steps on a compute-bound CPU, so drafting
    turns off as the batch grows, and back on as it shrinks or the text starts repeating.

    Measuring: a kind with fewer than MIN_SAMPLES measured steps at a row count is run to measure it (plain first:
    what would run anyway). After that the kind not chosen is run again once per K steps of the chosen one (at least
    MIN_GAP), K such that its waste is EXPLORE_LOSS of their time: the worse the other kind, the rarer it runs, and
    both estimates stay current. `mode` "always" drafts every step (tests, and measuring the rounds themselves)."""

    WINDOW = 16
    MIN_SAMPLES = 5
    EXPLORE_LOSS = 0.01
    MIN_GAP = 16

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        # (kind, rows, sampled) -> recent steps' (seconds, tokens emitted, occupied rows)
        self.steps: dict = collections.defaultdict(lambda: collections.deque(maxlen=self.WINDOW))
        self.estimate: dict = {}  # (kind, rows, sampled) -> (median seconds, tokens per occupied row), as they arrive
        self.since: dict = collections.defaultdict(int)  # (rows, sampled) -> steps since the kind last changed
        self.last: dict = {}  # (rows, sampled) -> the kind of the last step (True: a round)
        self.predicted = float("nan")  # the last predicted speed-up of drafting (the metrics' gauge)

    def choose(self, rows: int, sampled: bool) -> bool:
        """Draft this step? `rows`: the step's row count (programs.row_buckets); `sampled`: some row samples."""
        if self.mode == "always":
            return True
        for kind in ("plain", "draft"):
            if len(self.steps[kind, rows, sampled]) < self.MIN_SAMPLES:
                return kind == "draft"
        (v, tau), (s, _) = self.estimate["draft", rows, sampled], self.estimate["plain", rows, sampled]
        c = v / s
        self.predicted = p = speedup(tau, c, 0.0)
        best = p > 1.0
        # what one step of the other kind wastes, in plain steps: a round where plain is better costs c and makes
        # what tau plain steps make (c - tau); a plain step where rounds are better makes 1 / p of a plain step's
        # worth of rounds (1 - 1 / p); spread over `gap` steps of the chosen kind it is EXPLORE_LOSS of their time
        waste = (1.0 - 1.0 / p) / c if best else c - tau
        gap = max(self.MIN_GAP, int(np.ceil(waste / self.EXPLORE_LOSS)))
        if self.last.get((rows, sampled)) == best and self.since[rows, sampled] >= gap:
            return not best  # measure the other kind again
        return best

    def observe(self, drafted: bool, rows: int, sampled: bool, seconds: float, tokens: int, occupied: int) -> None:
        """A step of that kind took `seconds` and emitted `tokens` over `occupied` requests."""
        key = ("draft" if drafted else "plain", rows, sampled)
        steps = self.steps[key]
        steps.append((seconds, tokens, max(occupied, 1)))
        self.estimate[key] = (float(np.median([t for t, _, _ in steps])),
                              sum(k for _, k, _ in steps) / sum(n for _, _, n in steps))
        same = self.last.get((rows, sampled)) == drafted
        self.since[rows, sampled] = self.since[rows, sampled] + 1 if same else 1
        self.last[rows, sampled] = drafted

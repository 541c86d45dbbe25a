"""Scheduling: the bounded queue of waiting requests, read in prefill batches of one length bucket, and the answer
that ends each request (its metrics, its last event). One lock (a Condition) guards the queue; the engine's threads
share it for the state they hand each other."""

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

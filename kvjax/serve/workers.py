"""The disaggregated topology's prefill pool: one worker thread per prefill device takes a batch from the queue, runs
source + map on its device and hands the mapped cache (moved to the decode device) to the decode thread, which
inserts it. The decode thread also supervises the workers: one that dies or hangs has its in-flight requests failed
with a clear error and is replaced, or, past `max_worker_restarts`, the engine reports unhealthy and refuses work."""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from kvjax.serve.config import EngineConfig, Request
from kvjax.serve.faults import Faults, WorkerKilled
from kvjax.serve.metrics import Metrics
from kvjax.serve.scheduler import Scheduler

log = logging.getLogger("kvjax.serve")


class Worker:
    """A prefill worker thread and what it holds (to fail it if the thread dies or hangs)."""

    def __init__(self, index: int, device, generation: int):
        self.index, self.device, self.generation = index, device, generation
        self.inflight: list[Request] = []
        self.busy_since = 0.0
        self.thread: threading.Thread | None = None


class PrefillPool:
    """`prefill(requests, device)` -> [(requests, cache on the decode device)] (failed requests answered);
    `free_slots()`: decode slots not holding a request; `running()`: whether the engine runs. Shares the
    scheduler's lock for the queue, the ready batches and the slots they were promised."""

    def __init__(self, devices, config: EngineConfig, scheduler: Scheduler, prefill: Callable,
                 free_slots: Callable[[], int], running: Callable[[], bool], metrics: Metrics, faults: Faults):
        self.devices, self.config, self.scheduler, self.lock = devices, config, scheduler, scheduler.lock
        self.prefill, self.free_slots, self.running, self.metrics, self.faults = (prefill, free_slots, running,
                                                                                   metrics, faults)
        self.workers: list[Worker] = []
        self.ready: collections.deque = collections.deque()  # (requests, cache on decode device), for the decode thread
        self.reserved = 0  # slots promised to prefilled-but-not-inserted requests
        self.restarts = 0
        self.unhealthy = ""  # why the pool gave up (past max_worker_restarts)

    def start(self) -> None:
        self.workers = [Worker(i, dev, 0) for i, dev in enumerate(self.devices)]
        for w in self.workers:
            self._spawn(w)

    def held(self) -> list[Request]:
        """The requests in flight or prefilled and waiting for a slot (lock held)."""
        return [r for w in self.workers for r in w.inflight] + [r for reqs, _ in self.ready for r in reqs]

    def take_ready(self) -> list:
        """The prefilled batches, for the decode thread to insert; `release` each one's promised slots first."""
        with self.lock:
            ready = list(self.ready)
            self.ready.clear()
        return ready

    def release(self, n: int) -> None:
        with self.lock:
            self.reserved -= n

    def stats(self) -> list[dict]:
        return [{"device": str(w.device), "alive": bool(w.thread and w.thread.is_alive()), "inflight": len(w.inflight)}
                for w in self.workers]

    def threads(self) -> list[threading.Thread | None]:
        return [w.thread for w in self.workers]

    def _spawn(self, w: Worker) -> Worker:
        w.thread = threading.Thread(target=self._worker_main, args=(w,), name=f"kvjax-prefill-{w.index}",
                                    daemon=True)
        w.thread.start()
        return w

    def _worker_main(self, w: Worker) -> None:
        while self.running() and self.workers[w.index] is w:
            with self.lock:
                free = self.free_slots() - self.reserved
                reqs = self.scheduler.take(free) if free > 0 else []
                if not reqs:
                    self.lock.wait(0.05)
                    continue
                self.reserved += len(reqs)
                w.inflight, w.busy_since = reqs, time.perf_counter()
            try:
                self.faults.check("worker", w)
                done = self.prefill(reqs, w.device)
            except WorkerKilled as e:  # the thread ends holding its requests: supervise() answers them
                log.error("prefill worker %d killed: %s", w.index, e)
                return
            with self.lock:
                if self.workers[w.index] is w:  # else it was declared hung and replaced: its result is dropped
                    handed = sum(len(b) for b, _ in done)
                    self.reserved -= len(reqs) - handed  # failed ones release their slot promise
                    self.ready.extend(done)
                    w.inflight, w.busy_since = [], 0.0
                    self.lock.notify_all()

    def supervise(self) -> None:
        """A dead worker (thread ended) or a hung one (one batch past prefill_timeout): fail what it held, replace
        it, or past max_worker_restarts mark the pool unhealthy (the engine then refuses work)."""
        now = time.perf_counter()
        for i, w in enumerate(list(self.workers)):
            dead = w.thread is not None and not w.thread.is_alive()
            hung = w.busy_since and now - w.busy_since > self.config.prefill_timeout
            if not (dead or hung):
                continue
            why = "died" if dead else f"hung (no result for {now - w.busy_since:.0f} s)"
            with self.lock:
                lost, w.inflight = w.inflight, []
                self.reserved -= len(lost)
                self.restarts += 1
                self.metrics.worker_restarts.inc()
                replace = self.restarts <= self.config.max_worker_restarts and self.running()
                # a replaced (or, unhealthy, retired) worker's thread that returns later drops its result
                self.workers[i] = Worker(i, w.device, self.restarts)
            for r in lost:
                self.scheduler.fail(r, 503, f"prefill worker {i} on {w.device} {why} while prefilling this request; "
                                            "retry")
            log.error("prefill worker %d %s; %s", i, why, "restarted" if replace else "not restarted: unhealthy")
            if replace:
                self._spawn(self.workers[i])
            else:
                self.unhealthy = (f"prefill worker {i} {why} and {self.restarts - 1} restarts were used "
                                  f"(max_worker_restarts={self.config.max_worker_restarts})")
                self.metrics.healthy.set(0)
                with self.lock:
                    waiting = self.scheduler.drain()
                for r in waiting:
                    self.scheduler.fail(r, 503, f"the server is unhealthy: {self.unhealthy}")

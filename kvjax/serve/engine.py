"""The serving engine: continuous batching over a fixed set of decode slots, fed by source prefill + map.

One batched target cache holds `slots` rows (kvjax.serve.programs). A request waits in a bounded queue, is prefilled
(with the others waiting, up to `max_prefill_batch`) by the path the map's gate allows (source + map, or the target
itself), its cache is written into a free slot, and from then on it advances one token per decode step with every
other active slot; it leaves (EOS, stop text, max_tokens, timeout, cancel, error) between two steps and its slot is
free for the next. Topologies (EngineConfig.topology):

  serial          one request at a time: prefill, then decode it alone (1 slot, prefill batch 1)
  batched         one thread and device do both: between decode steps it admits a prefill batch into free slots
  disaggregated   prefill workers (one thread per prefill device) run source + map and move each mapped cache to the
                  decode device, where one thread inserts and decodes; prefill and decode overlap

JAX runs only on the engine's own threads; callers (the asyncio server) submit requests and receive events through
the request's `sink`, a thread-safe callable. A prefill worker that dies or hangs is detected by the decode thread:
its in-flight requests fail with a clear error, and it is restarted (or, past `max_worker_restarts`, the engine
reports unhealthy and refuses new work).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.serve import programs
from kvjax.serve.faults import Faults, WorkerKilled
from kvjax.serve.metrics import Metrics
from kvjax.serve.text import TextStream

log = logging.getLogger("kvjax.serve")

TOPOLOGIES = ("serial", "batched", "disaggregated")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    topology: str = "batched"
    slots: int = 32  # rows of the decode cache: requests decoding at once
    capacity: int = 2048  # positions per slot: prompt + max_tokens must fit
    max_prefill_batch: int = 8  # prompts prefilled together (padded to a power of two)
    max_queue: int = 256  # waiting requests; past it, submit raises QueueFull (HTTP 429)
    max_tokens_limit: int = 1024  # largest max_tokens a request may ask for
    request_timeout: float = 300.0  # seconds from submission to the last token
    prefill_devices: int = 0  # disaggregated: devices of the prefill pool (0: all but the last; the last decodes)
    prefill_timeout: float = 120.0  # a prefill batch running longer marks its worker hung
    max_worker_restarts: int = 3  # prefill worker deaths tolerated before the engine reports unhealthy

    def resolved(self) -> "EngineConfig":
        """serial is one slot and one prompt per prefill: a request has the engine to itself."""
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"topology {self.topology!r}: use one of {', '.join(TOPOLOGIES)}")
        if self.topology == "serial":
            return dataclasses.replace(self, slots=1, max_prefill_batch=1)
        return self

    def problems(self) -> list[str]:
        out = [f"{name} must be >= 1, got {getattr(self, name)}" for name in
               ("slots", "capacity", "max_prefill_batch", "max_queue", "max_tokens_limit")
               if getattr(self, name) < 1]
        if self.topology not in TOPOLOGIES:
            out.append(f"topology {self.topology!r}: use one of {', '.join(TOPOLOGIES)}")
        if self.request_timeout <= 0 or self.prefill_timeout <= 0:
            out.append("request_timeout and prefill_timeout must be > 0")
        return out


class QueueFull(Exception):
    """The bounded queue is full: retry after `retry_after` seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the server is at capacity (queue full); retry after {retry_after} s")
        self.retry_after = retry_after


class Unhealthy(Exception):
    """The engine cannot take work (a pool died past its restarts, or the engine stopped)."""


@dataclasses.dataclass
class Event:
    kind: str  # "token" (ids, text), "finish" (reason), "error" (status, message)
    ids: tuple[int, ...] = ()
    text: str = ""
    reason: str = ""
    status: int = 0
    message: str = ""


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    """One generation. `prompt`: token ids (>= 2). `sink(Event)` is called from engine threads."""

    prompt: list[int]
    max_tokens: int
    sink: Callable[[Event], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    timeout: float | None = None
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    submitted: float = 0.0
    deadline: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    generated: list = dataclasses.field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    text: TextStream | None = None


class _Worker:
    """A prefill worker thread and what it holds (to fail it if the thread dies or hangs)."""

    def __init__(self, index: int, device, generation: int):
        self.index, self.device, self.generation = index, device, generation
        self.inflight: list[Request] = []
        self.busy_since = 0.0
        self.thread: threading.Thread | None = None


class Engine:
    """See the module docstring. `source`/`target`: (config, params); `kvmap`: the map; `split`: serve the split
    path (False: the map's gate failed, the target prefills itself); `tokenizer`: a tokenizers.Tokenizer."""

    def __init__(self, source, target, kvmap, tokenizer, config: EngineConfig = EngineConfig(), split: bool = True,
                 reason: str = "", faults: Faults | None = None, metrics: Metrics | None = None,
                 devices=None):
        problems = config.problems()
        if problems:
            raise ValueError("engine settings: " + "; ".join(problems))
        self.config = config = config.resolved()
        self.split, self.reason = split, reason
        self.path = "split" if split else "native_target"
        self.tokenizer = tokenizer
        self.faults = faults or Faults()
        self.metrics = metrics or Metrics()
        self.metrics.slots.set(config.slots)
        tcfg = target[0]
        self.eos = frozenset(tcfg.eos_token_ids)
        self.vocab_size = tcfg.vocab_size
        self.buckets = programs.buckets(config.capacity)
        self.row_buckets = programs.row_buckets(config.slots)  # the decode step's compiled row counts
        devices = list(devices or jax.devices())
        if config.topology == "disaggregated" and len(devices) > 1:
            n = config.prefill_devices or len(devices) - 1
            if not 1 <= n < len(devices):
                raise ValueError(f"prefill_devices={n}: need 1..{len(devices) - 1} of the {len(devices)} devices "
                                 "(the rest decode)")
            self.prefill_devices, self.decode_device = devices[:n], devices[n]
        else:  # one device: the pools share it (still separate threads when disaggregated)
            self.prefill_devices, self.decode_device = devices[:1], devices[0]
        place = lambda tree, dev: jax.device_put(tree, dev)  # noqa: E731
        self.target = (tcfg, place(target[1], self.decode_device))
        # each prefill device holds what its path runs: source + map, or (gate failed) the target
        self._builders = {}
        for dev in self.prefill_devices:
            src = (source[0], place(source[1], dev)) if split else None
            tgt = self.target if dev == self.decode_device else (tcfg, place(target[1], dev))
            self._builders[dev] = programs.prefill_builder(src, tgt, place(kvmap, dev) if split else None, split)
        dtype = jnp.dtype(target[1].embed.dtype)
        self.cache = programs.empty_slots(tcfg, config.slots, config.capacity, dtype, self.decode_device)
        s = config.slots
        self._slot_req: list[Request | None] = [None] * s
        self._next_in = np.zeros(s, np.int32)
        self._temp = np.zeros(s, np.float32)
        self._top_p = np.ones(s, np.float32)
        self._seed = np.zeros(s, np.int32)
        self._count = np.zeros(s, np.int32)
        self._waiting: collections.deque[Request] = collections.deque()
        self._ready: collections.deque = collections.deque()  # disaggregated: (requests, cache on decode device)
        self._reserved = 0  # slots promised to prefilled-but-not-inserted requests
        self._lock = threading.Condition()
        self._running = False
        self._unhealthy = ""
        self._restarts = 0
        self._workers: list[_Worker] = []
        self._decode_thread: threading.Thread | None = None
        self._e2e = collections.deque(maxlen=64)  # recent end-to-end seconds (Retry-After estimate)

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> "Engine":
        self._running = True
        if self.config.topology == "disaggregated":
            self._workers = [_Worker(i, dev, 0) for i, dev in enumerate(self.prefill_devices)]
            for w in self._workers:
                self._spawn(w)
        self._decode_thread = threading.Thread(target=self._decode_main, name="kvjax-decode", daemon=True)
        self._decode_thread.start()
        self.metrics.healthy.set(1)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._running = False
            pending = list(self._waiting) + [r for r in self._slot_req if r is not None]
            pending += [r for w in self._workers for r in w.inflight]
            pending += [r for reqs, _ in self._ready for r in reqs]
            self._waiting.clear()
            self._lock.notify_all()
        for r in pending:
            self._fail(r, 503, "the server is shutting down")
        for t in [self._decode_thread] + [w.thread for w in self._workers]:
            if t is not None and t is not threading.current_thread():
                t.join(timeout)

    def warmup(self, max_prompt: int | None = None, min_prompt: int = 2) -> float:
        """Compile every prefill (bucket x batch size) for prompts of min_prompt..max_prompt tokens and the decode
        step, before serving: the first requests then see serving latency, not compile time. Returns seconds."""
        t0 = time.perf_counter()
        limit = self.config.capacity if max_prompt is None else max_prompt
        low = programs.bucket_for(max(1, min(min_prompt, limit) - 1), self.buckets)
        sizes = sorted({programs.batch_size_for(n, self.config.max_prefill_batch)
                        for n in range(1, self.config.max_prefill_batch + 1)})
        for dev, builder in self._builders.items():
            top = programs.bucket_for(min(limit, self.config.capacity), self.buckets)
            for bucket in [b for b in self.buckets if low <= b <= top]:
                for bs in sizes:
                    new = programs.prefill_batch(builder, [[0, 0]], bucket, bs)
                    new = jax.device_put(new, self.decode_device)
                    slots = jnp.full((bs,), self.config.slots, jnp.int32)  # all dropped
                    self.cache = programs.insert(self.cache, new, slots)
        for rows in self.row_buckets:
            self._run_step(rows)
        jax.block_until_ready(self.cache)
        return time.perf_counter() - t0

    @property
    def healthy(self) -> tuple[bool, str]:
        if self._unhealthy:
            return False, self._unhealthy
        if not self._running:
            return False, "engine stopped"
        if self._decode_thread is None or not self._decode_thread.is_alive():
            return False, "decode thread is not running"
        return True, ""

    def stats(self) -> dict:
        with self._lock:
            return {"topology": self.config.topology, "slots": self.config.slots,
                    "active_slots": sum(r is not None for r in self._slot_req), "queue": len(self._waiting),
                    "prefill_workers": [{"device": str(w.device), "alive": bool(w.thread and w.thread.is_alive()),
                                         "inflight": len(w.inflight)} for w in self._workers],
                    "worker_restarts": self._restarts, "path": self.path}

    # ---- requests ----------------------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        ok, why = self.healthy
        if not ok:
            raise Unhealthy(why)
        now = time.perf_counter()
        req.submitted = now
        req.deadline = now + (req.timeout or self.config.request_timeout)
        req.text = TextStream(self.tokenizer, req.stop)
        with self._lock:
            if len(self._waiting) >= self.config.max_queue:
                self.metrics.rejected.inc()
                raise QueueFull(self._retry_after())
            self._waiting.append(req)
            self.metrics.queue_depth.set(len(self._waiting))
            self._lock.notify_all()

    def cancel(self, req: Request) -> None:
        """The client went away: the request stops at the next step boundary and frees its slot."""
        req.cancelled = True
        with self._lock:
            self._lock.notify_all()

    def _retry_after(self) -> int:
        per = float(np.median(self._e2e)) if self._e2e else 1.0
        return max(1, int(np.ceil(per * len(self._waiting) / self.config.slots)))

    def _finish(self, req: Request, reason: str) -> None:
        if req.finished:
            return
        req.finished = True
        self._e2e.append(time.perf_counter() - req.submitted)
        self.metrics.requests.labels(path=self.path, outcome=reason).inc()
        req.sink(Event("finish", reason=reason))

    def _fail(self, req: Request, status: int, message: str) -> None:
        if req.finished:
            return
        req.finished = True
        outcome = {499: "cancelled", 504: "timeout"}.get(status, "error")
        self.metrics.requests.labels(path=self.path, outcome=outcome).inc()
        req.sink(Event("error", status=status, message=message))

    # ---- prefill -----------------------------------------------------------------------------------------------

    LOOKAHEAD = 64  # queued requests scanned for prompts of the head's prefill bucket

    def _take(self, free: int) -> list[Request]:
        """Up to min(free, max_prefill_batch) live requests from the queue (lock held): the head of the queue and
        those of the next LOOKAHEAD whose prompts fall in its prefill bucket (a batch padded to one length wastes
        nothing on shorter rows); the others keep their places. Expired or cancelled ones are answered on the way."""
        out, skipped, bucket = [], [], None
        now = time.perf_counter()
        limit = min(free, self.config.max_prefill_batch)
        scanned = 0
        while self._waiting and len(out) < limit and scanned < self.LOOKAHEAD:
            r = self._waiting.popleft()
            scanned += 1
            if r.cancelled:
                self._fail(r, 499, "cancelled by the client")
            elif now > r.deadline:
                self._fail(r, 504, f"timed out after {r.deadline - r.submitted:.0f} s waiting in the queue")
            else:
                b = programs.bucket_for(len(r.prompt) - 1, self.buckets)
                bucket = b if bucket is None else bucket
                (out if b == bucket else skipped).append(r)
        self._waiting.extendleft(reversed(skipped))
        self.metrics.queue_depth.set(len(self._waiting))
        return out

    def _prefill(self, reqs: list[Request], device):
        """[(requests, cache on the decode device)]: one batch; if it fails, each request alone, so a bad request
        fails by itself (its error answered here) and the others go on."""
        try:
            return [(reqs, self._prefill_once(reqs, device))]
        except WorkerKilled:
            raise
        except Exception as e:  # noqa: BLE001 - any failure is answered to its request, never kills the engine
            if len(reqs) == 1:
                log.exception("prefill failed for request %d", reqs[0].id)
                self._fail(reqs[0], 500, f"prefill failed: {type(e).__name__}: {e}")
                return []
        out = []
        for r in reqs:
            out += self._prefill([r], device)
        return out

    def _prefill_once(self, reqs: list[Request], device):
        for r in reqs:
            self.faults.check("prefill", r)
        bucket = programs.bucket_for(max(len(r.prompt) - 1 for r in reqs), self.buckets)
        batch = programs.batch_size_for(len(reqs), self.config.max_prefill_batch)
        t0 = time.perf_counter()
        cache = programs.prefill_batch(self._builders[device], [r.prompt for r in reqs], bucket, batch)
        if device != self.decode_device:
            cache = jax.device_put(cache, self.decode_device)  # the mapped cache moves to the decode pool
        jax.block_until_ready(cache)
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        self.metrics.prefill_tokens.inc(sum(len(r.prompt) - 1 for r in reqs))
        return cache

    def _insert(self, reqs: list[Request], cache) -> None:
        """Write a prefilled batch into free slots (decode thread)."""
        free = [i for i, r in enumerate(self._slot_req) if r is None]
        slots = np.full((cache.batch_size,), self.config.slots, np.int32)  # padding and dropped rows: nowhere
        for row, r in enumerate(reqs):
            if r.finished:
                continue
            if r.cancelled:
                self._fail(r, 499, "cancelled by the client")
                continue
            s = free.pop(0)
            slots[row] = s
            self._slot_req[s] = r
            self._next_in[s] = r.prompt[-1]
            self._temp[s], self._top_p[s], self._seed[s], self._count[s] = r.temperature, r.top_p, r.seed, 0
        if any(slots < self.config.slots):
            self.cache = programs.insert(self.cache, cache, jnp.asarray(slots))

    # ---- decode ------------------------------------------------------------------------------------------------

    def _run_step(self, rows: int | None = None):
        active = np.array([r is not None for r in self._slot_req])
        if rows is None:  # the smallest compiled row count that holds every occupied slot
            need = int(np.flatnonzero(active).max()) + 1 if active.any() else 1
            rows = next(b for b in self.row_buckets if b >= need)
        out, self.cache = programs.step(self.target[1], self.target[0], self.cache, self._next_in, active,
                                        self._temp, self._top_p, self._seed, self._count, rows=rows)
        return np.asarray(out)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            out = self._run_step()
        except Exception as e:  # noqa: BLE001 - the batch step itself failed: every slot in it fails, the cache is rebuilt
            log.exception("decode step failed")
            for s, r in enumerate(self._slot_req):
                if r is not None:
                    self._fail(r, 500, f"decode step failed: {type(e).__name__}: {e}")
                    self._slot_req[s] = None
            self.cache = programs.empty_slots(self.target[0], self.config.slots, self.config.capacity,
                                              self.cache.dtype, self.decode_device)
            return
        now = time.perf_counter()
        self.metrics.step_seconds.observe(now - t0)
        produced = 0
        for s, r in enumerate(self._slot_req):
            if r is None:
                continue
            try:
                self.faults.check("step", r)
                produced += 1
                self._emit(s, r, int(out[s]), now)
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                log.exception("request %d failed in its decode step", r.id)
                self._fail(r, 500, f"generation failed: {type(e).__name__}: {e}")
            if r.finished:
                self._slot_req[s] = None
        self.metrics.produced(produced, now)

    def _emit(self, s: int, r: Request, tok: int, now: float) -> None:
        if r.cancelled:
            self._fail(r, 499, "cancelled by the client")
            return
        if not r.generated:
            r.first_token_at = now
            self.metrics.ttft.observe(now - r.submitted)
        else:
            self.metrics.token_latency.observe(now - r.last_token_at)
        r.last_token_at = now
        r.generated.append(tok)
        self._count[s] += 1
        self._next_in[s] = tok
        eos = tok in self.eos
        delta, stopped = r.text.push(tok, final=eos)
        r.sink(Event("token", ids=(tok,), text=delta))
        if eos or stopped:
            self._finish(r, "stop")
        elif len(r.generated) >= r.max_tokens:
            tail = r.text.flush()
            if tail:
                r.sink(Event("token", ids=(), text=tail))
            self._finish(r, "length")
        elif now > r.deadline:
            self._fail(r, 504, f"timed out after {now - r.submitted:.0f} s ({len(r.generated)} tokens generated)")

    def _sweep(self) -> None:
        """Free the slots of requests cancelled or past their deadline (between steps)."""
        now = time.perf_counter()
        for s, r in enumerate(self._slot_req):
            if r is None:
                continue
            if r.cancelled:
                self._fail(r, 499, "cancelled by the client")
            elif now > r.deadline:
                self._fail(r, 504, f"timed out after {now - r.submitted:.0f} s ({len(r.generated)} tokens generated)")
            if r.finished:
                self._slot_req[s] = None

    def _decode_main(self) -> None:
        disaggregated = self.config.topology == "disaggregated"
        while self._running:
            try:
                self._sweep()
                if disaggregated:
                    self._supervise()
                    with self._lock:
                        ready = list(self._ready)
                        self._ready.clear()
                    for reqs, cache in ready:
                        with self._lock:
                            self._reserved -= len(reqs)
                        self._insert(reqs, cache)
                else:
                    free = sum(r is None for r in self._slot_req)
                    with self._lock:
                        reqs = self._take(free) if free else []
                    if reqs:
                        for batch, cache in self._prefill(reqs, self.prefill_devices[0]):
                            self._insert(batch, cache)
                active = sum(r is not None for r in self._slot_req)
                self.metrics.active_slots.set(active)
                if active:
                    self._step()
                    self.metrics.active_slots.set(sum(r is not None for r in self._slot_req))
                else:
                    with self._lock:
                        if not self._waiting and not self._ready and self._running:
                            self._lock.wait(0.05)
                        elif disaggregated and not self._ready:
                            self._lock.wait(0.01)
            except Exception:  # noqa: BLE001 - the loop must survive anything; the failing requests were answered
                log.exception("decode loop error")
                time.sleep(0.01)

    # ---- disaggregated prefill pool ------------------------------------------------------------------------------

    def _spawn(self, w: _Worker) -> _Worker:
        w.thread = threading.Thread(target=self._worker_main, args=(w,), name=f"kvjax-prefill-{w.index}",
                                    daemon=True)
        w.thread.start()
        return w

    def _worker_main(self, w: _Worker) -> None:
        while self._running and self._workers[w.index] is w:
            with self._lock:
                free = self.config.slots - sum(r is not None for r in self._slot_req) - self._reserved
                reqs = self._take(free) if free > 0 else []
                if not reqs:
                    self._lock.wait(0.05)
                    continue
                self._reserved += len(reqs)
                w.inflight, w.busy_since = reqs, time.perf_counter()
            try:
                self.faults.check("worker", w)
                done = self._prefill(reqs, w.device)
            except WorkerKilled as e:  # the thread ends holding its requests: _supervise answers them
                log.error("prefill worker %d killed: %s", w.index, e)
                return
            with self._lock:
                if self._workers[w.index] is w:  # else it was declared hung and replaced: its result is dropped
                    handed = sum(len(b) for b, _ in done)
                    self._reserved -= len(reqs) - handed  # failed ones release their slot promise
                    self._ready.extend(done)
                    w.inflight, w.busy_since = [], 0.0
                    self._lock.notify_all()

    def _supervise(self) -> None:
        """A dead worker (thread ended) or a hung one (one batch past prefill_timeout): fail what it held, replace
        it, or past max_worker_restarts mark the engine unhealthy."""
        now = time.perf_counter()
        for i, w in enumerate(list(self._workers)):
            dead = w.thread is not None and not w.thread.is_alive()
            hung = w.busy_since and now - w.busy_since > self.config.prefill_timeout
            if not (dead or hung):
                continue
            why = "died" if dead else f"hung (no result for {now - w.busy_since:.0f} s)"
            with self._lock:
                lost, w.inflight = w.inflight, []
                self._reserved -= len(lost)
                self._restarts += 1
                self.metrics.worker_restarts.inc()
                replace = self._restarts <= self.config.max_worker_restarts and self._running
                # a replaced (or, unhealthy, retired) worker's thread that returns later drops its result
                self._workers[i] = _Worker(i, w.device, self._restarts)
            for r in lost:
                self._fail(r, 503, f"prefill worker {i} on {w.device} {why} while prefilling this request; retry")
            log.error("prefill worker %d %s; %s", i, why, "restarted" if replace else "not restarted: unhealthy")
            if replace:
                self._spawn(self._workers[i])
            else:
                self._unhealthy = (f"prefill worker {i} {why} and {self._restarts - 1} restarts were used "
                                   f"(max_worker_restarts={self.config.max_worker_restarts})")
                self.metrics.healthy.set(0)
                with self._lock:
                    waiting, self._waiting = list(self._waiting), collections.deque()
                for r in waiting:
                    self._fail(r, 503, f"the server is unhealthy: {self._unhealthy}")

"""The serving engine: continuous batching over a fixed set of decode slots, fed by source prefill + map.

One batched target cache holds `slots` rows (kvjax.serve.slots). A request waits in a bounded queue
(kvjax.serve.scheduler), is prefilled (with the others waiting, up to `max_prefill_batch`) by the path the map's gate
allows (source + map, or the target itself), its cache is written into a free slot, and from then on it advances one
token per decode step with every other active slot; it leaves (EOS, stop text, max_tokens, timeout, cancel, error)
between two steps and its slot is free for the next. Topologies (EngineConfig.topology):

  serial          one request at a time: prefill, then decode it alone (1 slot, prefill batch 1)
  batched         one thread and device do both: between decode steps it admits a prefill batch into free slots
  disaggregated   prefill workers (kvjax.serve.workers: one thread per prefill device) run source + map and move each
                  mapped cache to the decode device, where one thread inserts and decodes; prefill and decode overlap

Spoken requests (Request.audio, with `audio`: kvjax.serve.audio.AudioServing) are prefilled in batches of their
own: on the split path the source's audio adapter listens to the batch's clips (in row order) and the AUDIO map
translates the cache; on the native path (the gate failed) the answerer's own audio adapter listens (`audio` without
a map); either way the target decodes in the same slots as every other request.

JAX runs only on the engine's own threads; callers (the asyncio server) submit requests and receive events through
the request's `sink`, a thread-safe callable. A prefill worker that dies or hangs is detected by the decode thread:
its in-flight requests fail with a clear error, and it is restarted (or, past `max_worker_restarts`, the engine
reports unhealthy and refuses new work).
"""

from __future__ import annotations

import logging
import threading
import time

import jax

from kvjax.serve import programs
from kvjax.serve.prefill import PrefillJob, chunk_width, compile_pieces, pieces
from kvjax.serve.prefix import PrefixCache
from kvjax.serve.config import TOPOLOGIES, EngineConfig, Event, QueueFull, Request, Unhealthy
from kvjax.serve.faults import Faults, WorkerKilled
from kvjax.serve.metrics import Metrics
from kvjax.serve.placement import Placement
from kvjax.serve.scheduler import Scheduler
from kvjax.serve.slots import Slots
from kvjax.serve.text import TextStream
from kvjax.serve.workers import PrefillPool

log = logging.getLogger("kvjax.serve")

__all__ = ["Engine", "EngineConfig", "Event", "QueueFull", "Request", "Unhealthy", "TOPOLOGIES"]


class Engine:
    """See the module docstring. `source`/`target`: (config, params); `kvmap`: the map; `split`: serve the split
    path (False: the map's gate failed, the target prefills itself); `tokenizer`: a tokenizers.Tokenizer; `audio`:
    spoken requests' adapter, map and prompt template (kvjax.serve.audio.AudioServing; with a map: the source's
    adapter, split path only; without: the answerer's own, native path only; None: text only); `audio_reason`: why
    spoken requests are refused when `audio` is None (default: a sentence from the path)."""

    def __init__(self, source, target, kvmap, tokenizer, config: EngineConfig = EngineConfig(), split: bool = True,
                 reason: str = "", faults: Faults | None = None, metrics: Metrics | None = None,
                 devices=None, audio=None, audio_reason: str = "", mesh=None):
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
        devices = list(devices or jax.devices())
        if mesh is not None and mesh.size > 1:  # the models sharded over the mesh, as the job shards them
            if config.topology == "disaggregated":
                raise ValueError(f"a model sharded over {mesh.size} devices serves with topology=batched (the "
                                 "disaggregated pools hold one device each): use --topology batched, or "
                                 "--config.mesh.model=1 --config.mesh.data=1")
            self.prefill_devices, self.decode_device = [Placement(mesh)], Placement(mesh)
        elif config.topology == "disaggregated" and len(devices) > 1:
            n = config.prefill_devices or len(devices) - 1
            if not 1 <= n < len(devices):
                raise ValueError(f"prefill_devices={n}: need 1..{len(devices) - 1} of the {len(devices)} devices "
                                 "(the rest decode)")
            self.prefill_devices, self.decode_device = [Placement(d) for d in devices[:n]], Placement(devices[n])
        else:  # one device: the pools share it (still separate threads when disaggregated)
            self.prefill_devices, self.decode_device = [Placement(devices[0])], Placement(devices[0])
        self.target = (tcfg, self.decode_device.params(tcfg, target[1]))
        # spoken requests: the source's adapter + the audio map on the split path; the answerer's own adapter on the
        # native path (an AudioServing without a map)
        if audio is not None and (audio.kvmap is None) == split:
            if split:
                raise ValueError("the answerer's own audio path (an AudioServing without a map) serves the native "
                                 "path only; the split path answers spoken requests through the audio map")
            audio = None  # the source's audio path needs the split path
        self.audio = audio
        self.audio_reason = ("" if self.audio is not None else audio_reason or (
            f"spoken requests need the split path (the source listens) or the answerer's own audio adapter, and "
            f"{reason}" if not split else "this server's config takes no audio (serve an audio config, e.g. python "
            "-m kvjax.serve --config=toy_audio)"))
        # each prefill device holds what its path runs: source + map, or (gate failed) the target
        self._builders, self._listeners = {}, {}
        for dev in self.prefill_devices:
            src = (source[0], dev.params(source[0], source[1])) if split else None
            tgt = self.target if dev == self.decode_device else (tcfg, dev.params(tcfg, target[1]))
            self._builders[dev] = programs.prefill_builder(src, tgt, dev.kvmap(kvmap) if split else None, split)
            if self.audio is not None:  # the adapter around this device's listening model (source, or the target)
                alm = self.audio.alm
                alm = alm.replace(encoder=dev.put(alm.encoder), projector=dev.put(alm.projector),
                                  lm=type(alm.lm)(*(src if split else tgt)))
                self._listeners[dev] = (src, tgt, dev.kvmap(self.audio.kvmap) if split else None, alm)
        self.prefix = (PrefixCache(config.prefix_block, int(config.prefix_cache_mb * 2**20), self.metrics)
                       if config.prefix_cache_mb else None)
        self._job: PrefillJob | None = None  # chunked prefill: the batch being read between decode steps
        self._job_reqs: list[Request] = []
        self._job_t0 = 0.0
        self.scheduler = Scheduler(config, lambda n: programs.bucket_for(n, self.buckets), self.metrics, self.path)
        self._lock = self.scheduler.lock  # the one lock of the engine's shared state
        self.slots = Slots(self.target, config, self.decode_device, self.scheduler, self.metrics, self.faults)
        self.pool = PrefillPool(self.prefill_devices, config, self.scheduler, self._prefill, self.slots.free,
                                lambda: self._running, self.metrics, self.faults)
        self._running = False
        self._decode_thread: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> "Engine":
        self._running = True
        if self.config.topology == "disaggregated":
            self.pool.start()
        self._decode_thread = threading.Thread(target=self._decode_main, name="kvjax-decode", daemon=True)
        self._decode_thread.start()
        self.metrics.healthy.set(1)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._running = False
            pending = self.scheduler.drain() + self.slots.held() + self.pool.held() + list(self._job_reqs)
            self._lock.notify_all()
        for r in pending:
            self.scheduler.fail(r, 503, "the server is shutting down")
        for t in [self._decode_thread] + self.pool.threads():
            if t is not None and t is not threading.current_thread():
                t.join(timeout)

    def warmup(self, max_prompt: int | None = None, min_prompt: int = 2) -> float:
        """Compile every prefill (bucket x batch size) for prompts of min_prompt..max_prompt tokens and the decode
        step, and run each attention window's branch of the programs that read a cache once (a piece after a cached
        prefix or between decode steps, the decode step), before serving: the first requests then see serving
        latency, not compile time or a branch's first run. Returns seconds."""
        t0 = time.perf_counter()
        limit = self.config.capacity if max_prompt is None else max_prompt
        low = programs.bucket_for(max(1, min(min_prompt, limit) - 1), self.buckets)
        sizes = sorted({programs.batch_size_for(n, self.config.max_prefill_batch)
                        for n in range(1, self.config.max_prefill_batch + 1)})
        for dev, builder in self._builders.items():
            top = programs.bucket_for(min(limit, self.config.capacity), self.buckets)
            for bucket in [b for b in self.buckets if low <= b <= top]:
                for bs in sizes:
                    if self._pieces:  # prefills read in pieces: the resumable programs
                        compile_pieces(builder, bs, bucket, pieces(bucket, bs, self.prefix is not None,
                                                                   self.config.max_step_tokens))
                    new = programs.prefill_batch(builder, [[0, 0]], bucket, bs)
                    self.slots.compile_insert(self.decode_device.cache(new))
        self.slots.warm()
        return time.perf_counter() - t0

    @property
    def _pieces(self) -> bool:
        """Text prefills are read through PrefillJob (a prefix cache, or chunked prefill)."""
        return self.prefix is not None or bool(self.config.max_step_tokens)

    @property
    def healthy(self) -> tuple[bool, str]:
        if self.pool.unhealthy:
            return False, self.pool.unhealthy
        if not self._running:
            return False, "engine stopped"
        if self._decode_thread is None or not self._decode_thread.is_alive():
            return False, "decode thread is not running"
        return True, ""

    def stats(self) -> dict:
        with self._lock:
            return {"topology": self.config.topology, "slots": self.config.slots,
                    "active_slots": self.slots.active(), "queue": len(self.scheduler.waiting),
                    "prefill_workers": self.pool.stats(), "worker_restarts": self.pool.restarts, "path": self.path,
                    "prefix_cache": self.prefix.stats() if self.prefix is not None else None,
                    "speculative": self.config.speculative}

    # ---- requests ----------------------------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        ok, why = self.healthy
        if not ok:
            raise Unhealthy(why)
        now = time.perf_counter()
        req.submitted = now
        req.deadline = now + (req.timeout or self.config.request_timeout)
        req.text = TextStream(self.tokenizer, req.stop)
        self.scheduler.submit(req)

    def cancel(self, req: Request) -> None:
        """The client went away: the request stops at the next step boundary and frees its slot."""
        req.cancelled = True
        with self._lock:
            self._lock.notify_all()

    # ---- prefill -----------------------------------------------------------------------------------------------

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
                self.scheduler.fail(reqs[0], 500, f"prefill failed: {type(e).__name__}: {e}")
                return []
        out = []
        for r in reqs:
            out += self._prefill([r], device)
        return out

    def _prefill_once(self, reqs: list[Request], device):
        for r in reqs:
            self.faults.check("prefill", r)
        t0 = time.perf_counter()
        if self._pieces and not reqs[0].audio:
            job = self._new_job(reqs, device, chunk=0)
            try:
                cache = job.finish()
            finally:
                job.close()
            computed = job.computed
        else:
            builder = self._audio_builder(reqs, device) if reqs[0].audio else self._builders[device]
            bucket = programs.bucket_for(max(len(r.prompt) - 1 for r in reqs), self.buckets)
            batch = programs.batch_size_for(len(reqs), self.config.max_prefill_batch)
            cache = programs.prefill_batch(builder, [r.prompt for r in reqs], bucket, batch)
            computed = sum(len(r.prompt) - 1 for r in reqs)
        return self._prefilled(cache, device, t0, computed)

    def _prefilled(self, cache, device, t0: float, computed: int):
        if device != self.decode_device:
            cache = self.decode_device.cache(cache)  # the mapped cache moves to the decode pool
        jax.block_until_ready(cache)
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        self.metrics.prefill_tokens.inc(computed)
        return cache

    def _new_job(self, reqs: list[Request], device, chunk: int) -> PrefillJob:
        """A text batch read in pieces: from each prompt's longest cached prefix, in chunks of `chunk` tokens per
        row (0: the rest at once)."""
        batch = programs.batch_size_for(len(reqs), self.config.max_prefill_batch)
        return PrefillJob(self._builders[device], [r.prompt for r in reqs], self.buckets, batch, self.prefix,
                          chunk_width(chunk, batch) if chunk else 0)

    def _audio_builder(self, reqs: list[Request], device):
        """The builder of a spoken batch (the scheduler never mixes spoken and text requests): the listening adapter
        (the source's, then the audio map; or, native path, the answerer's own) given this batch's clips, row by row
        (a new one per batch: prefill threads never share its clips)."""
        if device not in self._listeners:
            raise ValueError(f"a spoken request reached an engine that takes no audio: {self.audio_reason}")
        src, tgt, kvmap, alm = self._listeners[device]
        clips = [c for r in reqs for c in r.audio]
        if kvmap is None:
            return programs.own_audio_builder(alm, clips)
        return programs.audio_builder(src, tgt, kvmap, alm, clips)

    # ---- chunked prefill (batched topology) ---------------------------------------------------------------------

    def _chunked(self, reqs: list[Request]) -> bool:
        """Whether a text batch is read in chunks between decode steps: past the per-step token budget."""
        budget = self.config.max_step_tokens
        return bool(budget) and not reqs[0].audio and sum(len(r.prompt) - 1 for r in reqs) > budget

    def _start_job(self, reqs: list[Request]) -> None:
        try:
            for r in reqs:
                self.faults.check("prefill", r)
            self._job_t0 = time.perf_counter()
            self._job = self._new_job(reqs, self.prefill_devices[0], chunk=self.config.max_step_tokens)
        except Exception:  # noqa: BLE001 - each request alone, as _prefill does: a bad one fails by itself
            log.exception("chunked prefill could not start; prefilling its %d requests one by one", len(reqs))
            self._insert_each(reqs)
            return
        self._job_reqs = reqs
        self._chunk()

    def _insert_each(self, reqs: list[Request]) -> None:
        for r in reqs:
            for batch, cache in self._prefill([r], self.prefill_devices[0]):
                self.slots.insert(batch, cache)

    def _chunk(self) -> None:
        """One piece of the chunked batch (then the loop runs a decode step); at its end the batch joins the slots.
        A failure fails the batch's requests (each alone is retried by the unchunked path, as `_prefill` does)."""
        job, reqs = self._job, self._job_reqs
        try:
            self.metrics.prefill_pieces.inc()
            if not job.step():
                return
            cache = self._prefilled(job.finish(), self.prefill_devices[0], self._job_t0, job.computed)
        except Exception:  # noqa: BLE001 - answered below, request by request
            log.exception("chunked prefill failed; prefilling its %d requests one by one", len(reqs))
            job.close()
            self._job, self._job_reqs = None, []
            self._insert_each(reqs)
            return
        job.close()
        self._job, self._job_reqs = None, []
        self.slots.insert(reqs, cache)

    # ---- decode ------------------------------------------------------------------------------------------------

    def _decode_main(self) -> None:
        disaggregated = self.config.topology == "disaggregated"
        while self._running:
            try:
                self.slots.sweep()
                if disaggregated:
                    self.pool.supervise()
                    for reqs, cache in self.pool.take_ready():
                        self.pool.release(len(reqs))
                        self.slots.insert(reqs, cache)
                elif self._job is not None:
                    self._chunk()
                else:
                    free = self.slots.free()
                    with self._lock:
                        reqs = self.scheduler.take(free) if free else []
                    if reqs and self._chunked(reqs):
                        self._start_job(reqs)
                    elif reqs:
                        for batch, cache in self._prefill(reqs, self.prefill_devices[0]):
                            self.slots.insert(batch, cache)
                active = self.slots.active()
                self.metrics.active_slots.set(active)
                if active:
                    self.slots.step()
                    self.metrics.active_slots.set(self.slots.active())
                else:
                    with self._lock:
                        if not self.scheduler.waiting and not self.pool.ready and self._running and self._job is None:
                            self._lock.wait(0.05)
                        elif disaggregated and not self.pool.ready:
                            self._lock.wait(0.01)
            except Exception:  # noqa: BLE001 - the loop must survive anything; the failing requests were answered
                log.exception("decode loop error")
                time.sleep(0.01)

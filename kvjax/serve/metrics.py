"""The server's Prometheus metrics (GET /metrics), in a registry of their own (several servers per process in
tests). Tokens per second is the rate of kvjax_generated_tokens_total (PromQL rate()); the histograms are what a load
test reads: time to first token and the gap between tokens."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
TOKEN = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.queue_depth = Gauge("kvjax_queue_depth", "requests waiting for prefill", registry=r)
        self.active_slots = Gauge("kvjax_active_slots", "decode slots holding a request", registry=r)
        self.slots = Gauge("kvjax_slots", "decode slots in the batched target cache", registry=r)
        self.healthy = Gauge("kvjax_healthy", "1 while the engine takes work", registry=r)
        self.ttft = Histogram("kvjax_ttft_seconds", "submission to first token", buckets=LATENCY, registry=r)
        self.token_latency = Histogram("kvjax_token_latency_seconds", "time between a request's tokens",
                                       buckets=TOKEN, registry=r)
        self.step_seconds = Histogram("kvjax_decode_step_seconds", "one decode step over all slots", buckets=TOKEN,
                                      registry=r)
        self.prefill_seconds = Histogram("kvjax_prefill_seconds", "one prefill batch (source + map, or target)",
                                         buckets=LATENCY, registry=r)
        self.tokens = Counter("kvjax_generated_tokens", "tokens generated (rate(): tokens/s)", registry=r)
        self.prefill_tokens = Counter("kvjax_prefill_tokens", "prompt tokens prefilled", registry=r)
        self.requests = Counter("kvjax_requests", "finished requests by served path and outcome",
                                ["path", "outcome"], registry=r)
        self.rejected = Counter("kvjax_rejected", "requests refused with 429 (queue full)", registry=r)
        self.worker_restarts = Counter("kvjax_prefill_worker_restarts", "dead or hung prefill workers replaced",
                                       registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

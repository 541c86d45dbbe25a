"""The server's Prometheus metrics (GET /metrics), in a registry of their own (several servers per process in
tests). Tokens per second is the rate of kvjax_generated_tokens_total (PromQL rate()); the histograms are what a load
test reads: time to first token and the gap between tokens."""

from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
WINDOW = 10.0  # seconds of the tokens/s gauge
TOKEN = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
ROUND = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17)  # tokens a row emits in a verify round


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
        self.tokens_per_second = Gauge("kvjax_tokens_per_second", "tokens generated per second over the last "
                                       f"{WINDOW:.0f} s", registry=r)
        self._recent = collections.deque()  # (time, tokens) of recent decode steps
        self.prefill_tokens = Counter("kvjax_prefill_tokens", "prompt tokens prefilled", registry=r)
        self.requests = Counter("kvjax_requests", "finished requests by served path and outcome",
                                ["path", "outcome"], registry=r)
        self.rejected = Counter("kvjax_rejected", "requests refused with 429 (queue full)", registry=r)
        self.prefix_lookups = Counter("kvjax_prefix_lookups", "prompts looked up in the prefix cache", registry=r)
        self.prefix_hits = Counter("kvjax_prefix_hits", "prompts that reused at least one cached block", registry=r)
        self.prefix_lookup_tokens = Counter("kvjax_prefix_lookup_tokens", "prompt tokens looked up", registry=r)
        self.prefix_reused_tokens = Counter("kvjax_prefix_reused_tokens", "prompt tokens read from the prefix cache "
                                            "(no source prefill, no map)", registry=r)
        self.prefix_evictions = Counter("kvjax_prefix_evictions", "blocks evicted from the prefix cache", registry=r)
        self.prefix_bytes = Gauge("kvjax_prefix_bytes", "bytes held by the prefix cache", registry=r)
        self.prefix_blocks = Gauge("kvjax_prefix_blocks", "blocks held by the prefix cache", registry=r)
        self.prefill_pieces = Counter("kvjax_prefill_pieces", "prefill pieces run (chunked prefill: several per "
                                      "batch, decode steps between them)", registry=r)
        self.worker_restarts = Counter("kvjax_prefill_worker_restarts", "dead or hung prefill workers replaced",
                                       registry=r)
        # speculative decoding (kvjax.serve.drafting), per drafter: "lookup" (prompt lookup's copies), "block" (the
        # block drafter's drafts; the combined drafter counts each row-round under the part that drafted it), and
        # "none" (a row in a verify round with nothing drafted)
        self.decode_steps = Counter("kvjax_decode_steps", "decode steps by kind: draft (a verify round) or plain",
                                    ["kind"], registry=r)
        self.drafted_tokens = Counter("kvjax_drafted_tokens", "tokens drafted", ["drafter"], registry=r)
        self.accepted_tokens = Counter("kvjax_accepted_tokens", "drafted tokens the target accepted", ["drafter"],
                                       registry=r)
        self.acceptance_length = Histogram("kvjax_acceptance_length", "tokens a request emitted in one verify round "
                                           "(accepted drafts + the target's own token; sum / count: the mean "
                                           "acceptance length)", ["drafter"], buckets=ROUND, registry=r)
        self.draft_speedup = Gauge("kvjax_draft_predicted_speedup", "the best verify round's predicted tokens/s over "
                                   "a plain step's at the last step that could draft (drafting runs while it is > 1)",
                                   registry=r)
        self.step_cost = Gauge("kvjax_step_cost_seconds", "a decode step's time as the drafting policy prices it (the "
                               "median of the recent ones) by row count and verify width (0: a plain step)",
                               ["rows", "width"], registry=r)
        self.round_width = Histogram("kvjax_round_width", "verify rounds by width (each row's pending token and up to "
                                     "width - 1 drafts)", buckets=(1, 2, 3, 5, 9, 17, 33, 65), registry=r)

    def produced(self, n: int, now: float) -> None:
        """n tokens generated by the step that ended at `now` (perf_counter)."""
        self.tokens.inc(n)
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - WINDOW:
            self._recent.popleft()
        span = max(now - self._recent[0][0], 1.0)
        self.tokens_per_second.set(sum(k for _, k in self._recent) / span)

    def render(self) -> bytes:
        return generate_latest(self.registry)

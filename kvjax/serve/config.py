"""The serving engine's settings and the requests it serves. No JAX here: the command line (kvjax.serve.cli) checks
its flags against EngineConfig before JAX starts."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

from kvjax.serve.text import TextStream

TOPOLOGIES = ("serial", "batched", "disaggregated")
DRAFTERS = ("none", "lookup", "block", "combined")  # --speculative (kvjax.serve.drafting)
DRAFT_POLICIES = ("auto", "always")  # when a step drafts: where the measured costs say it pays, or every step
# tokens drafted per round when --draft-len is 0: prompt lookup's copies, the block drafter's trained block
DEFAULT_DRAFT_LEN = {"lookup": 16, "block": 16, "combined": 16}


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
    prefix_cache_mb: float = 0.0  # host memory for the prefix cache of transferred caches (0: no prefix cache)
    prefix_block: int = 32  # tokens per prefix-cache block
    max_step_tokens: int = 0  # batched: prefill tokens per decode step (chunked prefill; 0: a prompt is read whole)
    speculative: str = "none"  # drafter of speculative decoding: none, lookup, block, combined (DRAFTERS)
    draft_len: int = 0  # tokens drafted per round (0: DEFAULT_DRAFT_LEN; block / combined: a trained block size)
    drafter: str = ""  # block / combined: the block drafter's directory (kvjax.drafter.save_drafter)
    draft_refine: int = 2  # block / combined: the block drafter's refinement passes (kvjax.drafter.load_block_drafter)
    draft_context: int = 256  # block / combined: prompt tokens (its last) whose target features start its context
    lookup_ngram: tuple[int, int] = (1, 3)  # lookup / combined: the shortest and longest n-gram matched
    min_match: int = 2  # combined: the shortest recurring n-gram whose copy is taken over the block drafter's draft
    draft_policy: str = "auto"  # DRAFT_POLICIES: draft where the measured costs say it pays, or every step

    @property
    def drafting(self) -> bool:
        return self.speculative != "none"

    @property
    def rounds_draft(self) -> int:
        """Tokens drafted per round (draft_len, or the drafter's default)."""
        return self.draft_len or DEFAULT_DRAFT_LEN.get(self.speculative, 0)

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
        if self.prefix_cache_mb < 0:
            out.append(f"prefix_cache_mb must be >= 0 (0: no prefix cache), got {self.prefix_cache_mb}")
        if self.prefix_block < 1:
            out.append(f"prefix_block must be >= 1 token, got {self.prefix_block}")
        if self.max_step_tokens and self.max_step_tokens < 16:
            out.append(f"max_step_tokens must be 0 (off) or >= 16 (a prompt is read in pieces of multiples of 16 "
                       f"tokens, which bounds the compiled programs), got {self.max_step_tokens}")
        out += self.draft_problems()
        if self.max_step_tokens and self.topology != "batched":
            out.append(f"max_step_tokens (chunked prefill) interleaves prefill with decode on one device: use "
                       f"--topology=batched (the {self.topology} topology "
                       + ("decodes one request at a time, so nothing waits behind a prefill)" if self.topology ==
                          "serial" else "prefills on workers of their own, so decoding never waits for it)"))
        return out


    def draft_problems(self) -> list[str]:
        """The speculative-decoding settings (kvjax.serve.drafting), each a message that says what to pass."""
        if self.speculative not in DRAFTERS:
            return [f"speculative {self.speculative!r}: use one of {', '.join(DRAFTERS)}"]
        out = []
        if self.draft_policy not in DRAFT_POLICIES:
            out.append(f"draft_policy {self.draft_policy!r}: use one of {', '.join(DRAFT_POLICIES)}")
        block = self.speculative in ("block", "combined")
        if not self.drafting:
            if self.draft_len or self.drafter:
                out.append("draft_len and drafter set the drafter of speculative decoding, which is off: pass "
                           "--speculative=lookup|block|combined, or drop them")
            return out
        if self.draft_len < 0:
            out.append(f"draft_len must be >= 1 (0: the drafter's default), got {self.draft_len}")
        elif self.rounds_draft + 1 >= self.capacity:
            out.append(f"draft_len {self.rounds_draft} leaves no room in a slot of capacity {self.capacity}: a round "
                       "writes draft_len + 1 positions past a request's end")
        if block and not self.drafter:
            out.append(f"speculative={self.speculative} drafts with a block drafter: pass its directory with "
                       "--drafter DIR (one trained for the answering model: python -m launch.toy.drafter)")
        if not block and self.drafter:
            out.append(f"--drafter is the block drafter of --speculative=block|combined; "
                       f"speculative={self.speculative} reads no drafter: drop it")
        if self.draft_refine < 0 or self.draft_context < 1:
            out.append(f"draft_refine must be >= 0 and draft_context >= 1, got {self.draft_refine} and "
                       f"{self.draft_context}")
        lo, hi = self.lookup_ngram
        if not 1 <= lo <= hi:
            out.append(f"lookup n-grams {lo}:{hi}: need 1 <= MIN <= MAX")
        elif self.speculative == "combined" and not 1 <= self.min_match <= hi:
            out.append(f"min_match {self.min_match}: need 1 <= min_match <= the longest n-gram ({hi})")
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
    """One generation. `prompt`: token ids (>= 2). `sink(Event)` is called from engine threads. `audio`: a spoken
    request's clips (log-mel features float32 [M, frames] each, in the order of their placeholder runs in `prompt`;
    kvjax.serve.audio), answered through the audio map; empty: a text request."""

    prompt: list[int]
    max_tokens: int
    sink: Callable[[Event], None]
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    timeout: float | None = None
    audio: tuple = ()
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    submitted: float = 0.0
    deadline: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    generated: list = dataclasses.field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    text: TextStream | None = None

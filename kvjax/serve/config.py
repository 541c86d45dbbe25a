"""The serving engine's settings and the requests it serves. No JAX here: the command line (kvjax.serve.cli) checks
its flags against EngineConfig before JAX starts."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

from kvjax.serve.text import TextStream

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
    prefix_cache_mb: float = 0.0  # host memory for the prefix cache of transferred caches (0: no prefix cache)
    prefix_block: int = 32  # tokens per prefix-cache block
    max_step_tokens: int = 0  # batched: prefill tokens per decode step (chunked prefill; 0: a prompt is read whole)

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
        if self.max_step_tokens and self.topology != "batched":
            out.append(f"max_step_tokens (chunked prefill) interleaves prefill with decode on one device: use "
                       f"--topology=batched (the {self.topology} topology "
                       + ("decodes one request at a time, so nothing waits behind a prefill)" if self.topology ==
                          "serial" else "prefills on workers of their own, so decoding never waits for it)"))
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

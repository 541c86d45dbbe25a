"""Fault injection: the engine calls `faults.check(stage, obj)` at the points where a real failure can happen, so
tests and the load tool can make one happen there on purpose (or make that point slow: Delay) (and a server started with --enable-fault-injection
takes them over HTTP, localhost tooling only). Stages:

  prefill   per request, before its prefill batch runs       (obj: the Request)
  step      per request, after each decode step, on the host (obj: the Request)
  worker    per prefill batch in a disaggregated prefill worker (obj: the worker)

With no rule added, `check` costs one empty-list test.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable


class WorkerKilled(BaseException):
    """Ends a prefill worker thread as a crash would (a BaseException: no `except Exception` on the way stops it)."""


class InjectedFault(RuntimeError):
    """An ordinary exception raised on purpose in one request's prefill or step."""


@dataclasses.dataclass
class Rule:
    stage: str
    make: Callable[[], BaseException]
    when: Callable[[object], bool]
    times: int  # how many more times it fires (< 0: always)


class Delay(Exception):
    """Not raised: a rule whose `make` returns a Delay makes check() sleep that long instead (a slow device)."""

    def __init__(self, seconds: float):
        super().__init__(f"delay {seconds} s")
        self.seconds = seconds


class Faults:
    STAGES = ("prefill", "step", "worker")

    def __init__(self):
        self._rules: list[Rule] = []
        self._lock = threading.Lock()

    def add(self, stage: str, make: Callable[[], BaseException], when: Callable[[object], bool] = lambda _: True,
            times: int = 1) -> None:
        if stage not in self.STAGES:
            raise ValueError(f"fault stage {stage!r}: use one of {', '.join(self.STAGES)}")
        with self._lock:
            self._rules.append(Rule(stage, make, when, times))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def check(self, stage: str, obj) -> None:
        if not self._rules:
            return
        with self._lock:
            for rule in self._rules:
                if rule.stage == stage and rule.times != 0 and rule.when(obj):
                    rule.times -= 1
                    exc = rule.make()
                    break
            else:
                return
            self._rules = [r for r in self._rules if r.times != 0]
        if isinstance(exc, Delay):
            time.sleep(exc.seconds)
            return
        raise exc

"""The cache-builder interface: every way to give an answering model the cache of a prompt.

A builder takes right-padded prompt tokens int [B, T] and per-row lengths [B] and returns the answering model's
`KVCache` holding each row's tokens[:length] (lengths set, the rest of the buffer zero). Generation, every evaluation
arm and throughput timing consume builders, so a new way to build a cache (a map, a pipelined map, a partial
recomputation, ...) is one new builder and works everywhere at once.

Builders are plain Python objects around jitted pure functions: the object holds the models and settings (static
for tracing), the functions do the work. `Clock` lets a caller time a builder's phases without the builder knowing
about benchmarks.
"""

from __future__ import annotations

import abc
import time

import jax
import numpy as np

from kvjax.cache import KVCache

BUCKET = 64  # the token axis is rounded up to a multiple of this: a handful of compiles for many prompt lengths


def bucket(n: int, multiple: int = BUCKET) -> int:
    """n rounded up to a positive multiple of `multiple`."""
    return max(multiple, -(-n // multiple) * multiple)


class Clock:
    """Per-phase wall times of one build. `clock(name, value)` waits for `value` and books the time since the last
    mark under `name`; a disabled clock returns the value untouched (no synchronisation, the fastest path)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.phases: dict[str, float] = {}
        self._t = time.perf_counter()

    def __call__(self, name: str, value):
        if self.enabled:
            jax.block_until_ready(value)
            now = time.perf_counter()
            self.phases[name] = self.phases.get(name, 0.0) + now - self._t
            self._t = now
        return value


OFF = Clock(enabled=False)


def as_batch(tokens, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [B, T], lengths int32 [B]) on the host, checked: the one place builders validate prompts."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be an integer array [B, T] with T >= 1, got {tokens.dtype}{tokens.shape}")
    lengths = np.full((tokens.shape[0],), tokens.shape[1], np.int32) if lengths is None else np.asarray(lengths)
    if lengths.shape != (tokens.shape[0],) or lengths.min() < 0 or lengths.max() > tokens.shape[1]:
        raise ValueError(f"lengths must be [B] = [{tokens.shape[0]}] in 0..{tokens.shape[1]}, got {lengths}")
    return tokens.astype(np.int32), lengths.astype(np.int32)


class CacheBuilder(abc.ABC):
    """tokens int [B, T] (right-padded) + lengths [B] -> the answering model's KVCache of each row's tokens[:length].

    `name` labels the builder in logs and reports; `model` is the (config, params) pair that answers from the cache
    (decodes or scores). `capacity` (default: T rounded up to a multiple of BUCKET) is the cache's time axis; pass
    prompt + new tokens to decode from it."""

    name: str
    model: tuple

    @abc.abstractmethod
    def build(self, tokens: np.ndarray, lengths: np.ndarray, capacity: int, clock: Clock) -> KVCache:
        """The work, on checked host arrays (tokens [B, T], lengths [B]) and a capacity >= T."""

    def __call__(self, tokens, lengths=None, *, capacity: int | None = None, bucketed: bool = False,
                 clock: Clock = OFF) -> KVCache:
        """`bucketed`: zero-pad the token axis to a multiple of BUCKET first (rows keep their lengths), so that
        scoring many prompts of different lengths compiles a handful of programs."""
        tokens, lengths = as_batch(tokens, lengths)
        if bucketed and tokens.shape[1] != bucket(tokens.shape[1]):
            tokens = np.pad(tokens, ((0, 0), (0, bucket(tokens.shape[1]) - tokens.shape[1])))
        capacity = bucket(tokens.shape[1]) if capacity is None else int(capacity)
        if capacity < tokens.shape[1]:
            raise ValueError(f"capacity {capacity} is smaller than the {tokens.shape[1]} prompt tokens")
        return self.build(tokens, lengths, capacity, clock)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Resumable(abc.ABC):
    """A builder that can read a prompt in pieces: a server's prefix cache (a cached prefix, then the rest) and
    chunked prefill (a long prompt between decode steps) both read the prompt this way.

    A state is a tuple of KVCaches in the prefill layout, one per model that reads the prompt, the answering
    model's last (Mapped: source, target; NativePrefill: the model's own). Every cache of a state holds the same
    positions of each row, so a row's positions [a, b) can be cut out of every cache and later written back: what
    a prefix cache keeps of a block. `resume` reads right-padded tokens [B, T] (`lengths` real ones per row) after
    what the state holds; reading a prompt in pieces gives the cache `build` gives it whole, up to float rounding."""

    @abc.abstractmethod
    def start(self, batch: int, capacity: int) -> tuple[KVCache, ...]:
        """An empty state of `batch` rows and `capacity` positions."""

    @abc.abstractmethod
    def resume(self, state: tuple[KVCache, ...], tokens, lengths, fresh: bool = False) -> tuple[KVCache, ...]:
        """The state after reading tokens [B, T] (lengths [B]) after what it holds (its caches are donated).
        `fresh` promises every row of the state is empty (attention then reads the new tokens alone, as `build`)."""

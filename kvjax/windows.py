"""Token windows: every way kvjax cuts fixed-length windows out of a flat token array, in one place.

Three draws, each a pure function of its arguments so that a rerun, a resumed run and every process of a
multi-process run see the same windows:
  sample       n windows at sorted, uniformly drawn offsets of `seed` (calibration, lambda selection, held-out sets)
  step_batch   the batch of training step `step`: uniform offsets, with replacement, drawn from (seed, step), so a
               run that resumes at step i draws the batches it would have drawn (LM pretraining, residual training)
  consecutive  disjoint windows one after the other (held-out text read in order)
`sample_starts` and `step_starts` give the offsets alone, for callers that read only their own rows
(``kvjax.distributed.TokenWindows``).
"""

from __future__ import annotations

import numpy as np


def read(tokens: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """The windows int32 [len(starts), length] of `tokens` at `starts`."""
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def sample_starts(n_tokens: int, n: int, length: int, seed: int = 0) -> np.ndarray:
    """Sorted offsets of n windows of `length` drawn uniformly (with replacement) from `n_tokens` tokens."""
    if n_tokens < length:
        raise ValueError(f"need at least {length} tokens for one window, got {n_tokens}")
    return np.sort(np.random.default_rng(seed).integers(0, n_tokens - length + 1, n))


def sample(tokens: np.ndarray, n: int, length: int, seed: int = 0) -> np.ndarray:
    """n windows int32 [n, length] at `sample_starts` of a flat token array."""
    tokens = np.asarray(tokens)
    return read(tokens, sample_starts(len(tokens), n, length, seed), length)


def step_starts(n_tokens: int, step: int, batch_size: int, length: int, seed: int) -> np.ndarray:
    """Offsets of training step `step`'s batch of `batch_size` windows of `length` tokens (unsorted: row i of the
    batch is window i)."""
    # the highest offset drawn is n_tokens - length - 1 (one short of the last full window) and the rng is keyed by
    # [seed, step]: both as the toy pair and every residual checkpoint were trained, so resumed runs stay identical
    if n_tokens < length + 1:
        raise ValueError(f"token array of {n_tokens} tokens is shorter than one window of {length}")
    return np.random.default_rng([seed, step]).integers(0, n_tokens - length, batch_size)


def step_batch(tokens: np.ndarray, step: int, batch_size: int, length: int, seed: int) -> np.ndarray:
    """Training step `step`'s batch int32 [batch_size, length] (the windows at `step_starts`)."""
    return read(tokens, step_starts(len(tokens), step, batch_size, length, seed), length)


def consecutive(tokens: np.ndarray, length: int, n: int | None = None) -> np.ndarray:
    """Consecutive disjoint windows int32 [N, length] of a flat token array (at most n); the tail that does not fill
    a window is dropped."""
    count = len(tokens) // length if n is None else min(n, len(tokens) // length)
    if count == 0:
        raise ValueError(f"{len(tokens)} tokens do not make one window of {length}")
    return np.asarray(tokens[: count * length], np.int32).reshape(count, length)

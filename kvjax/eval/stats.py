"""Percentile bootstrap confidence intervals for per-item scores (accuracy, exact match, loss).

Deterministic: the resampled indices depend only on (seed, n, number of items). `paired_bootstrap_ci` resamples the
same items for both arms, so the interval of a difference reflects per-item agreement (much narrower than two
independent intervals when both arms get mostly the same items right).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

CHUNK = 1000  # resamples drawn at once: bounds memory at CHUNK x items indices


class CI(NamedTuple):
    mean: float  # the statistic on the original sample
    lo: float
    hi: float

    def __str__(self) -> str:
        return f"{self.mean:.4f} [{self.lo:.4f}, {self.hi:.4f}]"


def _resampled_means(values: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Means [n] of `values` [N] over n resamples with replacement."""
    rng = np.random.default_rng(seed)
    means = []
    for start in range(0, n, CHUNK):
        idx = rng.integers(0, len(values), (min(CHUNK, n - start), len(values)))
        means.append(values[idx].mean(axis=1))
    return np.concatenate(means)


def _as_vector(values, name: str) -> np.ndarray:
    values = np.asarray(values, np.float64)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty 1-D array, got shape {values.shape}")
    return values


def bootstrap_ci(values, n: int = 10_000, seed: int = 0, alpha: float = 0.05) -> CI:
    """Mean of `values` [N] with its (1 - alpha) percentile-bootstrap interval."""
    values = _as_vector(values, "values")
    lo, hi = np.quantile(_resampled_means(values, n, seed), [alpha / 2, 1 - alpha / 2])
    return CI(float(values.mean()), float(lo), float(hi))


def paired_bootstrap_ci(a, b, n: int = 10_000, seed: int = 0, alpha: float = 0.05) -> CI:
    """mean(a - b) for per-item scores a, b [N] of two arms on the same items, resampling items jointly."""
    a, b = _as_vector(a, "a"), _as_vector(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired scores need the same items: got {a.shape} and {b.shape}")
    return bootstrap_ci(a - b, n=n, seed=seed, alpha=alpha)


def ratio_ci(num, den, n: int = 10_000, seed: int = 0, alpha: float = 0.05) -> tuple[float | None, list | None]:
    """mean(num) / mean(den) of per-item values [N] of the same items, and its (1 - alpha) percentile-bootstrap
    interval resampling the items jointly (paired; the resampling recipe of paired_bootstrap_ci). (None, None) when
    mean(den) <= 0 (the ratio is undefined); the interval is None when more than alpha / 2 of the resamples have
    mean(den) <= 0 (the denominator is not distinguishable from zero, so the ratio is unbounded); otherwise the
    quantiles of the resamples whose denominator is positive."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if num.shape != den.shape or num.ndim != 1 or len(num) == 0:
        raise ValueError(f"paired values need the same non-empty 1-D shape: got {num.shape} and {den.shape}")
    if den.mean() <= 1e-12:
        return None, None
    value = float(num.mean() / den.mean())
    rng = np.random.default_rng(seed)
    nums, dens = [], []
    for start in range(0, n, CHUNK):
        idx = rng.integers(0, len(num), (min(CHUNK, n - start), len(num)))
        nums.append(num[idx].mean(axis=1))
        dens.append(den[idx].mean(axis=1))
    nums, dens = np.concatenate(nums), np.concatenate(dens)
    ok = dens > 1e-12
    if np.mean(~ok) > alpha / 2:
        return value, None
    lo, hi = np.quantile(nums[ok] / dens[ok], [alpha / 2, 1 - alpha / 2])
    return value, [float(lo), float(hi)]

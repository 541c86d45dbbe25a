"""Streaming sufficient statistics and the closed-form (reduced-rank) ridge solve.

Statistics are accumulated per chunk on device in float32 and summed on the host in float64, so memory does not
grow with the number of calibration tokens and the sums stay exact enough for millions of tokens. Everything
needed to choose lambda on held-out tokens (held-out MSE of any linear map) is computable from held-out statistics.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class Stats:
    """Sums over tokens for x [Fx] -> y [Fy]: n, sum x, sum y, sum x x^T, sum x y^T, sum y*y (per dim)."""

    n: float
    sx: np.ndarray
    sy: np.ndarray
    xx: np.ndarray
    xy: np.ndarray
    yy: np.ndarray

    @classmethod
    def zeros(cls, fx: int, fy: int) -> "Stats":
        z = lambda *s: np.zeros(s, np.float64)  # noqa: E731
        return cls(0.0, z(fx), z(fy), z(fx, fx), z(fx, fy), z(fy))

    def __iadd__(self, other: "Stats") -> "Stats":
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    @property
    def mean_x(self):
        return self.sx / self.n

    @property
    def mean_y(self):
        return self.sy / self.n

    def cov_xx(self):
        return self.xx / self.n - np.outer(self.mean_x, self.mean_x)

    def cov_xy(self):
        return self.xy / self.n - np.outer(self.mean_x, self.mean_y)

    def var_y(self) -> float:
        """Total variance of y (summed over dims)."""
        return float(np.sum(self.yy / self.n - self.mean_y ** 2))


def chunk_stats(x: jax.Array, y: jax.Array, mask: jax.Array):
    """Traceable float32 sums for one chunk: x [N, Fx], y [N, Fy], mask [N] (1 = a real token)."""
    m = mask.astype(jnp.float32)[:, None]
    xm = x * m
    return (m.sum(), xm.sum(0), (y * m).sum(0), xm.T @ x, xm.T @ y, (y * y * m).sum(0))


def to_stats(sums) -> Stats:
    return Stats(*(np.asarray(jax.device_get(s), np.float64) for s in sums))


@dataclasses.dataclass(frozen=True)
class RidgeFit:
    """y ~ (x - mu) @ w_in @ w_out + bias, with rank(w_in @ w_out) <= rank."""

    mu: np.ndarray  # [Fx]
    w_in: np.ndarray  # [Fx, r]
    w_out: np.ndarray  # [r, Fy]
    bias: np.ndarray  # [Fy]
    lam: float  # the lambda used (relative to the mean eigenvalue of cov(x))

    @property
    def weight(self) -> np.ndarray:
        return self.w_in @ self.w_out


def solve(stats: Stats, lam: float, rank: int | None = None) -> RidgeFit:
    """Centred ridge regression: W = (Cxx + lam * tr(Cxx)/Fx * I)^-1 Cxy via Cholesky, truncated to `rank` along the
    principal directions of the fitted values (reduced-rank ridge)."""
    cxx, cxy = stats.cov_xx(), stats.cov_xy()
    fx, fy = cxy.shape
    reg = lam * max(np.trace(cxx) / fx, 1e-12)
    chol = np.linalg.cholesky(cxx + reg * np.eye(fx))
    w = np.linalg.solve(chol.T, np.linalg.solve(chol, cxy))  # [Fx, Fy]
    r = fy if rank is None else int(min(rank, fy))
    fitted_cov = w.T @ cxx @ w  # covariance of the fitted values, [Fy, Fy]
    evals, evecs = np.linalg.eigh((fitted_cov + fitted_cov.T) / 2)
    basis = evecs[:, np.argsort(evals)[::-1][:r]]  # [Fy, r]
    return RidgeFit(mu=stats.mean_x, w_in=w @ basis, w_out=basis.T, bias=stats.mean_y, lam=float(lam))


def mse(fit: RidgeFit, stats: Stats) -> float:
    """Mean over tokens of ||y - f(x)||^2 for the tokens summarised by `stats` (e.g. held-out)."""
    w = fit.weight
    b = fit.bias - fit.mu @ w  # f(x) = x @ w + b
    total = (stats.yy.sum() - 2 * np.sum(w * stats.xy) - 2 * b @ stats.sy + np.sum(w * (stats.xx @ w))
             + 2 * b @ (w.T @ stats.sx) + stats.n * b @ b)
    return float(total / stats.n)


def r2(fit: RidgeFit, stats: Stats) -> float:
    return 1.0 - mse(fit, stats) / stats.var_y()


def select(train: Stats, heldout: Stats, lams=(1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0),
           rank: int | None = None) -> tuple[RidgeFit, dict[float, float]]:
    """Fit on `train` for every lambda, keep the one with the lowest held-out MSE. Returns (fit, {lam: mse})."""
    scores, best = {}, None
    for lam in lams:
        fit = solve(train, lam, rank)
        scores[lam] = mse(fit, heldout)
        if best is None or scores[lam] < scores[best.lam]:
            best = fit
    return best, scores

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
    """Token count, means and *centred* scatter sums for x [Fx] -> y [Fy]. Chunks are centred on their own means
    (no cancellation in float32) and merged exactly in float64 (Chan et al.'s pairwise update)."""

    n: float
    mx: np.ndarray  # [Fx] mean of x
    my: np.ndarray  # [Fy]
    cxx: np.ndarray  # [Fx, Fx] sum (x - mx)(x - mx)^T
    cxy: np.ndarray  # [Fx, Fy] sum (x - mx)(y - my)^T
    cyy: np.ndarray  # [Fy] sum (y - my)^2

    @classmethod
    def zeros(cls, fx: int, fy: int) -> "Stats":
        z = lambda *s: np.zeros(s, np.float64)  # noqa: E731
        return cls(0.0, z(fx), z(fy), z(fx, fx), z(fx, fy), z(fy))

    def __iadd__(self, other: "Stats") -> "Stats":
        n = self.n + other.n
        if other.n == 0:
            return self
        dx, dy = other.mx - self.mx, other.my - self.my
        w = self.n * other.n / n
        self.cxx = self.cxx + other.cxx + w * np.outer(dx, dx)
        self.cxy = self.cxy + other.cxy + w * np.outer(dx, dy)
        self.cyy = self.cyy + other.cyy + w * dy * dy
        self.mx = self.mx + dx * other.n / n
        self.my = self.my + dy * other.n / n
        self.n = n
        return self

    def cov_xx(self):
        return self.cxx / self.n

    def cov_xy(self):
        return self.cxy / self.n

    def var_y(self) -> float:
        """Total variance of y (summed over dims)."""
        return float(self.cyy.sum() / self.n)


def chunk_stats(x: jax.Array, y: jax.Array, mask: jax.Array):
    """Traceable float32 statistics of one chunk: x [N, Fx], y [N, Fy], mask [N] (1 = a real token)."""
    m = mask.astype(jnp.float32)[:, None]
    n = m.sum()
    safe = jnp.maximum(n, 1.0)
    mx, my = (x * m).sum(0) / safe, (y * m).sum(0) / safe
    xc, yc = (x - mx) * m, (y - my) * m
    return n, mx, my, xc.T @ xc, xc.T @ yc, (yc * yc).sum(0)


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
    return RidgeFit(mu=stats.mx, w_in=w @ basis, w_out=basis.T, bias=stats.my, lam=float(lam))


def mse(fit: RidgeFit, stats: Stats) -> float:
    """Mean over tokens of ||y - f(x)||^2 for the tokens summarised by `stats` (e.g. held-out)."""
    w = fit.weight
    offset = stats.my - (stats.mx - fit.mu) @ w - fit.bias  # error of the mean prediction
    spread = stats.cyy.sum() - 2 * np.sum(w * stats.cxy) + np.sum(w * (stats.cxx @ w))
    return float(offset @ offset + spread / stats.n)


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

"""Streaming sufficient statistics and the closed-form (reduced-rank) ridge solve.

Statistics are accumulated per chunk on device in float32 and summed on the host in float64, so memory does not
grow with the number of calibration tokens and the sums stay exact enough for millions of tokens. Everything
needed to choose lambda on held-out tokens (held-out MSE of any linear map) is computable from held-out statistics.

Held-out statistics are taken of the residual r = y - x @ ref around a reference map fitted on the training
statistics (`reference`), not of y. The MSE of a map W is a quadratic form in the sums. Of y it is
sum y^2 - 2 W.sum x y + W' (sum x x') W, terms of order var(y) per token that cancel to the MSE, so the float32
rounding of the sums reaches the MSE multiplied by var(y) / MSE, in amounts that depend on the summation order:
on the mapper test's data (var(y) / MSE = 6e3) 0.02% on one machine and 0.27% on another, and 310% at
1.5e7. Of r, with D = W - ref, the terms are sum r^2, D.sum x r and D' (sum x x') D, each bounded by the MSEs of
ref and W (Cauchy-Schwarz), so the relative error is 2^-24 times a factor of order MSE(ref) / MSE(W), plus
2^-24 |y| / |y - f(x)| from forming r per token, whatever var(y) / MSE: 1e-6 and 3e-5 on those two data sets
(tests/test_mapper.py bounds it for any summation order). Training statistics use ref = 0: the solve does not
cancel that way.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

# Statistics go into a cancelling quadratic form and a solve: no reduced-precision passes (bf16 on TPU, TF32 on GPU).
_dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)
LAMBDAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)  # relative to the mean eigenvalue of cov(x)


@dataclasses.dataclass
class Stats:
    """Token count, means and *centred* scatter sums for x [Fx] -> y [Fy], the y sums taken of the residual
    r = y - x @ ref. Chunks are centred on their own means (no cancellation in float32) and merged exactly in float64
    (Chan et al.'s pairwise update)."""

    n: float
    mx: np.ndarray  # [Fx] mean of x
    my: np.ndarray  # [Fy] mean of y
    cxx: np.ndarray  # [Fx, Fx] sum (x - mx)(x - mx)^T
    cxr: np.ndarray  # [Fx, Fy] sum (x - mx)(r - mr)^T
    crr: np.ndarray  # [Fy] sum (r - mr)^2
    ref: np.ndarray  # [Fx, Fy] the reference map (float32 values, as the device used them); zero: r = y

    @classmethod
    def zeros(cls, fx: int, fy: int, ref: np.ndarray | None = None) -> "Stats":
        z = lambda *s: np.zeros(s, np.float64)  # noqa: E731
        return cls(0.0, z(fx), z(fy), z(fx, fx), z(fx, fy), z(fy), z(fx, fy) if ref is None else _as_ref(ref))

    def __iadd__(self, other: "Stats") -> "Stats":
        if not np.array_equal(self.ref, other.ref):
            raise ValueError("statistics around different reference maps do not add: collect every chunk with the "
                             "same ref (collect_stats(..., refs=...))")
        n = self.n + other.n
        if other.n == 0:
            return self
        dx, dy = other.mx - self.mx, other.my - self.my
        dr = dy - dx @ self.ref  # the means of r differ by this
        w = self.n * other.n / n
        self.cxx = self.cxx + other.cxx + w * np.outer(dx, dx)
        self.cxr = self.cxr + other.cxr + w * np.outer(dx, dr)
        self.crr = self.crr + other.crr + w * dr * dr
        self.mx = self.mx + dx * other.n / n
        self.my = self.my + dy * other.n / n
        self.n = n
        return self

    @property
    def cxy(self) -> np.ndarray:
        """[Fx, Fy] sum (x - mx)(y - my)^T (y = r + x @ ref)."""
        return self.cxr + self.cxx @ self.ref

    @property
    def cyy(self) -> np.ndarray:
        """[Fy] sum (y - my)^2: the residual's and the reference prediction's parts (no cancellation: their cross
        term is small when ref fits)."""
        return self.crr + 2 * np.sum(self.ref * self.cxr, 0) + np.sum(self.ref * (self.cxx @ self.ref), 0)

    def restrict(self, features: np.ndarray) -> "Stats":
        """The statistics of x's `features` (indices into Fx) alone: centred sums restrict exactly to their sub-blocks.
        Training statistics only (ref = 0): around a reference map the residual itself reads every feature."""
        if np.any(self.ref):
            raise ValueError("only statistics of y itself (ref = 0) restrict to a subset of x's features")
        f = np.asarray(features)
        return Stats(self.n, self.mx[f], self.my.copy(), self.cxx[np.ix_(f, f)], self.cxr[f], self.crr.copy(),
                     self.ref[f])

    def cov_xx(self):
        return self.cxx / self.n

    def cov_xy(self):
        return self.cxy / self.n

    def var_y(self) -> float:
        """Total variance of y (summed over dims)."""
        return float(self.cyy.sum() / self.n)


def _as_ref(ref) -> np.ndarray:
    """A reference map as the device applies it: float32 values, held in float64."""
    return np.asarray(np.asarray(ref, np.float32), np.float64)


def tree_sum(a: jax.Array) -> jax.Array:
    """Sum over axis 0 as an explicit pairwise tree. Its float32 error is at most ceil(log2 N) * 2^-24 * sum |a|
    whatever the backend (a plain reduce may accumulate sequentially: N * 2^-24, 4096 tokens -> 2.4e-4). Used for the
    means (an error there moves the offset of every prediction) and for sum r^2 (the bulk of a held-out MSE)."""
    n = a.shape[0]
    size = 1 << max(n - 1, 0).bit_length()
    a = jnp.pad(a, [(0, size - n)] + [(0, 0)] * (a.ndim - 1))
    while a.shape[0] > 1:
        a = a[: a.shape[0] // 2] + a[a.shape[0] // 2 :]
    return a[0]


def chunk_stats(x: jax.Array, y: jax.Array, mask: jax.Array, ref: jax.Array | None = None,
                weights: jax.Array | None = None):
    """Traceable float32 statistics of one chunk: x [N, Fx], y [N, Fy], mask [N] (1 = a real token); with `ref`
    [Fx, Fy] the y sums are of the residual y - x @ ref (see Stats).

    `weights` [N] (>= 0) weights each token's contribution: n is then the sum of the weights, the means are weighted
    means and every scatter sum is sum w (.)(.)' (an integer weight counts a token that many times; a zero weight
    drops it), so the ridge solved from them minimises the weighted squared error. The centred rows are scaled by
    sqrt(w): with every weight 1 the sums are today's bit for bit (sqrt(1) = 1 exactly)."""
    m = mask.astype(jnp.float32)[:, None]
    if weights is not None:
        m = m * weights.astype(jnp.float32)[:, None]
    n = m.sum()  # unweighted: an exact integer below 2^24 tokens
    safe = jnp.maximum(n, 1.0) if weights is None else jnp.where(n > 0, n, 1.0)
    mx, my = tree_sum(x * m) / safe, tree_sum(y * m) / safe
    root = m if weights is None else jnp.sqrt(m)  # a 0/1 mask is its own square root
    xc, rc = (x - mx) * root, (y - my) * root
    if ref is not None:
        rc = rc - _dot(xc, ref.astype(jnp.float32))  # centred y minus centred prediction: the centred residual
    return n, mx, my, _dot(xc.T, xc), _dot(xc.T, rc), tree_sum(rc * rc)


def to_stats(sums, ref=None) -> Stats:
    """Host float64 Stats of chunk_stats' output (`ref`: the one chunk_stats was given, or None)."""
    n, mx, my, cxx, cxr, crr = (np.asarray(jax.device_get(s), np.float64) for s in sums)
    return Stats(float(n), mx, my, cxx, cxr, crr,
                 np.zeros((len(mx), len(my)), np.float64) if ref is None else _as_ref(jax.device_get(ref)))


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
    d = w - stats.ref  # y - x w = r - x d: small terms when the stats are of a residual around a nearby map
    spread = stats.crr.sum() - 2 * np.sum(d * stats.cxr) + np.sum(d * (stats.cxx @ d))
    return float(offset @ offset + spread / stats.n)


def r2(fit: RidgeFit, stats: Stats) -> float:
    return 1.0 - mse(fit, stats) / stats.var_y()


def reference(train: Stats, lams=LAMBDAS) -> np.ndarray:
    """float32 [Fx, Fy]: the map to take held-out statistics around (Stats.ref), the ridge fit of `train` at the
    smallest lambda of the grid. With many more calibration tokens than features (every run here: the toy pair fits
    128 features on 65k tokens) that fit is, or is next to, the held-out optimum, so the fits that compete for the
    lowest MSE are the ones nearest to it and get the most accurate MSEs. A fit far from it has a large MSE itself
    (Cauchy-Schwarz, see the module docstring), so its relative error stays small too. (The middle of the grid was
    measured worse: on the toy pair the lambda=1e-6 fit differs from it by large weights in directions of tiny
    variance, whose float32 error in sum x x' gave its MSE a 1.6e-5 relative error; 3e-8 around the smallest.)"""
    return solve(train, min(lams)).weight.astype(np.float32)


def select(train: Stats, heldout: Stats, lams=LAMBDAS, rank: int | None = None) -> tuple[RidgeFit, dict[float, float]]:
    """Fit on `train` for every lambda, keep the one with the lowest held-out MSE. Returns (fit, {lam: mse})."""
    scores, best = {}, None
    for lam in lams:
        fit = solve(train, lam, rank)
        scores[lam] = mse(fit, heldout)
        if best is None or scores[lam] < scores[best.lam]:
            best = fit
    return best, scores

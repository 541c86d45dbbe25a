"""Reduced-rank ridge maps at several ranks from one collection of calibration statistics.

The ridge statistics (kvjax.mapper.ridge.Stats) do not depend on the rank: the rank only truncates the solve
(kvjax.mapper.ridge.solve). So a sweep over ranks collects them once, as fit_map does (training statistics on the
calibration windows, held-out statistics around the smallest-lambda reference on the lambda-selection windows),
solves once per (target layer, kind, lambda) at full rank and truncates that solve to each rank (the basis is ordered
by decreasing variance of the fitted values: solve(stats, lam, k) keeps its first k directions), lambda chosen per
(rank, layer, kind) on the held-out statistics as fit_map's select chooses it. At full rank (None) the fit is
fit_map's with rank=None on the same windows and pairing: the run's unreduced ridge map.

The maps carry no residual (a zero rank-1 network, as the direct-injection and per-head maps): the sweep is of the
closed-form part alone. Used by the registry evaluation kvjax.eval.suite.rank_sweep.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.fitting.calibrate import batches_of, collect_stats
from kvjax.mapper.kvmap import KVMap, LinearMap, spec_for
from kvjax.mapper.pairing import Pairing
from kvjax.mapper.ridge import LAMBDAS, RidgeFit, Stats, mse, reference, solve
from kvjax.models.family import DecoderConfig
from kvjax.models.model import Model

RIDGE_PARTS = ("mu", "w_in", "w_out", "bias")  # the parameters of a map without residual, as the method stores them


@dataclasses.dataclass
class SweepStats:
    """Per target layer (key, value) statistics: training (calibration windows) and held-out (lambda-selection
    windows, of the residual around each training fit's reference map)."""

    pairing: Pairing
    train: list[tuple[Stats, Stats]]
    heldout: list[tuple[Stats, Stats]]

    @property
    def max_rank(self) -> int:
        """The largest rank any layer's map can have: min(Fx, Fy) over target layers and kinds."""
        return int(min(min(len(st.mx), len(st.my)) for pair in self.train for st in pair))


@dataclasses.dataclass(frozen=True)
class RankFit:
    """The map at one rank, with what the statistics say of it (normalised MSE = MSE / total variance of y =
    1 - R^2, per target layer [key, value])."""

    rank: int | None  # as asked (None: full rank, no truncation)
    effective_rank: int  # the rank the solve kept: min(rank, Fy), at most max_rank directions of nonzero variance
    kvmap: KVMap
    lambdas: list[list[float]]
    train_nmse: list[list[float]]
    heldout_nmse: list[list[float]]


def collect(source: Model, target: Model, pairing: Pairing, calib: np.ndarray, select_windows: np.ndarray,
            batch_size: int = 8, lams=LAMBDAS) -> SweepStats:
    """The statistics fit_map collects for `pairing` (one device): calibration windows int [N, T], lambda-selection
    windows [M, T]."""
    train_k, train_v = collect_stats(source, target, pairing, batches_of(calib, batch_size), "rank sweep calib",
                                     total=-(-len(calib) // batch_size))
    refs = [(reference(k, lams), reference(v, lams)) for k, v in zip(train_k, train_v)]
    held_k, held_v = collect_stats(source, target, pairing, batches_of(select_windows, batch_size),
                                   "rank sweep held-out", refs=refs)
    return SweepStats(tuple(tuple(p) for p in pairing), list(zip(train_k, train_v)), list(zip(held_k, held_v)))


def rank_grid(ranks, max_rank: int) -> list[int | None]:
    """The ranks to fit: each clipped to `max_rank`, None (full rank) kept, duplicates (after clipping, a rank equal
    to max_rank counting as full) dropped, in increasing order with full rank last."""
    if any(r is not None and r < 1 for r in ranks):
        raise ValueError(f"ranks must be >= 1 or None (full rank), got {tuple(ranks)}")
    clipped = {min(int(r), max_rank) for r in ranks if r is not None}
    full = None in ranks or max_rank in clipped
    return sorted(r for r in clipped if r < max_rank) + ([None] if full else [])


def map_from_fits(fits: list[tuple[RidgeFit, RidgeFit]], stats: SweepStats, scfg: DecoderConfig, tcfg: DecoderConfig,
                  rank: int | None) -> KVMap:
    """A KVMap of per-layer (key, value) ridge fits, no residual (zero rank-1 network); the residual input scale as
    fit_map sets it."""
    layers = {"key": [], "value": []}
    for (fk, fv), (tk, tv) in zip(fits, stats.train):
        for kind, fit, tr in (("key", fk, tk), ("value", fv, tv)):
            scale = float(np.sqrt(max(np.trace(tr.cov_xx()) / len(tr.mx), 1e-12)))
            f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
            fx, fy = fit.w_in.shape[0], fit.w_out.shape[1]
            layers[kind].append(LinearMap(mu=f32(fit.mu), scale=f32(scale), w_in=f32(fit.w_in), w_out=f32(fit.w_out),
                                          bias=f32(fit.bias), down=jnp.zeros((fx, 1), jnp.float32),
                                          res_bias=jnp.zeros((1,), jnp.float32), up=jnp.zeros((1, fy), jnp.float32)))
    return KVMap(keys=tuple(layers["key"]), values=tuple(layers["value"]),
                 spec=spec_for(scfg, tcfg, stats.pairing, rank, 1))


def truncated(fit: RidgeFit, rank: int | None) -> RidgeFit:
    """solve(stats, lam, rank) from the full-rank solve(stats, lam): its basis is ordered by decreasing variance of
    the fitted values, so rank k keeps its first k directions (the same columns, so the same numbers)."""
    if rank is None:
        return fit
    r = min(int(rank), fit.w_out.shape[0])
    return dataclasses.replace(fit, w_in=fit.w_in[:, :r], w_out=fit.w_out[:r])


def fit_ranks(stats: SweepStats, scfg: DecoderConfig, tcfg: DecoderConfig, ranks, lams=LAMBDAS) -> list[RankFit]:
    """The reduced-rank ridge map at each of `ranks` (None: full), lambda chosen per rank, layer and kind on the
    held-out statistics as kvjax.mapper.ridge.select chooses it (with one lambda in `lams`: that lambda). One solve
    per (layer, kind, lambda) serves every rank (truncated)."""
    full = [tuple([solve(tr, lam) for lam in lams] for tr in pair) for pair in stats.train]
    out = []
    for rank in ranks:
        fits, lambdas, train_nmse, held_nmse = [], [], [], []
        for by_lam, train, held in zip(full, stats.train, stats.heldout):
            pair = []
            for candidates, ho in zip(by_lam, held):
                best, best_mse = None, None
                for fit in (truncated(f, rank) for f in candidates):  # select's rule: the first lowest held-out MSE
                    score = mse(fit, ho)
                    if best is None or score < best_mse:
                        best, best_mse = fit, score
                pair.append(best)
            fits.append(tuple(pair))
            lambdas.append([f.lam for f in pair])
            train_nmse.append([mse(f, st) / st.var_y() for f, st in zip(pair, train)])
            held_nmse.append([mse(f, st) / st.var_y() for f, st in zip(pair, held)])
        effective = max(f.w_in.shape[1] for pair in fits for f in pair)
        out.append(RankFit(rank, effective, map_from_fits(fits, stats, scfg, tcfg, rank), lambdas, train_nmse,
                           held_nmse))
    return out


def fit_rank(stats: SweepStats, scfg: DecoderConfig, tcfg: DecoderConfig, rank: int | None, lams=LAMBDAS) -> RankFit:
    return fit_ranks(stats, scfg, tcfg, [rank], lams)[0]


def ridge_params(kvmap: KVMap) -> int:
    """Parameters of the map's ridge part as the method stores them (mu, w_in, w_out, bias per target layer and
    kind; float32, 4 bytes each): what kvjax.job.reporting counts for a ridge map's size_bytes."""
    return int(sum(getattr(m, p).size for m in (*kvmap.keys, *kvmap.values) for p in RIDGE_PARTS))


def padded(kvmap: KVMap, width: int) -> KVMap:
    """The same map with w_in / w_out zero-padded to `width` columns / rows (and spec.rank None): equal outputs (the
    extra terms are exact zeros), and maps of every rank share one shape, so an evaluation compiles once for all."""
    def pad(m: LinearMap) -> LinearMap:
        r = m.w_in.shape[1]
        if r > width:
            raise ValueError(f"rank {r} is wider than the padding width {width}")
        return m.replace(w_in=jnp.pad(m.w_in, ((0, 0), (0, width - r))),
                         w_out=jnp.pad(m.w_out, ((0, width - r), (0, 0))))
    return kvmap.replace(keys=tuple(map(pad, kvmap.keys)), values=tuple(map(pad, kvmap.values)),
                         spec=dataclasses.replace(kvmap.spec, rank=None))


def dense_weight(m: LinearMap) -> np.ndarray:
    """[Fx, Fy] the map's effective ridge weight w_in @ w_out (float64), e.g. to compare maps whose reduced-rank
    bases differ in sign."""
    return np.asarray(jax.device_get(m.w_in), np.float64) @ np.asarray(jax.device_get(m.w_out), np.float64)


__all__ = ["SweepStats", "RankFit", "collect", "rank_grid", "truncated", "fit_rank", "fit_ranks", "map_from_fits",
           "ridge_params", "padded", "dense_weight"]

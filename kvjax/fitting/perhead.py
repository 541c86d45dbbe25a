"""The per-head ridge peer (Heo et al., NVIDIA 2026): each target KV head regressed, in closed form, on the
concatenated heads of its own top-k source layers, keys with RoPE stripped, one fixed lambda, no residual.

It differs from kvjax's ridge (kvjax.fitting.fit) in three ways, each a choice the comparison is about: the source
layers are chosen per target head (kvjax pairs per target layer), lambda is fixed instead of chosen on held-out
tokens, and nothing is trained on top. One calibration pass collects statistics of every source layer against every
target layer (x = all source layers' features concatenated); each (target layer, key/value, head) then ranks the
source layers by the R^2 of a single-layer fit on those statistics, keeps the top k and solves on their
concatenation. The result is an ordinary KVMap (so every builder, evaluation and the map kernel apply it): a target
layer's input is the union of the layers its heads chose (padded with unchosen layers to the widest union: the map
kernels take the same number of source layers per target layer), and each head's weights are zero on the layers it
did not choose; its residual is a zero rank-1 network, as the direct-injection map's. `size_bytes` in the report is the
per-head weights and biases as the peer stores them (float32), not that dense embedding.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from kvjax.fitting.calibrate import batches_of, collect_stats
from kvjax.mapper.kvmap import KVMap, LinearMap, spec_for
from kvjax.mapper.ridge import Stats, r2, solve
from kvjax.models.model import Model

DEFAULT_LAMBDA = 1e-3  # relative to the mean eigenvalue of cov(x), as kvjax.mapper.ridge.LAMBDAS


def sub_stats(st: Stats, ix: np.ndarray, iy: np.ndarray) -> Stats:
    """The statistics of x[ix] -> y[iy] (training statistics: no reference map)."""
    if np.any(st.ref):
        raise ValueError("sub_stats takes training statistics (ref = 0)")
    return Stats(st.n, st.mx[ix], st.my[iy], st.cxx[np.ix_(ix, ix)], st.cxr[np.ix_(ix, iy)], st.crr[iy],
                 np.zeros((len(ix), len(iy))))


def _head_fits(st: Stats, n_src: int, f_src: int, hd: int, k: int, lam: float):
    """Per target head: (chosen source layers, weights [k*f_src, hd], the R^2 of each single source layer)."""
    heads = st.my.shape[0] // hd
    out = []
    for h in range(heads):
        iy = np.arange(h * hd, (h + 1) * hd)
        scores = [r2(solve(sub_stats(st, np.arange(s * f_src, (s + 1) * f_src), iy), lam),
                     sub_stats(st, np.arange(s * f_src, (s + 1) * f_src), iy)) for s in range(n_src)]
        layers = tuple(sorted(int(s) for s in np.argsort(-np.asarray(scores), kind="stable")[:k]))
        ix = np.concatenate([np.arange(s * f_src, (s + 1) * f_src) for s in layers])
        fit = solve(sub_stats(st, ix, iy), lam)
        out.append((layers, fit.weight, scores))
    return out


def fit_perhead(source: Model, target: Model, calib: np.ndarray, *, k: int = 3, lam: float = DEFAULT_LAMBDA,
                batch_size: int = 8) -> tuple[KVMap, dict]:
    """Fit the per-head ridge peer on calibration windows int [N, T]. Returns (map, report: per target layer and
    kind the source layers of each head and their R^2, size_bytes, fit_seconds, calib_tokens)."""
    (scfg, _), (tcfg, _) = source, target
    if not 1 <= k <= scfg.num_layers:
        raise ValueError(f"k must be in 1..{scfg.num_layers} (source layers), got {k}")
    t0 = time.perf_counter()
    every = tuple(range(scfg.num_layers))
    k_stats, v_stats = collect_stats(source, target, (every,) * tcfg.num_layers, batches_of(calib, batch_size),
                                     "per-head calibrate", total=-(-len(calib) // batch_size))
    f_src, hd = scfg.num_kv_heads * scfg.head_dim, tcfg.head_dim
    fits = [(_head_fits(ks, scfg.num_layers, f_src, hd, k, lam), _head_fits(vs, scfg.num_layers, f_src, hd, k, lam))
            for ks, vs in zip(k_stats, v_stats)]
    unions = [sorted({s for kind in (kf, vf) for layers, _, _ in kind for s in layers}) for kf, vf in fits]
    width = max(len(u) for u in unions)
    pairing, keys, values, layers_report = [], [], [], []
    size = 0
    for t, (kf, vf) in enumerate(fits):
        # every target layer reads the same number of source layers (the map kernels take a rectangular pairing):
        # a layer whose heads chose fewer is padded with unchosen layers, whose weight rows stay zero
        union = tuple(sorted(unions[t] + [s for s in range(scfg.num_layers) if s not in unions[t]][: width
                                                                                                  - len(unions[t])]))
        pairing.append(union)
        row = {}
        for kind, heads, st, out in (("key", kf, k_stats[t], keys), ("value", vf, v_stats[t], values)):
            ix = np.concatenate([np.arange(s * f_src, (s + 1) * f_src) for s in union])
            w = np.zeros((len(ix), len(heads) * hd))
            for h, (layers, wh, _) in enumerate(heads):
                rows = np.concatenate([union.index(s) * f_src + np.arange(f_src) for s in layers])
                w[rows, h * hd : (h + 1) * hd] = wh
                size += 4 * (wh.size + hd)
            f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
            fy = w.shape[1]
            out.append(LinearMap(mu=f32(st.mx[ix]), scale=f32(1.0), w_in=f32(w), w_out=f32(np.eye(fy)),
                                 bias=f32(st.my), down=f32(np.zeros((len(ix), 1))), res_bias=f32(np.zeros(1)),
                                 up=f32(np.zeros((1, fy)))))
            row[kind] = [{"source_layers": list(layers), "r2_by_source_layer": [float(x) for x in scores]}
                         for layers, _, scores in heads]
        layers_report.append(row)
    pairing = tuple(pairing)
    kvmap = KVMap(keys=tuple(keys), values=tuple(values), spec=spec_for(scfg, tcfg, pairing, None, 1))
    report = {"pairing": [list(p) for p in pairing], "heads": layers_report, "k": k, "lambda": lam,
              "size_bytes": size, "fit_seconds": time.perf_counter() - t0, "calib_tokens": int(k_stats[0].n)}
    return kvmap, report

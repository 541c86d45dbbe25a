"""How close a mapped cache is to the target's native cache: cosine and NRMSE per layer (keys before RoPE)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache
from kvjax.mapper.features import layer_features


def _valid_rows(feat, lengths) -> np.ndarray:
    feat = np.asarray(feat)  # [B, T, F]
    return np.concatenate([feat[b, : int(n)] for b, n in enumerate(np.asarray(lengths))])


def feature_distances(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Mean per-token cosine, and NRMSE = RMS error / RMS deviation of `true` from its mean. pred/true [N, F]."""
    pred, true = np.asarray(pred, np.float64), np.asarray(true, np.float64)
    cos = np.sum(pred * true, 1) / np.maximum(np.linalg.norm(pred, axis=1) * np.linalg.norm(true, axis=1), 1e-12)
    nrmse = np.sqrt(np.mean(np.sum((pred - true) ** 2, 1)) / np.mean(np.sum((true - true.mean(0)) ** 2, 1)))
    return {"cos": float(cos.mean()), "nrmse": float(nrmse)}


def cache_distances(mapped: KVCache, native: KVCache, theta: float) -> list[dict[str, float]]:
    """Per target layer {key_cos, key_nrmse, value_cos, value_nrmse} over each row's valid positions (of `native`)."""
    out = []
    for layer in range(native.num_layers):
        mk, mv = layer_features(mapped, layer, theta, native.capacity)
        nk, nv = layer_features(native, layer, theta)
        row = {}
        for kind, a, b in (("key", mk, nk), ("value", mv, nv)):
            d = feature_distances(_valid_rows(a, native.lengths), _valid_rows(b, native.lengths))
            row.update({f"{kind}_cos": d["cos"], f"{kind}_nrmse": d["nrmse"]})
        out.append(row)
    return out


def raw_features(source: KVCache, layer: int, theta: float, width: int) -> jnp.ndarray:
    """The 'raw' baseline: a source layer's features cut or zero-padded to the target's width (no map at all)."""
    def fit(a):
        return a[..., :width] if a.shape[-1] >= width else jnp.pad(a, [(0, 0), (0, 0), (0, width - a.shape[-1])])

    k, v = layer_features(source, layer, theta)
    return fit(k), fit(v)

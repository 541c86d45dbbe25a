"""How close a mapped cache is to the target's native cache: cosine and NRMSE per layer (keys before RoPE)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.builders import Mapped, NativePrefill, SourcePrefill
from kvjax.cache import KVCache
from kvjax.eval.attention_fidelity import cache_attention, native_attention
from kvjax.kernels.features import layer_features


def _valid_rows(feat, lengths) -> np.ndarray:
    feat = np.asarray(feat)  # [B, T, F]
    return np.concatenate([feat[b, : int(n)] for b, n in enumerate(np.asarray(lengths))])


def feature_distances(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Mean per-token cosine, and NRMSE = RMS error / RMS deviation of `true` from its mean. pred/true [N, F]."""
    pred, true = np.asarray(pred, np.float64), np.asarray(true, np.float64)
    cos = np.sum(pred * true, 1) / np.maximum(np.linalg.norm(pred, axis=1) * np.linalg.norm(true, axis=1), 1e-12)
    nrmse = np.sqrt(np.mean(np.sum((pred - true) ** 2, 1)) / np.mean(np.sum((true - true.mean(0)) ** 2, 1)))
    return {"cos": float(cos.mean()), "nrmse": float(nrmse)}


def cache_distances(mapped: KVCache, native: KVCache, rope) -> list[dict[str, float]]:
    """Per target layer {key_cos, key_nrmse, value_cos, value_nrmse} over each row's valid positions (of `native`);
    keys compared before RoPE (`rope`: the target's config .rope)."""
    out = []
    for layer in range(native.num_layers):
        mk, mv = layer_features(mapped, layer, rope, native.capacity)
        nk, nv = layer_features(native, layer, rope)
        row = {}
        for kind, a, b in (("key", mk, nk), ("value", mv, nv)):
            d = feature_distances(_valid_rows(a, native.lengths), _valid_rows(b, native.lengths))
            row.update({f"{kind}_cos": d["cos"], f"{kind}_nrmse": d["nrmse"]})
        out.append(row)
    return out


def raw_features(source: KVCache, layer: int, rope, width: int) -> jnp.ndarray:
    """The 'raw' baseline: a source layer's features cut or zero-padded to the target's width (no map at all)."""
    def fit(a):
        return a[..., :width] if a.shape[-1] >= width else jnp.pad(a, [(0, 0), (0, 0), (0, width - a.shape[-1])])

    k, v = layer_features(source, layer, rope)
    return fit(k), fit(v)


class _Accumulator:
    """Streaming cosine / NRMSE over token rows (the same numbers as `feature_distances` on all rows at once)."""

    def __init__(self):
        self.n, self.cos, self.err, self.sq, self.sum = 0, 0.0, 0.0, 0.0, 0.0

    def add(self, pred: np.ndarray, true: np.ndarray) -> None:
        pred, true = np.asarray(pred, np.float64), np.asarray(true, np.float64)
        norms = np.maximum(np.linalg.norm(pred, axis=1) * np.linalg.norm(true, axis=1), 1e-12)
        self.cos += float(np.sum(np.sum(pred * true, 1) / norms))
        self.err += float(np.sum((pred - true) ** 2))
        self.sq += float(np.sum(true ** 2))
        self.sum = self.sum + true.sum(0)
        self.n += len(true)

    def result(self) -> dict[str, float]:
        spread = self.sq / self.n - float(np.sum((self.sum / self.n) ** 2))  # mean ||t - mean(t)||^2
        return {"cos": self.cos / self.n, "nrmse": float(np.sqrt(self.err / self.n / max(spread, 1e-30)))}


def map_distances(maps: dict, source, target, windows: np.ndarray, batch_size: int = 8) -> dict:
    """Distances of mapped caches to the target's native cache on token windows int [N, T] (all positions valid).

    `maps`: name -> KVMap (e.g. {"raw": kvjax.mapper.injection.injection_map(...), "ridge": ..., "residual": ...}).
    Returns {name: {"mean": {key_cos, key_nrmse, value_cos, value_nrmse, attn_cos, attn_nrmse} (mean over target
    layers), "per_layer": [...]}}; keys are compared before RoPE, values as they are; attn_* compare the target's
    attention outputs from the mapped and the native cache under the same (native) queries
    (kvjax.eval.attention_fidelity)."""
    tcfg, tparams = target
    acc = {name: [(_Accumulator(), _Accumulator()) for _ in range(tcfg.num_layers)] for name in maps}
    # the target's attention outputs, mapped vs native cache (kvjax.eval.attention_fidelity)
    attn_acc = {name: [_Accumulator() for _ in range(tcfg.num_layers)] for name in maps}
    shared = SourcePrefill(source)  # one source prefill per batch: the raw features and every map's input
    builders = {name: Mapped(source, target, kvmap, name=name, shared=shared) for name, kvmap in maps.items()}
    native_target = NativePrefill(target)
    for i in range(0, len(windows), batch_size):
        tokens = np.asarray(windows[i : i + batch_size], np.int32)
        width = tokens.shape[1]  # every cache holds exactly the window: features over its positions only
        tgt = native_target(tokens, capacity=width)
        native = [layer_features(tgt, t, tcfg.rope) for t in range(tcfg.num_layers)]
        queries, native_out = native_attention(tparams, tcfg, jnp.asarray(tokens))
        for name, builder in builders.items():
            mapped = builder(tokens, capacity=width)
            for t, (nk, nv) in enumerate(native):
                mk, mv = layer_features(mapped, t, tcfg.rope)
                flat = lambda a: np.asarray(a).reshape(-1, a.shape[-1])  # noqa: E731
                acc[name][t][0].add(flat(mk), flat(nk))
                acc[name][t][1].add(flat(mv), flat(nv))
            mapped_out = cache_attention(queries, mapped.k, mapped.v)
            for t in range(tcfg.num_layers):
                heads = lambda a: np.asarray(a).reshape(-1, a.shape[-2] * a.shape[-1])  # noqa: E731
                attn_acc[name][t].add(heads(mapped_out[t]), heads(native_out[t]))
    out = {}
    for name, layers in acc.items():
        per_layer = []
        for (k, v), a in zip(layers, attn_acc[name]):
            kr, vr, ar = k.result(), v.result(), a.result()
            per_layer.append({"key_cos": kr["cos"], "key_nrmse": kr["nrmse"], "value_cos": vr["cos"],
                              "value_nrmse": vr["nrmse"], "attn_cos": ar["cos"], "attn_nrmse": ar["nrmse"]})
        out[name] = {"mean": {m: float(np.mean([r[m] for r in per_layer])) for m in per_layer[0]},
                     "per_layer": per_layer}
    return out

"""The bridge map (CacheBridge-style fitting, arXiv 2609.00891's idea): head matching plus attention-sensitivity
weighting, both on the ridge map's pairing of source layers.

Head matching. Each target KV head (per target layer, keys and values apart) is paired with the `k` source KV heads,
among the heads of the layers the ridge pairs with that target layer, whose features best predict it: the held-out
R^2 of a single-source-head ridge fit (fitted on the calibration windows at a fixed lambda, scored on the
lambda-selection windows). Its map reads only those heads: k * source head_dim inputs per target head instead of
the ridge's every paired layer's every head, a much smaller mapper.

Attention-sensitivity weighting. The fit of a target head weights each calibration token by how much the target's
own attention reads that position: in the target's native prefill of the window, the probability mass the
position receives from the queries at or after it, averaged over those queries and over the head's query group
(`attention_mass`), normalised to mean 1 per window, clipped at `clip` times that mean and normalised again
(`mass_weights`; an attention sink would otherwise take most of the weight). The ridge statistics are then weighted
(kvjax.mapper.ridge.chunk_stats(weights=)), so the fit spends its capacity on the tokens that are read; lambda is
chosen per head on the weighted held-out MSE of the lambda-selection windows, as fit_map does per layer.

Four passes: the unweighted statistics of the ridge's pairing on the calibration windows (the ridge's own) and on
the selection windows (the matching's held-out R^2, taken of y itself: a ranking, not a reported MSE, so the float32
cancellation kvjax.mapper.ridge guards against is immaterial at these R^2), then per target head the weighted
statistics of its chosen heads on both (the held-out ones around the training fit, as fit_map's). The result is an
ordinary KVMap on the ridge's pairing (so the artifact, the builders, the evaluations and the map kernels take it
unchanged): w_in is block-sparse, each target head's columns non-zero on its chosen source heads' rows only, w_out
the identity; each head's fit has its own (weighted) input mean, folded into its bias around one shared mu. Its
residual is a zero rank-1 network, as the per-head peer's. `size_bytes` in the report is the per-head weights and
biases (float32), not that dense embedding.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax import aot
from kvjax.fitting.calibrate import batches_of, collect_stats
from kvjax.fitting.perhead import sub_stats
from kvjax.kernels.features import layer_features, paired_features
from kvjax.mapper.kvmap import KVMap, LinearMap, spec_for
from kvjax.mapper.pairing import Pairing, check_pairing, depth_pairing
from kvjax.mapper.ridge import LAMBDAS, Stats, chunk_stats, r2, reference, select, solve, to_stats
from kvjax.models.decoder import Stack, forward, prefill_forward
from kvjax.models.model import Model

MATCH_LAMBDA = 1e-3  # the single-head fits that rank source heads (relative to the mean eigenvalue of cov(x))
CLIP = 10.0  # default weight clip, in multiples of the window's mean weight
_BLOCK = 128  # queries per block in attention_mass: scores [B, Hkv, G, 128, T] bound the memory of a long window


# ---- attention-sensitivity weights ---------------------------------------------------------------------------------

def _received(q: jax.Array, k: jax.Array, block: int = _BLOCK) -> jax.Array:
    """q [B, T, Hq, hd], k [B, T, Hkv, hd] (after RoPE) -> [B, Hkv, T]: per key position j the causal attention
    probability summed over the queries i >= j and over the KV head's query group."""
    b, t, hq, hd = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, hd).transpose(0, 2, 3, 1, 4).astype(jnp.float32)  # [B, Hkv, G, T, hd]
    kt = k.transpose(0, 2, 1, 3).astype(jnp.float32)  # [B, Hkv, T, hd]
    acc = jnp.zeros((b, hkv, t), jnp.float32)
    for lo in range(0, t, block):
        hi = min(lo + block, t)
        s = jnp.einsum("bkgqd,bksd->bkgqs", qg[:, :, :, lo:hi], kt[:, :, :hi]) * hd ** -0.5
        causal = np.arange(hi)[None, :] <= np.arange(lo, hi)[:, None]  # [q, s] host constant
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        acc = acc.at[:, :, :hi].add(p.sum(axis=(2, 3)))
    return acc


@functools.partial(aot.jit, static_argnames=("cfg",))
def attention_mass(params, cfg, tokens: jax.Array) -> jax.Array:
    """float32 [L, B, Hkv, T]: in the model's own prefill of tokens int [B, T] (from position 0), per layer and KV
    head the mean attention probability position j receives from the queries at or after it (i >= j: the last
    position's is its own query's), averaged over the head's query heads. sum_j (T - j) * mass[j] = T."""
    t = tokens.shape[1]
    readers = (t - jnp.arange(t)).astype(jnp.float32)  # queries that can read position j

    def mass(s):  # the layer's received probability, averaged over each KV head's query group and the readers
        return _received(s.q, s.k) / (s.q.shape[2] // s.k.shape[2] * readers)

    return forward(params, cfg, tokens, logits=None, tap=Stack(mass)).tapped


def mass_weights(mass: jax.Array, clip: float | None = CLIP) -> jax.Array:
    """Per-token weights from attention mass [..., T]: normalised to mean 1 over the last axis (a window), clipped
    at `clip` (None or 0: no clip) and normalised again."""
    w = mass / jnp.maximum(mass.mean(-1, keepdims=True), 1e-30)
    if clip:
        w = jnp.minimum(w, clip)
        w = w / jnp.maximum(w.mean(-1, keepdims=True), 1e-30)
    return w


# ---- weighted per-head statistics ----------------------------------------------------------------------------------

Columns = tuple  # per target layer, (key, value), per target head: the source feature columns it reads


def head_columns(layers: int, src_kv: int, src_hd: int, heads: tuple[int, ...]) -> np.ndarray:
    """The feature columns of candidate source heads `heads` (index c = position of the layer in the pairing *
    src_kv + head) in a pairing's concatenated features (layers * src_kv heads of src_hd each)."""
    if any(not 0 <= c < layers * src_kv for c in heads):
        raise ValueError(f"source head index out of range 0..{layers * src_kv - 1}: {heads}")
    return np.concatenate([c * src_hd + np.arange(src_hd) for c in heads])


@functools.partial(aot.jit, static_argnames=("scfg", "tcfg", "pairing", "columns", "weighted", "clip"))
def _head_stats(sparams, tparams, scfg, tcfg, pairing: Pairing, columns: Columns, weighted: bool, clip, tokens, mask,
                refs):
    """Per target layer, kind and head: the chunk statistics of its chosen source columns -> its features, weighted
    by its attention mass when `weighted`."""
    src = prefill_forward(sparams, scfg, tokens, logits=None).cache
    tgt = prefill_forward(tparams, tcfg, tokens, logits=None).cache
    weights = mass_weights(attention_mass(tparams, tcfg, tokens), clip) if weighted else None  # [L, B, Hkv, T]
    flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
    flat_mask, hd = mask.reshape(-1), tcfg.head_dim
    out = []
    for t, layers in enumerate(pairing):
        xs = paired_features(src, layers, scfg.rope)
        ys = layer_features(tgt, t, tcfg.rope)
        row = []
        for kind in range(2):
            heads = []
            for h, cols in enumerate(columns[t][kind]):
                w = None if weights is None else weights[t][:, h].reshape(-1)
                x, y = xs[kind][..., np.asarray(cols)], ys[kind][..., h * hd:(h + 1) * hd]
                heads.append(chunk_stats(flat(x), flat(y), flat_mask, refs[t][kind][h], weights=w))
            row.append(heads)
        out.append(row)
    return out


def collect_head_stats(source: Model, target: Model, pairing: Pairing, columns: Columns, batches, *,
                       weighted: bool = True, clip: float | None = CLIP, refs=None, desc: str = "bridge calibrate",
                       total: int | None = None) -> list[list[list[Stats]]]:
    """Sum the per-head statistics over batches of token windows int [B, T]: [target layer][key, value][head] ->
    Stats of the head's source columns -> its features. `refs` (same nesting, [cols, head_dim] maps): held-out
    statistics of the residuals around them (kvjax.mapper.ridge); None: of y."""
    (scfg, sparams), (tcfg, tparams) = source, target
    if refs is None:
        refs = [[[np.zeros((len(c), tcfg.head_dim), np.float32) for c in kind] for kind in row] for row in columns]
    refs = [[[np.asarray(r, np.float32) for r in kind] for kind in row] for row in refs]
    acc = None
    for tokens in tqdm(batches, desc=desc, unit="batch", total=total, leave=False):
        tokens = jnp.asarray(tokens, jnp.int32)
        sums = _head_stats(sparams, tparams, scfg, tcfg, pairing, columns, weighted, clip, tokens,
                           jnp.ones(tokens.shape, jnp.float32), refs)
        new = [[[to_stats(s, r) for s, r in zip(sk, rk)] for sk, rk in zip(st, rt)] for st, rt in zip(sums, refs)]
        if acc is None:
            acc = new
        else:
            for a_row, n_row in zip(acc, new):
                for a_kind, n_kind in zip(a_row, n_row):
                    for a, n in zip(a_kind, n_kind):
                        a += n
    if acc is None:
        raise ValueError("no calibration batches")
    return acc


# ---- head matching -------------------------------------------------------------------------------------------------

def match_heads(train: Stats, heldout: Stats, src_hd: int, iy: np.ndarray, k: int, lam: float = MATCH_LAMBDA
                ) -> tuple[tuple[int, ...], list[float]]:
    """Rank the candidate source heads (consecutive blocks of `src_hd` columns of x) by the held-out R^2 of a
    single-head ridge fit of y[iy] (fitted on `train`, scored on `heldout`, both statistics of y itself). Returns
    (the best k candidates in ascending order, every candidate's R^2)."""
    n = len(train.mx) // src_hd
    if not 1 <= k <= n:
        raise ValueError(f"k must be in 1..{n} (candidate source heads), got {k}")
    scores = []
    for c in range(n):
        ix = c * src_hd + np.arange(src_hd)
        scores.append(r2(solve(sub_stats(train, ix, iy), lam), sub_stats(heldout, ix, iy)))
    chosen = tuple(sorted(int(c) for c in np.argsort(-np.asarray(scores), kind="stable")[:k]))
    return chosen, [float(s) for s in scores]


# ---- the fit -------------------------------------------------------------------------------------------------------

def fit_bridge(source: Model, target: Model, calib: np.ndarray, heldout: np.ndarray, *, k: int = 2,
               pairing: str | Pairing = "depth", weighted: bool = True, clip: float | None = CLIP, lams=LAMBDAS,
               match_lambda: float = MATCH_LAMBDA, batch_size: int = 8) -> tuple[KVMap, dict]:
    """Fit the bridge map on calibration windows int [N, T], heads matched and lambda chosen on the held-out
    (lambda-selection) windows [M, T]. `pairing`: the source layers each target layer reads ("depth" or the ridge
    map's explicit pairing; the job passes the ridge's); `k`: source heads per target head (at most the heads of a
    target layer's paired layers); `weighted` False: every token weight 1 (head matching alone). Returns (map,
    report: per target layer and kind each head's chosen source heads as [source layer, head], every candidate's
    held-out R^2, lambda and weighted held-out R^2; size_bytes, fit_seconds, calib_tokens)."""
    (scfg, _), (tcfg, _) = source, target
    t0 = time.perf_counter()
    if pairing == "depth":
        pairing = depth_pairing(scfg.num_layers, tcfg.num_layers)
    pairing = check_pairing(tuple(tuple(int(s) for s in p) for p in pairing), scfg.num_layers, tcfg.num_layers)
    widest = min(len(p) for p in pairing) * scfg.num_kv_heads
    if not 1 <= k <= widest:
        raise ValueError(f"k must be in 1..{widest} (the source KV heads of the fewest layers a target layer is "
                         f"paired with), got {k}")
    nb = lambda w: -(-len(w) // batch_size)  # noqa: E731
    train_k, train_v = collect_stats(source, target, pairing, batches_of(calib, batch_size), "bridge match",
                                     total=nb(calib))
    held_k, held_v = collect_stats(source, target, pairing, batches_of(heldout, batch_size), "bridge match held-out",
                                   total=nb(heldout))
    shd, hd, heads = scfg.head_dim, tcfg.head_dim, tcfg.num_kv_heads
    matched = []  # [t][kind][h] -> (candidates, scores)
    for t in range(len(pairing)):
        matched.append([[match_heads(tr, ho, shd, np.arange(h * hd, (h + 1) * hd), k, match_lambda)
                         for h in range(heads)] for tr, ho in ((train_k[t], held_k[t]), (train_v[t], held_v[t]))])
    columns = tuple(tuple(tuple(tuple(int(c) for c in head_columns(len(pairing[t]), scfg.num_kv_heads, shd, cand))
                                for cand, _ in kind) for kind in row) for t, row in enumerate(matched))
    wtrain = collect_head_stats(source, target, pairing, columns, batches_of(calib, batch_size), weighted=weighted,
                                clip=clip, total=nb(calib))
    refs = [[[reference(st, lams) for st in kind] for kind in row] for row in wtrain]
    wheld = collect_head_stats(source, target, pairing, columns, batches_of(heldout, batch_size), weighted=weighted,
                               clip=clip, refs=refs, desc="bridge held-out", total=nb(heldout))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    maps, report_layers, size = ([], []), [], 0
    for t, layers in enumerate(pairing):
        row = {}
        for kind, name, shared in ((0, "key", train_k[t]), (1, "value", train_v[t])):
            fx = len(shared.mx)
            w = np.zeros((fx, heads * hd))
            bias = np.zeros(heads * hd)
            mu = shared.mx  # one input mean for the layer; each head's own (weighted) mean goes into its bias
            rows = []
            for h in range(heads):
                cand, scores = matched[t][kind][h]
                cols = np.asarray(columns[t][kind][h])
                fit, by_lam = select(wtrain[t][kind][h], wheld[t][kind][h], lams)
                wh = fit.weight
                w[cols, h * hd:(h + 1) * hd] = wh
                bias[h * hd:(h + 1) * hd] = fit.bias + (mu[cols] - fit.mu) @ wh
                size += 4 * (wh.size + hd)
                rows.append({"source_heads": [[int(layers[c // scfg.num_kv_heads]), int(c % scfg.num_kv_heads)]
                                              for c in cand],
                             "heldout_r2_by_source_head": scores, "lambda": fit.lam,
                             "heldout_r2": r2(fit, wheld[t][kind][h]), "train_r2": r2(fit, wtrain[t][kind][h]),
                             "heldout_mse_by_lambda": {str(a): b for a, b in by_lam.items()}})
            maps[kind].append(LinearMap(mu=f32(mu), scale=f32(1.0), w_in=f32(w), w_out=f32(np.eye(heads * hd)),
                                        bias=f32(bias), down=f32(np.zeros((fx, 1))), res_bias=f32(np.zeros(1)),
                                        up=f32(np.zeros((1, heads * hd)))))
            row[name] = rows
        report_layers.append(row)
    kvmap = KVMap(keys=tuple(maps[0]), values=tuple(maps[1]), spec=spec_for(scfg, tcfg, pairing, None, 1))
    report = {"pairing": [list(p) for p in pairing], "heads": report_layers, "k": k, "weighted": weighted,
              "clip": clip, "match_lambda": match_lambda, "size_bytes": size,
              "heldout_r2": [[float(np.mean([h["heldout_r2"] for h in r[kind]])) for kind in ("key", "value")]
                             for r in report_layers],
              "fit_seconds": time.perf_counter() - t0, "calib_tokens": int(round(train_k[0].n))}
    return kvmap, report

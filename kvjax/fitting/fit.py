"""fit_map: calibration -> pairing -> ridge per target layer (K and V) with lambda chosen on held-out tokens."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from kvjax import distributed, sharding
from kvjax.models.model import Model
from kvjax.fitting.calibrate import batches_of, collect_stats, row_batches
from kvjax.mapper.kvmap import KVMap, kvmap_shardings, linear_map, spec_for
from kvjax.mapper.pairing import Pairing, check_pairing, depth_pairing, topk_pairing
from kvjax.mapper.ridge import LAMBDAS, Stats, r2, reference, select


def _refs(train_k: list[Stats], train_v: list[Stats], lams) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per target layer the (key, value) maps to take held-out statistics around, so that held-out MSE and R^2 do not
    cancel in float32 (kvjax.mapper.ridge)."""
    return [(reference(k, lams), reference(v, lams)) for k, v in zip(train_k, train_v)]


def _batches(windows, batch_size: int, mesh: Mesh | None):
    return batches_of(windows, batch_size) if mesh is None else row_batches(windows, batch_size)


def layer_r2(source: Model, target: Model, calib: np.ndarray, heldout: np.ndarray, batch_size: int = 8,
             lams=LAMBDAS, mesh: Mesh | None = None) -> np.ndarray:
    """Held-out R^2 of single-source-layer ridge fits for every (target layer, source layer): [n_target, n_source],
    mean of the key and value R^2."""
    n_src, n_tgt = source[0].num_layers, target[0].num_layers
    out = np.zeros((n_tgt, n_src))
    for s in range(n_src):
        pairing = ((s,),) * n_tgt
        train_k, train_v = collect_stats(source, target, pairing, _batches(calib, batch_size, mesh),
                                         f"rank src {s}", mesh=mesh)
        held_k, held_v = collect_stats(source, target, pairing, _batches(heldout, batch_size, mesh),
                                       f"rank src {s}", mesh=mesh, refs=_refs(train_k, train_v, lams))
        for t in range(n_tgt):
            scores = [r2(select(tr, ho, lams)[0], ho) for tr, ho in ((train_k[t], held_k[t]), (train_v[t], held_v[t]))]
            out[t, s] = np.mean(scores)
    return out


def fit_map(source: Model, target: Model, calib: np.ndarray, heldout: np.ndarray, *,
            pairing: str | int | Pairing = "depth", rank: int | None = None, lams=LAMBDAS, residual_rank: int = 16,
            batch_size: int = 8, seed: int = 0, mesh: Mesh | None = None,
            tokenizers: tuple[str | None, str | None] | None = None) -> tuple[KVMap, dict]:
    """Fit a source->target cache map on calibration windows int [N, T]; lambda per layer and kind is picked on the
    held-out windows [M, T]. `pairing`: "depth" (nearest relative depth), k (top-k source layers by held-out R^2),
    or an explicit tuple per target layer. Returns (map with zero-initialised residual, fit report).

    With `mesh` (kvjax.sharding.make_mesh), the statistics are collected data-parallel over the mesh's 'data' axis
    with the models sharded over 'model', and summed across devices and processes before the solve (see
    collect_stats); `batch_size` is then the global batch. Windows may be arrays, memmaps or
    kvjax.distributed.TokenWindows; each process reads only its rows. The solve runs on process 0's statistics
    and the returned map is replicated on the mesh, identical on every process.

    The two models must share a tokenizer (the map pairs their caches position by position on the same ids): equal
    vocab_size, and with `tokenizers` (each checkpoint's kvjax.hf.tokenizer_fingerprint, None where unknown) equal
    fingerprints; otherwise a ValueError, before any work."""
    (scfg, _), (tcfg, _) = source, target
    if scfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"source and target vocabularies differ ({scfg.vocab_size} vs {tcfg.vocab_size}); the map "
                         "needs models that share a tokenizer")
    if tokenizers is not None and None not in tokenizers and tokenizers[0] != tokenizers[1]:
        raise ValueError(f"source and target tokenizers differ (tokenizer.json fingerprints {tokenizers[0]} vs "
                         f"{tokenizers[1]}); the map needs models that share a tokenizer")
    report: dict = {}
    if pairing == "depth":
        pairing = depth_pairing(scfg.num_layers, tcfg.num_layers)
    elif isinstance(pairing, int):
        report["layer_r2"] = layer_r2(source, target, calib, heldout, batch_size, lams, mesh).tolist()
        pairing = topk_pairing(np.asarray(report["layer_r2"]), pairing)
    pairing = check_pairing(pairing, scfg.num_layers, tcfg.num_layers)
    train_k, train_v = collect_stats(source, target, pairing, _batches(calib, batch_size, mesh), "calibrate",
                                     total=-(-len(calib) // batch_size), mesh=mesh)
    held_k, held_v = collect_stats(source, target, pairing, _batches(heldout, batch_size, mesh), "held-out stats",
                                   mesh=mesh, refs=_refs(train_k, train_v, lams))
    keys, values, layers = [], [], []
    rng = jax.random.split(jax.random.key(seed), 2 * len(pairing))
    for t in range(len(pairing)):
        row = {"source_layers": list(pairing[t])}
        for kind, tr, ho, out, key in (("key", train_k[t], held_k[t], keys, rng[2 * t]),
                                       ("value", train_v[t], held_v[t], values, rng[2 * t + 1])):
            fit, scores = select(tr, ho, lams, rank)
            scale = float(np.sqrt(max(np.trace(tr.cov_xx()) / len(tr.mx), 1e-12)))
            out.append(linear_map(fit, residual_rank, key, scale))
            row[kind] = {"lambda": fit.lam, "heldout_r2": r2(fit, ho), "train_r2": r2(fit, tr),
                         "heldout_mse_by_lambda": {str(k): v for k, v in scores.items()}}
        layers.append(row)
    report.update(pairing=[list(p) for p in pairing], layers=layers, calib_tokens=int(train_k[0].n),
                  heldout_tokens=int(held_k[0].n), rank=rank)
    spec = spec_for(scfg, tcfg, pairing, rank, residual_rank)
    kvmap = KVMap(keys=tuple(keys), values=tuple(values), spec=spec)
    if mesh is not None:  # process 0's solve, replicated everywhere (hosts' LAPACKs may differ in the last bits)
        kvmap = sharding.place(distributed.broadcast_from_primary(kvmap), kvmap_shardings(kvmap, mesh))
    return kvmap, report

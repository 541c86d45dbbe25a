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


def restrict(stats: list[Stats], pairing: Pairing, width: int) -> list[Stats]:
    """Per target layer, statistics of several source layers' features (block i: features i x width .. (i + 1) x
    width, as kvjax.kernels.features.paired_features concatenates them) restricted to the blocks `pairing` gives it,
    in its order."""
    return [st.restrict(np.concatenate([np.arange(s * width, (s + 1) * width) for s in layers]))
            for st, layers in zip(stats, pairing)]


STATS_BUDGET = 1 << 30  # bytes of float64 scatter sums the layer screen holds at once (keys and values)


def screen_groups(n_source: int, n_target: int, width: int) -> list[tuple[int, ...]]:
    """Source layers in groups whose joint statistics (keys and values, every target layer: 2 x n_target x (g x
    width)^2 float64) fit STATS_BUDGET: a toy's every layer in one group, one layer per group for Qwen3-32B (the
    joint statistics of all its layers would take 34 GB for each target layer's keys alone)."""
    g = max(1, int((STATS_BUDGET / (16 * n_target * width * width)) ** 0.5))
    return [tuple(range(i, min(i + g, n_source))) for i in range(0, n_source, g)]


def layer_r2(source: Model, target: Model, calib: np.ndarray, heldout: np.ndarray, batch_size: int = 8,
             lams=LAMBDAS, mesh: Mesh | None = None) -> tuple[np.ndarray, tuple[list[Stats], list[Stats]] | None]:
    """Held-out R^2 of single-source-layer ridge fits for every (target layer, source layer): [n_target, n_source],
    mean of the key and value R^2. The calibration windows are read once per group of source layers
    (`screen_groups`), each single-layer fit taking its block of the group's statistics; the held-out windows (a few
    batches) once per group too, with statistics around each of its fits. Also returns, when one group held every
    layer, those statistics (per target layer, keys and values), from which any pairing's training statistics
    restrict."""
    (scfg, _), n_tgt = source, target[0].num_layers
    width = scfg.num_kv_heads * scfg.head_dim
    groups = screen_groups(scfg.num_layers, n_tgt, width)
    out = np.zeros((n_tgt, scfg.num_layers))
    for group in groups:
        every_k, every_v = collect_stats(source, target, (group,) * n_tgt, _batches(calib, batch_size, mesh),
                                         f"rank src {group[0]}-{group[-1]}", total=-(-len(calib) // batch_size),
                                         mesh=mesh)
        # each layer's single-layer fits: block i of the group's statistics for layer s = group[i]
        train = [(restrict(every_k, ((i,),) * n_tgt, width), restrict(every_v, ((i,),) * n_tgt, width))
                 for i in range(len(group))]
        # the held-out statistics around every one of those fits in one pass (entry i * n_tgt + t: layer group[i]
        # read by target layer t)
        held_k, held_v = collect_stats(
            source, target, tuple((s,) for s in group for _ in range(n_tgt)), _batches(heldout, batch_size, mesh),
            f"held-out src {group[0]}-{group[-1]}", mesh=mesh, targets=tuple(range(n_tgt)) * len(group),
            refs=[ref for tr_k, tr_v in train for ref in _refs(tr_k, tr_v, lams)])
        for i, s in enumerate(group):
            tr_k, tr_v = train[i]
            for t in range(n_tgt):
                ho_k, ho_v = held_k[i * n_tgt + t], held_v[i * n_tgt + t]
                scores = [r2(select(tr, ho, lams)[0], ho) for tr, ho in ((tr_k[t], ho_k), (tr_v[t], ho_v))]
                out[t, s] = np.mean(scores)
    return out, ((every_k, every_v) if len(groups) == 1 else None)


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
    every = None
    if pairing == "depth":
        pairing = depth_pairing(scfg.num_layers, tcfg.num_layers)
    elif isinstance(pairing, int):
        r2_table, every = layer_r2(source, target, calib, heldout, batch_size, lams, mesh)
        report["layer_r2"] = r2_table.tolist()
        pairing = topk_pairing(r2_table, pairing)
    pairing = check_pairing(pairing, scfg.num_layers, tcfg.num_layers)
    if every is None:
        train_k, train_v = collect_stats(source, target, pairing, _batches(calib, batch_size, mesh), "calibrate",
                                         total=-(-len(calib) // batch_size), mesh=mesh)
    else:  # the screen held every layer's statistics: the pairing's are a block of them (no second pass)
        train_k, train_v = (restrict(st, pairing, scfg.num_kv_heads * scfg.head_dim) for st in every)
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

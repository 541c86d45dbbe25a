"""Calibration: run both models on the same windows and stream (source, target) feature pairs into statistics."""

from __future__ import annotations

import functools
import logging
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

from kvjax import aot
from kvjax import distributed, sharding
from kvjax.kernels.features import layer_features, paired_features
from kvjax.mapper.pairing import Pairing
from kvjax.mapper.ridge import Stats, chunk_stats, to_stats
from kvjax.models.family import DecoderConfig
from kvjax.models.decoder import prefill_forward
from kvjax.models.model import Model
from kvjax.models.params import shard_params

log = logging.getLogger(__name__)


Pairs = tuple[tuple[int, tuple[int, ...]], ...]  # (target layer, its source layers) per set of statistics


def pairs_of(pairing: Pairing, targets: tuple[int, ...] | None = None) -> Pairs:
    """Each entry of `pairing` with the target layer it is for: entry i is target layer i, or targets[i]."""
    targets = tuple(range(len(pairing))) if targets is None else tuple(int(t) for t in targets)
    if len(targets) != len(pairing):
        raise ValueError(f"{len(targets)} target layers for {len(pairing)} entries of the pairing")
    return tuple(zip(targets, (tuple(int(s) for s in layers) for layers in pairing)))


@functools.partial(aot.jit, static_argnames=("scfg", "tcfg", "pairs"))
def _window_stats(sparams, tparams, scfg, tcfg, pairs: Pairs, tokens, mask, refs):
    src = prefill_forward(sparams, scfg, tokens, logits=None).cache  # the models' own caches
    tgt = prefill_forward(tparams, tcfg, tokens, logits=None).cache
    flat_mask = mask.reshape(-1)
    out = []
    for i, (t, layers) in enumerate(pairs):
        xk, xv = paired_features(src, layers, scfg.rope)
        yk, yv = layer_features(tgt, t, tcfg.rope)
        flat = lambda a: a.reshape(-1, a.shape[-1])  # noqa: E731
        rk, rv = refs[i]
        out.append((chunk_stats(flat(xk), flat(yk), flat_mask, rk), chunk_stats(flat(xv), flat(yv), flat_mask, rv)))
    return out


def feature_sizes(scfg: DecoderConfig, tcfg: DecoderConfig, pairing: Pairing) -> list[tuple[int, int]]:
    """(Fx, Fy) of each target layer's statistics (keys and values alike)."""
    return [(len(layers) * scfg.num_kv_heads * scfg.head_dim, tcfg.num_kv_heads * tcfg.head_dim) for layers in pairing]


def _refs32(scfg: DecoderConfig, tcfg: DecoderConfig, pairing: Pairing, refs) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per target layer (key ref, value ref) as float32 [Fx, Fy]; zeros (statistics of y itself) where refs is None."""
    sizes = feature_sizes(scfg, tcfg, pairing)
    if refs is None:
        return [(np.zeros(s, np.float32), np.zeros(s, np.float32)) for s in sizes]
    if len(refs) != len(pairing):
        raise ValueError(f"refs has {len(refs)} entries for {len(pairing)} target layers: pass one (key, value) pair "
                         "of reference maps per target layer (kvjax.mapper.ridge.reference of the training stats)")
    out = []
    for t, (pair, size) in enumerate(zip(refs, sizes)):
        pair = tuple(np.asarray(r, np.float32) for r in pair)
        if any(r.shape != size for r in pair):
            raise ValueError(f"refs[{t}] has shapes {[r.shape for r in pair]}, the features need {size}: the "
                             "reference maps must come from statistics of the same pairing")
        out.append(pair)
    return out


def collect_stats(source: Model, target: Model, pairing: Pairing, batches: Iterable[np.ndarray],
                  desc: str = "calibrate", total: int | None = None, mesh: Mesh | None = None, refs=None,
                  targets: tuple[int, ...] | None = None) -> tuple[list[Stats], list[Stats]]:
    """Sum statistics over batches of token windows int [B, T] (EOS-padded rows count fully). Returns per target
    layer (key stats, value stats). With `targets`, entry i of `pairing` (and of `refs`) is for target layer
    targets[i] instead of layer i: several pairings of one target layer in one pass over the windows.

    `refs`, per target layer a (key, value) pair of reference maps [Fx, Fy] (kvjax.mapper.ridge.reference of the
    training statistics), makes these statistics of the residuals around them: what held-out MSE and R^2 need to
    stay accurate in float32 (see kvjax.mapper.ridge). None: statistics of the targets themselves.

    With `mesh`, each batch is the *global* batch (an array, memmap or kvjax.distributed.TokenWindows indexed by
    row) and is split over the mesh's 'data' axis: each process reads only its own rows, every data shard
    computes its own statistics, a process merges its shards in float64, and the per-process sums are gathered
    and merged across processes before returning, so every process holds the same statistics, equal to a
    single-device pass up to float32 rounding of the chunks. Params are sharded over 'model' by the logical axis
    rules (already-placed params are used as they are); batches are padded to a multiple of the data axis with
    masked rows, so the statistics function compiles once.
    """
    pairs = pairs_of(pairing, targets)
    if mesh is not None:
        return _collect_stats_sharded(source, target, pairs, batches, desc, total, mesh, refs)
    (scfg, sparams), (tcfg, tparams) = source, target
    refs = _refs32(scfg, tcfg, pairing, refs)
    k_stats: list[Stats] | None = None
    v_stats: list[Stats] | None = None
    for tokens in tqdm(batches, desc=desc, unit="batch", total=total, leave=False):
        tokens = jnp.asarray(tokens, jnp.int32)
        mask = jnp.ones(tokens.shape, jnp.float32)
        sums = _window_stats(sparams, tparams, scfg, tcfg, pairs, tokens, mask, refs)
        batch_k = [to_stats(k, rk) for (k, _), (rk, _) in zip(sums, refs)]
        batch_v = [to_stats(v, rv) for (_, v), (_, rv) in zip(sums, refs)]
        if k_stats is None:
            k_stats, v_stats = batch_k, batch_v
        else:
            for acc, new in zip(k_stats + v_stats, batch_k + batch_v):
                acc += new
    if k_stats is None:
        raise ValueError("no calibration batches")
    return k_stats, v_stats


def batches_of(windows: np.ndarray, batch_size: int):
    """Consecutive batches [B, T] of a window array [N, T] (the last one may be smaller)."""
    for i in range(0, len(windows), batch_size):
        yield np.asarray(windows[i : i + batch_size])


def row_batches(windows, batch_size: int):
    """Consecutive row ranges windows[i : i + batch_size], not read yet (for `collect_stats(..., mesh=)`, which
    reads only this process's rows)."""
    for i in range(0, len(windows), batch_size):
        yield windows[i : i + batch_size]


# ---- the sharded path ----------------------------------------------------------------------------------------------

def model_on_mesh(model: Model, mesh: Mesh) -> Model:
    """(cfg, params) with params sharded by the logical axis rules on `mesh` (unchanged if already there)."""
    cfg, params = model
    if sharding.on_mesh(params, mesh):
        return model
    if jax.process_count() > 1:
        raise ValueError("in a multi-process run, load the params straight onto the mesh: kvjax.load_hf(path, "
                         "shardings=kvjax.models.params.param_shardings(cfg, mesh))")
    return cfg, shard_params(params, cfg, mesh)


def _data_shards(mesh: Mesh) -> int:
    axis = sharding.RULES["batch"]
    return 1 if axis is None else mesh.shape[axis]


@functools.lru_cache(maxsize=16)
def _sharded_stats_fn(scfg, tcfg, pairs: Pairs, mesh: Mesh, s_shardings, t_shardings, shape):
    """jit of: both models' caches for a global batch -> per-data-shard chunk statistics, leaves [S, ...]."""
    shards = _data_shards(mesh)
    batch = sharding.data_sharding(mesh, shape)
    out = NamedSharding(mesh, P(sharding.RULES["batch"]))

    def fn(sparams, tparams, tokens, mask, refs):
        src = prefill_forward(sparams, scfg, tokens, logits=None).cache
        tgt = prefill_forward(tparams, tcfg, tokens, logits=None).cache
        split = lambda a: a.reshape(shards, -1, a.shape[-1])  # noqa: E731  [B, T, F] -> [S, B/S*T, F]
        m = mask.reshape(shards, -1)
        stats = jax.vmap(chunk_stats, in_axes=(0, 0, 0, None))
        res = []
        for i, (t, layers) in enumerate(pairs):
            xk, xv = paired_features(src, layers, scfg.rope)
            yk, yv = layer_features(tgt, t, tcfg.rope)
            rk, rv = refs[i]
            res.append((stats(split(xk), split(yk), m, rk), stats(split(xv), split(yv), m, rv)))
        return res

    return aot.jit(fn, in_shardings=(s_shardings, t_shardings, batch, batch, sharding.replicated(mesh)),
                   out_shardings=out)


def _local_shard_stats(leaves: list[jax.Array]) -> dict[int, list[np.ndarray]]:
    """{data index: [host copy of each leaf's row]} for the data shards this process holds (one replica each)."""
    out: dict[int, list[np.ndarray]] = {}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                first = shard.index[0].start or 0
                rows = np.asarray(shard.data, np.float64)
                for r in range(rows.shape[0]):
                    out.setdefault(first + r, []).append(rows[r])
    return out


def merge_across_processes(stats: list[Stats]) -> list[Stats]:
    """Each process's partial statistics merged (in process order) into the same totals on every process."""
    if jax.process_count() == 1:
        return stats
    fields = [a for st in stats for a in (np.asarray(st.n, np.float64), st.mx, st.my, st.cxx, st.cxr, st.crr)]
    per_process = distributed.allgather_f64(fields)
    out = [Stats.zeros(len(st.mx), len(st.my), st.ref) for st in stats]  # refs: the same on every process
    for arrays in per_process:
        for i, acc in enumerate(out):
            n, mx, my, cxx, cxr, crr = arrays[6 * i : 6 * i + 6]
            acc += Stats(float(n), mx, my, cxx, cxr, crr, acc.ref)
    return out


def _collect_stats_sharded(source: Model, target: Model, pairs: Pairs, batches, desc: str, total, mesh: Mesh,
                           refs):
    pairing = tuple(layers for _, layers in pairs)
    source, target = model_on_mesh(source, mesh), model_on_mesh(target, mesh)
    (scfg, sparams), (tcfg, tparams) = source, target
    # process 0's refs everywhere: every shard's residual must be around the same map for the sums to merge
    refs = [tuple(np.asarray(r, np.float32) for r in pair)
            for pair in distributed.broadcast_from_primary(_refs32(scfg, tcfg, pairing, refs))]
    flat_refs = [r for pair in refs for r in pair]  # in the order of the statistics: layer 0 key, layer 0 value, ...
    refs_on_mesh = sharding.place(refs, sharding.replicated(mesh))
    s_sh = jax.tree.map(lambda x: x.sharding, sparams)
    t_sh = jax.tree.map(lambda x: x.sharding, tparams)
    shards = _data_shards(mesh)
    acc: list[Stats] | None = None
    shape = None
    bar = tqdm(batches, desc=desc, unit="batch", total=total, leave=False, disable=not distributed.is_primary())
    with jax.set_mesh(mesh):
        for rows in bar:
            if shape is None:  # every batch is padded to the first one's size: one compile
                shape = (-(-len(rows) // shards) * shards, rows.shape[1])
            if len(rows) > shape[0] or rows.shape[1] != shape[1]:
                raise ValueError(f"calibration batch of shape {rows.shape} after batches of {shape}: batches must "
                                 "not grow (use kvjax.fitting.calibrate.row_batches)")
            data = sharding.data_sharding(mesh, shape)
            if acc is None:
                mine = distributed.local_rows(data, shape)
                log.info("%s: process %d of %d reads rows %d:%d of each %d-window batch (%d data shards)", desc,
                         jax.process_index(), jax.process_count(), mine.start, mine.stop, shape[0], shards)
            tokens = distributed.global_batch(rows, data, shape)
            mask = distributed.global_batch(np.ones((len(rows), shape[1]), np.float32), data, shape, np.float32)
            fn = _sharded_stats_fn(scfg, tcfg, pairs, mesh, s_sh, t_sh, shape)
            sums = fn(sparams, tparams, tokens, mask, refs_on_mesh)
            leaves = [leaf for layer in sums for kind in layer for leaf in kind]
            if acc is None:
                acc = [Stats.zeros(leaves[6 * i + 1].shape[-1], leaves[6 * i + 2].shape[-1], ref)
                       for i, ref in enumerate(flat_refs)]
            for _, rows_of_shard in sorted(_local_shard_stats(leaves).items()):
                for i, st in enumerate(acc):
                    n, mx, my, cxx, cxr, crr = rows_of_shard[6 * i : 6 * i + 6]
                    st += Stats(float(n), mx, my, cxx, cxr, crr, st.ref)
            distributed.heartbeat()
    if acc is None:
        raise ValueError("no calibration batches")
    acc = merge_across_processes(acc)
    n = len(pairing)
    return acc[0 : 2 * n : 2], acc[1 : 2 * n : 2]

"""The fitting stages' programs (ridge, residual, perhead, bridge) as the job runs them on a slice.

ridge: both models' caches of a batch of calibration windows and their feature statistics, in one program
(kvjax.fitting.calibrate: `_sharded_stats_fn` on a mesh of more than one device, `_window_stats` on one), for the
calibration windows and, with reference maps, for the held-out ones (the same shapes: one compile). residual: the
training step (kvjax.fitting.residual.training_step) with its optimizer state, and the teacher pool's programs when
the config pools. perhead: the statistics of every source layer per target layer. bridge: the target's attention mass
and the per-head statistics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.fitting import calibrate
from kvjax.fitting.calibrate import feature_sizes, pairs_of
from kvjax.mapper.kvmap import kvmap_shardings
from kvjax.plan import costs, shapes
from kvjax.plan.programs import Builder
from kvjax.plan.program import Program


def _refs(scfg, tcfg, pairing, mesh):
    return [tuple(shapes.replicated(s, jnp.float32, mesh) for _ in range(2))
            for s in feature_sizes(scfg, tcfg, pairing)]


def stats_program(b: Builder, pairing, rows: int, length: int, name: str, sharded: bool = True) -> Program:
    """The statistics program of calibrate.collect_stats for `pairing` over batches of rows x length tokens (on the
    mesh when `sharded` and the mesh has more than one device, as collect_stats(mesh=) runs)."""
    (scfg, sparams), (tcfg, tparams) = b.source, b.target
    pairs = pairs_of(pairing)
    mesh = b.mesh
    shards = calibrate._data_shards(mesh)
    rows = -(-rows // shards) * shards  # collect_stats pads a batch to a multiple of the data axis
    refs = _refs(scfg, tcfg, pairing, mesh)
    tokens = shapes.batch_sharded((rows, length), jnp.int32, mesh)
    mask = shapes.batch_sharded((rows, length), jnp.float32, mesh)
    if sharded and mesh.size > 1:
        s_sh = jax.tree.map(lambda x: x.sharding, sparams)
        t_sh = jax.tree.map(lambda x: x.sharding, tparams)
        fn = calibrate._sharded_stats_fn(scfg, tcfg, pairs, mesh, s_sh, t_sh, (rows, length))
        args, kwargs = (sparams, tparams, tokens, mask, refs), {}
    else:
        fn = calibrate._window_stats
        args, kwargs = (sparams, tparams, scfg, tcfg, pairs, tokens, mask, refs), {}
    n = rows * length
    flops = (b.fwd("source", rows, length, (length + 1) / 2, 0)
             + b.fwd("target", rows, length, (length + 1) / 2, 0)
             + b.per_row(rows) * sum(2 * costs.stats_flops(fx, fy, n) for fx, fy in feature_sizes(scfg, tcfg,
                                                                                                   pairing)))
    moved = (b.wbytes("source", n, False) + b.wbytes("target", n, False)) \
        + sum(2 * 4 * (fx * fx + fx * fy + fy * fy) for fx, fy in feature_sizes(scfg, tcfg, pairing))
    return b.program(f"{name} statistics {rows} x {length} ({len(pairs)} target layers)", fn, args, kwargs, flops,
                     moved, ("source", "target"))


def ridge(b: Builder, cfg) -> list[Program]:
    m = cfg.map
    (scfg, _), (tcfg, _) = b.source, b.target
    if m.pairing == "depth":
        return [stats_program(b, shapes.pairing_for(scfg, tcfg, "depth"), m.batch_size, m.window_len, "ridge")]
    # topK: the screen reads every source layer for every target layer, in groups that fit the statistics budget
    from kvjax.fitting.fit import screen_groups
    groups = screen_groups(scfg.num_layers, tcfg.num_layers, scfg.num_kv_heads * scfg.head_dim)
    out = [stats_program(b, (g,) * tcfg.num_layers, m.batch_size, m.window_len, f"ridge screen ({len(g)} source layers)")
           for g in {len(g): g for g in groups}.values()]
    out.append(stats_program(b, shapes.pairing_for(scfg, tcfg, m.pairing), m.batch_size, m.window_len, "ridge"))
    return out


def residual(b: Builder, cfg, kvmap) -> list[Program]:
    """The residual's training step as train_residual compiles it for this config (data-parallel on the mesh
    unless it pools, as train_residual does), with the optimizer state; the pools' program when it pools."""
    from kvjax.fitting.residual import make_optimizer, training_step, with_attention, with_context
    rc = cfg.residual
    pooled = bool(rc.pool_windows or rc.copy_windows)
    m = kvmap
    if rc.context:
        m = jax.eval_shape(lambda k: with_context(k, rc.context, rc.seed, rc.context_kinds), m)
    if rc.attention_heads:
        m = jax.eval_shape(lambda k: with_attention(k, rc.attention_heads, rc.attention_dim, rc.seed), m)
    m = shapes.abstract(m, kvmap_shardings(m, b.mesh))
    opt = make_optimizer(rc, m)
    mesh = None if (pooled or b.mesh.size == 1) else b.mesh  # as train_residual decides
    step, shardings = training_step(m, b.source, b.target, rc, opt, mesh=mesh, pooled=bool(rc.pool_windows),
                                    copies=bool(rc.copy_windows))
    abstract_state = jax.eval_shape(opt.init, m)
    if shardings is None:
        replicated = shapes.replicated((), jnp.float32, b.mesh).sharding
        opt_state = shapes.abstract(abstract_state, jax.tree.map(lambda _: replicated, abstract_state))
    else:
        opt_state = shapes.abstract(abstract_state, shardings[1])
    out = []
    if shardings is not None:  # train_residual places the optimizer state with a compiled init on the mesh
        from kvjax import aot
        init = aot.jit(opt.init, out_shardings=shardings[1])
        out.append(b.program("optimizer state init", init, (m,), {}, 0.0, 3 * costs.map_weight_bytes(m), ()))
    window = rc.prefix_len + rc.cont_len
    batch = (pool_batch(b, rc.batch_size, rc.prefix_len, rc.cont_len) if rc.pool_windows else
             shapes.batch_sharded((rc.batch_size, window), jnp.int32, b.mesh))
    args = [m, opt_state, b.source.params, b.target.params, batch]
    if rc.copy_windows:
        args.append(pool_batch(b, rc.copy_batch, rc.copy_len, rc.copy_window_len - rc.copy_len))
    rows = rc.batch_size + (rc.copy_batch if rc.copy_windows else 0)
    # the teacher's forward over prefix + continuation (none when pooled: read from the pool), the map forward and
    # backward over the prefix, the target forward and backward over the continuation reading the mapped prefix
    src = 0.0 if rc.pool_windows else b.fwd("source", rc.batch_size, window, (window + 1) / 2,
                                                          rc.cont_len)
    flops = (src + 3 * costs.map_flops(m, rows, rc.prefix_len) * b.per_row(rows)
             + 3 * b.fwd("target", rows, rc.cont_len, rc.prefix_len + rc.cont_len / 2, rc.cont_len))
    moved = (2 * b.wbytes("target", rows * rc.cont_len)
             + (0 if rc.pool_windows else b.wbytes("source", rc.batch_size * window))) \
        + 4 * costs.map_weight_bytes(m)
    out += [b.program(f"residual training step {rc.batch_size} x {window}"
                     + (f" + {rc.copy_batch} copy windows" if rc.copy_windows else "")
                     + (" (pooled)" if rc.pool_windows else ""), step, tuple(args), {}, flops, moved,
                     ("source", "target"), note="the map and its Adam moments beside the models")]
    if rc.pool_windows:
        out.append(pool_program(b, rc.prefix_len, rc.cont_len, rc.teacher, "teacher pool"))
    if rc.copy_windows:
        out.append(pool_program(b, rc.copy_len, rc.copy_window_len - rc.copy_len, rc.teacher, "copy-window pool"))
    return out


def pool_batch(b: Builder, rows: int, prefix: int, cont: int):
    """A teacher pool's batch (kvjax.fitting.teacher_pool.Pool.batch): tokens, the source's cache of each prefix
    but its last token, the teacher's last hidden states on the continuation."""
    return (shapes.replicated((rows, prefix + cont), jnp.int32, b.mesh), b.cache("source", rows, prefix - 1),
            shapes.replicated((rows, cont, b.source.cfg.hidden_size), b.dtype, b.mesh))


def pool_program(b: Builder, prefix: int, cont: int, teacher: str, name: str) -> Program:
    """teacher_pool._pool_batch over pool_of's batches of 8 windows."""
    from kvjax.fitting.teacher_pool import _pool_batch
    (scfg, sparams), (tcfg, tparams) = b.source, b.target
    rows, window = 8, prefix + cont
    args = (sparams, tparams, scfg, tcfg, shapes.replicated((rows, window), jnp.int32, b.mesh))
    flops = b.fwd("source", rows, window - 1, window / 2, 0)
    moved = b.wbytes("source", rows * window, False)
    return b.program(f"{name} {rows} x {window}", _pool_batch, args, dict(prefix=prefix, teacher=teacher), flops,
                     moved, ("source", "target"))


def perhead(b: Builder, cfg) -> list[Program]:
    (scfg, _), (tcfg, _) = b.source, b.target
    every = tuple(range(scfg.num_layers))
    # fit_perhead collects its statistics without a mesh: the one-device program, on the first device
    return [stats_program(b, (every,) * tcfg.num_layers, cfg.map.batch_size, cfg.map.window_len, "per-head ridge",
                          sharded=False)]

"""The server's programs (kvjax.serve) for a config on a slice: what `python -m kvjax.serve` compiles, at its slot
count and context, with the models and the slots' cache sharded over the slice as the job shards them.

The engine's programs (kvjax.serve.programs, kvjax.serve.prefill): a prefill batch read whole (the split path's
builder: the source's prefill and the map, at each prefill bucket and batch size), read in pieces after a cached
prefix or between decode steps (the builder's `resume`: the source's prefill over its cache, then the map of the new
span), its insertion into free slots, and the decode step at each row count. The stages of a server plan group them
by what runs when: prefill, pieces, insert, decode.

`capacity_table` answers "how many slots of how much context": per context, the most slots whose cache fits beside
both models' weights and a prefill batch, from the shapes; the plan then compiles the server at one (slots,
context) to check it with XLA.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from kvjax.plan import costs, shapes
from kvjax.plan.hardware import PlanError, get_slice
from kvjax.plan.program import Program
from kvjax.plan.programs import Builder
from kvjax.plan.report import Plan

CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
SLOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def engine_config(slots: int, context: int, prefix: bool = True, max_step_tokens: int = 0):
    """The engine settings a server plan compiles: `slots` rows of `context` positions, the prefix cache on (the
    conversation workload's setting) and chunked prefill when `max_step_tokens`."""
    from kvjax.serve.config import EngineConfig
    return EngineConfig(slots=slots, capacity=context, prefix_cache_mb=1024.0 if prefix else 0.0,
                        max_step_tokens=max_step_tokens)


def server_programs(b: Builder, ec, split: bool = True) -> dict[str, list[Program]]:
    from kvjax.serve import programs as sp
    from kvjax.serve import prefill as pf
    (scfg, _), (tcfg, tparams) = b.source, b.target
    kvmap = shapes.kvmap(scfg, tcfg, b.mesh) if split else None
    buckets = sp.buckets(ec.capacity)
    batches = sorted({sp.batch_size_for(n, ec.max_prefill_batch) for n in range(1, ec.max_prefill_batch + 1)})
    out: dict[str, list[Program]] = {"prefill": [], "pieces": [], "insert": [], "decode": []}
    pb = b.at("prefill")
    # the engine reads every text prompt through a PrefillJob when it caches prefixes or chunks prefills
    # (Engine._pieces): an empty state (`start`), then the prompt as one fresh piece over it
    pieced = bool(ec.prefix_cache_mb or ec.max_step_tokens)
    builder = sp.prefill_builder(b.source if split else None, b.target, kvmap, split) if pieced else None
    for bs in batches:
        for bucket in buckets:
            who = "source" if split else "target"
            if pieced:
                state = shapes.nbytes_per_device(jax.eval_shape(lambda: builder.start(bs, bucket)))
                out["prefill"] += [pb.program(f"empty state {bs} x {bucket}", pf._start, (builder, bs, bucket), {},
                                              0.0, state, ()),
                                   pb.prefill(who, bs, bucket, bucket, cache=True, what="prefill piece")]
                if split:
                    out["prefill"].append(pb.map_span(kvmap, bs, bucket, bucket))
            elif split:
                out["prefill"] += [pb.prefill("source", bs, bucket, bucket),
                                   pb.apply_map(kvmap, bs, bucket, bucket)]
            else:
                out["prefill"].append(pb.prefill("target", bs, bucket, bucket))
    if split and b.mesh.devices.flat[0].platform == "tpu":
        # the map by the Pallas map-and-insert kernel (impl="pallas"; kvjax.kernels.map_insert), at the largest
        # prefill: Mosaic's own verdict on the real shapes, beside the XLA map the server runs by default
        out["prefill"].append(pb.apply_map(kvmap, batches[-1], buckets[-1], buckets[-1], impl="pallas"))
    if split and (ec.prefix_cache_mb or ec.max_step_tokens):
        kb = b.at("pieces")
        bs = batches[-1]
        for bucket in (buckets[-1],):
            for width, fresh in sorted(pf.pieces(bucket, bs, bool(ec.prefix_cache_mb), ec.max_step_tokens)):
                if fresh and width == bucket:
                    continue  # the whole prompt at once: the prefill stage's programs
                out["pieces"] += [kb.prefill("source", bs, width, bucket, cache=True, context=bucket - width,
                                             what="prefill piece"),
                                  kb.map_span(kvmap, bs, width, bucket)]
    ib = b.at("insert")
    slots = b.cache("target", ec.slots, ec.capacity, keys_transposed=True)
    held = shapes.nbytes_per_device(slots)  # the slots' cache lives as long as the server: held by every stage
    for bs in batches:
        new = b.cache("target", bs, buckets[-1])
        moved = 2 * b.kv_share("target", bs) * costs.kv_bytes(tcfg, bs, buckets[-1], b.itemsize())
        out["insert"].append(ib.program(f"insert {bs} prompts of {buckets[-1]} into {ec.slots} slots", sp.insert,
                                        (slots, new, b.rows(bs)), {}, 0.0, moved, ("slots",),
                                        extra_weights=held))
    db = b.at("decode")
    for rows in sp.row_buckets(ec.slots):
        f32 = lambda n: b.rows(n, jnp.float32)  # noqa: E731
        args = (tparams, tcfg, slots, b.rows(ec.slots), b.rows(ec.slots, jnp.bool_), f32(ec.slots), f32(ec.slots),
                b.rows(ec.slots), b.rows(ec.slots))
        flops = b.fwd("target", rows, 1, ec.capacity, 1)
        moved = (b.wbytes("target", rows)
                 + b.kv_share("target", ec.slots) * costs.kv_bytes(tcfg, rows, ec.capacity, b.itemsize()))
        out["decode"].append(db.program(f"decode step {rows} of {ec.slots} slots x {ec.capacity}", sp.step, args,
                                        dict(rows=rows), flops, moved, ("target", "slots"), extra_weights=held))
    return out


def capacity_table(b: Builder, max_prefill_batch: int = 8, split: bool = True) -> dict[int, int]:
    """context -> the most slots (of SLOTS) whose cache fits per device beside both models' weights and the largest
    prefill batch's caches (from the shapes; XLA's temporaries not counted)."""
    weights = b.weights("target") + (b.weights("source") if split else 0)
    hbm = b.mesh_memory
    out = {}
    for context in CONTEXTS:
        prefill = shapes.nbytes_per_device(b.cache("source", max_prefill_batch, context)) * split \
            + shapes.nbytes_per_device(b.cache("target", max_prefill_batch, context))
        best = 0
        for s in SLOTS:
            if weights + prefill + shapes.nbytes_per_device(b.cache("target", s, context)) <= hbm:
                best = s
        out[context] = best
    return out


def serve_stages(cfg, slice_name: str, cpu_memory_gb: float, slots: int, context: int, split: bool, depths):
    """The server's stages for a slice by name (what a compile worker rebuilds)."""
    from kvjax.plan import job
    sl = get_slice(slice_name, cpu_memory_gb)
    b = dataclasses.replace(job.pair(cfg, sl, depths), mesh_memory=sl.hbm_bytes)
    return server_programs(b, engine_config(slots, context), split)


def plan_serve(cfg, slice_name: str, slots: int = 0, context: int = 0, compile: bool = True,
               cpu_memory_gb: float = 16.0, split: bool = True, sampled: bool = False, jobs: int = 1,
               peaks: int = 0, store: str | None = None) -> Plan:
    """The server of `cfg` on a slice: the capacity table, and every engine program at (slots, context) compiled
    (default: 128 slots — the conversation workload's 128 clients — at the longest context that holds them)."""
    from kvjax.plan import compile_all, extrapolate, job, sample_depths
    t0 = time.perf_counter()
    sl = get_slice(slice_name, cpu_memory_gb)
    b = job.pair(cfg, sl)
    b = dataclasses.replace(b, mesh_memory=sl.hbm_bytes)
    table = capacity_table(b, split=split)
    slots = slots or 128
    if not context:
        fitting = [c for c, s in table.items() if s >= slots]
        context = max(fitting) if fitting else CONTEXTS[0]
    if context < 64 or slots < 1:
        raise PlanError(f"--slots={slots} --context={context}: need at least one slot of at least 64 tokens")
    ec = engine_config(slots, context)
    stages = server_programs(b, ec, split)
    slots_bytes = shapes.nbytes_per_device(b.cache("target", ec.slots, ec.capacity, keys_transposed=True))
    held = {"target": b.weights("target"), **({"source": b.weights("source")} if split else {}),
            "slots": slots_bytes}
    held_by = {name: held for name in stages}
    rebuild = lambda d: (serve_stages, (cfg, slice_name, cpu_memory_gb, slots, context, split, d))  # noqa: E731
    if sampled and compile:
        real = job.depths(cfg)
        points = sample_depths(real)
        runs = [serve_stages(cfg, slice_name, cpu_memory_gb, slots, context, split, d) for d in points]
        plans = extrapolate(stages, held_by, runs, points, real, jobs, [rebuild(d) for d in points], peaks, store)
    else:
        plans = compile_all(stages, held_by, compile, jobs, rebuild(None), peaks, store)
    plan = Plan(cfg.name, "serve", sl, plans, b.sources, dict(b.mesh.shape), time.perf_counter() - t0)
    plan.notes = {"slots": slots, "context": context, "capacity_table": table}
    if peaks:
        plan.notes["compiled"] = f"each stage's {peaks} largest programs by shape; the others left out"
    return plan

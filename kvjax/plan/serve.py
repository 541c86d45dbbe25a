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


def engine_config(slots: int, context: int, prefix: bool = True, max_step_tokens: int = 0, **drafting):
    """The engine settings a server plan compiles: `slots` rows of `context` positions, the prefix cache on (the
    conversation workload's setting), chunked prefill when `max_step_tokens`, and speculative decoding as `drafting`
    sets it (EngineConfig's speculative, draft_len, drafter, ...; default off)."""
    from kvjax.serve.config import EngineConfig
    return EngineConfig(slots=slots, capacity=context, prefix_cache_mb=1024.0 if prefix else 0.0,
                        max_step_tokens=max_step_tokens, **drafting)


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
    if ec.drafting:
        for stage, progs in drafting_programs(b, ec, slots, held).items():
            out[stage] += progs
        return out
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


def drafter(b: Builder, ec):
    """The speculating engine's drafter (kvjax.serve.drafting.build_drafter), abstract and replicated as the engine
    places it: prompt lookup holds no arrays; the block drafter's shapes are read from its directory's manifest and
    weights header (kvjax.drafter.io.drafter_shapes), never its weights."""
    from kvjax.serve.drafting import build_drafter
    tcfg, tparams = b.target
    block = None
    if ec.speculative in ("block", "combined"):
        from kvjax.drafter.block import block_drafter
        from kvjax.drafter.io import DrafterError, drafter_shapes
        try:
            dcfg, dparams = drafter_shapes(ec.drafter, tcfg)
            block = jax.eval_shape(lambda tp, dp: block_drafter((tcfg, tp), dcfg, dp, ec.rounds_draft,
                                                                refine=ec.draft_refine), tparams, dparams)
        except DrafterError as e:
            raise PlanError(str(e)) from None
        except ValueError as e:  # a block size it was not trained for, an unreadable weights header
            raise PlanError(f"{ec.drafter}: {e}") from None
    return _replicated(b, build_drafter(ec, b.target, block))


def drafter_state(b: Builder, ec, drafter, rows: int, bucket: int = 0):
    """The drafter state (kvjax.serve.drafting.start_state) of `rows` rows, abstract and replicated as the engine
    places it: of a batch prefilled to `bucket` positions, or (0) the slots' empty state."""
    from kvjax.serve.drafting import start_state
    tcfg, tparams = b.target
    cache = b.cache("target", rows, bucket) if bucket else None
    state = jax.eval_shape(lambda d, p, c: start_state(d, ec, (tcfg, p), [], rows, c), drafter, tparams, cache)
    return _replicated(b, state)


def _replicated(b: Builder, tree):
    return jax.tree.map(lambda x: shapes.replicated(x.shape, x.dtype, b.mesh), tree)


def drafting_held(b: Builder, ec) -> dict[str, int]:
    """Bytes per device a speculating server holds beside the models and the slots' cache: the drafter (the block
    drafter's weights, with its copies of the target's embedding and head rows) and the slots' drafter state."""
    d = drafter(b, ec)
    return {"drafter": shapes.nbytes_per_device(d),
            "drafter state": shapes.nbytes_per_device(drafter_state(b, ec, d, ec.slots))}


def drafting_programs(b: Builder, ec, slots, held: int) -> dict[str, list[Program]]:
    """The programs of a speculating engine (kvjax.serve.drafting) past its prefill and cache insertion, at the
    shapes it calls them: the block drafter's start (prefill: the target's features of each prompt's last tokens over
    the prefilled cache, then the drafter's context of them; and the slots' empty state), the new rows' drafter
    state written into the slots' (insert), and per decode row count a plain step and a verify round at every width
    of `verify_widths` greedy, at the widest sampled, as the engine warms them up (decode; it runs no `step`)."""
    from kvjax.serve import drafting as dr
    from kvjax.serve import programs as sp
    from kvjax.speculative import CombinedDrafter
    tcfg, tparams = b.target
    d = drafter(b, ec)
    state = drafter_state(b, ec, d, ec.slots)
    dbytes, sbytes = shapes.nbytes_per_device(d), shapes.nbytes_per_device(state)  # held: not a program's own
    buckets = sp.buckets(ec.capacity)
    batches = sorted({sp.batch_size_for(n, ec.max_prefill_batch) for n in range(1, ec.max_prefill_batch + 1)})
    out: dict[str, list[Program]] = {"prefill": [], "insert": [], "decode": []}
    layers = tuple(d.feature_layers)
    if layers:  # the block drafter reads the target's features: its context starts from the prefilled cache
        block = d.model if isinstance(d, CombinedDrafter) else d
        dcfg, dparams = block.dcfg, block.params
        pb = b.at("prefill")
        fsize = dcfg.feature_size

        def extend(rows: int, width: int, dtype, name: str) -> Program:
            from kvjax.drafter.block import _extend_jit
            from kvjax.drafter.model import init_context
            context = jax.eval_shape(lambda: init_context(dcfg, rows, ec.capacity, dparams.fc.dtype))
            args = (dparams, dcfg, _replicated(b, context), shapes.replicated((rows, width, fsize), dtype, b.mesh),
                    shapes.replicated((rows,), jnp.int32, b.mesh))
            flops = costs.forward_flops(dcfg.layer, rows, width, 0, 0)  # the drafter's K/V of each feature
            return pb.program(name, _extend_jit, args, {}, flops, shapes.nbytes_per_device(args[2:]), ("drafter",),
                              extra_weights=shapes.nbytes_per_device(dparams))

        out["prefill"].append(extend(ec.slots, 1, dparams.fc.dtype, f"drafter empty state of {ec.slots} slots"))
        for bs in batches:
            widths = set()
            for bucket in buckets:
                width = dr.context_width(ec, bucket)
                args = (tparams, tcfg, b.cache("target", bs, bucket), b.tokens(bs, width), b.rows(bs))
                feats = sp.context_features.eval_shape(*args, layers=layers)
                moved = (b.wbytes("target", bs * width, False)
                         + b.kv_share("target", bs) * costs.kv_bytes(tcfg, bs, bucket, b.itemsize()))
                out["prefill"].append(pb.program(f"drafter context {bs} x {width} after prefill {bucket}",
                                                 sp.context_features, args, dict(layers=layers),
                                                 b.fwd("target", bs, width, bucket, 0), moved, ("target",)))
                if width not in widths:
                    widths.add(width)
                    out["prefill"].append(extend(bs, width, feats.dtype, f"drafter start {bs} x {width}"))
    ib = b.at("insert")
    for bs in batches:
        new = drafter_state(b, ec, d, bs, buckets[-1])
        moved = 2 * shapes.nbytes_per_device(new)
        out["insert"] += [
            ib.program(f"new rows' drafts {bs}", sp.new_rows_lookahead,
                       (d, new, shapes.replicated((bs,), jnp.int32, b.mesh),
                        shapes.replicated((bs,), jnp.bool_, b.mesh)), {}, 0.0, moved, ("drafter",),
                       extra_weights=dbytes),
            ib.program(f"insert {bs} drafter states into {ec.slots} slots", sp.insert_rows,
                       (state, new, b.rows(bs)), {}, 0.0, moved, ("drafter state",), extra_weights=sbytes)]
    db = b.at("decode")
    rparams = round_params(b)
    g = d.draft_len
    extra = held + dbytes + sbytes

    def draft_flops(rows: int, sampled: bool) -> float:
        """The block drafter's forward of a round (g + 1 positions over its context; a greedy round refines it),
        priced at the target's vocabulary (its head may read fewer rows): at most."""
        if not layers:
            return 0.0
        return costs.forward_flops(dcfg.layer, rows, g + 1, ec.capacity, g) * (1 + (0 if sampled else ec.draft_refine))

    f32 = lambda n: b.rows(n, jnp.float32)  # noqa: E731
    inputs = (b.rows(ec.slots), b.rows(ec.slots, jnp.bool_), f32(ec.slots), f32(ec.slots), b.rows(ec.slots),
              b.rows(ec.slots))
    for rows in sp.row_buckets(ec.slots):
        kv = b.kv_share("target", ec.slots) * costs.kv_bytes(tcfg, rows, ec.capacity, b.itemsize())
        out["decode"].append(db.program(
            f"plain step {rows} of {ec.slots} slots x {ec.capacity}", sp.plain_step,
            (tparams, tcfg, slots, d, state) + inputs, dict(rows=rows), b.fwd("target", rows, 1, ec.capacity, 1),
            b.wbytes("target", rows) + kv, ("target", "slots"), extra_weights=extra))
        widths = dr.verify_widths(g)
        for width, sampled in [(w, False) for w in widths] + [(widths[-1], True)]:
            out["decode"].append(db.program(
                f"verify round {rows} of {ec.slots} slots x {ec.capacity} width {width}"
                + (" sampled" if sampled else ""), sp.round_step,
                (rparams, tcfg, slots, d, state) + inputs + (shapes.replicated((), jnp.int32, b.mesh),),
                dict(rows=rows, sampled=sampled, width=width),
                b.fwd("target", rows, width, ec.capacity, width) + draft_flops(rows, sampled),
                b.wbytes("target", rows * width) + kv, ("target", "slots"), extra_weights=extra))
    return out


def round_params(b: Builder):
    """The target's weights as the verify round reads them (kvjax.speculative.api.loop_verifier: on CPU a tied head
    gets an explicit [D, V] copy, replicated here; elsewhere the target's own)."""
    from kvjax.models.model import Model
    from kvjax.speculative.api import loop_verifier
    tcfg, tparams = b.target
    if b.mesh.devices.flat[0].platform != "cpu" or tparams.lm_head is not None:
        return tparams
    head = jax.eval_shape(lambda p: loop_verifier(Model(tcfg, p)).params.lm_head, tparams)
    return tparams.replace(lm_head=shapes.replicated(head.shape, head.dtype, b.mesh))


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


def serve_stages(cfg, slice_name: str, cpu_memory_gb: float, slots: int, context: int, split: bool, depths,
                 drafting: dict | None = None):
    """The server's stages for a slice by name (what a compile worker rebuilds)."""
    from kvjax.plan import job
    sl = get_slice(slice_name, cpu_memory_gb)
    b = dataclasses.replace(job.pair(cfg, sl, depths), mesh_memory=sl.hbm_bytes)
    return server_programs(b, engine_config(slots, context, **(drafting or {})), split)


def plan_serve(cfg, slice_name: str, slots: int = 0, context: int = 0, compile: bool = True,
               cpu_memory_gb: float = 16.0, split: bool = True, sampled: bool = False, jobs: int = 1,
               peaks: int = 0, store: str | None = None, speculative: str = "none", draft_len: int = 0,
               drafter: str = "") -> Plan:
    """The server of `cfg` on a slice: the capacity table, and every engine program at (slots, context) compiled
    (default: 128 slots — the conversation workload's 128 clients — at the longest context that holds them).
    `speculative` (lookup, block, combined; `draft_len`, and the block drafter's directory `drafter`): the server
    speculates (kvjax.serve.drafting), and the plan holds its drafter's programs and its decode rounds."""
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
    drafting = dict(speculative=speculative, draft_len=draft_len, drafter=drafter)
    ec = engine_config(slots, context, **drafting)
    if problems := ec.draft_problems():
        raise PlanError(problems[0])
    if sampled and compile and ec.speculative in ("block", "combined"):
        raise PlanError(f"--speculative={ec.speculative}: the block drafter reads the target's own layers, so it is "
                        "planned at the target's depth: leave out --depth=sampled")
    stages = server_programs(b, ec, split)
    slots_bytes = shapes.nbytes_per_device(b.cache("target", ec.slots, ec.capacity, keys_transposed=True))
    held = {"target": b.weights("target"), **({"source": b.weights("source")} if split else {}),
            "slots": slots_bytes, **(drafting_held(b, ec) if ec.drafting else {})}
    held_by = {name: held for name in stages}
    rebuild = lambda d: (serve_stages, (cfg, slice_name, cpu_memory_gb, slots, context, split, d,  # noqa: E731
                                        drafting))
    if sampled and compile:
        real = job.depths(cfg)
        points = sample_depths(real)
        runs = [serve_stages(cfg, slice_name, cpu_memory_gb, slots, context, split, d, drafting) for d in points]
        plans = extrapolate(stages, held_by, runs, points, real, jobs, [rebuild(d) for d in points], peaks, store)
    else:
        plans = compile_all(stages, held_by, compile, jobs, rebuild(None), peaks, store)
    plan = Plan(cfg.name, "serve", sl, plans, b.sources, dict(b.mesh.shape), time.perf_counter() - t0)
    plan.notes = {"slots": slots, "context": context, "capacity_table": table,
                  **({"speculative": ec.speculative, "draft_len": ec.rounds_draft} if ec.drafting else {})}
    if peaks:
        plan.notes["compiled"] = f"each stage's {peaks} largest programs by shape; the others left out"
    return plan

"""Compile-only plans: every program the main job and the server run, compiled ahead of time for a TPU slice (or
CPU devices) from this machine, with no weights and no accelerator; fitted against the slice's HBM and priced at
its peak FLOP/s and bandwidth.

    python -m kvjax.plan --config=qwen32_8 --topology=v5e:2x4           # the job, one slice
    python -m kvjax.plan --config=qwen32_8 --topology=v5e,v6e,v5p        # the smallest slice of each generation
    python -m kvjax.plan --config=qwen32_8 --serve --topology=v5e:2x4    # the server: slots x context that fit

Pieces: kvjax.plan.hardware (chips and slices), .shapes (abstract models, caches, maps), .programs (one builder per
library program), .fitting / .evals / .job (the job's stages), .serve (the server), .report (tables, JSON, chart),
.check (the fit check the job and the server run before reading weights).
"""

from __future__ import annotations

import time

from kvjax.plan.hardware import PlanError, Slice, compile_only_environment, get_slice, ladder  # noqa: F401  (the API)
from kvjax.plan.report import Plan, StagePlan


COMPILED = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "xla_flops", "xla_bytes",
            "error", "lower_seconds", "compile_seconds", "compiled")


def peak_candidates(stages: dict, n: int) -> set:
    """The (stage, program) indices of each stage's `n` programs with the most bytes beside the weights by their
    shapes (inputs other than weights, and what the stage keeps beside them), and its `n` with the most FLOPs: the
    ones that set its peak. Both, because XLA's temporaries follow the computation, not the inputs: a KL over the
    vocabulary of a few windows takes 0.1 MB of inputs and 109 MB of temporaries (tests/test_plan.py)."""
    from kvjax.plan import shapes
    out = set()
    for i, progs in enumerate(stages.values()):
        size = [(shapes.nbytes_per_device((p.args, p.kwargs)) - p.weight_bytes + p.kept_bytes, j)
                for j, p in enumerate(progs)]
        flops = [(p.flops, j) for j, p in enumerate(progs)]
        out |= {(i, j) for _, j in sorted(size, reverse=True)[:n]}
        out |= {(i, j) for _, j in sorted(flops, reverse=True)[:n]}
    return out


def compile_all(stages: dict, held: dict, compile: bool = True, jobs: int = 1, rebuild=None,
                peaks: int = 0, store: str | None = None, chosen: set | None = None) -> list[StagePlan]:
    """Compile every stage's programs (one compile per distinct program: a later stage calling the same program
    at the same shapes reuses it) into StagePlans. `held`: stage -> {model: weight bytes per device}. Without
    `compile`, the programs are lowered only (no memory or cost analysis; a quick check that they build).

    `jobs` > 1 compiles the distinct programs in that many worker processes, each rebuilding the same programs with
    `rebuild` (a picklable (function, args) whose call returns `stages` again: the programs themselves, holding
    device handles, do not travel); XLA compiles one program on one core, so this is what more cores buy.

    `peaks` > 0 compiles only each stage's `peaks` largest programs by their shapes (`peak_candidates`) and leaves
    the others out: the stage peaks in a fraction of the time (docs/planning.md measures how close).

    `store`: a folder keeping each compiled program's result (kvjax.plan.store), so that a plan stopped halfway
    resumes: a program found there is not compiled again. `chosen`: the (stage, program) indices to compile, the
    others left out (what `peaks` picks, given)."""
    from kvjax.plan import store as kept
    from kvjax.plan.program import Compiled, compile_program
    from tqdm import tqdm
    first: dict = {}  # key -> (stage index, program index) of its first occurrence
    for i, progs in enumerate(stages.values()):
        for j, p in enumerate(progs):
            first.setdefault(p.key(), (i, j))
    chosen = peak_candidates(stages, peaks) if peaks else chosen
    wanted = lambda i, j: compile and (chosen is None or (i, j) in chosen)  # noqa: E731
    results: dict = {}
    skipped = lambda i, j: chosen is not None and (i, j) not in chosen  # noqa: E731
    flat = list(stages.values())
    for i, j in first.values():
        if wanted(i, j) and (fields := kept.get(store, flat[i][j])) is not None:
            results[(i, j)] = {f: fields[f] for f in COMPILED}
    todo = [(i, j, wanted(i, j)) for i, j in sorted(first.values()) if not skipped(i, j) and (i, j) not in results]
    if jobs > 1 and rebuild is not None and len(todo) > 1:
        results |= _compile_in_workers(todo, jobs, rebuild, store)
    done: dict = {}
    out = []
    total = sum(len(ps) for ps in stages.values())
    with tqdm(total=total, desc="compile", unit="program", leave=False, disable=None) as bar:
        for i, (name, progs) in enumerate(stages.items()):
            compiled = []
            for j, p in enumerate(progs):
                key = p.key()
                if key in done:
                    c = Compiled(p, **{f: getattr(done[key], f) for f in COMPILED if "seconds" not in f}, reused=True)
                elif (i, j) in results:
                    c = done[key] = Compiled(p, **results[(i, j)])
                elif skipped(i, j):
                    c = Compiled(p)  # left out (peaks): neither lowered nor compiled
                else:
                    c = done[key] = compile_program(p, compile=wanted(i, j))
                    kept.put(store, p, {f: getattr(c, f) for f in kept.FIELDS})
                    _progress(bar, c)
                compiled.append(c)
                bar.set_postfix_str(p.name[:40])
                bar.update()
            out.append(StagePlan(name, held.get(name, {}), compiled))
    return out


def _compile_in_workers(where: list, jobs: int, rebuild, store: str | None = None) -> dict:
    import concurrent.futures
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")  # JAX is not fork-safe
    # compiles first, spread evenly: they are what takes the time
    order = sorted(where, key=lambda w: not w[2])
    parts = [order[w::jobs] for w in range(jobs)]
    out = {}
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        for part in pool.map(_worker, [(rebuild, part, store) for part in parts if part]):
            out.update(part)
    return out


def _worker(task) -> dict:
    """In a fresh process: rebuild the stages, compile the programs at the given (stage, program) indices."""
    (fn, args), where, store = task
    compile_only_environment()
    from kvjax.plan import store as kept
    from kvjax.plan.program import compile_program
    stages = list(fn(*args).values())
    out = {}
    for i, j, compile in where:
        c = compile_program(stages[i][j], compile)
        kept.put(store, stages[i][j], {f: getattr(c, f) for f in kept.FIELDS})  # kept at once: a killed run resumes
        _progress(None, c)
        out[(i, j)] = {f: getattr(c, f) for f in COMPILED}
    return out


def _progress(bar, c) -> None:
    """One line per compiled program where no progress bar shows (a log file, a worker)."""
    if bar is None or bar.disable:
        import sys
        print(f"{'compiled' if c.compiled else 'lowered'} {c.program.stage}: {c.program.name} in "
              f"{c.lower_seconds + c.compile_seconds:.1f} s"
              f"{' (refused: ' + c.error + ')' if c.error else ''}", file=sys.stderr, flush=True)


def _models_only(rebuild) -> dict:
    """A rebuilt `stages` with the programs that run a model only (extrapolate's sampled compiles)."""
    fn, args = rebuild
    return {k: [p for p in ps if set(p.holds) & {"source", "target"}] for k, ps in fn(*args).items()}


def job_stages(cfg, slice_name: str, cpu_memory_gb: float, only: tuple, depths):
    """The job's stages for a slice by name (what a compile worker rebuilds)."""
    from kvjax.plan import job
    return job.stage_programs(cfg, get_slice(slice_name, cpu_memory_gb), only, depths)[1]


def plan_job(cfg, slice_name: str, compile: bool = True, only: tuple[str, ...] = (),
             cpu_memory_gb: float = 16.0, sampled: bool = False, jobs: int = 1, peaks: int = 0,
             store: str | None = None) -> Plan:
    """The main job of `cfg` (a RunConfig) on a slice: every stage's programs compiled, fitted and priced.
    `sampled`: compile each program at reduced depths and extrapolate its memory and XLA counts to the models' own
    depth (`extrapolate`: a program's buffers are per-layer buffers times the layers plus the rest, and unrolled
    layers make compile time grow with depth: a 32B pair's full programs take hours to compile on a small machine)."""
    from kvjax.plan import job
    t0 = time.perf_counter()
    sl = get_slice(slice_name, cpu_memory_gb)
    b, stages = job.stage_programs(cfg, sl, only)
    weights = {"source": b.weights("source"), "target": b.weights("target")}
    held = {name: (weights if progs else {}) for name, progs in stages.items()}
    if sampled and compile:
        real = job.depths(cfg)
        points = sample_depths(real, cfg)
        plans = extrapolate(stages, held, [job.stage_programs(cfg, sl, only, d)[1] for d in points], points, real,
                            jobs=jobs, rebuild=[(job_stages, (cfg, slice_name, cpu_memory_gb, only, d)) for d in points],
                            peaks=peaks, store=store)
    else:
        plans = compile_all(stages, held, compile, jobs, (job_stages, (cfg, slice_name, cpu_memory_gb, only, None)),
                            peaks, store)
    plan = Plan(cfg.name, "job", sl, plans, b.sources, dict(b.mesh.shape), time.perf_counter() - t0)
    plan.notes["compiled_at"] = "sampled depths" if sampled and compile else "full depth"
    if peaks:
        plan.notes["compiled"] = f"each stage's {peaks} largest programs by shape; the others left out"
    return plan


FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "code_bytes", "xla_flops", "xla_bytes")
# (programs whose memory is fitted on sampled depths: the arguments, outputs and aliases are per-layer buffers times
# the layers plus the rest, exactly; the temporaries follow XLA's buffer reuse, so the fit never goes below a sample)


def sample_depths(real: tuple[int, int], cfg=None) -> list[tuple[int, int]]:
    """Three (source, target) depths that pin a + b_s L_s + b_t L_t: (a, a), (a + 2, a), (a, a + 2), with a the
    fewest layers the config's pairing needs (2, or K of a topK pairing)."""
    a = 2
    if cfg is not None and cfg.map.pairing.startswith("top"):
        a = max(a, int(cfg.map.pairing[3:]))
    return [(min(a, real[0]), min(a, real[1])), (min(a + 2, real[0]), min(a, real[1])),
            (min(a, real[0]), min(a + 2, real[1]))]


def extrapolate(stages: dict, held: dict, sampled: list[dict], points: list[tuple[int, int]],
                real: tuple[int, int], jobs: int = 1, rebuild=None, peaks: int = 0,
                store: str | None = None) -> list[StagePlan]:
    """StagePlans of the full-depth `stages` whose compiled figures are fitted, program by program, on the same
    programs compiled at the depths of `sampled` (three dicts as `stages`, from sample_depths): each field is
    c + b_s L_s + b_t L_t, solved from the three compiles and evaluated at the real depths `real`. `peaks` > 0:
    only each stage's `peaks` largest programs at full depth (peak_candidates), the others left out."""
    import numpy as np
    from kvjax.plan.program import Compiled
    from kvjax.plan.program import compile_program
    models = ("source", "target")
    runs_models = lambda p: bool(set(p.holds) & set(models))  # noqa: E731
    picked = peak_candidates(stages, peaks) if peaks else None
    # the same choice among each stage's model programs, by their place in the sampled stages (models only)
    sampled_pick = None if picked is None else {
        (i, k) for i, progs in enumerate(stages.values())
        for k, j in enumerate(j for j, p in enumerate(progs) if runs_models(p)) if (i, j) in picked}
    # a program that runs neither model (the map, an insert, a comparison) compiles in seconds at full depth: only
    # the models' forwards are sampled
    runs = [compile_all({k: [p for p in ps if runs_models(p)] for k, ps in s.items()}, held, True, jobs,
                        None if rebuild is None else (_models_only, (rebuild[n],)), store=store,
                        chosen=sampled_pick)
            for n, s in enumerate(sampled)]
    x = np.array([[1.0, ds, dt] for ds, dt in points])
    target = np.array([1.0, real[0], real[1]])
    out = []
    full: dict = {}
    for i, (name, progs) in enumerate(stages.items()):
        compiled = []
        k = 0
        for j, p in enumerate(progs):
            if picked is not None and (i, j) not in picked:
                k += runs_models(p)
                compiled.append(Compiled(p))  # left out (peaks)
                continue
            if not runs_models(p):
                key = p.key()
                if key not in full:
                    from kvjax.plan import store as kept
                    if (fields := kept.get(store, p)) is not None:
                        full[key] = Compiled(p, **{f: fields[f] for f in COMPILED})
                    else:
                        full[key] = compile_program(p)
                        kept.put(store, p, {f: getattr(full[key], f) for f in kept.FIELDS})
                c = full[key]
                compiled.append(Compiled(p, **{f: getattr(c, f) for f in FIELDS + ("error", "lower_seconds",
                                                                                    "compile_seconds")}))
                continue
            got = [run[i].programs[k] for run in runs]
            k += 1
            errors = [c.error for c in got if c.error]
            if errors:
                compiled.append(Compiled(p, error=errors[0]))
                continue
            fit = {}
            for f in FIELDS:
                y = np.array([getattr(c, f) for c in got], np.float64)
                coef = np.linalg.lstsq(x, y, rcond=None)[0]
                fit[f] = max(0.0, float(target @ coef))
                if f == "temp_bytes":  # scratch need not grow with depth (XLA reuses it): never below a sample's
                    fit[f] = max(fit[f], float(y.max()))
            c = Compiled(p, **{f: (int(v) if f.endswith("bytes") and f != "xla_bytes" else v) for f, v in fit.items()})
            c.lower_seconds = sum(g.lower_seconds for g in got)
            c.compile_seconds = sum(g.compile_seconds for g in got)
            c.reused = all(g.reused for g in got)
            compiled.append(c)
        out.append(StagePlan(name, held.get(name, {}), compiled))
    return out

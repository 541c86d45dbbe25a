"""`python -m kvjax.plan --config=NAME --topology=SLICE[,SLICE...] [--serve] [--config.FIELD=VALUE ...]`

Compiles every program the main job (or, with --serve, the server) runs for the config, for each named TPU slice,
from this machine: no weights, no accelerator (the TPU compiler comes with `pip install "kvjax[tpu]"`). Writes, per
slice, DIR/NAME[-serve]-SLICE.{md,json,png} (DIR: --out, default runs/plan) and prints one line per slice.

  --topology=v5e:2x4            a slice (v4 / v5e / v5p / v6e; e.g. v6e:4x4, v5p:2x2x2); cpu:N: N CPU devices
  --topology=v5e,v6e            a generation: walk its slices from the smallest and stop at the first that fits
  --serve                       plan the server (kvjax.serve) instead of the job
  --price                       the method's speed claims priced at the pair's shapes on the slice (roofline of
                                each program; no compile): DIR/NAME-priced-SLICE.{md,json}
  --slots=N --context=T         the server's decode slots and context per slot (default: the most that fit)
  --speculative=KIND            the server speculates (lookup, block, combined; kvjax.serve.drafting): its drafter's
                                programs and verify rounds are planned (--draft-len=N: tokens per round, default
                                the drafter's; --drafter=DIR: the block drafter's directory, its shapes read from it)
  --depth=full|sampled          full (default): compile every program as the job runs it; sampled: compile each
                                at three reduced depths and extrapolate its memory and XLA counts to the real
                                depth (minutes instead of hours for a 32B pair on a small machine; docs/planning.md
                                says how close it comes)
  --compile=all|peaks           all (default): every program; peaks: only each stage's two largest programs by
                                their shapes and two heaviest by FLOPs (the stage peaks in a fraction of the time)
  --jobs=N                      compile in N processes (default: the cores, at most 4; each holds a compile of
                                up to 14 GB: a Qwen3-32B prefill of 16K tokens)
  --no-compile                  lower only (seconds instead of minutes; no memory or cost analysis)
  --cpu-memory-gb=G             the memory a cpu:N device stands for (default 16)

Each compiled program's result is kept in DIR/compiled/ as soon as it compiles, so a plan stopped halfway resumes
where it stopped (a result is reused only under the same kvjax source, jax and libtpu; kvjax.plan.store).

Exit status: 0 when every slice asked for fits (for a generation: when one of its slices fits), 1 when one does not,
2 for a mistake in the command.
"""

from __future__ import annotations

import json
import os
import sys

USAGE = __doc__.split("\n\n", 2)[1]


def _error(msg: str, status: int = 2) -> int:
    print(f"kvjax.plan: error: {msg}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    from kvjax.config_flags import ConfigFlagError, available_configs, build, parse_argv
    from kvjax.plan.hardware import CHIPS, PlanError
    from kvjax.run.config import RunConfig
    argv = sys.argv[1:] if argv is None else argv
    opts = {"topology": "", "out": "runs/plan", "serve": False, "compile": True, "slots": 0, "context": 0,
            "cpu_memory_gb": 16.0, "depth": "full", "jobs": min(4, os.cpu_count() or 1), "price": False,
            "peaks": 0, "speculative": "none", "draft_len": 0, "drafter": ""}
    rest = []
    try:
        name, overrides, args = parse_argv(argv)
        for a in args:
            key, _, value = a.partition("=")
            if a in ("-h", "--help"):
                print(__doc__.strip())
                return 0
            if key == "--serve":
                opts["serve"] = True
            elif key == "--price":
                opts["price"] = True
            elif key == "--no-compile":
                opts["compile"] = False
            elif key in ("--topology", "--out"):
                opts[key[2:]] = value
            elif key == "--compile":
                if value not in ("all", "peaks"):
                    raise ConfigFlagError(f"--compile={value}: use all or peaks")
                opts["peaks"] = 2 if value == "peaks" else 0
            elif key == "--depth":
                if value not in ("full", "sampled"):
                    raise ConfigFlagError(f"--depth={value}: use full or sampled")
                opts["depth"] = value
            elif key in ("--slots", "--context", "--jobs"):
                opts[key[2:]] = int(value)
            elif key in ("--speculative", "--drafter"):
                opts[key[2:]] = value
            elif key == "--draft-len":
                opts["draft_len"] = int(value)
            elif key == "--cpu-memory-gb":
                opts["cpu_memory_gb"] = float(value)
            else:
                rest.append(a)
        if rest:
            raise ConfigFlagError(f"unknown argument {rest[0]!r}; the flags are:\n{USAGE}")
        if not name:
            raise ConfigFlagError(f"--config=NAME is required (configs: {', '.join(available_configs())})")
        if opts["speculative"] != "none" or opts["draft_len"] or opts["drafter"]:
            _check_drafting(opts)
        if not opts["topology"]:
            raise ConfigFlagError("--topology=SLICE is required, e.g. --topology=v5e:2x4 or --topology=v5e,v6e,v5p")
        cfg = build(name, overrides, RunConfig)
    except (ConfigFlagError, ValueError) as e:
        return _error(str(e))
    wanted = [t.strip() for t in opts["topology"].split(",") if t.strip()]
    from kvjax.plan import hardware
    try:
        for t in wanted:
            if t not in CHIPS and not t.startswith("cpu:"):
                hardware.parse(t)
    except PlanError as e:
        return _error(str(e))
    hardware.compile_only_environment()  # before JAX starts
    if opts["price"]:
        try:
            return _price(cfg, wanted, opts["out"])
        except PlanError as e:
            return _error(str(e))
    status = 0
    summary: list = []
    for t in wanted:
        try:
            ok = _one(cfg, t, opts, summary)
        except PlanError as e:
            return _error(str(e))
        status = status or (0 if ok else 1)
    if len(summary) > 1:
        _summary(summary, opts["out"], cfg.name + ("-serve" if opts["serve"] else ""))
    return status


def _check_drafting(opts: dict) -> None:
    """The speculative-decoding flags, checked as the server checks them (EngineConfig.draft_problems) before JAX
    starts; the draft length against the context again once the plan has chosen it."""
    from kvjax.config_flags import ConfigFlagError
    from kvjax.serve.config import EngineConfig
    if not opts["serve"]:
        raise ConfigFlagError("--speculative, --draft-len and --drafter set the server's drafter: add --serve")
    ec = EngineConfig(capacity=opts["context"] or EngineConfig.capacity, speculative=opts["speculative"],
                      draft_len=opts["draft_len"], drafter=opts["drafter"])
    if problems := ec.draft_problems():
        raise ConfigFlagError(problems[0])


def _price(cfg, slices: list, out: str) -> int:
    from kvjax.plan import pricing
    from kvjax.plan.hardware import CHIPS, PlanError
    os.makedirs(out, exist_ok=True)
    for name in slices:
        if name in CHIPS or name.startswith("cpu:"):
            raise PlanError(f"--price needs a TPU slice (e.g. {name}:2x4 or v5e:2x4), got {name}")
        t = pricing.price(cfg, name)
        stem = os.path.join(out, f"{cfg.name}-priced-{name.replace(':', '-')}")
        _atomic(stem + ".md", pricing.markdown(t))
        _atomic(stem + ".json", json.dumps(t, indent=1))
        print(f"{cfg.name} priced on {name} -> {stem}.md")
    return 0


def _atomic(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _summary(rows: list, out: str, stem: str) -> None:
    """Every slice tried, in one table (DIR/STEM-summary.md and .json)."""
    lines = [f"# {stem}: the slices tried", "", "| slice | fits | peak GB per device | HBM GB | compile s |",
             "|---|---|---|---|---|"]
    for r in rows:
        if "peak_gb" in r:
            lines.append(f"| {r['slice']} | {'yes' if r['fits'] else 'no'} | {r['peak_gb']:.2f} | {r['hbm_gb']:.0f} | "
                         f"{r['compile_s']:.0f} |")
        else:
            lines.append(f"| {r['slice']} | no ({r['why']}) | | | |")
    path = os.path.join(out, f"{stem}-summary")
    _atomic(path + ".md", "\n".join(lines) + "\n")
    _atomic(path + ".json", json.dumps(rows, indent=1))
    print(f"summary -> {path}.md")


def _one(cfg, topology: str, opts: dict, summary: list) -> bool:
    """Plan one slice, or walk a generation's slices until one fits: a slice whose weights and inputs alone are
    over (kvjax.plan.check, no compile) is skipped; the first that passes is compiled, and the walk goes on while
    the compiled plan does not fit. True when it fits."""
    from kvjax.plan import hardware
    generation = topology in hardware.CHIPS
    candidates = hardware.ladder(topology) if generation else [topology]
    for i, name in enumerate(candidates):
        if generation and not opts["serve"]:
            sl = hardware.get_slice(name)
            from kvjax.plan.check import job_problems
            if problems := job_problems(cfg, sl.devices, sl.hbm_bytes):
                print(f"{cfg.name} on {name}: over before compiling ({problems[0].split(';')[0]})")
                summary.append({"config": cfg.name, "what": "job", "slice": name, "fits": False,
                                "why": problems[0].split(";")[0]})
                continue
        plan = _plan(cfg, name, opts)
        _write(plan, opts["out"])
        summary.append({"config": plan.config, "what": plan.what, "slice": name, "fits": plan.fits(),
                        "peak_gb": max((s.peak_bytes for s in plan.stages), default=0) / 1e9,
                        "hbm_gb": plan.hbm / 1e9, "compile_s": plan.compile_seconds(),
                        "compiled_at": plan.notes.get("compiled_at", "full depth"),
                        **({k: plan.notes[k] for k in ("slots", "context")} if plan.what == "serve" else {})})
        if plan.fits() or i == len(candidates) - 1:
            return plan.fits()
    return False


def _plan(cfg, sl: str, opts: dict):
    from kvjax import plan as kvplan
    store = os.path.join(opts["out"], "compiled")  # each program's result as it compiles: a stopped plan resumes
    if opts["serve"]:
        from kvjax.plan.serve import plan_serve
        return plan_serve(cfg, sl, slots=opts["slots"], context=opts["context"], compile=opts["compile"],
                          cpu_memory_gb=opts["cpu_memory_gb"], sampled=opts["depth"] == "sampled", jobs=opts["jobs"],
                          peaks=opts["peaks"], store=store, speculative=opts["speculative"],
                          draft_len=opts["draft_len"], drafter=opts["drafter"])
    return kvplan.plan_job(cfg, sl, compile=opts["compile"], cpu_memory_gb=opts["cpu_memory_gb"],
                           sampled=opts["depth"] == "sampled", jobs=opts["jobs"], peaks=opts["peaks"], store=store)


def _write(plan, out: str) -> None:
    from kvjax.plan.report import chart, markdown
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"{plan.config}{'-serve' if plan.what == 'serve' else ''}-{plan.slice.name.replace(':', '-')}")
    _atomic(stem + ".md", markdown(plan))
    _atomic(stem + ".json", json.dumps(plan.to_json(), indent=1))
    chart(plan, stem + ".png")
    peak = max((s.peak_bytes for s in plan.stages), default=0)
    print(f"{plan.config} ({plan.what}) on {plan.slice.name}: {'fits' if plan.fits() else 'does NOT fit'} "
          f"(peak {peak / 1e9:.2f} of {plan.hbm / 1e9:.1f} GB per device; {plan.compile_seconds():.0f} s of "
          f"compiles) -> {stem}.md")


if __name__ == "__main__":
    sys.exit(main())

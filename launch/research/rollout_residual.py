"""The rollout-trained residual, measured as seed 004 does: ridge vs ridge + KL residual vs ridge + rollout residual in
32-step rollout divergence.

    python -m launch.research.rollout_residual --run RUN [--steps 400] [--lr 3e-3] [--windows 64] [--n 32]

Reads a main-job run (its config.json for the models, map_ridge/ for the frozen ridge map, data/train_tokens.npy for
the residual's training windows, data/heldout.npy for the frozen held-out windows). Trains two residuals on top of the
same ridge with the same steps, learning rate, batch and data (the run's `residual` settings with --steps / --lr
over them): one on source-teacher KL along the text's own continuation (the main job's residual), one along the
target's own greedy rollout from the mapped cache (`ResidualConfig.rollout`). `--init-from MAP` starts them from a
saved residual of the same ridge (`ResidualConfig.init_from`, e.g. a warm restart with another --seed); `--ema 0.995`
makes each the moving average of its iterates (`ResidualConfig.ema`: a rollout residual's held-out divergence moves
by points from one checkpoint to the next; the average is steadier and lower). Each trains in <out>/kl/ and
<out>/rollout/ (orbax checkpoints: an interrupted command resumes; a finished training is not repeated). Then, on
--windows held-out windows (rows --skip.., the main job's KL windows), the target greedily generates --n tokens from
each map's cache (and, as a reference, from its own prefill: `target`) and the source teacher scores every step
(kvjax.eval.rollout): the mean divergence per map, its per-step curve, each one's paired 95% interval vs the ridge
and the windows it improves. `--extra NAME=DIR` measures more maps beside them (e.g. the run's own residual map). Writes
<out>/rollout_residual.json and prints the table. `--measure-only` refuses to train (the residuals must be finished).
A run without a residual is enough (`--config.residual.steps=0`): only map_ridge/ is read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from kvjax.stages.plan import MAP_DIRS

ARMS = ("ridge", "kl", "rollout")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a `python -m kvjax.launch` run directory with map_ridge/")
    p.add_argument("--out", default="", help="default <run>/rollout_residual")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps of each residual")
    p.add_argument("--lr", type=float, default=0.0, help="peak learning rate (default: the run's residual.lr)")
    p.add_argument("--cont", type=int, default=0,
                   help="continuation tokens per training window (default: the run's residual.cont_len)")
    p.add_argument("--train-batch", type=int, default=0,
                   help="windows per training step (default: the run's residual.batch_size)")
    p.add_argument("--seed", type=int, default=-1, help="training batch order (default: the run's residual.seed)")
    p.add_argument("--init-from", default="",
                   help="a saved map of this run's ridge whose residual training starts from (ResidualConfig."
                        "init_from): e.g. a finished residual continued under a new schedule (with another --seed)")
    p.add_argument("--ema", type=float, default=0.0,
                   help="> 0: each residual is the moving average of its iterates with this decay per step "
                        "(ResidualConfig.ema, e.g. 0.995); 0: the last iterate")
    p.add_argument("--only", choices=ARMS[1:], help="train this residual alone (two commands train both at once)")
    p.add_argument("--windows", type=int, default=64, help="frozen held-out windows measured")
    p.add_argument("--skip", type=int, default=-1,
                   help="held-out rows before them (default: the run's distance windows, i.e. the KL windows)")
    p.add_argument("--prefix", type=int, default=256, help="tokens the source reads and the map translates")
    p.add_argument("--n", type=int, default=32, help="tokens the target generates from the mapped cache")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--extra", nargs="*", default=[],
                   help="more maps to measure beside them, NAME=MAP_DIR (e.g. the run's own map: main=RUN/map)")
    p.add_argument("--cache-metrics", action="store_true",
                   help="also each map's key / value cosine to the native target's cache (the run's distance windows) "
                        "and teacher-forced source KL over --kl-cont tokens (the same windows as the rollouts)")
    p.add_argument("--kl-cont", type=int, default=64)
    p.add_argument("--measure-only", action="store_true")
    p.add_argument("--train-only", action="store_true")
    return p.parse_args(argv)


def train(name: str, ridge, source, target, tokens, rc, workdir: str):
    """The residual `name` trained to rc.steps in `workdir` (resuming), with the wall time its runs took in total.
    A finished training is saved as <workdir>/map and loaded from there."""
    import kvjax
    from kvjax.fitting.residual import train_residual
    clock_path, map_dir = os.path.join(workdir, "train_seconds.json"), os.path.join(workdir, "map")
    spent = json.load(open(clock_path)) if os.path.isfile(clock_path) else {"seconds": 0.0, "steps": 0}
    if spent["steps"] >= rc.steps and os.path.isdir(map_dir):
        return kvjax.load_map(map_dir, source[0], target[0]), spent
    t0 = time.perf_counter()
    kvmap, history = train_residual(ridge, source, target, tokens, rc, workdir=workdir)
    if history:
        spent = {"seconds": spent["seconds"] + time.perf_counter() - t0, "steps": history[-1]["step"]}
        with open(clock_path, "w") as f:
            json.dump(spent, f)
        print(f"{name}: training KL {history[0]['kl']:.4f} -> {history[-1]['kl']:.4f} (steps "
              f"{history[0]['step']}..{history[-1]['step']})", flush=True)
    if spent["steps"] >= rc.steps:
        kvjax.save_map(map_dir, kvmap, info={"residual": dataclasses.asdict(rc), "train_seconds": spent["seconds"]})
    return kvmap, spent


def cache_metrics(maps: dict, source, target, heldout, skip: int, windows: int, prefix: int, cont: int,
                  batch_size: int) -> dict:
    """Per map: key / value cosine to the native target's cache (mean over target layers; heldout rows 0..skip, the
    main job's distance windows) and teacher-forced source KL over `cont` tokens after `prefix` (rows skip..)."""
    from kvjax.builders import Mapped, NativePrefill, SourcePrefill
    from kvjax.eval.distances import cache_distances
    from kvjax.fitting.residual import evaluate_kl
    dist = np.asarray(heldout[:skip, :512])
    kl_rows = np.asarray(heldout[skip : skip + windows, : prefix + cont])
    native, shared = NativePrefill(target), SourcePrefill(source)
    out = {}
    for name, kvmap in maps.items():
        mapped, layers = Mapped(source, target, kvmap, shared=shared), []
        for i in range(0, len(dist), batch_size):
            batch = dist[i : i + batch_size]
            layers.append(cache_distances(mapped(batch), native(batch), target[0].rope))
        out[name] = {f"{kind}_cos": float(np.mean([row[f"{kind}_cos"] for b in layers for row in b]))
                     for kind in ("key", "value")}
        out[name]["kl"] = float(evaluate_kl(kvmap, source, target, kl_rows, prefix, batch_size).mean())
        print(f"{name}: key cos {out[name]['key_cos']:.3f}, value cos {out[name]['value_cos']:.3f}, KL "
              f"{out[name]['kl']:.4f}", flush=True)
    return out


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg_path, ridge_dir = os.path.join(args.run, "config.json"), os.path.join(args.run, MAP_DIRS["ridge"])
    for path in (cfg_path, ridge_dir, os.path.join(args.run, "data", "heldout.npy")):
        if not os.path.exists(path):
            print(f"rollout_residual: {path} does not exist; run `python -m kvjax.launch` (--config.residual.steps=0 "
                  "is enough) and pass its directory as --run", file=sys.stderr)
            return 2
    if not 0.0 <= args.ema < 1.0:
        print(f"rollout_residual: --ema {args.ema} must be in [0, 1) (e.g. 0.995; 0: the last iterate)",
              file=sys.stderr)
        return 2
    if args.init_from and not os.path.isfile(os.path.join(args.init_from, "manifest.json")):
        print(f"rollout_residual: --init-from {args.init_from} is not a saved map (no manifest.json); pass a map "
              "directory such as <out>/rollout/map", file=sys.stderr)
        return 2
    import jax.numpy as jnp

    import kvjax
    from kvjax.eval.stats import paired_bootstrap_ci
    from kvjax.fitting.residual_config import ResidualConfig

    run_cfg = json.load(open(cfg_path))
    out = args.out or os.path.join(args.run, "rollout_residual")
    source, target = (kvjax.load_hf(run_cfg[r]["path"], dtype=jnp.dtype(run_cfg[r]["dtype"]))
                      for r in ("source", "target"))
    ridge = kvjax.load_map(ridge_dir, source[0], target[0])
    base = ResidualConfig(**{k: v for k, v in run_cfg["residual"].items() if k in
                             {f.name for f in dataclasses.fields(ResidualConfig)}})
    # fresh windows every step for both (a rollout's continuation changes with the map: it cannot be pooled)
    fresh = {"pool_windows": 0} if "pool_windows" in {f.name for f in dataclasses.fields(ResidualConfig)} else {}
    warm = {"init_from": os.path.abspath(args.init_from)} if args.init_from else {}
    if args.ema:  # only when asked: a run without it keeps its checkpoints' identity
        warm["ema"] = args.ema
    rc = dataclasses.replace(base, steps=args.steps, lr=args.lr or base.lr, cont_len=args.cont or base.cont_len,
                             batch_size=args.train_batch or base.batch_size,
                             seed=base.seed if args.seed < 0 else args.seed, rollout=False, **fresh, **warm,
                             save_every=min(base.save_every, args.steps))
    maps, clocks = {"ridge": ridge}, {}
    tokens = np.asarray(np.load(os.path.join(args.run, "data", "train_tokens.npy"), mmap_mode="r"))
    for name in ARMS[1:] if args.only is None else (args.only,):
        workdir = os.path.join(out, name)
        done = os.path.join(workdir, "train_seconds.json")
        if args.measure_only and (not os.path.isfile(done) or json.load(open(done))["steps"] < rc.steps):
            print(f"rollout_residual: --measure-only but {workdir} holds no finished training; run without it",
                  file=sys.stderr)
            return 2
        # a finished training resumes at its last step: nothing more is trained, its map is restored
        try:
            maps[name], clocks[name] = train(name, ridge, source, target, tokens,
                                             dataclasses.replace(rc, rollout=name == "rollout"), workdir)
        except ValueError as e:  # another run's checkpoint in workdir, an --init-from of another ridge
            print(f"rollout_residual: {e}", file=sys.stderr)
            return 2
        if clocks[name]["steps"] < rc.steps:
            print(f"rollout_residual: {name} residual has {clocks[name]['steps']} of {rc.steps} steps",
                  file=sys.stderr)
            return 2
    if args.train_only or args.only:
        return 0
    from kvjax.eval.rollout import rollout_table

    heldout = np.load(os.path.join(args.run, "data", "heldout.npy"), mmap_mode="r")
    skip = args.skip if args.skip >= 0 else run_cfg["eval"]["distances"]["windows"]
    windows = np.asarray(heldout[skip : skip + args.windows, : args.prefix])
    if len(windows) < args.windows:
        print(f"rollout_residual: the run has {len(heldout)} held-out rows; --skip {skip} + --windows "
              f"{args.windows} need more", file=sys.stderr)
        return 2
    from kvjax.builders import NativePrefill
    for pair in args.extra:
        name, _, where = pair.partition("=")
        maps[name] = kvjax.load_map(where, source[0], target[0])
    maps["target"] = NativePrefill(target, name="target")  # the target decoding from its own prefill: a reference
    t0 = time.perf_counter()
    per_step = rollout_table(maps, source, target, windows, args.n, args.batch_size)
    print(f"divergence of {len(maps)} maps on {len(windows)} windows: {time.perf_counter() - t0:.0f} s", flush=True)
    rows, fit = {}, {}
    if args.cache_metrics:
        fit = cache_metrics({k: m for k, m in maps.items() if k != "target"}, source, target, heldout, skip,
                             args.windows, args.prefix, args.kl_cont, args.batch_size)
    for name, d in per_step.items():
        row = {**fit.get(name, {}), "divergence": float(d.mean()), "per_step": d.mean(0).tolist(),
               "per_window": d.mean(1).tolist()}
        if name != "ridge":
            ci = paired_bootstrap_ci(d.mean(1), per_step["ridge"].mean(1))
            row.update(minus_ridge=ci.mean, minus_ridge_ci95=[ci.lo, ci.hi],
                       change=row["divergence"] / rows["ridge"]["divergence"] - 1.0,
                       windows_improved=int(np.sum(d.mean(1) < per_step["ridge"].mean(1))))
            if name in clocks:
                row.update(train_seconds=clocks[name]["seconds"], train_steps=clocks[name]["steps"])
        rows[name] = row
    result = {"run": args.run, "source": run_cfg["source"]["path"], "target": run_cfg["target"]["path"],
              "windows": len(windows), "skip": skip, "prefix": args.prefix, "n": args.n,
              "residual": dataclasses.asdict(rc), "arms": rows, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "rollout_residual.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n{len(windows)} windows, prefix {args.prefix}, {args.n} steps; residuals {rc.steps} steps at lr {rc.lr:g}")
    extra = lambda r: (f" {r['key_cos']:.3f} | {r['value_cos']:.3f} | {r['kl']:.4f} |"  # noqa: E731
                       if "kl" in r else "")
    more = " key cos | value cos | KL |" if args.cache_metrics else ""
    print("| map | mean divergence | vs ridge | paired 95% CI (map - ridge) | windows improved | training |" + more)
    print("|---|---:|---:|---|---:|---:|" + "---:|" * (3 if args.cache_metrics else 0))
    for name, r in rows.items():
        if name == "ridge":
            print(f"| ridge | {r['divergence']:.4f} | | | | |" + extra(r))
        else:
            lo, hi = r["minus_ridge_ci95"]
            label = f"ridge + {name} residual" if name in clocks else name
            trained = f"{r['train_seconds'] / 60:.1f} min ({r['train_steps']} steps)" if name in clocks else ""
            print(f"| {label} | {r['divergence']:.4f} | {100 * r['change']:+.1f}% | "
                  f"{r['minus_ridge']:+.4f} [{lo:+.4f}, {hi:+.4f}] | {r['windows_improved']} / {len(windows)} | "
                  f"{trained} |" + extra(r))
    print(f"wrote {os.path.join(out, 'rollout_residual.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

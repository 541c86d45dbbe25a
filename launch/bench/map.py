"""What the cache map costs on the toy pair: fit time and memory against calibration size, and applying the map
against the source prefill it follows.

    python -m launch.bench.map                  # both parts
    python -m launch.bench.map --part fit       # fit at 3 calibration sizes (4x steps), one subprocess each
    python -m launch.bench.map --part apply     # apply_map vs source prefill at 2K tokens
    python -m launch.bench.map --target checkpoints/toy/pruned --pairing 3 --residual-rank 64   # toy_pruned's map
    python -m launch.bench.map --part apply --target checkpoints/toy/pruned --maps base=RUN/map att=RUN2/map
                                                # saved maps (any family) side by side, interleaved

Fit: each size runs in its own process (peak RSS is per process); a warm-up fit on a few windows compiles
everything first, so the timed parts are streaming
(the statistics, which grow with tokens) and the whole fit_map (statistics + lambda selection + solve). Expect time ~ proportional to tokens and memory flat
(the statistics are fixed-size; batches are streamed). Apply: medians of interleaved repeats, batch 1. Weights do not
change either cost, only shapes (and the pairing: top-k feeds k source layers to each target layer): by default the
shipped pair in checkpoints/toy.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np


def load_pair(args):
    import kvjax
    return (kvjax.load_hf(f"{args.toy_dir}/source"), kvjax.load_hf(args.target or f"{args.toy_dir}/target"))


def pairing_arg(args):
    return args.pairing if args.pairing == "depth" else int(args.pairing)


def fit_one(args) -> dict:
    import jax

    import kvjax
    from kvjax.fitting.calibrate import batches_of, collect_stats
    from kvjax.windows import sample
    from kvjax.mapper.pairing import depth_pairing
    source, target = load_pair(args)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, source[0].vocab_size, 4_000_000).astype(np.int32)
    held = sample(tokens, 8, args.window, seed=2)
    fit = dict(pairing=pairing_arg(args), residual_rank=args.residual_rank)
    warm = sample(tokens, 8, args.window, seed=3)
    kvjax.fit_map(source, target, warm, held, **fit)
    calib = sample(tokens, args.fit_one, args.window, seed=1)
    pairing = depth_pairing(source[0].num_layers, target[0].num_layers)
    collect_stats(source, target, pairing, batches_of(warm, 8))  # compiled here (a top-k fit collects other pairs)
    t0 = time.perf_counter()
    collect_stats(source, target, pairing, batches_of(calib, 8))  # the part that grows with calibration tokens
    t1 = time.perf_counter()
    jax.block_until_ready(kvjax.fit_map(source, target, calib, held, **fit)[0])
    t2 = time.perf_counter()
    return {"windows": args.fit_one, "tokens": args.fit_one * args.window, "stats_seconds": t1 - t0,
            "fit_seconds": t2 - t1, "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def bench_fit(args) -> list[dict]:
    rows = []
    for n in args.sizes:
        cmd = [sys.executable, "-m", "launch.bench.map", "--fit-one", str(n), "--window", str(args.window),
               "--toy-dir", args.toy_dir, "--pairing", args.pairing, "--residual-rank", str(args.residual_rank)]
        cmd += ["--target", args.target] if args.target else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"fit at {n} windows failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"\nfit_map on the toy pair (window {args.window}; time excludes compilation)")
    print("| calibration tokens | statistics s | x tokens | x time | whole fit_map s | peak RSS MB |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['stats_seconds']:.1f} | {r['tokens'] / base['tokens']:.0f} | "
              f"{r['stats_seconds'] / base['stats_seconds']:.2f} | {r['fit_seconds']:.1f} | {r['max_rss_mb']:.0f} |")
    return rows


def bench_apply(args) -> dict:
    import jax
    import jax.numpy as jnp

    import kvjax
    from kvjax.models.decoder import prefill_forward
    from kvjax.windows import sample
    source, target = load_pair(args)
    (scfg, sparams) = source
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, scfg.vocab_size, 400_000).astype(np.int32)
    if args.maps:  # saved maps, NAME=DIR each
        try:
            maps = {spec.split("=", 1)[0]: kvjax.load_map(spec.split("=", 1)[1], scfg, target[0])
                    for spec in args.maps}
        except (IndexError, ValueError, FileNotFoundError) as e:
            sys.exit(f"--maps takes NAME=DIR of maps saved for these models (--target): {e}")
    else:
        maps = {"map": kvjax.fit_map(source, target, sample(tokens, 16, 256, seed=1), sample(tokens, 8, 256, seed=2),
                                     pairing=pairing_arg(args), residual_rank=args.residual_rank)[0]}
    prompt = jnp.asarray(tokens[None, : args.apply_tokens])
    prefill = jax.jit(lambda p, t: prefill_forward(p, scfg, t, logits=None).cache)
    apply = jax.jit(lambda m, c: kvjax.apply_map(m, c))
    cache = jax.block_until_ready(prefill(sparams, prompt))
    for kvmap in maps.values():
        jax.block_until_ready(apply(kvmap, cache))
    t_prefill, t_apply = [], {name: [] for name in maps}
    for _ in range(args.repeats):  # the prefill and every map in turn, each round
        t0 = time.perf_counter()
        cache = jax.block_until_ready(prefill(sparams, prompt))
        t_prefill.append(time.perf_counter() - t0)
        for name, kvmap in maps.items():
            t1 = time.perf_counter()
            jax.block_until_ready(apply(kvmap, cache))
            t_apply[name].append(time.perf_counter() - t1)
    prefill_s = statistics.median(t_prefill)
    rows = {}
    print(f"\napply_map vs source prefill at {args.apply_tokens} tokens (batch 1, median of {args.repeats}): "
          f"prefill {prefill_s * 1e3:.1f} ms")
    for name, ts in t_apply.items():
        apply_s = statistics.median(ts)
        rows[name] = {"tokens": args.apply_tokens, "prefill_s": prefill_s, "apply_s": apply_s,
                      "us_per_token": 1e6 * apply_s / args.apply_tokens, "ratio": apply_s / prefill_s}
        print(f"  {name}: map {apply_s * 1e3:.2f} ms ({rows[name]['us_per_token']:.2f} us / token), ratio "
              f"{rows[name]['ratio']:.3f} (goal <= 0.05)")
    return rows if args.maps else rows["map"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["fit", "apply", "all"], default="all")
    p.add_argument("--toy-dir", default="checkpoints/toy")
    p.add_argument("--target", default=None, help="another target checkpoint (default: TOY_DIR/target)")
    p.add_argument("--pairing", default="depth", help='"depth" or k: the top-k source layers by held-out R^2')
    p.add_argument("--residual-rank", type=int, default=16, help="the residual is applied too (zero at init)")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="calibration windows per fit")
    p.add_argument("--apply-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--maps", nargs="+", default=[], metavar="NAME=DIR",
                   help="apply part: time these saved maps (of --target) instead of fitting one")
    p.add_argument("--fit-one", type=int, help=argparse.SUPPRESS)  # internal: one fit in this process
    args = p.parse_args(argv)
    if args.fit_one:
        print(json.dumps(fit_one(args)))
        return
    if args.part in ("fit", "all"):
        bench_fit(args)
    if args.part in ("apply", "all"):
        bench_apply(args)


if __name__ == "__main__":
    main()

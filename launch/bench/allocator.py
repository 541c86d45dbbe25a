"""Decode step time under each host allocator (kvjax.allocator): glibc's defaults, kvjax's tuned glibc on 4 KiB and on
transparent huge pages, tcmalloc.

    launch/venv python -m launch.bench.allocator                      # batch 1 and 64, 2 rounds, CPU 1, ~3 minutes
    launch/venv python -m launch.bench.allocator --batches 1 4 16 64 --rounds 3 --cpus 1

The foundation benchmark's model (launch.bench.foundation: 33.6M Qwen3, random weights, float32), one decode step
(`kvjax.decode_step`, every row at --context tokens) timed in a fresh process per allocator, pinned with taskset; the
allocators alternate within each round and the report is the median over rounds of per-process medians. An allocator
can only be chosen before a process starts (LD_PRELOAD) or before its threads allocate (mallopt), hence one process
each. tcmalloc is measured where the system has it (apt-get install libtcmalloc-minimal4).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

from launch.bench.foundation import MODEL


def tcmalloc() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4") + glob.glob("/usr/lib*/libtcmalloc*.so.4"))
    return found[0] if found else None


def allocators() -> dict[str, dict]:
    """name -> the environment a worker runs under (huge pages by glibc's tunable, kvjax.allocator.environ)."""
    from kvjax.allocator import ENV, HUGETLB, TUNABLES
    small, huge = {TUNABLES: f"{HUGETLB}=0"}, {TUNABLES: f"{HUGETLB}=1"}
    out = {"glibc defaults": {ENV: "system", **small}, "glibc tuned, 4 KiB pages": {ENV: "tuned", **small},
           "glibc tuned + huge pages (kvjax default)": {ENV: "tuned", **huge}}
    if (lib := tcmalloc()) is not None:
        out["tcmalloc"] = {ENV: "tuned", "LD_PRELOAD": lib, **small}
    return out


def worker(args) -> None:
    from kvjax import allocator
    applied = allocator.tune()
    import time

    import jax
    import jax.numpy as jnp

    import kvjax
    from kvjax.models.config import Qwen3Config
    cfg = Qwen3Config.from_hf_dict({"model_type": "qwen3", **MODEL})
    params = kvjax.init_params(cfg, jax.random.PRNGKey(0))
    result = {"applied": applied, "ms": {}}
    for b in args.batches:
        capacity = args.capacity if b == 1 else args.context + 64
        cache = kvjax.init_cache(cfg, b, capacity, jnp.float32)
        token = jnp.ones((b,), jnp.int32)
        times = []
        for step in range(args.steps + 3):
            cache = cache.replace(lengths=jnp.full((b,), args.context, jnp.int32))
            t0 = time.perf_counter()
            logits, cache = kvjax.decode_step(params, cfg, token, cache)
            logits.block_until_ready()
            times.append(time.perf_counter() - t0)
        result["ms"][b] = 1e3 * statistics.median(times[3:])  # the first calls compile
    print(json.dumps(result), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=512, help="tokens in every row's cache")
    p.add_argument("--capacity", type=int, default=4096, help="cache capacity at batch 1 (batch > 1: context + 64)")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per batch size per process")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpus", default="1", help="taskset CPU list of every worker")
    p.add_argument("--out", help="also write the results as JSON")
    p.add_argument("--worker", action="store_true", help="internal: time one allocator in this process")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    envs = allocators()
    runs = {name: [] for name in envs}
    applied = {}
    for r in range(args.rounds):
        order = list(envs) if r % 2 == 0 else list(envs)[::-1]
        for name in order:
            cmd = ["taskset", "-c", args.cpus, sys.executable, "-m", "launch.bench.allocator", "--worker",
                   "--batches", *map(str, args.batches), "--context", str(args.context), "--capacity",
                   str(args.capacity), "--steps", str(args.steps)]
            out = subprocess.run(cmd, env={**os.environ, **envs[name]}, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"bench.allocator: the {name!r} worker failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                return 1
            res = json.loads(out.stdout.strip().splitlines()[-1])
            applied[name] = res["applied"]
            runs[name].append(res["ms"])
            print(f"[round {r + 1}/{args.rounds}] {name}: " + ", ".join(f"batch {b} {ms:.2f} ms"
                                                                        for b, ms in res["ms"].items()),
                  file=sys.stderr, flush=True)
    table = {name: {b: statistics.median(run[str(b)] for run in rs) for b in args.batches} for name, rs in runs.items()}
    base = table["glibc defaults"]
    print(f"\ndecode step of the foundation model, ctx {args.context}, CPUs {args.cpus}, median of {args.rounds} "
          f"round(s) (ms/step; x = speed vs glibc defaults)")
    print(f"{'allocator':<42}" + "".join(f"{'batch ' + str(b):>22}" for b in args.batches))
    for name, row in table.items():
        print(f"{name:<42}" + "".join(f"{ms:>12.2f} ({base[b] / ms:4.2f}x)" for b, ms in row.items()))
    for name, what in applied.items():
        print(f"  {name}: {what}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "ms_per_step": table, "applied": applied, "rounds": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

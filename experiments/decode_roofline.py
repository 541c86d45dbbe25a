"""Where batch-1 decode's time goes against the memory roofline, in one process.

    taskset -c 0,1 launch/venv python -m experiments.decode_roofline --rounds 4

Each round measures, in this order and in the same process: XLA's matrix-vector product over 1 GiB of float32 (the
read bandwidth the foundation benchmark's roofline takes when it is the higher reader), kvjax.generate's loop on the
foundation benchmark's random 33.6M Qwen3 (512 tokens of prompt; tokens/s of --new tokens after the first, as
launch.bench.foundation times it), then one jax.profiler trace of the same call, split per generated token into the
weight products (the `dot` operations), the attention conditionals (one per layer: the window choice and everything
inside it) and the rest (the timed step minus both), with how many of each run a token. Why: which part keeps the loop under 80% of the roofline is a
question of the same moment on this VM, whose bandwidth moves 30% between runs; numbers from different processes
do not add up. Run it pinned (taskset) and alone. The profile's own overhead makes "rest" noisy (it can go negative).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile

from launch.bench.foundation import make_checkpoint, seconds

GIB = 1 << 30


def step_bytes(cfg, params, context: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) one decode step reads: every weight but the embedding table (one row of it is
    gathered; a tied table is the output projection too, so it is read whole), the live K and V of every layer."""
    import jax
    weights = sum(a.nbytes for a in jax.tree.leaves(params))
    if params.lm_head is not None:
        weights -= params.embed.nbytes - params.embed[0].nbytes
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * context * cfg.head_dim * params.embed.dtype.itemsize
    return weights, kv


def per_token(events: list, n: int) -> dict:
    """The weight products' and the attention conditionals' microseconds and operation counts per token, from a
    trace of a loop of n tokens."""
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    looped = {name: us for name, us in total.items() if count[name] >= n}  # run once per token (or more)
    dots = [name for name in looped if re.fullmatch(r"dot\.\d+", name)]
    conds = [name for name in looped if name.startswith("cond")]
    return {"dots_us": sum(looped[k] for k in dots) / n, "conds_us": sum(looped[k] for k in conds) / n,
            "dots": sum(count[k] for k in dots) / n, "conds": sum(count[k] for k in conds) / n}


def run(args) -> list[dict]:
    from kvjax import allocator
    allocator.tune()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kvjax

    cfg, params = kvjax.load_hf(args.ckpt, dtype=jnp.float32)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.context)).astype(np.int32)
    w, x = jnp.ones((GIB // 4 // 4096, 4096), jnp.float32), jnp.ones((4096,), jnp.float32)
    matvec = jax.jit(lambda w, x: w @ x)
    weights, kv = step_bytes(cfg, params, args.context)

    def gen(n):
        kvjax.generate(params, cfg, prompt, n, eos_token_ids=()).block_until_ready()

    gen(args.new + 1), gen(1), matvec(w, x).block_until_ready()  # compile
    rows = []
    for r in range(args.rounds):
        gb_s = GIB / statistics.median(seconds(lambda: matvec(w, x).block_until_ready()) for _ in range(5)) / 1e9
        dt = statistics.median(seconds(lambda: gen(args.new + 1)) for _ in range(3)) - \
            statistics.median(seconds(lambda: gen(1)) for _ in range(3))
        step_us = dt / args.new * 1e6
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            gen(args.new + 1)
            jax.profiler.stop_trace()
            with gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]) as f:
                split = per_token(json.load(f)["traceEvents"], args.new)
        dots, conds = split["dots_us"], split["conds_us"]
        row = {"matvec_gb_s": gb_s, "tok_s": 1e6 / step_us, "roofline_frac": (weights + kv) / (gb_s * 1e3) / step_us,
               "step_us": step_us, "weight_products_us": dots, "weight_products_gb_s": weights / dots / 1e3,
               "attention_us": conds, "attention_at_bandwidth_us": kv / (gb_s * 1e3), "rest_us": step_us - dots - conds,
               "weight_products_per_token": split["dots"], "attention_conditionals_per_token": split["conds"]}
        rows.append(row)
        print(f"round {r + 1}: matvec {gb_s:.1f} GB/s | loop {row['tok_s']:.1f} tok/s, {step_us:.0f} us a token, "
              f"{100 * row['roofline_frac']:.0f}% of the roofline | weight products {dots:.0f} us "
              f"({row['weight_products_gb_s']:.1f} GB/s, {100 * row['weight_products_gb_s'] / gb_s:.0f}% of the "
              f"matvec's) | attention {conds:.0f} us (its cache at the matvec's rate: "
              f"{row['attention_at_bandwidth_us']:.0f}) | rest {row['rest_us']:.0f} us", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--context", type=int, default=512, help="prompt tokens before decoding")
    p.add_argument("--new", type=int, default=128, help="timed tokens after the first")
    p.add_argument("--ckpt", help="a Qwen3 checkpoint (default: the foundation benchmark's model in a temp dir)")
    p.add_argument("--out", help="also write every round as JSON to this path")
    args = p.parse_args()
    from kvjax.cache import MIN_WINDOW
    if args.rounds < 1 or args.context < 1 or args.new < 2:
        p.error("--rounds and --context must be >= 1 and --new >= 2")
    if args.context + args.new + 1 <= MIN_WINDOW:
        p.error(f"--context + --new must exceed {MIN_WINDOW - 1}: below that the cache has one attention window, "
                "no per-layer conditional, and attention is not told apart from the rest")
    if args.ckpt and not os.path.isdir(args.ckpt):
        p.error(f"--ckpt {args.ckpt}: no such directory (a Qwen3 checkpoint saved with save_pretrained)")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.ckpt:
            args.ckpt = os.path.join(tmp, "model")
            make_checkpoint(args.ckpt, 0)
        rows = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "ckpt"}, "rounds": rows}, f, indent=1)
    print("median: " + ", ".join(f"{k} {statistics.median(r[k] for r in rows):.3g}" for k in rows[0]))


if __name__ == "__main__":
    sys.exit(main())

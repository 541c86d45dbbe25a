"""Decode with the cache as one stacked buffer per K and V, one buffer per layer (KVCache since 2026-12-02), or one
buffer per layer with the keys held transposed (kvjax.generate's loop since 2026-12-02).

    launch/venv python -m experiments.cache_layout --cpus 0,1 --batches 1 4 16 64
    launch/venv python -m experiments.cache_layout --cpus 0,1 --batches 1 --profile   # + where a token's time goes

Why: on XLA:CPU a dot cannot read a slice of a larger buffer in place, so every decode step copies each layer's
attention window out of the stacked [L, B, Hkv, C, hd] cache before attending over it (the `slice` fusions of the
profile). Params were split per layer for the same reason (kvjax.models.params). This probe runs the same decode steps
both ways, with the decoder's own `_write` and `attend` (a per-layer buffer goes in as a [1, B, Hkv, C, hd] view, so
the window that is the whole capacity is no slice at all), and checks that both produce the same tokens. The third
layout, "keys_transposed", is the library's forward over `cache.with_keys_transposed(True)` (keys [B, Hkv, hd, C]:
decode's scores read them without repacking; kvjax.cache).

Method: the foundation benchmark's random 33.6M Qwen3 (float32), every row prefilled to --context tokens, capacity
context + 64 (so decode's window is the whole capacity, as in kvjax.generate); `--steps` greedy decode steps inside one
jitted fori_loop per layout; tokens/s from the time of `--steps` steps minus that of one step (medians of 3, in the
same process, layouts alternated for --rounds rounds, the order reversed every other round; the report is the median
over rounds). `--profile` also traces one jitted loop of each layout with jax.profiler and lists the per-token time
by XLA operation kind.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from launch.bench.foundation import MODEL, make_checkpoint

LAYOUTS = ("stacked", "per_layer", "keys_transposed")


def decode_steps(params, cfg, layout: str, steps: int):
    """A jitted fn(cache, tokens [B]) -> (cache, last tokens [B]) running `steps` greedy decode steps. "per_layer":
    the library's own forward over a KVCache (one buffer per layer); "stacked": the same step written out over
    stacked [L, B, Hkv, C, hd] buffers (KVCache's layout before 2026-12-02), with the decoder's own attention;
    "keys_transposed": the library's forward over a cache whose keys are held [B, Hkv, hd, C]."""
    import jax
    import jax.numpy as jnp

    from kvjax.models import decoder as D

    def stacked_step(bufs, tok):
        k_all, v_all, length = bufs
        positions, kv_len = length[:, None], length + 1
        cos, sin = D.head_angles(cfg, positions)
        x = D.embed(params, tok[:, None])
        rows = jnp.arange(tok.shape[0])[:, None]
        for i, lp in enumerate(params.layers):
            q, k, v = D.qkv(lp, cfg, x, cos, sin)
            k_all = k_all.at[i, rows, :, positions].set(k.astype(k_all.dtype), mode="drop")
            v_all = v_all.at[i, rows, :, positions].set(v.astype(v_all.dtype), mode="drop")
            x = D.finish(lp, cfg, x, D.attend(q, k_all[i], v_all[i], positions, kv_len))  # k_all[i]: a copy
        logits = D.unembed(params, D.rms_norm(x, params.final_norm, cfg.rms_norm_eps))
        return logits, (k_all, v_all, kv_len)

    def step(state, _):
        bufs, tok = state
        logits, bufs = stacked_step(bufs, tok) if layout == "stacked" else D.forward(params, cfg, tok[:, None], bufs)
        return (bufs, jnp.argmax(logits[:, 0], -1).astype(jnp.int32)), None

    @functools.partial(jax.jit, donate_argnums=0)
    def run(bufs, tok):
        (bufs, tok), _ = jax.lax.scan(step, (bufs, tok), None, length=steps)
        return bufs, tok

    return run


def side(args) -> dict:
    """Worker (its own pinned process): every batch size, the layouts alternated."""
    from kvjax import allocator
    allocator.tune()
    import jax.numpy as jnp
    import numpy as np

    import kvjax

    cfg, params = kvjax.load_hf(args.ckpt, dtype=jnp.float32)
    out = {}
    for b in args.batches:
        prompt = jnp.asarray(np.random.default_rng(b).integers(0, cfg.vocab_size, (b, args.context)), jnp.int32)
        _, cache = kvjax.prefill(params, cfg, prompt, kvjax.init_cache(cfg, b, args.context + 64, jnp.float32))
        tok = jnp.ones((b,), jnp.int32)
        flipped = cache.with_keys_transposed(True)  # its own value buffers too: each state's buffers are donated
        state = {"stacked": (cache.k, cache.v, None), "per_layer": cache,
                 "keys_transposed": flipped.replace(values=tuple(jnp.copy(a) for a in cache.values))}
        fns = {(lay, n): decode_steps(params, cfg, lay, n) for lay in LAYOUTS for n in (1, args.steps)}
        context = np.asarray(cache.lengths)  # every call decodes from the same context length (a fresh array:
        start = {"stacked": lambda s: (s[0], s[1], jnp.asarray(context)),  # the buffers passed in are donated)
                 "per_layer": lambda s: s.replace(lengths=jnp.asarray(context)),
                 "keys_transposed": lambda s: s.replace(lengths=jnp.asarray(context))}

        def call(lay, n):  # the cache is donated: keep the returned buffers for the next call
            state[lay], last = fns[lay, n](start[lay](state[lay]), tok)
            return last.block_until_ready()

        toks = [np.asarray(call(lay, args.steps)) for lay in LAYOUTS]
        same = all(bool((t == toks[0]).all()) for t in toks[1:])
        for lay in LAYOUTS:
            call(lay, 1)

        def timed(lay, n):
            t0 = time.perf_counter()
            call(lay, n)
            return time.perf_counter() - t0

        rounds = {lay: [] for lay in LAYOUTS}
        for r in range(args.rounds):
            for lay in LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]:  # no layout always first or last
                dt = statistics.median(timed(lay, args.steps) for _ in range(3)) - \
                    statistics.median(timed(lay, 1) for _ in range(3))
                rounds[lay].append(b * (args.steps - 1) / dt)
        out[b] = {"same_tokens": same, **{lay: statistics.median(r) for lay, r in rounds.items()},
                  "rounds": rounds}
        if args.profile:
            out[b]["profile"] = {lay: profile(lambda: call(lay, args.steps), args.steps) for lay in LAYOUTS}
    return out


def profile(fn, steps: int) -> dict:
    """Per-step milliseconds by XLA operation kind (the name without its numeric suffix) in one traced call; nested
    events (a conditional and the operations of its branch) are each counted under their own name."""
    import jax
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        fn()
        jax.profiler.stop_trace()
        with gzip.open(glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)[0]) as f:
            events = json.load(f)["traceEvents"]
    per_name, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            per_name[e["name"]] += e["dur"]
            count[e["name"]] += 1
    kinds = collections.Counter()
    for name, us in per_name.items():  # operations run once per step (or more) inside the loop
        if count[name] >= steps and not name.startswith(("Thunk", "Slinky", "$", "end:")):
            kinds[re.sub(r"[.\d]+(clone)?[.\d]*$", "", name)] += us
    return {k: round(us / 1e3 / steps, 4) for k, us in kinds.most_common(8)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpus", default="0,1", help="taskset CPU list of the worker (one XLA thread per CPU)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--context", type=int, default=512, help="cached tokens per row before decoding")
    p.add_argument("--steps", type=int, default=16, help="decode steps per timed call")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--profile", action="store_true", help="also list each layout's per-token time by operation")
    p.add_argument("--ckpt", help="a Qwen3 checkpoint (default: the foundation benchmark's model in a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 2 or args.rounds < 1 or args.context < 1 or min(args.batches) < 1:
        p.error("--steps must be >= 2 and --rounds, --context and every batch size >= 1")
    if args.worker:
        print(json.dumps(side(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not args.ckpt:
            args.ckpt = os.path.join(tmp, "model")
            make_checkpoint(args.ckpt, 0)
        from kvjax import allocator
        cmd = ["taskset", "-c", args.cpus, sys.executable, "-m", "experiments.cache_layout", "--worker",
               "--ckpt", args.ckpt, "--batches", *map(str, args.batches), "--context", str(args.context),
               "--steps", str(args.steps), "--rounds", str(args.rounds)] + (["--profile"] if args.profile else [])
        done = subprocess.run(cmd, env={**os.environ, **allocator.environ(), "JAX_PLATFORMS": "cpu"},
                              capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the worker failed:\n{done.stderr[-3000:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"decode tokens/s, {MODEL['num_hidden_layers']}-layer {MODEL['hidden_size']}-wide Qwen3, context "
          f"{args.context}, CPUs {args.cpus} (median of {args.rounds} rounds)")
    print("| batch | stacked cache | per-layer buffers | ratio | keys transposed | ratio to per-layer | same tokens |\n"
          "|---|---|---|---|---|---|---|")
    for b, r in res.items():
        print(f"| {b} | {r['stacked']:.1f} | {r['per_layer']:.1f} | {r['per_layer'] / r['stacked']:.2f}x | "
              f"{r['keys_transposed']:.1f} | {r['keys_transposed'] / r['per_layer']:.2f}x | {r['same_tokens']} |")
    for b, r in res.items():
        for lay, kinds in r.get("profile", {}).items():
            print(f"batch {b}, {lay}: ms per step by operation: " +
                  ", ".join(f"{k} {ms:.3f}" for k, ms in kinds.items()))
    if not all(r["same_tokens"] for r in res.values()):
        sys.exit("the layouts decoded different tokens")


if __name__ == "__main__":
    main()

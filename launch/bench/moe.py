"""MoE decode speed: routed vs dense dispatch on one Qwen3-MoE checkpoint, side by side in one run.

    taskset -c 1 python -m launch.bench.moe                          # the toy MoE (checkpoints/toy/moe), batch 1
    taskset -c 1 python -m launch.bench.moe --batch 1 4 --out moe_bench.json

For each dispatch (kvjax.models.qwen3_moe: "routed" gathers each token's top-k experts when tokens x top-k <= experts
/ 2 and runs a grouped matmul otherwise; "dense" runs every expert on every token; "auto", the default, is routed at
decode-sized batches and dense otherwise) the same model is compiled once. Each round, in
alternating order, prefills a `--context`-token prompt (timed) and times `--steps` compiled decode steps one by one
(kvjax.models.decoder.decode_jit, synchronised after each); the report is the median over rounds of each round's
median. Every dispatch then generates `--new-tokens` greedy tokens from the same prompt, which must be identical.
The machine may be shared: the report records the load average before and after; trust ratios more than absolutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.models.decoder import decode_jit

DISPATCHES = ("routed", "dense", "auto")


def time_round(params, cfg, prompt: np.ndarray, steps: int) -> tuple[float, float, float]:
    """(prefill seconds, median decode-step seconds, median decode-step CPU seconds of this process) for one fresh
    cache. CPU time counts the work of every XLA thread and not the time other processes hold the cores, so on a
    shared machine it is the steadier measure of the work a step does."""
    b, t = prompt.shape
    cache = kvjax.init_cache(cfg, b, t + steps + 1)
    t0 = time.perf_counter()
    logits, cache = kvjax.prefill(params, cfg, prompt, cache, last_only=True)
    logits.block_until_ready()
    prefill = time.perf_counter() - t0
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        logits, cache = decode_jit(params, cfg, token, cache)
        logits.block_until_ready()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    return prefill, statistics.median(times), statistics.median(cpu)


def bench(args) -> dict:
    cfg, params = kvjax.load_hf(args.model, dtype=jnp.dtype(args.dtype))
    if not hasattr(cfg, "moe_dispatch"):
        sys.exit(f"{args.model} is not a Qwen3-MoE checkpoint (model_type qwen3_moe); pass --model DIR")
    tokens = np.load(args.windows)[: max(args.batch), : args.context].astype(np.int32)
    cfgs = {d: dataclasses.replace(cfg, moe_dispatch=d) for d in DISPATCHES}
    out = {"model": args.model, "dtype": args.dtype, "context": args.context, "steps": args.steps,
           "rounds": args.rounds, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
           "params_M": cfg.num_params() / 1e6, "active_params_M": cfg.active_params() / 1e6,
           "load_before": os.getloadavg()[0], "jax_devices": str(jax.devices()), "batches": []}
    for b in args.batch:
        prompt = tokens[:b]
        for d in DISPATCHES:  # compile (and warm) every dispatch before anything is timed
            time_round(params, cfgs[d], prompt, args.steps)
        rounds = {d: [] for d in DISPATCHES}
        for r in range(args.rounds):
            for d in (DISPATCHES if r % 2 == 0 else DISPATCHES[::-1]):  # alternating order
                rounds[d].append(time_round(params, cfgs[d], prompt, args.steps))
        row = {"batch": b}
        for d in DISPATCHES:
            row[d] = {"prefill_ms": 1e3 * statistics.median(p for p, _, _ in rounds[d]),
                      "decode_ms_per_step": 1e3 * statistics.median(s for _, s, _ in rounds[d]),
                      "decode_cpu_ms_per_step": 1e3 * statistics.median(c for _, _, c in rounds[d])}
            row[d]["decode_tok_s"] = b * 1e3 / row[d]["decode_ms_per_step"]
        row["decode_speedup_routed"] = row["dense"]["decode_ms_per_step"] / row["routed"]["decode_ms_per_step"]
        row["decode_cpu_ratio_routed"] = row["dense"]["decode_cpu_ms_per_step"] / row["routed"]["decode_cpu_ms_per_step"]
        row["prefill_speedup_routed"] = row["dense"]["prefill_ms"] / row["routed"]["prefill_ms"]
        gen = {d: np.asarray(kvjax.generate(params, cfgs[d], prompt, max_new_tokens=args.new_tokens,
                                            eos_token_ids=())) for d in DISPATCHES}
        row["identical_tokens"] = all(np.array_equal(gen[d], gen["dense"]) for d in DISPATCHES)
        row["new_tokens"] = args.new_tokens
        out["batches"].append(row)
        print(json.dumps(row), flush=True)
    out["load_after"] = os.getloadavg()[0]
    return out


def table(out: dict) -> str:
    lines = [f"{out['model']} ({out['experts']} experts, top {out['top_k']}, {out['params_M']:.2f}M params, "
             f"{out['active_params_M']:.2f}M active, {out['dtype']}), context {out['context']}, "
             f"load {out['load_before']:.1f} -> {out['load_after']:.1f}",
             "| batch | decode ms/step routed | dense | auto | routed speedup | decode CPU ms/step routed | dense | "
             "ratio | prefill ms routed | dense | auto | identical tokens |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["batches"]:
        lines.append(f"| {r['batch']} | {r['routed']['decode_ms_per_step']:.2f} | {r['dense']['decode_ms_per_step']:.2f}"
                     f" | {r['auto']['decode_ms_per_step']:.2f} | {r['decode_speedup_routed']:.2f}x | "
                     f"{r['routed']['decode_cpu_ms_per_step']:.2f} | {r['dense']['decode_cpu_ms_per_step']:.2f} | "
                     f"{r['decode_cpu_ratio_routed']:.2f}x | "
                     f"{r['routed']['prefill_ms']:.1f} | {r['dense']['prefill_ms']:.1f} | {r['auto']['prefill_ms']:.1f} | "
                     f"{r['identical_tokens']} ({r['new_tokens']}) |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="checkpoints/toy/moe", help="a Qwen3-MoE HF checkpoint directory")
    p.add_argument("--windows", default="checkpoints/toy/eval/heldout_windows.npy", help="token windows [N, T] (.npy)")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--context", type=int, default=256, help="prompt tokens before the timed decode steps")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens compared between the dispatches")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    for path in (args.model, args.windows):
        if not os.path.exists(path):
            sys.exit(f"{path} does not exist; build the toy MoE with `python -m launch.toy.moe` or pass --model/--windows")
    out = bench(args)
    print(table(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()

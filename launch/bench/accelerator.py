"""The one prepared accelerator check: what a session lent a GPU (or TPU) runs in its few minutes of device time.

    python -m launch.bench.accelerator --out accel.json      # on a GPU/TPU, <= 8 minutes; writes JSON + a table
    python -m launch.bench.accelerator --smoke               # CPU, tiny shapes, kernel in interpret mode (the tests)

On the project's lent H200 (python3 there has jax with CUDA; run from the repository root with PYTHONPATH=.):

    PYTHONPATH=. python3 -m launch.bench.accelerator --out $OUT/accelerator.json

Sections, in order of what matters most if the budget runs out (each one checks the remaining budget first and is
recorded as skipped, with the reason, when it would not fit):
1. device: kind, memory, the copy bandwidth (read + write of a 2 GiB buffer) and the bf16 / f32 matmul peak
   measured here: the limits every later number is a fraction of.
2. parity: tests/test_parity.py run on the device (JAX on the accelerator, transformers on the host CPU) with
   JAX_DEFAULT_MATMUL_PRECISION=highest: GPUs multiply f32 in TF32 by default, which is not the 1e-4 the tests hold.
3. kernel: the Pallas map-and-insert kernel vs the XLA map at Qwen3-32B -> Qwen3-8B shapes (launch.bench.kernel:
   GB/s against the copy bandwidth, the kernel's error against XLA).
4. decode: an 8B-shaped Qwen3 with random bf16 weights, greedy decode steps at batch 1 and 32 from a 1K-token context:
   tokens/s and the fraction of the HBM roofline (weights + the attention window's K/V read once per step, at the
   measured copy bandwidth).
5. ttft: time to first token at 1K-16K tokens of the split path (a 32B-shaped source prefills, a random rank-256 +
   16 map translates, the 8B-shaped target runs the last token) against the 8B's and the 32B's own prefill.
6. speculative: the cost model's parts (kvjax.speculative.cost) at Qwen3-8B shapes: plain decoding's step s, a
   verify round of b + 1 tokens c_verify(b) and a block drafter's round c_draft(b) in units of s, for b = 4 / 8 / 16
   (a random drafter shaped as DFlash's for Qwen3-8B: 5 layers at the verifier's width, reading its layers 1, 9, 17,
   25, 33), each inside the compiled verify loop (launch/bench/spec_cost.py). A drafter's measured tau then gives
   this device's speed-up: tau / (c_verify(b) + c_draft(b)); `break_even_tau` is the tau that pays for a round.
   Beside it a small model drafting one token a forward (a Qwen3-0.6B shape, random bf16 weights): c_draft_model(b)
   and break_even_tau_model, the price of the pair's small model as drafter and of speculative KV transfer's rounds
   (the same rounds; launch/bench/spec_cost.py --models / --transfer measures their tau).
7. serving: the serving cost model's parts (launch/bench/serve_cost.py) at Qwen3-32B -> Qwen3-8B shapes, priced at the
   conversation workload's middle turn: the split prefill of a whole prompt (alone and in a batch of 4), the same
   after the prompt's cached prefix (the prefix cache's path), and a decode step of 1 and of 64 rows. They give this
   device's tokens/s of the serial topology, the batched one and the batched one with the prefix cache, and the time
   to first token with and without it, for the workload the load tool runs on the toy pair.

Goals (speed issue): decode >= 70% of the HBM roofline at batch 1, map-and-insert >= 70% of copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # 32B + 8B bf16 weights (81 GB) must fit on an H200

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# Qwen3 shapes (config.json of Qwen/Qwen3-8B and Qwen/Qwen3-32B)
QWEN3_8B = dict(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288, num_layers=36, num_heads=32,
                num_kv_heads=8, head_dim=128, tie_word_embeddings=False)
QWEN3_32B = dict(vocab_size=151_936, hidden_size=5120, intermediate_size=25_600, num_layers=64, num_heads=64,
                 num_kv_heads=8, head_dim=128, tie_word_embeddings=False)
QWEN3_0_6B = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                  num_kv_heads=8, head_dim=128, tie_word_embeddings=True)
TINY_TARGET = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, tie_word_embeddings=False)
TINY_SOURCE = dict(TINY_TARGET, hidden_size=96, num_layers=3)


class Budget:
    """Wall-clock budget of the whole script; a section asks before it starts."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


# ---- 1. device -----------------------------------------------------------------------------------------------------

def matmul_peak(n: int, dtype) -> float:
    from launch.bench.kernel import median_seconds
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x: x @ x)
    return 2 * n ** 3 / median_seconds(lambda: f(a), 5)


def device_section(smoke: bool) -> dict:
    from launch.bench.kernel import NOMINAL_TBPS, copy_bandwidth
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    bw = copy_bandwidth(64 << 20 if smoke else 2 << 30)
    n = 256 if smoke else 8192
    out = {"kind": dev.device_kind, "platform": dev.platform, "devices": jax.device_count(),
           "memory_bytes": stats.get("bytes_limit"), "jax": jax.__version__, "copy_GBps": bw / 1e9,
           "nominal_hbm_TBps": next((v for k, v in NOMINAL_TBPS.items() if k in dev.device_kind), None),
           "matmul_bf16_TFLOPs": matmul_peak(n, jnp.bfloat16) / 1e12,
           "matmul_f32_TFLOPs": matmul_peak(n, jnp.float32) / 1e12}
    print(f"device {out['kind']} ({out['platform']}, {out['devices']} device(s), jax {out['jax']}): copy "
          f"{out['copy_GBps']:.0f} GB/s, matmul bf16 {out['matmul_bf16_TFLOPs']:.1f} / f32 "
          f"{out['matmul_f32_TFLOPs']:.1f} TFLOP/s")
    return out


# ---- 2. parity on the device ---------------------------------------------------------------------------------------

def parity_section(args, budget: Budget) -> dict:
    timeout = max(30.0, min(args.parity_timeout, budget.left() - 60))
    env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest", PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args.parity_tests]
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "seconds": timeout, "summary": f"timed out after {timeout:.0f} s"}
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((line for line in reversed(tail) if re.search(r"\b(passed|failed|error|skipped)\b", line)),
                   tail[-1] if tail else "")
    out = {"ok": proc.returncode == 0, "returncode": proc.returncode, "seconds": time.perf_counter() - t0,
           "summary": summary.strip("= "), "tests": args.parity_tests}
    if proc.returncode:
        out["output_tail"] = "\n".join(tail[-40:])
    print(f"parity on the device: {'OK' if out['ok'] else 'FAILED'} ({out['summary']}, {out['seconds']:.0f} s)")
    return out


# ---- 3. the map-and-insert kernel ----------------------------------------------------------------------------------

def kernel_section(args) -> list[dict]:
    from launch.bench import kernel
    kargs = argparse.Namespace(smoke=args.smoke, lengths=args.kernel_lengths, rank=256, backends=None, repeats=5,
                               block_t=None, tolerance=2e-2)
    return kernel.bench_device(kargs)


# ---- 4. decode against the HBM roofline ----------------------------------------------------------------------------

def random_model(shape: dict, seed: int, dtype):
    import kvjax
    cfg = kvjax.Qwen3Config(**shape, eos_token_ids=(), pad_token_id=0)
    return kvjax.Model(cfg, kvjax.init_params(cfg, jax.random.key(seed), dtype=dtype))


def param_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(model.params))


def decode_section(args, target, copy_bps: float) -> list[dict]:
    from kvjax.builders import NativePrefill
    from kvjax.cache import window_sizes
    from kvjax.models.decoder import decode_jit
    cfg, params = target
    ctx, steps = args.context, args.decode_steps
    capacity = ctx + 2 * steps + 64
    window = next(w for w in window_sizes(capacity) if w >= ctx + 2 * steps)
    # bytes a step must read once: every weight but the embedding table (one row per token is gathered), and the
    # K/V window attention reads (all layers, both K and V)
    weights = param_bytes(target) - (0 if cfg.tie_word_embeddings else params.embed.nbytes)
    rows = []
    # both key layouts (kvjax.cache): [B, Hkv, T, hd] and the transposed one generate's loop and the server hold,
    # measured faster on CPU (no repacking of the keys per step); which layout an accelerator prefers is this row
    for batch, transposed in [(b, t) for b in args.batches for t in (False, True)]:
        tokens = jax.random.randint(jax.random.key(batch), (batch, ctx), 0, cfg.vocab_size, jnp.int32)
        cache = NativePrefill(target)(tokens, capacity=capacity).with_keys_transposed(transposed)
        step = jnp.zeros((batch,), jnp.int32)
        logits, cache = decode_jit(params, cfg, step, cache)  # compile
        jax.block_until_ready(logits)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            logits, cache = decode_jit(params, cfg, step, cache)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * window * cfg.head_dim * cache.dtype.itemsize
        roofline = (weights + kv) / copy_bps
        row = {"batch": batch, "keys_transposed": transposed, "context": ctx, "ms_per_step": t * 1e3,
               "tokens_per_s": batch / t,
               "weights_GB": weights / 1e9, "kv_window_GB": kv / 1e9, "roofline_ms": roofline * 1e3,
               "roofline_frac": roofline / t}
        rows.append(row)
        print(f"decode batch {batch:3d} at context {ctx}{', keys transposed' if transposed else ''}: "
              f"{t * 1e3:8.3f} ms/step, {batch / t:9.1f} tok/s, "
              f"{100 * roofline / t:5.1f}% of the HBM roofline ({(weights + kv) / 1e9:.2f} GB/step at "
              f"{copy_bps / 1e9:.0f} GB/s)")
        del cache, logits
    return rows


# ---- 6. the speculative cost model's parts -------------------------------------------------------------------------

DFLASH_QWEN3_8B = dict(num_layers=5, feature_layers=(1, 9, 17, 25, 33))  # DFlash's published Qwen3-8B drafter shape


def speculative_section(args, target) -> list[dict]:
    from kvjax.drafter import block_drafter, drafter_config, init_drafter
    from kvjax.speculative import ModelDrafter
    from launch.bench.spec_cost import Runs, measure_parts
    cfg = target.cfg
    shape = dict(num_layers=1, feature_layers=None) if args.smoke else DFLASH_QWEN3_8B
    dcfg = drafter_config(cfg, num_layers=shape["num_layers"], feature_layers=shape["feature_layers"],
                          block_sizes=tuple(args.spec_blocks))
    dtype = target.params.embed.dtype
    dparams = jax.tree.map(lambda x: x.astype(dtype), init_drafter(dcfg, jax.random.key(5)))
    parts = {f"block-{b}": block_drafter(target, dcfg, dparams, draft_len=b) for b in args.spec_blocks}
    small = random_model(dict(TINY_TARGET, hidden_size=32, num_layers=1) if args.smoke else QWEN3_0_6B, 7, dtype)
    parts.update({f"model-{b}": ModelDrafter(small, draft_len=b) for b in args.spec_blocks})
    prompt = np.asarray(jax.random.randint(jax.random.key(9), (args.context,), 0, cfg.vocab_size)).tolist()
    runs = Runs(target, prompt, args.spec_tokens, max(args.spec_blocks))
    costs = measure_parts(runs, parts, args.spec_repeats, cfg.vocab_size, variable=False)
    s = costs["step"]
    rows = []
    for b in args.spec_blocks:
        cv, cd = costs["verify"]["fixed"][b][b + 1] / s, costs["draft"][f"block-{b}"] / s
        cm = costs["draft"][f"model-{b}"] / s
        row = {"block": b, "context": args.context, "step_ms": s * 1e3, "c_verify": cv, "c_draft": cd,
               "break_even_tau": cv + cd, "drafter_layers": dcfg.num_layers,
               "feature_layers": list(dcfg.feature_layers), "c_draft_model": cm, "break_even_tau_model": cv + cm,
               "model_drafter_layers": small.cfg.num_layers, "model_drafter_hidden": small.cfg.hidden_size}
        rows.append(row)
        print(f"speculative b={b:2d} at context {args.context}: step {s * 1e3:.3f} ms, c_verify {cv:.2f}, c_draft "
              f"{cd:.2f} steps: speed-up = tau / {cv + cd:.2f}; a small model drafting: c_draft {cm:.2f}, tau / "
              f"{cv + cm:.2f}")
    return rows


# ---- 5. time to first token of the split path ----------------------------------------------------------------------

def random_kvmap(source_cfg, target_cfg, rank: int, residual: int):
    from launch.bench.kernel import random_maps
    from kvjax.mapper.kvmap import KVMap, spec_for
    from kvjax.mapper.pairing import depth_pairing
    fx = source_cfg.num_kv_heads * source_cfg.head_dim
    fy = target_cfg.num_kv_heads * target_cfg.head_dim
    n = target_cfg.num_layers
    return KVMap(keys=tuple(random_maps(jax.random.key(1), n, fx, fy, rank, residual)),
                 values=tuple(random_maps(jax.random.key(2), n, fx, fy, rank, residual)),
                 spec=spec_for(source_cfg, target_cfg, depth_pairing(source_cfg.num_layers, n), rank, residual))


def ttft_section(args, source, target, budget: Budget) -> list[dict]:
    import kvjax
    from kvjax.kernels.map_insert import platform_backend
    kvmap = random_kvmap(source.cfg, target.cfg, args.rank, 16)
    impl = "pallas" if platform_backend() else "xla"
    rows = []
    for n in args.ttft_lengths:
        if budget.left() < args.reserve:
            rows.append({"tokens": n, "skipped": f"budget: {budget.left():.0f} s left"})
            print(f"ttft at {n}: skipped (budget)")
            continue
        prompt = np.asarray(jax.random.randint(jax.random.key(n), (1, n + 1), 0, target.cfg.vocab_size, jnp.int32))
        arms = {
            "split": lambda p=prompt: kvjax.split_generate(source, target, kvmap, p, 1, timings=True, impl=impl),
            "target_native": lambda p=prompt: kvjax.native_generate(target, p, 1, timings=True),
            "source_native": lambda p=prompt: kvjax.native_generate(source, p, 1, timings=True),
        }
        row = {"tokens": n, "map_impl": impl}
        for name, fn in arms.items():
            fn()  # compile
            phases = [fn()[1] for _ in range(args.ttft_repeats)]
            ttft = [sum(v for k, v in ph.items() if k != "decode") for ph in phases]
            row[f"{name}_ms"] = statistics.median(ttft) * 1e3
            row[f"{name}_phases_ms"] = {k: statistics.median(ph[k] for ph in phases) * 1e3
                                        for k in phases[0] if k != "decode"}
        row["split_vs_target"] = row["split_ms"] / row["target_native_ms"]
        row["split_vs_source"] = row["split_ms"] / row["source_native_ms"]
        rows.append(row)
        print(f"ttft at {n:6d} tokens: split {row['split_ms']:9.2f} ms ({row['split_phases_ms']}), target native "
              f"{row['target_native_ms']:9.2f} ms, source native {row['source_native_ms']:9.2f} ms")
    return rows


# ---- 7. the serving cost model's parts -----------------------------------------------------------------------------

def serving_section(args, source, target) -> dict:
    import dataclasses

    from launch.bench.serve_cost import SMOKE, Workload, measure, predict
    w = SMOKE if args.smoke else Workload()
    kvmap = random_kvmap(source.cfg, target.cfg, args.rank, 16)
    turn = w.turns // 2 + 1  # one turn's shapes stand for all: each 32B prefill shape is a compile
    parts = measure(source, target, kvmap, w, args.serve_repeats, turns=[turn])
    pred = predict(w, parts)
    print(f"serving (conversation, priced at turn {turn}): x serial {pred['batched']['x_serial']:.2f} batched, "
          f"{pred['batched+prefix']['x_serial']:.2f} with the prefix cache; mean TTFT with / without it "
          f"{pred['ttft_prefix_vs_batched']:.2f}")
    return {"workload": dataclasses.asdict(w), "priced_at_turn": turn, "parts": parts, "predicted": pred}


# ---- the table -----------------------------------------------------------------------------------------------------

def table(result: dict) -> str:
    lines = ["| check | result |", "|---|---|"]
    d = result.get("device", {})
    if d:
        lines.append(f"| device | {d['kind']} ({d['platform']}), copy {d['copy_GBps']:.0f} GB/s, matmul bf16 "
                     f"{d['matmul_bf16_TFLOPs']:.0f} TFLOP/s |")
    for name, sec in result.items():
        if isinstance(sec, dict) and "skipped" in sec:
            lines.append(f"| {name} | skipped: {sec['skipped']} |")
    p = result.get("parity")
    if isinstance(p, dict) and "ok" in p:
        lines.append(f"| parity on the device | {'OK' if p['ok'] else 'FAILED'}: {p['summary']} |")
    for r in result.get("kernel", []) if isinstance(result.get("kernel"), list) else []:
        lines.append(f"| map+insert T={r['tokens']} {r['impl']} | {r['ms']:.3f} ms, {r['GB/s']:.0f} GB/s = "
                     f"{100 * r['bw_frac']:.0f}% of copy |")
    for r in result.get("decode", []) if isinstance(result.get("decode"), list) else []:
        lines.append(f"| decode batch {r['batch']} ctx {r['context']}{' keys transposed' * r['keys_transposed']} | "
                     f"{r['tokens_per_s']:.1f} tok/s, "
                     f"{100 * r['roofline_frac']:.0f}% of HBM roofline |")
    for r in result.get("speculative", []) if isinstance(result.get("speculative"), list) else []:
        lines.append(f"| speculative b={r['block']} ctx {r['context']} | c_verify {r['c_verify']:.2f} + c_draft "
                     f"{r['c_draft']:.2f} steps of {r['step_ms']:.2f} ms: speed-up = tau / {r['break_even_tau']:.2f}; "
                     f"a small model drafting: tau / {r['break_even_tau_model']:.2f} |")
    sv = result.get("serving", {})
    if "predicted" in sv:
        p = sv["predicted"]
        lines.append(f"| serving, conversation at turn {sv['priced_at_turn']} | predicted x serial: batched "
                     f"{p['batched']['x_serial']:.2f}, with the prefix cache {p['batched+prefix']['x_serial']:.2f}; "
                     f"mean TTFT with / without it {p['ttft_prefix_vs_batched']:.2f} |")
    for r in result.get("ttft", []) if isinstance(result.get("ttft"), list) else []:
        if "skipped" in r:
            lines.append(f"| ttft {r['tokens']} | skipped ({r['skipped']}) |")
        else:
            lines.append(f"| ttft {r['tokens']} | split {r['split_ms']:.1f} ms vs target {r['target_native_ms']:.1f} "
                         f"ms, source {r['source_native_ms']:.1f} ms |")
    return "\n".join(lines)


def run(args) -> dict:
    from kvjax.kernels.map_insert import platform_backend
    if platform_backend() is None and not args.smoke:
        sys.exit("launch.bench.accelerator: no GPU/TPU here; run it on an accelerator, or pass --smoke on CPU")
    budget = Budget(args.budget)
    result: dict = {"argv": sys.argv[1:], "smoke": args.smoke, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime())}

    def section(name, fn, need: float):
        if name not in args.sections:
            result[name] = {"skipped": "not selected (--sections)"}
        elif budget.left() < need:
            result[name] = {"skipped": f"budget: {budget.left():.0f} s left, needs ~{need:.0f} s"}
        else:
            t0 = time.perf_counter()
            try:
                result[name] = fn()
            except Exception as e:  # noqa: BLE001 - one section's failure must not lose the others' numbers
                result[name] = {"skipped": f"error: {type(e).__name__}: {e}"}
                print(f"{name}: ERROR {type(e).__name__}: {e}")
            result.setdefault("seconds", {})[name] = time.perf_counter() - t0
        if args.out:  # written after every section: a killed run keeps what it measured
            with open(args.out + ".tmp", "w") as f:
                json.dump(result, f, indent=1, default=str)
            os.replace(args.out + ".tmp", args.out)

    section("device", lambda: device_section(args.smoke), 0)
    copy_bps = result["device"]["copy_GBps"] * 1e9 if "copy_GBps" in result.get("device", {}) else 1e12
    section("parity", lambda: parity_section(args, budget), 60)
    section("kernel", lambda: kernel_section(args), 60)
    dtype = jnp.float32 if args.smoke else jnp.bfloat16
    models = {}
    if {"decode", "speculative", "ttft", "serving"} & set(args.sections):
        models["target"] = random_model(TINY_TARGET if args.smoke else QWEN3_8B, 1, dtype)
    section("decode", lambda: decode_section(args, models["target"], copy_bps), 60)
    if "ttft" in args.sections and budget.left() >= args.reserve:
        models["source"] = random_model(TINY_SOURCE if args.smoke else QWEN3_32B, 0, dtype)
    section("ttft", lambda: ttft_section(args, models["source"], models["target"], budget), args.reserve)
    # ~7 compiled 8B verify loops: it needs more than a TTFT length, and what it measures matters less than TTFT
    section("speculative", lambda: speculative_section(args, models["target"]), 0 if args.smoke else 150)
    if "serving" in args.sections and "source" not in models and budget.left() >= (0 if args.smoke else 120):
        models["source"] = random_model(TINY_SOURCE if args.smoke else QWEN3_32B, 0, dtype)
    section("serving", lambda: serving_section(args, models["source"], models["target"]), 0 if args.smoke else 120)
    models.pop("source", None)
    result["table"] = table(result)
    print(result["table"])
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1, default=str)
        os.replace(args.out + ".tmp", args.out)
    return result


SECTIONS = ("device", "parity", "kernel", "decode", "ttft", "speculative", "serving")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, kernel in interpret mode")
    p.add_argument("--out", help="write the results as JSON here (after every section)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole script (default 7.5 min)")
    p.add_argument("--reserve", type=float, default=90.0, help="seconds a TTFT length needs before it starts")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--parity-tests", nargs="+", default=["tests/test_parity.py"])
    p.add_argument("--parity-timeout", type=float, default=150.0)
    p.add_argument("--kernel-lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--spec-blocks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--spec-tokens", type=int, default=32, help="tokens per timed verify loop")
    p.add_argument("--spec-repeats", type=int, default=3)
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--serve-repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.smoke:  # CPU-sized everything; the parity run is one quick test (CI runs the whole file anyway)
        args.kernel_lengths, args.context, args.decode_steps = [48], 64, 4
        args.spec_blocks, args.spec_tokens, args.spec_repeats = [2, 4], 6, 1
        args.batches, args.ttft_lengths, args.ttft_repeats, args.reserve = [1, 4], [64], 1, 0.0
        if args.parity_tests == ["tests/test_parity.py"]:
            args.parity_tests = ["tests/test_parity.py::test_fp32_loading_of_bf16_checkpoint_upcasts"]
    return args


def main(argv=None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()

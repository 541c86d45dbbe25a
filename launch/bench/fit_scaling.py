"""Fit throughput vs device count, and the per-device memory of a 32B -> 8B pod run (by calculation).

    python -m launch.bench.fit_scaling --devices 1 2 4 8      # calibration-statistics tokens/s per device count
    python -m launch.bench.fit_scaling --memory                # memory per device, Qwen3-32B -> Qwen3-8B, bf16

Throughput: each device count runs in its own process with that many fake CPU devices (XLA_FLAGS), collecting
ridge statistics (both models' prefill + per-layer feature sums: the fit's hot loop) for the shipped toy pair on a
('data' = N, 'model' = 1) mesh; the N = 1 row also runs the plain single-device path. Compile first, then the
median of --repeats timed passes over --batches batches. Fake devices share this machine's cores, so the numbers
show the overhead of splitting the work, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def worker(args) -> dict:
    import jax
    import kvjax
    from kvjax import sharding
    from kvjax.fitting.calibrate import batches_of, collect_stats, row_batches
    from kvjax.mapper.pairing import depth_pairing
    source = kvjax.load_hf(os.path.join(args.toy_dir, "source"))
    target = kvjax.load_hf(os.path.join(args.toy_dir, "target"))
    n = jax.device_count()
    windows = np.random.RandomState(0).randint(3, target[0].vocab_size, (args.batch * args.batches, args.window))
    windows = windows.astype(np.int32)
    pairing = depth_pairing(source[0].num_layers, target[0].num_layers)
    paths = {"mesh": sharding.make_mesh(data=n, model=1)}
    if n == 1:
        paths["single"] = None
    out = {"devices": n}
    for name, mesh in paths.items():
        batches = (lambda w: batches_of(w, args.batch)) if mesh is None else (lambda w: row_batches(w, args.batch))
        t0 = time.perf_counter()
        collect_stats(source, target, pairing, batches(windows[: args.batch]), mesh=mesh)  # compile
        compile_s = time.perf_counter() - t0
        times, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            collect_stats(source, target, pairing, batches(windows), mesh=mesh)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        tokens = windows.size
        out[name] = {"tokens_per_s": tokens / float(np.median(times)), "seconds": float(np.median(times)),
                     "cpu_seconds": float(np.median(cpu)), "first_call_s": compile_s, "tokens": tokens}
    out["loadavg_1min"] = os.getloadavg()[0]
    return out


def scaling(args) -> list[dict]:
    rows = []
    for n in args.devices:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        cmd = [sys.executable, "-m", "launch.bench.fit_scaling", "--worker", "--toy-dir", args.toy_dir,
               "--batch", str(args.batch), "--batches", str(args.batches), "--window", str(args.window),
               "--repeats", str(args.repeats)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"worker with {n} devices failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows)
    return rows


def print_table(rows: list[dict]) -> None:
    """Wall-clock tokens/s, and tokens per CPU-second (all threads): the second is the overhead measure that
    survives a busy machine."""
    base = rows[0]["mesh"]
    print("\n| fake devices | tokens/s (wall) | vs 1 | tokens per CPU-s | vs 1 | CPU s per pass | 1-min load |")
    print("|---|---|---|---|---|---|---|")
    entries = [(str(r["devices"]), r["mesh"], r["loadavg_1min"]) for r in rows]
    if "single" in rows[0]:
        entries.insert(1, ("1 (plain path, no mesh)", rows[0]["single"], rows[0]["loadavg_1min"]))
    for name, m, load in entries:
        per_cpu, base_cpu = m["tokens"] / m["cpu_seconds"], base["tokens"] / base["cpu_seconds"]
        print(f"| {name} | {m['tokens_per_s']:.0f} | {m['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
              f"{per_cpu:.0f} | {per_cpu / base_cpu:.2f}x | {m['cpu_seconds']:.2f} | {load:.1f} |")


# ---- memory per device for a pod run, by calculation -------------------------------------------------------------

QWEN3_32B = dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64, num_heads=64,
                 num_kv_heads=8, head_dim=128, tie_word_embeddings=False)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32,
                num_kv_heads=8, head_dim=128, tie_word_embeddings=False)


def _sharded_bytes(shape, axes, mesh, itemsize) -> float:
    from kvjax.sharding import spec_for
    spec = spec_for(axes, shape, mesh)
    n = float(np.prod(shape))
    for s in spec:
        if s is not None:
            n /= mesh.shape[s]
    return n * itemsize


def memory(model_axis: int, data_axis: int, batch: int, window: int, res_batch: int, prefix: int, cont: int,
           rank: int | None, residual_rank: int) -> dict:
    """GB per device of each thing the fit / residual job holds (bf16 models, float32 map and statistics)."""
    import jax
    from kvjax.models.config import Qwen3Config
    from kvjax.models.params import param_specs
    from kvjax.cache import AXES
    mesh = jax.sharding.AbstractMesh((data_axis, model_axis), ("data", "model"))
    gb = 1e9
    out = {}
    cfgs = {}
    for name, d in (("source", QWEN3_32B), ("target", QWEN3_8B)):
        cfg = Qwen3Config(**d, rope_theta=1e6, eos_token_ids=(), pad_token_id=0)
        cfgs[name] = cfg
        total = sum(float(np.prod(s.shape)) for s in param_specs(cfg).values())
        out[f"{name} params ({total / 1e9:.2f}B, bf16)"] = sum(
            _sharded_bytes(s.shape, s.axes, mesh, 2) for s in param_specs(cfg).values()) / gb
    scfg, tcfg = cfgs["source"], cfgs["target"]
    b_local = batch // data_axis
    for name, cfg in (("source", scfg), ("target", tcfg)):  # calibration caches [L, B, Hkv, T, hd], K and V, bf16
        shape = (cfg.num_layers, b_local, cfg.num_kv_heads, window, cfg.head_dim)
        out[f"{name} cache (calibration batch)"] = 2 * _sharded_bytes(shape, AXES, mesh, 2) / gb
    fx = scfg.num_kv_heads * scfg.head_dim  # one paired source layer (depth pairing)
    fy = tcfg.num_kv_heads * tcfg.head_dim
    per = fx * fx + fx * fy + fx + 2 * fy + 1  # n, means, Cxx, Cxy, diag(Cyy)
    out["statistics (one batch, f32, replicated over 'model')"] = 2 * tcfg.num_layers * per * 4 / gb
    r = fy if rank is None else rank
    map_floats = 2 * tcfg.num_layers * (fx + 1 + fx * r + r * fy + fy + fx * residual_rank + residual_rank
                                        + residual_rank * fy)
    train_floats = 2 * tcfg.num_layers * (fx * residual_rank + residual_rank + residual_rank * fy)
    out["map params (f32, replicated)"] = map_floats * 4 / gb
    out["map gradients + Adam moments (trainable part)"] = 3 * train_floats * 4 / gb
    tokens = (res_batch // data_axis) * (prefix + cont)
    v_local = scfg.vocab_size / model_axis if scfg.vocab_size % model_axis == 0 else scfg.vocab_size
    out["teacher logits (residual step, f32, vocab over 'model')"] = tokens * v_local * 4 / gb
    kv_local = tcfg.num_kv_heads / model_axis if tcfg.num_kv_heads % model_axis == 0 else tcfg.num_kv_heads
    out["mapped target cache (residual step, bf16)"] = (2 * tcfg.num_layers * (res_batch // data_axis) * kv_local
                                                       * (prefix + cont) * tcfg.head_dim * 2) / gb
    # the largest live activations of the source prefill (one layer at a time; block-causal attention in query
    # blocks of 128): residual stream [B, T, D] bf16, gate/up [B, T, F/M] bf16, one block's f32 scores
    heads_local = scfg.num_heads / model_axis if scfg.num_heads % model_axis == 0 else scfg.num_heads
    for name, b, t in (("calibration", b_local, window), ("residual", res_batch // data_axis, prefix + cont)):
        act = (2 * b * t * scfg.hidden_size + 2 * 2 * b * t * scfg.intermediate_size / model_axis
               + 4 * b * heads_local * 128 * t)
        out[f"activations, source prefill ({name}, estimate)"] = act / gb
    out["host: float64 statistics (calibration + held-out accumulators, per process)"] = \
        2 * 2 * tcfg.num_layers * per * 8 / gb
    return out


def print_memory(args) -> None:
    for m in args.model_axis:
        rows = memory(m, args.data_axis, args.batch_pod, args.window_pod, args.res_batch_pod, args.prefix_pod,
                      args.cont_pod, None, 16)
        fit = {"source params", "target params", "source cache", "target cache", "statistics", "map params",
               "activations, source prefill (calibration"}
        res = {"source params", "target params", "map params", "map gradients", "teacher logits", "mapped target",
               "activations, source prefill (residual"}
        stage = lambda keys: sum(v for k, v in rows.items() if any(k.startswith(x) for x in keys))  # noqa: E731
        device, residual = stage(fit), stage(res)
        print(f"\nmodel axis {m}, data axis {args.data_axis} ({m * args.data_axis} devices); calibration batch "
              f"{args.batch_pod} x {args.window_pod} tokens, residual batch {args.res_batch_pod} x "
              f"({args.prefix_pod}+{args.cont_pod})")
        print("| per device | GB |\n|---|---|")
        for k, v in rows.items():
            print(f"| {k} | {v:.3f} |")
        print(f"| **device peak, fit stage** (params, caches, statistics, map, activations) | **{device:.2f}** |")
        print(f"| **device peak, residual stage** | **{residual:.2f}** |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--toy-dir", default="checkpoints/toy")
    p.add_argument("--batch", type=int, default=8, help="global calibration batch (windows)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help="print the 32B -> 8B memory table and exit")
    p.add_argument("--model-axis", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--data-axis", type=int, default=4)
    p.add_argument("--batch-pod", type=int, default=32)
    p.add_argument("--window-pod", type=int, default=2048)
    p.add_argument("--res-batch-pod", type=int, default=32)
    p.add_argument("--prefix-pod", type=int, default=1024)
    p.add_argument("--cont-pod", type=int, default=128)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
    elif args.memory:
        print_memory(args)
    else:
        scaling(args)


if __name__ == "__main__":
    main()

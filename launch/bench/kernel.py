"""Benchmarks of the fused map-and-insert kernel (kvjax.kernels.map_insert) and of the pipelined split path.

    python -m launch.bench.kernel                 # on a GPU/TPU: kernel vs XLA map at 1K-16K tokens, 32B->8B shapes
    python -m launch.bench.kernel --smoke         # the same on CPU, tiny shapes, kernels in interpret mode (tests)
    taskset -c 1 python -m launch.bench.kernel --ttft   # CPU, toy pair: time to first token, split / native

Device mode: random weights in Qwen3-32B -> Qwen3-8B shapes (source cache 64 layers x 8 kv heads x 128, target
36 x 8 x 128, bf16, batch 1, depth pairing, ridge rank 256 + residual 16). For each length it maps all 36 target
layers (a) with the kernel, bf16 weights, (b) the kernel with f32 weights, (c) the XLA path (`apply_map`'s math,
f32), each jitted with the target cache donated; prints the median time, the bytes the map must move (paired source
K/V read + target K/V written + weights) / time against the device's copy bandwidth measured in the same run, the
achieved matmul TFLOP/s, and the kernel's error against the XLA result (exit status 1 on a mismatch). Sized for
well under 5 minutes on one GPU (15 compiles, 5 timed runs each; not yet run on a GPU: no device was available when
it was written); memory peaks at ~10 GB at 16K.

TTFT mode: the shipped toy pair (checkpoints/toy), a map fitted on random tokens (or --map DIR). Time to the first
token (from host tokens to the token id on the host) of the source alone (native prefill of the whole prompt into
its cache, argmax of the last logits) against the split path: as kvjax.split_generate runs it today (source
prefill of all but the last token, apply_map, target forward on the last token) and pipelined
(kvjax.builders.pipelined.pipelined_prefill_map, then the target's forward). Interleaved repeats, medians, and the
share of the pinned CPUs other processes used meanwhile ("other load": trust numbers taken with little), and the
ratio of the process's CPU time per call (less sensitive to other load on a single pinned CPU).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.kernels import map_insert as mi

NOMINAL_TBPS = {"H100": 3.35, "H200": 4.8, "A100": 2.0, "GH200": 4.0, "B200": 8.0}  # HBM, for reference only


# ---- device benchmark ----------------------------------------------------------------------------------------------

def random_maps(key, n, fx, fy, rank, residual):
    from kvjax.mapper.kvmap import LinearMap
    out = []
    for j in range(n):
        ks = jax.random.split(jax.random.fold_in(key, j), 7)
        nrm = lambda k, s, sc: jax.random.normal(k, s, jnp.float32) * sc  # noqa: E731
        out.append(LinearMap(mu=nrm(ks[0], (fx,), 0.3), scale=jnp.float32(1.0), w_in=nrm(ks[1], (fx, rank), fx ** -0.5),
                             w_out=nrm(ks[2], (rank, fy), rank ** -0.5), bias=nrm(ks[3], (fy,), 0.1),
                             down=nrm(ks[4], (fx, residual), fx ** -0.5), res_bias=nrm(ks[5], (residual,), 0.1),
                             up=nrm(ks[6], (residual, fy), 0.3 * residual ** -0.5)))
    return out


def copy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a jitted read+write pass over `nbytes` (x * 2: one read, one write)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * 2.0)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 2 * x.nbytes / min(times)


def median_seconds(fn, repeats: int) -> float:
    """Median seconds of fn() (its result waited for) over `repeats` calls after an untimed one (compile + first
    run)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed(fn, state, repeats):
    """Median seconds of state = fn(state) (the target buffers are donated and handed back each call)."""
    state = jax.block_until_ready(fn(state))  # compile + first run
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(fn(state))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def bench_device(args) -> list[dict]:
    from kvjax.mapper.pairing import depth_pairing
    smoke = args.smoke
    if smoke:  # tiny shapes, interpret mode: proves the script end to end on CPU
        ls, lt, hs, ht, hd, rank, res, lengths, repeats = 4, 3, 2, 2, 32, 16, 4, (48,), 1
    else:
        ls, lt, hs, ht, hd, rank, res, lengths, repeats = 64, 36, 8, 8, 128, args.rank, 16, args.lengths, args.repeats
    backend = mi.platform_backend()
    if backend is None and not smoke:
        sys.exit("no GPU/TPU here: the device benchmark needs one (use --smoke on CPU)")
    interpret = smoke
    backends = args.backends or [backend or "triton"]
    dtype = jnp.bfloat16
    pairing = depth_pairing(ls, lt)
    fx, fy = hs * hd, ht * hd
    keys = random_maps(jax.random.key(1), lt, fx, fy, rank, res)
    values = random_maps(jax.random.key(2), lt, fx, fy, rank, res)
    dev = jax.devices()[0]
    bw = copy_bandwidth(64 << 20 if smoke else 2 << 30)
    nominal = next((v for k, v in NOMINAL_TBPS.items() if k in dev.device_kind), None)
    print(f"device {dev.device_kind} ({dev.platform}); measured copy bandwidth {bw / 1e9:.0f} GB/s"
          + (f" (nominal HBM {nominal:.2f} TB/s)" if nominal else ""))
    print(f"shapes: source {ls} layers x {hs} kv x {hd}, target {lt} x {ht} x {hd}, rank {rank} + residual {res}, "
          f"{jnp.dtype(dtype).name} caches, batch 1, depth pairing")
    common = dict(pairing=pairing, tgt_layers=tuple(range(lt)), src_rope=1e6, tgt_rope=1e6)
    rows = []
    for n in lengths:
        kk = jax.random.split(jax.random.key(n), 2)
        src_k = jax.random.normal(kk[0], (ls, 1, hs, n, hd), dtype)
        src_v = jax.random.normal(kk[1], (ls, 1, hs, n, hd), dtype)
        fresh = lambda n=n: tuple(jnp.zeros((lt, 1, ht, n, hd), dtype) for _ in range(2))  # noqa: E731
        xla = jax.jit(lambda s, sk, sv, km, vm, n=n: mi.map_insert_reference(sk, sv, *s, km, vm, length=n, **common),
                      donate_argnums=0)
        ref_time, ref = timed(lambda s: xla(s, src_k, src_v, keys, values), fresh(), repeats)
        io = 2 * lt * n * (hs * hd + ht * hd) * jnp.dtype(dtype).itemsize
        variants = [("xla f32", ref_time, 4 * (fx * rank + rank * fy + fx * res + res * fy) * lt * 2, None)]
        for bk in backends:
            for wname, wdt in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
                pk = mi.pack_maps(keys, hs, ht, dtype=wdt, backend=bk)
                pv = mi.pack_maps(values, hs, ht, dtype=wdt, backend=bk)
                fn = jax.jit(lambda s, sk, sv, pk, pv, n=n, bk=bk: mi.map_insert_call(
                    sk, sv, *s, pk, pv, length=n, backend=bk, interpret=interpret, block_t=args.block_t, **common),
                    donate_argnums=0)
                t, out = timed(lambda s: fn(s, src_k, src_v, pk, pv), fresh(),
                               repeats)
                err = max(float(jnp.max(jnp.abs(o.astype(jnp.float32) - r.astype(jnp.float32)))
                                / jnp.max(jnp.abs(r.astype(jnp.float32)))) for o, r in zip(out, ref))
                wbytes = sum(w.nbytes for w in pk.leaves() + pv.leaves())
                name = f"pallas {bk}{' (interpret)' if interpret else ''} {wname} weights"
                variants.append((name, t, wbytes, err))
        flops = 2 * 2 * lt * n * (rank + res) * (fx + fy)
        for name, t, wbytes, err in variants:
            moved = io + wbytes
            row = {"tokens": n, "impl": name, "ms": t * 1e3, "GB/s": moved / t / 1e9, "bw_frac": moved / t / bw,
                   "TFLOP/s": flops / t / 1e12, "rel_err_vs_xla": err, "bytes": moved, "weight_bytes": wbytes,
                   "copy_GBps": bw / 1e9}
            rows.append(row)
            check = "" if err is None else f"  max|kernel - xla| / max|xla| = {err:.2e}" + \
                ("  OK" if err < args.tolerance else "  MISMATCH")
            print(f"T={n:6d}  {name:42s} {t * 1e3:9.3f} ms  {moved / 1e6:8.1f} MB  {moved / t / 1e9:8.1f} GB/s "
                  f"({100 * moved / t / bw:5.1f}% of copy bw)  {flops / t / 1e12:7.2f} TFLOP/s{check}")
    bad = [r for r in rows if r["rel_err_vs_xla"] is not None and r["rel_err_vs_xla"] >= args.tolerance]
    if bad:
        sys.exit(f"kernel does not match the XLA path within {args.tolerance}: {bad}")
    return rows


# ---- time to first token on CPU (toy pair) -------------------------------------------------------------------------

def cpus_busy_seconds(cpus) -> float:
    with open("/proc/stat") as f:
        rows = [[int(t) for t in line.split()[1:9]] for line in f if line.split()[0] in {f"cpu{c}" for c in cpus}]
    return sum(sum(r) - r[3] - r[4] for r in rows) / os.sysconf("SC_CLK_TCK")


def bench_ttft(args) -> list[dict]:
    import kvjax
    from kvjax.builders import Mapped, Pipelined
    from kvjax.models.decoder import prefill_forward
    from kvjax.generation import CACHE_ALIGN
    from kvjax.windows import sample
    from kvjax.models.decoder import decode_jit

    source, target = (kvjax.load_hf(f"{args.toy_dir}/{r}") for r in ("source", "target"))
    (scfg, sparams), (tcfg, tparams) = source, target
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, scfg.vocab_size, 400_000).astype(np.int32)
    if args.map:
        kvmap = kvjax.load_map(args.map, scfg, tcfg)
    else:
        pairing = "depth" if args.pairing == "depth" else tuple((int(s),) for s in args.pairing.split(","))
        kvmap, _ = kvjax.fit_map(source, target, sample(tokens, 16, 256, seed=1),
                                 sample(tokens, 8, 256, seed=2), pairing=pairing)
    cpus = sorted(os.sched_getaffinity(0))
    print(f"toy pair: source {scfg.num_layers} layers x {scfg.hidden_size}, target {tcfg.num_layers} x "
          f"{tcfg.hidden_size}; pairing {kvmap.spec.pairing}; pinned to CPUs {cpus}; loadavg "
          f"{open('/proc/loadavg').read().split()[:3]}")

    @functools.partial(jax.jit, static_argnames="capacity")
    def native(params, prompt, capacity):  # the cache made inside the jit: ~5% faster than kvjax.prefill's
        logits, cache, _, _ = prefill_forward(params, scfg, prompt, capacity=capacity)  # donated one: stricter
        return jnp.argmax(logits[0]), cache

    def run_native(prompt, capacity):
        tok, cache = native(sparams, prompt, capacity)
        return int(tok), cache

    def run_split(prompt, capacity, pipeline):
        t = prompt.shape[1] - 1
        cache = builders[pipeline](np.asarray(prompt[:, :t]), capacity=capacity)
        logits, cache = decode_jit(tparams, tcfg, prompt[:, t], cache)
        return int(jnp.argmax(logits[0])), cache

    builders = {False: Mapped(source, target, kvmap), True: Pipelined(source, target, kvmap, impl="xla")}
    variants = {"native source": lambda p, c: run_native(p, c),
                "split (prefill, then map)": lambda p, c: run_split(p, c, False),
                "split pipelined": lambda p, c: run_split(p, c, True)}
    rows = []
    for n in args.ttft_lengths:
        prompt = jnp.asarray(tokens[None, 1000:1000 + n])
        capacity = math.ceil((n + args.new_tokens) / CACHE_ALIGN) * CACHE_ALIGN
        for fn in variants.values():
            jax.block_until_ready(fn(prompt, capacity))  # compile
        times, cpu_times = {k: [] for k in variants}, {k: [] for k in variants}
        busy0, cpu0, wall0 = cpus_busy_seconds(cpus), time.process_time(), time.perf_counter()
        names = list(variants)
        for r in range(args.ttft_repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order every round
                t0, c0 = time.perf_counter(), time.process_time()
                jax.block_until_ready(variants[name](prompt, capacity))
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
        other = cpus_busy_seconds(cpus) - busy0 - (time.process_time() - cpu0)
        load = max(0.0, other) / ((time.perf_counter() - wall0) * len(cpus))
        med = {k: statistics.median(v) for k, v in times.items()}
        base = med["native source"]
        for name, t in med.items():
            best = min(times[name]) / min(times["native source"])
            cpu = statistics.median(cpu_times[name]) / statistics.median(cpu_times["native source"])
            rows.append({"tokens": n, "path": name, "ttft_ms": t * 1e3, "ratio": t / base, "ratio_of_min": best,
                         "cpu_ratio": cpu, "other_load": load, "all_ms": [round(x * 1e3, 1) for x in times[name]]})
            print(f"T={n:5d}  {name:28s} TTFT median {t * 1e3:8.1f} ms  / native {t / base:.3f}  (min / min "
                  f"{best:.3f}; CPU-time ratio {cpu:.3f}; other load {100 * load:.0f}%; runs {rows[-1]['all_ms']})")
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (runs on CPU)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--backends", nargs="+", choices=mi.BACKENDS, default=None,
                   help="kernel bodies to run (default: the platform's; --smoke: triton, add mosaic_tpu for the TPU "
                        "interpreter)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block-t", type=int, default=None, help="positions per kernel block (default per backend)")
    p.add_argument("--tolerance", type=float, default=2e-2, help="max relative error of the kernel vs XLA")
    p.add_argument("--ttft", action="store_true", help="CPU time-to-first-token of the split path, toy pair")
    p.add_argument("--toy-dir", default="checkpoints/toy")
    p.add_argument("--map", default=None, help="a saved map for --ttft (default: fit one on random tokens)")
    p.add_argument("--pairing", default="depth",
                   help="--ttft map's pairing: 'depth' or one source layer per target layer, e.g. '2,5' (with the "
                        "last source layer paired, the pipelined source runs every layer)")
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--ttft-repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=32, help="decode room in the caches (capacity)")
    args = p.parse_args(argv)
    return bench_ttft(args) if args.ttft else bench_device(args)


if __name__ == "__main__":
    main()

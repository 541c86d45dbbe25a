"""Foundation benchmark: kvjax vs transformers (torch, CPU) on one random-init 33.6M Qwen3, float32.

    launch/venv python -m launch.bench.foundation --out bench_foundation.json   # full run, 5-8 minutes
    launch/venv python -m launch.bench.foundation --quick                       # smoke run, ~1 minute

Reports prefill tokens/s at several prompt lengths (full logits [1, T, V] on both sides) against the machine's f32
matmul peak measured in the same run (each library's own 2048^3 product; the faster one is the peak), decode
tokens/s at batch 1 with the cache holding `ctx` tokens (one step called from Python: kvjax's decode_step,
transformers' forward with a DynamicCache; and each library's generation loop: kvjax.generate's in-jit loop,
transformers' `generate`, greedy, the tokens after the first over their time) against the decode roofline (read
bandwidth / bytes read per token: all weights a step touches, the live KV cache; float32; the read bandwidth is the
higher of numpy's sum and XLA's matrix-vector product over 1 GiB), and batched decode:
tokens/s at batch 1-64 with every row at `--batch-context` tokens. kvjax's decode caches hold their keys transposed
(`keys_transposed=True`, the layout its generate loop and server decode on; kvjax.cache).

Method: transformers writes the checkpoint; both sides load it. Each side (kvjax, torch, bandwidth) is a worker
process of this script pinned with `taskset -c CPUS`, one thread per CPU (XLA sizes its pool from the affinity
mask), that loads and compiles once and then runs one round per request while the others sit idle. Rounds
alternate the order of the sides; the report is the median over rounds of per-round medians. Decode holds the
context fixed (kvjax resets the cache lengths, transformers crops its cache). OpenMP waits passively: spinning makes
torch decode ~13x slower whenever another process takes a pinned CPU, and is no faster on an idle one. Every side runs
under kvjax.allocator's host allocator settings (what the main job and the server use; KVJAX_MALLOC=system for the
C library's defaults): at batch 64 they make kvjax's decode step ~3x faster; each side's process starts with glibc's
transparent huge pages (kvjax.allocator.environ; torch's tensors get them too). Each round
records the share of the pinned CPUs that other processes used ("other load"): trust numbers taken with little.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, tie_word_embeddings=False, max_position_embeddings=4096)
BYTES = 4  # float32
DECODE_TOKEN = 1  # fed at every timed decode step; its value does not change the cost
WARMUP_STEPS = 3
BANDWIDTH_BYTES = 1 << 30
MATMUL_N = 2048  # the f32 matmul that measures the machine's peak (each library's own product)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # launch/bench/ -> the repository


def log(msg: str) -> None:
    print(f"[bench_foundation {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_seconds(fn, reps: int, warmup: int = 0) -> float:
    """Median duration of `reps` calls of fn() after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds(fn) for _ in range(reps))


def loop_tok_s(generate, n: int, reps: int) -> float:
    """Tokens/s of a generation loop `generate(new_tokens)` (prefill included): the n tokens after the first over
    their time, so that the prefill and the first token cancel out."""
    return n / (median_seconds(lambda: generate(n + 1), reps) - median_seconds(lambda: generate(1), reps))


def prompt_tokens(args) -> np.ndarray:
    return np.random.default_rng(args.seed).integers(0, MODEL["vocab_size"], (1, max(args.prefill_len,
                                                                                     *args.prefill_lens)))


def batch_tokens(args, b: int) -> np.ndarray:
    return np.random.default_rng(args.seed + b).integers(0, MODEL["vocab_size"], (b, args.batch_context))


def prefill_flops(t: int) -> float:
    """Multiply-adds x 2 of a prefill of t tokens: every weight matrix once per token (the full-logits head
    included) plus causal attention (scores and values, half the t x t square)."""
    d, f, v, hd = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"], MODEL["head_dim"]
    hq, hkv, layers = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], MODEL["num_hidden_layers"]
    weights = layers * (d * hd * (2 * hq + 2 * hkv) + 3 * d * f) + d * v
    return 2 * weights * t + layers * 2 * 2 * hq * hd * t * t / 2


# ---- workers: one per side, each in its own pinned process ------------------------------------------------------

class KvjaxBench:
    def __init__(self, args):
        import jax.numpy as jnp
        import kvjax
        self.args, self.jnp, self.kvjax = args, jnp, kvjax
        self.cfg, self.params = kvjax.load_hf(args.ckpt, dtype=jnp.float32)
        self.prompt = prompt_tokens(args)
        self.all_tokens = jnp.asarray(self.prompt, jnp.int32)  # the longest prefill length's prompt
        self.tokens = self.all_tokens[:, :args.prefill_len]
        self.token = jnp.asarray([DECODE_TOKEN], jnp.int32)
        self.cache = kvjax.init_cache(self.cfg, 1, args.capacity, jnp.float32)
        t0 = time.perf_counter()
        logits = self._prefill()
        first = {"prefill": time.perf_counter() - t0}
        np.save(os.path.join(args.workdir, "kvjax_logits.npy"), np.asarray(logits[0, -1]))
        # decode_step reads a copy of the prefilled cache with its keys held transposed, the layout kvjax's decode
        # loop and server run on (kvjax.cache); prefill keeps writing the standard one
        self.step_cache = self.cache.with_keys_transposed(True).replace(
            values=tuple(jnp.copy(a) for a in self.cache.values))  # its own buffers: prefill donates self.cache
        for n in args.prefill_lens:
            first[f"prefill T={n}"] = seconds(lambda: self._prefill(n))
        self.batched = {}  # batch -> (cache after prefilling every row to --batch-context, the tokens fed)
        for b in args.batches:
            rows = jnp.asarray(batch_tokens(args, b), jnp.int32)
            cache = kvjax.init_cache(self.cfg, b, args.batch_context + 64, jnp.float32, keys_transposed=True)
            cache = kvjax.prefill(self.params, self.cfg, rows, cache)[1]
            self.batched[b] = [cache, jnp.full((b,), DECODE_TOKEN, jnp.int32)]
            first[f"decode batch={b}"] = seconds(lambda: self._decode_batch(b))
        first["decode_step"] = seconds(lambda: self._decode_step(args.contexts[0]))
        for ctx in args.contexts if args.generate_tokens else ():
            for n in (1, args.generate_tokens + 1):
                first[f"generate ctx={ctx} new={n}"] = seconds(lambda: self._generate(ctx, n))
        self.setup = {"first_call_s": first}

    def _prefill(self, n: int | None = None):
        self.cache = self.cache.replace(lengths=self.jnp.zeros((1,), self.jnp.int32))
        tokens = self.tokens if n is None else self.all_tokens[:, :n]
        logits, self.cache = self.kvjax.prefill(self.params, self.cfg, tokens, self.cache)
        return logits.block_until_ready()

    def _decode_batch(self, b: int):
        cache, token = self.batched[b]
        cache = cache.replace(lengths=self.jnp.full((b,), self.args.batch_context, self.jnp.int32))
        logits, self.batched[b][0] = self.kvjax.decode_step(self.params, self.cfg, token, cache)
        logits.block_until_ready()

    def matmul(self) -> float:
        import jax
        a = self.jnp.ones((MATMUL_N, MATMUL_N), self.jnp.float32)
        f = jax.jit(lambda x: x @ x)
        f(a).block_until_ready()
        return 2 * MATMUL_N ** 3 / median_seconds(lambda: f(a).block_until_ready(), 5)

    def _decode_step(self, ctx: int):
        self.step_cache = self.step_cache.replace(lengths=self.jnp.full((1,), ctx, self.jnp.int32))  # back to ctx
        logits, self.step_cache = self.kvjax.decode_step(self.params, self.cfg, self.token, self.step_cache)
        logits.block_until_ready()

    def _generate(self, ctx: int, new_tokens: int):
        out = self.kvjax.generate(self.params, self.cfg, self.prompt[:, :ctx], new_tokens, eos_token_ids=())
        out.block_until_ready()

    def round(self) -> dict:
        a = self.args
        out = {"prefill": a.prefill_len / median_seconds(self._prefill, a.prefill_reps), "decode": {}, "generate": {},
               "prefill_lens": {n: n / median_seconds(lambda: self._prefill(n), a.prefill_reps) for n in a.prefill_lens},
               "batched": {b: b / median_seconds(lambda: self._decode_batch(b), a.decode_steps, WARMUP_STEPS)
                           for b in a.batches},
               "matmul_flops": self.matmul()}
        for ctx in a.contexts:
            out["decode"][ctx] = 1 / median_seconds(lambda: self._decode_step(ctx), a.decode_steps, WARMUP_STEPS)
            if a.generate_tokens:
                out["generate"][ctx] = loop_tok_s(lambda n: self._generate(ctx, n), a.generate_tokens, a.prefill_reps)
        return out


class TorchBench:
    def __init__(self, args):
        import torch
        import transformers
        torch.set_num_threads(args.threads)
        self.args, self.torch, self.transformers = args, torch, transformers
        self.model = transformers.Qwen3ForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).eval()
        self.all_tokens, self.token = torch.from_numpy(prompt_tokens(args)), torch.tensor([[DECODE_TOKEN]])
        self.tokens = self.all_tokens[:, :args.prefill_len]
        logits, self.prompt_cache = self._prefill()
        np.save(os.path.join(args.workdir, "torch_logits.npy"), logits[0, -1].numpy())
        self.batched = {}
        for b in args.batches:
            rows = torch.from_numpy(batch_tokens(args, b))
            self.batched[b] = (self._prefill(rows)[1], torch.full((b, 1), DECODE_TOKEN))
        if args.generate_tokens:
            self._generate(args.contexts[0], 2)  # its first call's set-up, outside the rounds as kvjax's compile is
        self.setup = {}

    def _prefill(self, tokens=None):
        with self.torch.inference_mode():
            cache = self.transformers.DynamicCache(config=self.model.config)
            tokens = self.tokens if tokens is None else tokens
            return self.model(input_ids=tokens, cache=cache, use_cache=True).logits, cache

    def _decode_batch(self, b: int):
        cache, token = self.batched[b]
        with self.torch.inference_mode():
            self.model(input_ids=token, cache=cache, use_cache=True)
        cache.crop(-1)  # back to the context: every step decodes at --batch-context tokens

    def matmul(self) -> float:
        a = self.torch.ones((MATMUL_N, MATMUL_N), dtype=self.torch.float32)
        with self.torch.inference_mode():
            return 2 * MATMUL_N ** 3 / median_seconds(lambda: a @ a, 5, 1)

    def _generate(self, ctx: int, new_tokens: int):
        """transformers' own generation loop (greedy, exactly `new_tokens` tokens), the peer of kvjax.generate."""
        tokens = self.all_tokens[:, :ctx]
        with self.torch.inference_mode():
            self.model.generate(input_ids=tokens, attention_mask=self.torch.ones_like(tokens), do_sample=False,
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens)

    def _decode_step(self, cache):
        cache.crop(-1)  # back to ctx tokens (the cache enters with ctx + 1)
        with self.torch.inference_mode():
            self.model(input_ids=self.token, cache=cache, use_cache=True)

    def round(self) -> dict:
        a = self.args
        out = {"prefill": a.prefill_len / median_seconds(self._prefill, a.prefill_reps), "decode": {},
               "prefill_lens": {n: n / median_seconds(lambda: self._prefill(self.all_tokens[:, :n]), a.prefill_reps)
                                for n in a.prefill_lens},
               "batched": {b: b / median_seconds(lambda: self._decode_batch(b), a.decode_steps, WARMUP_STEPS)
                           for b in a.batches},
               "matmul_flops": self.matmul()}
        for ctx in a.contexts:
            cache = copy.deepcopy(self.prompt_cache)
            cache.crop(ctx + 1 - a.prefill_len)
            out["decode"][ctx] = 1 / median_seconds(lambda: self._decode_step(cache), a.decode_steps, WARMUP_STEPS)
            if a.generate_tokens:
                out.setdefault("generate", {})[ctx] = loop_tok_s(lambda n: self._generate(ctx, n), a.generate_tokens,
                                                                 a.prefill_reps)
        return out


class BandwidthBench:
    """Read-only bandwidth (what bounds decode), the higher of two readers of 1 GiB float32: numpy sums in `threads`
    threads (numpy releases the GIL in reductions) and XLA's matrix-vector product, the operation decode streams its
    weights through. Why both: on this machine numpy's sum has read anywhere from 32 to 46 GB/s in runs where XLA's
    product read 43-47 GB/s, and a roofline from the lower reader overstated decode's share of it (2026-12-02)."""

    def __init__(self, args):
        from concurrent.futures import ThreadPoolExecutor

        import jax
        import jax.numpy as jnp
        self.pool = ThreadPoolExecutor(args.threads)
        self.chunks = np.array_split(np.ones(BANDWIDTH_BYTES // 4, np.float32), args.threads)
        self.w = jnp.ones((BANDWIDTH_BYTES // 4 // 4096, 4096), jnp.float32)
        self.x = jnp.ones((4096,), jnp.float32)
        self.matvec = jax.jit(lambda w, x: w @ x)
        self.setup = {}

    def _read_all(self):
        list(self.pool.map(np.sum, self.chunks))

    def _matvec(self):
        self.matvec(self.w, self.x).block_until_ready()

    def round(self) -> dict:
        self._read_all(), self._matvec()
        gb_s = {name: BANDWIDTH_BYTES / median_seconds(fn, 7) / 1e9
                for name, fn in (("numpy_sum_gb_s", self._read_all), ("xla_matvec_gb_s", self._matvec))}
        return {"read_gb_s": max(gb_s.values()), **gb_s}


SIDES = {"kvjax": KvjaxBench, "torch": TorchBench, "bandwidth": BandwidthBench}


def serve(args) -> None:
    """Worker loop: set up, then per line on stdin one JSON line on stdout (a round, with the CPU time it used)."""
    from kvjax import allocator
    applied = allocator.tune()  # every side alike, before any library starts its threads
    bench = SIDES[args.side](args)
    print(json.dumps({"setup": {**bench.setup, "allocator": applied}}), flush=True)
    for _ in sys.stdin:
        cpu0 = time.process_time()
        print(json.dumps({**bench.round(), "cpu_s": time.process_time() - cpu0}), flush=True)


# ---- parent: checkpoint, scheduling, report ---------------------------------------------------------------------

def make_checkpoint(path: str, seed: int) -> None:
    import torch
    import transformers
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**MODEL)).save_pretrained(path)


def decode_bytes(ctx: int) -> tuple[int, int]:
    """(weight bytes, KV-cache bytes) read by one decode step with `ctx` cached tokens."""
    d, f, v, hd = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"], MODEL["head_dim"]
    hq, hkv, layers = MODEL["num_attention_heads"], MODEL["num_key_value_heads"], MODEL["num_hidden_layers"]
    per_layer = d * hd * (2 * hq + 2 * hkv) + 3 * d * f + 2 * d + 2 * hd  # q, k, v, o, MLP, norms, q/k norms
    weights = layers * per_layer + d + d * v + d  # + final norm, lm_head, one embedding row
    return weights * BYTES, 2 * layers * hkv * ctx * hd * BYTES


def cpus_busy_seconds(cpus: list[str]) -> float:
    """Busy time (all but idle and iowait) of these CPUs since boot, all processes together."""
    with open("/proc/stat") as f:
        rows = [[int(t) for t in line.split()[1:9]] for line in f if line.split()[0] in {f"cpu{c}" for c in cpus}]
    return sum(sum(r) - r[3] - r[4] for r in rows) / os.sysconf("SC_CLK_TCK")


class Worker:
    """The parent's handle on one side's worker process."""

    def __init__(self, side: str, args):
        n = str(args.threads)
        from kvjax import allocator  # every side starts as kvjax's programs do (huge pages)
        env = dict(allocator.environ(), JAX_PLATFORMS="cpu", OMP_NUM_THREADS=n, OMP_WAIT_POLICY="PASSIVE",
                   MKL_NUM_THREADS=n, OPENBLAS_NUM_THREADS=n)
        self.side, self.cpus, self.log_path = side, args.cpus.split(","), os.path.join(args.workdir, f"{side}.log")
        cmd = ["taskset", "-c", args.cpus, sys.executable, "-m", "launch.bench.foundation", *sys.argv[1:],
               "--side", side, "--workdir", args.workdir]
        with open(self.log_path, "w") as stderr:  # from the repository root, so that kvjax imports from there
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                         text=True, env=env, cwd=REPO)
        self.setup = self._read()["setup"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            with open(self.log_path) as f:
                raise RuntimeError(f"the {self.side} worker exited ({self.proc.wait()}); its log ends:\n"
                                   f"{f.read()[-3000:]}")
        return json.loads(line)

    def round(self) -> dict:
        """One measurement round, plus "other_load": the share of the pinned CPUs used by other processes."""
        busy0, t0 = cpus_busy_seconds(self.cpus), time.perf_counter()
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        result = self._read()
        other = cpus_busy_seconds(self.cpus) - busy0 - result.pop("cpu_s")
        result["other_load"] = max(0.0, other) / ((time.perf_counter() - t0) * len(self.cpus))
        return result

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def median_over(rounds: list[dict], *keys) -> float:
    """Median across rounds of round[keys[0]][keys[1]]... (keys are strings after the JSON round trip)."""
    return statistics.median(functools.reduce(lambda d, k: d[str(k)], keys, r) for r in rounds)


def run(args) -> dict:
    log("writing the random-init checkpoint")
    make_checkpoint(args.ckpt, args.seed)
    workers = {}
    try:
        for side in SIDES:  # one at a time, so that no setup (compilation) overlaps another side
            log(f"starting the {side} worker (load, compile, warm up)")
            workers[side] = Worker(side, args)
        rounds = {side: [] for side in SIDES}
        for i in range(args.rounds):
            log(f"round {i + 1}/{args.rounds}")
            for side in (list(SIDES) if i % 2 == 0 else list(SIDES)[::-1]):
                rounds[side].append(workers[side].round())
    finally:
        for w in workers.values():
            w.close()
    kvjax_logits, torch_logits = (np.load(os.path.join(args.workdir, f"{s}_logits.npy")) for s in ("kvjax", "torch"))
    bandwidth = median_over(rounds["bandwidth"], "read_gb_s")
    readers = {k: median_over(rounds["bandwidth"], k) for k in ("numpy_sum_gb_s", "xla_matvec_gb_s")}
    settings = {k: v for k, v in vars(args).items() if k not in ("side", "workdir", "out", "ckpt")}
    result = {"model": MODEL, "settings": settings,
              "read_bandwidth_gb_s": bandwidth, "read_bandwidth_readers": readers,
              "kvjax_first_call_s": workers["kvjax"].setup["first_call_s"],
              "allocator": workers["kvjax"].setup["allocator"],
              "last_logits_max_abs_diff": float(np.abs(kvjax_logits - torch_logits).max()),
              "other_load": {s: median_over(rounds[s], "other_load") for s in SIDES},
              "prefill_tok_s": {s: median_over(rounds[s], "prefill") for s in ("kvjax", "torch")}, "decode": {},
              "matmul_gflops": {s: median_over(rounds[s], "matmul_flops") / 1e9 for s in ("kvjax", "torch")},
              "prefill": {}, "batched": {}}
    peak = max(result["matmul_gflops"].values()) * 1e9
    for n in args.prefill_lens:
        tok = {s: median_over(rounds[s], "prefill_lens", n) for s in ("kvjax", "torch")}
        result["prefill"][n] = {**{f"{s}_tok_s": v for s, v in tok.items()}, "flops_per_token": prefill_flops(n) / n,
                                **{f"{s}_peak_frac": v * prefill_flops(n) / n / peak for s, v in tok.items()}}
    for b in args.batches:
        result["batched"][b] = {f"{s}_tok_s": median_over(rounds[s], "batched", b) for s in ("kvjax", "torch")}
    for ctx in args.contexts:
        weights, kv = decode_bytes(ctx)
        result["decode"][ctx] = {"kvjax_tok_s": median_over(rounds["kvjax"], "decode", ctx),
                                 "torch_tok_s": median_over(rounds["torch"], "decode", ctx),
                                 "weight_bytes": weights, "kv_bytes": kv,
                                 "roofline_tok_s": bandwidth * 1e9 / (weights + kv)}
        if args.generate_tokens:
            result["decode"][ctx]["kvjax_generate_tok_s"] = median_over(rounds["kvjax"], "generate", ctx)
            result["decode"][ctx]["torch_generate_tok_s"] = median_over(rounds["torch"], "generate", ctx)
    return {**result, "rounds": rounds}


def print_report(r: dict, args) -> None:
    print(f"\nQwen3 {MODEL['hidden_size']}d x {MODEL['num_hidden_layers']} layers, vocab {MODEL['vocab_size']}, "
          f"float32, batch 1; {args.threads} threads on CPUs {args.cpus}; median of {args.rounds} round(s); every side's "
          f"host allocator: {r['allocator']}")
    row = "{:<33}{:>9}{:>14}{:>8}{:>10}{:>12}{:>9}"
    print(row.format("tokens/s", "kvjax", "transformers", "ratio", "roofline", "% roofline", "MB/tok"))
    p = r["prefill_tok_s"]
    print(row.format(f"prefill T={args.prefill_len}", f"{p['kvjax']:.0f}", f"{p['torch']:.0f}",
                     f"{p['kvjax'] / p['torch']:.2f}x", "", "", ""))
    for ctx, d in r["decode"].items():
        roof, mb = d["roofline_tok_s"], (d["weight_bytes"] + d["kv_bytes"]) / 1e6
        print(row.format(f"decode ctx={ctx} (decode_step)", f"{d['kvjax_tok_s']:.1f}", f"{d['torch_tok_s']:.1f}",
                         f"{d['kvjax_tok_s'] / d['torch_tok_s']:.2f}x", f"{roof:.1f}",
                         f"{100 * d['kvjax_tok_s'] / roof:.0f}%", f"{mb:.1f}"))
        if "kvjax_generate_tok_s" in d:
            g, tg = d["kvjax_generate_tok_s"], d["torch_generate_tok_s"]
            print(row.format(f"decode ctx={ctx} (generate loop)", f"{g:.1f}", f"{tg:.1f}", f"{g / tg:.2f}x", "",
                             f"{100 * g / roof:.0f}%", ""))
    peak = max(r["matmul_gflops"].values())
    print(f"\nprefill against the f32 matmul peak measured here ({MATMUL_N}^3: kvjax/XLA "
          f"{r['matmul_gflops']['kvjax']:.0f}, torch {r['matmul_gflops']['torch']:.0f} GFLOP/s)")
    for n, d in r["prefill"].items():
        print(row.format(f"prefill T={n}", f"{d['kvjax_tok_s']:.0f}", f"{d['torch_tok_s']:.0f}",
                         f"{d['kvjax_tok_s'] / d['torch_tok_s']:.2f}x", f"{peak * 1e9 / d['flops_per_token']:.0f}",
                         f"{100 * d['kvjax_peak_frac']:.0f}%/{100 * d['torch_peak_frac']:.0f}%", ""))
    print(f"\nbatched decode, every row at {args.batch_context} tokens (tokens/s of the whole batch)")
    for b, d in r["batched"].items():
        print(row.format(f"decode batch={b}", f"{d['kvjax_tok_s']:.1f}", f"{d['torch_tok_s']:.1f}",
                         f"{d['kvjax_tok_s'] / d['torch_tok_s']:.2f}x", "", "", ""))
    weights_mb = next(iter(r["decode"].values()))["weight_bytes"] / 1e6
    kv_mb = ", ".join(f"{d['kv_bytes'] / 1e6:.1f} MB at ctx={ctx}" for ctx, d in r["decode"].items())
    readers = r["read_bandwidth_readers"]
    print(f"\nroofline = read bandwidth / bytes per token; read bandwidth {r['read_bandwidth_gb_s']:.1f} GB/s, the "
          f"higher of two readers of 1 GiB float32 on {args.threads} threads: numpy sum "
          f"{readers['numpy_sum_gb_s']:.1f}, XLA matrix-vector product {readers['xla_matvec_gb_s']:.1f}"
          f"\nbytes per token = weights {weights_mb:.1f} MB + "
          f"live KV cache ({kv_mb})")
    print("kvjax first calls (compile + one run; not in the throughputs): "
          + ", ".join(f"{k} {v:.1f}s" for k, v in r["kvjax_first_call_s"].items()))
    print("other processes' load on the pinned CPUs during the rounds (median): "
          + ", ".join(f"{s} {100 * v:.0f}%" for s, v in r["other_load"].items()))
    print(f"same weights: max |logits kvjax - transformers| at the last prompt position = "
          f"{r['last_logits_max_abs_diff']:.2e}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="also write the results (with every round's numbers) as JSON to this path")
    p.add_argument("--quick", action="store_true", help="smoke run, under a minute: 1 round, 1 prefill rep, 8 decode "
                   "steps, no generate loop (overrides those flags)")
    p.add_argument("--rounds", type=int, default=3, help="measurement rounds per side, interleaved across sides")
    p.add_argument("--prefill-len", type=int, default=2048, help="prompt length T for prefill (fills the cache)")
    p.add_argument("--prefill-reps", type=int, default=3, help="timed prefills (and generate calls) per round (median)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2000], help="decode contexts (< --prefill-len)")
    p.add_argument("--decode-steps", type=int, default=64, help="timed decode steps per context per round (median)")
    p.add_argument("--prefill-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                   help="prompt lengths of the prefill-vs-matmul-peak table (< --capacity)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="batched-decode batch sizes")
    p.add_argument("--batch-context", type=int, default=512, help="tokens in every row's cache for batched decode")
    p.add_argument("--generate-tokens", type=int, default=128,
                   help="time kvjax.generate's in-jit loop and transformers' generate over this many tokens after "
                   "the first (0: skip)")
    p.add_argument("--capacity", type=int, default=4096, help="kvjax cache capacity (decode reads only a window)")
    p.add_argument("--cpus", default="0,1", help="comma-separated CPUs for taskset; one thread per CPU on each side")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and of the prompt")
    p.add_argument("--side", choices=list(SIDES), help="internal: run as the worker of one side")
    p.add_argument("--workdir", help="internal: the directory with the checkpoint, shared with the workers")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.prefill_reps, args.decode_steps, args.generate_tokens = 1, 1, 8, 0
        args.prefill_lens, args.batches, args.batch_context = [256], [1, 4], 128
    if max(args.contexts) >= args.prefill_len or args.prefill_len >= args.capacity \
            or max(args.prefill_lens) > args.capacity:
        p.error("need every context < --prefill-len < --capacity, and every --prefill-lens <= --capacity")
    if not {int(c) for c in args.cpus.split(",")} <= os.sched_getaffinity(0):
        p.error(f"--cpus {args.cpus}: this process may only use CPUs {sorted(os.sched_getaffinity(0))}")
    args.threads = len(args.cpus.split(","))
    return args


def main() -> None:
    args = parse_args()
    if args.side:
        args.ckpt = os.path.join(args.workdir, "ckpt")
        return serve(args)
    with tempfile.TemporaryDirectory(prefix="bench_foundation_") as workdir:
        args.workdir, args.ckpt = workdir, os.path.join(workdir, "ckpt")
        result = run(args)
    print_report(result, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {args.out}")


if __name__ == "__main__":
    main()

"""Decode attention alone: kvjax's formulation under XLA:CPU vs torch's on the same shapes, at each batch size.

    launch/venv python -m experiments.decode_attention --cpu 1 --batches 1 16 64 --rounds 2

One decode token's attention over 512 cached positions in each of the foundation model's 8 layers (4 KV heads, 2 query
heads per KV head, head_dim 64, float32): `kvjax.models.decoder.attend`, decode's own attention (the static window
that holds the live positions, out of each layer's [B, Hkv, capacity, hd] buffers), against torch's SDPA and its plain
matmul form over a [B, Hkv, window, hd] cache. Each side runs in a fresh process pinned to one CPU (never torch and
JAX in one timing process), the sides alternate for `--rounds` rounds, and every number is the median of 5 timed
calls. Measured 2026-12-02: XLA:CPU about 2-2.5x slower than torch at batch 16-64, with the cache then
one stacked [L, B, Hkv, capacity, hd] buffer that every layer's window was copied out of.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from launch.bench.foundation import MODEL, median_seconds

L, HKV, HD = MODEL["num_hidden_layers"], MODEL["num_key_value_heads"], MODEL["head_dim"]
G = MODEL["num_attention_heads"] // HKV  # query heads per KV head
REPS = 5


def median_ms(fn) -> float:
    return 1e3 * median_seconds(fn, REPS, warmup=1)


def xla_side(batch: int, window: int, capacity: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.models.decoder import attend

    rng = np.random.default_rng(0)
    k = [jnp.asarray(rng.random((batch, HKV, capacity, HD), np.float32)) for _ in range(L)]
    v = [a + 1 for a in k]
    q = jnp.asarray(rng.random((batch, 1, HKV * G, HD), np.float32))
    kv_len = jnp.full((batch,), window, jnp.int32)  # the new token is the window's last position
    q_pos = kv_len[:, None] - 1

    @jax.jit
    def layers(q, k, v):
        return sum(attend(q, k[i], v[i], q_pos, kv_len).sum() for i in range(L))

    return {"kvjax (XLA)": median_ms(lambda: layers(q, k, v).block_until_ready())}


def torch_side(batch: int, window: int) -> dict:
    import torch

    torch.set_num_threads(1)
    k = torch.rand(L, batch, HKV, window, HD)
    v = k + 1
    q = torch.rand(batch, HKV * G, 1, HD)

    def sdpa():
        return sum(torch.nn.functional.scaled_dot_product_attention(q, k[i], v[i], enable_gqa=True).sum()
                   for i in range(L))

    def matmul():
        qg = q.view(batch, HKV, G, HD)
        return sum((torch.softmax(qg @ k[i].transpose(-1, -2) * HD ** -0.5, -1) @ v[i]).sum() for i in range(L))

    with torch.inference_mode():
        return {"torch sdpa": median_ms(sdpa), "torch matmul": median_ms(matmul)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--window", type=int, default=512, help="cached positions attended to")
    p.add_argument("--capacity", type=int, default=4096, help="kvjax's cache capacity (the window is sliced from it)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cpu", type=int, default=1, help="the CPU every side is pinned to")
    p.add_argument("--side", choices=("xla", "torch"), help="internal: run one side and print JSON")
    args = p.parse_args()
    if args.window > args.capacity:
        p.error("--window must be <= --capacity")
    if args.side == "xla":
        from kvjax import allocator
        allocator.tune()  # as kvjax's programs run (kvjax.allocator)
        print(json.dumps({b: xla_side(b, args.window, args.capacity) for b in args.batches}))
        return
    if args.side == "torch":
        print(json.dumps({b: torch_side(b, args.window) for b in args.batches}))
        return
    rows: dict[str, dict[int, list[float]]] = {}
    for r in range(args.rounds):
        for side in (("xla", "torch") if r % 2 == 0 else ("torch", "xla")):
            cmd = ["taskset", "-c", str(args.cpu), sys.executable, "-m", "experiments.decode_attention",
                   "--side", side, "--window", str(args.window), "--capacity", str(args.capacity),
                   "--batches", *map(str, args.batches)]
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            for b, times in out.items():
                for name, ms in times.items():
                    rows.setdefault(name, {}).setdefault(int(b), []).append(ms)
    print(f"ms for {L} layers of decode attention over {args.window} positions, median of {REPS} calls, per round")
    print(f"{'':<14}" + "".join(f"{'batch ' + str(b):>20}" for b in args.batches))
    for name, by_batch in rows.items():
        print(f"{name:<14}" + "".join(f"{' / '.join(f'{t:.1f}' for t in by_batch[b]):>20}" for b in args.batches))


if __name__ == "__main__":
    main()

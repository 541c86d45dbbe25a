"""Which fusions pay on XLA:CPU? One decode step of the foundation model, written out with each change alone.

    launch/venv taskset -c 1 python -m launch.research.decode_fusions                     # batch 1, ctx 512
    launch/venv taskset -c 1 python -m launch.research.decode_fusions --batch 64 --capacity 576

Variants of kvjax.models.decoder's decode step (the foundation benchmark's 33.6M Qwen3, random weights, float32),
each checked against the baseline's logits and timed in the same process, interleaved (--rounds x --steps, median):
  base        the decoder's step as written out here (one lax.switch over attention windows per layer)
  onewin      one window choice per step: a lax.switch over the whole step, each branch at a static window
  fuse        fused QKV and gate/up projections (weights concatenated once, outside the step)
  table       RoPE angles gathered from a host-computed table instead of computed in the step
  dus         the cache write as dynamic_update_slice at row 0's position (valid here: every row at one position)
  library     kvjax's own decode_jit, for reference
The answers (session 11, WORKSPACE.md "Speed"): onewin is several times slower (the conditional copies the cache it
writes in every branch); the others move the step by a few percent at most.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import allocator
from kvjax.cache import window_sizes
from kvjax.models import decoder as D
from kvjax.models.config import Qwen3Config
from kvjax.models.rope import apply_rope, rope_table
from launch.bench.foundation import MODEL

VARIANTS = ("base", "onewin", "fuse", "table", "dus", "library")


def build(cfg, capacity: int):
    hq, hkv, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    cos_table, sin_table = rope_table(capacity, hd, cfg.rope)

    def layer(lp, fl, x, cos, sin, cache, i, positions, kv_len, window, fuse, dus):
        h = D.rms_norm(x, lp.attn_norm, eps)
        if fuse:
            a = jnp.einsum("btd,dn->btn", h, fl["qkv"])
            b, t = a.shape[:2]
            q = a[..., :hq * hd].reshape(b, t, hq, hd)
            k = a[..., hq * hd:(hq + hkv) * hd].reshape(b, t, hkv, hd)
            v = a[..., (hq + hkv) * hd:].reshape(b, t, hkv, hd)
        else:
            q, k, v = (jnp.einsum("btd,dhk->bthk", h, w) for w in (lp.q, lp.k, lp.v))
        q = apply_rope(D.rms_norm(q, lp.q_norm, eps), cos, sin)
        k = apply_rope(D.rms_norm(k, lp.k_norm, eps), cos, sin)
        if dus:
            start = (0, 0, positions[0, 0], 0)
            put = lambda buf, new: jax.lax.dynamic_update_slice(  # noqa: E731
                buf, new.transpose(0, 2, 1, 3).astype(buf.dtype), start)
        else:
            put = lambda buf, new: D._write(buf, new, positions)  # noqa: E731
        kb, vb = put(cache.keys[i], k), put(cache.values[i], v)
        cache = cache.replace(keys=D._replaced(cache.keys, i, kb), values=D._replaced(cache.values, i, vb))
        if window is None:
            attn = D.attend(q, kb, vb, positions, kv_len)
        else:
            attn = D._attend_window(q, kb, vb, positions, kv_len, window)
        x = x + jnp.einsum("bthk,hkd->btd", attn, lp.o)
        h = D.rms_norm(x, lp.mlp_norm, eps)
        if fuse:
            gu = jnp.einsum("btd,df->btf", h, fl["gu"])
            gate, up = jnp.split(gu, 2, axis=-1)
        else:
            gate, up = jnp.einsum("btd,df->btf", h, lp.gate), jnp.einsum("btd,df->btf", h, lp.up)
        return x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, lp.down), cache

    def body(params, fused, tokens, cache, window, fuse, table, dus):
        positions = cache.lengths[:, None]
        kv_len = cache.lengths + 1
        if table:
            cos = jnp.asarray(cos_table)[positions][:, :, None]
            sin = jnp.asarray(sin_table)[positions][:, :, None]
        else:
            cos, sin = D.head_angles(cfg, positions)
        x = D.embed(params, tokens[:, None])
        for i, lp in enumerate(params.layers):
            x, cache = layer(lp, fused[i], x, cos, sin, cache, i, positions, kv_len, window, fuse, dus)
        logits = D.unembed(params, D.rms_norm(x, params.final_norm, eps))[:, 0]
        return logits, cache.replace(lengths=kv_len)

    def make(onewin=False, fuse=False, table=False, dus=False):
        def step(params, fused, tokens, cache):
            if not onewin:
                return body(params, fused, tokens, cache, None, fuse, table, dus)
            ws = window_sizes(cache.capacity)
            index = jnp.minimum(jnp.searchsorted(jnp.asarray(ws), jnp.max(cache.lengths + 1)), len(ws) - 1)
            branches = [functools.partial(lambda w, p, f, t, c: body(p, f, t, c, w, fuse, table, dus), w) for w in ws]
            return jax.lax.switch(index, branches, params, fused, tokens, cache)
        return jax.jit(step, donate_argnums=(3,))

    return {"base": make(), "onewin": make(onewin=True), "fuse": make(fuse=True), "table": make(table=True),
            "dus": make(dus=True)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--capacity", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = p.parse_args(argv)
    print(f"host allocator: {allocator.tune()}")  # as the main job runs (kvjax.allocator); before XLA's threads start
    cfg = Qwen3Config.from_hf_dict({"model_type": "qwen3", **MODEL})
    params = kvjax.init_params(cfg, jax.random.PRNGKey(0))
    fused = tuple(dict(qkv=jnp.concatenate([w.reshape(w.shape[0], -1) for w in (lp.q, lp.k, lp.v)], 1),
                       gu=jnp.concatenate([lp.gate, lp.up], 1)) for lp in params.layers)
    steps = build(cfg, args.capacity)
    token = jnp.ones((args.batch,), jnp.int32)

    def call(name, cache):
        if name == "library":
            return D.decode_jit(params, cfg, token, cache)
        return steps[name](params, fused, token, cache)

    def fresh_cache():
        c = kvjax.init_cache(cfg, args.batch, args.capacity, jnp.float32)
        return c.with_stacked(0.5 * jax.random.normal(jax.random.PRNGKey(1), c.k.shape),
                              0.5 * jax.random.normal(jax.random.PRNGKey(2), c.v.shape),
                              lengths=jnp.full((args.batch,), args.context, jnp.int32))

    caches, ref = {}, None
    for name in args.variants:
        out, caches[name] = call(name, fresh_cache())
        out = np.asarray(out)
        ref = out if ref is None else ref
        print(f"{name:8s} max |logits - {args.variants[0]}| = {float(np.abs(out - ref).max()):.2e}", flush=True)
    times = {name: [] for name in args.variants}
    for _ in range(args.rounds):
        for name in args.variants:
            cache, ts = caches[name], []
            for _ in range(args.steps):
                cache = cache.replace(lengths=jnp.full((args.batch,), args.context, jnp.int32))
                t0 = time.perf_counter()
                out, cache = call(name, cache)
                out.block_until_ready()
                ts.append(time.perf_counter() - t0)
            caches[name] = cache
            times[name].append(statistics.median(ts))
    first = statistics.median(times[args.variants[0]])
    print(f"\nbatch {args.batch}, context {args.context}, capacity {args.capacity}; median of {args.rounds} rounds x "
          f"{args.steps} steps")
    for name, t in times.items():
        ms = 1e3 * statistics.median(t)
        print(f"{name:8s} {ms:8.3f} ms/step {args.batch / ms * 1e3:8.1f} tok/s  speed vs {args.variants[0]} "
              f"{first * 1e3 / ms:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

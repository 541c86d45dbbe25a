"""How far can a prefix cache move the target towards the source at all? An in-sample oracle for the residual.

    python -m launch.research.cache_oracle --map runs/toy_map/map      # 16 held-out windows, 300 Adam steps
    python -m launch.research.cache_oracle --target pruned --map runs/toy_pruned/map

For each of N held-out windows (prefix P + continuation C tokens), start from the mapped cache of the prefix (and,
separately, from the target's own cache) and optimise every key/value entry of it freely, per window, to minimise
source-teacher KL on that window's continuation. This is not a map (it sees the continuation it is scored on and
cannot generalise); it bounds what any cache-only change can do for this target: if even the oracle cannot lower
KL much, no residual can. Prints KL before and after, every 50 steps.

With --split, the cache is optimised on the first half of each continuation only and scored on the second half as
well: what a cache can carry about its prefix that helps tokens it was not fitted to (a held-out oracle; the
in-sample KL above also counts what the cache learns about the scored tokens themselves).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kvjax
from kvjax.mapper.kl import kl
from kvjax.models.decoder import forward, forward_nocache, prefill_forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy-dir", default="checkpoints/toy")
    p.add_argument("--map", default="runs/toy/map",
                   help="a map fitted for the pair (python -m kvjax.launch --config=toy)")
    p.add_argument("--target", default="target", help="the target's folder under --toy-dir (e.g. pruned)")
    p.add_argument("--windows", type=int, default=16, help="the last N held-out windows")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--cont", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-2)
    p.add_argument("--split", action="store_true",
                   help="optimise on the first half of each continuation, report the second half too")
    args = p.parse_args()
    if not os.path.isdir(args.map):
        raise SystemExit(f"no map at {args.map}: fit one with `python -m kvjax.launch --config=toy` or pass --map")
    source, target = (kvjax.load_hf(os.path.join(args.toy_dir, r)) for r in ("source", args.target))
    (scfg, sparams), (tcfg, tparams) = source, target
    kvmap = kvjax.load_map(args.map, scfg, tcfg)
    P, C = args.prefix, args.cont
    w = np.load(os.path.join(args.toy_dir, "eval", "heldout_windows.npy"))[-args.windows:, : P + C]
    w = jnp.asarray(w.astype(np.int32))
    teacher = forward_nocache(sparams, scfg, w[:, :-1])[:, P - 1 :]
    native = forward_nocache(tparams, tcfg, w[:, :-1])[:, P - 1 :]
    print(f"native target KL {float(kl(teacher, native).mean()):.4f} nats/token ({args.windows} windows)")
    mapped = kvjax.apply_map(kvmap, prefill_forward(sparams, scfg, w[:, : P - 1], logits=False).cache, capacity=P + C, length=P - 1)
    own = prefill_forward(tparams, tcfg, w[:, : P - 1], logits=False).cache
    pad = ((0, 0),) * 3 + ((0, C + 1),) + ((0, 0),)
    own = own.with_stacked(jnp.pad(own.k, pad), jnp.pad(own.v, pad))
    opt = optax.adam(args.lr)

    fit = C // 2 if args.split else C  # continuation positions the cache is optimised on

    def per_position(delta, base, teacher):
        cache = base.with_stacked(base.k + delta[0], base.v + delta[1])
        return kl(teacher, forward(tparams, tcfg, w[:, P - 1 : -1], cache)[0])

    def loss(delta, base, teacher):
        return per_position(delta, base, teacher)[:, :fit].mean()

    @jax.jit
    def step(delta, state, base, teacher):
        value, grads = jax.value_and_grad(loss)(delta, base, teacher)
        updates, state = opt.update(grads, state, delta)
        return optax.apply_updates(delta, updates), state, value

    held = jax.jit(lambda delta, base, teacher: per_position(delta, base, teacher)[:, fit:].mean())

    for name, base in (("mapped cache", mapped), ("target's own cache", own)):
        delta = (jnp.zeros_like(base.k), jnp.zeros_like(base.v))
        state = opt.init(delta)
        held_first = float(held(delta, base, teacher)) if args.split else None
        first = None
        for i in range(args.steps + 1):
            delta, state, value = step(delta, state, base, teacher)
            first = float(value) if first is None else first
            if i % 50 == 0:
                print(f"{name}: step {i:4d} KL {float(value):.4f}"
                      + (f", held-out half {float(held(delta, base, teacher)):.4f}" if args.split else ""), flush=True)
        print(f"{name}: KL {first:.4f} -> {float(value):.4f} ({100 * (1 - float(value) / first):.1f}% lower)"
              + (" on the positions it was optimised on" if args.split else ""))
        if args.split:
            after = float(held(delta, base, teacher))
            print(f"{name}: held-out second half KL {held_first:.4f} -> {after:.4f} "
                  f"({100 * (1 - after / held_first):.1f}% lower)", flush=True)


if __name__ == "__main__":
    main()

"""How far can a prefix cache move the target towards the source at all? An in-sample oracle for the residual.

    python -m experiments.cache_oracle --map runs/toy_map/map      # 16 held-out windows, 300 Adam steps
    python -m experiments.cache_oracle --target pruned --map runs/toy_pruned/map
    python -m experiments.cache_oracle --target pruned --map runs/toy_pruned/map --samples 16 --steps 70 \
        --lr 1e-2 --caches mapped                                        # the held-out oracle of docs/method.md

For each of N held-out windows (prefix P + continuation C tokens), start from the mapped cache of the prefix (and,
separately, from the target's own cache) and optimise every key/value entry of it freely, per window, to minimise
source-teacher KL on that window's continuation. This is not a map (it sees the continuation it is scored on and
cannot generalise); it bounds what any cache-only change can do for this target: if even the oracle cannot lower
KL much, no residual can. Prints KL before and after, every 50 steps.

With --split, the cache is optimised on the first half of each continuation only and scored on the second half as
well: what a cache can carry about its prefix that helps tokens it was not fitted to (a held-out oracle; the
in-sample KL above also counts what the cache learns about the scored tokens themselves).

With --samples N, the cache is optimised on N continuations the source samples after each prefix (temperature 1,
each --cont tokens, source-teacher KL on all of them) and scored on the window's real continuation, which it never
sees: the target behaving like the source on what the source would write next is what a map trained on many windows
is asked for, and N continuations of C tokens are a fitting set N * 2 times the C/2 real tokens of --split. The best
held-out KL over the steps (scored every 10, so the step is chosen on the scored tokens: an optimistic estimate) is what
a cache of this prefix can give tokens it was not fitted to.
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
from kvjax.models.decoder import forward, prefill_forward


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
    p.add_argument("--samples", type=int, default=0,
                   help="optimise on N source-sampled continuations of each prefix, score the real one")
    p.add_argument("--seed", type=int, default=0, help="the sampling key (--samples)")
    p.add_argument("--caches", default="mapped,own",
                   help="which starting caches to optimise, comma-separated: mapped (the map's), own (the target's)")
    args = p.parse_args()
    if args.split and args.samples:
        raise SystemExit("--split and --samples are two ways to hold tokens out: pass one of them")
    if args.samples < 0 or args.steps < 1:
        raise SystemExit("--samples must be >= 0 and --steps >= 1")
    caches = args.caches.split(",")
    if not caches or set(caches) - {"mapped", "own"}:
        raise SystemExit(f"--caches={args.caches!r}: name mapped, own or both (comma-separated)")
    if not os.path.isdir(args.map):
        raise SystemExit(f"no map at {args.map}: fit one with `python -m kvjax.launch --config=toy` or pass --map")
    source, target = (kvjax.load_hf(os.path.join(args.toy_dir, r)) for r in ("source", args.target))
    (scfg, sparams), (tcfg, tparams) = source, target
    kvmap = kvjax.load_map(args.map, scfg, tcfg)
    P, C = args.prefix, args.cont
    w = np.load(os.path.join(args.toy_dir, "eval", "heldout_windows.npy"))[-args.windows:, : P + C]
    w = jnp.asarray(w.astype(np.int32))
    teacher = forward(sparams, scfg, w[:, :-1]).logits[:, P - 1 :]
    native = forward(tparams, tcfg, w[:, :-1]).logits[:, P - 1 :]
    print(f"native target KL {float(kl(teacher, native).mean()):.4f} nats/token ({args.windows} windows)")
    mapped = kvjax.apply_map(kvmap, prefill_forward(sparams, scfg, w[:, : P - 1], logits=None).cache,
                             capacity=P + C, length=P - 1)
    own = prefill_forward(tparams, tcfg, w[:, : P - 1], logits=None).cache
    pad = ((0, 0),) * 3 + ((0, C + 1),) + ((0, 0),)
    own = own.with_stacked(jnp.pad(own.k, pad), jnp.pad(own.v, pad))
    bases = [(n, c) for key, n, c in (("mapped", "mapped cache", mapped), ("own", "target's own cache", own))
             if key in caches]
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

    if args.samples:
        sampled_oracle(w, source, target, bases, teacher, opt, prefix=P, cont=C, samples=args.samples,
                       steps=args.steps, seed=args.seed, log=lambda m: print(m, flush=True))
        return

    for name, base in bases:
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


def sampled_oracle(w, source, target, bases, teacher, opt, *, prefix: int, cont: int, samples: int, steps: int,
                   seed: int = 0, log=print) -> dict[str, dict]:
    """--samples: fit each window's cache on `samples` source-sampled continuations, score it on the real one.

    `w` [W, prefix + cont] held-out windows; `bases`: (name, cache of each window's first prefix - 1 tokens with room
    for the continuation); `teacher`: the source's logits over the real continuation. Returns, per base, the real
    continuation's KL at the start and its best (with the step) among every 10th, and the fitted KL per step."""
    (scfg, sparams), (tcfg, tparams) = source, target
    P, C, N = prefix, cont, samples
    prefixes = jnp.repeat(w[:, :P], N, axis=0)  # [W*N, P], window-major
    sampled = kvjax.generate(sparams, scfg, prefixes, C, temperature=1.0, key=jax.random.key(seed), eos_token_ids=())
    seqs = jnp.concatenate([prefixes, sampled], axis=1)  # [W*N, P + C]
    s_teacher = forward(sparams, scfg, seqs[:, :-1]).logits[:, P - 1:]
    s_inputs = seqs[:, P - 1:-1]
    log(f"{w.shape[0]} windows x {N} sampled continuations of {C} tokens (temperature 1, seed {seed})")

    def rows(base, delta, n):  # the window's cache (plus its delta) for each of its n rows
        k, v = (jnp.repeat(a + d, n, axis=1) for a, d in ((base.k, delta[0]), (base.v, delta[1])))
        return base.with_stacked(k, v, lengths=jnp.repeat(base.lengths, n))

    # the teachers and inputs go in as arguments: closed over, XLA would fold them as constants (minutes, GBs)
    def fit_loss(delta, base, t, x):
        return kl(t, forward(tparams, tcfg, x, rows(base, delta, N))[0]).mean()

    @jax.jit
    def step(delta, state, base, t, x):
        value, grads = jax.value_and_grad(fit_loss)(delta, base, t, x)
        updates, state = opt.update(grads, state, delta)
        return optax.apply_updates(delta, updates), state, value

    held_jit = jax.jit(lambda delta, base, t, x: kl(t, forward(tparams, tcfg, x, rows(base, delta, 1))[0]).mean())
    real_inputs = w[:, P - 1:-1]
    out = {}
    for name, base in bases:
        delta = (jnp.zeros_like(base.k), jnp.zeros_like(base.v))
        state = opt.init(delta)
        start = best = h = float(held_jit(delta, base, teacher, real_inputs))
        best_step, fitted = 0, []
        log(f"{name}: step    0 real continuation {start:.4f}")
        for i in range(1, steps + 1):
            delta, state, value = step(delta, state, base, s_teacher, s_inputs)
            fitted.append(float(value))  # the sampled continuations' KL before step i's update
            if i % 10 == 0 or i == steps:
                h = float(held_jit(delta, base, teacher, real_inputs))
                best, best_step = (h, i) if h < best else (best, best_step)
                log(f"{name}: step {i:4d} sampled KL {fitted[-1]:.4f}, real continuation {h:.4f}")
        log(f"{name}: sampled continuations' KL {fitted[0]:.4f} -> {fitted[-1]:.4f}; real continuation (never fitted) "
            f"{start:.4f} -> {h:.4f}, best {best:.4f} at step {best_step} ({100 * (1 - best / start):.1f}% lower)")
        out[name] = {"start": start, "best": best, "best_step": best_step, "fitted": fitted}
    return out


if __name__ == "__main__":
    main()

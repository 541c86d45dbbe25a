"""Continue a map's residual on windows whose continuation is a long-range copy (issue 22 item 4, fix attempt).

    python -m launch.research.copy_residual --map RUN/map --out DIR --steps 200       # then:
    python -m launch.research.retrieval_diag --map RUN/map --extra copy=DIR --arms map copy          # retrieval
    python -m launch.research.retrieval_diag --map RUN/map --extra copy=DIR --part mc --arms copy     # MC vs map

The residual's own training windows (256 + 64 tokens of text, kvjax.fitting.teacher_pool) hold no copy from more
than 320 tokens back, while the needle sits ~870 back (`retrieval_diag --part copies`). Here each step adds
`--copy-batch` windows of `--prefix` tokens of training text followed by a repeat of a `--span`-token span that
started 10-20% into the window (the needle's depth), and scores source-teacher KL only on the repeat after its first
`--skip` tokens (what an induction head predicts); `--text-batch` ordinary 256 + 64 windows keep the usual objective
beside it. The source runs once per window (a pool, as the library's trainer does); each step runs the map and the
target. Only the residual moves (the ridge stays frozen); it starts from --map's residual (or fresh with --fresh).
Writes DIR (a map artifact) and DIR/log.jsonl.

Measured 2026-12-01 at cf52193 (pruned pair; --map: the default run's map as it was then, without copy windows,
`python -m kvjax.launch --config.residual.copy_windows=0 --config.residual.steps=400`; retrieval = the shipped 1K set,
200 items; source 195/200): generic repeats (800 steps) 0/50 (digits 40%); `--facts --span 16 --copy-batch 4
--copy-windows 256 --lr 2e-3 --steps 800` 129/200, with `--text-windows 1536` 131/200 (MC within the map's paired
interval, KL +0.047), `--only k1` (the reader's keys alone) 116/200. The first digit does not transfer to a separator
the windows never showed ("key: value": 0-1/50, source 49/50).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import kvjax
from kvjax.cache import init_cache
from kvjax.mapper.artifact import read_manifest
from kvjax.mapper.kl import kl
from kvjax.mapper.kvmap import apply_map, ridge_only
from kvjax.fitting.residual import make_optimizer
from kvjax.fitting.residual_config import ResidualConfig
from kvjax.models.decoder import forward, forward_features, rms_norm, unembed
from kvjax.windows import sample
from launch.toy.config import DIGITS, EQUALS_SPACE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def copy_windows(tokens: np.ndarray, n: int, prefix: int, span: int, rng: np.random.Generator,
                 facts: bool = False) -> np.ndarray:
    """int32 [n, prefix + span]: `prefix` tokens of text, then a repeat of the span that starts 10-20% into it.
    `facts`: the span is first overwritten by a fact as the source's last training phase wrote them
    (launch/toy/config.py, phase 7): 2-5 tokens drawn from the window as the key, " =", " ", then digits to the
    span's end, and it starts anywhere 64-960 tokens back (the phase's copy gaps)."""
    starts = rng.integers(0, len(tokens) - prefix, n)
    out = np.zeros((n, prefix + span), np.int32)
    for i, s in enumerate(starts):
        w = np.array(tokens[s : s + prefix], np.int32)
        if facts:
            a = prefix - int(rng.integers(64, min(960, prefix - span) + 1))
            cue = int(rng.integers(2, 6))
            w[a : a + cue] = w[rng.integers(0, prefix, cue)]
            w[a + cue : a + cue + len(EQUALS_SPACE)] = EQUALS_SPACE
            w[a + cue + len(EQUALS_SPACE) : a + span] = rng.choice(DIGITS, span - cue - len(EQUALS_SPACE))
        else:
            a = int(rng.integers(int(0.1 * prefix), int(0.2 * prefix)))
        out[i] = np.concatenate([w, w[a : a + span]])
    return out


def build_pool(source, windows: np.ndarray, prefix: int, batch: int = 4):
    """(source K [L, N, H, prefix-1, hd], V, teacher last-layer output [N, cont, D]) of windows [N, prefix + cont]."""
    cfg, params = source

    @jax.jit
    def rows(tokens):
        inputs = tokens[:, :-1]
        fresh = init_cache(cfg, tokens.shape[0], inputs.shape[1], params.embed.dtype)
        _, cache, h = forward_features(params, cfg, inputs, fresh, (cfg.num_layers - 1,), fresh=True)
        return cache.k[:, :, :, : prefix - 1], cache.v[:, :, :, : prefix - 1], h[:, prefix - 1 :]

    ks, vs, hs = [], [], []
    for i in range(0, len(windows), batch):
        k, v, h = rows(jnp.asarray(windows[i : i + batch]))
        ks.append(np.asarray(k)), vs.append(np.asarray(v)), hs.append(np.asarray(h))
    return np.concatenate(ks, 1), np.concatenate(vs, 1), np.concatenate(hs)


def make_step(opt, source, target, copy_prefix: int, text_prefix: int, skip: int, copy_weight: float,
              only: tuple[str, ...] = ()):
    """`only`: train just these residuals ("k1" = target layer 1's keys, "v0", ...); the others keep --map's."""
    (scfg, sparams), (tcfg, tparams) = source, target

    def keep(grads):
        if not only:
            return grads
        pick = lambda kind, layers: tuple(g if f"{kind}{i}" in only else jax.tree.map(jnp.zeros_like, g)  # noqa: E731
                                          for i, g in enumerate(layers))
        return grads.replace(keys=pick("k", grads.keys), values=pick("v", grads.values))

    def window_loss(kvmap, tokens, k, v, hidden, prefix, first):
        cache = kvjax.KVCache.from_stacked(k, v, jnp.full((tokens.shape[0],), prefix - 1, jnp.int32))
        mapped = apply_map(kvmap, cache, capacity=tokens.shape[1], length=prefix - 1)
        student = forward(tparams, tcfg, tokens[:, prefix - 1 : -1], mapped)[0]
        teacher = unembed(sparams, rms_norm(hidden, sparams.final_norm, scfg.rms_norm_eps))
        return kl(jax.lax.stop_gradient(teacher), student)[:, first:].mean()

    @jax.jit
    def step(kvmap, state, copy_batch, text_batch):
        def loss(m):
            lc = window_loss(m, *copy_batch, copy_prefix, skip) if copy_weight > 0 else 0.0
            lt = window_loss(m, *text_batch, text_prefix, 0) if copy_weight < 1 else 0.0
            return copy_weight * lc + (1 - copy_weight) * lt, (lc, lt)
        (value, parts), grads = jax.value_and_grad(loss, has_aux=True)(kvmap)
        updates, state = opt.update(keep(grads), state, kvmap)
        return optax.apply_updates(kvmap, updates), state, value, parts

    return step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--map", default="runs/toy_pruned_quick/map", help="a map artifact of the pair (a run's map/)")
    p.add_argument("--source", default=os.path.join(REPO, "checkpoints/toy/source"))
    p.add_argument("--target", default=os.path.join(REPO, "checkpoints/toy/pruned"))
    p.add_argument("--train-tokens", default="",
                   help="training tokens (default: RUN/data/train_tokens.npy of --map's run)")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prefix", type=int, default=1024, help="copy windows: text tokens before the repeat")
    p.add_argument("--span", type=int, default=24, help="copy windows: repeated tokens")
    p.add_argument("--facts", action="store_true", help="copy windows: the repeated span is a key = digits fact")
    p.add_argument("--skip", type=int, default=2, help="copy windows: repeat tokens not scored (not yet copyable)")
    p.add_argument("--copy-windows", type=int, default=128, help="distinct copy windows in the pool")
    p.add_argument("--text-windows", type=int, default=256, help="distinct 256 + 64 text windows in the pool")
    p.add_argument("--copy-batch", type=int, default=2)
    p.add_argument("--text-batch", type=int, default=4)
    p.add_argument("--copy-weight", type=float, default=0.5, help="share of the loss on the copy windows")
    p.add_argument("--only", nargs="*", default=[], metavar="k1",
                   help="train only these residuals (k|v + target layer), e.g. k1: the reader layer's keys")
    p.add_argument("--fresh", action="store_true", help="start the residual at zero (the ridge) instead of --map's")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.train_tokens = args.train_tokens or os.path.join(os.path.dirname(os.path.abspath(args.map)), "data",
                                                          "train_tokens.npy")
    for path in (args.map, args.train_tokens):
        if not os.path.exists(path):
            raise SystemExit(f"{path}: not found (--map RUN/map, --train-tokens RUN/data/train_tokens.npy)")
    if os.path.exists(os.path.join(args.out, "manifest.json")):
        raise SystemExit(f"{args.out} already holds a map; pass another --out")
    source, target = kvjax.load_hf(args.source), kvjax.load_hf(args.target)
    kvmap = kvjax.load_map(args.map, source[0], target[0])
    if args.fresh:
        kvmap = ridge_only(kvmap)
    tokens = np.load(args.train_tokens, mmap_mode="r")
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    cw = copy_windows(tokens, args.copy_windows, args.prefix, args.span, rng, args.facts)
    tw = sample(np.asarray(tokens), args.text_windows, 256 + 64, seed=args.seed + 101)
    copy_pool = (cw, *build_pool(source, cw, args.prefix))
    text_pool = (tw, *build_pool(source, tw, 256))
    print(f"pools: {len(cw)} copy windows of {args.prefix} + {args.span}, {len(tw)} text windows; "
          f"{time.time() - t0:.0f} s", flush=True)
    rc = ResidualConfig(steps=args.steps, lr=args.lr, warmup_steps=min(20, args.steps // 10))
    opt = make_optimizer(rc, kvmap)
    state = opt.init(kvmap)
    step = make_step(opt, source, target, args.prefix, 256, args.skip, args.copy_weight, tuple(args.only))

    def batch(pool, n, i):
        toks, k, v, h = pool
        r = np.random.default_rng([args.seed, i, n]).choice(len(toks), n, replace=False)
        return jnp.asarray(toks[r]), jnp.asarray(k[:, r]), jnp.asarray(v[:, r]), jnp.asarray(h[r])

    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "log.jsonl"), "w")
    t0 = time.time()
    for i in range(args.steps):
        kvmap, state, value, (lc, lt) = step(kvmap, state, batch(copy_pool, args.copy_batch, i),
                                             batch(text_pool, args.text_batch, i))
        row = {"step": i + 1, "loss": float(value), "copy_kl": float(lc), "text_kl": float(lt),
               "s": round(time.time() - t0, 1)}
        log.write(json.dumps(row) + "\n"), log.flush()
        if (i + 1) % 20 == 0 or i == 0:
            print(row, flush=True)
    info = dict(read_manifest(args.map).get("info", {}), copy_residual=vars(args))
    kvjax.save_map(args.out, kvmap, info)
    print(f"saved {args.out} ({time.time() - t0:.0f} s of training)")


if __name__ == "__main__":
    main()

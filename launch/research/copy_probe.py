"""Can a model shape learn to copy at all? Train it from scratch on the pure induction task and watch the repeat.

    python -m launch.research.copy_probe --layers 2 --hidden 128 --heads 4 --kv-heads 2 --head-dim 32 --lr 3e-3

Every training sequence is `--span` tokens drawn at random from the training split, then the same tokens again, so
the second half is predictable only by copying (an induction head: find the earlier occurrence of the current token,
predict what followed it). Prints the held-out-style loss on the first half (the unigram floor, ~7 nats) and on the
repeat every `--every` steps; a shape that can copy drives the repeat towards 0. This is a check of the
architecture and optimiser settings, minutes on 2 CPU cores, before spending an hour training a toy target that
must read its context (issue 4's mapped path rewards a target that can).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from launch.toy.config import toy_model
from kvjax.models.decoder import forward_nocache
from kvjax.pretrain import TrainConfig, batch_at, init_state, make_train_step
from launch.toy.train import load_tokens


def repeated_batch(tokens: np.ndarray, step: int, batch: int, span: int, seed: int) -> np.ndarray:
    """int32 [batch, 2 * span]: random training-split tokens, each row's first half repeated (the trainer's own
    `repeat_prob` windows, so the probe sees exactly what a training config with it would)."""
    return batch_at(tokens, step, batch, 2 * span - 1, seed, repeat_prob=1.0, repeat_span=span)


def half_losses(params, cfg, seqs: np.ndarray) -> tuple[float, float]:
    """Mean next-token CE on the first half (unpredictable) and on the repeat (copyable) of seqs [B, 2 * span]."""
    span = seqs.shape[1] // 2
    toks = jnp.asarray(seqs)
    logp = jax.nn.log_softmax(forward_nocache(params, cfg, toks[:, :-1]).astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, toks[:, 1:, None], -1)[..., 0]
    return float(nll[:, : span - 1].mean()), float(nll[:, span:].mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--ffn", type=int, default=None, help="default 3 x hidden")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--span", type=int, default=128, help="random tokens per sequence, then repeated once")
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--data-dir", default="work/toy/data")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.steps < 1 or args.span < 2 or args.batch < 1:
        p.error("--steps, --batch must be >= 1 and --span >= 2")
    cfg = toy_model(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, ffn=args.ffn or 3 * args.hidden)
    tc = TrainConfig(seq_len=2 * args.span - 1, batch_size=args.batch, steps=args.steps, lr=args.lr,
                     warmup_steps=min(20, args.steps // 5), seed=args.seed)
    tokens, _ = load_tokens(args.data_dir)
    probe = repeated_batch(tokens, 0, 32, args.span, seed=args.seed + 1)  # fixed sequences, not trained on
    print(f"{cfg.num_params() / 1e6:.2f}M params, {args.layers} x {args.hidden}, {args.heads} q / {args.kv_heads} kv "
          f"heads x {args.head_dim}, lr {args.lr:g}", flush=True)
    state, step_fn = init_state(cfg, tc), make_train_step(cfg, tc)
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        state, _ = step_fn(state, repeated_batch(tokens, i, args.batch, args.span, seed=args.seed))
        if i % args.every == 0 or i == args.steps:
            first, repeat = half_losses(state.params, cfg, probe)
            print(f"step {i:5d}  first half {first:.2f}  repeat {repeat:.2f}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()

"""Short training runs of one toy model at several peak learning rates, to choose settings before a long run.

    python -m launch.research.lr_sweep --role source --lrs 2e-3 6e-3 --steps 60 --warmup 10

Each run trains from the config's initialisation for --steps steps (own warmup + cosine) in work/toy/sweep/ and
prints its final held-out loss (the trainer's fixed held-out batches).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil

from launch.toy.config import get_config
from kvjax.pretrain import train
from launch.toy.train import load_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["target", "source"], default="source")
    p.add_argument("--lrs", type=float, nargs="+", default=[2e-3, 6e-3])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default="work/toy/sweep")
    args = p.parse_args()
    cfg = get_config()
    train_tokens, heldout_tokens = load_tokens(cfg.data_dir)
    model, base = getattr(cfg, args.role), getattr(cfg, f"{args.role}_train")
    results = {}
    for lr in args.lrs:
        tc = dataclasses.replace(base, lr=lr, steps=args.steps, warmup_steps=args.warmup, eval_every=args.steps,
                                 save_every=args.steps)
        workdir = os.path.join(args.out, f"{args.role}_lr{lr:g}_s{args.steps}")
        shutil.rmtree(workdir, ignore_errors=True)
        train(model, tc, train_tokens, heldout_tokens, workdir, name=f"{args.role} lr={lr:g}")
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            results[lr] = json.loads(f.readlines()[-1])["heldout_loss"]
    for lr, loss in results.items():
        print(f"{args.role} lr={lr:g} steps={args.steps}: held-out CE {loss:.3f}")


if __name__ == "__main__":
    main()

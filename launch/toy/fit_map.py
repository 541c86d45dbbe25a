"""Fit, train and measure the toy pair's cache map: the main job's `toy` config under the flags of the former
standalone script (distances, KL and next-token agreement on held-out windows; multiple choice with --mc).

    python -m launch.toy.fit_map                    # ridge + residual, writes runs/toy_map/
    python -m launch.toy.fit_map --residual-steps 0 # ridge only
    python -m launch.toy.fit_map --target checkpoints/toy/pruned --out runs/pruned_map --pairing 3 \
        --residual-steps 1500 --residual-lr 3e-3 --mc 1000

is `python -m kvjax.launch --config=toy --config.FIELD=VALUE ...` (`--print` shows the translation); the numbers are
in OUT/metrics.json and OUT/report.md. Calibration text: the toy config's (the train split), or DATA_DIR/train.npy
with --data-dir; lambda is chosen on 32 other training windows; distances on the first 32 held-out windows
(TOY_DIR/eval/heldout_windows.npy), KL and agreement on the next 128.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy-dir", default="checkpoints/toy", help="source/, target/, eval/ (held-out windows, MC sets)")
    p.add_argument("--target", default=None, help="another target checkpoint (default: TOY_DIR/target)")
    p.add_argument("--data-dir", default=None, help="calibrate on DATA_DIR/train.npy (default: the toy config's "
                                                    "training text)")
    p.add_argument("--out", default="runs/toy_map")
    p.add_argument("--calib-windows", type=int, default=256, help="calibration windows of --window tokens")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--residual-steps", type=int, default=200)
    p.add_argument("--residual-lr", type=float, default=1e-3, help="peak learning rate of the residual")
    p.add_argument("--residual-rank", type=int, default=16)
    p.add_argument("--residual-batch", type=int, default=8, help="windows per residual step")
    p.add_argument("--rollout", action="store_true", help="residual KL on the target's own greedy continuation")
    p.add_argument("--pairing", default="depth", help='"depth" or k: the top-k source layers by held-out R^2')
    p.add_argument("--prefix", type=int, default=256, help="prefix tokens mapped for KL (held-out windows)")
    p.add_argument("--cont", type=int, default=64, help="continuation tokens scored by KL")
    p.add_argument("--mc", type=int, default=0, metavar="N",
                   help="also score the first N items of the toy dir's multiple-choice sets with every arm")
    p.add_argument("--print", action="store_true", help="print the kvjax.launch command and exit")
    return p.parse_args(argv)


def launch_args(args: argparse.Namespace) -> list[str]:
    """The `python -m kvjax.launch` arguments these flags stand for."""
    if not (args.pairing == "depth" or args.pairing.isdigit()):
        raise SystemExit(f"--pairing {args.pairing!r}: use 'depth' or a number of source layers")
    toy = args.toy_dir
    config = {
        "source.path": os.path.join(toy, "source"), "target.path": args.target or os.path.join(toy, "target"),
        "output_dir": args.out, "data.heldout_windows": os.path.join(toy, "eval", "heldout_windows.npy"),
        "map.calib_windows": args.calib_windows, "map.select_windows": 32, "map.window_len": args.window,
        "map.pairing": args.pairing if args.pairing == "depth" else f"top{args.pairing}",
        "map.rank": "None" if args.rank is None else args.rank, "map.residual_rank": args.residual_rank,
        "residual.steps": args.residual_steps, "residual.lr": args.residual_lr,
        "residual.batch_size": args.residual_batch, "residual.rollout": args.rollout,
        "residual.prefix_len": args.prefix, "residual.cont_len": args.cont,
        "eval.distances.windows": 32, "eval.distances.window_len": args.window,
        "eval.kl.windows": 128, "eval.kl.prefix_len": args.prefix, "eval.kl.cont_len": args.cont,
        "eval.mc.enabled": args.mc > 0, "eval.retrieval.enabled": False, "eval.throughput.enabled": False,
    }
    if args.mc:
        config.update({"eval.mc.limit": args.mc, "eval.mc.hellaswag": os.path.join(toy, "eval", "hellaswag.jsonl"),
                       "eval.mc.piqa": os.path.join(toy, "eval", "piqa.jsonl")})
    if args.data_dir:
        config["data.train_text"] = os.path.join(args.data_dir, "train.npy")
    return ["--config=toy", *(f"--config.{k}={v}" for k, v in config.items())]


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvjax import launch
    sys.exit(launch.alias(launch_args(args), args.print))


if __name__ == "__main__":
    main()

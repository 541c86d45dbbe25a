"""Train the toy source/target pair and export both as HF Qwen3 checkpoints.

    python -m launch.toy.data     # once: corpus, tokenizer, tokenized arrays under work/toy/data
    python -m launch.toy.train    # trains target then source (resumes from work/toy/train), exports to
                                  # checkpoints/toy/{target,source}, writes checkpoints/toy/loss.png

Settings: launch/toy/config.py. Interrupt at any time; rerunning resumes from the last checkpoint (every
`save_every` steps) and gives the same result as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

from launch.toy.config import get_config
from kvjax.hf import load_hf, save_hf
from kvjax.pretrain import plot_loss, train

log = logging.getLogger("launch.toy.train")


def load_tokens(data_dir: str) -> tuple[np.ndarray, np.ndarray]:
    paths = [os.path.join(data_dir, f"{split}.npy") for split in ("train", "heldout")]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        sys.exit(f"missing tokenized data {missing}; build it first with `python -m launch.toy.data`")
    return tuple(np.load(p, mmap_mode="r") for p in paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["target", "source"], help="train just one of the pair")
    parser.add_argument("--no-export", action="store_true", help="train only; do not write checkpoints/toy")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    cfg = get_config()
    train_tokens, heldout_tokens = load_tokens(cfg.data_dir)
    log.info("data: %d train tokens, %d held-out tokens", len(train_tokens), len(heldout_tokens))
    roles = [args.only] if args.only else ["target", "source"]
    for role in roles:
        model_cfg, tc = getattr(cfg, role), getattr(cfg, f"{role}_train")
        log.info("%s: %.2fM params, %d steps x %d x %d tokens", role, model_cfg.num_params() / 1e6, tc.steps,
                 tc.batch_size, tc.seq_len)
        params = train(model_cfg, tc, train_tokens, heldout_tokens, os.path.join(cfg.work_dir, role), name=role)
        for i, phase in enumerate(getattr(cfg, f"{role}_continue", ()), start=2):
            log.info("%s: phase %d, %d more steps from the previous phase's weights at lr %g", role, i,
                     phase.end_at or phase.steps, phase.lr)
            params = train(model_cfg, phase, train_tokens, heldout_tokens,
                           os.path.join(cfg.work_dir, f"{role}_phase{i}"), name=f"{role} phase {i}", init=params)
        if not args.no_export:
            out = os.path.join(cfg.out_dir, role)
            save_hf(out, model_cfg, params, tokenizer_dir=cfg.tokenizer_dir)
            load_hf(out)  # the exported directory must load back
            log.info("%s exported to %s", role, out)
    metrics = []
    for role in ("target", "source"):
        phases = [role] + [f"{role}_phase{i}" for i in range(2, 2 + len(getattr(cfg, f"{role}_continue", ())))]
        metrics.append([os.path.join(cfg.work_dir, p, "metrics.jsonl") for p in phases])
    if all(os.path.isfile(m) for phases in metrics for m in phases):
        plot_loss(metrics, os.path.join(cfg.out_dir, "loss.png"), title="toy pair training",
                  labels=["target", "source"])


if __name__ == "__main__":
    main()

"""Fit a cache map (ridge + residual) on a token file, one to many hosts: the main job's `fit` config under the flags
of the former standalone pipeline. Every process runs the same command.

    python -m launch.cluster.fit_distributed --source SRC --target TGT --tokens tokens.npy --out runs/map
    python -m launch.cluster.multihost --procs 2 --devices-per-proc 2 -- launch.cluster.fit_distributed --source SRC ...
    # a TPU pod slice or a SLURM GPU cluster: launch/cluster/templates/ (they start python -m kvjax.launch directly)

is exactly

    python -m kvjax.launch --config=fit --config.source.path=SRC --config.target.path=TGT \
        --config.data.train_text=tokens.npy --config.output_dir=runs/map ...

(`--print` shows the translation). The mesh is ('data', 'model'): calibration and residual batches split over
'data', the models' heads/FFN over 'model' (within a host). --out gets map/ (map_ridge/ with --residual-steps 0),
written by process 0, and residual/ (orbax checkpoints written by every process: --out must be on a filesystem
every host sees). A relaunch reuses the finished stages and resumes the residual from its last checkpoint.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="HF dir of the source (large) model")
    p.add_argument("--target", required=True, help="HF dir of the target (small) model")
    p.add_argument("--tokens", required=True, help=".npy flat token array for calibration and residual training; "
                                                   "lambda is chosen on other windows of it")
    p.add_argument("--out", required=True, help="the run directory (shared by all hosts)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model parameter dtype")
    p.add_argument("--mesh-model", type=int, default=0, help="devices per model replica (heads/FFN split; 0: all of "
                                                             "one process's devices)")
    p.add_argument("--mesh-data", type=int, default=1, help="data-parallel ways (with several processes, 1 means "
                                                            "one per process)")
    p.add_argument("--seed", type=int, default=0, help="window draws and residual batch order")
    g = p.add_argument_group("ridge fit")
    g.add_argument("--calib-windows", type=int, default=256)
    g.add_argument("--heldout-windows", type=int, default=32, help="windows for choosing lambda")
    g.add_argument("--window", type=int, default=512, help="tokens per calibration window")
    g.add_argument("--batch-size", type=int, default=8, help="global calibration batch (windows)")
    g.add_argument("--pairing", default="depth", help="'depth' or k (top-k source layers by held-out R^2)")
    g.add_argument("--rank", type=int, default=None, help="reduced rank of the ridge map (default: full)")
    g = p.add_argument_group("residual")
    g.add_argument("--residual-rank", type=int, default=16)
    g.add_argument("--residual-steps", type=int, default=200, help="0 = ridge only")
    g.add_argument("--residual-batch", type=int, default=8, help="global batch (windows)")
    g.add_argument("--prefix", type=int, default=256, help="tokens mapped into the target's cache")
    g.add_argument("--cont", type=int, default=64, help="continuation tokens scored by KL")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--warmup", type=int, default=20)
    g.add_argument("--save-every", type=int, default=50, help="checkpoint interval (steps)")
    g = p.add_argument_group("distributed (kvjax.launch's flags; defaults from JAX_COORDINATOR_ADDRESS / "
                             "JAX_NUM_PROCESSES / JAX_PROCESS_ID)")
    g.add_argument("--distributed", choices=("auto", "on", "off"), default="auto")
    g.add_argument("--coordinator", default=None)
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)
    g.add_argument("--heartbeat-timeout", type=int, default=30)
    g.add_argument("--init-timeout", type=int, default=300)
    g.add_argument("--step-timeout", type=float, default=0.0)
    p.add_argument("--print", action="store_true", help="print the kvjax.launch command and exit")
    return p.parse_args(argv)


def launch_args(args: argparse.Namespace) -> list[str]:
    """The `python -m kvjax.launch` arguments these flags stand for."""
    if not (args.pairing == "depth" or args.pairing.isdigit()):
        raise SystemExit(f"--pairing {args.pairing!r}: use 'depth' or a number of source layers")
    n_tokens = len(np.load(args.tokens, mmap_mode="r")) if args.tokens.endswith(".npy") else 0
    config = {
        "source.path": args.source, "target.path": args.target, "source.dtype": args.dtype,
        "target.dtype": args.dtype, "output_dir": args.out, "seed": args.seed,
        "data.train_text": args.tokens, "data.heldout_text": args.tokens, "data.heldout_window_len": args.window,
        "data.max_train_tokens": max(n_tokens, 1), "mesh.data": args.mesh_data, "mesh.model": args.mesh_model,
        "map.calib_windows": args.calib_windows, "map.select_windows": args.heldout_windows,
        "map.window_len": args.window, "map.batch_size": args.batch_size,
        "map.pairing": args.pairing if args.pairing == "depth" else f"top{args.pairing}",
        "map.rank": "None" if args.rank is None else args.rank, "map.residual_rank": args.residual_rank,
        "residual.steps": args.residual_steps, "residual.batch_size": args.residual_batch,
        "residual.prefix_len": args.prefix, "residual.cont_len": args.cont, "residual.lr": args.lr,
        "residual.warmup_steps": args.warmup, "residual.save_every": args.save_every, "residual.seed": args.seed,
    }
    out = ["--config=fit", *(f"--config.{k}={v}" for k, v in config.items()),
           f"--distributed={args.distributed}", f"--heartbeat_timeout={args.heartbeat_timeout}",
           f"--init_timeout={args.init_timeout}", f"--step_timeout={args.step_timeout}"]
    for name in ("coordinator", "num_processes", "process_id"):
        if getattr(args, name) is not None:
            out.append(f"--{name}={getattr(args, name)}")
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvjax import launch
    sys.exit(launch.alias(launch_args(args), args.print))


if __name__ == "__main__":
    main()

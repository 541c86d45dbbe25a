"""Fit a cache map (ridge + residual) as a JAX multi-controller job: every process runs this same program.

    # one process, all local devices
    python -m launch.fit_distributed --source SRC --target TGT --tokens tokens.npy --out runs/map
    # N processes on this machine (tests, laptops)
    python -m launch.multihost --procs 2 --devices-per-proc 2 -- launch.fit_distributed --source SRC ...
    # a TPU pod slice or a SLURM GPU cluster: launch/templates/

--source/--target are HF Qwen3 dirs (the same tokenizer); --tokens is a flat .npy token array, memory-mapped, of
which each process reads only the windows its devices hold. The mesh is ('data', 'model'): calibration batches
and residual-training batches split over 'data', the models' heads/FFN over 'model'. Statistics are summed over
devices and processes before the ridge solve, so the map equals the single-device one.

Writes to --out: map/ (kvjax.save_map) and report.json, by process 0 only; residual_ckpt/ (orbax, written by all
processes, so --out must be on a filesystem every host sees). A relaunch with the same flags refits the ridge map
(deterministic) and resumes the residual from its last checkpoint; the result equals an uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax import distributed, sharding
from kvjax.distributed import TokenWindows
from kvjax.mapper.residual import ResidualConfig

log = logging.getLogger("launch.fit_distributed")
CALIB_SEED, HELDOUT_SEED = 1, 2  # window draws: TokenWindows.sample(tokens, n, window, seed + these)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, help="HF dir of the source (large) model")
    p.add_argument("--target", required=True, help="HF dir of the target (small) model")
    p.add_argument("--tokens", required=True, help=".npy flat token array for calibration and residual training")
    p.add_argument("--heldout-tokens", default=None, help=".npy for lambda selection (default: --tokens)")
    p.add_argument("--out", required=True, help="output dir (shared by all hosts)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model parameter dtype")
    p.add_argument("--mesh-model", type=int, default=1, help="devices per model replica (heads/FFN split)")
    p.add_argument("--mesh-data", type=int, default=None, help="data-parallel ways (default: devices / model)")
    p.add_argument("--seed", type=int, default=0, help="window draws, residual init and batch order")
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
    distributed.add_flags(p)
    return p.parse_args(argv)


def _load_tokens(path: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"token file {path} not found; pass a .npy flat token array (np.save)")
    tokens = np.load(path, mmap_mode="r")
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: need a flat integer token array, got {tokens.dtype}{tokens.shape}")
    return tokens


def _windows_info(tokens_path: str, windows: TokenWindows, seed: int) -> dict:
    return {"tokens": os.path.abspath(tokens_path), "n_tokens": int(len(windows.tokens)), "count": len(windows),
            "window": windows.length, "seed": seed,
            "starts_sha256": hashlib.sha256(windows.starts.astype(np.int64).tobytes()).hexdigest()}


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict:
    """The job body (after jax.distributed is up). Returns the report (the same on every process)."""
    n_dev = jax.device_count()
    data = args.mesh_data or max(n_dev // args.mesh_model, 1)
    mesh = sharding.make_mesh(data=data, model=args.mesh_model)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    models = []
    for path in (args.source, args.target):
        cfg = kvjax.load_hf_config(path)
        models.append(kvjax.load_hf(path, dtype=dtype, shardings=kvjax.models.params.param_shardings(cfg, mesh)))
    source, target = models
    tokens = _load_tokens(args.tokens)
    held_tokens = tokens if args.heldout_tokens is None else _load_tokens(args.heldout_tokens)
    calib = TokenWindows.sample(tokens, args.calib_windows, args.window, args.seed + CALIB_SEED)
    held = TokenWindows.sample(held_tokens, args.heldout_windows, args.window, args.seed + HELDOUT_SEED)
    pairing = int(args.pairing) if args.pairing.isdigit() else args.pairing

    with distributed.Watchdog(args.step_timeout):
        t0 = time.perf_counter()
        kvmap, report = kvjax.fit_map(source, target, calib, held, pairing=pairing, rank=args.rank,
                                      residual_rank=args.residual_rank, batch_size=args.batch_size, seed=args.seed,
                                      mesh=mesh)
        fit_s = time.perf_counter() - t0
        log.info("ridge fit: %d + %d windows of %d tokens in %.1f s", len(calib), len(held), args.window, fit_s)
        history = []
        if args.residual_steps:
            rc = ResidualConfig(steps=args.residual_steps, batch_size=args.residual_batch, prefix_len=args.prefix,
                                cont_len=args.cont, lr=args.lr, warmup_steps=args.warmup, seed=args.seed,
                                save_every=args.save_every)
            kvmap, history = kvjax.train_residual(kvmap, source, target, tokens, rc, workdir=args.out, mesh=mesh)
    report.update(processes=jax.process_count(), devices=n_dev, mesh=dict(mesh.shape), dtype=args.dtype,
                  fit_seconds=fit_s, fit_tokens_per_s=(len(calib) + len(held)) * args.window / fit_s,
                  residual_steps_this_run=len(history),
                  residual_final_kl=history[-1]["kl"] if history else None)
    if distributed.is_primary():
        os.makedirs(args.out, exist_ok=True)
        info = {"source": os.path.abspath(args.source), "target": os.path.abspath(args.target),
                "calib": _windows_info(args.tokens, calib, args.seed + CALIB_SEED),
                "heldout": _windows_info(args.heldout_tokens or args.tokens, held, args.seed + HELDOUT_SEED),
                "calib_tokens": report["calib_tokens"], "args": vars(args),
                "fit": {k: v for k, v in report.items() if k != "layers"}, "layers": report["layers"]}
        tok = os.path.join(args.target, "tokenizer.json")
        if os.path.isfile(tok):
            with open(tok, "rb") as f:
                info["tokenizer_sha256"] = hashlib.sha256(f.read()).hexdigest()
        kvjax.save_map(os.path.join(args.out, "map"), kvmap, info=info)
        _write_json(os.path.join(args.out, "report.json"), report)
        log.info("wrote %s", os.path.join(args.out, "map"))
    distributed.barrier("kvjax_fit_distributed_written")  # nobody reports success before the map exists
    return report


def main(argv=None) -> None:
    args = parse_args(argv)
    distributed.initialize_from_args(args)  # before anything touches a device
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                        format=f"%(asctime)s [p{jax.process_index()}] %(name)s: %(message)s")
    for noisy in ("absl", "orbax", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    log.info("process %d of %d, %d local devices", jax.process_index(), jax.process_count(), jax.local_device_count())
    run(args)


if __name__ == "__main__":
    main()

"""Fit, train and measure the toy pair's cache map (the numbers issue 4 asks for), on held-out data only.

    python -m launch.toy.fit_map                    # ridge + residual, writes runs/toy_map/{map,report.json}
    python -m launch.toy.fit_map --residual-steps 0 # ridge only
    python -m launch.toy.fit_map --target checkpoints/toy/pruned --out runs/pruned_map --pairing 3 \
        --residual-steps 1500 --residual-lr 3e-3 --mc 1000   # + multiple choice of every arm (a finished run only
                                                             # evaluates)

Calibration windows come from the training split (work/toy/data/train.npy); lambda selection uses separate
training-split windows; distances and KL are measured on checkpoints/toy/eval/heldout_windows.npy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os

import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.eval import load_mc, next_token_agreement, paired_bootstrap_ci
from kvjax.eval.arms import injection_map, make_arms, score_mc_arms
from kvjax.eval.distances import cache_distances, feature_distances, raw_features
from kvjax.mapper.calibrate import native_cache
from kvjax.mapper.features import layer_features
from kvjax.mapper.kvmap import ridge_only
from kvjax.mapper.residual import ResidualConfig, evaluate_kl
from kvjax.windows import sample

log = logging.getLogger("launch.toy.fit_map")


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def distances(kvmap, source, target, windows) -> dict:
    """Mean over layers of cosine / NRMSE: raw (nearest-depth source, width-matched), ridge(+residual) map."""
    (scfg, sparams), (tcfg, tparams) = source, target
    src = native_cache(sparams, scfg, jnp.asarray(windows))
    tgt = native_cache(tparams, tcfg, jnp.asarray(windows))
    mapped = kvjax.apply_map(kvmap, src)
    per_layer = cache_distances(mapped, tgt, tcfg.rope_theta)
    raw = []
    for t, layers in enumerate(kvmap.spec.pairing):
        nk, nv = layer_features(tgt, t, tcfg.rope_theta)
        rk, rv = raw_features(src, layers[0], scfg.rope_theta, nk.shape[-1])
        flat = lambda a: np.asarray(a).reshape(-1, a.shape[-1])  # noqa: E731
        k, v = feature_distances(flat(rk), flat(nk)), feature_distances(flat(rv), flat(nv))
        raw.append({"key_cos": k["cos"], "key_nrmse": k["nrmse"], "value_cos": v["cos"], "value_nrmse": v["nrmse"]})
    mean = lambda rows: {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}  # noqa: E731
    return {"mapped": mean(per_layer), "raw": mean(raw), "mapped_per_layer": per_layer}


def multiple_choice(toy_dir: str, source, target, maps: dict, limit: int) -> dict:
    """Accuracy of every arm on both sets; mapped arms vs the native target (paired 95% CI, share of the gap). The
    pair shares one tokenizer (the map's manifest checks it); it is read from TOY_DIR/source."""
    tokenizer = kvjax.load_tokenizer(os.path.join(toy_dir, "source"))
    arms = make_arms(["target", "source", *maps], source, target, maps)
    out = {}
    for schema in ("hellaswag", "piqa"):
        items = load_mc(os.path.join(toy_dir, "eval", f"{schema}.jsonl"), schema=schema, limit=limit)
        scored = score_mc_arms(items, tokenizer, arms, desc=schema)
        correct = {n: np.asarray(r.correct, float) for n, r in scored.items()}
        gap = correct["source"].mean() - correct["target"].mean()
        row = {"items": len(items), "accuracy": {n: float(c.mean()) for n, c in correct.items()}}
        for name in maps:
            ci = paired_bootstrap_ci(correct[name], correct["target"])
            row[f"{name}_minus_target_ci95"] = [ci.lo, ci.hi]
            gain = correct[name].mean() - correct["target"].mean()
            row[f"{name}_gap_recovered"] = float(gain / gap) if gap else None
        out[schema] = row
        log.info("%s (%d items): %s; residual - target CI %s", schema, len(items),
                 {n: round(a, 4) for n, a in row["accuracy"].items()}, row.get("residual_minus_target_ci95"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy-dir", default="checkpoints/toy", help="source/, target/, eval/ (held-out windows, MC sets)")
    p.add_argument("--target", default=None, help="another target checkpoint (default: TOY_DIR/target)")
    p.add_argument("--data-dir", default="work/toy/data")
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
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    source = kvjax.load_hf(os.path.join(args.toy_dir, "source"))
    target_dir = args.target or os.path.join(args.toy_dir, "target")
    target = kvjax.load_hf(target_dir)
    train_tokens = np.load(os.path.join(args.data_dir, "train.npy"), mmap_mode="r")
    calib = sample(train_tokens, args.calib_windows, args.window, seed=1)
    select = sample(train_tokens, 32, args.window, seed=2)
    heldout = np.load(os.path.join(args.toy_dir, "eval", "heldout_windows.npy")).astype(np.int32)

    pairing = args.pairing if args.pairing == "depth" else int(args.pairing)
    kvmap, report = kvjax.fit_map(source, target, calib, select, pairing=pairing, rank=args.rank,
                                  residual_rank=args.residual_rank)
    dist_windows = heldout[:32, : args.window]
    kl_windows = heldout[32:160, : args.prefix + args.cont]
    report["distances_ridge"] = distances(kvmap, source, target, dist_windows)
    kl_ridge = evaluate_kl(kvmap, source, target, kl_windows, args.prefix)
    report["kl_ridge"] = float(kl_ridge.mean())
    log.info("ridge: %s, KL %.4f", report["distances_ridge"]["mapped"], report["kl_ridge"])
    if args.residual_steps:
        rc = ResidualConfig(steps=args.residual_steps, prefix_len=args.prefix, cont_len=args.cont, lr=args.residual_lr,
                            batch_size=args.residual_batch, rollout=args.rollout)
        kvmap, _ = kvjax.train_residual(kvmap, source, target, train_tokens, rc, workdir=args.out)
        report["distances_residual"] = distances(kvmap, source, target, dist_windows)
        kl_res = evaluate_kl(kvmap, source, target, kl_windows, args.prefix)
        ci = paired_bootstrap_ci(kl_res, kl_ridge)
        report.update(kl_residual=float(kl_res.mean()), kl_reduction=float(1 - kl_res.mean() / kl_ridge.mean()),
                      kl_residual_minus_ridge_ci95=[ci.lo, ci.hi])
        log.info("residual: KL %.4f (%.1f%% lower; paired 95%% CI of the difference [%.4f, %.4f])",
                 report["kl_residual"], 100 * report["kl_reduction"], ci.lo, ci.hi)
    agree = next_token_agreement(kvmap, source, target, kl_windows, args.prefix)
    report["agreement"] = {k: float(v.mean()) for k, v in agree.items()}
    log.info("next-token agreement: %s", report["agreement"])
    info = {"source": os.path.join(args.toy_dir, "source"), "target": target_dir,
            "tokenizer_sha256": sha256_file(os.path.join(target_dir, "tokenizer.json")),
            "calib_sha256": hashlib.sha256(calib.tobytes()).hexdigest(), "calib_tokens": report["calib_tokens"],
            "fit": {k: v for k, v in report.items() if k != "layers"}, "layers": report["layers"]}
    kvjax.save_map(os.path.join(args.out, "map"), kvmap, info=info)
    if args.mc:
        maps = {"direct": injection_map(source[0], target[0]), "ridge": ridge_only(kvmap)}
        if args.residual_steps:
            maps["residual"] = kvmap
        report["mc"] = multiple_choice(args.toy_dir, source, target, maps, args.mc)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k not in ("layers", "distances_ridge", "distances_residual")}
                     | {"ridge": report["distances_ridge"]["mapped"], "raw": report["distances_ridge"]["raw"]},
                     indent=1))


if __name__ == "__main__":
    main()

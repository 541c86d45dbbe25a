"""Measure the shipped toy pair on its held-out eval sets and write checkpoints/toy/README.md's numbers.

    python -m launch.toy.evaluate                 # both models: held-out CE (kvjax and transformers), multiple
                                                  # choice with 95% bootstrap intervals, retrieval at 1K/2K/4K
    python -m launch.toy.evaluate --limit 50      # a quick look (first 50 items of every set)
    python -m launch.toy.evaluate --target checkpoints/toy/pruned   # another target against the shipped source

Writes checkpoints/toy/metrics.json (with --target T: checkpoints/toy/metrics_<basename of T>.json); prints a markdown
summary for checkpoints/toy/README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import jax
import numpy as np

import kvjax
from kvjax.eval import (bootstrap_ci, heldout_loss, load_mc, load_retrieval, paired_bootstrap_ci, score_mc,
                        score_retrieval)

log = logging.getLogger("launch.toy.evaluate")
ROLES = ("target", "source")


def torch_heldout_loss(path: str, windows: np.ndarray, batch_size: int = 8) -> float:
    """The same metric through transformers (reference implementation)."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    losses = []
    with torch.inference_mode():
        for start in range(0, len(windows), batch_size):
            w = torch.as_tensor(windows[start : start + batch_size].astype(np.int64))
            logits = model(w[:, :-1]).logits.float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                                   reduction="none").reshape(w.shape[0], -1).mean(1)
            losses.append(ce.numpy())
    return float(np.concatenate(losses).mean())


def repeated_passage_ce(params, cfg, windows: np.ndarray, n: int = 256) -> tuple[float, float]:
    """Mean CE on a held-out passage of n tokens read once, and on the same passage read a second time right after
    it: a model with induction heads (what in-context retrieval needs) finds the repeat far easier."""
    import jax.numpy as jnp

    from kvjax.models.decoder import forward
    x = windows[:, :n].astype(np.int32)
    toks = jnp.asarray(np.concatenate([x, x], 1))
    logits = forward(params, cfg, toks[:, :-1]).logits.astype(jnp.float32)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), toks[:, 1:, None], -1)[..., 0]
    return float(nll[:, : n - 1].mean()), float(nll[:, n:].mean())


def ci_dict(ci) -> dict:
    return {"mean": ci.mean, "ci95": [ci.lo, ci.hi]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--toy-dir", default="checkpoints/toy")
    parser.add_argument("--target", default=None, help="another target checkpoint (default: TOY_DIR/target)")
    parser.add_argument("--limit", type=int, default=None, help="first N items of every set (quick look)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--no-torch", action="store_true", help="skip the transformers cross-check")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    evaldir = os.path.join(args.toy_dir, "eval")
    tokenizer = kvjax.load_tokenizer(os.path.join(args.toy_dir, "target"))
    paths = {"target": args.target or os.path.join(args.toy_dir, "target"),
             "source": os.path.join(args.toy_dir, "source")}
    models = {r: kvjax.load_hf(paths[r]) for r in ROLES}
    windows = np.load(os.path.join(evaldir, "heldout_windows.npy"))[: args.limit]
    out: dict = {"heldout_ce": {}, "repeated_passage_ce": {}, "mc": {}, "retrieval": {}}

    for role, (cfg, params) in models.items():
        ce = heldout_loss(params, cfg, windows)
        out["heldout_ce"][role] = {"kvjax": ce}
        if not args.no_torch:
            ref = torch_heldout_loss(paths[role], windows)
            out["heldout_ce"][role].update(transformers=ref, rel_diff=abs(ce - ref) / ref)
        log.info("%s held-out CE %.4f nats/token", role, ce)
        first, repeat = repeated_passage_ce(params, cfg, windows[:16])
        out["repeated_passage_ce"][role] = {"first": first, "repeat": repeat}
        log.info("%s repeated passage CE %.3f -> %.3f", role, first, repeat)
    out["heldout_ce"]["source_over_target"] = (out["heldout_ce"]["source"]["kvjax"]
                                               / out["heldout_ce"]["target"]["kvjax"])

    for name, schema in (("hellaswag", "hellaswag"), ("piqa", "piqa")):
        items = load_mc(os.path.join(evaldir, f"{name}.jsonl"), schema=schema, limit=args.limit)
        correct = {r: score_mc(items, tokenizer, p, c).correct.astype(np.float64) for r, (c, p) in models.items()}
        out["mc"][name] = {r: ci_dict(bootstrap_ci(correct[r])) for r in ROLES}
        out["mc"][name]["source_minus_target"] = ci_dict(paired_bootstrap_ci(correct["source"], correct["target"]))
        out["mc"][name]["items"] = len(items)
        log.info("%s: %s", name, out["mc"][name])

    for length in args.lengths:
        items = load_retrieval(os.path.join(evaldir, f"retrieval_{length}.jsonl"), tokenizer, limit=args.limit)
        out["retrieval"][str(length)] = {r: ci_dict(bootstrap_ci(score_retrieval(items, p, c).correct))
                                         for r, (c, p) in models.items()}
        out["retrieval"][str(length)]["items"] = len(items)
        log.info("retrieval %d: %s", length, out["retrieval"][str(length)])

    out["models"] = paths
    name = "metrics.json" if args.target is None else f"metrics_{os.path.basename(args.target.rstrip('/'))}.json"
    with open(os.path.join(args.toy_dir, name), "w") as f:
        json.dump(out, f, indent=2)
    print(summary(out))


def summary(m: dict) -> str:
    pct = lambda d: f"{100 * d['mean']:.1f}% [{100 * d['ci95'][0]:.1f}, {100 * d['ci95'][1]:.1f}]"  # noqa: E731
    ce = m["heldout_ce"]
    lines = ["| metric | target | source | source - target |", "|---|---|---|---|",
             f"| held-out CE (nats/token, kvjax) | {ce['target']['kvjax']:.4f} | {ce['source']['kvjax']:.4f} | "
             f"ratio {ce['source_over_target']:.3f} |"]
    if "transformers" in ce["target"]:
        lines.append(f"| held-out CE (transformers) | {ce['target']['transformers']:.4f} | "
                     f"{ce['source']['transformers']:.4f} | rel. diff kvjax vs transformers "
                     f"{max(ce[r]['rel_diff'] for r in ROLES):.1e} |")
    rp = m.get("repeated_passage_ce")
    if rp:
        lines.append("| 256-token passage read again: CE first -> repeat | "
                     + " | ".join(f"{rp[r]['first']:.2f} -> {rp[r]['repeat']:.2f}" for r in ROLES) + " | |")
    for name, d in m["mc"].items():
        lines.append(f"| {name} ({d['items']} items) | {pct(d['target'])} | {pct(d['source'])} | "
                     f"{pct(d['source_minus_target'])} |")
    for length, d in m["retrieval"].items():
        lines.append(f"| retrieval {length} ({d['items']} items) | {pct(d['target'])} | {pct(d['source'])} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

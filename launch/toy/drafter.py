"""Train the toy block drafter (DFlash-style) for the shipped toy source and ship it in checkpoints/toy/drafter.

    python -m launch.toy.drafter                 # ~75 min on 2 idle cores; resumable at every stage
    python -m launch.toy.drafter --smoke         # a 1-minute end-to-end run of every stage (tiny sizes)
    python -m launch.toy.drafter --init-from checkpoints/toy/drafter --seed 1 --work work/toy/drafter-1
                                                 # continue a trained drafter on fresh data (another seed)

Stages, each cached in --work (git-ignored; rerunning continues where a run stopped; the data recipe is kept in
--work/recipe.json and another recipe is refused there): the train-split corpus text (work/toy/data/train.npy when
`python -m launch.toy.data` has built it, else the manifest's stdlib train files read and tokenized here,
sha256-checked); --sequences prompts of random length in --prompt-len taken at random offsets of it; the source's own
continuations of --gen-len tokens (kvjax.generate; greedy, and sampled at --temperature for a --sampled-frac share);
the source's features at the drafter's feature layers; the draft vocabulary; training (kvjax.drafter.train, orbax
checkpoints, progress bar, metrics.jsonl, loss.png, tau.png: held-out acceptance against training tokens); export
with kvjax.drafter.io.save_drafter (manifest: the source's config fingerprint and the trained block sizes 4, 8, 16:
one drafter trained with random block truncation serves all three).
The held-out files never enter: prompts come from the train split only, so the held-out prompts it is measured on
(launch/bench/spec_cost.py, the main job's `dflash` evaluation) are unseen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time

import numpy as np

from kvjax.drafter.config import drafter_config
from kvjax.drafter.io import DrafterError, load_drafter, load_manifest, save_drafter
from kvjax.drafter.model import grow, with_vocab
from kvjax.drafter.train import (DrafterTrainConfig, draft_vocabulary, make_features, make_sequences,
                                 train_drafter)
from kvjax.hf import load_hf, load_tokenizer
from launch.toy.data import REPO, read_text, sha256, source_roots

log = logging.getLogger("launch.toy.drafter")
EOS = 0


def train_split_tokens(work: str) -> np.ndarray:
    """uint16 tokens of the corpus's train split (each file followed by EOS)."""
    built = REPO / "work/toy/data/train.npy"
    if built.is_file():
        return np.load(built, mmap_mode="r")
    cached = os.path.join(work, "train_tokens.npy")
    if os.path.isfile(cached):
        return np.load(cached, mmap_mode="r")
    manifest = json.loads((REPO / "checkpoints/toy/data/manifest.json").read_text())
    root = source_roots()["stdlib"]
    tok = load_tokenizer(str(REPO / "checkpoints/toy/tokenizer"))
    out = []
    for e in manifest["files"]:
        if e["split"] != "train" or not e["path"].startswith("stdlib/"):
            continue
        data, text = read_text(root / e["path"].split("/", 1)[1])
        if sha256(data) != e["sha256"]:
            sys.exit(f"{e['path']}: sha256 differs from checkpoints/toy/data/manifest.json; this corpus is not the "
                     "toy corpus (python -m launch.toy.data --check says more)")
        out += tok.encode(text).ids + [EOS]
    arr = np.asarray(out, np.uint16)
    np.save(cached, arr)
    return arr


def recipe_args(argv: list[str]) -> list[str]:
    """The command line less where it reads and writes (--work, --out), which do not change the drafter."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--work", "--out"):
            skip = True
        elif not arg.startswith(("--work=", "--out=")):
            out.append(arg)
    return out


def check_recipe(work: str, recipe: dict) -> None:
    """The cached data stages in `work` belong to one data recipe: refuse to mix another into them."""
    path = os.path.join(work, "recipe.json")
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if old != recipe:
            diff = ", ".join(f"{k}: {old.get(k)} -> {v}" for k, v in recipe.items() if old.get(k) != v)
            sys.exit(f"error: {work} holds data of another recipe ({diff}); pass another --work, or delete it to "
                     "rebuild")
    elif any(os.path.exists(os.path.join(work, n)) for n in ("sequences.npz", "gen", "features.npy")):
        sys.exit(f"error: {work} holds data without a recipe.json (an older run); pass another --work, or delete it")
    else:
        with open(path, "w") as f:
            json.dump(recipe, f, indent=2)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="checkpoints/toy/source", help="the verifier the drafter drafts for")
    p.add_argument("--out", default="checkpoints/toy/drafter")
    p.add_argument("--work", default="work/toy/drafter")
    p.add_argument("--sequences", type=int, default=8192)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 384))
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--sampled-frac", type=float, default=0.5,
                   help="share of the continuations sampled (at --temperature) instead of greedy, as DFlash's data")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--layers", type=int, default=2, help="drafter layers")
    p.add_argument("--block-sizes", type=int, nargs="+", default=(4, 8, 16))
    p.add_argument("--draft-vocab", type=int, default=2048, help="draft vocabulary size (0: the whole vocabulary)")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0,
                   help="draws the prompts, the sampled continuations and the training batches")
    p.add_argument("--init-from", metavar="DRAFTER",
                   help="continue from this trained drafter (its config and draft vocabulary; a fresh schedule); "
                        "with more --layers than it has, it is grown first (new layers on top, starting as the "
                        "identity: kvjax.drafter.model.grow)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the exported weights' dtype (bfloat16: half the size; they load back as float32)")
    p.add_argument("--stop-at", type=int, help="stop (checkpointed) after this step; rerun to continue")
    p.add_argument("--data-only", action="store_true", help="build the cached data stages and stop")
    p.add_argument("--smoke", action="store_true", help="tiny sizes in --work/smoke, nothing exported")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every checkpoint step at INFO
    work = os.path.join(a.work, "smoke") if a.smoke else a.work
    if a.smoke:
        a.sequences, a.steps, a.gen_len, a.prompt_len = 96, 20, 32, (16, 64)
    if not 0.0 <= a.sampled_frac <= 1.0 or a.temperature <= 0:
        p.error("--sampled-frac must lie in [0, 1] and --temperature be > 0")
    t0 = time.time()
    model = load_hf(a.source)
    cfg = model.cfg
    dcfg = drafter_config(cfg, num_layers=a.layers, block_sizes=tuple(a.block_sizes))
    init = init_notes = None
    if a.init_from:
        try:
            init_cfg, init = load_drafter(a.init_from, cfg)
            init_notes = load_manifest(a.init_from).get("notes", {})
        except DrafterError as e:
            sys.exit(f"error: --init-from: {e}")
        grown = dataclasses.replace(init_cfg, layer=dcfg.layer)
        if grown != dcfg or init_cfg.num_layers > dcfg.num_layers:
            sys.exit(f"error: --init-from {a.init_from} has {init_cfg.num_layers} layers and block sizes "
                     f"{list(init_cfg.block_sizes)}; pass --layers of at least {init_cfg.num_layers} and the same "
                     "--block-sizes")
        if init_cfg.num_layers < dcfg.num_layers:
            init = grow(init, dcfg, model.params)
            log.info("grew %s from %d to %d layers (the new ones start as the identity)", a.init_from,
                     init_cfg.num_layers, dcfg.num_layers)
    os.makedirs(work, exist_ok=True)
    check_recipe(work, {"sequences": a.sequences, "prompt_len": list(a.prompt_len), "gen_len": a.gen_len,
                        "sampled_frac": a.sampled_frac, "temperature": a.temperature if a.sampled_frac else None,
                        "source": os.path.abspath(a.source), "seed": a.seed,
                        "init_from": os.path.abspath(a.init_from) if a.init_from else None})
    tc = DrafterTrainConfig(steps=a.steps, batch_size=a.batch, lr=a.lr, save_every=10 if a.smoke else 100,
                            eval_every=10 if a.smoke else 50, eval_seqs=16 if a.smoke else 64, seed=a.seed)

    corpus = train_split_tokens(a.work)
    rng = np.random.default_rng(a.seed)
    lo, hi = a.prompt_len
    plen = rng.integers(lo, hi + 1, a.sequences).astype(np.int32)
    starts = rng.integers(0, len(corpus) - hi, a.sequences)
    prompts = np.stack([np.asarray(corpus[s: s + hi], np.int32) for s in starts])
    log.info("corpus %d train tokens; %d prompts of %d-%d tokens (%.0fs)", len(corpus), a.sequences, lo, hi,
             time.time() - t0)
    data = make_sequences(model, prompts, plen, a.gen_len, 64, work, EOS, sampled_frac=a.sampled_frac,
                          temperature=a.temperature, seed=a.seed)
    feats = make_features(model, data["tokens"], dcfg.feature_layers, 16, work)
    if init is not None:  # a continued drafter keeps its vocabulary: its head was trained on those tokens
        vocab = None if init.vocab_ids is None else np.asarray(init.vocab_ids)
    else:
        vocab = draft_vocabulary(data["tokens"], data["prompt_len"], data["valid_len"], a.draft_vocab, cfg.vocab_size)
    if vocab is not None:
        gen = np.concatenate([r[p:v] for r, p, v in zip(data["tokens"], data["prompt_len"], data["valid_len"])])
        log.info("draft vocabulary: %d tokens cover %.2f%% of the continuations", len(vocab),
                 100 * np.isin(gen, vocab).mean())
    log.info("data ready (%.0fs)", time.time() - t0)
    if a.data_only:
        return
    params = train_drafter(model, dcfg, tc, data, feats, vocab, work, stop_at=a.stop_at, init=init)
    if a.smoke or (a.stop_at and a.stop_at < a.steps):
        log.info("done (%.0fs); nothing exported", time.time() - t0)
        return
    with open(os.path.join(work, "train", "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    notes = {"trained_by": "python -m launch.toy.drafter " + " ".join(recipe_args(argv if argv is not None
                                                                               else sys.argv[1:])),
             "sequences": a.sequences, "prompt_len": list(a.prompt_len), "gen_len": a.gen_len,
             "sampled_frac": a.sampled_frac, "temperature": a.temperature if a.sampled_frac else None,
             "steps": a.steps, "seed": a.seed, "layers": a.layers, "dtype": a.dtype, "final": last}
    if init_notes is not None:
        notes["continues"] = init_notes  # the recipe chain: what this run started from
    save_drafter(a.out, dcfg, with_vocab(params, vocab), notes=notes,
                 dtype=None if a.dtype == "float32" else a.dtype)
    for chart in ("loss.png", "tau.png"):
        shutil.copyfile(os.path.join(work, "train", chart), os.path.join(a.out, chart))
    log.info("exported to %s (%.1f MB) in %.0fs", a.out,
             os.path.getsize(os.path.join(a.out, "drafter.safetensors")) / 1e6, time.time() - t0)


if __name__ == "__main__":
    main()

"""Build the pruned target: the shipped source's layers `pruned.layers` (launch/toy/config.py), fine-tuned on text.

    python -m launch.toy.data      # once: the tokenized corpus (work/toy/data)
    python -m launch.toy.pruned    # ~5 min on 2 cores: checkpoints/toy/pruned, an HF checkpoint (bf16 weights)
    python -m kvjax.launch --config=toy_pruned    # the main job on the shipped source and this target

Why: the pair's target (2 x 64, trained from scratch) cannot read text, so no cache, mapped or its own, changes its
answers much. This target keeps the source's attention readers but not the layers that build their inputs: it
cannot read by itself, yet reads a cache in the source's coordinates — the regime the map is for (docs/method.md).
Resumable (orbax checkpoints every `save_every` steps); a rerun of a finished build only re-exports. Trained in
float32, exported in `export_dtype` (bfloat16 halves the shipped size; kvjax.load_hf computes in float32).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys

from launch.toy.config import get_config
from kvjax.hf import load_hf, save_hf
from kvjax.models.family import DecoderConfig
from kvjax.models.params import Params
from kvjax.pretrain import train
from launch.toy.data import sha256
from launch.toy.train import load_tokens

log = logging.getLogger("launch.toy.pruned")


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return sha256(f.read())


def prune_layers(cfg: DecoderConfig, params: Params, layers) -> tuple[DecoderConfig, Params]:
    """The model made of `layers` (indices into cfg's layers, in the order given) with the same embedding, final norm
    and head."""
    layers = tuple(int(i) for i in layers)
    if not layers or any(not 0 <= i < cfg.num_layers for i in layers):
        raise ValueError(f"layers {layers}: need at least one index in [0, {cfg.num_layers})")
    return (dataclasses.replace(cfg, num_layers=len(layers)),
            Params(params.embed, tuple(params.layers[i] for i in layers), params.final_norm, params.lm_head))


def check_identity(work_dir: str, identity: dict) -> None:
    """A checkpoint in work_dir must come from the same source weights and layers, else resuming would continue
    another build."""
    path = os.path.join(work_dir, "pruned_identity.json")
    if os.path.isfile(path):
        with open(path) as f:
            stored = json.load(f)
        if stored != identity:
            sys.exit(f"{work_dir} holds a pruned target of another source or layer choice "
                     f"({', '.join(k for k in identity if stored.get(k) != identity[k])} differ); "
                     f"delete {work_dir} to rebuild")
    elif os.path.isdir(os.path.join(work_dir, "ckpt")):
        sys.exit(f"{work_dir}/ckpt has no pruned_identity.json, so it may belong to another build; delete {work_dir}")
    os.makedirs(work_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(identity, f, indent=1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shipped", default="checkpoints/toy", help="the toy dir whose source/ is pruned")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    cfg = get_config()
    pc = cfg.pruned
    source_dir = os.path.join(args.shipped, "source")
    if not os.path.isfile(os.path.join(source_dir, "model.safetensors")):
        sys.exit(f"no source checkpoint in {source_dir}; pass --shipped DIR (a toy dir with source/)")
    train_tokens, heldout_tokens = load_tokens(cfg.data_dir)
    scfg, sparams = load_hf(source_dir)
    tcfg, init = prune_layers(scfg, sparams, pc.layers)
    train_settings = json.loads(json.dumps(dataclasses.asdict(pc.train)))  # as it reads back (tuples -> lists)
    check_identity(pc.work_dir, {"source_sha256": file_sha256(os.path.join(source_dir, "model.safetensors")),
                                 "layers": list(pc.layers), "train": train_settings})
    log.info("pruned target: source layers %s, %.2fM params (source %.2fM), %d steps", pc.layers,
             tcfg.num_params() / 1e6, scfg.num_params() / 1e6, pc.train.steps)
    params = train(tcfg, pc.train, train_tokens, heldout_tokens, pc.work_dir, name="pruned target", init=init)

    out = pc.out_dir.rstrip("/")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(tmp, tcfg, params, tokenizer_dir=cfg.tokenizer_dir, dtype=pc.export_dtype)
    load_hf(tmp)  # the exported directory must load back before it replaces the old one
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    log.info("pruned target exported to %s (%s weights)", out, pc.export_dtype)


if __name__ == "__main__":
    main()

"""Build the toy MoE sibling: the shipped source upcycled into a Qwen3-MoE (settings: launch/toy/config.py `moe`).

    python -m launch.toy.data      # once: the tokenized corpus (work/toy/data)
    python -m launch.toy.moe       # checkpoints/toy/moe (HF Qwen3MoeForCausalLM, bf16 weights), loss_moe.png
    python -m launch.toy.evaluate --target checkpoints/toy/moe --lengths 1024   # metrics_moe.json
    python -m kvjax.launch --config=fit --config.source.path=checkpoints/toy/moe \\
        --config.target.path=checkpoints/toy/source --config.data.train_text=work/toy/data/train.npy

Upcycling: every layer's SwiGLU neurons (the source's ffn) are split into `num_experts` equal groups by balanced
spherical k-means on their gate vectors (neurons that fire on the same inputs share an expert), each group becomes an
expert (its down projection x top_k), and the router starts at the groups' mean gate vector (an expert's score is
its neurons' mean pre-activation). Attention, norms and the embedding are the source's. Only `top_k` experts run per token, so the
upcycled model starts well below the source and training on text (the source's data pipeline, with copy
augmentation) recovers it and lets the experts and the attention drift: a sibling, not a copy.

Resumable (orbax checkpoints every `save_every` steps, identity-checked against the source weights and settings); a
rerun of a finished build only re-exports. Trained in float32, exported in `export_dtype`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.hf import load_hf, save_hf
from kvjax.models.config import Qwen3Config
from kvjax.models.params import Params
from kvjax.models.qwen3_moe import Qwen3MoeConfig, SparseLayerParams
from kvjax.pretrain import train
from launch.toy.config import get_config
from launch.toy.pruned import check_identity, file_sha256
from launch.toy.train import load_tokens

log = logging.getLogger("launch.toy.moe")


def cluster_neurons(gate: np.ndarray, groups: int, iters: int = 20, seed: int = 0) -> np.ndarray:
    """Balanced spherical k-means of the columns of gate [D, F] into `groups` groups of F / groups neurons each:
    int [groups, F / groups] neuron indices (sorted within a group)."""
    d, f = gate.shape
    if f % groups:
        raise ValueError(f"ffn width {f} does not split into {groups} equal experts")
    size = f // groups
    x = gate.T / np.maximum(np.linalg.norm(gate.T, axis=1, keepdims=True), 1e-12)  # [F, D] unit vectors
    rng = np.random.default_rng(seed)
    centroids = x[rng.choice(f, groups, replace=False)]
    for _ in range(iters):
        sim = x @ centroids.T  # [F, groups]
        # balanced assignment: the most similar (neuron, group) pairs first, each group capped at `size`
        order = np.argsort(-sim, axis=None)
        assign = np.full(f, -1)
        count = np.zeros(groups, int)
        for flat in order:
            n, g = divmod(int(flat), groups)
            if assign[n] < 0 and count[g] < size:
                assign[n], count[g] = g, count[g] + 1
        new = np.stack([x[assign == g].mean(0) for g in range(groups)])
        centroids = new / np.maximum(np.linalg.norm(new, axis=1, keepdims=True), 1e-12)
    return np.stack([np.flatnonzero(assign == g) for g in range(groups)])


def upcycle(cfg: Qwen3Config, params: Params, num_experts: int, top_k: int,
            norm_topk_prob: bool) -> tuple[Qwen3MoeConfig, Params]:
    """A Qwen3-MoE with every layer sparse, whose experts are the source's MLP neurons grouped (cluster_neurons) and
    whose attention, norms and embedding are the source's."""
    mcfg = Qwen3MoeConfig(**dataclasses.asdict(cfg), num_experts=num_experts, num_experts_per_tok=top_k,
                          moe_intermediate_size=cfg.intermediate_size // num_experts, norm_topk_prob=norm_topk_prob)
    layers = []
    for lp in params.layers:
        gate, up, down = (np.asarray(a, np.float32) for a in (lp.gate, lp.up, lp.down))
        groups = cluster_neurons(gate, num_experts)  # [E, F/E]
        layers.append(SparseLayerParams(
            attn_norm=lp.attn_norm, q=lp.q, k=lp.k, v=lp.v, q_norm=lp.q_norm, k_norm=lp.k_norm, o=lp.o,
            mlp_norm=lp.mlp_norm,
            router=np.stack([gate[:, g].mean(1) for g in groups], axis=1),  # [D, E]: mean pre-activation
            gate=np.stack([gate[:, g] for g in groups]), up=np.stack([up[:, g] for g in groups]),
            # x top_k: normalised routing weights sum to one, so at equal weights the chosen experts' outputs add up
            # as the dense MLP adds all its neurons'
            down=np.stack([down[g] for g in groups]) * top_k))
    return mcfg, jax.tree.map(jnp.asarray, Params(params.embed, tuple(layers), params.final_norm, params.lm_head))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shipped", default="checkpoints/toy", help="the toy dir whose source/ is upcycled")
    parser.add_argument("--stop-at", type=int, default=None, help="stop after this step (resume later)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    cfg = get_config()
    mc = cfg.moe
    source_dir = os.path.join(args.shipped, "source")
    if not os.path.isfile(os.path.join(source_dir, "model.safetensors")):
        sys.exit(f"no source checkpoint in {source_dir}; pass --shipped DIR (a toy dir with source/)")
    train_tokens, heldout_tokens = load_tokens(cfg.data_dir)
    scfg, sparams = load_hf(source_dir)
    mcfg, init = upcycle(scfg, sparams, mc.num_experts, mc.top_k, mc.norm_topk_prob)
    settings = json.loads(json.dumps({k: v for k, v in dataclasses.asdict(mc).items() if k != "out_dir"}))
    check_identity(mc.work_dir, {"source_sha256": file_sha256(os.path.join(source_dir, "model.safetensors")),
                                 "moe": settings})
    log.info("MoE sibling: %d experts x %d (top %d), %.2fM params (%.2fM active; source %.2fM), %d steps",
             mcfg.num_experts, mcfg.moe_intermediate_size, mcfg.num_experts_per_tok, mcfg.num_params() / 1e6,
             mcfg.active_params() / 1e6, scfg.num_params() / 1e6, mc.train.steps)
    params = train(dataclasses.replace(mcfg, moe_dispatch=mc.train_dispatch), mc.train, train_tokens, heldout_tokens, mc.work_dir, name="moe sibling", init=init,
                   stop_at=args.stop_at)
    if args.stop_at is not None and args.stop_at < mc.train.steps:
        log.info("stopped at step %d; rerun to resume", args.stop_at)
        return

    out = mc.out_dir.rstrip("/")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_hf(tmp, mcfg, params, tokenizer_dir=cfg.tokenizer_dir, dtype=mc.export_dtype)
    load_hf(tmp)  # the exported directory must load back before it replaces the old one
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    shutil.copyfile(os.path.join(mc.work_dir, "loss.png"), os.path.join(os.path.dirname(out), "loss_moe.png"))
    log.info("MoE sibling exported to %s (%s weights), loss curve %s/loss_moe.png", out, mc.export_dtype,
             os.path.dirname(out))


if __name__ == "__main__":
    main()

"""Qwen3-30B-A3B reads, its dense sibling Qwen3-32B answers: local HF checkpoint directories, sharded over every
device present (the method's MoE sibling transfer).

    KVJAX_SOURCE=/ckpt/Qwen3-30B-A3B KVJAX_TARGET=/ckpt/Qwen3-32B python -m kvjax.launch --config=qwen30a3_sibling
    python -m kvjax.launch --config=qwen30a3_sibling --config.source.path=/ckpt/Qwen3-30B-A3B \\
        --config.target.path=/ckpt/Qwen3-32B

Direction: the mixture-of-experts model is the source and the dense sibling the target, as in the method's claim ("A
rollout residual cut 30B sibling-transfer divergence by 6.5%": the MoE's cache transferred into a dense Qwen3). It is
also the direction that saves compute: 30B-A3B prefills with ~3.3B active parameters per token, a tenth of Qwen3-32B's,
so the 32B answers from a cache that cost the MoE's prefill. Qwen3-32B is the default sibling because it is the dense
Qwen3 of the MoE's total size; any dense Qwen3 (same tokenizer) can stand in through KVJAX_TARGET.

Layer pairing: "depth" (each of the target's 64 layers takes the one MoE layer of the nearest relative depth among
its 48; kvjax.mapper.pairing.depth_pairing). The method reports that a matching-layer ridge map gave the lowest mean
divergence on this pair; siblings trained the same way place the same processing at the same relative depth, and one
source layer per target layer keeps the map's inputs at 4 KV heads x 128 = 512 features (30B-A3B has 4 KV heads,
32B has 8), so a ridge per target layer fits from a few hundred windows. `--config.map.pairing=top2` lets
calibration choose instead.

The cache and the map are those of dense models (the MoE's attention is dense); only the MoE's MLPs differ, and they
run routed at decode (kvjax.models.qwen3_moe). Data as configs/qwen32_8.py: FineWeb-Edu (sample-10BT)
streamed from the hub for calibration, training and held-out windows, MC sets from the hub; without network, local
copies (docs/real_pairs.md).
"""

import dataclasses

from configs import qwen32_8


def get_config():
    cfg = qwen32_8.get_config()
    return dataclasses.replace(
        cfg,
        name="qwen30a3_sibling",
        source=dataclasses.replace(cfg.source, name="Qwen3-30B-A3B", shapes="configs/models/Qwen3-30B-A3B"),
        target=dataclasses.replace(cfg.target, name="Qwen3-32B", shapes="configs/models/Qwen3-32B"),
        output_dir="runs/qwen30a3_sibling",
        map=dataclasses.replace(cfg.map, pairing="depth"),
    )

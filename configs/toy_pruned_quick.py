"""The default run: the shipped source and the pruned target (checkpoints/toy/pruned), sized to show the cache map
working in under 10 minutes on 2 CPU cores.

    python -m kvjax.launch                        # = --config=toy_pruned_quick, writes runs/toy_pruned_quick/
    python -m kvjax.launch --config=toy_pruned    # the same pair at full size (MC 1000 items, 3000 steps; ~50 min)
    python -m kvjax.launch --config=toy           # the from-scratch 2-layer target, which reads nothing (gate FAIL)

The pruned target keeps three of the source's layers (0, 3, 5) and was fine-tuned on text (`python -m
launch.toy.pruned`): it cannot read its context by itself, yet reads a cache in the source's coordinates, so a map
moves its answers — the regime the method is for (docs/method.md). The gate states the method's goals:
the ridge's key / value cosines to the native cache, the residual below the ridge in source-teacher KL, and on every
multiple-choice set the mapped target ahead of the native one (paired 95% interval above zero) by >= 60% of the
target-to-source gap, and the mapped target retrieving >= 50% of 1K-token needles (the source retrieves 97.5%, the
native target nothing).

Retrieval through the map (docs/method.md, "Retrieval through the mapped cache"): a residual trained only on 256
+ 64-token windows retrieves nothing at 1K (0/200), since those windows never hold a copy from far back and the pruned
target lost the source layer whose previous-token information its reader layer needs. So every residual step also reads
`residual.copy_batch` = 4 fact-copy windows (kvjax.fitting.copy_windows): 1,024 tokens of training text with a 16-token
"key = digits" fact written 64-960 tokens back, then repeated, scored by KL to the source on the repeat, beside 8
ordinary windows from the pool. `residual.copy_weight` (the copies' share of the loss) trades retrieval against the
ordinary KL; measured on this pair (2026-12-01: retrieval on the shipped 1K set, 200 items; MC 300 items per
set and KL 64 windows, paired by item against the 400-step residual without copies, HellaSwag 50.3 / PIQA 76.3 / KL
0.6903):

    copy_weight   retrieval   HellaSwag / PIQA vs no copies           KL vs no copies
    0.5           67.0%       -1.7 [-4.3, +0.7] / -0.7 [-3.3, +2.0]   +0.052 [+0.035, +0.069]
    0.3           68.0%       +0.0 [-2.0, +2.0] / +0.3 [-2.0, +2.7]   +0.021 [+0.009, +0.032]
    0.15          64.5%       +0.7 [-1.7, +3.0] / +0.0 [-2.3, +2.3]   +0.004 [-0.007, +0.015]   <- this config

(a rerun of the 0.15 row: 66.5%, HellaSwag / PIQA 52.0 / 77.0%). The copies double the residual stage (800 steps,
the copy windows' source pass ~50 s: 314 vs 164 CPU s). `--config.residual.copy_windows=0 --config.residual.steps=400
--config.gate.min_retrieval=none` is the default as it was before 2026-12-01 (no retrieval through the map).

Where the minutes go and why these sizes (the full-size config spends 35 of its 50 minutes training the residual):
  - residual: 800 steps with the copy windows above (without them the full run's KL curve flattens after ~400-600
    of its 3000 steps; 400 were enough) from a pool of 1536 windows
    (kvjax.fitting.teacher_pool): the frozen source runs once per window (one pass gives the prefix cache and the
    teacher's outputs) instead of twice per window per step, and a step runs only the map and the target (2.9x
    cheaper than a streaming step, measured interleaved on the loaded dev machine). Each window is seen ~4 times:
    a pool of 256 windows seen 16 times overfits (training KL 0.48; held-out KL cut 8.5% after 500 steps,
    where 600 streaming steps cut 17.5%).
  - calibration: 128 x 512 tokens, lambda on 16 x 512, top-3 pairing by held-out R^2 (the full run's 256 / 32).
  - evaluations: 64 KL windows; 300 items per multiple-choice set (paired intervals about +-4 points; the mapped
    target gains ~15); the per-head ridge peer as an arm; retrieval at 1K only, 100 items; throughput at 256 / 1K / 4K.
"""

import dataclasses

from configs import toy_pruned
from kvjax.eval.gate import GateConfig
from kvjax.run.config import PeerConfig


def get_config():
    base = toy_pruned.get_config()
    ev = base.eval
    return dataclasses.replace(
        base,
        name="toy_pruned_quick",
        output_dir="runs/toy_pruned_quick",
        map=dataclasses.replace(base.map, calib_windows=128, select_windows=16),
        data=dataclasses.replace(base.data, max_train_tokens=1_000_000),
        residual=dataclasses.replace(base.residual, steps=800, lr=3e-3, warmup_steps=20, pool_windows=1536,
                                     save_every=100, copy_windows=256, copy_len=1024, copy_span=16, copy_batch=4,
                                     copy_weight=0.15),
        peers=PeerConfig(perhead_topk=3),
        eval=dataclasses.replace(
            ev, kl=dataclasses.replace(ev.kl, windows=64),
            mc=dataclasses.replace(ev.mc, limit=300, arms=("target", "source", "perhead", "ridge", "residual")),
            retrieval=dataclasses.replace(ev.retrieval, lengths=(1024,), limit=100,
                                          arms=("target", "source", "ridge", "residual")),
            throughput=dataclasses.replace(ev.throughput, lengths=(256, 1024, 4096), repeats=2)),
        gate=GateConfig(min_key_cos=0.9, min_value_cos=0.6, min_attn_cos=0.9, max_kl_vs_target=1.0,
                        min_kl_reduction=0.1, min_mc_retention=1.0, min_mc_gap_recovered=0.6, min_mc_gain_ci_lo=0.0,
                        cos_arm="ridge", min_retrieval=0.5),
    )

"""The default run: the shipped toy pair (checkpoints/toy) on CPU, sized to finish in minutes on 2 cores.

    python -m kvjax.launch                      # = --config=toy, writes runs/toy/
    python -m kvjax.launch --config.eval.mc.limit=500 --config.output_dir=runs/toy_500

Calibration text: the train split of the toy corpus as it exists on this machine (the .py files of the local
Python standard library that checkpoints/toy/data/manifest.json marks "train"), so no data step is needed and the
held-out eval sets (built from held-out files only) never overlap it.

Sizes (why): the whole run must fit in 10 minutes on 2 CPU cores, and XLA compilation is a large share of that.
128 x 512 calibration tokens and 16 x 512 for lambda fit the ridge in seconds; 100 residual steps of 8 x (256 + 64)
tokens take about a minute; evaluation uses 16 distance windows, 64 KL windows, 200 items of each multiple-choice
set (95% intervals about +-6 points, paired differences narrower), 10 retrieval items per length at 1K/2K/4K (a
smoke signal: the source retrieves nearly all 1K needles, 97.5% of the full 200; nothing past its 1K training
length; the 2-layer target none), and throughput at 256..4K with 64 new tokens and 3 timed
rounds after a compile round (9 decode runs per round: a toy decode takes milliseconds).
"""

from kvjax.fitting.residual_config import ResidualConfig
from kvjax.run.config import (DataConfig, EvalConfig, KLEval, MapConfig, MCEval, ModelConfig, RetrievalEval, RunConfig,
                              ThroughputEval)
from kvjax.eval.gate import GateConfig

TOY = "checkpoints/toy"


def get_config() -> RunConfig:
    return RunConfig(
        name="toy",
        source=ModelConfig(path=f"{TOY}/source", name="toy source"),
        target=ModelConfig(path=f"{TOY}/target", name="toy target"),
        output_dir="runs/toy",
        data=DataConfig(train_text=("stdlib:train",), heldout_windows=f"{TOY}/eval/heldout_windows.npy",
                        manifest=f"{TOY}/data/manifest.json", max_train_tokens=1_000_000),
        map=MapConfig(calib_windows=128, select_windows=16, window_len=512, pairing="depth", residual_rank=16),
        residual=ResidualConfig(steps=100, batch_size=8, prefix_len=256, cont_len=64, lr=3e-3, warmup_steps=10,
                                save_every=50),
        eval=EvalConfig(
            kl=KLEval(windows=64, prefix_len=256, cont_len=64),
            mc=MCEval(hellaswag=f"{TOY}/eval/hellaswag.jsonl", piqa=f"{TOY}/eval/piqa.jsonl", limit=200),
            retrieval=RetrievalEval(lengths=(1024, 2048, 4096), files=f"{TOY}/eval/retrieval_{{length}}.jsonl",
                                    limit=10),
            throughput=ThroughputEval(lengths=(256, 512, 1024, 2048, 4096), new_tokens=64, repeats=3,
                                      decode_repeats=9),
        ),
        gate=GateConfig(min_key_cos=0.8, min_value_cos=0.5, max_kl_vs_target=1.0, min_kl_reduction=0.0,
                        min_mc_retention=0.95),
    )

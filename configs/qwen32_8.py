"""Qwen3-32B reads, Qwen3-8B answers: local HF checkpoint directories, sharded over every device present.

    KVJAX_SOURCE=/ckpt/Qwen3-32B KVJAX_TARGET=/ckpt/Qwen3-8B python -m kvjax.launch --config=qwen32_8
    python -m kvjax.launch --config=qwen32_8 --config.source.path=/ckpt/Qwen3-32B --config.target.path=/ckpt/Qwen3-8B

Data: calibration, residual training, held-out windows and needle haystacks come from FineWeb-Edu (sample-10BT,
FINEWEB_EDU), general prose: streamed from the Hugging Face hub, only the tokens asked for (data.max_train_tokens,
data.max_heldout_tokens), its documents split into calibration and held-out ones by a hash of their text
(kvjax.corpus), tokenized once and cached in the run directory. Without network, pass a local copy the same way
(--config.data.train_text=hf:/path/to/copy --config.data.heldout_text=hf:/path/to/copy) or, for a smoke run,
stdlib:train / stdlib:heldout; the multiple-choice sets (eval.mc.hellaswag / eval.mc.piqa) are hub names too: local
JSONL copies stand in for them. docs/real_pairs.md says what is fetched and how much.
"""

from kvjax.eval.gate import GateConfig
from kvjax.fitting.residual_config import ResidualConfig
from kvjax.run.config import (DataConfig, DistancesEval, EvalConfig, KLEval, MapConfig, MCEval, ModelConfig,
                              RetrievalEval, RunConfig, ThroughputEval)


FINEWEB_EDU = "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train"  # the real configs' text: general educational prose


def get_config() -> RunConfig:
    return RunConfig(
        name="qwen32_8",
        source=ModelConfig(env="KVJAX_SOURCE", name="Qwen3-32B", dtype="bfloat16",
                           shapes="configs/models/Qwen3-32B"),
        target=ModelConfig(env="KVJAX_TARGET", name="Qwen3-8B", dtype="bfloat16",
                           shapes="configs/models/Qwen3-8B"),
        output_dir="runs/qwen32_8",
        data=DataConfig(train_text=(FINEWEB_EDU,), heldout_text=(FINEWEB_EDU,), heldout_window_len=2049,
                        max_train_tokens=4_000_000, max_heldout_tokens=1_000_000),
        map=MapConfig(calib_windows=512, select_windows=64, window_len=1024, batch_size=4, pairing="depth",
                      residual_rank=16),
        residual=ResidualConfig(steps=500, batch_size=4, prefix_len=1024, cont_len=128, lr=1e-3, warmup_steps=50,
                                save_every=50),
        eval=EvalConfig(
            distances=DistancesEval(windows=8, window_len=1024, batch_size=2),
            kl=KLEval(windows=64, prefix_len=1024, cont_len=128, batch_size=4),
            mc=MCEval(hellaswag="Rowan/hellaswag", piqa="ybisk/piqa", limit=1000, normalize="bytes"),
            retrieval=RetrievalEval(lengths=(1024, 2048, 4096, 8192, 16384), files="", limit=50, batch_size=2),
            throughput=ThroughputEval(lengths=(1024, 2048, 4096, 8192, 16384), new_tokens=64, repeats=5),
        ),
        gate=GateConfig(min_key_cos=0.85, min_value_cos=0.4, max_kl_vs_target=1.0, min_kl_reduction=0.0,
                        min_mc_retention=0.98),
    )

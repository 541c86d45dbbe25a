"""Llama-3.1-Minitron-4B-Width reads, Llama-3.1-8B answers (small reads, large answers: the pair of the method's
"learned KV handoff" claim), from local HF checkpoint directories, sharded over every device present.

    KVJAX_SOURCE=/ckpt/Llama-3.1-Minitron-4B-Width-Base KVJAX_TARGET=/ckpt/Llama-3.1-8B \\
        python -m kvjax.launch --config=minitron4_llama8
    python -m kvjax.launch --config=minitron4_llama8 --config.source.path=/ckpt/Llama-3.1-Minitron-4B-Width-Base \\
        --config.target.path=/ckpt/Llama-3.1-8B

"source" / "target" are roles (reader / answerer), not sizes: the 4B model prefills the prompt, the map turns its
cache into the 8B model's, and the 8B model answers. Both are LlamaForCausalLM (kvjax.models.llama) with the Llama 3
tokenizer (vocab 128256; the preflight refuses a pair whose tokenizer.json fingerprints differ) and llama3-scaled
RoPE (theta 5e5, factor 8): each model's keys are un-rotated and re-rotated with its own RoPE description. Minitron-4B-
Width keeps the 8B model's 32 layers (it prunes width: hidden 3072, MLP 9216), so the default depth pairing maps
layer i to layer i.

What this run measures (docs/metrics.md), as configs/toy_reverse.py does for the toy pair: `ttft` (4B prefill + map
[+ repair] vs the 8B model's own prefill), `native_kl` (the 8B model's KL to its own native predictions from each
cache, paired against direct reuse), `speculative` (the 4B model drafting for the 8B one, plain and from the
transferred cache), `mc` (the 8B model answering from each cache vs natively), `retrieval` and `distances`. The
`kl` evaluation (the reader as teacher) and `throughput` (the forward direction's decode speed) are off; the residual
learns the 8B model's own predictions (residual.teacher="target"). The gate holds the answerer's multiple-choice
accuracy from the mapped cache to >= 95% of its native accuracy.

Data as configs/qwen32_8.py: FineWeb-Edu (sample-10BT) streamed from the hub for calibration, residual training and
the held-out windows (tokenized with the Llama 3 tokenizer the checkpoints carry); without network, a local copy
(hf:/path/to/copy) or stdlib:train / stdlib:heldout, and local JSONL copies for eval.mc.hellaswag / eval.mc.piqa
(docs/real_pairs.md).
"""

from configs.qwen32_8 import FINEWEB_EDU
from kvjax.eval.arm_settings import ArmSettings
from kvjax.eval.gate import GateConfig
from kvjax.fitting.residual_config import ResidualConfig
from kvjax.run.config import (DataConfig, DistancesEval, EvalConfig, KLEval, MapConfig, MCEval, ModelConfig,
                              NativeKLEval, RetrievalEval, RunConfig, SpeculativeEval, ThroughputEval, TTFTEval)


def get_config() -> RunConfig:
    return RunConfig(
        name="minitron4_llama8",
        source=ModelConfig(env="KVJAX_SOURCE", name="Llama-3.1-Minitron-4B-Width", dtype="bfloat16",
                           shapes="configs/models/Llama-3.1-Minitron-4B-Width-Base"),
        target=ModelConfig(env="KVJAX_TARGET", name="Llama-3.1-8B", dtype="bfloat16",
                           shapes="configs/models/Llama-3.1-8B"),
        output_dir="runs/minitron4_llama8",
        data=DataConfig(train_text=(FINEWEB_EDU,), heldout_text=(FINEWEB_EDU,), heldout_window_len=2049,
                        max_train_tokens=4_000_000, max_heldout_tokens=1_000_000),
        map=MapConfig(calib_windows=512, select_windows=64, window_len=1024, batch_size=4, pairing="depth",
                      residual_rank=16),
        residual=ResidualConfig(steps=500, batch_size=4, prefix_len=1024, cont_len=128, lr=1e-3, warmup_steps=50,
                                save_every=50, teacher="target"),
        arms=ArmSettings(partial_k=2, partial_mode="bottom"),
        eval=EvalConfig(
            distances=DistancesEval(windows=8, window_len=1024, batch_size=2),
            kl=KLEval(enabled=False),
            mc=MCEval(hellaswag="Rowan/hellaswag", piqa="ybisk/piqa", limit=1000, normalize="bytes",
                      arms=("target", "source", "direct", "ridge", "residual", "partial")),
            retrieval=RetrievalEval(lengths=(1024, 2048, 4096, 8192), files="", limit=50, batch_size=2,
                                    arms=("target", "source", "direct", "residual", "partial")),
            throughput=ThroughputEval(enabled=False),
            native_kl=NativeKLEval(enabled=True, windows=64, prefix_len=1024, cont_len=128, batch_size=4),
            ttft=TTFTEval(enabled=True, lengths=(1024, 2048, 4096, 8192), repeats=5),
            # the 4B model drafting for the 8B one: plain, and from the transferred (and repaired) cache
            speculative=SpeculativeEval(enabled=True, lengths=(4096, 8192), draft_lens=(4,), new_tokens=64, repeats=3),
        ),
        gate=GateConfig(min_key_cos=None, min_value_cos=None, max_kl_vs_target=None, min_kl_reduction=None,
                        min_mc_retention=0.95),
    )

"""Ultravox v0.5 on Llama-3.1-8B listens, Llama-3.2-1B answers from its mapped audio cache (the method's claim: "An 8B
model listened once. A 1B model answered, and got smarter doing it": 31.2% vs 17.2% for the 1B model's own audio path).

    KVJAX_SOURCE=/ckpt/Llama-3.1-8B-Instruct KVJAX_TARGET=/ckpt/Llama-3.2-1B-Instruct \\
    KVJAX_SOURCE_AUDIO=/ckpt/ultravox-v0_5-llama-3_1-8b KVJAX_TARGET_AUDIO=/ckpt/ultravox-v0_5-llama-3_2-1b \\
    KVJAX_AUDIO_TEST=/data/spoken_test KVJAX_AUDIO_MAP_TRAIN=/data/spoken_train \\
        python -m kvjax.launch --config=ultravox8_1

The language models are plain HF Llama checkpoints (the ones the Ultravox checkpoints name by text_model_id); the
audio adapters are Ultravox checkpoint directories (their audio_tower.* and multi_modal_projector.* tensors; the
1B one is the answerer's own audio path, the claim's "native 1B"). The spoken sets are directories in the layout of
launch/toy/speech.py (items.jsonl + features.npz of WhisperFeatureExtractor features with the adapters' mel bins:
128 for Ultravox v0.5's whisper-large-v3-turbo; `python -m launch.toy.speech --mel-bins 128` renders the toy's
prose that way). The job fits the text map as configs/qwen32_8.py does, then the evaluation `audio` trains the audio
map and scores the sealed set through every arm (kvjax/eval/suite/audio.py); the gate holds the method's speech claims.
Prompts: <|begin_of_text|>, the audio, a line break, then the text scored.
"""

import dataclasses
import os

from configs import qwen32_8
from kvjax.eval.gate import GateConfig
from kvjax.run.config import ModelConfig

ENV = {"source_adapter": "KVJAX_SOURCE_AUDIO", "target_adapter": "KVJAX_TARGET_AUDIO", "test": "KVJAX_AUDIO_TEST",
       "map_train": "KVJAX_AUDIO_MAP_TRAIN"}
LLAMA3_BOS = 128000  # <|begin_of_text|>


def audio_pair(name: str, source: str, target: str, source_shapes: str, target_shapes: str):
    """A Llama pair with Ultravox adapters (settings from the environment, ENV): the text map as qwen32_8's, the
    audio evaluation on, the evaluations that need a text benchmark off. `*_shapes`: the Ultravox checkpoints'
    config.json shipped in configs/models/ (their language models' and adapters' shapes, for `python -m
    kvjax.plan`)."""
    base = qwen32_8.get_config()
    ev = base.eval
    off = {n: dataclasses.replace(getattr(ev, n), enabled=False) for n in ("distances", "mc", "retrieval", "throughput")}
    audio = dataclasses.replace(ev.audio, enabled=True, open_id=LLAMA3_BOS, batch_size=4,
                                **{field: os.environ.get(var, "") for field, var in ENV.items()})
    return dataclasses.replace(
        base, name=name, output_dir=f"runs/{name}",
        source=ModelConfig(env="KVJAX_SOURCE", name=source, dtype="bfloat16", shapes=source_shapes),
        target=ModelConfig(env="KVJAX_TARGET", name=target, dtype="bfloat16", shapes=target_shapes),
        eval=dataclasses.replace(ev, **off, audio=audio),
        gate=GateConfig(min_key_cos=None, min_value_cos=None, max_kl_vs_target=1.0, min_kl_reduction=0.0,
                        min_mc_retention=None, min_audio_gain_ci_lo=0.0, min_audio_gap_recovered=0.5,
                        min_audio_margin_kept=0.7, min_audio_decode_ratio=0.97))


def get_config():
    return audio_pair("ultravox8_1", "Llama-3.1-8B-Instruct (Ultravox v0.5)", "Llama-3.2-1B-Instruct",
                      "configs/models/ultravox-v0_5-llama-3_1-8b", "configs/models/ultravox-v0_5-llama-3_2-1b")

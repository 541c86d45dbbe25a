"""Ultravox v0.5 on Llama-3.3-70B listens, Llama-3.1-8B answers (the method's claim: "The handoff reached 81.7% accuracy
at 59.6 tokens per second, recovering 12.7 points over native 8B").

    KVJAX_SOURCE=/ckpt/Llama-3.3-70B-Instruct KVJAX_TARGET=/ckpt/Llama-3.1-8B-Instruct \\
    KVJAX_SOURCE_AUDIO=/ckpt/ultravox-v0_5-llama-3_3-70b KVJAX_TARGET_AUDIO=/ckpt/ultravox-v0_5-llama-3_1-8b \\
    KVJAX_AUDIO_TEST=/data/spoken_test KVJAX_AUDIO_MAP_TRAIN=/data/spoken_train \\
        python -m kvjax.launch --config=ultravox70_8

Everything else as configs/ultravox8_1.py (the 8B model's own Ultravox adapter is its native audio path).
"""

from configs.ultravox8_1 import audio_pair


def get_config():
    return audio_pair("ultravox70_8", "Llama-3.3-70B-Instruct (Ultravox v0.5)", "Llama-3.1-8B-Instruct",
                      "configs/models/ultravox-v0_5-llama-3_3-70b", "configs/models/ultravox-v0_5-llama-3_1-8b")

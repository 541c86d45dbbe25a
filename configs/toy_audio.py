"""Audio cache transfer on the toy pair: the 6-layer source listens, the pruned target answers from its mapped cache.

    python -m kvjax.launch --config=toy_audio     # writes runs/toy_audio/

The method's speech experiment ("An 8B model listened once. A 1B model answered, and got smarter doing it") on models
this project trained: each model has an audio adapter (a Whisper encoder + Ultravox projector trained by Ultravox's
distillation with the language model frozen; launch/toy/speech_train.py, shipped in checkpoints/toy/audio/). The job
fits the text map as the default job does (ridge + residual on text, without copy windows: retrieval is not what this
run measures), then the evaluation `audio` (kvjax/eval/suite/audio.py) takes the AUDIO map (a text map of this config
with its residual widened to 256 and trained further on the source's audio caches of 5,865 training clips, shipped in
checkpoints/toy/audio/map; docs/audio.md has the command; `--config.eval.audio.map_from=` trains one in the run instead,
on 152 shipped clips of checkpoints/toy/audio/map_train), measures it on 32 held-out clips and scores the sealed spoken
multiple-choice test through every arm: the answerer on the mapped audio cache, the same with the text map alone, direct
injection, the answerer's own audio path, the source listening, each model on the transcript, and the text map on the
source reading the transcript (`mapped_text`: how much of the source's lead any map carries on these items, none on the
toy: docs/audio.md).
The gate holds the method's speech claims: the mapped cache beats the answerer's own audio path (paired 95% interval
above zero), recovers >= 50% of the gap to the listening source, the source hears (>= 70% of its transcript margin over
chance kept) and mapped decoding runs at >= 0.97x the answerer's own speed, side by side.
"""

import dataclasses

from configs import toy_pruned_quick
from kvjax.eval.gate import GateConfig
from kvjax.run.config import PeerConfig


def get_config():
    base = toy_pruned_quick.get_config()
    ev = base.eval
    off = {name: dataclasses.replace(getattr(ev, name), enabled=False)
           for name in ("distances", "mc", "retrieval", "throughput")}
    return dataclasses.replace(
        base,
        name="toy_audio",
        output_dir="runs/toy_audio",
        residual=dataclasses.replace(base.residual, steps=400, copy_windows=0),
        peers=PeerConfig(perhead_topk=0),
        eval=dataclasses.replace(ev, **off, audio=dataclasses.replace(ev.audio, enabled=True,
                                                                     map_from="checkpoints/toy/audio/map")),
        gate=GateConfig(min_key_cos=None, min_value_cos=None, max_kl_vs_target=1.0, min_kl_reduction=0.0,
                        min_mc_retention=None, min_audio_gain_ci_lo=0.0, min_audio_gap_recovered=0.5,
                        min_audio_margin_kept=0.7, min_audio_decode_ratio=0.97),
    )

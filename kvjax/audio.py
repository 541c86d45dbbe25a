"""`kvjax.audio`: the audio front end's public names in one place (the facade of kvjax.models.whisper and
kvjax.models.audio_lm, where they are defined and documented).

  encoder = kvjax.load_audio_encoder("openai/whisper-large-v3-turbo")  # an HF Whisper directory (or hub name)
  features, frames = kvjax.audio.log_mel([waveform_16khz], encoder.cfg.num_mel_bins)  # WhisperFeatureExtractor
  states = kvjax.audio.encode(encoder, features, frames)  # [B, (T - 1) // 2 + 1, d_model]

  alm = kvjax.load_ultravox(ultravox_dir, text_path=llama_dir)  # encoder + projector + LM
  shapes = kvjax.audio.audio_configs(ultravox_dir, text_path=llama_dir)  # their configs, from config.json alone
  ids, mask = kvjax.audio.audio_prompt(tokenizer, "<|begin_of_text|>... <|audio|> ...",
                                       kvjax.audio.audio_token_count(frames, alm.stack_factor), fill_id=eos)
  logits, cache = kvjax.audio.prefill_audio(alm, ids[None], features, frames, audio_mask=mask[None])
"""

from kvjax.hf.ultravox import AudioConfigs, audio_configs, load_audio_encoder, load_ultravox
from kvjax.models.audio_lm import (AudioLM, Projector, ProjectorConfig, ProjectorParams, audio_chunks, audio_prompt,
                                   audio_token_count, expand_audio, init_projector, log_mel, merge_audio, prefill_audio,
                                   project_forward, prompt_embeddings, stack_frames)
from kvjax.models.whisper import (AudioEncoder, WhisperEncoderConfig, encode, encode_forward, encoded_length,
                                  init_encoder)

__all__ = ["AudioConfigs", "AudioEncoder", "AudioLM", "Projector", "ProjectorConfig", "ProjectorParams",
           "WhisperEncoderConfig", "audio_chunks", "audio_configs", "audio_prompt", "audio_token_count", "encode",
           "encode_forward", "encoded_length", "expand_audio", "init_encoder", "init_projector", "load_audio_encoder",
           "load_ultravox", "log_mel", "merge_audio", "prefill_audio", "project_forward", "prompt_embeddings",
           "stack_frames"]

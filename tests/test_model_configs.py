"""The public config.json files in configs/models/ (the real models the shipped run configs name) read as kvjax
configs, describe the shapes their model cards publish, and build abstract parameters of the published size: shapes
only, no weights, no device work (jax.ShapeDtypeStruct leaves), a few seconds in all."""

from __future__ import annotations

import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import pytest

import kvjax
from kvjax.hf import tokenizer_mismatch
from kvjax.hf.ultravox import audio_configs
from kvjax.models.audio_lm import projector_specs
from kvjax.models.config import Qwen3Config
from kvjax.models.llama import LlamaConfig
from kvjax.models.params import abstract_params
from kvjax.models.qwen3_moe import Qwen3MoeConfig
from kvjax.models.whisper import WhisperEncoderConfig

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")

# directory -> (config type, layers, hidden, KV heads, head dim, vocab, parameters its model card publishes)
DECODERS = {
    "Qwen3-32B": (Qwen3Config, 64, 5120, 8, 128, 151936, 32.8e9),
    "Qwen3-8B": (Qwen3Config, 36, 4096, 8, 128, 151936, 8.2e9),
    "Qwen3-30B-A3B": (Qwen3MoeConfig, 48, 2048, 4, 128, 151936, 30.5e9),
    "Llama-3.1-Minitron-4B-Width-Base": (LlamaConfig, 32, 3072, 8, 128, 128256, 4.51e9),
    "Llama-3.1-8B": (LlamaConfig, 32, 4096, 8, 128, 128256, 8.03e9),
    "Llama-3.1-8B-Instruct": (LlamaConfig, 32, 4096, 8, 128, 128256, 8.03e9),
    "Llama-3.2-1B-Instruct": (LlamaConfig, 16, 2048, 8, 64, 128256, 1.24e9),
    "Llama-3.3-70B-Instruct": (LlamaConfig, 80, 8192, 8, 128, 128256, 70.6e9),
}
# Ultravox v0.5 checkpoint -> the language model its text_model_id names (a directory here)
ULTRAVOX = {
    "ultravox-v0_5-llama-3_1-8b": "Llama-3.1-8B-Instruct",
    "ultravox-v0_5-llama-3_2-1b": "Llama-3.2-1B-Instruct",
    "ultravox-v0_5-llama-3_3-70b": "Llama-3.3-70B-Instruct",
}
WHISPER = "whisper-large-v3-turbo"
WHISPER_ENCODER_PARAMS = 0.64e9  # large-v3(-turbo)'s encoder (turbo prunes only the decoder: 32 -> 4 layers)
# (reader, answerer) pairs of the run configs in configs/ (a cache map needs the two to share a tokenizer)
PAIRS = [("Qwen3-32B", "Qwen3-8B"), ("Qwen3-30B-A3B", "Qwen3-32B"),
         ("Llama-3.1-Minitron-4B-Width-Base", "Llama-3.1-8B"), ("Llama-3.1-8B-Instruct", "Llama-3.2-1B-Instruct"),
         ("Llama-3.3-70B-Instruct", "Llama-3.1-8B-Instruct")]


def model_dir(name: str) -> str:
    return os.path.join(MODELS, name)


def test_every_file_is_checked_and_listed_in_the_readme():
    shipped = {n for n in os.listdir(MODELS) if os.path.isdir(model_dir(n))}
    assert shipped == set(DECODERS) | set(ULTRAVOX) | {WHISPER}
    readme = open(os.path.join(MODELS, "README.md")).read()
    missing = [n for n in shipped if f"({n}/config.json)" not in readme]
    assert not missing, f"configs/models/README.md has no line for {missing}"


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoder_shapes_and_parameter_count(name):
    kind, layers, hidden, kv_heads, head_dim, vocab, published = DECODERS[name]
    cfg = kvjax.load_hf_config(model_dir(name))
    assert type(cfg) is kind
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == \
        (layers, hidden, kv_heads, head_dim, vocab)
    n = cfg.num_params()
    assert abs(n - published) <= 0.01 * published, f"{name}: {n / 1e9:.3f}B, its card says {published / 1e9}B"
    params = abstract_params(cfg, jnp.bfloat16)
    leaves = jax.tree.leaves(params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) and x.dtype == jnp.bfloat16 for x in leaves)
    assert sum(x.size * x.dtype.itemsize for x in leaves) == 2 * n


def test_qwen3_moe_active_parameters():
    """Qwen3-30B-A3B's card: "30.5B in total and 3.3B activated", "29.9B non-embedding". kvjax counts 30.53B total,
    29.91B without the embedding and head, and 3.353B used per token (attention, the router, 8 of 128 experts, the
    embedding and head). The card's figures for this model are truncated to one decimal, not rounded (30.53 -> 30.5,
    29.91 -> 29.9, 3.353 -> 3.3), so its 3.3B says 3.3B <= activated < 3.4B."""
    cfg = kvjax.load_hf_config(model_dir("Qwen3-30B-A3B"))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)
    assert all(cfg.is_sparse(i) for i in range(cfg.num_layers))
    embedding = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert 29.9e9 <= cfg.num_params() - embedding < 30.0e9
    assert 3.3e9 <= cfg.active_params() < 3.4e9
    # one token's experts are 8/128 of the expert weights: total - active = the 120 unused experts of 48 layers
    assert cfg.num_params() - cfg.active_params() == 48 * 120 * 3 * cfg.hidden_size * cfg.moe_intermediate_size


@pytest.mark.parametrize("reader, answerer", PAIRS)
def test_run_config_pairs_share_a_vocabulary(reader, answerer):
    a, b = (kvjax.load_hf_config(model_dir(n)) for n in (reader, answerer))
    assert tokenizer_mismatch(model_dir(reader), model_dir(answerer), a, b) is None


def test_whisper_large_v3_turbo_encoder():
    with open(os.path.join(model_dir(WHISPER), "config.json")) as f:
        enc = WhisperEncoderConfig.from_hf_dict(json.load(f))
    assert (enc.num_mel_bins, enc.d_model, enc.num_layers, enc.num_heads, enc.ffn_dim, enc.max_source_positions) == \
        (128, 1280, 32, 20, 5120, 1500)
    assert abs(enc.num_params() - WHISPER_ENCODER_PARAMS) <= 0.01 * WHISPER_ENCODER_PARAMS


@pytest.mark.parametrize("name", sorted(ULTRAVOX))
def test_ultravox_configs_read_without_weights(name):
    lm_name = ULTRAVOX[name]
    c = audio_configs(model_dir(name))  # the language model from the directory its text_model_id names
    assert c.lm == kvjax.load_hf_config(model_dir(lm_name))
    assert c.encoder == audio_configs(model_dir(name), audio_path=model_dir(WHISPER)).encoder
    assert abs(c.encoder.num_params() - WHISPER_ENCODER_PARAMS) <= 0.01 * WHISPER_ENCODER_PARAMS
    p = c.projector
    assert (p.audio_dim, p.text_dim, p.hidden_size, p.stack_factor, p.act, p.ln_mid) == \
        (1280, c.lm.hidden_size, 4096, 8, "swiglu", True)
    assert set(projector_specs(p)) == {"ln_pre", "linear_1", "ln_mid", "linear_2"}
    assert c.audio_token_index is None  # the released configs name no placeholder id: pass audio masks


def test_ultravox_8b_checkpoint_size():
    """The hub lists fixie-ai/ultravox-v0_5-llama-3_1-8b at 0.7B parameters: its safetensors hold the encoder and the
    projector (the language model is named by text_model_id)."""
    c = audio_configs(model_dir("ultravox-v0_5-llama-3_1-8b"))
    projector = sum(math.prod(s.shape) for s in projector_specs(c.projector).values())
    assert round((c.encoder.num_params() + projector) / 1e9, 1) == 0.7


def _released(tmp_path, name, **changes):
    """A copy of the 8B Ultravox config.json in a directory `name` under tmp_path, with `changes` (None: drop)."""
    with open(os.path.join(model_dir("ultravox-v0_5-llama-3_1-8b"), "config.json")) as f:
        d = json.load(f)
    for k, v in changes.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(d))
    return out


def test_audio_configs_says_what_is_missing(tmp_path):
    alone = _released(tmp_path, "alone")  # text_model_id names a directory that is not next to it
    with pytest.raises(kvjax.CheckpointError, match="text_path"):
        audio_configs(alone)
    c = audio_configs(alone, text_path=model_dir("Llama-3.1-8B-Instruct"))
    assert c.lm.num_layers == 32
    with pytest.raises(kvjax.CheckpointError, match="vocab_size 128256 but the language model has 151936"):
        audio_configs(alone, text_path=model_dir("Qwen3-8B"))
    with pytest.raises(kvjax.CheckpointError, match="not a directory"):
        audio_configs(alone / "config.json")
    with pytest.raises(kvjax.CheckpointError, match="streaming mask"):
        audio_configs(_released(tmp_path, "streaming", audio_latency_block_size=100))

    # a config that names its encoder by id instead of inlining it: audio_path, or the directory that id names
    by_id = _released(tmp_path, "by_id", audio_config=None, audio_model_id="openai/whisper-large-v3-turbo")
    with pytest.raises(kvjax.CheckpointError, match="audio_path"):
        audio_configs(by_id, text_path=model_dir("Llama-3.1-8B-Instruct"))
    inlined = audio_configs(model_dir("ultravox-v0_5-llama-3_1-8b"))
    assert audio_configs(by_id, text_path=model_dir("Llama-3.1-8B-Instruct"),
                         audio_path=model_dir(WHISPER)) == inlined
    shutil.copytree(model_dir(WHISPER), tmp_path / WHISPER)
    shutil.copytree(model_dir("Llama-3.1-8B-Instruct"), tmp_path / "Llama-3.1-8B-Instruct")
    assert audio_configs(by_id) == inlined

    # paths given win over inlined configs (as in load_ultravox)
    with open(os.path.join(model_dir("Llama-3.2-1B-Instruct"), "config.json")) as f:
        small_lm = json.load(f)
    both = _released(tmp_path, "both", text_config=small_lm, text_model_id=None)
    assert audio_configs(both).lm.num_layers == 16
    pruned = tmp_path / "pruned-whisper"
    pruned.mkdir()
    with open(os.path.join(model_dir(WHISPER), "config.json")) as f:
        (pruned / "config.json").write_text(json.dumps({**json.load(f), "encoder_layers": 4}))
    c = audio_configs(both, text_path=model_dir("Llama-3.1-8B-Instruct"), audio_path=pruned)
    assert (c.lm.num_layers, c.encoder.num_layers, c.projector.text_dim) == (32, 4, 4096)

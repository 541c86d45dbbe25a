"""The audio front end: the Whisper encoder against transformers' WhisperEncoder (full window,
shorter inputs as Ultravox feeds them, a batch of different lengths, bfloat16), log-mel features by transformers'
WhisperFeatureExtractor, Ultravox's projector against a numpy reference written here from its formulas, Ultravox's
checkpoint layout, and the audio-language prefill against transformers' LlamaForCausalLM run on the same input
embeddings. Tiny random checkpoints written by transformers into tmp dirs."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import kvjax
from kvjax.models.audio_lm import (ProjectorConfig, ProjectorParams, audio_chunks, audio_token_count, expand_audio,
                                   log_mel, project_forward, prompt_embeddings, stack_frames)
from kvjax.models.decoder import embed, prefill_forward, prefill_jit
from kvjax.models.whisper import encode, encoded_length

MELS, WINDOW, S = 16, 48, 8  # tiny Whisper: 16 mel bins, max_source_positions 24 (a 48-frame window)
PLACEHOLDER_ID = 150


def whisper_config(**kw):
    return transformers.WhisperConfig(**{**dict(
        d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48, decoder_layers=1,
        decoder_attention_heads=4, decoder_ffn_dim=48, num_mel_bins=MELS, max_source_positions=WINDOW // 2,
        max_target_positions=16, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=3, attn_implementation="eager"), **kw})


def make_whisper(cls=transformers.WhisperModel, seed=0, **kw):
    torch.manual_seed(seed)
    model = cls(whisper_config(**kw)).eval()
    with torch.no_grad():  # transformers starts norms at one, biases at zero: make all of them matter
        for name, p in model.named_parameters():
            if "layer_norm" in name or name.endswith(".bias") or "embed_positions" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def make_llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=160, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                   max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def features(n, t=WINDOW, seed=0):
    return np.random.RandomState(seed).randn(n, MELS, t).astype(np.float32)


def whisper_reference(encoder, x, frames=None):
    """Ultravox's ModifiedWhisperEncoder.forward run on transformers' WhisperEncoder modules: the positions sliced to
    the input's length, keys past each row's encoded length masked (transformers' own forward takes only the full
    window)."""
    with torch.no_grad():
        h = torch.nn.functional.gelu(encoder.conv1(torch.tensor(x)))
        h = torch.nn.functional.gelu(encoder.conv2(h)).permute(0, 2, 1)
        h = h + encoder.embed_positions.weight[: h.shape[1]]
        mask = None
        if frames is not None:
            keep = torch.arange(h.shape[1])[None, :] < torch.tensor(encoded_length(np.asarray(frames)))[:, None]
            mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)[:, None, None, :]
        for layer in encoder.layers:
            h = layer(h, mask)
        return encoder.layer_norm(h).numpy()


@pytest.fixture(scope="module")
def whisper(tmp_path_factory):
    """(directory, transformers WhisperForConditionalGeneration) of a tiny random Whisper."""
    model = make_whisper(transformers.WhisperForConditionalGeneration)
    path = tmp_path_factory.mktemp("whisper")
    model.save_pretrained(path)
    return str(path), model


# ---- the encoder -----------------------------------------------------------------------------------------------------

def test_encoder_matches_transformers_at_the_full_window(whisper, tmp_path):
    path, model = whisper
    enc = kvjax.load_audio_encoder(path)
    x = features(2)
    with torch.no_grad():
        ref = model.model.encoder(torch.tensor(x)).last_hidden_state.numpy()
    ours = np.asarray(kvjax.audio.encode(enc, x))
    assert ours.shape == (2, WINDOW // 2, 32)
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    assert np.abs(whisper_reference(model.model.encoder, x) - ref).max() < 1e-5  # the test's reference is HF's
    # WhisperModel's layout ("encoder.*") loads the same encoder
    bare = make_whisper(transformers.WhisperModel)
    bare.save_pretrained(tmp_path)
    with torch.no_grad():
        ref = bare.encoder(torch.tensor(x)).last_hidden_state.numpy()
    assert np.abs(np.asarray(encode(kvjax.load_audio_encoder(tmp_path), x)) - ref).max() < 1e-4


def test_shorter_inputs_and_a_batch_of_different_lengths_give_each_row_what_it_gives_alone(whisper):
    path, model = whisper
    enc = kvjax.load_audio_encoder(path)
    lengths = [29, 7]  # (the full window in a batch: test_encoder_matches_transformers_at_the_full_window)
    x = features(2, seed=1)  # past its length every row holds noise, not silence: it must not matter
    batch = np.asarray(encode(enc, x, lengths))
    for row, n in enumerate(lengths):
        alone = np.asarray(encode(enc, x[row:row + 1, :, :n]))[0]
        ref = whisper_reference(model.model.encoder, x[row:row + 1, :, :n])[0]
        m = encoded_length(n)
        assert alone.shape == (m, 32)
        assert np.abs(alone - ref).max() < 1e-4, (n, np.abs(alone - ref).max())
        assert np.abs(batch[row, :m] - alone).max() < 1e-5, (n, np.abs(batch[row, :m] - alone).max())
        assert not batch[row, m:].any()


def test_bfloat16_encoder_within_the_usual_bound(whisper):
    path, model = whisper
    enc = kvjax.load_audio_encoder(path, dtype=jnp.bfloat16)
    assert enc.params.layers[0].q.dtype == jnp.bfloat16
    x = features(2, seed=2)
    with torch.no_grad():
        ref = model.model.encoder(torch.tensor(x)).last_hidden_state.numpy()
    ours = np.asarray(encode(enc, x), np.float32)
    scale = np.abs(ref).max()
    assert np.abs(ours - ref).max() <= 2e-2 * scale, np.abs(ours - ref).max() / scale
    other = whisper_reference(make_whisper(transformers.WhisperForConditionalGeneration, seed=5).model.encoder, x)
    assert np.abs(other - ref).max() > 0.1 * scale  # a real difference is far outside the bound


def test_encoder_input_errors_name_the_fix(whisper):
    enc = kvjax.load_audio_encoder(whisper[0])
    with pytest.raises(ValueError, match="num_mel_bins"):
        encode(enc, np.zeros((1, 80, 10), np.float32))
    with pytest.raises(ValueError, match="audio_chunks"):
        encode(enc, np.zeros((1, MELS, WINDOW + 1), np.float32))
    with pytest.raises(ValueError, match="frames must be"):
        encode(enc, np.zeros((2, MELS, 10), np.float32), [10, 11])
    with pytest.raises(kvjax.CheckpointError, match="Whisper"):
        kvjax.load_audio_encoder(os.path.dirname(whisper[0]))  # no config.json


def test_log_mel_by_whisper_feature_extractor_feeds_the_encoder(whisper):
    enc = kvjax.load_audio_encoder(whisper[0])
    rng = np.random.RandomState(3)
    clips = [0.1 * rng.randn(n).astype(np.float32) for n in (4000, 2400, 100)]  # 0.25 s, 0.15 s, under two hops
    x, frames = log_mel(clips, num_mel_bins=MELS)
    assert x.shape == (3, MELS, 25) and x.dtype == np.float32
    assert frames.tolist() == [25, 15, 2]  # ceil(samples / hop), a clip under two hops padded to two
    for i, clip in enumerate(clips):  # each clip extracted alone, then zero-padded: its batch changes nothing
        xi, fi = log_mel([clip], num_mel_bins=MELS)
        assert fi.tolist() == [frames[i]]
        np.testing.assert_array_equal(x[i, :, :fi[0]], xi[0])
        assert not x[i, :, fi[0]:].any()
    states = np.asarray(encode(enc, x, frames))
    assert states.shape == (3, 13, 32) and np.isfinite(states).all() and not states[2, 1:].any()
    with pytest.raises(ValueError, match="resample"):
        log_mel(clips, num_mel_bins=MELS, sampling_rate=8000)


def test_audio_token_count_is_ultravox_formula_and_the_projector_output_length():
    for f in range(1, 70):
        shape = jax.ShapeDtypeStruct((1, encoded_length(f), 2), jnp.float32)
        n = jax.eval_shape(lambda a: stack_frames(a, S), shape).shape[1]
        assert audio_token_count(f, S) == n == int(np.ceil(f / (2 * S)))
    assert audio_token_count(3000) == 188 and audio_token_count(np.array([1, 16, 17])).tolist() == [1, 1, 2]
    # audio past the window: Ultravox's chunks, each rounded up alone
    x = features(2, t=100, seed=4)
    chunks, lens, per = audio_chunks(x, [100, 30], window=WINDOW)
    assert lens.tolist() == [48, 48, 4, 30] and per.tolist() == [3, 1] and chunks.shape == (4, MELS, WINDOW)
    np.testing.assert_array_equal(chunks[2, :, :4], x[0, :, 96:100])
    assert audio_token_count(100, S, window=WINDOW) == 3 + 3 + 1 == audio_token_count(lens[:3], S).sum()


# ---- the projector ---------------------------------------------------------------------------------------------------

def projector_reference(states, w, stack, ln_mid, eps=1e-6):
    """Ultravox's UltravoxProjector from its formulas, in float64 (w: HF-layout weights by Ultravox's names):
    stack S frames side by side (zero-padded tail), RMSNorm, Linear, SwiGLU (x, gate = halves; x * silu(gate)),
    RMSNorm (ln_mid, v0.5+), Linear, RMSNorm (ln_post, v0.4.1 and earlier)."""
    t, c = states.shape
    n = -(-t // stack)
    padded = np.zeros((n * stack, c))
    padded[:t] = states
    stacked = np.stack([np.concatenate([padded[i * stack + j] for j in range(stack)]) for i in range(n)])

    def rms(v, g):
        return g * v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)

    h = rms(stacked, w["ln_pre"]) @ w["linear_1"].T
    x, gate = h[:, : h.shape[1] // 2], h[:, h.shape[1] // 2:]
    h = x * gate / (1.0 + np.exp(-gate))
    if ln_mid:
        h = rms(h, w["ln_mid"])
    y = h @ w["linear_2"].T
    return y if ln_mid else rms(y, w["ln_post"])


def random_projector(c, hidden, d, ln_mid, seed=0):
    """HF-layout weights {name: array} with Ultravox's names (multi_modal_projector.*)."""
    rng = np.random.RandomState(seed)
    w = {"ln_pre": 0.4 + 0.1 * rng.randn(c * S), "linear_1": 0.1 * rng.randn(hidden, c * S),
         "linear_2": 0.1 * rng.randn(d, hidden // 2)}
    w["ln_mid" if ln_mid else "ln_post"] = 0.4 + 0.1 * rng.randn(hidden // 2 if ln_mid else d)
    return {f"multi_modal_projector.{k}.weight": v.astype(np.float32) for k, v in w.items()}


@pytest.mark.parametrize("ln_mid", [True, False])
def test_projector_matches_ultravox_formulas(ln_mid):
    hf = random_projector(32, 64, 48, ln_mid, seed=1)
    w = {k.split(".")[1]: v.astype(np.float64) for k, v in hf.items()}
    cfg = ProjectorConfig(audio_dim=32, text_dim=48, hidden_size=64, stack_factor=S, ln_mid=ln_mid)
    params = ProjectorParams(**{k: (jnp.asarray(v.T) if k.startswith("linear") else jnp.asarray(v))
                                for k, v in w.items()})
    params = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    states = np.random.RandomState(2).randn(2, 21, 32)  # 21 frames: the last stack is 5 frames and 3 zeros
    ours = np.asarray(project_forward(params, cfg, jnp.asarray(states, jnp.float32)))
    assert ours.shape == (2, 3, 48)
    for row in range(2):
        ref = projector_reference(states[row], w, S, ln_mid)
        assert np.abs(ours[row] - ref).max() < 1e-4, np.abs(ours[row] - ref).max()


# ---- Ultravox's layout -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ultravox(tmp_path_factory):
    """A tiny random Ultravox directory assembled as Ultravox writes one (a Whisper encoder and a Llama saved by
    transformers, a random projector, Ultravox's names and config), and its parts."""
    root = tmp_path_factory.mktemp("ultravox")
    wmodel, lmodel = make_whisper(seed=1), make_llama(seed=2)
    wdir, ldir, udir = str(root / "whisper"), str(root / "llama"), str(root / "ultravox")
    wmodel.save_pretrained(wdir)
    lmodel.save_pretrained(ldir)
    proj = random_projector(32, 64, 48, ln_mid=True, seed=3)
    tensors = {"audio_tower." + k.removeprefix("encoder."): v
               for k, v in load_file(os.path.join(wdir, "model.safetensors")).items() if k.startswith("encoder.")}
    tensors.update({"language_model." + k: v for k, v in load_file(os.path.join(ldir, "model.safetensors")).items()})
    tensors.update(proj)
    os.makedirs(udir)
    save_file(tensors, os.path.join(udir, "model.safetensors"), metadata={"format": "pt"})
    config = {"model_type": "ultravox", "architectures": ["UltravoxModel"], "audio_config": wmodel.config.to_dict(),
              "text_config": lmodel.config.to_dict(), "hidden_size": 64, "stack_factor": S, "projector_act": "swiglu",
              "projector_ln_mid": True, "norm_init": 0.4, "audio_token_index": PLACEHOLDER_ID, "vocab_size": 160}
    with open(os.path.join(udir, "config.json"), "w") as f:
        json.dump(config, f)
    return dict(dir=udir, whisper_dir=wdir, llama_dir=ldir, whisper=wmodel, llama=lmodel, projector=proj,
                config=config, tensors=tensors)


def _equal_trees(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_ultravox_layout_loads_the_pieces_that_were_written(ultravox, tmp_path):
    alm = kvjax.load_ultravox(ultravox["dir"])
    assert alm.audio_token_index == PLACEHOLDER_ID and alm.stack_factor == S
    assert alm.projector.cfg == ProjectorConfig(audio_dim=32, text_dim=48, hidden_size=64, stack_factor=S,
                                                ln_mid=True)
    _equal_trees(alm.encoder.params, kvjax.load_audio_encoder(ultravox["whisper_dir"]).params)
    assert alm.lm.cfg == kvjax.load_hf_config(ultravox["llama_dir"])
    _equal_trees(alm.lm.params, kvjax.load_hf(ultravox["llama_dir"]).params)
    for name in ("ln_pre", "linear_1", "ln_mid", "linear_2"):
        written = ultravox["projector"][f"multi_modal_projector.{name}.weight"]
        np.testing.assert_array_equal(np.asarray(getattr(alm.projector.params, name)),
                                      written.T if name.startswith("linear") else written)
    assert alm.projector.params.ln_post is None
    _equal_trees(kvjax.load_audio_encoder(ultravox["dir"]).params, alm.encoder.params)  # the audio tower alone

    # the released layout: no language_model.* (text_model_id names the LM): it comes from text_path
    os.makedirs(tmp_path / "released")
    save_file({k: v for k, v in ultravox["tensors"].items() if not k.startswith("language_model.")},
              str(tmp_path / "released" / "model.safetensors"))
    released = {k: v for k, v in ultravox["config"].items() if k != "text_config"}
    with open(tmp_path / "released" / "config.json", "w") as f:
        json.dump({**released, "text_model_id": "meta-llama/Llama-3.2-1B-Instruct"}, f)
    with pytest.raises(kvjax.CheckpointError, match="text_path"):
        kvjax.load_ultravox(tmp_path / "released")
    _equal_trees(kvjax.load_ultravox(tmp_path / "released", text_path=ultravox["llama_dir"]), alm)

    # a config that does not say projector_ln_mid (Ultravox's default: false) over v0.5 weights
    with open(tmp_path / "released" / "config.json", "w") as f:
        json.dump({k: v for k, v in released.items() if k != "projector_ln_mid"}, f)
    with pytest.raises(kvjax.CheckpointError, match='"projector_ln_mid": true'):
        kvjax.load_ultravox(tmp_path / "released", text_path=ultravox["llama_dir"])
    with open(tmp_path / "released" / "config.json", "w") as f:
        json.dump({**released, "audio_latency_block_size": 100}, f)
    with pytest.raises(kvjax.CheckpointError, match="streaming mask"):
        kvjax.load_ultravox(tmp_path / "released", text_path=ultravox["llama_dir"])


# ---- the audio-language prefill --------------------------------------------------------------------------------------

def test_audio_prefill_matches_transformers_llama_on_the_same_embeddings(ultravox):
    alm = kvjax.load_ultravox(ultravox["dir"])
    frames = [40, 23, 48]  # clip 0 in row 0; clips 1 and 2 in row 1
    x = features(3, seed=5)
    counts = [int(audio_token_count(f, S)) for f in frames]
    assert counts == [3, 2, 3]
    row0, m0 = expand_audio([1, 5, 6, PLACEHOLDER_ID, 7, 8], PLACEHOLDER_ID, counts[:1])
    row1, m1 = expand_audio([1, 9, PLACEHOLDER_ID, 10, PLACEHOLDER_ID, 11, 12], PLACEHOLDER_ID, counts[1:])
    lengths = [len(row0), len(row1)]  # 8, 10
    t = max(lengths)
    tokens = np.zeros((2, t), np.int32)
    tokens[0, :lengths[0]], tokens[1, :lengths[1]] = row0, row1

    # the reference: each clip alone through transformers' encoder modules and Ultravox's projector formulas, put in
    # place of the placeholders among LlamaForCausalLM's own token embeddings, which then runs on inputs_embeds
    w = {k.split(".")[1]: v.astype(np.float64) for k, v in ultravox["projector"].items()}
    clips = [projector_reference(whisper_reference(ultravox["whisper"].encoder, x[i:i + 1, :, :f])[0], w, S, True)
             for i, f in enumerate(frames)]
    llama = ultravox["llama"]
    logits, cache = kvjax.audio.prefill_audio(alm, tokens, x, frames, lengths=lengths, capacity=16)
    assert cache.lengths.tolist() == lengths and cache.capacity == 16
    k, v = np.asarray(cache.k), np.asarray(cache.v)  # [L, B, Hkv, C, hd]
    for row, (ids, mask, mine) in enumerate(((row0, m0, clips[:1]), (row1, m1, clips[1:]))):
        with torch.no_grad():
            emb = llama.model.embed_tokens(torch.tensor(np.where(mask, 0, ids)[None], dtype=torch.long))[0]
        emb[torch.tensor(mask)] = torch.tensor(np.concatenate(mine), dtype=torch.float32)
        with torch.no_grad():
            out = llama(inputs_embeds=emb[None], use_cache=True)
        ref_logits = out.logits[0, -1].numpy()
        assert np.abs(np.asarray(logits[row]) - ref_logits).max() < 1e-4, np.abs(logits[row] - ref_logits).max()
        for layer in range(2):
            ref_k = out.cache.layers[layer].keys[0].numpy()  # [Hkv, T, hd]
            ref_v = out.cache.layers[layer].values[0].numpy()
            assert np.abs(k[layer, row, :, :len(ids)] - ref_k).max() < 1e-4
            assert np.abs(v[layer, row, :, :len(ids)] - ref_v).max() < 1e-4


def test_a_text_only_prompt_is_exactly_the_plain_prefill(ultravox):
    alm = kvjax.load_ultravox(ultravox["dir"])
    tokens = np.random.RandomState(6).randint(3, 150, (2, 9)).astype(np.int32)
    lengths = np.array([9, 6], np.int32)
    plain = prefill_jit(alm.lm.params, alm.lm.cfg, tokens, lengths, capacity=12)
    logits, cache = kvjax.audio.prefill_audio(alm, tokens, lengths=lengths, capacity=12)
    np.testing.assert_array_equal(np.asarray(prompt_embeddings(alm, tokens, None)),
                                  np.asarray(embed(alm.lm.params, tokens)))
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(plain.logits))
    _equal_trees(cache, plain.cache)
    # the decoder's embeddings hook, fed the tokens' own embeddings, is the same program's numbers
    hooked = jax.jit(prefill_forward, static_argnames=("cfg", "capacity"))(
        alm.lm.params, alm.lm.cfg, embed(alm.lm.params, tokens), lengths, capacity=12)
    np.testing.assert_array_equal(np.asarray(hooked.logits), np.asarray(plain.logits))
    _equal_trees(hooked.cache, plain.cache)


def test_audio_prompt_errors_name_the_fix(ultravox):
    alm = kvjax.load_ultravox(ultravox["dir"])
    tokens = np.array([[1, PLACEHOLDER_ID, 5]], np.int32)
    with pytest.raises(ValueError, match="expand_audio"):  # one placeholder, but the clip makes 3 audio tokens
        kvjax.audio.prefill_audio(alm, tokens, features(1), [40])
    with pytest.raises(ValueError, match="no input_features"):
        kvjax.audio.prefill_audio(alm, tokens)
    with pytest.raises(ValueError, match="2 clips"):
        expand_audio([1, PLACEHOLDER_ID, 5], PLACEHOLDER_ID, [3, 2])

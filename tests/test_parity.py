"""Parity with transformers (the ground truth) on tiny random checkpoints."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
from conftest import TINY, make_hf_model

NAMES = sorted(TINY)


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def random_tokens(vocab, shape, seed=0):
    return np.random.RandomState(seed).randint(3, vocab, shape).astype(np.int32)


@pytest.mark.parametrize("name", NAMES)
def test_prefill_and_every_decode_step_match_transformers(hf_checkpoints, name):
    path, model = hf_checkpoints[name]
    cfg, params = kvjax.load_hf(path)
    tokens = random_tokens(cfg.vocab_size, (2, 40))
    ref = torch_logits(model, tokens)  # full forward over all 40 positions

    cache = kvjax.init_cache(cfg, 2, 64)
    logits, cache = kvjax.prefill(params, cfg, tokens[:, :24], cache)
    np.testing.assert_allclose(np.asarray(logits), ref[:, :24], atol=1e-4, rtol=0)
    for t in range(24, 40):
        step, cache = kvjax.decode_step(params, cfg, tokens[:, t], cache)
        np.testing.assert_allclose(np.asarray(step), ref[:, t], atol=1e-4, rtol=0, err_msg=f"decode step {t}")
    assert np.asarray(cache.lengths).tolist() == [40, 40]


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers_generate(hf_checkpoints, name):
    path, model = hf_checkpoints[name]
    cfg, params = kvjax.load_hf(path)
    prompt = random_tokens(cfg.vocab_size, (2, 9), seed=1)
    ours = np.asarray(kvjax.generate(params, cfg, prompt, max_new_tokens=32, eos_token_ids=()))
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=32, min_new_tokens=32,
                                do_sample=False, eos_token_id=None)
    np.testing.assert_array_equal(ours, theirs[:, 9:].numpy())


def test_bfloat16_matches_transformers_bfloat16(tmp_path):
    tiny = TINY["gqa2_untied_odd"]
    model = make_hf_model(tiny, seed=3, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg, params = kvjax.load_hf(tmp_path, dtype=jnp.bfloat16)
    assert params.embed.dtype == jnp.bfloat16
    tokens = random_tokens(cfg.vocab_size, (1, 24), seed=2)
    ref = torch_logits(model, tokens)
    cache = kvjax.init_cache(cfg, 1, 32, jnp.bfloat16)
    logits, cache = kvjax.prefill(params, cfg, tokens[:, :16], cache)
    steps = [np.asarray(logits, np.float32)]
    for t in range(16, 24):
        step, cache = kvjax.decode_step(params, cfg, tokens[:, t], cache)
        steps.append(np.asarray(step, np.float32)[:, None])
    ours = np.concatenate(steps, axis=1)
    scale = np.abs(ref).max()
    # bf16 has 8 mantissa bits: two correct implementations differ by rounding order, about 1% of the logit scale.
    assert np.abs(ours - ref).max() <= 0.03 * scale
    # ...but a real bug (e.g. a missing norm) moves logits by far more than that.
    f32 = torch_logits(make_hf_model(tiny, seed=4), tokens)
    assert np.abs(f32 - ref).max() > 0.1 * scale


def test_fp32_loading_of_bf16_checkpoint_upcasts(tmp_path):
    model = make_hf_model(TINY["gqa1_tied"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg, params = kvjax.load_hf(tmp_path, dtype=jnp.float32)
    want = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(params.embed), want)

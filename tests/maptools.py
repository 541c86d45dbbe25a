"""Shared by the distributed tests: tiny source/target models and comparing two maps within stated tolerances."""

import jax
import numpy as np

import kvjax

VOCAB = 96
# The sharded / multi-process runs compute the same sums in a different order (per data-shard chunks merged in
# float64, all-reduced gradients), so they agree with one device to float32 rounding, amplified a little by the
# ridge solve and by Adam. Measured on these models: ridge <= 2.1e-6, residual <= 1.1e-5 of the largest entry.
MAP_ATOL = 5e-5  # effective ridge map (w_in @ w_out), bias, mean, scale: max error / largest entry
RESIDUAL_ATOL = 1e-4  # residual weights after 20 Adam steps at lr 1e-2


def native_cache(params, cfg, tokens, lengths=None):
    """A model's own cache of tokens [B, T] (capacity T; traceable): the prefill program without logits."""
    from kvjax.models.decoder import prefill_forward
    return prefill_forward(params, cfg, tokens, lengths, logits=None).cache


def tiny_model(layers, hidden, heads, kv_heads, head_dim, seed, theta):
    cfg = kvjax.Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
                            tie_word_embeddings=True, eos_token_ids=(), pad_token_id=0)
    return cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1)


def tiny_pair():
    """Source 3 layers x 64 (4 heads, 2 KV heads), target 2 layers x 32 (2 heads, 1 KV head), head_dim 16."""
    return tiny_model(3, 64, 4, 2, 16, seed=0, theta=1e4), tiny_model(2, 32, 2, 1, 16, seed=1, theta=5e3)


def close(got, want, atol, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-6)
    assert err <= atol, f"{what}: max difference {err:.2e} of the largest entry (tolerance {atol:.0e})"


def assert_maps_match(got, want, atol_ridge=MAP_ATOL, atol_residual=RESIDUAL_ATOL):
    assert got.spec == want.spec
    for kind in ("keys", "values"):
        for t, (g, w) in enumerate(zip(getattr(got, kind), getattr(want, kind))):
            what = f"{kind}[{t}]"
            # the reduced-rank basis is an eigenbasis (signs arbitrary): compare the map it represents
            close(np.asarray(g.w_in) @ np.asarray(g.w_out), np.asarray(w.w_in) @ np.asarray(w.w_out), atol_ridge,
                  what + " ridge weight")
            for name in ("mu", "bias", "scale"):
                close(getattr(g, name), getattr(w, name), atol_ridge, f"{what}.{name}")
            for name in ("down", "res_bias", "up"):
                close(getattr(g, name), getattr(w, name), atol_residual, f"{what}.{name}")


def assert_maps_equal(got, want):
    assert got.spec == want.spec
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

"""The cache map: pairing, ridge statistics, RoPE round trip, fit/apply, residual, artifacts, split-path generation."""

import dataclasses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.mapper.calibrate import native_cache
from kvjax.mapper.kvmap import ridge_only
from kvjax.mapper.pairing import depth_pairing, topk_pairing
from kvjax.mapper.residual import ResidualConfig, evaluate_kl
from kvjax.mapper.ridge import Stats, chunk_stats, mse, select, solve, to_stats
from kvjax.eval.distances import cache_distances
from kvjax.models.rope import apply_rope, rope_angles, rope_table, unapply_rope

VOCAB = 96


def model(layers, hidden, heads, kv_heads, head_dim, seed, theta=10_000.0):
    cfg = kvjax.Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
                            tie_word_embeddings=True, eos_token_ids=(), pad_token_id=0)
    return cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1)


@pytest.fixture(scope="module")
def pair():
    return model(3, 64, 4, 2, 16, seed=0, theta=1e4), model(2, 32, 2, 1, 16, seed=1, theta=5e3)


def windows(n, t, seed=0):
    return np.random.RandomState(seed).randint(1, VOCAB, (n, t)).astype(np.int32)


def test_depth_and_topk_pairing():
    assert depth_pairing(6, 2) == ((1,), (4,))
    assert depth_pairing(64, 36)[0] == (0,) and depth_pairing(64, 36)[-1] == (63,)
    assert depth_pairing(2, 4) == ((0,), (0,), (1,), (1,))
    r2 = np.array([[0.1, 0.9, 0.5], [0.8, 0.2, 0.7]])
    assert topk_pairing(r2, 2) == ((1, 2), (0, 2))
    with pytest.raises(ValueError, match="k must be in 1..3"):
        topk_pairing(r2, 4)


def test_inverse_rope_is_exact():
    x = jax.random.normal(jax.random.key(0), (2, 3, 50, 32))
    cos, sin = rope_angles(jnp.arange(50), 32, 1e6)
    np.testing.assert_allclose(unapply_rope(apply_rope(x, cos, sin), cos, sin), x, atol=1e-5)
    table = rope_table(50, 32, 1e6)  # the host-constant version the map's features use
    np.testing.assert_allclose(table[0], cos, atol=2e-6)
    np.testing.assert_allclose(table[1], sin, atol=2e-6)


def test_streamed_ridge_recovers_a_linear_map_and_heldout_mse_is_exact():
    rng = np.random.RandomState(0)
    w = rng.randn(6, 4)
    x = rng.randn(2000, 6) * [1, 2, 3, 0.1, 1, 1] + 5
    y = x @ w + 0.05 * rng.randn(2000, 4) + 2
    train, held = Stats.zeros(6, 4), Stats.zeros(6, 4)
    for i in range(0, 1000, 250):  # chunked accumulation equals one pass
        train += to_stats(chunk_stats(jnp.asarray(x[i:i + 250], jnp.float32), jnp.asarray(y[i:i + 250], jnp.float32),
                                      jnp.ones(250)))
    held += to_stats(chunk_stats(jnp.asarray(x[1000:], jnp.float32), jnp.asarray(y[1000:], jnp.float32), jnp.ones(1000)))
    fit, scores = select(train, held)
    np.testing.assert_allclose(fit.weight, w, atol=0.05)
    assert fit.lam <= 1e-3 and scores[1.0] > scores[fit.lam]
    pred = (x[1000:] - fit.mu) @ fit.weight + fit.bias
    np.testing.assert_allclose(mse(fit, held), np.mean(np.sum((y[1000:] - pred) ** 2, 1)), rtol=1e-3)  # f32 inputs
    low = solve(train, 1e-6, rank=2)
    assert np.linalg.matrix_rank(low.weight, tol=1e-8) == 2 and mse(low, held) > mse(fit, held)


def test_map_of_a_model_onto_itself_is_near_exact(pair):
    (cfg, params), _ = pair
    m = (cfg, params)
    kvmap, report = kvjax.fit_map(m, m, windows(16, 64), windows(8, 64, seed=1), batch_size=8)
    assert report["pairing"] == [[0], [1], [2]]
    tokens = windows(4, 64, seed=2)
    native = native_cache(params, cfg, jnp.asarray(tokens))
    mapped = kvjax.apply_map(kvmap, native)
    assert mapped.is_mapped and mapped.origin.startswith("mapped:")
    for row in cache_distances(mapped, native, cfg.rope_theta):
        assert row["key_cos"] > 0.999 and row["value_cos"] > 0.999 and row["key_nrmse"] < 0.05
    prompts = windows(2, 20, seed=3).tolist()
    split = kvjax.split_generate(m, m, kvmap, prompts, 12)
    native_out = kvjax.generate(params, cfg, prompts, 12)
    np.testing.assert_array_equal(split, native_out)


def test_fit_apply_residual_save_load_between_different_models(pair, tmp_path):
    source, target = pair
    calib, held = windows(24, 48), windows(8, 48, seed=1)
    kvmap, report = kvjax.fit_map(source, target, calib, held, batch_size=8, rank=8, residual_rank=4)
    assert [len(r["source_layers"]) for r in report["layers"]] == [1, 1]
    assert kvmap.keys[0].w_in.shape == (32, 8) and kvmap.keys[0].w_out.shape == (8, 16)
    ev = windows(8, 48, seed=5)
    before = evaluate_kl(kvmap, source, target, ev, prefix=32)
    np.testing.assert_allclose(before, evaluate_kl(ridge_only(kvmap), source, target, ev, prefix=32),
                               rtol=1e-6)  # the residual starts exactly at the ridge map
    tokens = np.random.RandomState(7).randint(1, VOCAB, 5000).astype(np.uint16)
    rc = ResidualConfig(steps=6, batch_size=4, prefix_len=32, cont_len=16, lr=1e-2, warmup_steps=1, save_every=3)
    trained, hist = kvjax.train_residual(kvmap, source, target, tokens, rc, workdir=str(tmp_path / "run"))
    assert len(hist) == 6
    np.testing.assert_array_equal(trained.keys[0].w_in, kvmap.keys[0].w_in)  # ridge frozen
    assert np.abs(np.asarray(trained.keys[0].up)).max() > 0
    after = evaluate_kl(trained, source, target, ev, prefix=32)
    assert np.abs(after - before).max() > 1e-6
    np.testing.assert_allclose(evaluate_kl(ridge_only(trained), source, target, ev, prefix=32), before, rtol=1e-6)
    by_pos = evaluate_kl(trained, source, target, ev, prefix=32, per_position=True, batch_size=3)
    assert by_pos.shape == (8, 16) and (by_pos >= 0).all() and by_pos.std() > 0
    np.testing.assert_allclose(by_pos.mean(1), after, rtol=1e-5)

    kvjax.save_map(tmp_path / "map", trained, info={"note": "test"})
    loaded = kvjax.load_map(tmp_path / "map", source[0], target[0])
    assert loaded.spec == trained.spec
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="fitted for a source model"):
        kvjax.load_map(tmp_path / "map", target[0], target[0])
    with pytest.raises(FileNotFoundError, match="not a kvjax map"):
        kvjax.load_map(tmp_path)

    out, phases = kvjax.split_generate(source, target, loaded, windows(3, 30, seed=9).tolist(), 5, timings=True)
    assert out.shape == (3, 5) and set(phases) == {"source_prefill", "map", "first_token", "decode"}
    with pytest.raises(ValueError, match="fitted for source/target models"):
        kvjax.split_generate(target, source, loaded, [[1, 2, 3]], 4)


def test_residual_training_resumes_exactly(pair, tmp_path):
    source, target = pair
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 40), windows(8, 40, seed=1), batch_size=8, residual_rank=4)
    tokens = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.uint16)
    rc = ResidualConfig(steps=4, batch_size=2, prefix_len=24, cont_len=8, lr=1e-2, warmup_steps=1, save_every=2)
    straight, _ = kvjax.train_residual(kvmap, source, target, tokens, rc, workdir=str(tmp_path / "a"))
    _, first = kvjax.train_residual(kvmap, source, target, tokens, rc, workdir=str(tmp_path / "b"), stop_at=2)
    assert [h["step"] for h in first] == [1, 2]
    resumed, hist = kvjax.train_residual(kvmap, source, target, tokens, rc, workdir=str(tmp_path / "b"))
    assert [h["step"] for h in hist] == [3, 4]  # picked up at the checkpoint
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    # a checkpoint of another run is refused, not resumed: another ridge (the models changed) or other settings
    other, _ = kvjax.fit_map(source, target, windows(16, 40, seed=5), windows(8, 40, seed=1), batch_size=8,
                             residual_rank=4)
    with pytest.raises(ValueError, match="ridge_sha256.*Delete"):
        kvjax.train_residual(other, source, target, tokens, rc, workdir=str(tmp_path / "b"))
    with pytest.raises(ValueError, match="differs in settings"):
        kvjax.train_residual(kvmap, source, target, tokens, dataclasses.replace(rc, lr=2e-2),
                             workdir=str(tmp_path / "b"))
    kvjax.train_residual(kvmap, source, target, tokens, dataclasses.replace(rc, save_every=1),
                         workdir=str(tmp_path / "b"))  # the checkpoint interval is not part of a run's identity


def test_topk_pairing_concatenates_the_best_source_layers(pair):
    source, target = pair
    kvmap, report = kvjax.fit_map(source, target, windows(8, 32), windows(8, 32, seed=1), pairing=2, batch_size=8)
    r2 = np.asarray(report["layer_r2"])
    assert r2.shape == (2, 3)
    for t, layers in enumerate(report["pairing"]):
        assert len(layers) == 2 and set(layers) == set(np.argsort(-r2[t])[:2].tolist())
    assert kvmap.keys[0].w_in.shape[0] == 2 * 2 * 16  # two source layers of 2 kv heads x 16


def test_direct_injection_baseline_copies_the_source_cache():
    from kvjax.mapper.kvmap import direct_map
    a, b = model(2, 32, 2, 1, 16, seed=0, theta=1e4), model(2, 48, 4, 1, 16, seed=1, theta=1e4)
    kvmap = direct_map(a[0], b[0], ((0,), (1,)))
    cache = native_cache(a[1], a[0], jnp.asarray(windows(2, 24)))
    mapped = kvjax.apply_map(kvmap, cache)
    np.testing.assert_allclose(mapped.k, cache.k, atol=1e-5)
    np.testing.assert_allclose(mapped.v, cache.v, atol=1e-6)
    with pytest.raises(ValueError, match="equal KV shapes"):
        direct_map(a[0], model(2, 32, 2, 2, 16, seed=0)[0], ((0,), (1,)))


def test_calibration_windows_from_tokens_and_files(tmp_path):
    from kvjax.mapper.data import tokens_from_files, windows_from_tokens
    w = windows_from_tokens(np.arange(1000), 5, 64, seed=1)
    assert w.shape == (5, 64) and (np.diff(w, axis=1) == 1).all()
    np.testing.assert_array_equal(w, windows_from_tokens(np.arange(1000), 5, 64, seed=1))
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({"a": 1, "b": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "c.jsonl").write_text('{"text": "a b a"}\n{"text": "b b"}\n')
    np.testing.assert_array_equal(tokens_from_files(str(tmp_path / "c.jsonl"), tok, eos_id=0), [1, 2, 1, 0, 2, 2, 0])
    with pytest.raises(ValueError, match="no 'body' field"):
        tokens_from_files(str(tmp_path / "c.jsonl"), tok, text_field="body")


def test_next_token_agreement(pair):
    from kvjax.eval import next_token_agreement
    (cfg, params), target = pair
    m = (cfg, params)
    self_map, _ = kvjax.fit_map(m, m, windows(16, 64), windows(8, 64, seed=1), batch_size=8)
    held = windows(6, 40, seed=4)
    same = next_token_agreement(self_map, m, m, held, prefix=24, batch_size=4)
    assert set(same) == {"with_source", "with_target", "target_with_source", "kl_mapped", "kl_native"}
    assert same["with_source"].shape == (6,)
    np.testing.assert_allclose(same["with_source"], 1.0)  # a model mapped onto itself reproduces itself
    np.testing.assert_allclose(same["kl_native"], 0.0, atol=1e-5)
    assert same["kl_mapped"].max() < 1e-2
    kvmap, _ = kvjax.fit_map(m, target, windows(16, 64), windows(8, 64, seed=1), batch_size=8)
    cross = next_token_agreement(kvmap, m, target, held, prefix=24)
    assert np.all((cross["with_target"] >= 0) & (cross["with_target"] <= 1)) and cross["kl_native"].min() > 0
    with pytest.raises(ValueError, match="prefix"):
        next_token_agreement(kvmap, m, target, held, prefix=40)

"""The residual's teacher pool, the per-head ridge peer and attention-output fidelity, on tiny models."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.eval.attention_fidelity import cache_attention, native_attention
from kvjax.eval.cache_distances import map_distances
from maptools import native_cache
from kvjax.mapper.kvmap import apply_map
from kvjax.fitting.perhead import fit_perhead
from kvjax.fitting.residual import ResidualConfig, _pooled_step_fn, make_optimizer, window_kl
from kvjax.fitting.teacher_pool import build_pool

VOCAB = 96


def model(layers, hidden, heads, kv_heads, head_dim, seed, theta=10_000.0):
    cfg = kvjax.Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=theta,
                            tie_word_embeddings=True, eos_token_ids=(), pad_token_id=0)
    return cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1)


@pytest.fixture(scope="module")
def pair():
    """Source 3 layers (2 KV heads), target 2 layers with 2 KV heads: per-head choices can differ within a layer."""
    return model(3, 64, 4, 2, 16, seed=0, theta=1e4), model(2, 32, 2, 2, 16, seed=1, theta=5e3)


def windows(n, t, seed=0):
    return np.random.RandomState(seed).randint(1, VOCAB, (n, t)).astype(np.int32)


@pytest.fixture(scope="module")
def ridge(pair):
    kvmap, _ = kvjax.fit_map(*pair, windows(16, 40), windows(8, 40, seed=1), batch_size=8, residual_rank=4)
    return kvmap


TOKENS = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.int32)
RC = ResidualConfig(steps=4, batch_size=2, prefix_len=24, cont_len=8, lr=1e-2, warmup_steps=1, save_every=2,
                    pool_windows=5)


@pytest.mark.parametrize("teacher", ["source", "target"])
def test_pooled_loss_is_the_streaming_loss_on_the_same_windows(pair, ridge, teacher):
    """The pool stores the source's prefix cache and the teacher's last hidden states; the loss recomputed from them
    is the streaming trainer's (both models run per step) on the same windows, with a trained residual too."""
    source, target = pair
    rc = dataclasses.replace(RC, teacher=teacher)
    pool = build_pool(source, target, TOKENS, 5, rc.prefix_len, rc.cont_len, rc.seed, teacher, batch_size=2)
    width = 64 if teacher == "source" else 32  # the teacher's hidden size
    assert pool.tokens.shape == (5, 32) and pool.k.shape == (3, 5, 2, 23, 16) and pool.hidden.shape == (5, 8, width)
    keys = iter(jax.random.split(jax.random.key(9), 8))  # a residual that is not zero: the loss goes through it

    def nonzero(layers):
        return tuple(m.replace(up=0.1 * jax.random.normal(next(keys), m.up.shape)) for m in layers)
    trained = ridge.replace(keys=nonzero(ridge.keys), values=nonzero(ridge.values))
    opt = make_optimizer(rc, trained)
    step = jax.jit(_pooled_step_fn(opt, rc, source[0], target[0]))
    for i in range(3):  # 3 x 2 rows of a 5-window pool: every window once, then the next epoch's order
        tokens, cache, hidden = batch = pool.batch(i, 2, rc.seed)
        _, _, pooled = step(trained, opt.init(trained), source[1], target[1], batch)
        streaming = window_kl(trained, source, target, tokens, rc.prefix_len, teacher).mean()
        np.testing.assert_allclose(float(pooled), float(streaming), rtol=2e-5)
    rows = np.concatenate([pool.rows(i, 2, rc.seed) for i in range(3)])
    assert sorted(rows[:5].tolist()) == list(range(5))  # an epoch visits every window once


def test_pooled_training_learns_and_resumes_exactly(pair, ridge, tmp_path):
    source, target = pair
    straight, hist = kvjax.train_residual(ridge, source, target, TOKENS, RC, workdir=str(tmp_path / "a"))
    assert hist[-1]["kl"] < hist[0]["kl"]
    kvjax.train_residual(ridge, source, target, TOKENS, RC, workdir=str(tmp_path / "b"), stop_at=2)
    resumed, later = kvjax.train_residual(ridge, source, target, TOKENS, RC, workdir=str(tmp_path / "b"))
    assert [h["step"] for h in later] == [3, 4]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="pool_windows.*rollout"):
        kvjax.train_residual(ridge, source, target, TOKENS, dataclasses.replace(RC, rollout=True))


def test_perhead_with_every_source_layer_is_the_layerwise_ridge(pair):
    """Ridge separates over output columns: with k = all source layers each head's fit is its columns of the
    per-layer fit on all layers at the same lambda, so both maps make the same cache."""
    source, target = pair
    calib = windows(16, 40)
    peer, report = fit_perhead(source, target, calib, k=3, lam=1e-3, batch_size=8)
    full, _ = kvjax.fit_map(source, target, calib, windows(8, 40, seed=1), pairing=((0, 1, 2), (0, 1, 2)),
                            lams=(1e-3,), batch_size=8, residual_rank=1)
    src = native_cache(source[1], source[0], jnp.asarray(windows(2, 40, seed=7)))
    a, b = apply_map(peer, src), apply_map(full, src)
    scale = float(jnp.abs(b.k).max())
    np.testing.assert_allclose(np.asarray(a.k), np.asarray(b.k), atol=1e-4 * scale)
    np.testing.assert_allclose(np.asarray(a.v), np.asarray(b.v), atol=1e-4 * float(jnp.abs(b.v).max()))
    # size: 2 layers x (K, V) x 2 heads x (3 source layers x 2 heads x 16 -> 16 weights + 16 biases), float32
    assert report["size_bytes"] == 2 * 2 * 2 * (96 * 16 + 16) * 4
    assert report["calib_tokens"] == 16 * 40 and report["fit_seconds"] > 0


def test_perhead_picks_each_heads_own_source_layers(pair):
    source, target = pair
    peer, report = fit_perhead(source, target, windows(16, 40), k=1, batch_size=8)
    for t, row in enumerate(report["heads"]):
        chosen = set()
        for kind in ("key", "value"):
            for h, head in enumerate(row[kind]):
                assert head["source_layers"] == [int(np.argmax(head["r2_by_source_layer"]))]
                chosen |= set(head["source_layers"])
                # the head's weights are zero on every source layer it did not choose
                lm = (peer.keys if kind == "key" else peer.values)[t]
                union = report["pairing"][t]
                w = np.asarray(lm.w_in @ lm.w_out)[:, h * 16 : (h + 1) * 16].reshape(len(union), 32, 16)
                for i, s in enumerate(union):
                    assert (np.abs(w[i]).max() > 0) == (s in head["source_layers"])
        assert chosen <= set(report["pairing"][t])
    assert len({len(p) for p in report["pairing"]}) == 1  # padded to one width: the map kernels need it
    src = native_cache(source[1], source[0], jnp.asarray(windows(2, 40, seed=7)))
    assert np.isfinite(np.asarray(apply_map(peer, src).k)).all()


def test_attention_fidelity_is_one_on_the_native_cache_and_drops_with_a_worse_map(pair, ridge):
    source, target = pair
    tokens = jnp.asarray(windows(2, 40, seed=4))
    (tcfg, tparams) = target
    q, native = native_attention(tparams, tcfg, tokens)
    own = native_cache(tparams, tcfg, tokens)
    np.testing.assert_allclose(np.asarray(cache_attention(q, own.k, own.v)), np.asarray(native), atol=1e-5)
    from kvjax.mapper.injection import injection_map
    out = map_distances({"ridge": ridge, "raw": injection_map(source[0], tcfg)}, source, target,
                        windows(4, 40, seed=5), batch_size=2)
    for name in ("ridge", "raw"):
        assert set(out[name]["mean"]) >= {"attn_cos", "attn_nrmse"} and len(out[name]["per_layer"]) == 2
        assert -1 <= out[name]["mean"]["attn_cos"] <= 1
    assert out["ridge"]["mean"]["attn_cos"] > out["raw"]["mean"]["attn_cos"]


def test_mc_metrics_pair_the_final_map_with_each_peer_map():
    """The peer table: the final map against the per-head peer and the ridge, paired by item, in metrics.json,
    the summary and the report (a peer that did not run is left out, not reported as zero)."""
    from types import SimpleNamespace

    from kvjax.eval.suite import mc
    rng = np.random.default_rng(0)
    n = 400
    target = (rng.random(n) < 0.4).astype(int)
    residual = np.maximum(target, rng.random(n) < 0.3).astype(int)  # target's items and more: ahead by pairing
    ev = {"hellaswag": {"items": n, "normalize": "length", "arms": {
        "target": {"correct": target.tolist()}, "source": {"correct": (rng.random(n) < 0.7).astype(int).tolist()},
        "perhead": {"correct": target.tolist()}, "residual": {"correct": residual.tolist()}}}}
    ctx = SimpleNamespace(final="residual", n_boot=500, metrics={}, charts={})
    m = mc.metrics(ev, ctx)["hellaswag"]
    d = m["delta_vs_peer"]
    assert list(d) == ["perhead"]  # no ridge arm ran
    assert d["perhead"]["mean"] == pytest.approx(residual.mean() - target.mean())
    assert d["perhead"]["ci95"][0] > 0
    assert "mapped - perhead [+" in mc.summary({"hellaswag": m}, ctx)[0]
    table = "\n".join(mc.report({"hellaswag": m}, ctx))
    assert "mapped - perhead |" in table and "mapped - ridge" not in table

"""The bridge map (kvjax.fitting.bridge): weighted ridge statistics, the target's attention-mass weights,
head matching, the fit against an independent weighted ridge, and the map as a job stage and arm on tiny models."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.fitting.bridge import attention_mass, fit_bridge, mass_weights, match_heads
from kvjax.kernels.features import layer_features, paired_features
from kvjax.mapper.kvmap import apply_map
from kvjax.mapper.ridge import Stats, chunk_stats, solve, to_stats
from kvjax.models.decoder import Stack, forward, prefill_forward
from maptools import native_cache, tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 96


def windows(n, t, seed=0):
    return np.random.RandomState(seed).randint(1, VOCAB, (n, t)).astype(np.int32)


@pytest.fixture(scope="module")
def pair():
    """Source 3 layers (2 KV heads, GQA 2), target 2 layers (2 KV heads, GQA 2): heads can match differently."""
    return tiny_model(3, 64, 4, 2, 16, seed=0, theta=1e4), tiny_model(2, 32, 4, 2, 16, seed=1, theta=5e3)


def stats_of(x, y, mask=None, ref=None, weights=None) -> Stats:
    x, y = jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
    mask = jnp.ones(len(x), jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
    w = None if weights is None else jnp.asarray(weights, jnp.float32)
    r = None if ref is None else jnp.asarray(ref, jnp.float32)
    return to_stats(chunk_stats(x, y, mask, r, weights=w), ref)


def assert_stats_close(a: Stats, b: Stats, rtol=2e-5):
    for f in ("n", "mx", "my", "cxx", "cxr", "crr"):
        want = np.asarray(getattr(b, f))
        np.testing.assert_allclose(getattr(a, f), want, rtol=rtol, atol=rtol * max(np.abs(want).max(), 1.0),
                                   err_msg=f)


# ---- weighted statistics -------------------------------------------------------------------------------------------

def data(n=200, fx=6, fy=3, seed=0):
    rs = np.random.RandomState(seed)
    x = rs.randn(n, fx) * 3 + 5
    y = x @ rs.randn(fx, fy) + 0.3 * rs.randn(n, fy) - 2
    return x.astype(np.float32), y.astype(np.float32)


@pytest.mark.parametrize("with_ref", [False, True])
def test_unit_weights_give_the_unweighted_statistics_bit_for_bit(with_ref):
    x, y = data()
    mask = (np.arange(len(x)) % 7 != 3).astype(np.float32)  # some padding rows too
    ref = np.random.RandomState(1).randn(x.shape[1], y.shape[1]).astype(np.float32) if with_ref else None
    a = jax.jit(lambda *a: chunk_stats(*a))(x, y, mask, ref)
    b = jax.jit(lambda *a: chunk_stats(*a[:4], weights=a[4]))(x, y, mask, ref, np.ones(len(x), np.float32))
    for got, want in zip(b, a):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_integer_weights_equal_duplicated_tokens_and_zero_drops_a_token():
    x, y = data()
    w = np.random.RandomState(2).randint(0, 4, len(x)).astype(np.float32)  # 0..3, zeros included
    assert (w == 0).any() and (w > 1).any()
    rep = np.repeat(np.arange(len(x)), w.astype(int))
    assert_stats_close(stats_of(x, y, weights=w), stats_of(x[rep], y[rep]))
    # with a reference map (held-out statistics) too
    ref = np.random.RandomState(3).randn(x.shape[1], y.shape[1]).astype(np.float32)
    assert_stats_close(stats_of(x, y, ref=ref, weights=w), stats_of(x[rep], y[rep], ref=ref))
    # a zero weight drops its token even when the token is wild; the mask still applies on top of the weights
    x2 = x.copy()
    x2[5] = 1e4
    w2, keep = np.ones(len(x), np.float32), np.arange(len(x)) != 5
    w2[5] = 0
    assert_stats_close(stats_of(x2, y, weights=w2), stats_of(x[keep], y[keep]))
    mask = np.ones(len(x), np.float32)
    mask[7] = 0
    both = keep & (np.arange(len(x)) != 7)
    assert_stats_close(stats_of(x2, y, mask=mask, weights=w2 * 3), stats_of(x[both], y[both], weights=3 * w2[both]))


def test_weighted_chunks_merge_and_solve_as_weighted_least_squares():
    x, y = data(300)
    w = np.random.RandomState(4).uniform(0.1, 5, len(x)).astype(np.float32)
    merged = stats_of(x[:120], y[:120], weights=w[:120])
    merged += stats_of(x[120:], y[120:], weights=w[120:])
    assert_stats_close(merged, stats_of(x, y, weights=w))
    # the ridge of weighted statistics (lambda ~ 0) is weighted least squares with an intercept
    fit = solve(merged, 1e-9)
    xd = np.concatenate([x, np.ones((len(x), 1))], 1).astype(np.float64)
    coef = np.linalg.lstsq(xd * np.sqrt(w)[:, None], y * np.sqrt(w)[:, None], rcond=None)[0]
    np.testing.assert_allclose(fit.weight, coef[:-1], rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(fit.bias - fit.mu @ fit.weight, coef[-1], rtol=1e-3, atol=1e-3)
    unweighted = solve(stats_of(x, y), 1e-9)
    assert np.abs(unweighted.weight - fit.weight).max() > 1e-3  # the weights did change the fit


# ---- attention-mass weights ----------------------------------------------------------------------------------------

def explicit_probs(params, cfg, tokens):
    """[L, B, Hq, T, T] causal attention probabilities of the model's own prefill, computed head by head from each
    layer's queries and keys."""
    t = tokens.shape[1]
    qs, ks = forward(params, cfg, tokens, logits=None, tap=Stack(lambda s: (s.q, s.k))).tapped
    g = qs.shape[3] // ks.shape[3]
    kk = jnp.repeat(ks, g, axis=3)  # query head i reads KV head i // g
    s = jnp.einsum("lbqhd,lbkhd->lbhqk", qs, kk) / np.sqrt(qs.shape[-1])
    s = jnp.where(np.tril(np.ones((t, t), bool)), s, -jnp.inf)
    return np.asarray(jax.nn.softmax(s, -1), np.float64)


def test_attention_mass_is_the_mean_probability_from_later_queries(pair):
    _, (cfg, params) = pair
    tokens = jnp.asarray(windows(3, 150, seed=5))  # > one 128-query block
    mass = np.asarray(attention_mass(params, cfg, tokens), np.float64)
    L, B, T, hkv, g = cfg.num_layers, 3, 150, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    assert mass.shape == (L, B, hkv, T)
    p = explicit_probs(params, cfg, tokens).reshape(L, B, hkv, g, T, T).mean(3)  # [L, B, Hkv, Tq, Tk]
    want = p.sum(3) / (T - np.arange(T))
    np.testing.assert_allclose(mass, want, rtol=1e-4, atol=1e-7)
    # every query's probabilities sum to 1: sum_j (T - j) mass_j = T per layer, row and head
    np.testing.assert_allclose((mass * (T - np.arange(T))).sum(-1), T, rtol=1e-4)
    # causal: the last position is read by its own query only; the first by every query
    np.testing.assert_allclose(mass[..., -1], p[..., -1, -1], rtol=1e-4)
    np.testing.assert_allclose(mass[..., 0], p[..., :, 0].mean(-1), rtol=1e-4)
    # rows do not mix, and a new last token changes earlier positions' mass through the last query alone
    other = tokens.at[1, -1].set((tokens[1, -1] % (VOCAB - 1)) + 1)
    mass2 = np.asarray(attention_mass(params, cfg, other), np.float64)
    np.testing.assert_array_equal(mass2[:, [0, 2]], mass[:, [0, 2]])
    p2 = explicit_probs(params, cfg, other).reshape(L, B, hkv, g, T, T).mean(3)
    readers = T - np.arange(T - 1)
    moved = (mass2[:, 1, :, :-1] - mass[:, 1, :, :-1]) * readers
    assert np.abs(moved).max() > 1e-4
    np.testing.assert_allclose(moved, p2[:, 1, :, -1, :-1] - p[:, 1, :, -1, :-1], atol=1e-5)


def test_mass_weights_have_mean_one_per_window_and_clip():
    mass = np.random.RandomState(0).exponential(1.0, (2, 3, 50)) ** 3
    w = np.asarray(mass_weights(jnp.asarray(mass, jnp.float32), clip=None), np.float64)
    np.testing.assert_allclose(w.mean(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(w, mass / mass.mean(-1, keepdims=True), rtol=1e-5)
    c = np.asarray(mass_weights(jnp.asarray(mass, jnp.float32), clip=3.0), np.float64)
    np.testing.assert_allclose(c.mean(-1), 1.0, rtol=1e-5)
    assert w.max() > 3  # the clip bites
    clipped = np.minimum(w, 3.0)
    np.testing.assert_allclose(c, clipped / clipped.mean(-1, keepdims=True), rtol=1e-5)
    assert np.all(np.diff(c[0, 0][np.argsort(w[0, 0])]) >= -1e-6)  # the order of the tokens is kept


# ---- head matching -------------------------------------------------------------------------------------------------

def test_head_matching_picks_the_source_head_that_is_a_linear_function_of_the_target_head():
    rs = np.random.RandomState(0)
    hd, n = 8, 4000
    y = rs.randn(n, hd)  # one target head
    heads = [rs.randn(n, hd) * 2,  # noise
             0.6 * y @ rs.randn(hd, hd) + rs.randn(n, hd),  # partly predictive
             y @ (np.linalg.qr(rs.randn(hd, hd))[0] * np.linspace(1, 3, hd)) + 3.0,  # an exact affine function
             rs.randn(n, hd)]  # noise
    x = np.concatenate(heads, 1)
    train, held = stats_of(x[:3000], y[:3000]), stats_of(x[3000:], y[3000:])
    chosen, scores = match_heads(train, held, hd, np.arange(hd), k=1)
    assert chosen == (2,) and scores[2] > 0.999 and max(scores[0], scores[3]) < 0.05
    assert match_heads(train, held, hd, np.arange(hd), k=2)[0] == (1, 2)  # next: the partly predictive one
    with pytest.raises(ValueError, match="k must be in 1..4"):
        match_heads(train, held, hd, np.arange(hd), k=5)


# ---- the fit -------------------------------------------------------------------------------------------------------

def weighted_ridge_prediction(source, target, calib, test, lam, pairing, clip):
    """The bridge with every candidate head chosen, computed independently: per target layer, kind and head a
    weighted ridge (float64 numpy) on all the paired layers' features, weights = the head's clipped attention mass."""
    (scfg, sparams), (tcfg, tparams) = source, target

    def features(tokens):
        src = prefill_forward(sparams, scfg, jnp.asarray(tokens), logits=None).cache
        tgt = prefill_forward(tparams, tcfg, jnp.asarray(tokens), logits=None).cache
        return src, tgt

    src, tgt = features(calib)
    w = np.asarray(mass_weights(attention_mass(tparams, tcfg, jnp.asarray(calib)), clip), np.float64)
    tsrc, _ = features(test)
    hd, out = tcfg.head_dim, []
    for t, layers in enumerate(pairing):
        xs = [np.asarray(a, np.float64).reshape(-1, a.shape[-1]) for a in paired_features(src, layers, scfg.rope)]
        ys = [np.asarray(a, np.float64).reshape(-1, a.shape[-1]) for a in layer_features(tgt, t, tcfg.rope)]
        xt = [np.asarray(a, np.float64) for a in paired_features(tsrc, layers, scfg.rope)]
        row = []
        for kind in range(2):
            preds = []
            for h in range(tcfg.num_kv_heads):
                wh = w[t][:, h].reshape(-1)
                x, y = xs[kind], ys[kind][:, h * hd:(h + 1) * hd]
                mx, my = wh @ x / wh.sum(), wh @ y / wh.sum()
                cxx = ((x - mx) * wh[:, None]).T @ (x - mx) / wh.sum()
                cxy = ((x - mx) * wh[:, None]).T @ (y - my) / wh.sum()
                wt = np.linalg.solve(cxx + lam * np.trace(cxx) / len(mx) * np.eye(len(mx)), cxy)
                preds.append((xt[kind] - mx) @ wt + my)
            row.append(np.concatenate(preds, -1))
        out.append(row)
    return out


def test_bridge_with_every_head_is_the_weighted_ridge_computed_independently(pair):
    """k = every candidate head: each target head's fit is a weighted ridge on all the paired layers' features, so
    the map (block placement, each head's weighted mean folded into its bias) reproduces that ridge's predictions."""
    source, target = pair
    calib, pairing, lam = windows(12, 40), ((0, 1), (1, 2)), 1e-3
    kvmap, report = fit_bridge(source, target, calib, windows(6, 40, seed=1), k=4, pairing=pairing, lams=(lam,),
                               clip=3.0, batch_size=4)
    test = windows(2, 40, seed=7)
    want = weighted_ridge_prediction(source, target, calib, test, lam, pairing, 3.0)
    src = native_cache(source[1], source[0], jnp.asarray(test))
    for t in range(2):
        for kind, lm in enumerate((kvmap.keys[t], kvmap.values[t])):
            x = paired_features(src, pairing[t], source[0].rope)[kind]
            got = np.asarray(lm(x), np.float64)
            scale = np.abs(want[t][kind]).max()
            np.testing.assert_allclose(got, want[t][kind], atol=2e-4 * scale)
    cached = apply_map(kvmap, src)
    assert np.isfinite(np.asarray(cached.k)).all()
    # 2 layers x (K, V) x 2 heads x (4 source heads x 16 -> 16 weights + 16 biases), float32
    assert report["size_bytes"] == 2 * 2 * 2 * (64 * 16 + 16) * 4
    assert report["calib_tokens"] == 12 * 40 and report["fit_seconds"] > 0 and report["weighted"]
    # unweighted, the same map is the plain ridge's (with k = all heads it is fit_map's on that pairing)
    plain, _ = fit_bridge(source, target, calib, windows(6, 40, seed=1), k=4, pairing=pairing, lams=(lam,),
                          weighted=False, batch_size=4)
    ridge, _ = kvjax.fit_map(source, target, calib, windows(6, 40, seed=1), pairing=pairing, lams=(lam,),
                             batch_size=4, residual_rank=1)
    a, b, c = apply_map(plain, src), apply_map(ridge, src), cached
    np.testing.assert_allclose(np.asarray(a.k), np.asarray(b.k), atol=1e-4 * float(jnp.abs(b.k).max()))
    np.testing.assert_allclose(np.asarray(a.v), np.asarray(b.v), atol=1e-4 * float(jnp.abs(b.v).max()))
    assert np.abs(np.asarray(c.k) - np.asarray(a.k)).max() > 1e-3 * float(jnp.abs(b.k).max())  # weights matter


def test_bridge_reads_only_each_heads_matched_source_heads(pair):
    source, target = pair
    kvmap, report = fit_bridge(source, target, windows(12, 40), windows(6, 40, seed=1), k=1, pairing="depth",
                               batch_size=4)
    assert [len(p) for p in report["pairing"]] == [1, 1]
    for t, row in enumerate(report["heads"]):
        layer = report["pairing"][t][0]
        for kind, lm in (("key", kvmap.keys[t]), ("value", kvmap.values[t])):
            w = np.asarray(lm.w_in @ lm.w_out)  # [1 layer x 2 heads x 16, 2 heads x 16]
            for h, head in enumerate(row[kind]):
                best = int(np.argmax(head["heldout_r2_by_source_head"]))
                assert head["source_heads"] == [[layer, best]]
                block = w[:, h * 16:(h + 1) * 16].reshape(2, 16, 16)
                assert np.abs(block[best]).max() > 0 and np.abs(block[1 - best]).max() == 0
                assert head["lambda"] in kvjax.mapper.ridge.LAMBDAS and -1 < head["heldout_r2"] <= 1
    assert report["size_bytes"] == 2 * 2 * 2 * (16 * 16 + 16) * 4
    with pytest.raises(ValueError, match="k must be in 1..2"):
        fit_bridge(source, target, windows(4, 40), windows(2, 40), k=3, pairing="depth")


# ---- the job: stage, map directory, arm ----------------------------------------------------------------------------

TOKENIZER = os.path.join(REPO, "checkpoints", "toy", "tokenizer")


def saved_pair(root):
    """Tiny random checkpoints sharing the toy tokenizer (vocab 8192), as tests/test_launch.py's."""
    def make(name, hidden, layers, heads, kv, hd, seed):
        cfg = kvjax.Qwen3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                                num_heads=heads, num_kv_heads=kv, head_dim=hd, rope_theta=10_000.0,
                                tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
        path = os.path.join(root, name)
        kvjax.save_hf(path, cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1), tokenizer_dir=TOKENIZER)
        return path
    return make("source", 32, 3, 4, 2, 16, 0), make("target", 16, 2, 2, 1, 16, 1)


SMALL = ["--config.data.max_train_tokens=6000", "--config.data.max_heldout_tokens=3000",
         "--config.data.heldout_window_len=80", "--config.map.calib_windows=6", "--config.map.select_windows=4",
         "--config.map.window_len=48", "--config.map.batch_size=4", "--config.map.residual_rank=4",
         "--config.map.pairing=depth", "--config.residual.steps=0"]


def test_bridge_is_a_stage_a_map_directory_and_an_arm(tmp_path, monkeypatch):
    from kvjax.job import command as launch
    from kvjax.job.stages import plan
    from kvjax.job.execute import Job
    from kvjax.builders import Mapped
    from kvjax.eval.arms import make_arms
    from kvjax.mapper.artifact import read_manifest
    from kvjax.run.layout import MAP_DIRS, fitted_maps
    from kvjax.job.reporting import map_size_bytes
    monkeypatch.chdir(REPO)
    src_path, tgt_path = saved_pair(str(tmp_path / "pair"))
    out = str(tmp_path / "run")
    base = [f"--config.output_dir={out}", f"--config.source.path={src_path}", f"--config.target.path={tgt_path}",
            *SMALL, "--config.peers.perhead_topk=1"]
    off, _, _ = launch.parse(base)
    cfg, _, _ = launch.parse(base + ["--config.peers.bridge_topk=2", "--config.eval.mc.arms=target,bridge,ridge"])
    plan_off, plan_on = plan(off), plan(cfg)
    assert "bridge" not in plan_off and list(plan_on)[:4] == ["calibrate", "ridge", "perhead", "bridge"]
    assert fitted_maps(cfg) == ("perhead", "bridge", "ridge")
    assert plan_on["perhead"].hash == plan_off["perhead"].hash  # the bridge's fields are not the peer's hash
    assert plan_on["mc"].settings["arms"] == ["target", "bridge", "ridge"]
    assert "bridge" not in plan(launch.parse(base + ["--config.eval.mc.arms=target,bridge"])[0])["mc"].settings[
        "arms"]  # a run without the bridge map leaves its arm out
    job = Job(cfg)
    job.check()
    os.makedirs(out)
    with jax.set_mesh(job.mesh()):
        for name in ("calibrate", "ridge", "bridge"):
            getattr(job, f"stage_{name}")(job.stages[name])
            job.run.finish(job.stages[name], 0.0)
        manifest = read_manifest(job.run.path(MAP_DIRS["bridge"]))
        info = manifest["info"]
        ridge_pairing = read_manifest(job.run.path(MAP_DIRS["ridge"]))["info"]["pairing"]
        assert info["pairing"] == ridge_pairing and info["k"] == 2 and info["weighted"]
        assert info["size_bytes"] == 2 * 2 * 1 * (2 * 16 * 16 + 16) * 4  # 2 layers, K/V, 1 head, 2 source heads
        assert map_size_bytes(manifest, job.map("bridge"), "bridge") == info["size_bytes"]
        assert info["fit_seconds"] > 0
        source, target = job.models()
        (arm,) = make_arms(["bridge"], source, target, job.map)
        tokens, lengths = np.asarray(job.data("heldout"))[:2, :30], np.asarray([30, 21], np.int32)
        cache = arm.batch_fn(tokens, lengths)
        want = Mapped(source, target, job.map("bridge"))(tokens, lengths, bucketed=True)
        assert np.asarray(cache.lengths).tolist() == [30, 21]
        np.testing.assert_array_equal(np.asarray(cache.keys[0]), np.asarray(want.keys[0]))
        ridge = Mapped(source, target, job.map("ridge"))(tokens, lengths, bucketed=True)
        assert not np.allclose(np.asarray(cache.keys[1])[:, :, :21], np.asarray(ridge.keys[1])[:, :, :21])

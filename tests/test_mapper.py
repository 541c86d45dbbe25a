"""The cache map: pairing, ridge statistics, RoPE round trip, fit/apply, residual, artifacts, split-path generation."""

import dataclasses
import os
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from maptools import native_cache
from kvjax.mapper.kvmap import ridge_only
from kvjax.mapper.pairing import depth_pairing, topk_pairing
from kvjax.fitting.residual import ResidualConfig, evaluate_kl
from kvjax.mapper.ridge import LAMBDAS, Stats, chunk_stats, mse, reference, select, solve, to_stats
from kvjax.eval.cache_distances import cache_distances
from kvjax.models.rope import apply_rope, rope_angles, rope_table, unapply_rope

VOCAB = 96
U = 2.0 ** -24  # float32 unit roundoff


def gamma(k):
    """Bound on the relative float32 error of a sum of k terms (any order), as a fraction of sum |terms|."""
    return k * U / (1 - k * U)


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
    # rope_angles rounds inv_freq and position * inv_freq to float32: its angles (up to 49) are off by <= 2 U 49,
    # moving cos/sin by as much; plus a few ulps each for XLA's cos/sin and the table's rounding. Measured 1.3e-6.
    atol = 2 * U * 49 + 4 * U  # 6.1e-6
    np.testing.assert_allclose(table[0], cos, atol=atol)
    np.testing.assert_allclose(table[1], sin, atol=atol)


def heldout_mse_bound(fit, x, y, ref):
    """Worst-case bound (first order in U) on |mse(fit, held) - exact| for held-out statistics of float32 data
    x [N, Fx], y [N, Fy] taken by chunk_stats in one chunk around `ref` (zero: of y itself), for any summation order,
    so for any vector width or backend: a float32 sum of k terms is off by at most gamma(k) * sum of |terms|.
    - means (tree_sum, L = ceil(log2 N) levels, one division): off by delta <= gamma(L + 1) (mean|y| + mean|x| |W|)
      through the prediction; that moves the offset^2 term by 2 |o| delta + delta^2 and the spread by delta^2;
    - each token's centred residual (x - mx, y - my, x @ ref over Fx terms, one subtraction): off by
      E_t <= gamma(Fx + 3) (|yc| + |rc| + |xc| (|ref| + |D|)), D = W - ref; moves the spread by 2 |e_t| E_t + E_t^2
      (e_t: that token's centred error under W);
    - the sums: sum r^2 (tree_sum: gamma(L + 1)), sum x r' and sum x x' (matmuls: gamma(N + 1)), weighted by D in
      sum r^2 - 2 D.sum x r' + D' sum x x' D.
    Host float64 merges and the quadratic form add ~1e-16 relative (neglected, as are second-order terms)."""
    n, w = len(x), fit.weight
    ref = np.asarray(ref, np.float64)
    d = w - ref
    levels = int(np.ceil(np.log2(n)))
    xc, yc = x - x.mean(0), y - y.mean(0)
    rc = yc - xc @ ref
    e = rc - xc @ d
    offset = y.mean(0) - (x.mean(0) - fit.mu) @ w - fit.bias
    delta = gamma(levels + 1) * (np.abs(y).mean(0) + np.abs(x).mean(0) @ np.abs(w))
    means = 2 * np.abs(offset) @ delta + 2 * delta @ delta
    et = gamma(x.shape[1] + 3) * (np.abs(yc) + np.abs(rc) + np.abs(xc) @ (np.abs(ref) + np.abs(d)))
    tokens = np.sum(2 * np.abs(e) * et + et * et) / n
    xd = np.abs(xc) @ np.abs(d)
    sums = (gamma(levels + 1) * np.sum(rc * rc) + gamma(n + 1) * np.sum((2 * np.abs(rc) + xd) * xd)) / n
    return means + tokens + sums


def linear_data(noise, offset=5.0):
    """Offset features (mean 5) and y = x @ w + noise + 2, rounded to float32 (the data the statistics see)."""
    rng = np.random.RandomState(0)
    w = rng.randn(6, 4)
    x = rng.randn(2000, 6) * [1, 2, 3, 0.1, 1, 1] + offset
    y = x @ w + noise * rng.randn(2000, 4) + 2
    return w, x.astype(np.float32).astype(np.float64), y.astype(np.float32).astype(np.float64)


def f32_stats(x, y, chunk, ref=None):
    acc = None
    for i in range(0, len(x), chunk):
        xs, ys = jnp.asarray(x[i:i + chunk], jnp.float32), jnp.asarray(y[i:i + chunk], jnp.float32)
        st = to_stats(chunk_stats(xs, ys, jnp.ones(len(xs)), None if ref is None else jnp.asarray(ref)), ref)
        if acc is None:
            acc = st
        else:
            acc += st
    return acc


def exact_mse(fit, x, y):
    return float(np.mean(np.sum((y - (x - fit.mu) @ fit.weight - fit.bias) ** 2, 1)))


def test_streamed_ridge_recovers_a_linear_map_and_heldout_mse_is_exact():
    w, x, y = linear_data(noise=0.05)
    train = f32_stats(x[:1000], y[:1000], 250)
    one_pass = f32_stats(x[:1000], y[:1000], 1000)
    # chunked accumulation equals one pass: both are within the float32 bound of the sums, gamma(N + 3) of each
    # entry's Cauchy-Schwarz scale (means: gamma(log2 N + 2) of sqrt(mean x^2)); measured <= 5% of that (0.3% sums)
    sxx, syy, n = np.diag(one_pass.cxx), one_pass.crr, one_pass.n
    for name, scale, k in (("mx", np.sqrt(sxx / n + one_pass.mx ** 2), 12),
                           ("my", np.sqrt(syy / n + one_pass.my ** 2), 12), ("cxx", np.sqrt(np.outer(sxx, sxx)), n + 3),
                           ("cxr", np.sqrt(np.outer(sxx, syy)), n + 3), ("crr", syy, n + 3)):
        assert np.all(np.abs(getattr(train, name) - getattr(one_pass, name)) <= 2 * gamma(k) * scale), name
    ref = reference(train)
    held = f32_stats(x[1000:], y[1000:], 1000, ref)  # held-out statistics: of the residual around ref
    fit, scores = select(train, held)
    np.testing.assert_allclose(fit.weight, w, atol=0.05)
    assert fit.lam <= 1e-3 and scores[1.0] > scores[fit.lam]
    exact = exact_mse(fit, x[1000:], y[1000:])
    bound = heldout_mse_bound(fit, x[1000:], y[1000:], ref)  # 1.9e-4 of the MSE here; measured error 1.2e-6
    assert abs(mse(fit, held) - exact) <= bound < 1e-3 * exact
    # y's moments rebuilt from r's sums: off by at most ~gamma(N + 3) = 6e-5 of their Cauchy-Schwarz scale (the
    # float32 sums, any order) times |x||ref| / |y| (< 3 here); 1e-3 of it separates that from a wrong formula
    var_x, var_y = np.var(x[1000:], 0), np.var(y[1000:], 0)
    np.testing.assert_allclose(held.var_y(), var_y.sum(), rtol=1e-3)
    cov = np.cov(x[1000:].T, y[1000:].T, bias=True)[:6, 6:]
    assert np.all(np.abs(held.cov_xy() - cov) <= 1e-3 * np.sqrt(np.outer(var_x, var_y)))
    low = solve(train, 1e-6, rank=2)
    assert np.linalg.matrix_rank(low.weight, tol=1e-8) == 2 and mse(low, held) > mse(fit, held)
    with pytest.raises(ValueError, match="different reference maps"):
        held += f32_stats(x[:100], y[:100], 100)


def test_heldout_mse_stays_within_its_bound_where_float32_cancellation_is_worst():
    """var(y) is 1.5e7 times the held-out MSE (noise 1e-3, features offset by 5). Statistics of y itself (as the
    code once kept them) missed the MSE here by 310% (and by 0.02-0.3% at the previous test's noise 0.05, depending on
    the machine's vector width); their bound exceeds the MSE itself, i.e. they guaranteed no digit."""
    _, x, y = linear_data(noise=1e-3)
    train = f32_stats(x[:1000], y[:1000], 250)
    ref = reference(train)
    held = f32_stats(x[1000:], y[1000:], 1000, ref)
    exact, bounds = {}, {}
    for lam in LAMBDAS:
        fit = solve(train, lam)
        exact[lam], bounds[lam] = exact_mse(fit, x[1000:], y[1000:]), heldout_mse_bound(fit, x[1000:], y[1000:], ref)
        assert abs(mse(fit, held) - exact[lam]) <= bounds[lam], f"lambda {lam}"
    best = min(exact, key=exact.get)
    assert bounds[best] < 0.02 * exact[best]  # 1.1e-2 here; measured error 2.8e-5
    fit = solve(train, best)
    assert heldout_mse_bound(fit, x[1000:], y[1000:], 0 * ref) > exact[best]  # y statistics: no digit certain
    runner_up = min((v for k, v in exact.items() if k != best))
    if runner_up - exact[best] > bounds[best] + max(bounds.values()):  # the choice is certain: it must be made
        assert select(train, held)[0].lam == best


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
    for root, _, files in os.walk(tmp_path / "map"):  # nothing in a saved map names where it was written
        for f in files:
            assert str(tmp_path).encode() not in open(os.path.join(root, f), "rb").read(), f
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


def test_topk_pairing_concatenates_the_best_source_layers(pair, monkeypatch):
    source, target = pair
    kvmap, report = kvjax.fit_map(source, target, windows(8, 32), windows(8, 32, seed=1), pairing=2, batch_size=8)
    r2 = np.asarray(report["layer_r2"])
    assert r2.shape == (2, 3)
    for t, layers in enumerate(report["pairing"]):
        assert len(layers) == 2 and set(layers) == set(np.argsort(-r2[t])[:2].tolist())
    assert kvmap.keys[0].w_in.shape[0] == 2 * 2 * 16  # two source layers of 2 kv heads x 16
    # the top-k fit reads the picked layers' block of every layer's statistics (one calibration pass): the same map
    # as a fit that collects the picked pairing's own statistics, and the same choice of lambda
    explicit, again = kvjax.fit_map(source, target, windows(8, 32), windows(8, 32, seed=1),
                                    pairing=tuple(tuple(p) for p in report["pairing"]), batch_size=8)
    assert [r["key"]["lambda"] for r in again["layers"]] == [r["key"]["lambda"] for r in report["layers"]]
    for a, b in zip(jax.tree.leaves(kvmap), jax.tree.leaves(explicit)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    # a model too large to screen every layer in one pass is screened a group at a time: the same table and map
    from kvjax.fitting import fit
    monkeypatch.setattr(fit, "STATS_BUDGET", 1)
    assert fit.screen_groups(3, 2, 32) == [(0,), (1,), (2,)]
    grouped, by_groups = kvjax.fit_map(source, target, windows(8, 32), windows(8, 32, seed=1), pairing=2,
                                       batch_size=8)
    np.testing.assert_allclose(by_groups["layer_r2"], report["layer_r2"], rtol=1e-5)
    assert by_groups["pairing"] == report["pairing"]
    for a, b in zip(jax.tree.leaves(kvmap), jax.tree.leaves(grouped)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="ref = 0"):  # around a reference map the residual reads every feature
        around = Stats.zeros(4, 2, np.ones((4, 2)))
        around.restrict([0, 1])


def test_collect_stats_reads_several_pairings_of_a_target_layer_in_one_pass(pair):
    """The layer screen's held-out pass: entry i of the pairing (and of refs) for target layer targets[i]; the same
    statistics as one pass per pairing."""
    from kvjax.fitting.calibrate import batches_of, collect_stats
    source, target = pair
    w = windows(8, 32)
    rng = np.random.default_rng(0)
    refs = [[(rng.normal(size=(32, 16)), rng.normal(size=(32, 16))) for _ in range(2)] for _ in range(3)]
    one = [collect_stats(source, target, ((s,),) * 2, batches_of(w, 4), refs=refs[s]) for s in range(3)]
    k, v = collect_stats(source, target, tuple((s,) for s in range(3) for _ in range(2)), batches_of(w, 4),
                         targets=(0, 1) * 3, refs=[r for per_s in refs for r in per_s])
    for s in range(3):
        for t in range(2):
            for got, want in ((k[2 * s + t], one[s][0][t]), (v[2 * s + t], one[s][1][t])):
                assert got.n == want.n
                for f in ("mx", "my", "cxx", "cxr", "crr", "ref"):  # float32 chunks, fused differently: 2^-16
                    w = getattr(want, f)
                    np.testing.assert_allclose(getattr(got, f), w, rtol=0, atol=2.0 ** -16 * np.abs(w).max())
    with pytest.raises(ValueError, match="2 target layers for 3 entries"):
        collect_stats(source, target, ((0,), (1,), (2,)), batches_of(w, 4), targets=(0, 1))


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


def test_next_token_agreement(pair):
    from kvjax.eval import next_token_agreement
    (cfg, params), target = pair
    m = (cfg, params)
    self_map, _ = kvjax.fit_map(m, m, windows(16, 64), windows(8, 64, seed=1), batch_size=8)
    held = windows(6, 40, seed=4)
    same = next_token_agreement(self_map, m, m, held, prefix=24, batch_size=4)
    assert set(same) == {"with_source", "with_target", "target_with_source", "first_with_source",
                         "first_with_target", "kl_mapped", "kl_native", "kl_to_target"}
    assert same["with_source"].shape == (6,)
    np.testing.assert_allclose(same["with_source"], 1.0)  # a model mapped onto itself reproduces itself
    np.testing.assert_allclose(same["first_with_target"], 1.0)
    np.testing.assert_allclose(same["kl_native"], 0.0, atol=1e-5)
    assert same["kl_mapped"].max() < 1e-2 and same["kl_to_target"].max() < 1e-2  # the map moves nothing
    kvmap, _ = kvjax.fit_map(m, target, windows(16, 64), windows(8, 64, seed=1), batch_size=8)
    cross = next_token_agreement(kvmap, m, target, held, prefix=24)
    assert np.all((cross["with_target"] >= 0) & (cross["with_target"] <= 1)) and cross["kl_native"].min() > 0
    with pytest.raises(ValueError, match="prefix"):
        next_token_agreement(kvmap, m, target, held, prefix=40)


def per_position_map(m, x, before):
    """A context LinearMap written out position by position: each reads itself and the m.context positions before it
    (rows of `before` ahead of the block; mu before the sequence's start)."""
    c = m.context
    rows = jnp.concatenate([before, x], 1)  # [B, c + T, Fx]
    out = []
    for i in range(x.shape[1]):
        pre = (rows[:, c + i] - m.mu) @ (m.down / m.scale) + m.res_bias
        for j in range(c):
            pre = pre + (rows[:, c + i - 1 - j] - m.mu) @ (m.down_prev[j] / m.scale)
        out.append(((rows[:, c + i] - m.mu) @ m.w_in) @ m.w_out + m.bias + jax.nn.gelu(pre) @ m.up)
    return jnp.stack(out, 1)


def test_context_map_reads_the_positions_before_each_one(pair, tmp_path):
    from kvjax.kernels.map_insert import insert_layers, map_insert_reference
    from kvjax.mapper.kvmap import LinearMap, apply_map
    from kvjax.fitting.residual import warm_start, with_context

    ks = jax.random.split(jax.random.key(0), 8)
    fx, fy, h, r = 12, 8, 4, 3
    m = LinearMap(mu=jax.random.normal(ks[0], (fx,)), scale=jnp.float32(2.0), w_in=jax.random.normal(ks[1], (fx, r)),
                  w_out=jax.random.normal(ks[2], (r, fy)), bias=jax.random.normal(ks[3], (fy,)),
                  down=jax.random.normal(ks[4], (fx, h)), res_bias=jnp.zeros(h), up=jax.random.normal(ks[5], (h, fy)),
                  down_prev=jax.random.normal(ks[6], (2, fx, h)))
    x = jax.random.normal(ks[7], (2, 10, fx))
    start = jnp.broadcast_to(m.mu, (2, 2, fx))  # before position 0: mu, i.e. zero features
    np.testing.assert_allclose(m(x), per_position_map(m, x, start), atol=1e-5)
    np.testing.assert_allclose(m(x[:, 4:], x[:, 2:4]), m(x)[:, 4:], atol=1e-5)  # a later block reads its past
    assert not np.allclose(m(x)[:, 1:], m.replace(down_prev=None)(x)[:, 1:], atol=1e-3)

    source, target = pair
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 40), windows(8, 40, seed=1), batch_size=8, residual_rank=4)
    ctx = with_context(kvmap, 2, seed=0)
    assert {lm.context for lm in (*ctx.keys, *ctx.values)} == {2} and with_context(ctx, 2, seed=0) is ctx
    with pytest.raises(ValueError, match="reads \\[2\\] previous positions"):
        with_context(ctx, 1, seed=0)
    cache = native_cache(source[1], source[0], jnp.asarray(windows(2, 24, seed=4)))
    np.testing.assert_allclose(apply_map(ctx, cache).k, apply_map(kvmap, cache).k, atol=1e-6)  # up = 0: the ridge

    # trained, the map reads neighbours: the XLA map in blocks (a later block reads the positions before it) equals
    # the map of the whole sequence, and the Pallas kernel (positions alone) refuses it
    tokens = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.uint16)
    rc = ResidualConfig(steps=4, batch_size=2, prefix_len=24, cont_len=8, lr=3e-2, warmup_steps=1, context=2)
    trained, hist = kvjax.train_residual(kvmap, source, target, tokens, rc)
    assert len(hist) == 4 and all(np.abs(np.asarray(lm.down_prev)).max() > 0 for lm in trained.keys)
    args = dict(pairing=trained.spec.pairing, tgt_layers=(0, 1), src_rope=source[0].rope, tgt_rope=target[0].rope)
    zeros = jnp.zeros((2, 2, target[0].num_kv_heads, 24, target[0].head_dim))
    whole = map_insert_reference(cache.k, cache.v, zeros, zeros, trained.keys, trained.values, length=24, **args)
    part = (zeros, zeros)
    for lo, n in ((0, 1), (1, 9), (10, 14)):  # the second block starts inside the context
        part = map_insert_reference(cache.k, cache.v, *part, trained.keys, trained.values, length=n, src_offset=lo,
                                    dst_offset=lo, **args)
    for a, b in zip(whole, part):
        np.testing.assert_allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="context map"):
        insert_layers(cache.k, cache.v, zeros, zeros, trained.keys, trained.values, length=24, impl="pallas", **args)
    auto = insert_layers(cache.k, cache.v, zeros, zeros, trained.keys, trained.values, length=24, impl="auto",
                         interpret=True, **args)
    np.testing.assert_allclose(auto[0], whole[0], atol=1e-6)

    # saved and loaded with its context; a map saved without one loads without one; a warm start must match it
    kvjax.save_map(tmp_path / "ctx", trained)
    loaded = kvjax.load_map(tmp_path / "ctx", source[0], target[0])
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(a, b)
    kvjax.save_map(tmp_path / "plain", kvmap)
    assert kvjax.load_map(tmp_path / "plain").keys[0].down_prev is None
    with pytest.raises(ValueError, match="residual rank, context"):
        warm_start(ctx, str(tmp_path / "plain"))
    np.testing.assert_array_equal(warm_start(ctx, str(tmp_path / "ctx")).values[1].down_prev,
                                  trained.values[1].down_prev)


def test_context_map_on_keys_or_values_only(pair, tmp_path):
    """residual.context_kinds: the key maps (or the value maps) read the context, the others each position alone; the
    same draw as both reading it; trained, saved and loaded so; a warm start across kinds is refused."""
    from kvjax.fitting.residual import warm_start, with_context

    source, target = pair
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 40), windows(8, 40, seed=1), batch_size=8, residual_rank=4)
    both = with_context(kvmap, 1, seed=0)
    keys_only, values_only = (with_context(kvmap, 1, seed=0, kinds=k) for k in ("k", "v"))
    assert [lm.context for lm in (*keys_only.keys, *keys_only.values)] == [1, 1, 0, 0]
    assert [lm.context for lm in (*values_only.keys, *values_only.values)] == [0, 0, 1, 1]
    np.testing.assert_array_equal(keys_only.keys[1].down_prev, both.keys[1].down_prev)
    np.testing.assert_array_equal(values_only.values[0].down_prev, both.values[0].down_prev)
    assert with_context(keys_only, 1, seed=0, kinds="k") is keys_only
    with pytest.raises(ValueError, match="in its key maps, not residual.context=1 in residual.context_kinds='kv'"):
        with_context(keys_only, 1, seed=0)

    tokens = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.uint16)
    rc = ResidualConfig(steps=2, batch_size=2, prefix_len=24, cont_len=8, lr=3e-2, warmup_steps=1, context=1,
                        context_kinds="k")
    trained, _ = kvjax.train_residual(kvmap, source, target, tokens, rc)
    assert all(np.abs(np.asarray(lm.down_prev)).max() > 0 for lm in trained.keys)
    assert all(lm.down_prev is None for lm in trained.values)
    kvjax.save_map(tmp_path / "k", trained)
    loaded = kvjax.load_map(tmp_path / "k", source[0], target[0])
    assert [lm.context for lm in (*loaded.keys, *loaded.values)] == [1, 1, 0, 0]
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(warm_start(keys_only, str(tmp_path / "k")).keys[0].down_prev,
                                  trained.keys[0].down_prev)
    with pytest.raises(ValueError, match="context of keys and values"):
        warm_start(both, str(tmp_path / "k"))


def test_cross_position_map_attends_over_every_earlier_position(pair, tmp_path, monkeypatch):
    from kvjax.kernels.map_insert import insert_layers, map_insert_reference
    from kvjax.mapper import kvmap as kvmap_module
    from kvjax.mapper.kvmap import LinearMap, apply_map
    from kvjax.fitting.residual import warm_start, with_attention

    ks = jax.random.split(jax.random.key(1), 10)
    fx, fy, h, r, a, d = 12, 8, 4, 3, 2, 6
    m = LinearMap(mu=jax.random.normal(ks[0], (fx,)), scale=jnp.float32(2.0), w_in=jax.random.normal(ks[1], (fx, r)),
                  w_out=jax.random.normal(ks[2], (r, fy)), bias=jax.random.normal(ks[3], (fy,)),
                  down=jax.random.normal(ks[4], (fx, h)), res_bias=jnp.zeros(h), up=jax.random.normal(ks[5], (h, fy)),
                  att_q=jax.random.normal(ks[6], (a, fx, d)), att_k=jax.random.normal(ks[7], (a, fx, d)),
                  att_v=jax.random.normal(ks[8], (a, fx, d)), att_o=jax.random.normal(ks[9], (a, d, h)))
    x = jax.random.normal(jax.random.key(2), (2, 10, fx))
    whole = m(x)
    np.testing.assert_allclose(m(x[:, 4:], x[:, :4]), whole[:, 4:], atol=1e-5)  # a later block reads all its past
    moved = m(x.at[:, 0].add(3.0))  # position 0 reaches every later position (a context map's few would not)
    np.testing.assert_array_equal(moved[:, :0], whole[:, :0])
    assert np.abs(np.asarray(moved - whole))[:, 1:].min(axis=-1).max() > 0 and not np.allclose(moved[:, 9], whole[:, 9])
    moved = m(x.at[:, 6].add(3.0))
    np.testing.assert_array_equal(moved[:, :6], whole[:, :6])  # causal: nothing before it moves
    monkeypatch.setattr(kvmap_module, "ATTENTION_BLOCK", 3)  # queries in blocks give the same answer
    np.testing.assert_allclose(m(x), whole, atol=1e-5)
    monkeypatch.undo()
    assert not np.allclose(whole, m.replace(att_q=None, att_k=None, att_v=None, att_o=None)(x), atol=1e-3)

    source, target = pair
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 40), windows(8, 40, seed=1), batch_size=8, residual_rank=4)
    att = with_attention(kvmap, 2, 8, seed=0)
    assert all(lm.attends and lm.att_q.shape == (2, lm.down.shape[0], 8) for lm in (*att.keys, *att.values))
    assert with_attention(att, 2, 8, seed=0) is att
    with pytest.raises(ValueError, match="attends with"):
        with_attention(att, 1, 8, seed=0)
    cache = native_cache(source[1], source[0], jnp.asarray(windows(2, 24, seed=4)))
    np.testing.assert_allclose(apply_map(att, cache).k, apply_map(kvmap, cache).k, atol=1e-6)  # fresh: unchanged

    tokens = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.uint16)
    rc = ResidualConfig(steps=4, batch_size=2, prefix_len=24, cont_len=8, lr=3e-2, warmup_steps=1, attention_heads=2,
                        attention_dim=8)
    trained, hist = kvjax.train_residual(kvmap, source, target, tokens, rc)
    assert len(hist) == 4 and all(np.abs(np.asarray(lm.att_o)).max() > 0 for lm in trained.keys)
    np.testing.assert_array_equal(trained.keys[0].w_in, kvmap.keys[0].w_in)  # the ridge stays frozen
    args = dict(pairing=trained.spec.pairing, tgt_layers=(0, 1), src_rope=source[0].rope, tgt_rope=target[0].rope)
    zeros = jnp.zeros((2, 2, target[0].num_kv_heads, 24, target[0].head_dim))
    whole = map_insert_reference(cache.k, cache.v, zeros, zeros, trained.keys, trained.values, length=24, **args)
    part = (zeros, zeros)
    for lo, n in ((0, 1), (1, 9), (10, 14)):  # each block reads every position before it
        part = map_insert_reference(cache.k, cache.v, *part, trained.keys, trained.values, length=n, src_offset=lo,
                                    dst_offset=lo, **args)
    for got, want in zip(part, whole):
        np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="cross-position map"):
        insert_layers(cache.k, cache.v, zeros, zeros, trained.keys, trained.values, length=24, impl="pallas", **args)

    kvjax.save_map(tmp_path / "att", trained)
    loaded = kvjax.load_map(tmp_path / "att", source[0], target[0])
    for got, want in zip(jax.tree.leaves(loaded), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(got, want)
    kvjax.save_map(tmp_path / "plain", kvmap)
    with pytest.raises(ValueError, match="context or attention"):
        warm_start(att, str(tmp_path / "plain"))


def test_train_ridge_moves_the_ridge_and_never_mu_or_scale(pair):
    source, target = pair
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 40), windows(8, 40, seed=1), batch_size=8, residual_rank=4)
    tokens = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.uint16)
    rc = ResidualConfig(steps=3, batch_size=2, prefix_len=24, cont_len=8, lr=3e-2, warmup_steps=1, train_ridge=True,
                        ridge_lr=0.5, ema=0.5)
    trained, _ = kvjax.train_residual(kvmap, source, target, tokens, rc)
    for new, old in zip((*trained.keys, *trained.values), (*kvmap.keys, *kvmap.values)):
        assert not np.allclose(new.w_in, old.w_in) and not np.allclose(new.bias, old.bias)
        np.testing.assert_array_equal(new.mu, old.mu)
        np.testing.assert_array_equal(new.scale, old.scale)
    # (without train_ridge the ridge stays as fitted: test_cross_position_map_attends_over_every_earlier_position)

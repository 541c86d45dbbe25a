"""Rollout divergence (kvjax.eval.divergence) and the residual's rollout training (ResidualConfig.rollout)."""

import dataclasses

import jax
import numpy as np
import pytest

import kvjax
from kvjax.builders import NativePrefill
from kvjax.eval.divergence import rollout_divergence, rollout_table
from kvjax.mapper.kvmap import direct_map, ridge_only
from kvjax.fitting.residual import ResidualConfig, heldout_position_kl, rollout_windows
from kvjax.windows import step_batch
from tests.maptools import VOCAB, tiny_pair

P, N = 24, 6  # prefix tokens, generated steps


def windows(n, t, seed=0):
    return np.random.RandomState(seed).randint(1, VOCAB, (n, t)).astype(np.int32)


@pytest.fixture(scope="module")
def setup():
    source, target = tiny_pair()
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 40), windows(8, 40, seed=1), batch_size=8, residual_rank=4)
    # a residual that moves the cache: random output projections instead of training
    keys = jax.random.split(jax.random.key(3), 2 * len(kvmap.keys))
    bump = lambda ms, ks: tuple(m.replace(up=0.3 * jax.random.normal(k, m.up.shape)) for m, k in zip(ms, ks))  # noqa
    moved = kvmap.replace(keys=bump(kvmap.keys, keys[::2]), values=bump(kvmap.values, keys[1::2]))
    return source, target, kvmap, moved


def test_divergence_is_the_teacher_forced_kl_along_the_targets_own_rollout(setup):
    source, target, ridge, moved = setup
    prefixes = windows(5, P, seed=4)
    got = rollout_table({"ridge": ridge, "moved": moved}, source, target, prefixes, N, batch_size=2)
    assert set(got) == {"ridge", "moved"} and got["ridge"].shape == (5, N)
    for name, kvmap in (("ridge", ridge), ("moved", moved)):
        # the same quantity through the residual trainer's two functions: its greedy rollout, then its per-position
        # KL of the target reading those tokens after the mapped prefix (teacher-forced)
        (scfg, sparams), (tcfg, tparams) = source, target
        roll = jax.jit(lambda m, sp, tp, x: rollout_windows(m, (scfg, sp), (tcfg, tp), x, N))
        tokens = roll(kvmap, sparams, tparams, prefixes)
        want = heldout_position_kl(kvmap, sparams, tparams, scfg, tcfg, tokens, P)
        np.testing.assert_allclose(got[name], want, atol=2e-5, rtol=1e-4, err_msg=name)
    assert (got["ridge"] > 0).all() and np.abs(got["moved"] - got["ridge"]).max() > 1e-3
    # the zero residual is the ridge, exactly
    np.testing.assert_array_equal(rollout_divergence(ridge_only(moved), source, target, prefixes, N, 2), got["ridge"])


def test_the_source_mapped_onto_itself_does_not_diverge():
    source, _ = tiny_pair()
    prefixes = windows(4, P, seed=6)
    identity = direct_map(source[0], source[0], tuple((i,) for i in range(source[0].num_layers)))
    got = rollout_table({"identity": identity, "native": NativePrefill(source)}, source, source, prefixes, N)
    for name, d in got.items():
        assert d.shape == (4, N) and np.abs(d).max() < 1e-5, (name, np.abs(d).max())
    with pytest.raises(ValueError, match="prefixes must be"):
        rollout_divergence(identity, source, source, prefixes[0], N)


def test_rollout_training_scores_the_rollout(setup, tmp_path):
    source, target, ridge, _ = setup
    tokens = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.uint16)
    rc = ResidualConfig(steps=4, batch_size=2, prefix_len=P, cont_len=N, lr=1e-2, warmup_steps=1, save_every=2,
                        rollout=True)
    straight, hist = kvjax.train_residual(ridge, source, target, tokens, rc, workdir=str(tmp_path / "a"))
    # step 1's loss is the untrained map's rollout divergence on step 1's windows
    first = step_batch(tokens, 0, rc.batch_size, rc.prefix_len + rc.cont_len, rc.seed)[:, :P]
    np.testing.assert_allclose(hist[0]["kl"], rollout_divergence(ridge, source, target, first, N).mean(), rtol=1e-4)
    assert all(np.isfinite(h["kl"]) for h in hist)
    np.testing.assert_array_equal(straight.keys[0].w_in, ridge.keys[0].w_in)  # the ridge stays frozen
    assert np.abs(np.asarray(straight.values[0].up)).max() > 0
    with pytest.raises(ValueError, match="differs in settings"):  # a KL run does not resume a rollout run
        kvjax.train_residual(ridge, source, target, tokens, dataclasses.replace(rc, rollout=False),
                             workdir=str(tmp_path / "a"))


def test_rollout_evaluation_metrics_report_and_chart(tmp_path):
    from kvjax.eval.suite import BY_NAME, MetricsContext, ReportContext, rollout
    from kvjax.eval.suite.rollout import RolloutEval
    rng = np.random.RandomState(0)
    ridge = rng.uniform(0.5, 1.5, (10, 4))
    residual = ridge - 0.1  # every window improves
    residual[0] += 0.3  # ... but the first
    record = {"per_step": {"ridge": ridge.tolist(), "residual": residual.tolist(), "target": ridge.tolist(),
                            "other": ridge.tolist()},  # a map outside the arm table is listed by its name
              "windows": 10, "prefix_len": 16, "steps": 4, "residual_training": "rollout"}
    ro = rollout.metrics(record, MetricsContext(1000, "residual"))
    np.testing.assert_allclose(ro["change"], residual.mean() / ridge.mean() - 1)
    assert ro["windows_improved"] == 9 and ro["residual_minus_ridge_ci95"][0] < ro["residual_minus_ridge"]
    np.testing.assert_allclose(ro["per_step"]["residual"], residual.mean(0))
    charts = {"rollout_steps": "rollout_steps.png"}
    rollout.step_chart(ro, str(tmp_path / "rollout_steps.png"), None)
    assert (tmp_path / "rollout_steps.png").stat().st_size > 0
    text = "\n".join(rollout.report(ro, ReportContext({}, charts, "residual", "s", "t")))
    assert "ridge + rollout-trained residual" in text and "9 of 10 windows improve" in text and "| other |" in text
    assert "rollout_steps.png" in text and rollout.summary(ro, None)[0].startswith("- Rollout: 4-step divergence")
    assert BY_NAME["rollout"].settings().enabled is False  # registered; the default job does not pay for it
    assert rollout.preflight(RolloutEval(steps=0, prefix_len=1), None) == [
        "eval.rollout.steps must be >= 1, got 0", "eval.rollout.prefix_len must be >= 2 (a mapped prefix and a last "
        "token), got 1"]


def test_warm_start_continues_a_saved_residual_of_the_same_ridge(setup, tmp_path):
    source, target, ridge, _ = setup
    tokens = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.uint16)
    rc = ResidualConfig(steps=3, batch_size=2, prefix_len=P, cont_len=N, lr=1e-2, warmup_steps=1, save_every=3)
    kl_map, _ = kvjax.train_residual(ridge, source, target, tokens, rc)  # a KL residual, saved as a run saves it
    kvjax.save_map(str(tmp_path / "kl"), kl_map)
    warm = dataclasses.replace(rc, rollout=True, init_from=str(tmp_path / "kl"), seed=1)
    rolled, hist = kvjax.train_residual(ridge, source, target, tokens, warm, workdir=str(tmp_path / "w"))
    # step 1 scores the saved residual (not the ridge's fresh one) on step 1's windows
    first = step_batch(tokens, 0, rc.batch_size, rc.prefix_len + rc.cont_len, warm.seed)[:, :P]
    start = rollout_divergence(kl_map, source, target, first, N).mean()
    np.testing.assert_allclose(hist[0]["kl"], start, rtol=1e-4)
    assert abs(start - rollout_divergence(ridge, source, target, first, N).mean()) > 1e-4
    np.testing.assert_array_equal(rolled.keys[0].w_in, ridge.keys[0].w_in)  # the ridge stays frozen
    assert np.abs(np.asarray(rolled.values[0].up) - np.asarray(kl_map.values[0].up)).max() > 0
    # a fresh run's checkpoint is not resumed as a warm one, nor a warm one from another starting residual
    with pytest.raises(ValueError, match="differs in settings"):
        kvjax.train_residual(ridge, source, target, tokens, dataclasses.replace(warm, init_from=""),
                             workdir=str(tmp_path / "w"))
    kvjax.save_map(str(tmp_path / "kl2"), ridge_only(kl_map))
    with pytest.raises(ValueError, match="init_sha256"):
        kvjax.train_residual(ridge, source, target, tokens, dataclasses.replace(warm, init_from=str(tmp_path / "kl2")),
                             workdir=str(tmp_path / "w"))
    # a residual of another ridge fit, or a directory that holds no map, is refused
    other, _ = kvjax.fit_map(source, target, windows(16, 40, seed=5), windows(8, 40, seed=1), batch_size=8,
                             residual_rank=4)
    kvjax.save_map(str(tmp_path / "other"), other)
    with pytest.raises(ValueError, match="another ridge fit"):
        kvjax.train_residual(ridge, source, target, tokens,
                             dataclasses.replace(warm, init_from=str(tmp_path / "other")))
    with pytest.raises(ValueError, match="not a saved map"):
        kvjax.train_residual(ridge, source, target, tokens, dataclasses.replace(warm, init_from=str(tmp_path)))


def test_ema_is_the_moving_average_of_the_iterates_and_resumes_exactly(setup, tmp_path):
    source, target, ridge, _ = setup
    tokens = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.uint16)
    rc = ResidualConfig(steps=3, batch_size=2, prefix_len=P, cont_len=N, lr=1e-2, warmup_steps=1, save_every=1)
    live = [kvjax.train_residual(ridge, source, target, tokens, rc, workdir=str(tmp_path / "live"), stop_at=k)[0]
            for k in (1, 2, 3)]
    averaged = dataclasses.replace(rc, ema=0.6)
    got, hist = kvjax.train_residual(ridge, source, target, tokens, averaged, workdir=str(tmp_path / "a"))
    assert len(hist) == 3
    for kind in ("keys", "values"):
        for i, layer in enumerate(getattr(got, kind)):
            for name in ("down", "res_bias", "up"):
                want = np.asarray(getattr(getattr(ridge, kind)[i], name))
                for m in live:
                    want = 0.6 * want + 0.4 * np.asarray(getattr(getattr(m, kind)[i], name))
                np.testing.assert_allclose(getattr(layer, name), want, rtol=1e-5, atol=1e-7, err_msg=(kind, i, name))
            for name in ("mu", "scale", "w_in", "w_out", "bias"):  # the frozen part, bit-exact
                np.testing.assert_array_equal(getattr(layer, name), getattr(getattr(ridge, kind)[i], name))
    assert np.abs(np.asarray(got.values[0].up) - np.asarray(live[-1].values[0].up)).max() > 1e-6  # not the last one
    kvjax.train_residual(ridge, source, target, tokens, averaged, workdir=str(tmp_path / "b"), stop_at=2)
    resumed, _ = kvjax.train_residual(ridge, source, target, tokens, averaged, workdir=str(tmp_path / "b"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(resumed)):  # the average rides along in the checkpoint
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="differs in settings"):  # a last-iterate run is not resumed as an average
        kvjax.train_residual(ridge, source, target, tokens, averaged, workdir=str(tmp_path / "live"))

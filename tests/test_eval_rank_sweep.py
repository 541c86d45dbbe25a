"""Evaluation `rank_sweep`: reduced-rank ridge maps at ten ranks from one collection of statistics
(kvjax.fitting.rank_sweep), measured on held-out KL, reconstruction, attention similarity, map time and size."""

import dataclasses
import json

import numpy as np
import pytest

from maptools import tiny_pair, VOCAB
from kvjax.config_flags import build
from kvjax.eval.suite import rank_sweep as ev
from kvjax.eval.suite.evaluation import EvalContext, MetricsContext, ReportContext
from kvjax.run.config import RunConfig

# the tiny pair's features: source 2 KV heads x 16 = 32, target 1 x 16 = 16, so full rank is 16
TEN = (1, 2, 3, 4, 6, 8, 10, 12, 14, None)


def windows(n, t, seed):
    return np.random.RandomState(seed).randint(1, VOCAB, (n, t)).astype(np.int32)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def fitted(pair):
    """The run's ridge (fit_map, full rank) and the sweep's statistics of the same windows and pairing."""
    from kvjax.fitting.fit import fit_map
    from kvjax.fitting.rank_sweep import collect
    calib, select = windows(24, 48, 0), windows(8, 48, 1)
    kvmap, _ = fit_map(*pair, calib, select, batch_size=8, residual_rank=4)
    return calib, select, kvmap, collect(*pair, kvmap.spec.pairing, calib, select, batch_size=8)


def test_rank_grid_clips_to_the_pair_and_keeps_ten_points():
    from kvjax.fitting.rank_sweep import rank_grid
    assert rank_grid(ev.DEFAULT_RANKS, 128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, None]
    assert rank_grid(ev.DEFAULT_RANKS, 16) == [1, 2, 4, 8, None]  # 16 and above are full rank
    assert rank_grid((64, 8, 200), 32) == [8, None]
    with pytest.raises(ValueError, match=">= 1"):
        rank_grid((0, 4), 16)


def test_full_rank_is_the_runs_ridge_and_train_loss_falls_with_rank(pair, fitted):
    import jax.numpy as jnp
    from kvjax.fitting.rank_sweep import dense_weight, fit_rank, fit_ranks, padded, ridge_params
    from kvjax.mapper.kvmap import apply_map
    from kvjax.models.decoder import prefill_forward
    (scfg, sparams), (tcfg, _) = pair
    _, _, run_map, stats = fitted
    assert stats.max_rank == 16
    full = fit_rank(stats, scfg, tcfg, None)
    for got, want in zip((*full.kvmap.keys, *full.kvmap.values), (*run_map.keys, *run_map.values)):
        np.testing.assert_allclose(dense_weight(got), dense_weight(want), rtol=0, atol=1e-6)
        for name in ("mu", "bias", "scale"):
            np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), atol=1e-6)
    # truncating one full-rank solve per lambda is ridge.select at that rank (the same lambda, the same weights)
    from kvjax.mapper.ridge import select
    for k in (1, 5, 12):
        got = fit_rank(stats, scfg, tcfg, k)
        for t, ((tk, tv), (hk, hv)) in enumerate(zip(stats.train, stats.heldout)):
            for kind, tr, ho, m in (("key", tk, hk, got.kvmap.keys[t]), ("value", tv, hv, got.kvmap.values[t])):
                want, _ = select(tr, ho, rank=k)
                assert got.lambdas[t][kind == "value"] == want.lam
                np.testing.assert_allclose(dense_weight(m), want.weight, rtol=0, atol=1e-6 * np.abs(want.weight).max())
    # at one lambda the rank-k fits nest: the calibration (fitting) reconstruction error never rises with k,
    # and falls from rank 1 to full rank
    fits = fit_ranks(stats, scfg, tcfg, [*range(1, 16), None], lams=(1e-3,))
    train = np.array([np.mean(f.train_nmse) for f in fits])
    assert np.all(np.diff(train) <= 1e-9 * train[:-1]), train
    assert train[-1] < 0.9 * train[0]
    assert [f.effective_rank for f in fits] == [*range(1, 17)]
    # sizes: mu + w_in [Fx, k] + w_out [k, Fy] + bias, per target layer (2) and kind (2)
    assert [ridge_params(f.kvmap) for f in fits[:2]] == [4 * (32 + 32 * k + k * 16 + 16) for k in (1, 2)]
    # padding to full width changes no output
    tokens = jnp.asarray(windows(2, 16, 5))
    cache = prefill_forward(sparams, scfg, tokens, logits=None).cache
    a, b = apply_map(fits[2].kvmap, cache), apply_map(padded(fits[2].kvmap, 16), cache)
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5)


def test_the_evaluation_runs_ten_ranks(pair, fitted, tmp_path):
    from kvjax.fitting.residual import evaluate_kl
    from kvjax.mapper.kvmap import ridge_only
    calib, select, run_map, _ = fitted
    cfg = build("toy", [("output_dir", str(tmp_path))], RunConfig)
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "calib.npy", calib)
    np.save(tmp_path / "data" / "select.npy", select)
    skip = cfg.eval.distances.windows  # the KL rows come after the distance rows
    heldout = windows(skip + 6, 40, 3)
    ctx = EvalContext(cfg, source=pair[0], target=pair[1], map={"ridge": run_map}.__getitem__, fitted=("ridge",),
                      heldout=heldout, tokenizer=None)
    ec = ev.RankSweepEval(enabled=True, ranks=TEN, kl_windows=6, prefix_len=24, cont_len=16, attn_windows=3,
                          attn_window_len=32, batch_size=4, time_batch=2, time_repeats=3)
    assert ev.preflight(ec, cfg) == []
    record = json.loads(json.dumps(ev.run(ec, ctx)))  # the record is JSON
    assert [p["rank"] for p in record["points"]] == list(TEN)
    assert [p["effective_rank"] for p in record["points"]] == [*TEN[:-1], 16]
    assert record["full_vs_run_ridge"] < 1e-6
    assert record["calib_tokens"] == calib.size and record["kl_windows"] == 6
    full = record["points"][-1]
    want = evaluate_kl(ridge_only(run_map), *pair, heldout[skip : skip + 6, :40], 24, 4)
    np.testing.assert_allclose(full["kl"], want, rtol=1e-4)
    assert all(len(p["map_seconds"]) == 3 and min(p["map_seconds"]) > 0 for p in record["points"])
    assert full["attn_cos"] > record["points"][0]["attn_cos"]  # rank 1 of 16 loses most of the cache
    m = ev.metrics(record, MetricsContext(200, "ridge"))
    assert [p["rank"] for p in m["points"]] == list(TEN) and set(m["picks"]) == {"kl", "heldout_nmse", "attn_cos",
                                                                                  "kl_tied", "map_s"}
    path = ev.chart(m, str(tmp_path / "rank_sweep.png"), None)
    assert (tmp_path / "rank_sweep.png").stat().st_size > 1000 and path.endswith(".png")


def _record():
    """Four ranks by hand: KL lowest at 24 (but 8 within its interval), attention highest at 8, time climbing."""
    base = np.linspace(-0.01, 0.01, 8)
    swing = np.array([0.18, -0.18] * 4)  # rank 8's windows: alternately well above and below rank 24's
    kl = {4: 0.9, 8: 0.52, 24: 0.5, None: 0.51}
    attn = {4: 0.8, 8: 0.95, 24: 0.93, None: 0.92}
    pts = []
    for i, (k, eff) in enumerate(((4, 4), (8, 8), (24, 24), (None, 64))):
        pts.append({"rank": k, "effective_rank": eff, "kl": (kl[k] + base + (swing if k == 8 else 0)).tolist(),
                    "train_nmse": [[0.5 / eff, 0.4 / eff]], "heldout_nmse": [[0.3 + 1 / eff, 0.3 + 1 / eff]],
                    "lambdas": [[1e-3, 1e-3]], "key_cos": 0.9, "value_cos": 0.8, "attn_cos": attn[k],
                    "attn_cos_per_layer": [attn[k]], "map_seconds": [1e-3 * (i + 1), 1e-3 * (i + 1.2), 5.0],
                    "params": 100 * eff})
    return {"points": pts, "max_rank": 64, "pairing": [[0]], "calib_tokens": 1000, "heldout_tokens": 100,
            "kl_windows": 8, "prefix_len": 16, "cont_len": 8, "attn_windows": 2, "attn_window_len": 32,
            "time_batch": 2, "time_repeats": 3, "run_rank": None, "full_vs_run_ridge": 0.0}


def test_metrics_and_picks_of_a_hand_made_record():
    m = ev.metrics(_record(), MetricsContext(500, "ridge"))
    pk = m["picks"]
    assert [p["rank"] for p in m["points"]] == [4, 8, 24, None]
    assert (pk["kl"]["rank"], pk["attn_cos"]["rank"], pk["heldout_nmse"]["rank"], pk["map_s"]["rank"]) == \
        (24, 8, None, 4)
    assert pk["kl"]["value"] == pytest.approx(0.5) and pk["attn_cos"]["value"] == 0.95
    # time: the median of the repeats (the 5 s outlier ignored); size: float32 bytes
    assert pk["kl"]["map_s"] == pytest.approx(3.2e-3) and pk["attn_cos"]["map_s"] == pytest.approx(2.2e-3)
    assert pk["kl"]["bytes"] == 4 * 2400 and m["points"][0]["bytes"] == 1600
    # rank 8's KL is 0.02 above 24's with a spread that puts zero in its paired interval; ranks 4 and full are
    # above it on every window
    assert m["points"][0]["kl_minus_best_ci95"][0] > 0 and m["points"][3]["kl_minus_best_ci95"][0] > 0
    lo, hi = m["points"][1]["kl_minus_best_ci95"]
    assert lo < 0 < hi
    assert pk["kl_tied"]["rank"] == 8
    lo, hi = m["points"][2]["kl_ci95"]
    assert lo < 0.5 < hi and m["points"][2]["kl_minus_best_ci95"] == [0.0, 0.0]
    assert m["points"][3]["heldout_nmse"] == pytest.approx(0.3 + 1 / 64)
    assert m["points"][1]["train_nmse"] == pytest.approx(0.45 / 8)
    ctx = ReportContext(metrics={}, charts={"rank_sweep": "rank_sweep.png"}, final="ridge", source="S", target="T")
    text = "\n".join(ev.report(m, ctx))
    assert "| 24 | 0.5000 [" in text and "| full | 0.5100 [" in text and "![rank sweep](rank_sweep.png)" in text
    assert "- held-out KL (argmin kl): k=24, 0.5000; map 3.200 ms, 9.6 KB" in text
    assert "- attention similarity (argmax attn_cos): k=8, 0.9500; map 2.200 ms" in text
    assert "smallest rank whose KL is within the KL pick's paired 95% CI: k=8" in text
    summary = ev.summary(m, ctx)[0]
    assert "held-out KL picks k=24" in summary and "attention similarity k=8" in summary


def test_registered_off_by_default_after_distances(tmp_path):
    from kvjax.eval import suite
    from kvjax.job.stages import plan
    names = list(suite.NAMES)
    assert names.index("rank_sweep") == names.index("distances") + 1 and suite.BY_NAME["rank_sweep"].section == 32
    cfg = build("toy", [("output_dir", str(tmp_path))], RunConfig)
    assert cfg.eval.rank_sweep == ev.RankSweepEval() and not cfg.eval.rank_sweep.enabled
    assert "rank_sweep" not in plan(cfg)
    on = build("toy", [("output_dir", str(tmp_path)), ("eval.rank_sweep.enabled", "true"),
                       ("eval.rank_sweep.ranks", "1,4,none")], RunConfig)
    assert on.eval.rank_sweep.ranks == (1, 4, None)
    stage = plan(on)["rank_sweep"]
    assert stage.settings["skip_rows"] == on.eval.distances.windows
    rows, length, names = suite.heldout_needed(on)
    assert "rank_sweep" in names and rows >= on.eval.distances.windows + on.eval.rank_sweep.kl_windows
    bad = dataclasses.replace(on.eval.rank_sweep, ranks=(0,), time_repeats=0)
    assert ev.preflight(bad, on) == ["eval.rank_sweep.time_repeats must be >= 1, got 0",
                                     "eval.rank_sweep.ranks must be ranks >= 1 or none (full rank), got (0,)"]

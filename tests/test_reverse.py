"""Small reads, large answers: the map fitted from a reader with fewer, narrower layers into a deeper, wider
answerer; the residual trained on the answerer's own predictions; the main job in that direction end to end on tiny
random checkpoints (native_kl and ttft evaluations, the repaired arm); the forward default job unchanged."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

import kvjax
from kvjax import config_flags
from kvjax.job.stages import plan
from kvjax.builders import Mapped, NativePrefill, PartialRecompute
from kvjax.mapper.injection import injection_map
from kvjax.fitting.residual_config import ADDED_LATER
from kvjax.run.config import RunConfig
from test_launch import REPO, TOKENIZER, lookup, run_job, write_mc_sets


def make(root, name, hidden, layers, heads, kv, hd, seed):
    cfg = kvjax.Qwen3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                            num_heads=heads, num_kv_heads=kv, head_dim=hd, rope_theta=10_000.0,
                            tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
    path = os.path.join(root, name)
    kvjax.save_hf(path, cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1), tokenizer_dir=TOKENIZER)
    return path


@pytest.fixture(scope="module")
def reverse_pair(tmp_path_factory):
    """(small reader, large answerer): the reader has fewer layers, fewer KV heads and a narrower residual stream."""
    root = str(tmp_path_factory.mktemp("reverse_pair"))
    return make(root, "small", 16, 2, 2, 1, 16, 1), make(root, "large", 32, 4, 4, 2, 16, 0)


@pytest.fixture(scope="module")
def models(reverse_pair):
    return kvjax.load_hf(reverse_pair[0]), kvjax.load_hf(reverse_pair[1])


@pytest.fixture(scope="module")
def windows():
    flat = np.load(os.path.join(REPO, "checkpoints", "toy", "eval", "heldout_windows.npy"))[:8].reshape(-1)
    return flat[: 24 * 48].reshape(24, 48).astype(np.int32)


def test_reverse_map_fits_applies_and_round_trips(models, windows, tmp_path):
    small, large = models
    kvmap, report = kvjax.fit_map(small, large, windows[:16], windows[16:], residual_rank=4, batch_size=8)
    # every answerer layer has a reader layer, the reader's two layers spread over the answerer's four by depth
    assert report["pairing"] == [[0], [0], [1], [1]]
    assert all(np.isfinite(r["key"]["heldout_r2"]) and np.isfinite(r["value"]["heldout_r2"]) for r in report["layers"])
    kvjax.save_map(str(tmp_path / "map"), kvmap, info={"direction": "reverse"})
    loaded = kvjax.load_map(str(tmp_path / "map"), small[0], large[0])
    tokens, lengths = windows[:3, :40], np.array([40, 25, 7], np.int32)
    cache = Mapped(small, large, loaded)(tokens, lengths, capacity=64)
    native = NativePrefill(large)(tokens, lengths, capacity=64)
    assert cache.k.shape == native.k.shape == (4, 3, 2, 64, 16) and cache.lengths.tolist() == [40, 25, 7]
    np.testing.assert_array_equal(np.asarray(cache.k), np.asarray(Mapped(small, large, kvmap)(
        tokens, lengths, capacity=64).k))
    # the fitted map is closer to the answerer's own cache than the reader's layers reused as they are
    direct = Mapped(small, large, injection_map(small[0], large[0]))(tokens, lengths, capacity=64)
    err = lambda c: float(np.mean((np.asarray(c.v)[:, 0, :, :40] - np.asarray(native.v)[:, 0, :, :40]) ** 2))  # noqa
    assert err(cache) < err(direct)
    # the repair recomputes answerer layers natively: all of them is the answerer's own prefill, bottom 1 its layer 0
    full = PartialRecompute(small, large, kvmap, 4)(tokens, lengths, capacity=64)
    np.testing.assert_allclose(np.asarray(full.k), np.asarray(native.k), atol=1e-5)
    one = PartialRecompute(small, large, kvmap, 1)(tokens, lengths, capacity=64)
    np.testing.assert_allclose(np.asarray(one.k[0, 0, :, :40]), np.asarray(native.k[0, 0, :, :40]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(one.k[1:]), np.asarray(cache.k[1:]))


def test_residual_learns_the_answerers_own_predictions(models, windows):
    """teacher="target": the student is pulled towards the answerer after its own prefill, not towards the reader."""
    import jax.numpy as jnp

    from kvjax.builders import NativePrefill
    from kvjax.mapper.kl import kl
    from kvjax.fitting.residual import position_kl, student_logits, window_kl
    from kvjax.models.decoder import forward
    small, large = models
    kvmap, _ = kvjax.fit_map(small, large, windows[:16], windows[16:], residual_rank=4, batch_size=8)
    tokens = jnp.asarray(windows[:4, :32])
    got = position_kl(kvmap, small, large, tokens, 24, teacher="target")
    native = forward(large[1], large[0], tokens[:, :-1]).logits[:, 23:]
    student = student_logits(kvmap, large, NativePrefill(small)(tokens[:, :23], capacity=23), tokens, 24)
    np.testing.assert_allclose(np.asarray(got), np.asarray(kl(native, student)), rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(got), np.asarray(position_kl(kvmap, small, large, tokens, 24)))
    # one small step down the residual's gradient of that loss lowers it (the residual output `up` starts at zero)
    loss = lambda m: window_kl(m, small, large, tokens, 24, "target").mean()  # noqa: E731
    grads = jax.grad(loss)(kvmap)
    norm = np.sqrt(sum(float(jnp.sum(g.up ** 2)) for g in (*grads.keys, *grads.values)))
    assert norm > 0
    step = lambda layers, gs: tuple(m.replace(up=m.up - 1e-2 * g.up / norm) for m, g in zip(layers, gs))  # noqa
    moved = kvmap.replace(keys=step(kvmap.keys, grads.keys), values=step(kvmap.values, grads.values))
    assert float(loss(moved)) < float(loss(kvmap))


def test_forward_default_job_is_unchanged():
    """The default (toy) job plans the same stages with the same residual settings as before these evaluations and
    the teacher setting existed (hashes of existing run directories still match)."""
    cfg = config_flags.build("toy", [], RunConfig)
    stages = plan(dataclasses.replace(cfg, source=dataclasses.replace(cfg.source, path=os.path.join(
        REPO, cfg.source.path)), target=dataclasses.replace(cfg.target, path=os.path.join(REPO, cfg.target.path))))
    assert list(stages) == ["calibrate", "ridge", "residual", "distances", "kl", "agreement", "mc", "retrieval",
                            "throughput", "report"]
    assert stages["residual"].settings == {"residual": {k: v for k, v in dataclasses.asdict(cfg.residual).items()
                                                        if k not in ADDED_LATER}}
    assert not cfg.eval.native_kl.enabled and not cfg.eval.ttft.enabled
    rev = config_flags.build("toy_reverse", [], RunConfig)
    assert rev.residual.teacher == "target" and rev.eval.native_kl.enabled and rev.eval.ttft.enabled
    assert "teacher" in plan(dataclasses.replace(rev, source=dataclasses.replace(
        rev.source, path=os.path.join(REPO, rev.source.path)), target=dataclasses.replace(
        rev.target, path=os.path.join(REPO, rev.target.path))))["residual"].settings["residual"]


TINY = [
    "--config.data.max_train_tokens=6000", "--config.data.max_heldout_tokens=3000",
    "--config.data.heldout_window_len=80",
    "--config.map.calib_windows=6", "--config.map.select_windows=4", "--config.map.window_len=48",
    "--config.map.batch_size=4", "--config.map.residual_rank=4",
    "--config.residual.steps=2", "--config.residual.batch_size=2", "--config.residual.prefix_len=24",
    "--config.residual.cont_len=8", "--config.residual.warmup_steps=1", "--config.residual.save_every=2",
    "--config.eval.distances.enabled=false",
    "--config.eval.native_kl.windows=4", "--config.eval.native_kl.prefix_len=24",
    "--config.eval.native_kl.cont_len=8", "--config.eval.native_kl.batch_size=4",
    "--config.eval.mc.limit=3", "--config.eval.mc.arms=target,residual,partial,tail",
    "--config.eval.retrieval.enabled=false",
    "--config.eval.ttft.lengths=32,64", "--config.eval.ttft.repeats=1", "--config.eval.bootstrap=200",
    "--config.eval.speculative.lengths=40", "--config.eval.speculative.new_tokens=6",
    "--config.eval.speculative.repeats=1", "--config.eval.speculative.draft_lens=2",
    "--config.arms.partial_k=1",  # the tiny answerer has 4 layers: the config's 4 would recompute them all
    "--config.eval.ttft.tail=true", "--config.arms.tail_tokens=8",
]


def test_reverse_job_end_to_end(reverse_pair, tmp_path):
    out = str(tmp_path / "run")
    argv = ["--config=toy_reverse", f"--config.output_dir={out}", f"--config.source.path={reverse_pair[0]}",
            f"--config.target.path={reverse_pair[1]}", *TINY, *write_mc_sets(str(tmp_path))]
    assert run_job(argv) == 0
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    assert "kl" not in metrics and metrics["run"]["source"]["layers"] == 2 and metrics["run"]["target"]["layers"] == 4
    nk = metrics["native_kl"]
    assert set(nk["kl"]) == {"direct", "ridge", "residual", "partial", "tail", "partial_tail"}
    assert nk["final"] == "residual"
    for arm in ("ridge", "residual", "partial"):
        lo, hi = nk["minus_direct"][arm]["ci95"]
        assert lo <= nk["minus_direct"][arm]["mean"] <= hi
    assert all(v >= 0 for v in nk["kl"].values()) and all(0 <= v <= 1 for v in nk["agreement"].values())
    assert len(nk["per_window"]["residual"]) == 4 and nk["partial_minus_final"]["ci95"][0] <= \
        nk["partial_minus_final"]["ci95"][1]
    tt = metrics["ttft"]
    assert set(tt["lengths"]) == {"32", "64"} and tt["repair"] == {"k": 1, "mode": "bottom"}
    assert tt["tail_tokens"] == 8
    for row in tt["lengths"].values():
        assert set(row["ttft_s"]) == {"target", "mapped", "partial", "tail", "partial_tail"}
        assert all(v > 0 for v in row["ttft_s"].values())
        lo, mid, hi = row["speedup_rounds"]["mapped"]
        assert lo <= mid <= hi and row["speedup"]["mapped"] > 0
        assert set(row["phases_s"]["mapped"]) == {"source_prefill", "map", "first_token"}
        assert set(row["phases_s"]["partial"]) == {"source_prefill", "map", "recompute", "first_token"}
        assert set(row["phases_s"]["tail"]) == {"source_prefill", "map", "tail", "first_token"}
        assert set(row["phases_s"]["partial_tail"]) == {"source_prefill", "map", "recompute", "tail", "first_token"}
    sp = metrics["speculative"]["lengths"]["40"]
    assert set(sp) == {"native", "plain@2", "transfer@2", "repaired@2", "tail@2", "lookup@2"}
    for arm in ("plain@2", "lookup@2"):  # lossless: drafting for the verifier's own cache gives its greedy output
        assert sp[arm]["matches_native"] == 1.0
    for arm in ("plain@2", "transfer@2", "repaired@2", "tail@2", "lookup@2"):
        assert 1 <= sp[arm]["acceptance_length"] <= 3 and sp[arm]["latency_s"] > 0 and sp[arm]["decode_tps"] > 0
        assert 0 <= sp[arm]["prefix_match"] <= 1 and sp[arm]["latency_vs_native"] > 0
    assert set(sp["transfer@2"]["phases_s"]) >= {"prefill", "map", "decode"}
    assert sp["tail@2"]["phases_s"]["tail"] > 0 and sp["tail@2"]["phases_s"]["repair"] > 0
    assert sp["transfer@2"]["phases_s"]["tail"] == 0 and metrics["speculative"]["tail_tokens"] == 8
    for path in ("mc.hellaswag.acc.partial", "mc.piqa.acc.tail", "mc.piqa.delta_vs_target.residual.ci95",
                 "mc.piqa.acc.target"):
        assert lookup(metrics, path)
    report = open(os.path.join(out, "report.md")).read()
    for heading in ("## Time to first token", "## Cache quality: the answerer's KL", "![native KL](native_kl.png)",
                    "![time to first token](ttft_reverse.png)", "## Quality: multiple choice"):
        assert heading in report
    assert "## Speculative decoding" in report and "lookup@G = " in report and "tail@G = the same repaired" in report
    assert "quality of the partial_tail cache" in report
    for chart in ("native_kl.png", "ttft_reverse.png", "speculative.png"):
        assert os.path.getsize(os.path.join(out, chart)) > 0

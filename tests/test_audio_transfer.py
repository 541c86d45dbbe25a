"""Audio cache transfer: the audio builders, the audio map's training, the evaluation's statistics and report, and the
shipped toy adapters."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.builders import Mapped
from kvjax.builders.audio_prefill import AudioPrefill
from kvjax.generation import generate_from
from kvjax.mapper.kvmap import apply_map
from kvjax.models.audio_lm import AudioLM, ProjectorConfig, audio_token_count, init_projector, prefill_audio
from kvjax.hf.ultravox import load_ultravox, save_ultravox
from kvjax.models.decoder import prefill_jit
from kvjax.models.model import Model
from kvjax.models.whisper import WhisperEncoderConfig, init_encoder
from maptools import VOCAB, tiny_pair

PLACEHOLDER = 5
OPEN, CLOSE = 1, 2


@pytest.fixture(scope="module")
def setup():
    source, target = tiny_pair()
    ecfg = WhisperEncoderConfig(num_mel_bins=16, d_model=32, num_layers=1, num_heads=2, ffn_dim=64,
                                max_source_positions=64)
    alm = AudioLM(init_encoder(ecfg, jax.random.key(3), std=0.2),
                  init_projector(ProjectorConfig(32, source[0].hidden_size, hidden_size=64, stack_factor=2,
                                                 ln_mid=True), jax.random.key(4)),
                  Model(*source), PLACEHOLDER)
    windows = np.random.RandomState(0).randint(6, VOCAB, (8, 32)).astype(np.int32)
    kvmap = kvjax.fit_map(source, target, windows, windows[:4], batch_size=8, residual_rank=4)[0]
    return source, target, alm, kvmap


def clips(n, seed=0, frames=(40, 23, 31)):
    rng = np.random.RandomState(seed)
    f = np.zeros((n, 16, 48), np.float32)
    fr = np.asarray(frames[:n], np.int32)
    for i in range(n):
        f[i, :, :fr[i]] = rng.randn(16, fr[i])
    return f, fr


def prompts(frames, stack=2, text=(7, 8, 9)):
    """[OPEN][audio][CLOSE][text...] per clip, right-padded; (tokens, lengths)."""
    rows = [[OPEN] + [PLACEHOLDER] * int(audio_token_count(int(f), stack)) + [CLOSE] + list(text) for f in frames]
    t = max(map(len, rows))
    out = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, np.asarray([len(r) for r in rows], np.int32)


def test_audio_prefill_is_the_audio_language_prefill_and_reads_text_alone(setup):
    source, _, alm, _ = setup
    f, fr = clips(3)
    tokens, lengths = prompts(fr)
    b = AudioPrefill(alm).set_audio(f, fr)
    got = b(tokens, lengths, capacity=64)
    _, want = prefill_audio(alm, tokens, f, fr, lengths=lengths, capacity=64)
    np.testing.assert_array_equal(np.asarray(got.lengths), lengths)
    for r in range(3):
        np.testing.assert_allclose(np.asarray(got.k[:, r, :, :lengths[r]]), np.asarray(want.k[:, r, :, :lengths[r]]),
                                   rtol=0, atol=0)
    assert b(tokens, lengths, capacity=64) is got  # the same batch and clips: listened once
    b.set_audio(*clips(3, seed=1))
    assert b(tokens, lengths, capacity=64) is not got  # other clips: listens again
    text = np.asarray([[OPEN, 7, 8, 9, 10]], np.int32)  # no placeholder: the plain prefill (to float32 rounding)
    plain = prefill_jit(source[1], source[0], jnp.asarray(text), jnp.asarray([5]), capacity=64, logits=None).cache
    np.testing.assert_allclose(np.asarray(b.set_audio(None, None)(text, capacity=64).k), np.asarray(plain.k),
                               atol=1e-6)


def test_audio_errors_say_what_to_do(setup):
    _, _, alm, _ = setup
    with pytest.raises(ValueError, match="audio_token_index"):
        AudioPrefill(alm.replace(audio_token_index=None))
    f, fr = clips(2)
    tokens, lengths = prompts(fr)
    with pytest.raises(ValueError, match="audio positions but the clips"):  # clips that do not match the prompt
        AudioPrefill(alm).set_audio(*clips(2, frames=(12, 12)))(tokens, lengths)


def test_mapped_audio_cache_reaches_a_text_only_answerer_through_the_unchanged_builders(setup):
    source, target, alm, kvmap = setup
    f, fr = clips(3)
    tokens, lengths = prompts(fr)
    listen = AudioPrefill(alm).set_audio(f, fr)
    mapped = Mapped(source, target, kvmap, shared=listen)
    got = mapped(tokens, lengths, capacity=64)
    want = apply_map(kvmap, listen(tokens, lengths, capacity=tokens.shape[1]), capacity=64, length=tokens.shape[1])
    np.testing.assert_allclose(np.asarray(got.k), np.asarray(want.k), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got.lengths), lengths)
    # generation takes it unchanged: greedy tokens from the mapped audio cache equal a hand-made decode
    listen.set_audio(f[:1], fr[:1])
    out = np.asarray(generate_from(mapped, [list(tokens[0, :lengths[0]])], 4, eos_token_ids=()))
    cache = apply_map(kvmap, listen(tokens[:1, :lengths[0] - 1], capacity=lengths[0] - 1), capacity=32,
                      length=lengths[0] - 1)  # the listened cache may be the builder's, of a larger capacity
    tcfg, tparams = target
    seq = [int(tokens[0, lengths[0] - 1])]
    for _ in range(4):
        logits, cache = kvjax.models.decoder.decode(tparams, tcfg, jnp.asarray([seq[-1]]), cache)
        seq.append(int(jnp.argmax(logits[0])))
    assert out[0].tolist() == seq[1:]


def test_audio_map_trains_only_the_residual_and_lowers_held_out_kl(setup):
    from kvjax.fitting.audio_map import audio_pool, pool_kl, prompt_rows, train_audio_map
    source, target, alm, kvmap = setup
    f, fr = clips(3)
    f, fr = np.concatenate([f] * 4), np.concatenate([fr] * 4)
    rows, lengths = prompt_rows(audio_token_count(fr.astype(np.int64), 2), OPEN, PLACEHOLDER, [CLOSE])
    texts = np.random.RandomState(2).randint(6, VOCAB, (len(fr), 6)).astype(np.int32)
    pool = audio_pool(alm, rows, lengths, texts, f, fr, batch_size=4)
    before = pool_kl(kvmap, target, pool)
    trained, losses = train_audio_map(kvmap, target, pool, steps=30, lr=1e-2, progress=False)
    after = pool_kl(trained, target, pool)
    assert after < 0.8 * before, (before, after)
    assert len(losses) == 30
    for a, b in zip(kvmap.keys, trained.keys):
        np.testing.assert_array_equal(np.asarray(a.w_in), np.asarray(b.w_in))  # the ridge is frozen
        np.testing.assert_array_equal(np.asarray(a.mu), np.asarray(b.mu))
    assert any(not np.array_equal(np.asarray(a.up), np.asarray(b.up)) for a, b in zip(kvmap.keys, trained.keys))


def test_transcript_teacher_is_the_source_reading_and_the_map_learns_it_judged_by_true_text_nll(setup):
    from kvjax.fitting.audio_map import (audio_pool, pool_kl, pool_nll, prompt_rows, teacher_nll, train_audio_map,
                                         transcript_teacher)
    source, target, alm, kvmap = setup
    f, fr = clips(3)
    f, fr = np.concatenate([f] * 4), np.concatenate([fr] * 4)
    rows, lengths = prompt_rows(audio_token_count(fr.astype(np.int64), 2), OPEN, PLACEHOLDER, [CLOSE])
    rng = np.random.RandomState(4)
    texts = rng.randint(6, VOCAB, (len(fr), 5)).astype(np.int32)
    words = [list(rng.randint(6, VOCAB, 2 + c)) for c in range(3)]  # each clip's transcript, ragged
    said = [[OPEN] + words[i % 3] + [CLOSE] for i in range(len(fr))]
    said_rows = np.zeros((len(said), max(map(len, said))), np.int32)
    for i, r in enumerate(said):
        said_rows[i, :len(r)] = r
    said_lengths = np.asarray([len(r) for r in said], np.int32)
    teacher = transcript_teacher(source, said_rows, said_lengths, texts, batch_size=4)
    assert [t.shape for t in teacher] == [(4, 5, VOCAB)] * 3
    cfg, params = source  # by hand: row 5 alone, its logits predicting each text token
    row = np.asarray([said[5] + list(texts[5])], np.int32)
    full = prefill_jit(params, cfg, jnp.asarray(row), jnp.asarray([row.shape[1]]), logits="all").logits[0]
    np.testing.assert_allclose(teacher[1][1], np.asarray(full[len(said[5]) - 1:-1]), atol=1e-4)
    pool = audio_pool(alm, rows, lengths, texts, f, fr, batch_size=4)
    # the true-text NLL, by hand for the first batch: the answerer reads [last prompt token][text] after the cache
    mapped = apply_map(kvmap, pool.caches[0], capacity=pool.caches[0].capacity)
    logits = kvjax.models.decoder.forward(target[1], target[0], jnp.asarray(pool.text[0][:, :-1]), mapped).logits
    logp = jax.nn.log_softmax(logits, -1)
    nll0 = -float(jnp.take_along_axis(logp, jnp.asarray(pool.text[0][:, 1:, None]), -1).mean())
    one = pool._replace(caches=pool.caches[:1], teacher=pool.teacher[:1], text=pool.text[:1])
    assert pool_nll(kvmap, target, one) == pytest.approx(nll0, rel=1e-4)
    # the teacher's own NLL of the true text (the ends the map sits between), by hand for the first batch
    tl = jax.nn.log_softmax(jnp.asarray(pool.teacher[0]), -1)
    want = -float(jnp.take_along_axis(tl, jnp.asarray(pool.text[0][:, 1:, None]), -1).mean())
    assert teacher_nll(one) == pytest.approx(want, rel=1e-5)
    taught = pool._replace(teacher=teacher)
    before = pool_kl(kvmap, target, taught)
    trained, _ = train_audio_map(kvmap, target, taught, steps=30, lr=1e-2, progress=False)
    assert pool_kl(trained, target, taught) < 0.8 * before  # it learns the reading source's predictions


def test_a_widened_residual_maps_exactly_as_before_and_refuses_a_narrower_rank(setup):
    from kvjax.mapper.kvmap import widen_residual
    source, target, alm, kvmap = setup
    f, fr = clips(3)
    tokens, lengths = prompts(fr)
    cache = AudioPrefill(alm).set_audio(f, fr)(tokens, lengths, capacity=32)
    trained = kvmap.replace(keys=tuple(m.replace(up=m.up + 0.1) for m in kvmap.keys))  # a residual that does work
    wide = widen_residual(trained, 12, jax.random.key(0))
    assert wide.spec.residual_rank == 12 and wide.keys[0].down.shape[1] == 12 and wide.values[1].up.shape[0] == 12
    a, b = apply_map(trained, cache, capacity=32), apply_map(wide, cache, capacity=32)
    np.testing.assert_allclose(np.asarray(b.k), np.asarray(a.k), atol=1e-5)
    np.testing.assert_allclose(np.asarray(b.v), np.asarray(a.v), atol=1e-5)
    with pytest.raises(ValueError, match="below the map's residual rank"):
        widen_residual(kvmap, 2, jax.random.key(0))


def test_save_ultravox_round_trips(setup, tmp_path):
    _, _, alm, _ = setup
    save_ultravox(str(tmp_path / "adapter"), alm.encoder, alm.projector, text_model_id="lm", audio_token_index=5,
                  vocab_size=VOCAB)
    back = load_ultravox(str(tmp_path / "adapter"), lm=alm.lm)
    assert back.audio_token_index == 5 and back.projector.cfg == alm.projector.cfg
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(alm)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not os.path.exists(str(tmp_path / "adapter") + ".partial")


def record(acc_by_arm, n=200, seed=0):
    """A synthetic eval record: per arm, items answered correctly with the given probability."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    arms = {}
    for arm, p in acc_by_arm.items():
        right = rng.random(n) < p
        lp = rng.normal(-5, 0.1, (n, 4))
        lp[np.arange(n), labels] = np.where(right, 0.0, -10.0)
        arms[arm] = {"logprobs": lp.tolist(), "n_tokens": np.full((n, 4), 3).tolist()}
    for who in ("source", "target"):
        arms[f"null_{who}"] = {"logprobs": np.zeros((n, 4)).tolist(), "n_tokens": np.full((n, 4), 3).tolist()}
    speed = {a: {"phases_s": {"decode": 0.1}, "ttft_s": 0.01, "decode_tok_s": 640.0} for a in
             ("mapped_audio", "target_audio")}
    return {"arms": arms, "labels": labels.tolist(), "items": n,
            "map": {"kl_text_map": 0.5, "kl_audio_map": 0.3, "steps": 10, "clips": 100, "valid_clips": 10,
                    "nll_text_map": 5.1, "nll_audio_map": 4.9, "nll_source_audio": 4.7, "nll_target_audio": 5.0,
                    "loss": [1.0], "seconds": 1.0},
            "speed": {**speed, "tokens": 64, "rounds": 3}}


def test_metrics_report_and_gate_state_the_seeds_claims():
    from kvjax.eval.suite import audio
    from kvjax.eval.suite.evaluation import MetricsContext, ReportContext
    from kvjax.eval.gate import GateConfig
    ev = record({"target_audio": 0.3, "mapped_audio": 0.5, "source_audio": 0.6, "text_map_audio": 0.4,
                 "source_text": 0.7, "target_text": 0.45, "mapped_text": 0.6})
    m = audio.metrics(ev, MetricsContext(n_boot=2000, final="residual"))
    acc = m["accuracy"]
    assert m["mapped_minus_target_audio"] == pytest.approx(acc["mapped_audio"] - acc["target_audio"])
    assert m["mapped_minus_target_audio_ci95"][0] > 0 and m["mapped_minus_target_audio_p"] < 0.01
    assert m["gap_recovered"] == pytest.approx((acc["mapped_audio"] - acc["target_audio"])
                                               / (acc["source_audio"] - acc["target_audio"]))
    assert m["source_margin_kept"] == pytest.approx((acc["source_audio"] - 0.25) / (acc["source_text"] - 0.25))
    assert m["speed"]["decode_ratio"] == pytest.approx(1.0)
    # the same claims with no audio: the text map on the source reading the transcript against the answerer reading it
    assert m["text_gap_recovered"] == pytest.approx((acc["mapped_text"] - acc["target_text"])
                                                    / (acc["source_text"] - acc["target_text"]))
    assert m["text_mapped_minus_target_ci95"][0] > 0
    ctx = ReportContext(metrics={"audio": m}, charts={}, final="residual", source="S", target="T")
    text = "\n".join(audio.report(m, ctx) + audio.summary(m, ctx))
    assert "of the gap recovered" in text and "p = " in text and "text map" in text
    assert f"{100 * m['text_gap_recovered']:.1f}% of that gap recovered" in text
    assert "the audio map 4.900, the source listening 4.700, 33.3% of the way" in text  # (5.0 - 4.9) / (5.0 - 4.7)
    gate = GateConfig(min_audio_gain_ci_lo=0.0, min_audio_gap_recovered=0.5, min_audio_margin_kept=0.7,
                      min_audio_decode_ratio=0.97)
    checks = {c.name: c for c in audio.gate(m, gate, "residual")}
    assert checks["audio_gain_ci_lo"].passed and checks["audio_decode_ratio"].passed
    assert checks["audio_margin_kept"].value == pytest.approx(m["source_margin_kept"])
    # the same arms, but the mapped cache no better than the answerer's own audio path: the gate says so
    worse = audio.metrics(record({"target_audio": 0.4, "mapped_audio": 0.4, "source_audio": 0.6, "source_text": 0.7,
                                  "target_text": 0.45}, seed=1), MetricsContext(n_boot=2000, final="residual"))
    checks = {c.name: c for c in audio.gate(worse, gate, "residual")}
    assert checks["audio_gain_ci_lo"].passed is False and checks["audio_gap_recovered"].passed is False
    # a source no better than the answerer's own audio path: no gap, so its share is not measured (not a number)
    even = audio.metrics(record({"target_audio": 0.3, "mapped_audio": 0.3, "source_audio": 0.3, "source_text": 0.7,
                                 "target_text": 0.45}, seed=2), MetricsContext(n_boot=2000, final="residual"))
    assert even["gap_recovered"] is None and even["source_lead_ci95"][0] <= 0
    assert not {c.name: c for c in audio.gate(even, gate, "residual")}["audio_gap_recovered"].measured
    assert "no gap to recover" in "\n".join(audio.summary(even, ctx))


def test_sign_flip_p_value():
    from kvjax.eval.audio_transfer import sign_flip_p
    assert sign_flip_p(np.zeros(50)) == 1.0
    assert sign_flip_p(np.ones(30)) < 1e-3
    d = np.random.default_rng(0).choice([-1.0, 0.0, 1.0], 400)
    assert sign_flip_p(d) > 0.05  # no effect: not significant


TOY = "checkpoints/toy/audio"


@pytest.mark.skipif(not os.path.isfile(f"{TOY}/source/config.json"), reason="the toy audio adapters are not built")
def test_the_shipped_toy_adapters_and_sealed_set_load_and_listen():
    from kvjax.eval import audio_transfer as A
    from kvjax.eval.suite.audio import AudioEval, load_adapter
    ec = AudioEval()
    meta = json.load(open(f"{TOY}/test/meta.json"))
    train = json.load(open(f"{TOY}/map_train/meta.json"))
    assert meta["split"] == "heldout docs" and train["split"] == "train docs"  # sealed items: held-out documents
    sealed = {json.loads(x)["file"] for x in open(f"{TOY}/test/items.jsonl")}
    trained = {json.loads(x)["file"] for x in open(f"{TOY}/map_train/items.jsonl")}
    assert not sealed & trained
    src = kvjax.load_hf("checkpoints/toy/source")
    alm = load_adapter(ec.source_adapter, (src.cfg, src.params), ec.placeholder)
    assert alm.audio_token_index == 100  # the toy's <|audio|> (launch/toy/speech_train.py AUDIO_TOKEN)
    items = A.load_spoken(ec.test, limit=4)
    assert len(items) == 4 and items[0].features.shape[0] == alm.encoder.cfg.num_mel_bins
    feats, frames = A.pad_features([it.features for it in items])
    listen = AudioPrefill(alm).set_audio(feats, frames)
    tok = kvjax.load_tokenizer("checkpoints/toy/tokenizer")
    p = A.Prompts(ec.open_id, tuple(tok.encode(ec.close, add_special_tokens=False).ids), alm.audio_token_index)
    res = A.score_spoken(items, tok, {"source_audio": (listen, "audio")}, p, alm.stack_factor, [listen],
                         batch_size=4, progress=False)
    lp = res["source_audio"]["logprobs"]
    assert lp.shape == (4, 4) and np.isfinite(lp).all() and (lp < 0).all()
    # the shipped audio map: toy_audio's, made for this pair, and trained on none of the clips the job holds out
    from configs import toy_audio
    from kvjax.mapper.artifact import load_map, read_manifest
    ac = toy_audio.get_config().eval.audio
    assert ac.map_from == f"{TOY}/map"
    tgt = kvjax.load_hf("checkpoints/toy/pruned")
    audio_map = load_map(ac.map_from, src.cfg, tgt.cfg)  # refuses a map fitted for other models
    info = read_manifest(ac.map_from)["info"]
    assert info["held_out"] >= ac.map_valid and audio_map.spec.residual_rank == info["residual_rank"]
    assert info["kl_audio_map"] < info["kl_text_map"]


# ---- ultravox8_1 / ultravox70_8 on tiny random checkpoints ---------------------------------------------------------

def write_spoken_set(path, n, mel_bins, seed, kind):
    """A tiny spoken set in launch/toy/speech.py's layout: random features, prose from a fixed list."""
    from launch.toy.speech import save_set
    rng = np.random.default_rng(seed)
    words = "the module reads a file and returns the list of names it found in order".split()
    frames = rng.integers(20, 44, n).astype(np.int32)
    feats = rng.integers(40, 200, (mel_bins, int(frames.sum()))).astype(np.uint8)
    items = []
    for i in range(n):
        ctx = " ".join(rng.choice(words, 6))
        endings = [" " + " ".join(rng.choice(words, 5)) for _ in range(4)]
        items.append({"file": f"{kind}/{i}", "context": ctx, "continuation": endings[0], "endings": endings,
                      "label": int(i % 4)})
    save_set(path, items, feats, frames, {"split": kind})


@pytest.mark.slow  # a whole main job (every stage, tiny sizes)
def test_ultravox8_1_runs_end_to_end_on_an_identity_pair(tmp_path):
    """The job with one tiny Llama as reader and answerer and one tiny Ultravox adapter as both audio paths: every
    number is known. The source listening and the answerer's own audio path are the same computation, direct
    injection copies the answerer's own audio cache, the text arms agree, and the maps (identity ridge, a residual
    a few steps from zero) move nothing."""
    from pathlib import Path

    from test_launch import SMALL, STDLIB_TEXT, run_job
    from test_llama import REPO, tiny_llama_pair
    reader, _ = tiny_llama_pair(str(tmp_path))
    lm = kvjax.load_hf(reader)
    ecfg = WhisperEncoderConfig(num_mel_bins=16, d_model=32, num_layers=1, num_heads=2, ffn_dim=64,
                                max_source_positions=64)
    adapter = str(tmp_path / "ultravox")
    save_ultravox(adapter, init_encoder(ecfg, jax.random.key(5), std=0.2),
                  init_projector(ProjectorConfig(32, lm.cfg.hidden_size, hidden_size=32, stack_factor=2,
                                                 ln_mid=True), jax.random.key(6)),
                  text_model_id=reader, audio_token_index=100, vocab_size=lm.cfg.vocab_size)
    write_spoken_set(Path(tmp_path / "test"), 6, 16, 0, "heldout")
    write_spoken_set(Path(tmp_path / "train"), 8, 16, 1, "train")
    out = str(tmp_path / "run")
    env = {"KVJAX_SOURCE": reader, "KVJAX_TARGET": reader, "KVJAX_SOURCE_AUDIO": adapter,
           "KVJAX_TARGET_AUDIO": adapter, "KVJAX_AUDIO_TEST": str(tmp_path / "test"),
           "KVJAX_AUDIO_MAP_TRAIN": str(tmp_path / "train")}
    small = [a for a in SMALL if not a.startswith(("--config.eval.mc", "--config.eval.retrieval",
                                                   "--config.eval.throughput", "--config.eval.distances"))]
    argv = ["--config=ultravox8_1", f"--config.output_dir={out}", "--config.source.dtype=float32",
            "--config.target.dtype=float32", *small, *STDLIB_TEXT, "--config.eval.audio.open_id=0",
            "--config.eval.audio.map_valid=4", "--config.eval.audio.map_steps=3", "--config.eval.audio.map_cont=4",
            "--config.eval.audio.batch_size=3", "--config.eval.audio.speed_tokens=4",
            "--config.eval.audio.speed_rounds=1", "--config.eval.audio.paired_decode=2",
            "--config.eval.kl.enabled=false"]
    old = os.getcwd()
    os.chdir(REPO)
    try:
        assert run_job(argv, env) == 0
    finally:
        os.chdir(old)
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    assert metrics["run"]["config"] == "ultravox8_1"
    au = metrics["audio"]
    record = json.load(open(os.path.join(out, "eval", "audio.json")))
    lp = {a: np.asarray(r["logprobs"]) for a, r in record["arms"].items()}
    assert set(lp) == {"target_audio", "direct_audio", "text_map_audio", "mapped_audio", "source_audio",
                       "target_text", "source_text", "mapped_text", "null_source", "null_target"} and lp["source_audio"].shape == (6, 4)
    np.testing.assert_allclose(lp["null_source"], lp["null_target"], atol=1e-5)
    np.testing.assert_allclose(lp["source_audio"], lp["target_audio"], atol=1e-5)  # one model, one adapter
    np.testing.assert_allclose(lp["direct_audio"], lp["target_audio"], atol=1e-5)  # a copy of its own cache
    np.testing.assert_allclose(lp["source_text"], lp["target_text"], atol=1e-5)
    for arm in ("text_map_audio", "mapped_audio"):  # the identity ridge + a near-zero residual
        np.testing.assert_allclose(lp[arm], lp["target_audio"], atol=0.05)
    np.testing.assert_allclose(lp["mapped_text"], lp["target_text"], atol=0.05)  # the same, reading the transcript
    assert au["items"] == 6 and au["mapped_minus_target_audio_ci95"][0] <= 0 <= au["mapped_minus_target_audio_ci95"][1]
    assert au["map"]["clips"] == 4 and au["map"]["steps"] == 3
    assert au["speed"]["mapped_audio"]["decode_tok_s"] > 0 and "decode_ratio" in au["speed"]
    assert "audio_gain_ci_lo" in metrics["gate"]["checks"]
    assert "## Audio transfer" in open(os.path.join(out, "report.md")).read()
    m = au["map"]
    assert m["nll_source_audio"] == pytest.approx(m["nll_target_audio"], abs=1e-4)  # one model, one adapter
    assert m["nll_text_map"] > 0 and m["from_saved"] is None and m["teacher"] == "listening"

    # the audio map saved by that run, given back (`map_from`): the stage loads it, trains nothing, and the mapped
    # arm reads exactly as it did
    import shutil
    saved = str(tmp_path / "saved_map")
    shutil.copytree(os.path.join(out, "eval", "audio", "audio_map"), saved)
    os.chdir(REPO)
    try:
        assert run_job([*argv, "--redo=audio", f"--config.eval.audio.map_from={saved}"], env) == 0
        # held out more than the saved map did: refused before any work, naming the fix
        assert run_job([*argv, "--redo=audio", f"--config.eval.audio.map_from={saved}",
                        "--config.eval.audio.map_valid=5"], env) == 2
    finally:
        os.chdir(old)
    again = json.load(open(os.path.join(out, "eval", "audio.json")))
    np.testing.assert_allclose(np.asarray(again["arms"]["mapped_audio"]["logprobs"]), lp["mapped_audio"], atol=1e-5)
    assert again["map"]["from_saved"] == saved and again["map"]["loss"] == [] and again["map"]["steps"] == 3
    assert again["map"]["kl_audio_map"] == pytest.approx(record["map"]["kl_audio_map"], rel=1e-5)


def test_ultravox70_8_is_ultravox8_1_with_other_models():
    from configs import ultravox8_1, ultravox70_8
    a, b = ultravox8_1.get_config(), ultravox70_8.get_config()
    assert (b.name, b.output_dir, b.eval.audio.enabled) == ("ultravox70_8", "runs/ultravox70_8", True)
    assert "70B" in b.source.name and "8B" in b.target.name and "8B" in a.source.name and "1B" in a.target.name
    assert dataclasses.replace(b, name=a.name, output_dir=a.output_dir, source=a.source, target=a.target) == a


def test_ultravox_config_without_adapters_fails_fast_naming_what_to_pass(tmp_path):
    config = "ultravox8_1"
    import subprocess
    import sys

    from test_llama import REPO, tiny_llama_pair
    reader, answerer = tiny_llama_pair(str(tmp_path))  # the models are there; the audio adapters and sets are not
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVJAX_")}
    env.update(KVJAX_SOURCE=reader, KVJAX_TARGET=answerer)
    out = tmp_path / "run"
    from test_launch import STDLIB_TEXT
    proc = subprocess.run([sys.executable, "-m", "kvjax.launch", f"--config={config}", f"--config.output_dir={out}",
                           *STDLIB_TEXT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not out.exists()
    assert "eval.audio.source_adapter" in proc.stderr and "launch.toy.speech" in proc.stderr


# ---- the toy encoder's speech-recognition pre-training (launch/toy/speech_asr.py) ----------------------------------

def test_asr_pretraining_pieces_label_decode_and_score_as_ctc_means(tmp_path):
    """Character labels, greedy CTC decoding, the error rate's edit distance, and the loss as the script calls it:
    an alignment of the right transcript costs less than of a wrong one, and padding past a row's frames is ignored."""
    import optax

    from launch.toy.speech_asr import ALPHABET, edit_distance, greedy, labels, load_encoder, spell
    y = labels("The file's well-known  path/name, read.")
    assert spell(y) == "the file's well known path name read"
    hello = labels("hello")
    path = np.asarray([0, hello[0], hello[0], 0, hello[1], hello[2], 0, hello[3], hello[4], hello[4], 0, 0])
    assert greedy(path, 11) == hello and greedy(path, 4) == hello[:1]
    assert edit_distance(labels("kitten"), labels("sitting")) == 3 and edit_distance([], [1, 2]) == 2
    k = len(ALPHABET) + 1
    logits = np.full((1, 16, k), -5.0, np.float32)
    logits[0, np.arange(12), path] = 5.0
    logits[0, 12:] = np.random.default_rng(0).normal(size=(4, k)) * 9  # past the row's 12 frames: ignored
    pad = (np.arange(16) >= 12)[None].astype(np.float32)

    def ctc(text):
        lab = np.zeros((1, 8), np.int32)
        lab[0, :len(labels(text))] = labels(text)
        return float(optax.ctc_loss(logits, pad, lab, (lab == 0).astype(np.float32), blank_id=0)[0])
    assert ctc("hello") < 0.1 < 20 < ctc("world")
    with pytest.raises(SystemExit, match="python -m launch.toy.speech_asr"):
        load_encoder(tmp_path / "nothing")


def test_asr_continuation_keeps_the_whole_pretraining_record(tmp_path):
    """A continued pre-training (speech_asr --init-from ADAPTER) records the runs it continues; the adapters trained
    on it ship them all, oldest first, each record with its run; a directory without an adapter is refused."""
    import json

    from launch.toy.speech_asr import encoder_record, encoder_runs, main
    adapter, work = tmp_path / "adapter", tmp_path / "asr"
    adapter.mkdir()
    work.mkdir()
    (adapter / "encoder_metrics.jsonl").write_text("".join(json.dumps({"step": s, "valid_cer": c}) + "\n"
                                                         for s, c in ((250, 0.5), (500, 0.3))))
    runs = encoder_runs(adapter)
    assert [[r["step"] for r in run] for run in runs] == [[250, 500]]
    (work / "settings.json").write_text(json.dumps({"continues": {"from": str(adapter), "runs": runs}}))
    (work / "metrics.jsonl").write_text(json.dumps({"step": 250, "valid_cer": 0.2}) + "\n")
    lines = [json.loads(ln) for ln in encoder_record(work).splitlines()]
    assert [(r["run"], r["step"], r["valid_cer"]) for r in lines] == [(0, 250, 0.5), (0, 500, 0.3), (1, 250, 0.2)]
    (adapter / "encoder_metrics.jsonl").write_text(encoder_record(work))  # an adapter trained on the continuation
    assert [len(run) for run in encoder_runs(adapter)] == [2, 1]
    with pytest.raises(SystemExit, match="exported adapter"):
        main(["--init-from", str(tmp_path / "nothing"), "--data", str(tmp_path / "no-data")])


def test_projector_continuation_records_its_runs_and_refuses_bad_arguments(tmp_path, capsys):
    """speech_train --init-from ADAPTER: the adapter's distillation record (runs without a `run` field are the first)
    comes first in the continued adapter's, each record with its run; contradictory or missing inputs are refused
    with what to pass, before anything loads."""
    import json

    from launch.toy.speech_asr import encoder_runs, runs_record
    from launch.toy.speech_train import main
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "training_metrics.jsonl").write_text("".join(json.dumps({"step": s, "valid_kl": k}) + "\n"
                                                          for s, k in ((100, 0.2), (200, 0.18))))
    runs = encoder_runs(adapter, "training_metrics.jsonl")
    lines = [json.loads(ln) for ln in runs_record(runs + [[{"step": 100, "valid_kl": 0.17}]]).splitlines()]
    assert [(r["run"], r["step"], r["valid_kl"]) for r in lines] == [(0, 100, 0.2), (0, 200, 0.18), (1, 100, 0.17)]
    # the exported config keeps the provenance, not the metrics (those ship beside the weights), at every level
    from launch.toy.speech_train import lean
    nested = {"from": "a", "runs": runs, "training": {"lr": 1, "continues": {"from": "b", "runs": runs}}}
    assert lean(nested) == {"from": "a", "training": {"lr": 1, "continues": {"from": "b"}}} and lean(None) is None
    for argv, says in ((["--init-from", str(tmp_path / "nothing")], "no config.json"),
                       (["--init-from", str(adapter), "--encoder-from", str(adapter)], "pass one"),
                       (["--train-encoder"], "--train-encoder goes with")):
        with pytest.raises(SystemExit) as e:
            main(["--lm", "source", *argv])
        assert e.value.code == 2 and says in capsys.readouterr().err

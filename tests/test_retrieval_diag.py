"""The retrieval probes of issue 22 item 4 (launch/research/retrieval_diag.py, copy_residual.py): the written-out
attention that reports who reads the needle, the map surgery that copies one source layer into a target layer, and
the copy windows the residual is continued on."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.builders import NativePrefill
from kvjax.mapper.kvmap import apply_map
from kvjax.models.decoder import forward
from launch.research import copy_residual, retrieval_diag
from launch.toy.config import DIGITS, EQUALS_SPACE
from tests.maptools import VOCAB, tiny_model


def _tokens(n, t, seed):
    return np.random.RandomState(seed).randint(1, VOCAB, (n, t)).astype(np.int32)


def test_written_out_attention_is_the_models_forward_and_its_probabilities_are_causal():
    cfg, params = tiny_model(3, 64, 4, 2, 16, seed=0, theta=1e4)
    prompt = _tokens(2, 20, 0)
    cache = NativePrefill((cfg, params))(prompt, capacity=32)
    new = jnp.asarray(_tokens(2, 4, 1))
    want, _ = forward(params, cfg, new, cache)
    got, probs = retrieval_diag.attn_forward(params, cfg, new, cache, want_probs=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    p = np.asarray(probs[1])  # [B, Hq, S, C]
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
    for s in range(4):  # query s sits at position 20 + s: nothing after it is read
        assert np.abs(p[:, :, s, 21 + s :]).max() == 0.0


def test_reader_direct_writes_the_source_layer_unchanged_into_one_target_layer():
    source, target = tiny_model(3, 64, 4, 2, 16, seed=0, theta=1e4), tiny_model(2, 48, 4, 2, 16, seed=1, theta=1e4)
    kvmap, _ = kvjax.fit_map(source, target, _tokens(8, 40, 2), _tokens(4, 40, 3), pairing=((0, 1), (1, 2)),
                             batch_size=4, residual_rank=4)
    src = NativePrefill(source)(_tokens(2, 30, 4), capacity=32)
    base = apply_map(kvmap, src, length=30)
    for name, keys_from_source, values_from_source in (("map@1=2", True, True), ("map@1=2+k", True, False),
                                                       ("map@1=2+v", False, True)):
        got = apply_map(retrieval_diag.map_recipe(name, {"map": kvmap}), src, length=30)
        for kind, copied in (("k", keys_from_source), ("v", values_from_source)):
            want = getattr(src, kind)[2, :, :, :30] if copied else getattr(base, kind)[1, :, :, :30]
            np.testing.assert_allclose(np.asarray(getattr(got, kind)[1, :, :, :30]), np.asarray(want), atol=1e-4)
            np.testing.assert_array_equal(np.asarray(getattr(got, kind)[0]), np.asarray(getattr(base, kind)[0]))
    with pytest.raises(SystemExit, match="reads source layers"):
        retrieval_diag.reader_direct(kvmap, 1, 0)


def test_copy_windows_repeat_a_far_span_and_facts_are_key_equals_digits():
    tokens = np.random.RandomState(5).randint(30, 8000, 20_000).astype(np.int32)  # no digit or separator ids
    rng = np.random.default_rng(0)
    for facts in (False, True):
        w = copy_residual.copy_windows(tokens, 16, 300, 16, rng, facts=facts)
        assert w.shape == (16, 316)
        for row in w:
            tail = row[300:].tolist()
            starts = [a for a in range(300 - 16 + 1) if row[a : a + 16].tolist() == tail]
            assert starts, "the continuation repeats a span of the prefix"
            if facts:
                assert 64 <= 300 - starts[0] <= 300 - 16
                cue = tail.index(EQUALS_SPACE[0])
                assert 2 <= cue <= 5 and tail[cue + 1] == EQUALS_SPACE[1]
                assert set(tail[cue + 2 :]) <= set(DIGITS)
            else:
                assert 30 <= starts[0] < 60


def test_a_missing_map_is_named_before_anything_loads(capsys, tmp_path):
    with pytest.raises(SystemExit, match="no map artifact at /nonexistent/map"):
        retrieval_diag.main(["--map", "/nonexistent/map"])
    with pytest.raises(SystemExit, match="not found"):
        copy_residual.main(["--map", "/nonexistent/map", "--out", str(tmp_path / "never_written")])

"""The residual's fact-copy windows (kvjax.fitting.copy_windows, ResidualConfig.copy_*), on tiny
models with a character-level tokenizer, and the toy pair's own tokenizer for the default fact format."""

import dataclasses
import hashlib
import os

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import BPE

import kvjax
from kvjax.fitting.copy_windows import FactFormat, fact_format, fact_windows, gap_range
from kvjax.fitting.residual import pooled_kl
from kvjax.fitting.residual import ResidualConfig
from tests.maptools import VOCAB, tiny_pair

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def char_tokenizer():
    """Printable ASCII, one token per character (ids 1..95): ' = ' is 3 tokens, each digit one."""
    return Tokenizer(BPE(vocab={chr(32 + i): i + 1 for i in range(95)}, merges=[]))


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def ridge(pair):
    rs = np.random.RandomState(0)
    calib, select = (rs.randint(1, VOCAB, (n, 40)).astype(np.int32) for n in (16, 8))
    return kvjax.fit_map(*pair, calib, select, batch_size=8, residual_rank=4)[0]


TOKENS = np.random.RandomState(3).randint(1, VOCAB, 4000).astype(np.int32)
FMT = fact_format(char_tokenizer(), " = ", "0123456789")
RC = ResidualConfig(steps=4, batch_size=2, prefix_len=24, cont_len=8, lr=1e-2, warmup_steps=1, save_every=2,
                    pool_windows=5, copy_windows=6, copy_len=160, copy_span=12, copy_batch=2)


def test_fact_format_of_the_toy_tokenizer_and_bad_alphabets():
    toy = kvjax.load_tokenizer(os.path.join(REPO, "checkpoints/toy/pruned"))
    # launch/toy/config.py's EQUALS_SPACE and DIGITS: the format the toy source's last training phase wrote
    assert fact_format(toy, " = ", "0123456789") == FactFormat(((308, 221),), tuple(range(16, 26)))
    assert FMT == FactFormat(((1, 30, 1),), tuple(range(17, 27)))
    with pytest.raises(ValueError, match="one token"):
        fact_format(toy, " = ", "0123456789xyz" + "\u00e9\u00e9\u00e9")
    with pytest.raises(ValueError, match="empty"):
        fact_format(toy, " = ", "")


def test_fact_windows_repeat_a_fact_at_the_stated_gap_deterministically():
    windows, at = fact_windows(TOKENS, 50, 160, 12, FMT, seed=7)
    assert windows.shape == (50, 172) and windows.dtype == np.int32 and at.shape == (50, 1)
    at = at[:, 0]
    lo, hi = gap_range(160, 12)
    assert (lo, hi) == (64, 96)
    gaps = 160 - at
    assert gaps.min() >= lo and gaps.max() <= hi and len(set(gaps.tolist())) > 10  # spread over the range
    sep, values = np.asarray(FMT.separators[0]), set(FMT.values)
    for w, a in zip(windows, at):
        fact = w[a : a + 12]
        np.testing.assert_array_equal(w[160:], fact)  # the continuation is the fact, copied from `gap` back
        offsets = [k for k in range(2, 6) if np.array_equal(fact[k : k + 3], sep)]
        assert offsets, f"no separator after a 2-5 token key in {fact}"
        assert set(fact[offsets[0] + 3 :].tolist()) <= values  # the rest is the value
    again, at2 = fact_windows(TOKENS, 50, 160, 12, FMT, seed=7)
    np.testing.assert_array_equal(again, windows), np.testing.assert_array_equal(at2[:, 0], at)
    other, _ = fact_windows(TOKENS, 50, 160, 12, FMT, seed=8)
    assert not np.array_equal(other, windows)
    with pytest.raises(ValueError, match="span must be"):
        fact_windows(TOKENS, 4, 160, 8, FMT, seed=0)  # key (5) + separator (3) + a value leave no room


def test_random_separators_are_drawn_per_fact_from_the_window_text():
    """copy_separator "*": each fact's separator is 1-3 tokens of its own window's text (no one format to learn)."""
    fmt = fact_format(char_tokenizer(), "*", "0123456789")
    assert fmt.separators == () and fmt.max_separator() == 3 and fmt.min_span() == 9
    windows, at = fact_windows(TOKENS, 60, 160, 12, fmt, seed=3)
    at = at[:, 0]
    values = set(fmt.values)
    seps = set()
    for w, a in zip(windows, at):
        fact = w[a : a + 12]
        np.testing.assert_array_equal(w[160:], fact)
        # the value: the longest run of alphabet tokens at the fact's end; key + separator: 3..8 tokens before it
        v = 12
        while v > 0 and fact[v - 1] in values:
            v -= 1
        assert 3 <= v <= 8 or set(fact[v:].tolist()) <= values
        seps.add(tuple(fact[max(2, v - 3) : v].tolist()))
    assert len(seps) > 20  # separators differ from fact to fact
    with pytest.raises(ValueError, match="span must be"):
        fact_windows(TOKENS, 4, 160, 8, fmt, seed=0)


def test_several_separators_are_drawn_per_fact_and_one_keeps_its_windows():
    """copy_separator " = | -> | equals ": each fact draws one of the three; a setting of one separator makes the
    windows it made before several existed (the shipped maps' training data unchanged)."""
    tok = char_tokenizer()
    fmt = fact_format(tok, " = | -> | equals ", "0123456789")
    enc = lambda s: tuple(tok.encode(s, add_special_tokens=False).ids)  # noqa: E731
    assert fmt.separators == (enc(" = "), enc(" -> "), enc(" equals ")) and fmt.max_separator() == 8
    assert fmt.min_span() == 5 + 8 + 1
    windows, at = fact_windows(TOKENS, 90, 160, 16, fmt, seed=5)
    at = at[:, 0]
    counts = dict.fromkeys(fmt.separators, 0)
    for w, a in zip(windows, at):
        fact = w[a : a + 16]
        np.testing.assert_array_equal(w[160:], fact)
        found = [s for s in fmt.separators for k in range(2, 6) if tuple(fact[k : k + len(s)].tolist()) == s
                 and set(fact[k + len(s) :].tolist()) <= set(fmt.values)]
        assert len(found) == 1, f"not exactly one separator after a 2-5 token key in {fact}"
        counts[found[0]] += 1
    assert min(counts.values()) >= 15, counts  # each drawn about a third of the time
    one, at1 = fact_windows(TOKENS, 50, 160, 12, FMT, seed=7)
    # the windows (and fact starts) that one separator made before several existed (fact_windows as of 2026-12-04)
    assert hashlib.sha256(one.tobytes() + at1.tobytes()).hexdigest()[:16] == "1efc601985db60bb"
    with pytest.raises(ValueError, match="tokenizes to nothing"):
        fact_format(tok, " = ||", "0123456789")


def test_wildcard_separators_draw_window_tokens_never_an_avoided_one_or_a_value():
    """copy_separator "? | ?? ": each "?" is one token of the fact's own window text, drawn per fact; the tokens of
    copy_avoid (an evaluation's own separators, kept unseen) and the value alphabet are never drawn."""
    from kvjax.fitting.copy_windows import ANY
    tok = char_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    fmt = fact_format(tok, "? | ?? ", "0123456789", avoid="a|bc")
    assert fmt.separators == ((ANY, *enc(" ")), (*enc(" "), ANY, ANY, *enc(" "))) and fmt.max_separator() == 4
    assert fmt.avoid == tuple(sorted(enc("abc")))
    text = TOKENS.copy()
    text[::7] = enc("a")[0]  # a common token of the text, avoided
    text[3::11] = FMT.values[4]  # a value symbol in the text, never a separator
    windows, at = fact_windows(text, 120, 160, 14, fmt, seed=4)
    never, drawn = set(fmt.avoid) | set(fmt.values), set()
    space = enc(" ")[0]
    for w, a in zip(windows, at[:, 0]):
        fact = w[a : a + 14]
        np.testing.assert_array_equal(w[160:], fact)
        v = 14
        while fact[v - 1] in fmt.values:
            v -= 1
        assert fact[v - 1] == space  # both separators end in the space, the value after it
        if fact[v - 4] == space and 2 <= v - 4 <= 5:  # " ?? ": two wildcards between spaces
            got = fact[v - 3 : v - 1]
        else:  # "? ": one wildcard
            got = fact[v - 2 : v - 1]
        assert not set(got.tolist()) & never
        assert set(got.tolist()) <= set(w[:160].tolist())  # tokens of the window's own text
        drawn |= set(got.tolist())
    assert len(drawn) > 30  # drawn per fact, not one separator
    with pytest.raises(ValueError, match="tokenizes to nothing"):
        fact_format(tok, " = |", "0123456789")
    with pytest.raises(ValueError, match="keeps unseen"):  # a listed separator may not show what avoid keeps unseen
        fact_format(tok, " = | : ", "0123456789", avoid=":")


def test_several_facts_a_window_are_written_apart_and_all_repeated_in_a_drawn_order():
    """copy_facts: each window holds `facts` facts at their own gaps, never overlapping, and its continuation repeats
    every one of them, in an order drawn per window."""
    windows, at = fact_windows(TOKENS, 40, 160, 12, FMT, seed=9, facts=3)
    assert windows.shape == (40, 160 + 36) and at.shape == (40, 3)
    lo, hi = gap_range(160, 12)
    orders = set()
    for w, starts in zip(windows, at):
        assert all(lo <= 160 - a <= hi for a in starts)
        assert all(abs(int(a) - int(b)) >= 12 for i, a in enumerate(starts) for b in starts[:i])  # apart
        facts = [tuple(w[a : a + 12].tolist()) for a in starts]
        repeats = [tuple(w[160 + 12 * k : 172 + 12 * k].tolist()) for k in range(3)]
        assert sorted(repeats) == sorted(facts)
        orders.add(tuple(facts.index(r) for r in repeats))
    assert len(orders) > 3  # not always the order they sit in the text
    again, at2 = fact_windows(TOKENS, 40, 160, 12, FMT, seed=9, facts=3)
    np.testing.assert_array_equal(again, windows), np.testing.assert_array_equal(at2, at)
    with pytest.raises(ValueError, match="do not fit apart"):
        fact_windows(TOKENS, 2, 160, 12, FMT, seed=0, facts=4)  # 33 start positions hold 3 facts of 12 apart


def test_the_copy_loss_skips_the_first_tokens_of_every_repeated_fact(pair, ridge):
    """pooled_kl(period=span) leaves out the first COPY_SKIP positions of each repeat, not only of the first."""
    from kvjax.fitting.residual import student_logits
    from kvjax.fitting.teacher_pool import pool_of, teacher_logits
    from kvjax.mapper.kl import kl
    source, target = pair
    windows, _ = fact_windows(TOKENS, 2, 160, 12, FMT, seed=4, facts=2)
    pool = pool_of(source, target, windows, 160, "source")
    batch = pool.batch(0, 2, seed=0)
    per = np.asarray(kl(teacher_logits(source, batch[2]), student_logits(ridge, target, batch[1], batch[0], 160)))
    want = np.concatenate([per[:, 2:12], per[:, 14:24]], axis=1).mean()
    got = float(pooled_kl(ridge, source, target, batch, 160, skip=2, period=12))
    assert got == pytest.approx(float(want), rel=1e-5)
    assert got != pytest.approx(float(pooled_kl(ridge, source, target, batch, 160, skip=2)), rel=1e-4)


def test_copy_windows_change_the_step_and_training_resumes_exactly(pair, ridge, tmp_path):
    source, target = pair
    tok = char_tokenizer()
    off = dataclasses.replace(RC, copy_windows=0)
    plain, plain_hist = kvjax.train_residual(ridge, source, target, TOKENS, off)
    straight, hist = kvjax.train_residual(ridge, source, target, TOKENS, RC, workdir=str(tmp_path / "a"),
                                          tokenizer=tok)
    # the ordinary windows' KL is logged apart: the same batches, the same first-step loss as without copies ...
    assert hist[0]["kl"] == pytest.approx(plain_hist[0]["kl"], rel=1e-5) and "copy_kl" not in plain_hist[0]
    assert all(h["copy_kl"] > 0 for h in hist)
    # ... yet the update differs: the copy windows' KL moves the residual
    assert not np.allclose(np.asarray(plain.keys[0].up), np.asarray(straight.keys[0].up))
    kvjax.train_residual(ridge, source, target, TOKENS, RC, workdir=str(tmp_path / "b"), stop_at=2, tokenizer=tok)
    resumed, later = kvjax.train_residual(ridge, source, target, TOKENS, RC, workdir=str(tmp_path / "b"),
                                          tokenizer=tok)
    assert [h["step"] for h in later] == [3, 4]
    assert [h["copy_kl"] for h in later] == [h["copy_kl"] for h in hist[2:]]
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="copy_windows.*tokenizer"):
        kvjax.train_residual(ridge, source, target, TOKENS, RC)


def test_copy_windows_beside_streaming_text_windows_from_a_warm_start(pair, ridge, tmp_path):
    """Without a text pool the ordinary windows stream (both models run per step) beside the copy pool: the logged
    "kl" is theirs (the streaming loss of step 0's batch under the init_from map's residual), "copy_kl" the copies';
    an iterate average rides along."""
    from kvjax.fitting.residual import window_kl
    from kvjax.windows import step_batch
    source, target = pair
    keys = iter(jax.random.split(jax.random.key(5), 8))
    warm = ridge.replace(**{kind: tuple(m.replace(up=0.1 * jax.random.normal(next(keys), m.up.shape))
                                        for m in getattr(ridge, kind)) for kind in ("keys", "values")})
    kvjax.save_map(str(tmp_path / "warm"), warm, info={})
    rc = dataclasses.replace(RC, pool_windows=0, steps=1, ema=0.5, init_from=str(tmp_path / "warm"))
    _, hist = kvjax.train_residual(ridge, source, target, TOKENS, rc, tokenizer=char_tokenizer())
    first = step_batch(TOKENS, 0, rc.batch_size, rc.prefix_len + rc.cont_len, rc.seed)
    want = float(window_kl(warm, source, target, first, rc.prefix_len).mean())
    assert hist[0]["kl"] == pytest.approx(want, rel=1e-5)
    assert want != pytest.approx(float(window_kl(ridge, source, target, first, rc.prefix_len).mean()), rel=1e-3)
    assert hist[0]["copy_kl"] > 0


def test_the_default_config_trains_copies_and_gates_on_retrieval_and_preflight_errors():
    from kvjax import config_flags
    from kvjax.job.stages import plan
    from kvjax.run.config import DEFAULT_CONFIG
    from kvjax.run import preflight
    from kvjax.run.config import RunConfig
    cfg = config_flags.build(DEFAULT_CONFIG, [], RunConfig)
    rc = cfg.residual
    assert rc.copy_windows > 0 and rc.pool_windows > 0 and cfg.gate.min_retrieval == 0.5
    assert "residual" in cfg.eval.retrieval.arms and cfg.eval.retrieval.limit >= 50
    # the copy settings enter the residual stage's hash; a run without them keeps its old one
    off = dataclasses.replace(rc, copy_windows=0)
    assert plan(cfg)["residual"].hash != plan(dataclasses.replace(cfg, residual=off))["residual"].hash
    assert "copy_windows" not in off.hashed() and rc.hashed()["copy_windows"] == 256
    preflight.validate(cfg)

    def problems(**changes):
        with pytest.raises(preflight.LaunchError) as e:
            preflight.validate(dataclasses.replace(cfg, residual=dataclasses.replace(rc, **changes)))
        return str(e.value)
    assert "copy windows score; set residual.copy_windows=0 or residual.rollout=False" in problems(rollout=True,
                                                                                                  pool_windows=0)
    assert "exceeds the source's max_position_embeddings 4096" in problems(copy_len=5000)
    err = preflight.LaunchError
    with pytest.raises(err, match="longer than the training text"):
        preflight.validate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_train_tokens=1000)))
    assert "copy_span=6: a fact" in problems(copy_span=6)
    assert "each symbol of the value alphabet must be one token" in problems(copy_values="0123\u00e9")
    assert "copy_weight=0.0: must be in (0, 1]" in problems(copy_weight=0.0)
    assert "residual.context=-1: use 0 (each position alone) or 1..8" in problems(context=-1)
    # a context map (kvjax.mapper.kvmap.LinearMap.down_prev) is a residual setting: it enters that stage's hash only
    assert "context" not in rc.hashed() and dataclasses.replace(rc, context=1).hashed()["context"] == 1
    assert "context_kinds='q': use kv (keys and values read the context), k" in problems(context=1, context_kinds="q")
    assert "context_kinds" not in rc.hashed() and dataclasses.replace(rc, context_kinds="k").hashed()["context_kinds"]
    assert "copy_len=100: must be >= 128" in problems(copy_len=100)
    assert "residual.copy_facts=0: must be 1..57" in problems(copy_facts=0)
    assert "residual.copy_facts=58: must be 1..57" in problems(copy_facts=58)
    assert "copy_facts" not in rc.hashed() and dataclasses.replace(rc, copy_facts=4).hashed()["copy_facts"] == 4
    assert "keeps unseen" in problems(copy_separator=" = | is ", copy_avoid=" is")
    assert "copy_avoid" not in rc.hashed() and dataclasses.replace(rc, copy_avoid=":").hashed()["copy_avoid"] == ":"
    preflight.check_processes(cfg, 1)
    with pytest.raises(err, match="residual.pool_windows and residual.copy_windows need one process"):
        preflight.check_processes(cfg, 2)


def test_gate_min_retrieval_checks_the_maps_worst_length():
    from kvjax.eval.suite import evaluate_gate
    from kvjax.eval.gate import GateConfig
    rt = {"1024": {"target": 0.0, "source": 0.97, "residual": 0.62, "items": 100},
          "2048": {"target": 0.0, "source": 0.5, "residual": 0.41, "items": 100}}
    passed = evaluate_gate({"retrieval": rt}, GateConfig(min_retrieval=0.4), "residual")
    (c,) = [c for c in passed.checks if c.name == "retrieval"]
    assert passed.passed and c.value == 0.41 and c.note == "length 2048"
    failed = evaluate_gate({"retrieval": rt}, GateConfig(min_retrieval=0.5), "residual")
    assert not failed.passed and "retrieval 0.41 < 0.5" in failed.summary()
    assert "min_retrieval" not in GateConfig().hashed()  # older runs keep their report stage's hash

"""The pretraining loop on a tiny config: loss goes down, checkpoints resume exactly, batches are reproducible."""

import json

import jax
import numpy as np
import pytest

import kvjax
from kvjax.models.params import to_flat
from kvjax.models.decoder import forward
from kvjax.pretrain import TrainConfig, batch_at, train

CFG = kvjax.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=16, tie_word_embeddings=True)


def corpus(n=20_000, seed=0):
    """A learnable token stream: a repeating pattern with noise."""
    rng = np.random.RandomState(seed)
    base = np.tile(np.arange(3, 40), n // 37 + 1)[:n]
    noise = rng.rand(n) < 0.1
    return np.where(noise, rng.randint(0, 64, n), base).astype(np.uint16)


def test_the_no_cache_forward_equals_cached_prefill():
    params = kvjax.init_params(CFG, jax.random.key(0), std=0.3)
    tokens = np.random.RandomState(1).randint(0, 64, (2, 300)).astype(np.int32)  # spans several query blocks
    a = forward(params, CFG, tokens).logits
    b, _ = kvjax.prefill(params, CFG, tokens, kvjax.init_cache(CFG, 2, 512), fresh=False)  # windowed path
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_batches_are_a_pure_function_of_seed_and_step():
    data = corpus()
    a, b = batch_at(data, 7, 4, 16, seed=3), batch_at(data, 7, 4, 16, seed=3)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (4, 17) and not np.array_equal(a, batch_at(data, 8, 4, 16, seed=3))
    with pytest.raises(ValueError, match="shorter than one window"):
        batch_at(data[:10], 0, 4, 16, seed=3)


def test_copy_augmentation_repeats_spans_and_is_deterministic():
    data = np.arange(50_000)  # consecutive ids: every break in the sequence is a copied span
    plain = batch_at(data, 3, 16, 256, seed=1)
    aug = batch_at(data, 3, 16, 256, seed=1, copy_prob=0.5, copy_spans=2, copy_len=(8, 16))
    np.testing.assert_array_equal(aug, batch_at(data, 3, 16, 256, seed=1, copy_prob=0.5, copy_spans=2,
                                                copy_len=(8, 16)))
    changed = [r for r in range(16) if not np.array_equal(plain[r], aug[r])]
    assert 0 < len(changed) < 16  # about half the windows, the rest untouched
    for r in changed:
        row, orig = aug[r], plain[r]
        # every overwritten token repeats a token from earlier in the same window
        for t in np.flatnonzero(row != orig):
            assert row[t] in set(row[:t].tolist()) | set(orig[:t].tolist())
    with pytest.raises(ValueError, match="copy_len"):
        batch_at(data, 0, 4, 16, seed=3, copy_prob=0.5, copy_len=(8, 16))


def test_copy_gap_places_copies_at_the_requested_distance():
    data = np.arange(50_000)  # consecutive ids: a copied token's value says where in the window it came from
    plain = batch_at(data, 5, 32, 256, seed=2)
    aug = batch_at(data, 5, 32, 256, seed=2, copy_prob=1.0, copy_spans=1, copy_len=(8, 8), copy_gap=(100, 120))
    for r in range(32):
        moved = np.flatnonzero(aug[r] != plain[r])
        assert len(moved) == 8 and np.all(np.diff(moved) == 1)  # one contiguous span of 8
        src = int(np.flatnonzero(plain[r] == aug[r][moved[0]])[0])
        assert 100 <= moved[0] - (src + 8) <= 120
    rand = batch_at(data, 5, 32, 256, seed=2, copy_prob=1.0, copy_spans=1, copy_len=(8, 8), copy_gap=(100, 120),
                    copy_random=1.0)
    for r in range(32):  # ids are unique, so 8 equal tokens at two places can only be a span and its copy
        found = [(s, g) for s in range(257 - 16) for g in range(0, 258 - 16 - s)
                 if np.array_equal(rand[r, s : s + 8], rand[r, s + 8 + g : s + 16 + g])]
        assert len(found) == 1 and 100 <= found[0][1] <= 120
        s, _ = found[0]
        assert not np.array_equal(rand[r, s : s + 8], plain[r, s : s + 8])  # the span itself was replaced ...
        assert set(rand[r, s : s + 8].tolist()) <= set(plain[r].tolist())  # ... by tokens of the same window
    with pytest.raises(ValueError, match="copy_gap"):
        batch_at(data, 0, 4, 64, seed=3, copy_prob=0.5, copy_len=(8, 16), copy_gap=(0, 40))


def test_copy_values_shape_random_spans_as_facts():
    data = np.arange(1_000, 60_000)  # unique ids above the value and separator ids, so nothing can be confused
    values, sep = tuple(range(10)), (500, 501)
    kw = dict(copy_prob=1.0, copy_spans=1, copy_len=(12, 12), copy_gap=(100, 120), copy_random=1.0)
    old = batch_at(data, 5, 32, 256, seed=2, **kw)
    aug = batch_at(data, 5, 32, 256, seed=2, **kw, copy_values=values, copy_value_frac=1.0, copy_cue=(2, 5),
                   copy_sep=sep)
    # without copy_value_frac the option leaves the batches of earlier configs exactly as they were
    np.testing.assert_array_equal(old, batch_at(data, 5, 32, 256, seed=2, **kw, copy_values=values, copy_sep=sep))
    for r in range(32):
        where = np.flatnonzero(aug[r] < 10)  # the value of the fact and of its copy: two equal runs
        breaks = np.flatnonzero(np.diff(where) > 1)
        assert len(breaks) == 1
        first, second = where[: breaks[0] + 1], where[breaks[0] + 1 :]
        assert len(first) == len(second) and np.all(np.diff(first) == 1) and np.all(np.diff(second) == 1)
        cue = 12 - len(sep) - len(first)
        assert 2 <= cue <= 5 and np.array_equal(aug[r, first], aug[r, second])
        start = first[0] - len(sep) - cue
        assert (aug[r, start : start + cue] >= 1_000).all()  # the key: tokens of the window ...
        assert aug[r, start + cue : first[0]].tolist() == list(sep)  # ... then the separator
        copy = second[0] - len(sep) - cue
        assert 100 <= copy - (start + 12) <= 120  # the whole fact reappears 100-120 tokens later
        np.testing.assert_array_equal(aug[r, start : start + 12], aug[r, copy : copy + 12])
    with pytest.raises(ValueError, match="copy_values"):
        batch_at(data, 0, 4, 256, seed=3, copy_prob=1.0, copy_len=(8, 16), copy_random=1.0, copy_value_frac=0.5)
    with pytest.raises(ValueError, match="copy_cue"):  # key + separator leave no room for a value
        batch_at(data, 0, 4, 256, seed=3, copy_prob=1.0, copy_len=(8, 16), copy_random=1.0, copy_value_frac=0.5,
                 copy_values=values, copy_cue=(2, 6), copy_sep=sep)


def test_training_learns_and_resumes_exactly(tmp_path):
    data, heldout = corpus(), corpus(seed=1)
    tc = TrainConfig(seq_len=32, batch_size=4, steps=8, lr=1e-2, warmup_steps=2, eval_every=2, eval_batches=2,
                     save_every=2)
    straight = train(CFG, tc, data, heldout, str(tmp_path / "a"))
    records = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    assert records[-1]["heldout_loss"] < records[0]["heldout_loss"] - 0.3
    assert (tmp_path / "a" / "loss.png").stat().st_size > 1000

    # stop after 4 steps, then resume to 8: same parameters as the uninterrupted run
    train(CFG, tc, data, heldout, str(tmp_path / "b"), stop_at=4)
    resumed = train(CFG, tc, data, heldout, str(tmp_path / "b"))
    for x, y in zip(to_flat(straight).values(), to_flat(resumed).values()):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # a phase cut short (end_at) keeps the full schedule: same weights as stopping that run at the step
    cut = train(CFG, TrainConfig(**{**tc.__dict__, "end_at": 4}), data, heldout, str(tmp_path / "c"))
    stopped = train(CFG, tc, data, heldout, str(tmp_path / "d"), stop_at=4)
    assert [json.loads(line)["step"] for line in open(tmp_path / "c" / "metrics.jsonl")] == [2, 4]
    for x, y in zip(to_flat(cut).values(), to_flat(stopped).values()):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_second_phase_starts_from_given_weights(tmp_path):
    data, heldout = corpus(), corpus(seed=1)
    tc = TrainConfig(seq_len=32, batch_size=4, steps=6, lr=1e-2, warmup_steps=2, eval_every=2, eval_batches=2,
                     save_every=6)
    first = train(CFG, tc, data, heldout, str(tmp_path / "phase1"))
    train(CFG, TrainConfig(**{**tc.__dict__, "steps": 2, "lr": 1e-4}), data, heldout, str(tmp_path / "phase2"),
          init=first)
    p1 = [json.loads(line) for line in open(tmp_path / "phase1" / "metrics.jsonl")]
    p2 = [json.loads(line) for line in open(tmp_path / "phase2" / "metrics.jsonl")]
    assert abs(p2[0]["heldout_loss"] - p1[-1]["heldout_loss"]) < 0.05 < p1[0]["heldout_loss"] - p1[-1]["heldout_loss"]


def test_repeat_prob_replaces_windows_by_random_tokens_repeated():
    data = np.arange(50_000)
    kw = dict(copy_prob=0.5, copy_len=(8, 16))
    plain = batch_at(data, 3, 64, 99, seed=1, **kw)
    a = batch_at(data, 3, 64, 99, seed=1, **kw, repeat_prob=0.5, repeat_span=40)
    assert a.shape == (64, 100) and np.array_equal(a, batch_at(data, 3, 64, 99, seed=1, **kw, repeat_prob=0.5,
                                                               repeat_span=40))
    rep = np.asarray([np.array_equal(r[40:80], r[:40]) and np.array_equal(r[80:], r[:20]) for r in a])
    assert 16 < rep.sum() < 48  # about half the windows
    assert np.array_equal(a[~rep], plain[~rep])  # the others are untouched (copy augmentation included)
    assert not any(np.all(np.diff(row[:40]) == 1) for row in a[rep])  # random draws, not a text window
    with pytest.raises(ValueError, match="repeat_span"):
        batch_at(data, 0, 4, 99, seed=1, repeat_prob=0.5, repeat_span=60)

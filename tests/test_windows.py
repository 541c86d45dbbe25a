"""kvjax.windows: every window draw, pinned to the offsets the project's runs were made with (the toy pair's
training, every residual checkpoint and every calibration set): a change to a draw fails here, not as a resumed run
that silently trains on other batches."""

import numpy as np
import pytest

from kvjax.windows import consecutive, read, sample, sample_starts, step_batch, step_starts

# computed with the draws as they were before kvjax.windows gathered them (pretrain.batch_at / residual.batch_starts
# and mapper.data.windows_from_tokens, 2026-11-30)
STEP_5_SEED_2 = [3776, 4076, 103, 3365, 2959, 2553, 1694, 4075]  # step_starts(5000, 5, 8, 32, seed=2)
# sample_starts(5000, 12, 64, seed=4)
SAMPLE_SEED_4 = [399, 1397, 1858, 2239, 2524, 2998, 3586, 4351, 4642, 4655, 4790, 4819]


def test_draws_are_the_ones_runs_were_made_with():
    np.testing.assert_array_equal(step_starts(5000, 5, 8, 32, seed=2), STEP_5_SEED_2)
    np.testing.assert_array_equal(sample_starts(5000, 12, 64, seed=4), SAMPLE_SEED_4)


def test_windows_are_the_tokens_at_their_starts():
    tokens = np.arange(5000, dtype=np.int64) * 3
    batch = step_batch(tokens, 5, 8, 32, seed=2)
    assert batch.dtype == np.int32 and batch.shape == (8, 32)
    np.testing.assert_array_equal(batch, read(tokens, np.asarray(STEP_5_SEED_2), 32))
    np.testing.assert_array_equal(batch[:, 0], np.asarray(STEP_5_SEED_2) * 3)
    w = sample(tokens, 12, 64, seed=4)
    assert w.dtype == np.int32 and w.shape == (12, 64) and (np.diff(w, axis=1) == 3).all()
    np.testing.assert_array_equal(w[:, 0], np.asarray(SAMPLE_SEED_4) * 3)
    assert not np.array_equal(step_batch(tokens, 6, 8, 32, seed=2), batch)


def test_consecutive_windows_drop_the_tail():
    w = consecutive(np.arange(10), 3)
    np.testing.assert_array_equal(w, [[0, 1, 2], [3, 4, 5], [6, 7, 8]])
    assert consecutive(np.arange(10), 3, n=2).shape == (2, 3)


def test_too_few_tokens_say_how_many_a_window_needs():
    with pytest.raises(ValueError, match="shorter than one window of 32"):
        step_starts(32, 0, 4, 32, seed=0)
    with pytest.raises(ValueError, match="need at least 64 tokens"):
        sample_starts(63, 4, 64)
    with pytest.raises(ValueError, match="10 tokens do not make one window of 16"):
        consecutive(np.arange(10), 16)

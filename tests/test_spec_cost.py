"""The cost model of speculative decoding (kvjax.speculative.cost): its drafters measure what they claim (a null
round verifies exactly t tokens and emits the verifier's greedy tokens; an ignored drafter drafts but is never
accepted), the prediction is the formula, and the benchmark that prices the toy's drafters runs end to end."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.speculative import LookupDrafter, speculative_generate
from kvjax.speculative.cost import Ignored, NullDrafter, predict_seconds, speedup
from maptools import VOCAB, tiny_pair


@pytest.fixture(scope="module")
def verifier():
    return kvjax.Model(*tiny_pair()[0])


def test_null_rounds_verify_t_tokens_and_emit_the_greedy_decode(verifier):
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    want = np.asarray(kvjax.generate(verifier.params, verifier.cfg, prompts, 9, eos_token_ids=()))
    for width, variable in ((1, True), (3, True), (5, True), (5, False)):
        d = NullDrafter(VOCAB, draft_len=4, width=width, variable_length=variable)
        got, stats = speculative_generate(verifier, d, prompts, 9, eos_token_ids=(), return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), want)
        assert stats.widths[width] == int(np.sum(stats.widths)) == stats.rounds.max()  # every round at width t
    traced = NullDrafter(VOCAB, draft_len=4, width=jnp.int32(2), variable_length=True)  # one program, any width
    _, stats = speculative_generate(verifier, traced, prompts, 9, eos_token_ids=(), return_stats=True)
    assert stats.widths.tolist() == [0, 0, 9, 0, 0, 0]
    # a schedule: round r at width schedule[r % K], as a real drafter's rounds change width
    mixed = NullDrafter(VOCAB, draft_len=4, width=jnp.asarray([1, 3, 5], jnp.int32), variable_length=True)
    got, stats = speculative_generate(verifier, mixed, prompts, 9, eos_token_ids=(), return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert stats.widths.tolist() == [0, 3, 0, 3, 0, 3]
    with pytest.raises(ValueError, match="schedule"):
        NullDrafter(VOCAB, draft_len=4, width=np.asarray([1, 5], np.int32))
    with pytest.raises(ValueError, match="variable_length=True"):
        NullDrafter(VOCAB, draft_len=4, width=2)
    with pytest.raises(ValueError, match="width"):
        NullDrafter(VOCAB, draft_len=4, width=6, variable_length=True)


def test_an_ignored_drafter_drafts_at_full_width_and_is_never_accepted(verifier):
    phrase = [4, 8, 15, 16, 23, 42]
    prompts = [phrase * 3]
    want = np.asarray(kvjax.generate(verifier.params, verifier.cfg, prompts, 12, eos_token_ids=()))
    lookup = LookupDrafter(VOCAB, draft_len=3)
    _, real = speculative_generate(verifier, lookup, prompts, 12, eos_token_ids=(), return_stats=True)
    got, stats = speculative_generate(verifier, Ignored(lookup, VOCAB), prompts, 12, eos_token_ids=(),
                                      return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert real.accepted.sum() > 0 and stats.accepted.sum() == 0  # the same drafter, its drafts withheld
    assert stats.widths[4] == int(np.sum(stats.widths)) == 12  # one token a round, always verified at full width


def test_the_prediction_is_the_formula():
    widths = [0, 3, 0, 5]  # 3 rounds at t = 1, 5 at t = 3
    got = predict_seconds(widths, {1: 0.010, 3: 0.030, 2: 9.0}, {"block": 4, "lookup": 8},
                          {"block": 0.002, "lookup": 0.0005})
    assert got == pytest.approx(3 * 0.010 + 5 * 0.030 + 4 * 0.002 + 8 * 0.0005, rel=1e-12)
    assert speedup(3.0, 1.2, 0.3) == pytest.approx(2.0)
    with pytest.raises(ValueError, match=r"width\(s\) \[3\]"):
        predict_seconds(widths, {1: 0.01}, {}, {})
    with pytest.raises(ValueError, match="block"):
        predict_seconds(widths, {1: 0.01, 3: 0.03}, {"block": 1}, {})


def test_benchmark_smoke(tmp_path):
    """launch.bench.spec_cost on tiny random models: every drafter token-identical, its predicted speed-up the
    formula over the costs and widths it wrote, the measured one from the timings (the numbers are machine noise)."""
    from launch.bench import spec_cost
    out = tmp_path / "spec_cost.json"
    result = spec_cost.main(["--smoke", "--blocks", "2", "--sets", "windows", "--transfer", "smoke",
                             "--transfer-repair", "0", "1", "--refine", "1", "--out", str(out), "--accept-chart",
                             str(tmp_path / "accept.png")])
    assert (tmp_path / "accept.png").stat().st_size > 0
    saved = json.loads(out.read_text())
    assert saved["args"]["refine"] == 1  # the block drafters draft with one refinement pass (still exact, below)
    res = saved["sets"]["windows"]
    # small: a model drafting; transferK: the same model drafting while the verifier reads the cache a map made of
    # the small model's prefill (K verifier layers recomputed), checked against the verifier's decode from that cache
    assert set(res["drafters"]) == {"lookup-2", "block-2", "combined-2", "small-2", "transfer0-2", "transfer1-2"}
    costs = res["costs"]
    assert set(costs["c_verify"]["variable"]["2"]) == {"1", "2", "3"} and set(costs["c_verify"]["fixed"]["2"]) == {"3"}
    assert set(costs["c_draft"]) == set(costs["c_draft_raw"]) == {"lookup-2", "block-2", "small-2"}
    assert all(v == max(costs["c_draft_raw"][k], 0.0) for k, v in costs["c_draft"].items())
    for name, r in res["drafters"].items():
        assert r["identical"] == r["prompts"] == 2, name
        assert sum(r["widths"]) == r["rounds"] and r["tau"] >= 1
        hist = r["accepted_hist"]  # rounds by drafts accepted: their count and tau; tau from the positions' shares
        assert len(hist) == 3 and sum(hist) == r["rounds"]
        assert (sum(k * n for k, n in enumerate(hist)) + r["rounds"]) / r["rounds"] == pytest.approx(r["tau"])
        shares = np.cumprod([p or 0.0 for p in r["accept_given_previous"]])
        assert 1 + shares.sum() == pytest.approx(r["tau"])
        variable = name not in ("block-2", "small-2", "transfer0-2", "transfer1-2")
        path = costs["c_verify"]["variable" if variable else "fixed"]["2"]
        mean = sum(w * path[str(t)] for t, w in enumerate(r["widths"]) if w) / r["rounds"]
        assert r["c_verify_mean"] == pytest.approx(mean, rel=1e-9)
        draft = sum(n * costs["c_draft"][k] for k, n in r["calls"].items()) / r["rounds"]
        assert r["c_draft_per_round"] == pytest.approx(draft, rel=1e-9)
        assert r["measured_speedup"] > 0 and r["error"] == pytest.approx(
            r["measured_speedup"] / r["predicted_speedup"] - 1, rel=1e-9)
        assert r["error_parts"] == pytest.approx(r["measured_speedup"] / r["predicted_speedup_parts"] - 1, rel=1e-9)
        assert r["error_replay"] == pytest.approx(r["measured_speedup"] / r["predicted_speedup_replay"] - 1, rel=1e-9)
        if not variable:  # a fixed-length drafter's rounds are the reference round: the same prediction
            assert r["predicted_speedup_replay"] == pytest.approx(r["predicted_speedup"], rel=1e-12)
        # a wide round (and a model drafter's forward) dearer than the parts measured: a slower prediction
        scale = costs["verify_scale"]["2"] + [v for k in r["calls"] for v in costs["draft_scale"].get(k, [])]
        if min(scale) > 1:
            assert r["predicted_speedup"] < r["predicted_speedup_parts"]
        elif max(scale) < 1:
            assert r["predicted_speedup"] > r["predicted_speedup_parts"]
    assert len(costs["verify_scale"]["2"]) == 2 and min(costs["verify_scale"]["2"]) > 0  # one per prompt
    # one per fixed-length drafting part and prompt (lookup's part costs ~0 and is not rescaled)
    assert set(costs["draft_scale"]) == {"block-2", "small-2"}
    assert all(len(v) == 2 and min(v) > 0 for v in costs["draft_scale"].values())
    assert res["drafters"]["combined-2"]["calls"]["lookup-2"] == res["drafters"]["combined-2"]["rounds"]
    for name in ("transfer0-2", "transfer1-2"):  # priced by the small model's drafting part
        assert res["drafters"][name]["calls"] == {"small-2": res["drafters"][name]["rounds"]}
    assert result["table"] == saved["table"] and "| combined-2 | 2/2 |" in saved["table"]


def test_an_oracle_drafts_the_greedy_decode_and_every_draft_is_accepted(verifier):
    from kvjax.speculative.cost import Oracle
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8, 1, 2]]
    want = np.asarray(kvjax.generate(verifier.params, verifier.cfg, prompts, 12, eos_token_ids=()))
    ref = np.pad(want, ((0, 0), (0, 4)))
    got, stats = speculative_generate(verifier, Oracle(jnp.asarray(ref), draft_len=3), prompts, 12, eos_token_ids=(),
                                      return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert stats.rounds.max() == 3 and stats.widths[4] == 3  # 12 tokens in 3 rounds of 4: every draft accepted
    wrong = np.pad(want[:, ::-1], ((0, 0), (0, 4)))  # drafts that are not the greedy decode: still exact, more rounds
    got, stats = speculative_generate(verifier, Oracle(jnp.asarray(wrong), draft_len=3), prompts, 12,
                                      eos_token_ids=(), return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert stats.rounds.max() > 3
    got, stats = speculative_generate(verifier, Oracle(jnp.asarray(ref), draft_len=3, accept=1), prompts, 12,
                                      eos_token_ids=(), return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert stats.rounds.max() == 6 and stats.widths[4] == 6  # rounds at full width, each accepting 1: 2 tokens


def test_acceptance_by_draft_position():
    """Rounds that accepted 0 / 1 / 2 drafts: 2 / 1 / 3. Position 1 was accepted in 4 of 6 rounds, position 2 in 3
    of those 4; tau = 1 + 4/6 + 4/6 x 3/4 = 13/6, as (accepted + rounds) / rounds counts it."""
    from launch.bench.spec_cost import accept_given_previous
    assert accept_given_previous([2, 1, 3]) == pytest.approx([4 / 6, 3 / 4])
    assert accept_given_previous([5, 0, 0]) == [0.0, None]  # no round reached position 2


def test_a_replay_draws_the_runs_widths_tiled_to_one_length():
    """spec_cost.replay: a run's widths (3 rounds at t = 1, 5 at t = 3) in a shuffled order, tiled to the rounds
    asked, on the variable-length path (one program per draft length, whatever the run)."""
    from launch.bench.spec_cost import replay
    d = replay(VOCAB, 4, [0, 3, 0, 5], 16, seed=1)
    w = np.asarray(d.width)
    assert d.variable_length and w.shape == (16,) and sorted(np.bincount(w[:8], minlength=4).tolist()) == [0, 0, 3, 5]
    assert np.array_equal(w[8:], w[:8]) and not np.array_equal(w[:8], np.sort(w[:8]))

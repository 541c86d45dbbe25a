"""The `agreement` evaluation (every arm's next-token agreement with the source and the native
target, against direct injection) on tiny random models, its metrics / gate / report / chart on hand-made records,
and chance-normalised retention in the `mc` evaluation's metrics."""

import types

import jax
import numpy as np
import pytest

import kvjax
from kvjax.eval import stats
from kvjax.eval.arm_settings import ArmSettings
from kvjax.eval.arms import ARMS
from kvjax.eval.suite import agreement, mc
from kvjax.eval.suite.kl import KLEval
from kvjax.eval.suite.evaluation import EvalContext, MetricsContext, ReportContext
from kvjax.eval.gate import GateConfig

PREFIX, CONT, WINDOWS = 12, 8, 6
RUN_INFO = {"config": "t", "source": {"name": "S", "params_m": 1.0, "layers": 2, "path": "s", "dtype": "f"},
            "target": {"name": "T", "params_m": 0.5, "layers": 1, "path": "t"},
            "map": {"residual_rank": 4, "residual_steps": 3, "final": "residual", "pairing": "depth", "rank": None,
                    "lambdas": []},
            "data": {"calib_tokens": 10, "train_text": ["x"]}, "devices": "1 x cpu",
            "versions": {"kvjax": "0", "jax": "0"}, "stage_seconds": {}}


def tiny(seed: int, layers: int = 2):
    cfg = kvjax.Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                            num_kv_heads=2, head_dim=16, rope_theta=10_000.0, tie_word_embeddings=True,
                            eos_token_ids=(0,), pad_token_id=0)
    return cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1)


@pytest.fixture(scope="module")
def heldout():
    return np.random.default_rng(0).integers(1, 96, (WINDOWS + 2, PREFIX + CONT + 4)).astype(np.int32)


def settings(arms):
    return agreement.AgreementEval(arms=arms)


def run_config():
    """What the evaluation reads of RunConfig: the kl windows (rows after the distance windows, sizes) and arms."""
    kl = KLEval(windows=WINDOWS, prefix_len=PREFIX, cont_len=CONT, batch_size=4)
    return types.SimpleNamespace(eval=types.SimpleNamespace(distances=types.SimpleNamespace(windows=1), kl=kl),
                                 arms=ArmSettings())


def context(source, target, maps, heldout, fitted=("ridge",)):
    cfg = run_config()

    def get(name):
        if name not in maps:
            raise ValueError(f"no map {name!r}")
        return maps[name]
    return EvalContext(cfg, source=source, target=target, map=get, fitted=fitted, heldout=heldout, tokenizer=None)


def test_registered_after_kl_and_gate_hash_unchanged():
    from kvjax.eval import suite
    assert suite.NAMES.index("agreement") == suite.NAMES.index("kl") + 1
    assert 40 < suite.BY_NAME["agreement"].section < 50
    hashed = GateConfig().hashed()  # report hashes of runs made before these checks existed do not move
    assert "min_agreement_vs_direct" not in hashed and "min_chance_retention" not in hashed
    assert "min_chance_retention" in GateConfig(min_chance_retention=0.5).hashed()
    assert agreement.preflight(settings(("target", "nope")), run_config()) == [
        f"eval.agreement.arms: unknown arms ['nope']; choose from {list(ARMS)}"]
    # the windows are kl's: its rows after the distance windows, its lengths
    assert suite.BY_NAME["agreement"].heldout(settings(("target",)), run_config()) == (1 + WINDOWS, PREFIX + CONT)
    # in the default job: on, no problems, and it reads no more held-out data than the job read before
    import dataclasses
    from kvjax import config_flags
    from kvjax.run.config import RunConfig
    cfg = config_flags.build("toy", [], RunConfig)
    assert cfg.eval.agreement.enabled and agreement.preflight(cfg.eval.agreement, cfg) == []
    off = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, agreement=agreement.AgreementEval(False)))
    assert suite.heldout_needed(cfg)[:2] == suite.heldout_needed(off)[:2]
    assert "agreement" in suite.heldout_needed(cfg)[2]


def test_identity_pair_direct_injection_agrees_everywhere(heldout):
    """Source = target: direct injection copies the target's own cache, so the target reading it picks the source's
    (= its own) top token at every position; the source row is the teacher itself."""
    model = tiny(0)
    from kvjax.mapper.injection import injection_map
    direct = injection_map(model[0], model[0])
    ctx = context(model, model, {"direct": direct, "ridge": direct}, heldout)
    rec = agreement.run(settings(("target", "direct", "ridge", "source")), ctx)
    assert rec["windows"] == WINDOWS and rec["skipped"] == {} and rec["reference"]
    assert set(rec["arms"]) == {"target", "direct", "ridge"}  # the source builds no cache for the target
    for arm in ("target", "direct", "ridge"):
        for k in agreement.KINDS + agreement.FIRST:
            assert rec["arms"][arm][k] == [1.0] * WINDOWS, (arm, k)
    assert rec["target_with_source"] == [1.0] * WINDOWS
    m = agreement.metrics(rec, MetricsContext(200, "ridge"))
    assert m["with_source"] == {"target": 1.0, "direct": 1.0, "ridge": 1.0, "source": 1.0}
    assert m["ratio_vs_direct"]["with_source"]["ridge"] == 1.0 and m["ratio_vs_direct"]["with_target"]["ridge"] == 1.0
    assert m["disagreement_ratio"]["with_source"]["ridge"] is None  # never disagrees: unbounded
    assert m["minus_direct"]["with_source"]["ridge"] == {"mean": 0.0, "ci95": [0.0, 0.0]}


def test_two_models_match_next_token_agreement_and_skip_an_unbuildable_direct_arm(heldout):
    """Different models: each arm's per-window values are next_token_agreement's for its builder; the target reading
    its own prefill agrees with its native decode; a direct arm whose map cannot be made is skipped, every ratio to
    it unmeasured (and the gate says so)."""
    from kvjax.builders import Mapped
    from kvjax.eval.token_agreement import next_token_agreement
    from kvjax.mapper.injection import injection_map
    source, target = tiny(1, layers=4), tiny(2)
    direct = injection_map(source[0], target[0])
    windows = heldout[1 : 1 + WINDOWS, : PREFIX + CONT]
    rec = agreement.run(settings(("target", "direct", "source")), context(source, target, {"direct": direct}, heldout))
    want = next_token_agreement(Mapped(source, target, direct), source, target, windows, PREFIX, 4)
    for k in agreement.KINDS + agreement.FIRST:
        np.testing.assert_allclose(rec["arms"]["direct"][k], want[k])
    np.testing.assert_allclose(rec["target_with_source"], want["target_with_source"])
    assert rec["arms"]["target"]["with_target"] == [1.0] * WINDOWS
    np.testing.assert_allclose(rec["arms"]["target"]["with_source"], want["target_with_source"])
    assert np.mean(want["with_source"]) < 1.0  # random models disagree somewhere: the test can tell arms apart

    rec = agreement.run(settings(("target", "direct", "source")), context(source, target, {}, heldout))
    assert set(rec["arms"]) == {"target"} and "no map 'direct'" in rec["skipped"]["direct"]
    m = agreement.metrics(rec, MetricsContext(200, "residual"))
    assert m["ratio_vs_direct"]["with_source"]["target"] is None and m["minus_direct"]["with_source"]["target"] is None
    checks = agreement.gate(m, GateConfig(min_agreement_vs_direct=2.0), "target")
    assert [(c.name, c.value) for c in checks] == [("agreement_vs_direct", None)] and "no map" in checks[0].note
    text = "\n".join(agreement.report(m, ReportContext({}, {}, "residual", "S", "T")))
    assert "Arm direct was not measured" in text and "unmeasured" in text


def hand_record():
    """Per-window agreement of three arms on 4 windows (hand-made: the metrics' arithmetic is checkable)."""
    arms = {"target": {"with_source": [0.5, 0.5, 0.25, 0.75], "with_target": [1.0] * 4},
            "direct": {"with_source": [0.1, 0.0, 0.1, 0.0], "with_target": [0.2, 0.2, 0.0, 0.2]},
            "residual": {"with_source": [0.6, 0.5, 0.4, 0.5], "with_target": [0.8, 0.6, 0.6, 0.6]}}
    for r in arms.values():
        r["first_with_source"], r["first_with_target"] = [1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]
    return {"arms": arms, "target_with_source": [0.5, 0.5, 0.25, 0.75], "reference": True, "skipped": {},
            "windows": 4, "prefix_len": 12, "cont_len": 8}


def test_metrics_ratios_gate_report_and_chart(tmp_path):
    from kvjax.eval import suite
    m = agreement.metrics(hand_record(), MetricsContext(500, "residual"))
    assert m["with_source"]["residual"] == pytest.approx(0.5) and m["with_source"]["direct"] == pytest.approx(0.05)
    assert m["ratio_vs_direct"]["with_source"]["residual"] == pytest.approx(10.0)  # 0.5 / 0.05
    assert m["ratio_vs_direct"]["with_target"]["residual"] == pytest.approx(0.65 / 0.15)
    assert m["disagreement_ratio"]["with_source"]["residual"] == pytest.approx(0.95 / 0.5)
    assert m["disagreement_ratio"]["with_target"]["target"] is None  # the target never disagrees with itself
    d = m["minus_direct"]["with_source"]["residual"]
    assert d["mean"] == pytest.approx(0.45) and 0 < d["ci95"][0] <= 0.45 <= d["ci95"][1]
    lo, hi = m["ratio_vs_direct_ci95"]["with_source"]["residual"] or (None, None)
    assert lo is None or lo <= 10.0 <= hi
    assert m["target_with_source"] == pytest.approx(0.5)
    assert m["with_source"]["source"] == 1.0 and m["with_target"]["source"] == pytest.approx(0.5)
    assert m["first_with_source"]["residual"] == 0.75 and m["first_with_target"]["source"] == 0.75

    metrics = {"schema_version": 1, "run": RUN_INFO, "agreement": m}
    gate = suite.evaluate_gate(metrics, GateConfig(min_agreement_vs_direct=12.0), "residual")
    check = next(c for c in gate.checks if c.name == "agreement_vs_direct")
    assert check.value == pytest.approx(10.0) and check.passed is False
    assert next(c for c in suite.evaluate_gate(metrics, GateConfig(min_agreement_vs_direct=8.0), "residual").checks
                if c.name == "agreement_vs_direct").passed
    assert not [c for c in suite.evaluate_gate(metrics, GateConfig(), "residual").checks
                if c.name == "agreement_vs_direct"]  # default: not checked
    metrics["gate"] = gate.to_json()
    drawn = suite.draw_charts(metrics, str(tmp_path), "S", "T")
    assert drawn.get("agreement") == "agreement.png" and (tmp_path / "agreement.png").stat().st_size > 0
    text = suite.render_report(metrics, drawn)
    assert "## Next-token agreement: every arm against direct injection" in text
    assert "| ridge + residual | 50.0% [" in text and "| 10.00x / 4.33x | 1.90x / 2.43x | +45.0 pts [" in text
    assert "![next-token agreement](agreement.png)" in text
    assert "- Next-token agreement with the source: mapped (residual) 50.0%, native target 50.0%, direct injection " \
           "5.0%: 10.00x over direct injection" in text


def mc_record():
    """hellaswag (4 options, stored): target 1/2, source 3/4, residual 3/8, direct 1/4 (= chance) on 8 items; piqa
    (an older record without `choices`: 2 from the schema) where the target is at chance."""
    hs = {"target": [1, 1, 1, 1, 0, 0, 0, 0], "source": [1, 1, 1, 1, 1, 1, 0, 0],
          "residual": [1, 1, 1, 0, 0, 0, 0, 0], "direct": [1, 1, 0, 0, 0, 0, 0, 0]}
    pq = {"target": [1, 0, 1, 0], "source": [1, 1, 1, 0], "residual": [1, 1, 0, 0]}
    arms = lambda d: {a: {"correct": c, "predictions": [0] * len(c)} for a, c in d.items()}  # noqa: E731
    return {"hellaswag": {"items": 8, "normalize": "length", "source": "x", "choices": 4, "arms": arms(hs)},
            "piqa": {"items": 4, "normalize": "length", "source": "y", "arms": arms(pq)}}


def test_mc_chance_normalised_retention():
    m = mc.metrics(mc_record(), MetricsContext(500, "residual"))
    hs, pq = m["hellaswag"], m["piqa"]
    assert (hs["choices"], hs["chance"], pq["choices"], pq["chance"]) == (4, 0.25, 2, 0.5)
    cr = hs["chance_retention"]
    assert cr["vs_target"]["residual"]["value"] == pytest.approx(0.5)  # (3/8 - 1/4) / (1/2 - 1/4)
    assert cr["vs_source"]["residual"]["value"] == pytest.approx(0.25)  # (3/8 - 1/4) / (3/4 - 1/4)
    assert cr["vs_target"]["direct"]["value"] == pytest.approx(0.0)
    # the target's margin over chance (1/4 on 8 items) is at or below zero in more than 2.5% of resamples: no interval
    assert cr["vs_target"]["residual"]["ci95"] is None
    assert set(cr["vs_target"]) == {"residual", "direct"}  # the native arms are the references
    ci = cr["vs_source"]["residual"]["ci95"]
    assert ci is not None and ci[0] <= 0.25 <= ci[1]
    assert pq["chance_retention"]["vs_target"]["residual"] == {"value": None, "ci95": None}  # target at chance
    assert pq["chance_retention"]["vs_source"]["residual"]["value"] == pytest.approx(0.0)
    checks = mc.gate(m, GateConfig(min_chance_retention=0.6), "residual")
    c = next(c for c in checks if c.name == "mc_chance_retention")
    assert (c.value, c.note, c.passed) == (pytest.approx(0.5), "hellaswag", False)
    assert not [c for c in mc.gate(m, GateConfig(), "residual") if c.name == "mc_chance_retention"]
    text = "\n".join(mc.report(m, ReportContext({}, {}, "residual", "S", "T")))
    assert "| set | chance | arm | vs native target (95% CI) | vs source (95% CI) |" in text
    assert "| hellaswag | 25.0% | residual | 50.0% | 25.0% [" in text and "| piqa | 50.0% | residual | n/a | 0.0%" in text
    summary = "\n".join(mc.summary(m, ReportContext({}, {}, "residual", "S", "T")))
    assert "it keeps 50.0% of the target's margin over chance (25.0%)" in summary


def test_ratio_ci():
    num, den = np.array([1.0, 0.0, 1.0, 1.0]), np.array([1.0, 1.0, 1.0, 0.0])
    value, ci = stats.ratio_ci(num, den, n=500)
    assert value == pytest.approx(1.0) and ci[0] <= 1.0 <= ci[1]
    assert stats.ratio_ci(num, np.zeros(4), n=100) == (None, None)
    value, ci = stats.ratio_ci(num, np.array([1.0, -1.0, 0.0, 0.5]), n=500)  # mean(den) > 0, often not resampled
    assert value == pytest.approx(0.75 / 0.125) and ci is None
    with pytest.raises(ValueError):
        stats.ratio_ci(num, den[:3])

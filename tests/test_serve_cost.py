"""launch.bench.serve_cost: the conversation workload's counts (what the prefix cache reuses), the cost model's
arithmetic, and the script end to end on tiny random models."""

import json

import pytest

from launch.bench.serve_cost import SMOKE, Workload, predict


def test_counts_follow_the_load_tools_conversations():
    """Turn k's prompt is the system prompt, k user messages and k - 1 answers; it finds the full blocks of turn
    k - 1's prefilled prompt (turn 1: the system prompt's). With the load tool's defaults that is 80.3% of the
    prompt tokens, the share its conversation runs count (80.2% on 2026-12-04, docs/serving.md)."""
    w = Workload()
    c = w.counts()
    assert [t["prompt"] for t in c] == [608, 768, 928, 1088]
    assert [t["reused"] for t in c] == [512, 576, 736, 896]  # 512 // 32, 607 // 32, 767 // 32, 927 // 32 blocks
    assert [t["new"] for t in c] == [95, 191, 191, 191]
    assert w.capacity() == 1152
    parts = {"turns": [{"P1": 1.0, "P": 1.0, "Pc": 1.0}], "D1": 1.0, "DR": 1.0}
    assert predict(w, parts)["reused_frac"] == pytest.approx(2720 / 3388)


def test_predict_is_the_cost_model():
    """serial: P1 + A D(1); batched: P + A D(R) / R; prefix: Pc + A D(R) / R; tokens/s = A / cost; TTFT from Little's
    law with the decode stretched by the prefill share."""
    w = Workload(clients=10, turns=2, answer=4, slots=2)
    parts = {"turns": [{"P1": 0.3, "P": 0.2, "Pc": 0.05}, {"P1": 0.5, "P": 0.4, "Pc": 0.15}], "D1": 0.01, "DR": 0.016}
    p = predict(w, parts)
    assert p["serial"]["cost_s"] == pytest.approx(0.4 + 4 * 0.01)
    assert p["batched"]["cost_s"] == pytest.approx(0.3 + 4 * 0.008)
    assert p["batched+prefix"]["cost_s"] == pytest.approx(0.1 + 4 * 0.008)
    for arm in ("serial", "batched", "batched+prefix"):
        assert p[arm]["tokens_per_s"] == pytest.approx(4 / p[arm]["cost_s"])
    share = 0.1 / 0.132
    assert p["batched+prefix"]["ttft_s"] == pytest.approx(10 * 0.132 - 4 * 0.016 / (1 - share))
    assert p["serial"]["ttft_s"] == pytest.approx(10 * 0.44 - 4 * 0.01)
    assert p["batched+prefix"]["x_serial"] == pytest.approx(0.44 / 0.132)


def test_script_smoke(tmp_path, capsys):
    from launch.bench import serve_cost
    out = tmp_path / "serve_cost.json"
    result = serve_cost.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["workload"]["turns"] == SMOKE.turns and len(saved["parts"]["turns"]) == SMOKE.turns
    assert saved["predicted"] == json.loads(json.dumps(predict(SMOKE, saved["parts"])))  # floats round-trip
    parts = saved["parts"]
    assert all(t[k] > 0 for t in parts["turns"] for k in ("P1", "P", "Pc")) and parts["D1"] > 0 and parts["DR"] > 0
    assert "| batched+prefix |" in capsys.readouterr().out and result["measured"] is None


def test_bad_arguments_name_the_fix(tmp_path, capsys):
    from launch.bench import serve_cost
    with pytest.raises(SystemExit) as e:
        serve_cost.main([])
    assert e.value.code == 2 and "--map is required" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="not a map directory"):
        serve_cost.main(["--map", str(tmp_path)])
    bad = tmp_path / "load.json"
    bad.write_text(json.dumps({"workload": "arrival", "results": {}}))
    with pytest.raises(SystemExit, match="--workload conversation"):
        serve_cost.main(["--smoke", "--load", str(bad)])

"""`python -m experiments.compare_runs BASE RUN ...` (docs/method.md, "How to run it"), run as a user runs it: RUN's
arm minus BASE's per item with a paired interval, the share of the gap each recovers, a measure whose items differ
reported as not compared (never paired wrongly), and a directory that is no finished run refused in one line."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compare_runs(*args):
    return subprocess.run([sys.executable, "-m", "experiments.compare_runs", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def run(root, name, residual, kl, piqa_items=4, colon=(0, 0)):
    """A finished run's eval/*.json as the main job writes them (only what compare_runs reads)."""
    d = root / name
    (d / "eval").mkdir(parents=True)
    (d / "metrics.json").write_text("{}")
    mc = {"hellaswag": {"items": 4, "source": "hs.jsonl", "arms": {
              "target": {"correct": [0, 0, 1, 0]}, "source": {"correct": [1, 1, 1, 0]},
              "residual": {"correct": residual}}},
          "piqa": {"items": piqa_items, "source": "piqa.jsonl",
                   "arms": {"residual": {"correct": [1] * piqa_items}}}}
    (d / "eval" / "mc.json").write_text(json.dumps(mc))
    (d / "eval" / "kl.json").write_text(json.dumps({"per_window": {"residual": kl}}))
    needles = {"1024": {"items": 2, "source": "r.jsonl", "arms": {"residual": {"correct": residual[:2]}}}}
    (d / "eval" / "retrieval.json").write_text(json.dumps(needles))
    ruler = {"1024": {"niah_single_colon": {"items": 2, "answers": [" 12", " 34"][: len(colon)],
                                            "arms": {"residual": {"correct": colon}}}}}
    (d / "eval" / "ruler.json").write_text(json.dumps(ruler))
    return d


def test_compare_runs_pairs_items_and_refuses_different_ones(tmp_path):
    base = run(tmp_path, "base", [0, 1, 1, 0], [0.5, 0.7])
    better = run(tmp_path, "better", [1, 1, 1, 0], [0.4, 0.7], piqa_items=3, colon=(1, 0))
    other = run(tmp_path, "other", [1, 1, 1, 0], [0.4, 0.7], colon=(1,))
    out = tmp_path / "rows.json"
    r = compare_runs(base, better, other, "--json", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "gap 50.0% -> 100.0%" in r.stdout
    got = json.loads(out.read_text())
    rows = {row["measure"]: row for row in got[str(better)]}
    hs = rows["mc.hellaswag"]
    assert hs["n"] == 4 and hs["delta"] == pytest.approx(0.25) and hs["ci95"][0] >= 0.0
    assert hs["gap_base"] == pytest.approx(0.5) and hs["gap_run"] == pytest.approx(1.0)  # target 0.25, source 0.75
    assert rows["kl"]["delta"] == pytest.approx(-0.05)
    assert rows["retrieval.1024"]["delta"] == pytest.approx(0.5) and "gap_base" not in rows["retrieval.1024"]
    assert "different items" in rows["mc.piqa"]["skipped"]
    assert rows["ruler.1024.niah_single_colon"]["delta"] == pytest.approx(0.5)
    assert "different items" in {row["measure"]: row for row in got[str(other)]}[
        "ruler.1024.niah_single_colon"]["skipped"]


def test_compare_runs_refuses_a_directory_without_a_finished_run(tmp_path):
    base = run(tmp_path, "base", [0, 1, 1, 0], [0.5, 0.7])
    r = compare_runs(base, tmp_path / "missing", "--json", tmp_path / "rows.json")
    assert r.returncode != 0 and "no metrics.json" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "rows.json").exists()

"""The prepared accelerator check (launch/bench/accelerator.py) end to end on CPU: every section runs (tiny shapes,
the kernel in interpret mode, one parity test in a subprocess) and the JSON it writes holds each section's numbers."""

import json


def test_accelerator_script_smoke(tmp_path, capsys):
    from launch.bench import accelerator
    out = tmp_path / "accelerator.json"
    result = accelerator.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["smoke"] and set(accelerator.SECTIONS) <= set(saved)
    skipped = {name: saved[name]["skipped"] for name in accelerator.SECTIONS
               if isinstance(saved[name], dict) and "skipped" in saved[name]}
    assert not skipped, skipped
    assert saved["parity"]["ok"], saved["parity"]
    assert saved["device"]["copy_GBps"] > 0 and saved["device"]["matmul_f32_TFLOPs"] > 0
    assert {r["impl"] for r in saved["kernel"]} >= {"xla f32"}
    assert all(r["rel_err_vs_xla"] is None or r["rel_err_vs_xla"] < 2e-2 for r in saved["kernel"])
    assert [(r["batch"], r["keys_transposed"]) for r in saved["decode"]] == [(1, False), (1, True), (4, False), (4, True)]
    assert all(r["tokens_per_s"] > 0 and r["roofline_frac"] > 0 for r in saved["decode"])
    (ttft,) = saved["ttft"]
    assert ttft["split_ms"] > 0 and set(ttft["split_phases_ms"]) == {"source_prefill", "map", "first_token"}
    assert result["table"] in capsys.readouterr().out

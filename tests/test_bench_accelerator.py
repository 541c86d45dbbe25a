"""The prepared accelerator check (launch/bench/accelerator.py) end to end on CPU: every section runs (tiny shapes,
the kernel in interpret mode, one parity test in a subprocess), the Pallas kernel's output equals the XLA map's, and
the JSON it writes holds numbers that follow from the shapes and the times they are computed from."""

import argparse
import dataclasses
import json

import pytest

# launch.bench.kernel's smoke shapes: target layers, source / target KV heads, head_dim, ranks (ridge, residual), tokens
LT, HS, HT, HD, RANK, RES, TOKENS = 3, 2, 2, 32, 16, 4, 48


def kernel_weight_bytes(backend: str, itemsize: int) -> int:
    """Bytes of one packed map pair (K and V, every target layer; kvjax.kernels.map_insert.pack_maps): the matmul
    operands at `itemsize`, padded to the backend's sizes; mean, residual bias and bias in float32."""
    from kvjax.kernels.map_insert import padded_size
    rp, hp = padded_size(RANK, backend), padded_size(RES, backend)
    fx, fy = HS * HD, HT * HD
    per_map = (fx * rp + fx * hp + rp * fy + hp * fy) * itemsize + (fx + hp + fy) * 4
    return 2 * LT * per_map


def check_kernel(rows: list) -> None:
    """The Pallas kernel (both weight dtypes) against the XLA map on the same inputs, and each row's bytes, rates and
    fractions from the shapes and its own time."""
    fx, fy = HS * HD, HT * HD
    io = 2 * LT * TOKENS * (fx + fy) * 2  # paired source K/V read + target K/V written, bf16 caches
    flops = 2 * 2 * LT * TOKENS * (RANK + RES) * (fx + fy)
    xla_weights = 4 * (fx * RANK + RANK * fy + fx * RES + RES * fy) * LT * 2
    want = {"xla f32": (xla_weights, False),
            "pallas triton (interpret) bf16 weights": (kernel_weight_bytes("triton", 2), True),
            "pallas triton (interpret) f32 weights": (kernel_weight_bytes("triton", 4), True)}
    assert [r["impl"] for r in rows] == list(want) and {r["tokens"] for r in rows} == {TOKENS}
    for r in rows:
        weights, compared = want[r["impl"]]
        assert r["weight_bytes"] == weights and r["bytes"] == io + weights, r["impl"]
        assert r["GB/s"] == pytest.approx(r["bytes"] / (r["ms"] / 1e3) / 1e9, rel=1e-9)
        assert r["bw_frac"] == pytest.approx(r["GB/s"] / r["copy_GBps"], rel=1e-9)
        assert r["TFLOP/s"] == pytest.approx(flops / (r["ms"] / 1e3) / 1e12, rel=1e-9)
        if not compared:
            assert r["rel_err_vs_xla"] is None
        else:  # the kernel's output equals the XLA map's (bf16 caches: to bf16 rounding)
            assert 0 <= r["rel_err_vs_xla"] < 2e-2, r


def check_decode(rows: list, copy_GBps: float) -> None:
    """The bytes a decode step must read, from the tiny target's shapes; the roofline from them and the copy rate."""
    from kvjax.cache import window_sizes
    from launch.bench.accelerator import TINY_TARGET
    t = argparse.Namespace(**TINY_TARGET)
    per_layer = (t.hidden_size * (t.num_heads + 2 * t.num_kv_heads) * t.head_dim + t.num_heads * t.head_dim
                 * t.hidden_size + 2 * t.head_dim + 2 * t.hidden_size + 3 * t.hidden_size * t.intermediate_size)
    weights = 4 * (t.num_layers * per_layer + t.hidden_size + t.hidden_size * t.vocab_size)  # f32, no embedding
    ctx, steps = 64, 4  # --smoke
    window = next(w for w in window_sizes(ctx + 2 * steps + 64) if w >= ctx + 2 * steps)
    assert [(r["batch"], r["keys_transposed"]) for r in rows] == [(1, False), (1, True), (4, False), (4, True)]
    for r in rows:
        kv = 2 * t.num_layers * r["batch"] * t.num_kv_heads * window * t.head_dim * 4
        assert r["context"] == ctx and r["weights_GB"] * 1e9 == pytest.approx(weights, rel=1e-12)
        assert r["kv_window_GB"] * 1e9 == pytest.approx(kv, rel=1e-12)
        assert r["roofline_ms"] == pytest.approx((weights + kv) / (copy_GBps * 1e9) * 1e3, rel=1e-9)
        assert r["roofline_frac"] == pytest.approx(r["roofline_ms"] / r["ms_per_step"], rel=1e-9)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / (r["ms_per_step"] / 1e3), rel=1e-9)


def check_ttft(rows: list) -> None:
    """One repeat: each arm's time is the sum of its phases, and the ratios are of those times."""
    (ttft,) = rows
    assert ttft["tokens"] == 64 and ttft["map_impl"] == "xla"
    assert set(ttft["split_phases_ms"]) == {"source_prefill", "map", "first_token"}
    assert set(ttft["target_native_phases_ms"]) == set(ttft["source_native_phases_ms"]) == {"prefill", "first_token"}
    for arm in ("split", "target_native", "source_native"):
        assert ttft[f"{arm}_ms"] == pytest.approx(sum(ttft[f"{arm}_phases_ms"].values()), rel=1e-9), arm
    assert ttft["split_vs_target"] == pytest.approx(ttft["split_ms"] / ttft["target_native_ms"], rel=1e-9)
    assert ttft["split_vs_source"] == pytest.approx(ttft["split_ms"] / ttft["source_native_ms"], rel=1e-9)


def check_speculative(rows: list) -> None:
    """One row per block size; the break-even tau is the round's cost in plain steps (c_verify + c_draft)."""
    assert [r["block"] for r in rows] == [2, 4]
    for r in rows:
        assert r["context"] == 64 and r["step_ms"] > 0 and r["c_verify"] > 0
        assert r["break_even_tau"] == pytest.approx(r["c_verify"] + r["c_draft"], rel=1e-12)
        assert r["drafter_layers"] == 1 and r["feature_layers"] == [1]
        assert r["c_draft_model"] >= 0 and r["model_drafter_layers"] == 1 and r["model_drafter_hidden"] == 32
        assert r["break_even_tau_model"] == pytest.approx(r["c_verify"] + r["c_draft_model"], rel=1e-12)


def check_serving(sec: dict) -> None:
    """The smoke workload priced at its middle turn; the prediction is the cost model's on those parts."""
    from launch.bench.serve_cost import SMOKE, predict
    assert sec["workload"] == dataclasses.asdict(SMOKE) and sec["priced_at_turn"] == 2
    assert [t["turn"] for t in sec["parts"]["turns"]] == [2]
    assert sec["predicted"] == json.loads(json.dumps(predict(SMOKE, sec["parts"])))  # floats round-trip


def test_accelerator_script_smoke(tmp_path, capsys):
    import jax

    from launch.bench import accelerator
    out = tmp_path / "accelerator.json"
    result = accelerator.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["smoke"] and set(accelerator.SECTIONS) <= set(saved)
    skipped = {name: saved[name]["skipped"] for name in accelerator.SECTIONS
               if isinstance(saved[name], dict) and "skipped" in saved[name]}
    assert not skipped, skipped
    assert saved["parity"]["ok"] and "1 passed" in saved["parity"]["summary"], saved["parity"]
    dev = saved["device"]
    assert (dev["platform"], dev["devices"]) == ("cpu", jax.device_count())
    assert dev["copy_GBps"] > 0 and dev["matmul_f32_TFLOPs"] > 0
    check_kernel(saved["kernel"])
    check_decode(saved["decode"], dev["copy_GBps"])
    check_speculative(saved["speculative"])
    check_ttft(saved["ttft"])
    check_serving(saved["serving"])
    printed = capsys.readouterr().out
    assert result["table"] in printed and result["table"] == saved["table"]
    assert len([line for line in result["table"].splitlines() if line.startswith("| map+insert")]) == 3


def test_kernel_benchmark_flags_a_kernel_that_differs_from_the_xla_map(monkeypatch):
    """Positive control of the comparison above: a 'kernel' that returns other caches is reported as a mismatch."""
    from launch.bench import kernel
    monkeypatch.setattr(kernel.mi, "map_insert_call", lambda sk, sv, tk, tv, pk, pv, **kw: (tk + 1e4, tv))
    args = argparse.Namespace(smoke=True, lengths=[TOKENS], rank=RANK, backends=None, repeats=1, block_t=None,
                              tolerance=2e-2)
    with pytest.raises(SystemExit, match="kernel does not match the XLA path"):
        kernel.bench_device(args)

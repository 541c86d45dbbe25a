"""The pure parts of the load tool (launch/bench/load.py, launch/bench/load_workloads.py): workload prompts, the offline reference's grouping, arms,
/metrics parsing and the per-turn and arrival summaries. No server, no models."""

import numpy as np
import pytest

from launch.bench import load
from launch.bench import load_report
from launch.bench import load_workloads as workloads


def windows(rows=12, width=40):
    return np.arange(rows * width, dtype=np.int64).reshape(rows, width) % 1000


def args(*argv):
    return load.args_parser().parse_args(list(argv))


def test_heldout_span_continues_into_the_next_row_and_wraps():
    w = windows(rows=3, width=4)
    assert workloads.heldout_span(w, 2, 4) == [2, 3, 4, 5]
    assert workloads.heldout_span(w, 10, 4) == [10, 11, 0, 1]


def test_conversation_parts_share_the_system_prompt_and_keep_user_messages_apart():
    w = windows()
    system, users = workloads.conversation_parts(w, conversations=5, turns=3, system_tokens=50, user_tokens=8)
    assert system == list(range(50))
    assert len(users) == 5 and all(len(u) == 3 and all(len(m) == 8 for m in u) for u in users)
    flat = [tuple(m) for u in users for m in u]
    assert len(set(flat)) == len(flat)  # distinct per conversation and turn
    assert not set(t for m in flat for t in m) & set(system)  # other rows than the system prompt's
    # more messages than free rows: the second pass starts further into each row
    _, users = workloads.conversation_parts(w, conversations=8, turns=2, system_tokens=40, user_tokens=8)
    flat = [tuple(m) for u in users for m in u]
    assert len(set(flat)) == len(flat) and flat[11][0] == 40 + 8  # message 11: row 1 again, 8 further
    with pytest.raises(ValueError, match="do not fit"):
        workloads.conversation_parts(w, conversations=100, turns=4, system_tokens=40, user_tokens=8)


def test_turn_prompt_is_system_then_the_user_answer_pairs_then_this_turns_user():
    system, users, answers = [1, 2], [[10], [20, 21], [30]], [[11, 12], [22], [33]]
    assert workloads.turn_prompt(system, users, answers, 0) == [1, 2, 10]
    assert workloads.turn_prompt(system, users, answers, 1) == [1, 2, 10, 11, 12, 20, 21]
    assert workloads.turn_prompt(system, users, answers[:2], 2) == [1, 2, 10, 11, 12, 20, 21, 22, 30]
    # each turn's prompt extends the previous one: a prefix cache can reuse it
    assert workloads.turn_prompt(system, users, answers, 2)[:7] == workloads.turn_prompt(system, users, answers, 1)


def test_arrival_prompts():
    short, long = workloads.arrival_prompts(windows(), decoders=3, short_tokens=16, long_tokens=100)
    assert [len(p) for p in short] == [16, 16, 16] and len(long) == 100
    assert short[1][0] == 40 and long[:2] == [120, 121] and long[40] == 160  # row 3 on, across rows


def test_offline_grouping_and_eos_cut():
    prompts = [[1] * 5, [2] * 3, [3] * 5, [4] * 5, [5] * 3]
    assert workloads.equal_length_groups(prompts, 2) == [[0, 2], [3], [1, 4]]
    assert workloads.equal_length_groups(prompts, 1) == [[0], [2], [3], [1], [4]]
    assert [workloads.padded_rows(n, 8) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert workloads.padded_rows(3, 1) == 1
    assert workloads.cut_at_eos(np.array([5, 7, 0, 0]), {0}) == [5, 7, 0]
    assert workloads.cut_at_eos([5, 7], {0}) == [5, 7]


def test_cached_recomputes_only_when_the_key_changes(tmp_path):
    calls = []

    def compute():
        calls.append(1)
        return {"answers": [[len(calls)]]}
    assert workloads.cached(str(tmp_path), "x.json", "k1", compute)["answers"] == [[1]]
    assert workloads.cached(str(tmp_path), "x.json", "k1", compute)["answers"] == [[1]]
    assert workloads.cached(str(tmp_path), "x.json", "k2", compute)["answers"] == [[2]]


def test_parse_arm():
    a = args("--prefix-mb", "64", "--max-step-tokens", "128")
    assert load.parse_arm("serial", a) == ("serial", [])
    assert load.parse_arm("batched+prefix", a) == ("batched", ["--prefix-cache-mb", "64"])
    assert load.parse_arm("batched+prefix+chunked", a) == (
        "batched", ["--prefix-cache-mb", "64", "--max-step-tokens", "128"])
    assert load.parse_arm("batched+prefix", args("--prefix-block", "16"))[1][-2:] == ["--prefix-block", "16"]
    for bad in ("batched+turbo", "pipelined"):
        with pytest.raises(ValueError):
            load.parse_arm(bad, a)
    # the server's own checks, before the offline reference runs: it would refuse these at start
    with pytest.raises(ValueError, match=r"max_step_tokens must be 0 \(off\) or >= 16"):
        load.parse_arm("batched+chunked", args("--max-step-tokens", "8"))
    with pytest.raises(ValueError, match="use --topology=batched"):
        load.parse_arm("serial+chunked", a)
    # speculative decoding: the server's --speculative with the drafter's settings given to the tool
    assert load.parse_arm("batched+lookup", a) == ("batched", ["--speculative", "lookup"])
    d = args("--draft-len", "8", "--drafter", "DIR", "--draft-policy", "always")
    assert load.parse_arm("batched+prefix+combined", d)[1][-8:] == [
        "--speculative", "combined", "--draft-len", "8", "--drafter", "DIR", "--draft-policy", "always"]
    assert "--drafter" not in load.parse_arm("batched+lookup", d)[1]
    with pytest.raises(ValueError, match="--drafter DIR"):
        load.parse_arm("batched+block", a)
    with pytest.raises(ValueError, match="one drafter"):
        load.parse_arm("batched+lookup+block", d)


def test_defaults_and_workload_checks():
    a = args()
    assert (a.workload, a.turns, a.system_tokens, a.user_tokens, a.decoders, a.long_tokens, a.decode_tokens) == (
        "independent", 4, 512, 96, 32, 2000, 512)
    assert (a.repeats, a.file_tokens, a.lead_lines) == (1, 384, 2)
    assert load.check_args(a) == []
    assert load.check_args(args("--workload", "conversation", "--soak", "5"))
    assert load.check_args(args("--repeats", "0")) and load.check_args(args("--repeats", "2", "--soak", "5"))
    assert load.check_args(args("--workload", "code", "--file-tokens", "2"))
    assert not load.check_args(args("--workload", "code", "--repeats", "3"))


class Words:
    """A stand-in tokenizer: one id per character."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def encode(self, text):
        return type("Encoding", (), {"ids": [ord(c) for c in text]})()


def test_code_prompts_quote_a_file_and_start_its_edited_copy():
    text = "def load(path):\n    return open(path).read()\n\npath = load(path)\n"
    prompt = workloads.code_edit_prompt(text, "io.py", lead_lines=1)
    assert "every `path` renamed to `path_v2`" in prompt  # the most frequent word of 4+ letters
    assert prompt.count(text) == 1 and prompt.endswith("--- io.py (edited)\ndef load(path_v2):\n")
    rows = np.array([[ord(c) for c in "partial line\n" + text + "cut"]] * 4)
    files = workloads.code_files(rows, Words(), 2, rows.shape[1])
    assert files == [text, text]  # whole lines: the partial first and last lines are dropped
    prompts = workloads.code_prompts(rows, Words(), 2, rows.shape[1], 2)
    assert [Words().decode(p).count(text) for p in prompts] == [1, 1] and "file1.py" in Words().decode(prompts[1])


METRICS_BEFORE = """# HELP kvjax_active_slots decode slots holding a request
# TYPE kvjax_active_slots gauge
kvjax_active_slots 0.0
kvjax_requests_total{outcome="ok",path="split"} 3.0
kvjax_requests_total{outcome="error",path="split"} 1.0
kvjax_prefix_lookups_total 10.0
kvjax_prefix_hits_total 4.0
kvjax_prefix_lookup_tokens_total 1000.0
kvjax_prefix_reused_tokens_total 300.0
kvjax_prefix_evictions_total 0.0
kvjax_prefix_bytes 1.5e+06
kvjax_prefix_blocks 12.0
"""


def test_parse_metrics_and_prefix_stats():
    before = load.parse_metrics(METRICS_BEFORE)
    assert before["kvjax_requests_total"] == 4.0 and before["kvjax_prefix_bytes"] == 1.5e6
    after = dict(before, kvjax_prefix_lookups_total=30.0, kvjax_prefix_hits_total=19.0,
                 kvjax_prefix_lookup_tokens_total=3000.0, kvjax_prefix_reused_tokens_total=1300.0,
                 kvjax_prefix_evictions_total=2.0, kvjax_prefix_bytes=2e6)
    s = load.prefix_stats(before, after)
    assert (s["prefix_lookups"], s["prefix_hits"], s["prefix_evictions"]) == (20.0, 15.0, 2.0)
    assert s["prefix_hit_rate"] == 0.75 and s["prefix_reused_frac"] == 0.5
    assert s["prefix_bytes_after"] == 2e6 and s["prefix_blocks_after"] == 12.0
    # a server without the prefix cache: zero counts, NaN rates and gauges
    s = load.prefix_stats({}, load.parse_metrics("kvjax_active_slots 0.0\n"))
    assert s["prefix_lookups"] == 0 and np.isnan(s["prefix_hit_rate"]) and np.isnan(s["prefix_bytes_after"])


def test_draft_stats_are_the_levels_deltas_per_drafter():
    before = """kvjax_decode_steps_total{kind="draft"} 10.0
kvjax_decode_steps_total{kind="plain"} 5.0
kvjax_drafted_tokens_total{drafter="lookup"} 40.0
kvjax_accepted_tokens_total{drafter="lookup"} 20.0
kvjax_acceptance_length_sum{drafter="lookup"} 50.0
kvjax_acceptance_length_count{drafter="lookup"} 20.0
"""
    after = before.replace("10.0", "30.0").replace("40.0", "100.0").replace("50.0", "110.0") + (
        'kvjax_acceptance_length_sum{drafter="none"} 4.0\nkvjax_acceptance_length_count{drafter="none"} 4.0\n'
        'kvjax_acceptance_length_count{drafter="lookup"} 50.0\nkvjax_accepted_tokens_total{drafter="lookup"} 50.0\n'
        'kvjax_step_cost_seconds{rows="16",width="9"} 0.004\nkvjax_step_cost_seconds{rows="16",width="0"} 0.002\n'
        'kvjax_step_cost_seconds{rows="2",width="17"} 0.003\n')
    after = after.replace('kvjax_acceptance_length_count{drafter="lookup"} 20.0\n', "").replace(
        'kvjax_accepted_tokens_total{drafter="lookup"} 20.0\n', "")
    s = load.draft_stats(before, after)
    assert (s["draft_steps"], s["plain_steps"]) == (20.0, 0.0)
    assert s["drafters"]["lookup"] == {"drafted": 60.0, "accepted": 30.0, "rounds": 30.0, "acceptance_length": 2.0}
    assert s["drafters"]["none"]["acceptance_length"] == 1.0 and s["acceptance_length"] == (60 + 4) / 34
    assert list(s["step_costs"].items()) == [("2x17", 0.003), ("16x0", 0.002), ("16x9", 0.004)]  # by rows, width
    assert load.draft_stats("", "kvjax_active_slots 0.0\n") == {}  # a server that does not draft


def test_interleaved_repeats_report_medians_and_paired_ratios():
    def level(c, rep, tps, **kw):
        return dict(concurrency=c, repeat=rep, tokens_per_s=tps, mismatches=0, errors=0, ttft_p50=0.1, itl_p50=0.01,
                    tpot_p50=0.005, e2e_p50=1.0, **kw)
    results = {"batched": [level(1, r, t) for r, t in enumerate((100, 50, 100))],
               "batched+lookup": [level(1, r, t, draft_steps=5, plain_steps=1,
                                        drafters={"lookup": {"acceptance_length": 3.0, "rounds": 10}})
                                  for r, t in enumerate((160, 90, 150))]}
    rows = load_report.compare_table(results)
    spec = next(r for r in rows if r.startswith("| batched+lookup | 1 |"))
    # ratios per repeat 1.6, 1.8, 1.5: median 1.6 (the unpaired medians would give 150 / 100)
    assert "| 150 | 1.600 (1.50-1.80) |" in spec and "| 15 / 3 | lookup 3.00 |" in spec
    assert "| 1.000 (1.00-1.00) |" in next(r for r in rows if r.startswith("| batched | 1 |"))


def rec(turn, ttft, match=True, error=None):
    return {"turn": turn, "ttft": ttft, "match": match, "error": error, "ids": [1], "itl": [], "e2e": ttft,
            "retries": 0, "hung": False}


def test_turn_summary():
    records = [rec(1, 1.0), rec(1, 3.0), rec(2, 0.5, match=False), rec(3, 0.25), rec(2, 9.0, error="boom")]
    s = load_report.turn_summary(records)
    assert s["ttft_turn1_p50"] == 2.0 and s["ttft_later_p50"] == 0.375
    assert s["per_turn"]["2"] == {"n": 1, "ttft_p50": 0.5, "ttft_p99": 0.5, "mismatches": 1}
    assert sorted(s["per_turn"]) == ["1", "2", "3"]


def test_arrival_summary_windows():
    # two decoders stepping every 0.1 s; the long prompt is sent at t=1.0 and its first token comes at t=1.5,
    # the decoders stalled meanwhile (one 0.5 s gap each)
    times = [0.1 * i for i in range(11)] + [1.5, 1.6, 1.7]
    decoders = [{"times": times, "match": True}, {"times": [t + 0.01 for t in times], "match": True}]
    long = {"t0": 1.0, "times": [1.5], "match": True}
    s = load_report.arrival_summary(decoders, long)
    assert s["long_ttft"] == pytest.approx(0.5)
    # the stalled gaps, and decoder 2's gap that straddles the submission (0.91 -> 1.01)
    assert s["gaps_during"] == 3 and s["itl_during_p99"] == pytest.approx(0.5)
    assert s["gaps_before"] == 10 and s["itl_before_p99"] == pytest.approx(0.1)  # gaps ending in (0.5, 1.0]
    assert s["itl_p99_ratio"] == pytest.approx(5.0)
    assert s["decoders_streaming_at_long_first_token"] == 2
    assert s["slowest_steps_during"][0] == (pytest.approx(0.5), 1, pytest.approx(0.5))  # half of two decoders
    # the long request failed: no window
    s = load_report.arrival_summary(decoders, {"t0": 1.0, "times": [], "match": False})
    assert np.isnan(s["itl_p99_ratio"])


def test_slow_steps_are_the_gaps_that_end_together():
    # four decoders: a step at t = 1.00 they all waited 20 ms in, one at 1.05 they all waited 50 ms in (their tokens
    # reaching the clients within 3 ms), and a 300 ms gap of one decoder alone at 1.2 (a client's, not a step)
    gaps = [(1.0 - 0.02, 1.0 + 0.001 * i) for i in range(4)] + [(1.0, 1.05 + 0.001 * i) for i in range(4)]
    gaps.append((0.9, 1.2))
    steps = load_report.slow_steps(gaps, decoders=4, t0=0.5)
    assert [(t, n) for t, n, _ in steps] == [(0.55, 4), (0.5, 4)]
    assert steps[0][2] == pytest.approx(0.052) and steps[1][2] == pytest.approx(0.022)  # the (upper) median
    assert load_report.slow_steps([], decoders=4, t0=0.0) == []


def test_progress_waits_for_every_decoder():
    import asyncio

    async def go():
        progress, a, b = load.Progress(2, lead=3), {"ids": [1]}, {"ids": [1]}
        progress(a)
        assert not progress.first.is_set()
        progress(b)
        assert progress.first.is_set() and not progress.led.is_set()
        a["ids"] += [2, 3]
        progress(a)
        b["ids"] += [2, 3, 4]
        progress(b)
        assert progress.led.is_set()
    asyncio.run(go())


def test_summarize_keeps_its_fields():
    out = load_report.summarize([rec(1, 1.0)], 2.0, 1, 0, "kvjax_active_slots 0.0\n", {"status": "ok"}, [(0.0, 100.0)])
    assert out["tokens_per_s"] == 0.5 and out["active_slots_after"] == 0.0 and out["mismatches"] == 0


def test_plan_shapes_the_server(monkeypatch, tmp_path):
    a = args("--workload", "conversation", "--concurrency", "2", "--turns", "2", "--system-tokens", "64",
             "--user-tokens", "32", "--new-tokens", "8")
    monkeypatch.setattr(workloads, "heldout_windows", lambda: windows(rows=20, width=100))

    def reference(a, system, users, out_dir, offline=None):
        answers = [[[7] * 8 for _ in u] for u in users]
        prompts = [[workloads.turn_prompt(system, u, ans, k) for k in range(len(u))] for u, ans in zip(users, answers)]
        return prompts, answers, "split"
    monkeypatch.setattr(workloads, "conversation_reference", reference)
    plan = workloads.conversation_plan(a, str(tmp_path))
    assert plan.warmup == (96, 136) and plan.capacity == 256 and plan.per_client == 2
    jobs = list(plan.jobs(3)(2))  # client 2 of 3 runs conversation 0
    assert [j["tags"]["turn"] for j in jobs] == [1, 2] and jobs[0]["tags"]["conversation"] == 0
    assert jobs[1]["prompt"][:96] == jobs[0]["prompt"]


def test_arrival_plan_fits_the_long_prompt(monkeypatch, tmp_path):
    a = args("--workload", "arrival", "--decoders", "2", "--long-tokens", "512", "--decode-tokens", "32")
    monkeypatch.setattr(workloads, "heldout_windows", lambda: windows(rows=20, width=100))
    monkeypatch.setattr(workloads, "arrival_reference",
                        lambda a, short, long, out_dir, offline=None: ([[1]] * len(short), [1], "split"))
    plan = workloads.arrival_plan(a, str(tmp_path))
    assert plan.capacity == 640 and plan.warmup == (256, 512) and len(plan.arrival["short"]) == 2


def test_help_mentions_the_workloads():
    text = load.args_parser().format_help()
    assert "--workload" in text and "code editing" in text and "--repeats" in text

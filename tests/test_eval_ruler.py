"""Evaluation `ruler` (kvjax.eval.suite.ruler, items from kvjax.eval.ruler_tasks): every task's items on the shipped
toy tokenizer (exact lengths, each fact once, the answer the fact's value, distractors that differ, the variable chain
resolving to the answer, deterministic in the seed), clear errors for a tokenizer that cannot score them, the metrics,
report, gate and chart of a hand-made record, the registry entry, and one scoring pass on tiny random models checked
against a no-cache forward."""

from __future__ import annotations

import dataclasses
import os
import re
import types

import numpy as np
import pytest

import kvjax
from kvjax.eval.ruler_tasks import TASK_NAMES, TASKS, UNSEEN, Sizes, make_task_items
from kvjax.eval.suite import ruler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(REPO, "checkpoints", "toy")


@pytest.fixture(scope="module")
def tok():
    return kvjax.load_tokenizer(os.path.join(TOY, "tokenizer"))


@pytest.fixture(scope="module")
def heldout():
    return np.load(os.path.join(TOY, "eval", "heldout_windows.npy"))[:40].reshape(-1).astype(np.int64)


def texts(tok, items) -> list[str]:
    return [tok.decode(it.prompt_ids) for it in items]


def test_every_task_builds_exact_lengths_deterministically(tok, heldout):
    for task in TASK_NAMES:
        for length in (256, 1024):
            items = make_task_items(task, heldout, tok, length, 6, seed=3)
            assert [len(it.prompt_ids) for it in items] == [length] * 6, task
            assert all(it.length == length for it in items)
            again = make_task_items(task, heldout, tok, length, 6, seed=3)
            assert [it.prompt_ids for it in again] == [it.prompt_ids for it in items], task
            assert [it.answer_ids for it in again] == [it.answer_ids for it in items]
            other = make_task_items(task, heldout, tok, length, 6, seed=4)
            assert [it.prompt_ids for it in other] != [it.prompt_ids for it in items], task
            for it in items:
                assert it.answer_ids == kvjax_encode(tok, it.answer)
                assert tok.decode(it.answer_ids) == it.answer
                lo, hi = Sizes().depth
                assert lo * (length - 200) - 1 <= it.needle_position <= hi * length + 64, (task, it.needle_position)
    # the tasks do not share draws: their first items differ
    firsts = {t: make_task_items(t, heldout, tok, 256, 1, seed=3)[0].prompt_ids for t in TASK_NAMES}
    assert len({tuple(p) for p in firsts.values()}) == len(TASK_NAMES)


def kvjax_encode(tok, text):
    from kvjax.eval.multiple_choice import encode
    return encode(tok, text)


SINGLE = {  # task -> (regex of the needle with the key, regex of the query at the prompt's end)
    "niah_single_kv": (r"\n{key} = (\d+)\n", r"\n(_[a-z]+_[a-z]{{4}}) =$"),
    "niah_single_secret": (r"\nThe secret code for {key} is (\d+)\.\n", r"\nThe secret code for ([a-z]+) is$"),
    "niah_single_json": (r'\n"{key}": "(\d+)",\n', r'\n"([0-9a-f]{{8}}-[0-9a-f]{{4}})": "$'),
    "niah_single_colon": (r"\n{key}: (\d+)\n", r"\n([a-z]+):$"),
}


@pytest.mark.parametrize("task", sorted(SINGLE))
def test_single_needle_is_present_once_and_holds_the_answer(task, tok, heldout):
    needle_re, query_re = SINGLE[task]
    items = make_task_items(task, heldout, tok, 512, 8, seed=1)
    for it, text in zip(items, texts(tok, items)):
        key = re.search(query_re.format(), text).group(1)
        found = re.findall(needle_re.format(key=re.escape(key)), text)
        assert len(found) == 1, (task, key, found)
        assert it.answer.strip() == found[0]
        assert text.count(found[0]) == 1  # the haystack does not hold the value
        assert len(found[0]) == Sizes().value_digits and found[0][0] != "0"
        tail = tok.decode(it.prompt_ids[it.needle_position:])
        assert re.match(needle_re.format(key=re.escape(key)), tail), (task, tail[:60])


def test_multikey_asks_one_key_among_distractors(tok, heldout):
    n = 5
    items = make_task_items("niah_multikey", heldout, tok, 1024, 8, seed=2, sizes=Sizes(needles=n))
    asked_at = set()
    for it, text in zip(items, texts(tok, items)):
        facts = re.findall(r"\n(_[a-z]+_[a-z]{4}) = (\d+)\n", text)
        assert len(facts) == n
        keys, values = zip(*facts)
        assert len(set(keys)) == n and len(set(values)) == n  # the distractors differ in key and value
        asked = re.search(r"\n(_[a-z]+_[a-z]{4}) =$", text).group(1)
        assert dict(facts)[asked] == it.answer.strip()
        assert [v for k, v in facts if k != asked] and all(v != it.answer.strip() for k, v in facts if k != asked)
        asked_at.add(keys.index(asked))
        assert tok.decode(it.prompt_ids[it.needle_position:]).startswith(f"\n{asked} =")
    assert len(asked_at) > 1  # the asked needle is not always the same one


def test_multivalue_answers_every_value_in_order(tok, heldout):
    items = make_task_items("niah_multivalue", heldout, tok, 1024, 6, seed=2, sizes=Sizes(values=4))
    for it, text in zip(items, texts(tok, items)):
        key = re.search(r"\n(_[a-z]+_[a-z]{4}) =$", text).group(1)
        values = re.findall(rf"\n{re.escape(key)} = (\d+)\n", text)
        assert len(values) == 4 and len(set(values)) == 4
        assert it.answer == " " + ", ".join(values)
        assert it.answer_ids == kvjax_encode(tok, it.answer)


def test_variable_tracking_chain_resolves_to_the_answer(tok, heldout):
    asked_first = []
    for chain, chains in ((2, 1), (4, 2), (3, 3)):
        items = make_task_items("vt", heldout, tok, 1024, 6, seed=5, sizes=Sizes(chain=chain, chains=chains))
        for it, text in zip(items, texts(tok, items)):
            lines = re.findall(r"\nVAR ([A-Z]{5}) = ([A-Z]{5}|\d+)\n", text)
            assert len(lines) == chain * chains
            assigned, order = dict(lines), [name for name, _ in lines]
            assert len(assigned) == chain * chains  # every variable assigned once
            numbers = [v for _, v in lines if v.isdigit()]
            assert len(numbers) == chains == len(set(numbers))  # the other chains hold other values
            var, hops = re.search(r"\nassert ([A-Z]{5}) ==$", text).group(1), 0
            while not assigned[var].isdigit():
                assert order.index(assigned[var]) < order.index(var)  # assigned before it is read
                var, hops = assigned[var], hops + 1
            assert hops == chain - 1 and assigned[var] == it.answer.strip()
            assert text.count(it.answer.strip()) == 1
            assert tok.decode(it.prompt_ids[it.needle_position:]).startswith(f"\nVAR {var} = {assigned[var]}\n")
            asked_first.append(order.index(var) == 0)
    assert not all(asked_first)  # the chains interleave: the asked chain does not always come first


def test_the_toy_tokenizer_scores_every_format(tok):
    ruler.check_formats(tok, ruler.RulerEval(), draws=20)
    for task in TASK_NAMES:  # the answer is one token per digit, after a space where the format has one
        it = make_task_items(task, np.arange(3, 4000), tok, 256, 1)[0]
        digits = [d for d in it.answer_ids if tok.decode([d]).isdigit()]
        assert len(digits) == len(it.answer.replace(",", "").replace(" ", ""))


class CharTokenizer:
    """One token per character (ids 3..130, newline 131), optionally merging a character with the next one when
    `merge(a, b)` says so: a tokenizer that can be made to merge a query with its answer."""

    def __init__(self, merge=None):
        self.merge = merge or (lambda a, b: False)

    def _id(self, s: str) -> int:
        return 131 if s == "\n" else 3 + (ord(s) - 32) % 128

    def encode(self, text, add_special_tokens=False):
        out, i = [], 0
        while i < len(text):
            if i + 1 < len(text) and self.merge(text[i], text[i + 1]):
                out.append(140 + (ord(text[i]) + ord(text[i + 1])) % 19)
                i += 2
            else:
                out.append(self._id(text[i]))
                i += 1
        return out


def test_a_tokenizer_that_merges_query_and_answer_is_a_clear_error():
    hay = np.random.RandomState(0).randint(3, 130, 2000)
    for task in TASK_NAMES:  # a plain character tokenizer scores every task
        assert len(make_task_items(task, hay, CharTokenizer(), 300, 2)[0].prompt_ids) == 300
    merges_space = CharTokenizer(lambda a, b: b == " " and a != " ")  # "=" + " 1" -> "= " "1"
    with pytest.raises(ValueError, match="niah_single_kv: this tokenizer merges the query .* tokenize separately"):
        make_task_items("niah_single_kv", hay, merges_space, 300, 1)
    with pytest.raises(ValueError, match="tokenize separately"):
        ruler.check_formats(merges_space, ruler.RulerEval(tasks=("niah_single_colon",)))
    merges_dot = CharTokenizer(lambda a, b: a.isdigit() and b == ".")  # "...3." in the needle, "...3" answered
    with pytest.raises(ValueError, match="niah_single_secret: the needle .* cannot be copied"):
        make_task_items("niah_single_secret", hay, merges_dot, 300, 1)
    make_task_items("niah_single_colon", hay, merges_dot, 300, 1)  # no "." after the value there
    with pytest.raises(ValueError, match="needs at least .* held-out tokens"):
        make_task_items("niah_single_kv", hay[:100], CharTokenizer(), 300, 1)
    with pytest.raises(ValueError, match="vt: a prompt of 96 tokens cannot hold"):
        make_task_items("vt", hay, CharTokenizer(), 96, 1)
    with pytest.raises(ValueError, match="depth"):
        make_task_items("niah_single_kv", hay, CharTokenizer(), 300, 1, sizes=Sizes(depth=(0.5, 0.2)))


# ---- metrics, report, gate, chart from a hand-made record -----------------------------------------------------------

def record() -> dict:
    def row(unseen, **arms):
        return {"items": len(next(iter(arms.values()))), "unseen": unseen, "answers": [" 1"] * 4,
                "answer_tokens": [4] * 4,
                "arms": {a: {"correct": c, "answer_logprob": [-float(i) for i in range(len(c))],
                             "prefix": [4 if x else i % 4 for i, x in enumerate(c)]} for a, c in arms.items()}}
    return {
        "2048": {"niah_single_kv": row(False, target=[0, 0, 0, 0], residual=[1, 0, 0, 0]),
                 "niah_single_secret": row(True, target=[0, 0, 0, 0], residual=[0, 0, 0, 0])},
        "1024": {"niah_single_kv": row(False, target=[0, 0, 0, 1], residual=[1, 1, 1, 1], source=[1, 1, 1, 1]),
                 "niah_single_secret": row(True, target=[0, 0, 0, 0], residual=[1, 1, 0, 0], source=[1, 1, 1, 1]),
                 "niah_single_json": row(True, target=[1, 0, 0, 0], residual=[1, 1, 1, 0], source=[1, 1, 1, 0]),
                 "vt": row(False, target=[0, 0, 0, 0], residual=[0, 0, 0, 0], source=[1, 0, 0, 0])},
    }


def test_metrics_of_a_hand_made_record():
    m = ruler.metrics(record(), None)
    assert list(m) == ["1024", "2048"]
    r = m["1024"]
    assert r["niah_single_kv"]["residual"] == 1.0 and r["niah_single_kv"]["target"] == 0.25
    assert r["niah_single_secret"]["residual"] == 0.5 and r["niah_single_json"]["residual"] == 0.75
    assert r["niah_single_json"]["items"] == 4 and r["niah_single_json"]["unseen"] is True
    assert r["vt"]["answer_logprob"]["source"] == pytest.approx(-1.5)
    assert r["vt"]["prefix_match"]["source"] == pytest.approx((1 + 1 / 4 + 2 / 4 + 3 / 4) / 4)
    assert r["niah_single_kv"]["prefix_match"]["residual"] == 1.0
    assert r["mean"]["residual"] == pytest.approx((1 + 0.5 + 0.75 + 0) / 4)
    assert r["mean"]["source"] == pytest.approx((1 + 1 + 0.75 + 0.25) / 4)
    assert r["unseen"] == {"residual": 0.625, "source": 0.875, "target": 0.125}
    assert "source" not in m["2048"]["mean"] and m["2048"]["unseen"]["residual"] == 0.0
    only_seen = ruler.metrics({"1024": {"vt": record()["1024"]["vt"]}}, None)
    assert "unseen" not in only_seen["1024"] and only_seen["1024"]["mean"]["source"] == 0.25


def test_report_summary_gate_and_chart(tmp_path):
    from kvjax.eval.suite.evaluation import ChartContext, ReportContext
    from kvjax.eval.gate import GateConfig
    m = ruler.metrics(record(), None)
    ctx = ReportContext({}, {"ruler": "ruler.png"}, "residual", "src", "tgt")
    text = "\n".join(ruler.report(m, ctx))
    assert "**1K tokens**" in text and "**2K tokens**" in text and "![ruler](ruler.png)" in text
    assert "| task | items | native target | ridge + residual | native source |" in text  # the arm table's order
    assert "| `niah_single_secret` \\* | 4 | 0.0% | 50.0% | 100.0% |" in text
    assert "| mean over unseen formats \\* | | 12.5% | 62.5% | 87.5% |" in text
    assert "| `vt` | 4 | 0.0% | 0.0% | 25.0% |" in text
    (bullet,) = ruler.summary(m, ctx)
    assert "unseen needle formats" in bullet and "1K target 12.5%, mapped (residual) 62.5%, source 87.5%" in bullet
    (c,) = ruler.gate(m, GateConfig(min_ruler_unseen=0.5), "residual")
    assert c.name == "ruler_unseen" and c.value == 0.5 and c.passed and "niah_single_secret at length 1024" in c.note
    (c,) = ruler.gate(m, GateConfig(min_ruler_unseen=0.6), "residual")
    assert c.passed is False
    (c,) = ruler.gate(m, GateConfig(min_ruler_unseen=0.5), "ridge")
    assert c.value is None and "arm ridge" in c.note
    (c,) = ruler.gate({}, GateConfig(min_ruler_unseen=0.5), "residual")
    assert not c.measured
    assert ruler.gate(m, GateConfig(), "residual") == []  # off by default
    path = ruler.chart(m, str(tmp_path / "ruler.png"), ChartContext("src", "tgt", {}))
    assert os.path.getsize(path) > 1000


def test_registry_entry_and_settings():
    from kvjax import config_flags
    from kvjax.eval import suite
    names = list(suite.NAMES)
    assert names[names.index("retrieval") + 1] == "ruler" and suite.BY_NAME["ruler"].section == 55
    cfg = config_flags.build("toy_pruned_quick", [("eval.ruler.enabled", "true"), ("eval.ruler.lengths", "1024"),
                                                  ("eval.ruler.tasks", "vt,niah_single_json"),
                                                  ("gate.min_ruler_unseen", "0.5")])
    ec = cfg.eval.ruler
    assert ec.enabled and ec.lengths == (1024,) and ec.tasks == ("vt", "niah_single_json")
    assert cfg.gate.min_ruler_unseen == 0.5
    assert not ruler.RulerEval().enabled and ruler.RulerEval().tasks == TASK_NAMES
    assert set(UNSEEN) < set(TASKS) and all(TASKS[t].unseen for t in UNSEEN) and not TASKS["niah_single_kv"].unseen
    assert ruler.preflight(ec, cfg) == []  # the shipped tokenizer scores these tasks
    bad = dataclasses.replace(ec, tasks=("nope",), needles=1, depth=(0.9, 0.1), lengths=(32,), arms=("x",))
    problems = "\n".join(ruler.preflight(bad, cfg))
    for needle in ("unknown tasks ['nope']", "needles must be >= 2", "depth", "lengths >= 64", "unknown arms"):
        assert needle in problems


# ---- scoring on tiny random models ---------------------------------------------------------------------------------

def test_run_scores_the_items_it_builds_per_task_and_arm(hf_checkpoints):
    """run() on tiny random models (vocab 160, a character tokenizer): its per-item answer log-probs are the
    no-cache forward's of the items make_task_items builds, for the arm's own model."""
    import jax
    from kvjax.eval.arm_settings import ArmSettings
    from kvjax.eval.suite.evaluation import EvalContext
    from kvjax.models.decoder import forward
    source = kvjax.load_hf(hf_checkpoints["gqa2_untied_odd"][0])
    target = kvjax.load_hf(hf_checkpoints["gqa1_tied"][0])
    heldout = np.random.RandomState(0).randint(3, 130, (20, 50))
    ec = ruler.RulerEval(enabled=True, lengths=(192,), tasks=("niah_single_secret", "vt"), limit=3,
                         arms=("target", "source"), batch_size=3)
    cfg = types.SimpleNamespace(seed=7, arms=ArmSettings())
    ctx = EvalContext(cfg=cfg, source=source, target=target, map=lambda name: pytest.fail(f"no map: {name}"),
                      fitted=("ridge",), heldout=heldout, tokenizer=CharTokenizer)
    rec = ruler.run(ec, ctx)
    assert sorted(rec) == ["192"] and all(sorted(r) == ["niah_single_secret", "vt"] for r in rec.values())
    for length, r in rec.items():
        for task, s in r.items():
            items = make_task_items(task, heldout.reshape(-1), CharTokenizer(), int(length), 3, 7, ruler.sizes_of(ec))
            assert s["items"] == 3 and s["answers"] == [it.answer for it in items]
            assert s["unseen"] == (task == "niah_single_secret")
            for arm, model in (("target", target), ("source", source)):
                ids = np.asarray([it.prompt_ids + it.answer_ids for it in items], np.int32)
                logp = np.asarray(jax.nn.log_softmax(forward(model[1], model[0], ids).logits.astype(np.float32)))
                start = int(length)
                want = [sum(float(logp[i, j - 1, ids[i, j]]) for j in range(start, ids.shape[1]))
                        for i in range(len(items))]
                np.testing.assert_allclose(s["arms"][arm]["answer_logprob"], want, rtol=1e-4, atol=2e-3,
                                           err_msg=f"{arm} {task} {length}")
                assert set(s["arms"][arm]["correct"]) <= {0.0, 1.0}
                assert [p == n for p, n in zip(s["arms"][arm]["prefix"], s["answer_tokens"])] == \
                    [c == 1.0 for c in s["arms"][arm]["correct"]]
    m = ruler.metrics(rec, None)
    assert set(m["192"]) == {"niah_single_secret", "vt", "mean", "unseen"}

"""kvjax.eval: bootstrap intervals, likelihood from a prefix cache, multiple choice, retrieval, and the shipped toy
eval sets (checkpoints/toy/eval, built by `python -m launch.toy.evalsets`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import kvjax
from kvjax.eval import likelihood, multiple_choice, retrieval
from kvjax.eval.stats import bootstrap_ci, paired_bootstrap_ci
from kvjax.models.qwen3 import forward_nocache

REPO = Path(__file__).resolve().parents[1]
EVAL = REPO / "checkpoints/toy/eval"
TOKENIZER = REPO / "checkpoints/toy/tokenizer/tokenizer.json"
CFG = kvjax.Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=32, tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)


@pytest.fixture(scope="module")
def params():
    return kvjax.init_params(CFG, jax.random.key(0))


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(TOKENIZER))


_forward_nocache = jax.jit(forward_nocache, static_argnums=1)


def reference_logprob(params, context, continuation) -> float:
    """sum log p(continuation | context) from one cache-free forward pass over the concatenation (right-padded to
    128 tokens, which causal attention ignores: one compile for every test)."""
    seq = np.zeros((1, 128), np.int32)
    seq[0, : len(context) + len(continuation)] = context + continuation
    logp = np.asarray(jax.nn.log_softmax(_forward_nocache(params, CFG, seq)[0], -1))
    return float(sum(logp[len(context) - 1 + j, t] for j, t in enumerate(continuation)))


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---- stats -------------------------------------------------------------------------------------------------------

def test_bootstrap_constant_and_bernoulli():
    assert tuple(bootstrap_ci(np.full(50, 0.7))) == pytest.approx((0.7, 0.7, 0.7))
    ci = bootstrap_ci(np.arange(1000) % 2, n=4000)  # p = 0.5, N = 1000: normal approx +-1.96 * 0.0158 = 0.031
    assert ci.mean == 0.5 and ci.lo == pytest.approx(0.469, abs=0.006) and ci.hi == pytest.approx(0.531, abs=0.006)
    assert bootstrap_ci(np.arange(100) % 3, n=500, seed=3) == bootstrap_ci(np.arange(100) % 3, n=500, seed=3)
    assert bootstrap_ci(np.arange(100) % 3, n=500, seed=3) != bootstrap_ci(np.arange(100) % 3, n=500, seed=4)


def test_paired_bootstrap_uses_the_same_items():
    rng = np.random.default_rng(0)
    a = rng.normal(size=300)
    assert tuple(paired_bootstrap_ci(a, a - 0.1, n=1000)) == pytest.approx((0.1, 0.1, 0.1))
    b = a + rng.normal(scale=0.1, size=300)  # strongly correlated arms: paired interval much narrower
    paired = paired_bootstrap_ci(a, b, n=2000)
    width_a, width_b = (ci.hi - ci.lo for ci in (bootstrap_ci(a, n=2000), bootstrap_ci(b, n=2000)))
    assert paired.hi - paired.lo < 0.2 * (width_a + width_b)
    assert paired.lo < paired.mean < paired.hi
    with pytest.raises(ValueError, match="same items"):
        paired_bootstrap_ci(a, b[:-1])


# ---- likelihood --------------------------------------------------------------------------------------------------

def test_continuation_logprobs_match_forward_nocache(params):
    rng = np.random.default_rng(0)
    contexts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (37, 5, 70)]
    conts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (5, 9, 1)]
    cache = kvjax.init_cache(CFG, 3, 256)  # rows hold prefixes of different lengths
    prefixes, lengths = kvjax.pad_prompts([c[:-1] for c in contexts])
    _, cache = kvjax.prefill(params, CFG, prefixes, cache, lengths)
    tokens, cont_lengths = kvjax.pad_prompts(conts)
    total, n, per_token = likelihood.continuation_logprobs(params, CFG, cache, [c[-1] for c in contexts], tokens,
                                                           cont_lengths, return_tokens=True)
    np.testing.assert_array_equal(n, [5, 9, 1])
    want = [reference_logprob(params, c, x) for c, x in zip(contexts, conts)]
    np.testing.assert_allclose(total, want, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(per_token.sum(1), total, rtol=1e-6)
    assert (per_token[1:, 9:] == 0).all() and per_token.shape == (3, 9)


def test_native_prefix_cache_and_fit_capacity(params):
    context = list(range(1, 101))
    cache = likelihood.native_prefix_cache(params, CFG, context, batch=2)
    assert cache.capacity == 128 and cache.lengths.tolist() == [99, 99]
    for capacity in (99, 320):
        fitted = likelihood.fit_capacity(cache, capacity)
        assert fitted.capacity == capacity
        total, _ = likelihood.continuation_logprobs(params, CFG, fitted, [100, 100], [[5, 6], [7, 0]], [2, 1])
        np.testing.assert_allclose(total, [reference_logprob(params, context, [5, 6]),
                                           reference_logprob(params, context, [7])], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="longest row"):
        likelihood.fit_capacity(cache, 98)
    single = likelihood.native_prefix_cache(params, CFG, [42], batch=1)  # nothing to cache: empty rows
    assert single.lengths.tolist() == [0]


def test_heldout_loss_equals_training_loss(params):
    from kvjax.pretrain import lm_loss
    lm_loss = jax.jit(lm_loss, static_argnums=1)
    windows = np.random.default_rng(1).integers(0, CFG.vocab_size, (5, 33))  # 5: the last batch of 2 is padded
    per_window = likelihood.window_losses(params, CFG, windows, batch_size=2)
    assert per_window.shape == (5,)
    assert likelihood.heldout_loss(params, CFG, windows, 2) == pytest.approx(float(lm_loss(params, CFG, windows)),
                                                                             rel=1e-5)
    assert per_window[4] == pytest.approx(float(lm_loss(params, CFG, windows[4:])), rel=1e-5)


# ---- multiple choice ---------------------------------------------------------------------------------------------

MC_ITEMS = [
    multiple_choice.MCItem("def add(a, b):\n", ["    return a + b\n", "    pass\n", "import os\n"], 0),
    multiple_choice.MCItem("x = [1, 2,", [" 3]", " 'a', 'b']\n", " None]"], 2),
    multiple_choice.MCItem("The", [" function returns", " x"], 1),
]


def test_score_mc_equals_manual_computation(params, tok):
    items = MC_ITEMS[:2]
    calls = []

    def prefix_fn(context_ids, n_options):  # a stand-in for a mapped arm's cache
        calls.append((list(context_ids), n_options))
        return likelihood.native_prefix_cache(params, CFG, context_ids, n_options)

    result = multiple_choice.score_mc(items, tok, params, CFG, prefix_fn=prefix_fn, progress=False)
    assert [c for c, _ in calls] == [tok.encode(it.context).ids for it in items] and calls[0][1] == 3
    for i, item in enumerate(items):
        ctx = tok.encode(item.context).ids
        for j, option in enumerate(item.options):
            ids = tok.encode(option).ids
            assert result.logprobs[i, j] == pytest.approx(reference_logprob(params, ctx, ids), abs=1e-4)
            assert result.n_tokens[i, j] == len(ids) and result.n_bytes[i, j] == len(option.encode())
    np.testing.assert_allclose(result.scores, result.logprobs / result.n_tokens)
    np.testing.assert_array_equal(result.predictions, result.scores.argmax(1))
    np.testing.assert_array_equal(result.correct, result.predictions == [0, 2])
    raw = result.renormalized("none")
    np.testing.assert_array_equal(raw.predictions, result.logprobs.argmax(1))


def test_score_mc_rigged_labels(params, tok):
    """Labels set to the model's best / worst option give accuracy 1 / 0 (catches off-by-one option bookkeeping)."""
    items = MC_ITEMS[:2]
    scores = multiple_choice.score_mc(items, tok, params, CFG, progress=False).scores
    for pick, want in ((np.argmax, 1.0), (np.argmin, 0.0)):
        rigged = [multiple_choice.MCItem(it.context, it.options, int(pick(s))) for it, s in zip(items, scores)]
        assert multiple_choice.score_mc(rigged, tok, params, CFG, progress=False).accuracy == want
    with pytest.raises(ValueError, match="same number of options"):
        multiple_choice.score_mc(MC_ITEMS, tok, params, CFG, progress=False)


def test_mc_scoring_compiles_once_per_bucket(params, tok):
    fn = likelihood._continuation_logprobs
    rng = np.random.default_rng(2)
    words = ["alpha", "beta", "gamma", "delta", "import", "return"]
    items = [multiple_choice.MCItem(" ".join(rng.choice(words, n)) + "\n", [" x = 1\n", " y\n", " return z\n"], 0)
             for n in rng.integers(3, 40, 6)]  # contexts of different lengths, all under one 64-token bucket
    multiple_choice.score_mc(items[:1], tok, params, CFG, progress=False)
    before = fn._cache_size()
    multiple_choice.score_mc(items, tok, params, CFG, progress=False)
    assert fn._cache_size() == before


def test_load_mc_local_schemas(tmp_path):
    hs, piqa = tmp_path / "hs.jsonl", tmp_path / "piqa.jsonl"
    hs.write_text(json.dumps({"ctx": "A man is", "endings": ["sitting", " running", "c", "d"], "label": "1"}) + "\n"
                  + json.dumps({"ctx": "x\n", "endings": ["a\n", "b\n", "c\n", "d\n"], "label": 3}) + "\n")
    piqa.write_text(json.dumps({"goal": "Open a jar", "sol1": "twist the lid", "sol2": "x", "label": 0}) + "\n")
    items = multiple_choice.load_mc(str(hs), schema="hellaswag")
    assert items[0] == multiple_choice.MCItem("A man is", [" sitting", " running", " c", " d"], 1)
    assert items[1].options == ["a\n", "b\n", "c\n", "d\n"] and items[1].label == 3
    assert len(multiple_choice.load_mc(str(hs), limit=1)) == 1
    assert multiple_choice.load_mc(str(piqa), schema="piqa") == [
        multiple_choice.MCItem("Open a jar", [" twist the lid", " x"], 0)]
    with pytest.raises(ValueError, match="lacks field 'goal'"):
        multiple_choice.load_mc(str(hs), schema="piqa")
    piqa.write_text(json.dumps({"goal": "g", "sol1": "a", "sol2": "b", "label": 2}) + "\n")
    with pytest.raises(ValueError, match="not an index"):
        multiple_choice.load_mc(str(piqa), schema="piqa")
    with pytest.raises(FileNotFoundError):
        multiple_choice.load_mc(str(tmp_path / "missing.jsonl"))


def test_load_mc_hub_name_offline_names_the_local_alternative():
    code = "from kvjax.eval import load_mc; load_mc('Rowan/hellaswag')"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "RuntimeError: could not load hub dataset 'Rowan/hellaswag'" in proc.stderr
    assert "local JSONL" in proc.stderr and "checkpoints/toy/eval" in proc.stderr


# ---- retrieval ---------------------------------------------------------------------------------------------------

def test_retrieval_exact_match_against_generate(params):
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (20, 45)]
    items = []
    for p, greedy in zip(prompts, np.asarray(kvjax.generate(params, CFG, prompts, 4, eos_token_ids=())).tolist()):
        wrong = greedy[:3] + [(greedy[3] + 1) % CFG.vocab_size]
        items += [retrieval.RetrievalItem(p, greedy, len(p), 0), retrieval.RetrievalItem(p, wrong, len(p), 0)]
    result = retrieval.score_retrieval(items, params, CFG, progress=False)
    np.testing.assert_array_equal(result.correct, [1, 0, 1, 0])
    assert result.generated[0] == items[0].answer_ids and result.generated[1] == items[0].answer_ids
    assert result.answer_logprob[0] > result.answer_logprob[1]
    assert result.answer_logprob[0] == pytest.approx(reference_logprob(params, prompts[0], items[0].answer_ids),
                                                     abs=1e-4)


# ---- shipped eval sets -------------------------------------------------------------------------------------------

def heldout_files() -> set[str]:
    manifest = json.loads((REPO / "checkpoints/toy/data/manifest.json").read_text())
    return {e["path"] for e in manifest["files"] if e["split"] == "heldout"}


@pytest.mark.parametrize("name,schema,count,k", [("hellaswag", "hellaswag", 1000, 4), ("piqa", "piqa", 500, 2)])
def test_shipped_mc_sets(name, schema, count, k, params, tok):
    rows = jsonl(EVAL / f"{name}.jsonl")
    items = multiple_choice.load_mc(str(EVAL / f"{name}.jsonl"), schema=schema)
    assert len(items) >= count and {r["source_file"] for r in rows} <= heldout_files()
    assert all(len(it.options) == k == len(set(it.options)) and 0 <= it.label < k for it in items)
    assert np.bincount([it.label for it in items], minlength=k).min() >= 0.9 * len(items) / k
    assert all(it.context.endswith("\n") and not it.options[it.label].startswith("\n") for it in items)
    assert len({it.context for it in items}) == len(items)
    result = multiple_choice.score_mc(items[:2], tok, params, CFG, progress=False)  # end to end on real text
    assert np.isfinite(result.logprobs).all() and (result.n_tokens >= 5).all()


def test_mc_sets_do_not_share_text():
    contexts = [r["ctx"] for r in jsonl(EVAL / "hellaswag.jsonl")] + [r["goal"] for r in jsonl(EVAL / "piqa.jsonl")]
    assert len(set(contexts)) == len(contexts)


@pytest.mark.parametrize("length", [1024, 2048, 4096])
def test_shipped_retrieval_sets(length, tok):
    rows = jsonl(EVAL / f"retrieval_{length}.jsonl")
    assert len(rows) >= 200 and {r["source_file"] for r in rows} <= heldout_files()
    assert len({r["key"] for r in rows}) == len(rows)
    for r in rows:
        assert r["length"] == length and tok.decode(r["answer_ids"]) == r["answer"] == f" {r['value']}"
        assert r["prompt"].count(r["key"]) == 2 and r["prompt"].rstrip().endswith(f"{r['key']} =")
        assert 0.05 * length <= r["needle_position"] <= 0.25 * length
    items = retrieval.load_retrieval(str(EVAL / f"retrieval_{length}.jsonl"), tok, limit=10)
    for row, item in zip(rows, items):  # prompts re-tokenize to `length`; the needle starts at needle_position
        assert len(item.prompt_ids) == length and item.answer_ids == row["answer_ids"]
        after = tok.decode(item.prompt_ids[item.needle_position:])
        assert after.lstrip(" \t").startswith(f"{row['key']} = {row['value']}\n")


def test_shipped_windows_and_meta():
    windows = np.load(EVAL / "heldout_windows.npy")
    assert windows.dtype == np.uint16 and windows.shape == (256, 1025) and windows.max() < 8192
    assert len({w.tobytes() for w in windows}) == len(windows)
    meta = json.loads((EVAL / "meta.json").read_text())
    assert meta["counts"]["hellaswag"] == len(jsonl(EVAL / "hellaswag.jsonl"))
    assert (EVAL / "README.md").is_file()
    # the shipped sets are the builder's defaults: meta records every setting, so a rebuild writes the same meta
    from launch.toy.evalsets import parse_args
    defaults = {k: v for k, v in vars(parse_args([])).items() if not isinstance(v, Path)}
    assert meta["args"] == json.loads(json.dumps(defaults))


@pytest.mark.skipif(not (REPO / "work/toy/data/heldout.npy").is_file(), reason="needs python -m launch.toy.data")
def test_shipped_windows_are_heldout_slots():
    heldout = np.load(REPO / "work/toy/data/heldout.npy")
    slots = {bytes(s.tobytes()) for s in heldout[: len(heldout) // 1025 * 1025].reshape(-1, 1025)}
    assert all(w.tobytes() in slots for w in np.load(EVAL / "heldout_windows.npy"))


def test_reading_gap_splits_the_kl(params):
    from kvjax.eval import reading_gap
    from kvjax.mapper.residual import kl
    other_cfg = kvjax.Qwen3Config(vocab_size=8192, hidden_size=96, intermediate_size=128, num_layers=3, num_heads=2,
                                  num_kv_heads=2, head_dim=16, tie_word_embeddings=True, eos_token_ids=(0,),
                                  pad_token_id=0)
    source, target = (other_cfg, kvjax.init_params(other_cfg, jax.random.key(1))), (CFG, params)
    windows = np.random.default_rng(0).integers(1, 8192, (3, 40))
    m = reading_gap(source, target, windows, prefix=32, short=4, batch_size=2)
    assert all(v.shape == (3,) for v in m.values())
    # the full view is plain forward_nocache over the whole window
    tok = jax.numpy.asarray(windows, jax.numpy.int32)
    s_full = forward_nocache(source[1], other_cfg, tok[:, :-1])[:, 31:]
    t_full = forward_nocache(params, CFG, tok[:, :-1])[:, 31:]
    np.testing.assert_allclose(m["kl_full"], np.asarray(kl(s_full, t_full).mean(-1)), rtol=1e-4, atol=1e-6)
    t_short = forward_nocache(params, CFG, tok[:, 28:-1])[:, 3:]  # the first continuation prediction sees 4 tokens
    np.testing.assert_allclose(m["target_reading"], np.asarray(kl(t_full, t_short).mean(-1)), rtol=1e-4, atol=1e-6)
    lp = jax.nn.log_softmax(t_full, -1)
    ce = -np.take_along_axis(np.asarray(lp), windows[:, 32:, None], -1)[..., 0].mean(-1)
    np.testing.assert_allclose(m["ce_target_full"], ce, rtol=1e-5)
    assert (m["source_reading"] > 1e-4).all() and (m["kl_full"] > 1e-3).all()
    # reading everything in the "short" view: nothing left to read; a model against itself: no gap
    same = reading_gap(source, target, windows, prefix=32, short=32)
    np.testing.assert_allclose(same["source_reading"], 0, atol=1e-5)
    np.testing.assert_allclose(same["kl_local"], same["kl_full"], rtol=1e-5)
    np.testing.assert_allclose(reading_gap(target, target, windows, prefix=32)["kl_full"], 0, atol=1e-5)
    with pytest.raises(ValueError, match="short"):
        reading_gap(source, target, windows, prefix=32, short=33)
    # several local views in one pass: each the same as its own call
    from kvjax.eval import reading_gaps
    both = reading_gaps(source, target, windows, prefix=32, shorts=(4, 32, 4), batch_size=2)
    assert list(both) == [4, 32]
    for short, one in ((4, m), (32, same)):
        for k, v in one.items():
            np.testing.assert_allclose(both[short][k], v, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="short"):
        reading_gaps(source, target, windows, prefix=32, shorts=())
    by_pos = reading_gaps(source, target, windows, prefix=32, shorts=(4,), batch_size=2, by_position=True)[4]
    assert all(v.shape == (3, 8) for v in by_pos.values())
    np.testing.assert_allclose(by_pos["kl_full"], np.asarray(kl(s_full, t_full)), rtol=1e-4, atol=1e-6)
    for k, v in m.items():
        np.testing.assert_allclose(by_pos[k].mean(1), v, rtol=1e-5, atol=1e-7)

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
from kvjax.eval import likelihood, multiple_choice, needle_retrieval as retrieval
from kvjax.eval.stats import bootstrap_ci, paired_bootstrap_ci
from kvjax.models.decoder import forward

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


_forward = jax.jit(lambda params, tokens: forward(params, CFG, tokens).logits)


def reference_logprob(params, context, continuation) -> float:
    """sum log p(continuation | context) from one cache-free forward pass over the concatenation (right-padded to
    128 tokens, which causal attention ignores: one compile for every test)."""
    seq = np.zeros((1, 128), np.int32)
    seq[0, : len(context) + len(continuation)] = context + continuation
    logp = np.asarray(jax.nn.log_softmax(_forward(params, seq)[0], -1))
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

def test_continuation_logprobs_match_the_no_cache_forward(params):
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


def test_evalsets_refuses_a_needle_format_it_cannot_place(capsys):
    from launch.toy.evalsets import parse_args
    assert parse_args(["--needle", "{key}: {value}\n", "--query", "{key}:"]).query == "{key}:"
    for bad in (["--needle", "{key}: {value}"], ["--query", "{key} =\n"], ["--depth", "0.3", "0.2"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert "--needle must end with a newline, --query must not" in capsys.readouterr().err


@pytest.mark.skipif(not (REPO / "work/toy/data/heldout.npy").is_file(), reason="needs python -m launch.toy.data")
def test_shipped_windows_are_heldout_slots():
    heldout = np.load(REPO / "work/toy/data/heldout.npy")
    slots = {bytes(s.tobytes()) for s in heldout[: len(heldout) // 1025 * 1025].reshape(-1, 1025)}
    assert all(w.tobytes() in slots for w in np.load(EVAL / "heldout_windows.npy"))


def test_reading_gap_splits_the_kl(params):
    from kvjax.eval import reading_gap
    from kvjax.mapper.kl import kl
    other_cfg = kvjax.Qwen3Config(vocab_size=8192, hidden_size=96, intermediate_size=128, num_layers=3, num_heads=2,
                                  num_kv_heads=2, head_dim=16, tie_word_embeddings=True, eos_token_ids=(0,),
                                  pad_token_id=0)
    source, target = (other_cfg, kvjax.init_params(other_cfg, jax.random.key(1))), (CFG, params)
    windows = np.random.default_rng(0).integers(1, 8192, (3, 40))
    m = reading_gap(source, target, windows, prefix=32, short=4, batch_size=2)
    assert all(v.shape == (3,) for v in m.values())
    # the full view is one no-cache forward over the whole window
    tok = jax.numpy.asarray(windows, jax.numpy.int32)
    s_full = forward(source[1], other_cfg, tok[:, :-1]).logits[:, 31:]
    t_full = forward(params, CFG, tok[:, :-1]).logits[:, 31:]
    np.testing.assert_allclose(m["kl_full"], np.asarray(kl(s_full, t_full).mean(-1)), rtol=1e-4, atol=1e-6)
    t_short = forward(params, CFG, tok[:, 28:-1]).logits[:, 3:]  # the first continuation prediction sees 4 tokens
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


# ---- the evaluation registry and the arm table -------------------------------------------------------------------

def test_run_config_eval_is_the_registry():
    from kvjax import config_flags
    from kvjax.eval import suite
    from kvjax.run.config import EvalConfig, RunConfig
    fields = [f.name for f in __import__("dataclasses").fields(EvalConfig)]
    assert fields == [*suite.NAMES, "bootstrap"]
    for e in suite.EVALUATIONS:  # every evaluation's settings: defaults as its dataclass, overridable by name
        assert getattr(EvalConfig(), e.name) == e.settings() and e.settings.__dataclass_params__.frozen
        cfg = config_flags.build("toy", [(f"eval.{e.name}.enabled", "false")], RunConfig)
        assert getattr(cfg.eval, e.name).enabled is False


def test_evaluation_modules_import_no_jax():
    """Settings are part of RunConfig, so an evaluation module's top level (and the kvjax modules it imports there)
    must not import JAX. Package __init__ files are not followed: kvjax/__init__ imports the library."""
    import ast
    seen, todo = set(), [f"kvjax.eval.suite.{p.stem}" for p in (REPO / "kvjax/eval/suite").glob("*.py")
                         if p.stem != "__init__"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = REPO / (name.replace(".", "/") + ".py")
        for node in ast.parse(path.read_text()).body:
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) else [])
            for mod in mods:
                assert mod.split(".")[0] not in ("jax", "flax", "optax", "orbax"), f"{name} imports {mod}"
                if mod.startswith("kvjax.") and (REPO / (mod.replace(".", "/") + ".py")).is_file():
                    todo.append(mod)
    assert "kvjax.eval.suite.kl" in seen and "kvjax.eval.gate" in seen


def test_adding_an_evaluation_is_one_module_and_one_registry_line(monkeypatch, tmp_path):
    """A new evaluation plugs into the job's plan, metrics.json, the gate, report.md and the charts through its
    Evaluation record alone."""
    import dataclasses

    from kvjax.job.stages import plan
    from kvjax.config_flags import build
    from kvjax.eval import suite
    from kvjax.eval.gate import GateConfig, check
    from kvjax.run.config import RunConfig

    @dataclasses.dataclass(frozen=True)
    class EchoEval:
        enabled: bool = True
        scale: float = 2.0

    def draw(section, path, ctx):
        Path(path).write_text(f"{ctx.source} {section['value']}")
        return path

    echo = suite.Evaluation(
        name="echo", settings=EchoEval, run=lambda ec, ctx: {"x": ec.scale, "final": ctx.final},
        metrics=lambda rec, ctx: {"value": rec["x"] * ctx.n_boot}, section=35,
        report=lambda m, ctx: ["## Echo", "", f"value {m['value']} ({ctx.charts['echo']})", ""],
        summary=lambda m, ctx: [f"- echo {m['value']}"], charts=(suite.Chart("echo", draw),),
        depends=lambda cfg: {"seed": cfg.seed},
        preflight=lambda ec, cfg: [] if ec.scale > 0 else ["eval.echo.scale must be > 0"],
        gate=lambda m, config, arm: check("echo", m.get("value"), config.max_kl, "max", arm))
    monkeypatch.setattr(suite, "EVALUATIONS", suite.EVALUATIONS + (echo,))
    monkeypatch.setattr(suite, "BY_NAME", {**suite.BY_NAME, "echo": echo})
    base = build("toy", [("output_dir", str(tmp_path))], RunConfig)
    eval_cfg = suite.eval_config_type()(**{f.name: getattr(base.eval, f.name)
                                           for f in dataclasses.fields(base.eval)})
    cfg = dataclasses.replace(base, eval=eval_cfg)
    assert eval_cfg.echo == EchoEval()
    stage = plan(cfg)["echo"]
    assert stage.settings == {"echo": {"enabled": True, "scale": 2.0}, "final": "residual", "seed": 0}
    assert "echo" in [s.name for s in plan(cfg)["report"].upstream]
    assert suite.preflight(dataclasses.replace(cfg, eval=dataclasses.replace(eval_cfg, echo=EchoEval(scale=0.0)))) \
        == ["eval.echo.scale must be > 0"]
    ctx = suite.EvalContext(cfg, source=None, target=None, map=None, fitted=("ridge", "residual"), heldout=None,
                            tokenizer=None)
    assert suite.run(echo, cfg, ctx) == {"x": 2.0, "final": "residual"}
    run_info = {"config": "t", "source": {"name": "S", "params_m": 1.0, "layers": 2, "path": "s", "dtype": "f"},
                "target": {"name": "T", "params_m": 0.5, "layers": 1, "path": "t"},
                "map": {"residual_rank": 4, "residual_steps": 3, "final": "residual", "pairing": "depth", "rank": None,
                        "lambdas": []},
                "data": {"calib_tokens": 10, "train_text": ["x"]}, "devices": "1 x cpu",
                "versions": {"kvjax": "0", "jax": "0"}, "stage_seconds": {}}
    metrics = suite.build_metrics({"echo": {"x": 2.0}}, run_info, 3, "residual")
    assert list(metrics) == ["schema_version", "run", "echo"] and metrics["echo"] == {"value": 6.0}
    gate = suite.evaluate_gate(metrics, GateConfig(max_kl=5.0), "residual")
    assert [(c.name, c.value, c.passed, c.note) for c in gate.checks if c.name == "echo"] == \
        [("echo", 6.0, False, "residual")] and not gate.passed
    metrics["gate"] = gate.to_json()
    drawn = suite.draw_charts(metrics, str(tmp_path), "S", "T")
    assert drawn == {"echo": "echo.png"} and (tmp_path / "echo.png").read_text() == "S 6.0"
    text = suite.render_report(metrics, drawn)
    assert "- echo 6.0" in text and "## Echo\n\nvalue 6.0 (echo.png)" in text
    assert text.index("- echo 6.0") < text.index("## Echo") < text.index("## Quality gate")


def _spec_arm(latency: float, native: float, tau, matches: float, prefix: float, first: float) -> dict:
    """One arm of metrics.json `speculative.lengths.<len>` as kvjax.eval.suite.speculative.metrics writes it."""
    m = {"latency_s": latency, "decode_tps": 64 / latency, "phases_s": {"prefill": 0.1, "decode": latency - 0.1},
         "acceptance_length": tau, "matches_native": matches, "prefix_match": prefix, "first_token_match": first}
    if tau is not None:
        m["latency_vs_native"] = latency / native
        m["latency_vs_native_rounds"] = [latency / native] * 3
    return m


def test_summaries_rank_by_speed_only_arms_with_the_native_answer():
    """The fastest speculative arm (a transfer, answering from the mapped cache, 0% of requests equal to
    native greedy) is not the summary's best arm; the fastest arm whose output equals native greedy is, and every
    arm answering from another cache is quoted with its latency beside its agreement and its cache's quality. The
    same for dflash (a faster method that answered differently), TTFT and throughput (the mapped cache's quality
    beside its speed)."""
    from kvjax.eval import suite
    from kvjax.eval.suite import dflash, speculative, throughput, ttft

    native = 1.0
    lengths = {"1024": {"native": _spec_arm(0.9, 0.9, None, 1.0, 1.0, 1.0)},
               "4096": {"native": _spec_arm(native, native, None, 1.0, 1.0, 1.0),
                        "plain@4": _spec_arm(1.30, native, 2.1, 1.0, 1.0, 1.0),  # lossless, slower than native
                        "transfer@4": _spec_arm(0.418, native, 1.78, 0.0, 0.375, 1.0),  # fastest, answers differ
                        "repaired@4": _spec_arm(0.60, native, 2.4, 0.0, 0.5, 1.0),
                        "lookup@4": _spec_arm(0.80, native, 1.5, 1.0, 1.0, 1.0)}}  # the fastest same answer
    lengths["1024"].update({a: dict(m) for a, m in lengths["4096"].items() if a != "native"})
    metrics = {
        "schema_version": 1,
        "run": {"config": "toy_reverse", "source": {"name": "S", "params_m": 1.0, "layers": 2, "path": "s",
                                                     "dtype": "f"},
                "target": {"name": "T", "params_m": 3.0, "layers": 6, "path": "t"},
                "map": {"residual_rank": 4, "residual_steps": 3, "final": "residual", "pairing": "depth",
                        "rank": None, "lambdas": []},
                "data": {"calib_tokens": 10, "train_text": ["x"]}, "devices": "1 x cpu",
                "versions": {"kvjax": "0", "jax": "0"}, "stage_seconds": {}},
        "native_kl": {"kl": {"residual": 0.2456, "partial": 0.1798},
                      "kl_ci95": {"residual": [0.19, 0.31], "partial": [0.13, 0.24]},
                      "agreement": {"residual": 0.25, "partial": 0.5},
                      "first_agreement": {"residual": 0.0, "partial": 0.0}, "final": "residual", "windows": 4,
                      "prefix_len": 24, "cont_len": 8},
        "mc": {"hellaswag": {"acc": {"target": 0.5, "residual": 0.4, "partial": 0.45},
                             "acc_ci95": {"target": [0.4, 0.6], "residual": [0.3, 0.5], "partial": [0.35, 0.55]},
                             "items": 200, "normalize": "length",
                             "delta_vs_target": {"residual": {"mean": -0.1, "ci95": [-0.2, -0.01]},
                                                 "partial": {"mean": -0.05, "ci95": [-0.12, 0.02]}},
                             "delta_vs_target_ci95": [-0.2, -0.01]}},
        "ttft": {"lengths": {"4096": {"ttft_s": {"target": 0.5, "mapped": 0.1, "partial": 0.15},
                                      "speedup": {"mapped": 5.0, "partial": 3.33},
                                      "speedup_rounds": {"mapped": [4.9, 5.0, 5.1], "partial": [3.3, 3.33, 3.4]},
                                      "phases_s": {}}},
                 "final": "residual", "batch_size": 1, "repeats": 3, "repair": {"k": 1, "mode": "bottom"}},
        "speculative": {"lengths": lengths, "final": "residual", "new_tokens": 64, "batch_size": 1, "repeats": 3,
                        "repair": {"k": 1, "mode": "bottom"}},
        "gate": {"passed": True, "map": "residual", "thresholds": {}, "checks": {}},
    }
    text = suite.render_report(metrics, {})
    summary = text[text.index("## Summary"): text.index("\n## ", text.index("## Summary") + 1)]
    lines = [line for line in summary.splitlines() if "Speculative decoding" in line or "transfer@4" in line]
    best = [line for line in lines if "best arm" in line]
    assert len(best) == 1 and "best arm lookup@4 at -20.0% end-to-end latency" in best[0], summary
    assert "transfer@4" not in best[0] and "repaired@4" not in best[0], best[0]
    # the transfer: its own line, latency beside its agreement with native greedy and its cache's quality
    transfer = [line for line in summary.splitlines() if "transfer@4 at" in line]
    assert len(transfer) == 1 and "best" not in transfer[0], summary
    assert "transfer@4 at -58.2% end-to-end latency vs native" in transfer[0]
    assert "native greedy on 0% of requests, 37.5% of tokens before the first difference" in transfer[0]
    assert "quality of the residual cache: next-token agreement with native 25.0%" in transfer[0]
    assert "hellaswag accuracy -10.0 pts vs native target (95% CI [-20.0, -1.0] pts)" in transfer[0]
    repaired = next(line for line in summary.splitlines() if "repaired@4 at" in line)
    assert "best" not in repaired and "quality of the partial cache: next-token agreement with native 50.0%" in repaired
    # the report's table keeps every arm; the note under it says which rows are ranked
    assert "| 4K | transfer@4 | 0.418 |" in text and "Ranked by speed (the summary's best arm)" in text

    # no lossless arm reproduced native greedy (numerical drift): nothing is ranked, everything quoted with agreement
    drift = {**metrics["speculative"], "lengths": {"4096": {
        a: {**m, "matches_native": 0.0} if a != "native" else m for a, m in lengths["4096"].items()}}}
    from kvjax.eval.suite.evaluation import ReportContext
    ctx = ReportContext(metrics, {}, "residual", "S", "T")
    out = speculative.summary(drift, ctx)
    assert not any("best arm" in line for line in out) and "none is ranked by speed" in out[0]
    assert any("lookup@4 at -20.0% end-to-end latency vs native, output equal to native greedy on 0%" in line
               for line in out)

    # dflash: the faster block size answered differently on one prompt group: the identical one is the best
    dm = {"verifier": "source", "drafter": "d", "new_tokens": 64, "prompt_len": 256, "batch_size": 1,
          "methods": {"greedy": {"tok_s": 100.0, "median_s": 1.0, "speedup": 1.0, "identical": 16, "groups": 16},
                      "dflash-8": {"tok_s": 150.0, "median_s": 0.7, "speedup": 1.5, "identical": 16, "groups": 16,
                                   "tau": 3.0},
                      "dflash-16": {"tok_s": 200.0, "median_s": 0.5, "speedup": 2.0, "identical": 15, "groups": 16,
                                    "tau": 5.0}}}
    out = dflash.summary(dm, ctx)
    assert out[0].startswith("- Block drafting (dflash-8) for the source: 1.50x") and "dflash-16" not in out[0]
    assert out[1] == ("- Not ranked by speed: dflash-16 answered differently from greedy (output identical on 15/16 "
                      "prompts) at 2.00x its greedy decoding (tau 5.00).")

    # TTFT: each built cache's ratio with its answers' quality beside it
    out = ttft.summary(metrics["ttft"], ctx)
    assert len(out) == 2 and "S prefill + map 5.00x the speed of T's own prefill" in out[0]
    assert "answering from the residual cache" in out[0] and "next-token agreement with native 25.0%" in out[0]
    assert "answering from the partial cache" in out[1] and "hellaswag accuracy -5.0 pts vs native target" in out[1]

    # throughput: the split path's decode speed with the final map's quality beside it
    tp = {"4096": {"mapped_over_target_decode": 1.01, "mapped_over_source_decode": 2.0,
                   "active_saving_vs_source": 0.3}}
    out = throughput.summary(tp, ctx)
    assert "answering from the residual cache" in out[0] and "hellaswag accuracy -10.0 pts vs native target" in out[0]


def test_throughput_reserves_both_devices_and_gates_end_to_end_latency():
    """Reserved accelerator seconds count every device a path holds for the whole request (the split path: two), and
    the gate's latency check is the worst prefix length's split-path / source latency."""
    from kvjax.eval.suite import MetricsContext, throughput
    from kvjax.eval.gate import GateConfig

    def row(mapped_latency):
        return {"decode_tps": {"target": 100.0, "source": 50.0, "mapped": 99.0},
                "active_s": {"target": 0.5, "source": 1.0, "mapped": 0.9},
                "ttft_s": {"target": 0.1, "source": 0.2, "mapped": 0.3},
                "latency_s": {"target": 0.6, "source": 1.2, "mapped": mapped_latency},
                "batch_size": 1, "new_tokens": 64, "repeats": 5, "decode_repeats": 5}
    m = throughput.metrics({"256": row(0.9), "1024": row(1.5)}, MetricsContext(100, "residual"))
    assert m["256"]["reserved_s"] == {"target": 0.6, "source": 1.2, "mapped": 1.8}
    assert m["1024"]["mapped_latency_over_source"] == 1.25 and m["256"]["mapped_latency_over_target"] == 1.5
    (c,) = throughput.gate(m, GateConfig(max_latency_vs_source=1.1), "residual")
    assert (c.name, c.value, c.kind) == ("latency_vs_source", 1.25, "max")
    assert throughput.gate(m, GateConfig(), "residual") == []  # off unless a threshold is set
    old = {"256": {k: v for k, v in row(0.9).items() if k != "latency_s"}}  # a record from before latency
    assert "reserved_s" not in throughput.metrics(old, MetricsContext(100, "residual"))["256"]
    assert any("reserved" in line for line in throughput.report(m, type("Ctx", (), {"charts": {}})()))

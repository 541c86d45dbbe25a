"""`python -m kvjax.launch`: config parsing and overrides, fast errors, stages that resume, the quality gate and
split_generate's fallback, the report's files and metrics.json schema; the qwen32_8 path end to end with tiny random
checkpoints standing in for Qwen3-32B / 8B (sharded over conftest's 8 fake CPU devices)."""

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import kvjax
from kvjax import config_flags
from kvjax.job import command as launch
from kvjax.job.stages import plan
from kvjax.job.execute import Job
from kvjax.run.config import DEFAULT_CONFIG
from kvjax.run import preflight
from kvjax.config_flags import ConfigFlagError
from kvjax.eval.suite import evaluate_gate
from kvjax.eval.gate import GateConfig, load_gate
from kvjax.run.config import RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = os.path.join(REPO, "checkpoints", "toy")
TOKENIZER = os.path.join(TOY, "tokenizer")

# every run in this file: tiny sizes, everything else as configured
SMALL = [
    "--config.data.max_train_tokens=6000", "--config.data.max_heldout_tokens=3000",
    "--config.data.heldout_window_len=80",
    "--config.map.calib_windows=6", "--config.map.select_windows=4", "--config.map.window_len=48",
    "--config.map.batch_size=4", "--config.map.residual_rank=4",
    "--config.residual.steps=3", "--config.residual.batch_size=2", "--config.residual.prefix_len=24",
    "--config.residual.cont_len=8", "--config.residual.warmup_steps=1", "--config.residual.save_every=2",
    "--config.eval.distances.windows=3", "--config.eval.distances.window_len=48",
    "--config.eval.kl.windows=4", "--config.eval.kl.prefix_len=24", "--config.eval.kl.cont_len=8",
    "--config.eval.mc.limit=3",
    "--config.eval.retrieval.limit=2", "--config.eval.retrieval.lengths=40,48",
    "--config.eval.throughput.lengths=32", "--config.eval.throughput.repeats=1",
    "--config.eval.throughput.new_tokens=4", "--config.eval.bootstrap=200",
]

REQUIRED = [  # metrics.json paths the issue fixes; "*" = every key at that level
    "distances.key_cos.raw", "distances.key_cos.ridge", "distances.key_cos.residual", "distances.value_cos.raw",
    "distances.value_cos.ridge", "distances.value_cos.residual", "distances.key_nrmse.raw",
    "distances.key_nrmse.ridge", "distances.key_nrmse.residual", "distances.value_nrmse.raw",
    "distances.value_nrmse.ridge", "distances.value_nrmse.residual",
    "kl.ridge", "kl.residual", "kl.reduction", "kl.residual_minus_ridge_ci95", "kl.target", "kl.vs_target",
    "kl.final_minus_target_ci95", "kl.agreement.with_source", "kl.agreement.target_with_source",
    *[f"mc.{s}.acc.{a}" for s in ("hellaswag", "piqa") for a in ("target", "source", "direct", "ridge", "residual")],
    "mc.hellaswag.gap_recovered", "mc.piqa.gap_recovered", "mc.hellaswag.delta_vs_target_ci95",
    "mc.piqa.delta_vs_target_ci95",
    *[f"retrieval.*.{a}" for a in ("target", "source", "residual")],
    *[f"throughput.*.{m}.{a}" for m in ("decode_tps", "ttft_s", "active_s") for a in ("target", "source", "mapped")],
    "gate.passed", "gate.thresholds.min_key_cos", "gate.thresholds.min_kl_reduction",
    "gate.thresholds.min_mc_retention", "gate.thresholds.max_kl_vs_target",
]


STDLIB_TEXT = ["--config.data.train_text=stdlib:train", "--config.data.heldout_text=stdlib:heldout"]  # no hub text
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
PROSE_CHARS = 120_000  # the local FineWeb-Edu-format copy's text: more than SMALL's token counts need of each part


def stdlib_prose(chars: int) -> list[str]:
    """English prose made here: the docstrings of this Python's standard library modules, classes and functions of
    at least 200 characters, one document each, in file-name order, until they hold `chars` characters."""
    import ast
    import sysconfig
    root, docs, total = sysconfig.get_paths()["stdlib"], [], 0
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py") or total >= chars:
            continue
        try:
            with open(os.path.join(root, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            text = ast.get_docstring(node) if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) else None
            if text and len(text) >= 200 and text not in docs:
                docs.append(text)
                total += len(text)
    return docs


def fineweb_copy(root) -> list[str]:
    """A local copy of a FineWeb-Edu-format dataset (its fields, its parquet files as sample-10BT lays them out)
    holding prose made here, and the flags that make a real config calibrate and measure on it, as docs/real_pairs.md
    says to name a downloaded part of the hub's."""
    from test_corpus import fineweb_repo
    fineweb_repo(root, stdlib_prose(PROSE_CHARS))
    source = f"hf:{os.path.join(root, 'fineweb-edu', 'sample', '10BT', '*.parquet')}"
    return [f"--config.data.train_text={source}", f"--config.data.heldout_text={source}"]


def write_mc_sets(root) -> list[str]:
    """Tiny HellaSwag / PIQA-schema files with short contexts (one shape bucket: few compiles)."""
    hs, pq = os.path.join(root, "hellaswag.jsonl"), os.path.join(root, "piqa.jsonl")
    with open(hs, "w") as f:
        for i in range(3):
            f.write(json.dumps({"ctx": f"def add_{i}(a, b):\n", "label": i % 4,
                                "endings": ["    return a + b\n", "    return a - b\n", "    pass\n",
                                            f"    print({i})\n"]}) + "\n")
    with open(pq, "w") as f:
        for i in range(3):
            f.write(json.dumps({"goal": f"Open file number {i}", "sol1": " with open()", "sol2": " by hand",
                                "label": i % 2}) + "\n")
    return [f"--config.eval.mc.hellaswag={hs}", f"--config.eval.mc.piqa={pq}"]


def nocache_scores(model, mc_files: dict, normalize: str, limit: int, needles: dict) -> tuple[dict, dict]:
    """`model`'s multiple-choice predictions per set and retrieval answer log-probs per length, computed without a
    cache or a builder: one no-cache forward (kvjax.models.decoder.forward) over every context + option and
    prompt + answer row, the continuation's log-probs summed (an option's normalized as the mc evaluation's
    `normalize` says). `mc_files`: schema -> JSONL path; `needles`: length -> retrieval items."""
    from kvjax.eval.multiple_choice import encode, load_mc
    from kvjax.models.decoder import forward
    cfg, params = model
    tok = kvjax.load_tokenizer(TOKENIZER)
    rows = []  # (what, token ids, first scored position, normalizer)
    for schema, path in mc_files.items():
        for i, it in enumerate(load_mc(path, schema=schema, limit=limit)):
            context = encode(tok, it.context)
            for option in it.options:
                ids = encode(tok, option)
                norm = {"bytes": len(option.encode()), "length": len(ids), "none": 1}[normalize]
                rows.append((("mc", schema, i), context + ids, len(context), norm))
    for length, items in needles.items():
        rows += [(("retrieval", length, i), it.prompt_ids + it.answer_ids, len(it.prompt_ids), 1)
                 for i, it in enumerate(items)]
    tokens = np.zeros((len(rows), max(len(r[1]) for r in rows)), np.int32)  # right-padded: causal, pads come last
    for r, (_, ids, _, _) in enumerate(rows):
        tokens[r, : len(ids)] = ids
    logits = jax.jit(lambda p, t: forward(p, cfg, t).logits)(params, tokens)
    logp = np.asarray(jax.nn.log_softmax(logits.astype(np.float32), -1))
    options, answers = {}, {}
    for r, ((kind, name, i), ids, start, norm) in enumerate(rows):
        total = sum(float(logp[r, j - 1, ids[j]]) for j in range(start, len(ids))) / norm
        if kind == "mc":
            options.setdefault(name, {}).setdefault(i, []).append(total)
        else:
            answers.setdefault(name, []).append(total)
    return {s: [int(np.argmax(o)) for _, o in sorted(items.items())] for s, items in options.items()}, answers


def check_real_pair_relations(out: str, source: str, target: str) -> dict:
    """Relations a main job's metrics.json must hold on any pair (returns the metrics): the native arms' multiple
    choice equals a computation without caches or builders; accuracies, KL ratios, distance means and throughput
    times follow from the per-item, per-window, per-layer and per-phase numbers they are computed from; the fitted
    ridge map is closer to the target's native cache than the unmapped source layers; the gate's checks hold the
    numbers they read."""
    from kvjax.eval.multiple_choice import load_mc
    from kvjax.eval.needles import make_needle_items
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    run_cfg = json.load(open(os.path.join(out, "config.json")))
    mc_cfg, rt_cfg = run_cfg["eval"]["mc"], run_cfg["eval"]["retrieval"]
    record = json.load(open(os.path.join(out, "eval", "mc.json")))
    rt_record = json.load(open(os.path.join(out, "eval", "retrieval.json")))
    files = {s: mc_cfg[s] for s in record}
    assert not rt_cfg["files"]  # generated retrieval items: made again here from the run's held-out tokens
    heldout = np.load(os.path.join(out, "data", "heldout.npy")).reshape(-1)
    tok = kvjax.load_tokenizer(TOKENIZER)
    needles = {str(n): make_needle_items(heldout, tok, n, rt_cfg["limit"], run_cfg["seed"]) for n in rt_cfg["lengths"]}
    for role, path in (("target", target), ("source", source)):
        predictions, answers = nocache_scores(kvjax.load_hf(path), files, mc_cfg["normalize"], mc_cfg["limit"],
                                              needles)
        for s, p in predictions.items():
            assert record[s]["arms"][role]["predictions"] == p, (role, s)
        for length, lp in answers.items():  # a continuous number: which model answered shows
            np.testing.assert_allclose(rt_record[length]["arms"][role]["answer_logprob"], lp, rtol=0, atol=2e-3,
                                       err_msg=f"{role} at {length}")
    for s, rec in record.items():
        labels = [it.label for it in load_mc(files[s], schema=s, limit=mc_cfg["limit"])]
        for arm, r in rec["arms"].items():
            assert r["correct"] == [p == lab for p, lab in zip(r["predictions"], labels)], (s, arm)
            assert metrics["mc"][s]["acc"][arm] == pytest.approx(np.mean(r["correct"])), (s, arm)
    kl = metrics["kl"]
    for arm, v in kl["per_window"].items():
        assert kl[arm] == pytest.approx(np.mean(v)) and min(v) >= 0, arm
    assert kl["reduction"] == pytest.approx(1 - kl["residual"] / kl["ridge"])
    assert kl["vs_target"] == pytest.approx(kl["residual"] / kl["target"])
    diff = np.subtract(kl["per_window"]["residual"], kl["per_window"]["ridge"])
    assert kl["residual_minus_ridge"] == pytest.approx(diff.mean(), abs=1e-9)
    assert kl["windows_improved"] == int(np.sum(diff < 0))
    assert kl["residual_minus_ridge_ci95"][0] <= kl["residual_minus_ridge"] <= kl["residual_minus_ridge_ci95"][1]
    d = metrics["distances"]
    for m in ("key_cos", "value_cos", "key_nrmse", "value_nrmse", "attn_cos", "attn_nrmse"):
        for arm, layers in d["per_layer"].items():
            assert d[m][arm] == pytest.approx(np.mean([layer[m] for layer in layers])), (m, arm)
    for kind in ("key", "value"):  # the ridge is fitted to the native cache; the unmapped source is not
        assert d[f"{kind}_nrmse"]["ridge"] < d[f"{kind}_nrmse"]["raw"], kind
        assert d[f"{kind}_cos"]["ridge"] > d[f"{kind}_cos"]["raw"], kind
    for length, t in metrics["throughput"].items():
        for arm, phases in t["phases_s"].items():
            ttft = sum(v for k, v in phases.items() if k != "decode")
            assert t["ttft_s"][arm] == pytest.approx(ttft), (length, arm)
            # the map (and a transfer) occupy both devices (kvjax.eval.decode_throughput.active_seconds)
            active = ttft + phases["decode"] + phases.get("map", 0.0) + phases.get("transfer", 0.0)
            assert t["active_s"][arm] == pytest.approx(active), (length, arm)
    g = metrics["gate"]
    final, checks = g["map"], g["checks"]
    for kind in ("key_cos", "value_cos"):
        assert checks[kind]["value"] == pytest.approx(d[kind][g["thresholds"]["cos_arm"] or final]), kind
    assert checks["kl_vs_target"]["value"] == pytest.approx(kl["vs_target"])
    assert checks["kl_reduction"]["value"] == pytest.approx(kl["reduction"])
    retention = min(m["acc"][final] / m["acc"]["target"] for m in metrics["mc"].values() if m["acc"]["target"])
    assert checks["mc_retention"]["value"] == pytest.approx(retention)
    measured = [c for c in checks.values() if c["value"] is not None]
    for c in measured:
        assert c["passed"] == (c["value"] >= c["threshold"] if c["kind"] == "min" else c["value"] <= c["threshold"])
    assert g["passed"] == (bool(measured) and all(c["passed"] for c in measured))
    return metrics


def lookup(d, path: str):
    """Values at a dotted path ("*" fans out over keys)."""
    nodes = [d]
    for part in path.split("."):
        nodes = [v for n in nodes for v in (n.values() if part == "*" else [n[part]])]
    return nodes


def tiny_pair(root, source_layers=3, target_layers=2, same_kv=False):
    """Tiny random Qwen3 checkpoints sharing the toy tokenizer (vocab 8192)."""
    def make(name, hidden, layers, heads, kv, hd, seed):
        cfg = kvjax.Qwen3Config(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                                num_heads=heads, num_kv_heads=kv, head_dim=hd, rope_theta=10_000.0,
                                tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
        path = os.path.join(root, name)
        kvjax.save_hf(path, cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1), tokenizer_dir=TOKENIZER)
        return path
    return (make("source", 32, source_layers, 4, 2, 16, 0),
            make("target", 16, target_layers, 2, 2 if same_kv else 1, 16, 1))


@pytest.fixture(scope="module", autouse=True)
def in_repo_root():
    """The shipped configs name repository-relative paths, as the README's commands run from the root."""
    old = os.getcwd()
    os.chdir(REPO)
    yield
    os.chdir(old)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(str(tmp_path_factory.mktemp("tiny_pair")))


# ---- configs -------------------------------------------------------------------------------------------------------

def test_default_config_is_toy_and_overrides_are_typed():
    cfg = config_flags.build("toy", [("eval.mc.limit", "50"), ("eval.throughput.lengths", "256, 1024"),
                                     ("map.rank", "8"), ("gate.max_kl", "0.5"), ("eval.kl.enabled", "false"),
                                     ("output_dir", "runs/x"), ("data.train_text", "a.txt,b.jsonl")], RunConfig)
    assert isinstance(cfg, RunConfig) and cfg.name == "toy"
    assert cfg.eval.mc.limit == 50 and cfg.eval.throughput.lengths == (256, 1024) and cfg.map.rank == 8
    assert cfg.gate.max_kl == 0.5 and cfg.eval.kl.enabled is False and cfg.output_dir == "runs/x"
    assert cfg.data.train_text == ("a.txt", "b.jsonl")
    assert config_flags.build("toy", [("map.rank", "None")], RunConfig).map.rank is None
    name, overrides, rest = config_flags.parse_argv(["--config.seed", "3", "--redo=report", "--config.eval.mc.limit=2"])
    assert name is None and overrides == [("seed", "3"), ("eval.mc.limit", "2")] and rest == ["--redo=report"]
    cfg, redo, _ = launch.parse(["--config.eval.mc.limit=7", "--redo=mc,report"])  # default: toy_pruned_quick
    assert cfg.name == "toy_pruned_quick" and cfg.eval.mc.limit == 7 and redo == ("mc", "report")


def test_toy_pruned_config_runs_the_shipped_pruned_target_and_gates_on_the_map_goals():
    cfg = config_flags.build("toy_pruned", [], RunConfig)
    toy = config_flags.build("toy", [], RunConfig)
    assert cfg.source == toy.source and os.path.isfile(os.path.join(cfg.target.path, "model.safetensors"))
    assert cfg.output_dir != toy.output_dir and cfg.map.pairing == "top3" and cfg.map.residual_rank == 64
    g = cfg.gate  # the cache-map issue's goals
    assert (g.min_key_cos, g.min_value_cos, g.min_kl_reduction, g.min_mc_gap_recovered) == (0.9, 0.6, 0.2, 0.6)
    assert g.min_mc_gain_ci_lo == 0.0 and g.cos_arm == "ridge"
    preflight.validate(cfg)  # every file it names exists and every setting is in range



def test_default_config_is_the_pruned_pair_with_the_method_goals_in_its_gate():
    """The default run shows the map working: the pruned target, the full-size config's pairing and
    residual width, a teacher pool, the per-head peer, and a gate on cosines, attention fidelity, KL and MC gain."""
    cfg = config_flags.build(DEFAULT_CONFIG, [], RunConfig)
    full = config_flags.build("toy_pruned", [], RunConfig)
    assert (cfg.source, cfg.target) == (full.source, full.target) and cfg.output_dir != full.output_dir
    assert (cfg.map.pairing, cfg.map.residual_rank) == ("top3", 64) and cfg.residual.pool_windows > 0
    assert cfg.peers.perhead_topk == 3 and "perhead" in cfg.eval.mc.arms
    g = cfg.gate
    assert g.min_attn_cos is not None and g.min_kl_reduction > 0 and g.min_mc_gap_recovered == 0.6
    assert g.min_mc_gain_ci_lo == 0.0 and g.cos_arm == "ridge"
    assert list(plan(cfg))[:4] == ["calibrate", "ridge", "residual", "perhead"]
    preflight.validate(cfg)
    old = config_flags.build("toy", [], RunConfig)  # the from-scratch pair stays shipped, its gate as before
    assert old.target.path.endswith("toy/target") and old.gate.min_attn_cos is None and old.peers.perhead_topk == 0
    assert "perhead" not in plan(old) and plan(old)["report"].settings["gate"] == \
        {k: v for k, v in dataclasses.asdict(old.gate).items()
         if k not in ("min_attn_cos", "min_retrieval", "min_audio_gain_ci_lo", "min_audio_gap_recovered",
                      "min_audio_margin_kept", "min_audio_decode_ratio", "min_ruler_unseen", "min_chance_retention",
                      "min_agreement_vs_direct", "max_latency_vs_source")}  # old runs keep their hash


@pytest.mark.parametrize("overrides, message", [
    ([("eval.mc.limt", "3")], "unknown config field 'eval.mc.limt' (did you mean 'eval.mc.limit'?)"),
    ([("nope", "3")], "unknown config field 'nope'"),
    ([("eval.mc.limit", "many")], "--config.eval.mc.limit='many': expected int or none"),
    ([("eval.kl.enabled", "maybe")], "expected bool"),
    ([("eval", "1")], "'eval' is a group of settings"),
    ([("seed.x", "1")], "'seed' holds a single value"),
])
def test_bad_overrides_are_clear_errors(overrides, message):
    with pytest.raises(ConfigFlagError) as e:
        config_flags.build("toy", overrides, RunConfig)
    assert message in str(e.value)


def test_unknown_config_and_wrong_config_type():
    with pytest.raises(ConfigFlagError, match="there is no configs/nope.py; available: .*toy"):
        config_flags.build("nope", [], RunConfig)
    with pytest.raises(ConfigFlagError, match="returns a ToyPairConfig, not a RunConfig"):
        config_flags.build(os.path.join(REPO, "launch", "toy", "config.py"), [], RunConfig)


def test_cli_errors_exit_nonzero_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert launch.main([f"--config.output_dir={out}", "--config.eval.mc.limt=3"]) == 2
    assert "did you mean 'eval.mc.limit'" in capsys.readouterr().err
    assert launch.main([f"--config.output_dir={out}", "--config.eval.mc.hellaswag=missing.jsonl",
                        "--config.map.pairing=best", "--config.eval.retrieval.arms=target,oracle"]) == 2
    err = capsys.readouterr().err
    assert "no such file missing.jsonl" in err and "map.pairing='best'" in err and "unknown arms ['oracle']" in err
    assert launch.main([f"--config.output_dir={out}", "--bogus"]) == 2
    wrong = tmp_path / "wrong_schema.jsonl"
    wrong.write_text(json.dumps({"goal": "a", "sol1": "b", "sol2": "c", "label": 0}) + "\n")
    assert launch.main([f"--config.output_dir={out}", f"--config.eval.mc.hellaswag={wrong}"]) == 2
    assert "lacks field 'ctx' of the 'hellaswag' schema" in capsys.readouterr().err
    assert launch.main([f"--config.output_dir={out}", "--config.gate.cos_arm=ridg"]) == 2
    assert "gate.cos_arm='ridg': use ridge, residual, perhead, bridge, raw or None" in capsys.readouterr().err
    assert not out.exists()


def test_missing_qwen_checkpoints_fail_fast_naming_what_to_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KVJAX_SOURCE", "KVJAX_TARGET")}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "kvjax.launch", "--config=qwen32_8", f"--config.output_dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "KVJAX_SOURCE" in proc.stderr and "--config.source.path" in proc.stderr and "Qwen3-32B" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()
    env["KVJAX_SOURCE"], env["KVJAX_TARGET"] = str(tmp_path / "nope32"), str(tmp_path / "nope8")
    proc = subprocess.run([sys.executable, "-m", "kvjax.launch", "--config=qwen32_8", f"--config.output_dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "(from $KVJAX_SOURCE) does not exist" in proc.stderr and not out.exists()


def test_offline_without_a_copy_of_the_hub_corpus_refuses_naming_it_and_what_to_pass(tmp_path, monkeypatch):
    """The real configs read FineWeb-Edu from the hub: offline, with the models there and no cached or local copy,
    the job stops in the fast checks (no JAX) with one line naming the corpus and the flags that replace it."""
    out = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if k not in ("KVJAX_SOURCE", "KVJAX_TARGET")}, **OFFLINE}
    env.update(KVJAX_SOURCE=os.path.join(TOY, "source"), KVJAX_TARGET=os.path.join(TOY, "pruned"))
    proc = subprocess.run([sys.executable, "-m", "kvjax.launch", "--config=qwen32_8", f"--config.output_dir={out}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not out.exists()
    line = next(x for x in proc.stderr.splitlines() if "fineweb-edu" in x)
    assert "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train (data.train_text and data.heldout_text)" in line
    assert "HF_HUB_OFFLINE=1 is set" in line and "--config.data.train_text=hf:/path/to/copy" in line
    assert "--config.data.train_text=stdlib:train --config.data.heldout_text=stdlib:heldout" in line
    cfg = config_flags.build("qwen32_8", [("output_dir", str(out))], RunConfig)
    for k in ("KVJAX_SOURCE", "KVJAX_TARGET", *OFFLINE):
        monkeypatch.setenv(k, env[k])
    start = time.perf_counter()
    with pytest.raises(preflight.LaunchError, match="must be streamed from the Hugging Face hub"):
        preflight.check_fast(preflight.resolve_models(cfg))
    assert time.perf_counter() - start < 2.0
    for k in (*OFFLINE, "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")  # no network: the probe says so as quickly
    start = time.perf_counter()
    with pytest.raises(preflight.LaunchError, match=r"hub.invalid:443 cannot be reached"):
        preflight.check_fast(preflight.resolve_models(cfg))
    assert time.perf_counter() - start < 2.0
    assert not out.exists()


# ---- the gate and split_generate's fallback ------------------------------------------------------------------------

def test_gate_thresholds():
    metrics = {"distances": {"key_cos": {"residual": 0.9}, "value_cos": {"residual": 0.6}},
               "kl": {"residual": 0.4, "ridge": 0.5, "reduction": 0.2},
               "mc": {"hellaswag": {"acc": {"target": 0.5, "residual": 0.49}},
                      "piqa": {"acc": {"target": 0.6, "residual": 0.66}}},
               "retrieval": {"1024": {"target": 0.0, "residual": 0.0}}}
    g = evaluate_gate(metrics, GateConfig())
    assert g.passed and {c.name for c in g.checks} == {"key_cos", "value_cos", "kl_vs_target", "kl_reduction",
                                                       "mc_retention"}
    assert g.to_json()["checks"]["mc_retention"]["value"] == pytest.approx(0.98)
    g = evaluate_gate(metrics, GateConfig(min_mc_retention=0.99, max_kl=0.3, min_retrieval_retention=0.5))
    assert not g.passed and {c.name for c in g.failed} == {"mc_retention", "kl"}
    assert "mc_retention 0.98 < 0.99" in g.summary()
    assert g.to_json()["checks"]["retrieval_retention"]["value"] is None  # target scored 0: not measured
    assert not evaluate_gate({}, GateConfig()).passed  # thresholds but nothing measured: no pass
    assert evaluate_gate(metrics, GateConfig(None, None, None, None, None, None)).passed  # no thresholds at all
    assert evaluate_gate({"kl": {"ridge": 0.5}}, GateConfig(max_kl=0.6), map_arm="ridge").passed
    # a map that leaves the target further from the source than its own prefill fails (default threshold 1.0)
    worse = evaluate_gate({**metrics, "kl": {**metrics["kl"], "target": 0.38, "vs_target": 0.4 / 0.38}}, GateConfig())
    assert not worse.passed and [c.name for c in worse.failed] == ["kl_vs_target"]
    assert "kl_vs_target 1.053 > 1" in worse.summary()
    assert evaluate_gate({**metrics, "kl": {**metrics["kl"], "target": 0.45, "vs_target": 0.4 / 0.45}},
                         GateConfig()).passed


def test_gate_on_the_share_of_the_multiple_choice_gap():
    def mc(gap_h, lo_h, gap_p, lo_p):
        return {"mc": {"hellaswag": {"gap_recovered_by_arm": {"ridge": 0.1, "residual": gap_h},
                                     "delta_vs_target": {"residual": {"mean": 0.1, "ci95": [lo_h, 0.2]}}},
                       "piqa": {"gap_recovered_by_arm": {"residual": gap_p},
                                "delta_vs_target": {"residual": {"mean": 0.1, "ci95": [lo_p, 0.2]}}}}}
    only = dict.fromkeys(["min_key_cos", "min_value_cos", "max_kl_vs_target", "min_kl_reduction",
                          "min_mc_retention"])
    cfg = GateConfig(**only, min_mc_gap_recovered=0.6, min_mc_gain_ci_lo=0.0)
    assert evaluate_gate(mc(0.77, 0.12, 0.86, 0.09), cfg).passed
    g = evaluate_gate(mc(0.77, 0.12, 0.55, -0.01), cfg)
    assert {(c.name, c.note) for c in g.failed} == {("mc_gap_recovered", "piqa"), ("mc_gain_ci_lo", "piqa")}
    assert "mc_gap_recovered 0.55 < 0.6" in g.summary()
    # source no better than target: the share is undefined (null), so the check is not measured and cannot pass
    g = evaluate_gate({"mc": {"piqa": {"gap_recovered_by_arm": {"residual": None}}}},
                      GateConfig(**only, min_mc_gap_recovered=0.6))
    assert not g.passed and g.to_json()["checks"]["mc_gap_recovered"]["value"] is None
    assert evaluate_gate(mc(0.05, 0.0, 0.05, 0.0), cfg, map_arm="ridge").to_json()["checks"]["mc_gap_recovered"][
        "value"] == pytest.approx(0.1)
    # cache distances of another arm than the gated map (the ridge, which a residual moves away from on purpose)
    dist = {"distances": {"key_cos": {"ridge": 0.98, "residual": 0.7}, "value_cos": {"ridge": 0.97, "residual": 0.7}}}
    cos = dict(only, min_key_cos=0.9, min_value_cos=0.6)
    assert [c.name for c in evaluate_gate(dist, GateConfig(**cos)).failed] == ["key_cos"]
    g = evaluate_gate(dist, GateConfig(**cos, cos_arm="ridge"))
    assert g.passed and g.to_json()["checks"]["key_cos"] == {"value": 0.98, "threshold": 0.9, "kind": "min",
                                                             "passed": True, "note": "ridge"}


@pytest.fixture(scope="module")
def fitted(pair, qwen_run):
    """The tiny pair and the map the qwen32_8 run fitted for it."""
    source, target = kvjax.load_hf(pair[0]), kvjax.load_hf(pair[1])
    return source, target, kvjax.load_map(os.path.join(qwen_run[0], "map"), source[0], target[0])


def test_split_generate_falls_back_to_native_target_when_the_gate_fails(fitted, caplog):
    source, target, kvmap = fitted
    prompts = [[5, 9, 300, 41, 7000, 12], [8, 1000, 3]]
    native = np.asarray(kvjax.generate(target[1], target[0], prompts, max_new_tokens=5))
    failed = evaluate_gate({"distances": {"key_cos": {"residual": 0.1}}}, GateConfig(min_value_cos=None))
    with caplog.at_level(logging.WARNING, logger="kvjax.split"):
        result = kvjax.split_generate(source, target, kvmap, prompts, 5, gate=failed, timings=True)
    assert result.path == "native_target" and result.fell_back and "key_cos 0.1 < 0.8" in result.reason
    assert "falling back to native target prefill" in caplog.text
    np.testing.assert_array_equal(np.asarray(result.tokens), native)
    assert set(result.phases) == {"prefill", "first_token", "decode"}
    mapped = np.asarray(kvjax.split_generate(source, target, kvmap, prompts, 5))
    ok = kvjax.split_generate(source, target, kvmap, prompts, 5, gate=True)
    assert ok.path == "split" and not ok.fell_back and ok.phases == {}
    np.testing.assert_array_equal(np.asarray(ok.tokens), mapped)
    with pytest.raises(TypeError, match="gate must be a GateResult"):
        kvjax.split_generate(source, target, kvmap, prompts, 5, gate="yes")


def test_map_distances_match_the_one_shot_metric(fitted):
    from kvjax.eval.cache_distances import cache_distances, map_distances
    from maptools import native_cache
    source, target, kvmap = fitted
    windows = np.random.RandomState(1).randint(1, 8192, (3, 48)).astype(np.int32)  # the run's shapes: compiled
    got = map_distances({"ridge": kvmap}, source, target, windows, batch_size=2)["ridge"]["per_layer"]
    mapped = kvjax.apply_map(kvmap, native_cache(source[1], source[0], windows))
    want = cache_distances(mapped, native_cache(target[1], target[0], windows), target[0].rope_theta)
    for g, w in zip(got, want):
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-4, abs=1e-5)


def test_throughput_accounting_follows_the_seed():
    from kvjax.eval.decode_throughput import active_seconds, ttft_seconds
    mapped = {"source_prefill": 1.0, "map": 0.1, "first_token": 0.01, "decode": 0.5}
    native = {"prefill": 1.0, "first_token": 0.02, "decode": 2.0}
    assert ttft_seconds("mapped", mapped) == pytest.approx(1.11)
    assert active_seconds("mapped", mapped) == pytest.approx(1.0 + 0.01 + 0.5 + 2 * 0.1)  # map on both devices
    assert ttft_seconds("source", native) == pytest.approx(1.02)
    assert active_seconds("source", native) == pytest.approx(3.02)


def test_batched_arm_scorers_match_item_by_item(fitted, tmp_path):
    from kvjax.eval import load_mc, score_mc, score_retrieval
    from kvjax.eval.arms import make_arms, score_mc_arms, score_retrieval_arms
    from kvjax.eval.needles import make_needle_items
    source, target, kvmap = fitted
    tok = kvjax.load_tokenizer(TOKENIZER)
    arms = make_arms(("target", "source", "ridge"), source, target, {"ridge": kvmap})
    items = load_mc(os.path.join(TOY, "eval", "piqa.jsonl"), schema="piqa", limit=3)
    batched = score_mc_arms(items, tok, arms, batch_size=2, progress=False)
    for arm in arms:
        one = score_mc(items, tok, arm.model[1], arm.model[0], prefix_fn=arm.prefix_fn, progress=False)
        np.testing.assert_allclose(batched[arm.name].logprobs, one.logprobs, rtol=1e-4, atol=1e-3)
        np.testing.assert_array_equal(batched[arm.name].n_bytes, one.n_bytes)
    haystack = np.random.RandomState(0).randint(1, 8192, 500)
    needles = make_needle_items(haystack, tok, 40, 3, seed=0)
    assert all(len(it.prompt_ids) == 40 for it in needles)
    # a target whose greedy answer is right: teacher forcing must call it a hit, as greedy decoding does
    greedy = [np.asarray(kvjax.generate(target[1], target[0], [it.prompt_ids], 6, eos_token_ids=()))[0].tolist()
              for it in needles]
    hits = [dataclasses.replace(it, answer_ids=g) for it, g in zip(needles, greedy)]
    for items in (needles, hits):
        batched = score_retrieval_arms(items, arms, batch_size=2, progress=False)
        for arm in arms:
            one = score_retrieval(items, arm.model[1], arm.model[0], prefix_fn=arm.prefix_fn, progress=False)
            np.testing.assert_array_equal(batched[arm.name].correct, one.correct)
            np.testing.assert_allclose(batched[arm.name].answer_logprob, one.answer_logprob, rtol=1e-4, atol=1e-3)
            for it, g, o in zip(items, batched[arm.name].generated, one.generated):
                miss = next((i for i, (a, b) in enumerate(zip(g, it.answer_ids)) if a != b), len(g))
                assert g[: miss + 1] == o[: miss + 1]  # greedy's tokens, up to its first miss
    assert batched["target"].correct.all()


# ---- end to end ----------------------------------------------------------------------------------------------------

def run_job(argv, env=None):
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        return launch.main(argv)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def stage_mtimes(out) -> dict:
    d = os.path.join(out, "stages")
    return {f: os.path.getmtime(os.path.join(d, f)) for f in os.listdir(d)}


@pytest.fixture(scope="module")
def qwen_run(pair, tmp_path_factory):
    """--config=qwen32_8 with tiny checkpoints standing in for 32B / 8B (through KVJAX_SOURCE / KVJAX_TARGET), on
    the standard library's text (test_qwen32_8_calibrates_on_a_local_copy_of_fineweb_edu_offline reads the
    config's own corpus)."""
    out = str(tmp_path_factory.mktemp("qwen_run") / "run")
    env = {"KVJAX_SOURCE": pair[0], "KVJAX_TARGET": pair[1]}
    argv = ["--config=qwen32_8", f"--config.output_dir={out}", "--config.source.dtype=float32",
            "--config.target.dtype=float32", *SMALL, *write_mc_sets(os.path.dirname(out)), *STDLIB_TEXT]
    rc = run_job(argv, env)
    return out, argv, env, rc


def test_qwen32_8_path_end_to_end_writes_the_report(qwen_run, pair):
    out, _, _, rc = qwen_run
    assert rc == 0
    check_real_pair_relations(out, *pair)
    for name in ("report.md", "metrics.json", "gate.json", "run.log", "config.json", "throughput.png",
                 "active_compute.png", "ttft.png", "distances.png", "kl_slope.png", "mc.png", "retrieval.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    for path in REQUIRED:
        values = lookup(metrics, path)
        assert values, path
        for v in values:
            if path.endswith("ci95"):
                assert len(v) == 2 and v[0] <= v[1], path
            elif path.startswith(("mc.", "retrieval.", "distances.key_cos", "distances.value_cos")) \
                    and "gap" not in path:
                assert -1 <= v <= 1, (path, v)
            elif path != "gate.passed" and v is not None:
                assert isinstance(v, float), (path, v)
    assert set(metrics["throughput"]) == {"32"} and set(metrics["retrieval"]) == {"40", "48"}
    assert metrics["run"]["config"] == "qwen32_8" and metrics["run"]["source"]["name"] == "Qwen3-32B"
    gate = load_gate(os.path.join(out, "gate.json"))
    assert gate.passed == metrics["gate"]["passed"]
    report = open(os.path.join(out, "report.md")).read()
    for heading in ("## Summary", "## Quality: multiple choice", "## Speed", "## What the map learned",
                    "## Residual", "## Long-context retrieval", "## Quality gate", "![KL slope chart](kl_slope.png)"):
        assert heading in report
    assert "8 x cpu" in report  # sharded over the fake devices


def test_qwen32_8_calibrates_on_a_local_copy_of_fineweb_edu_offline(pair, tmp_path, monkeypatch):
    """The real config's text is FineWeb-Edu; a local copy in its format (made here) stands in for the hub's,
    offline: the calibrate stage takes the copy's calibration documents for the training text and its held-out ones
    for the held-out windows, caches their tokens in the run directory, and a rerun reads the cache, not the copy.
    Read under the config's hub name (the copy standing in for the hub's stream), it gives the same tokens, and the
    run's cache lets the offline checks pass."""
    from kvjax import corpus
    from kvjax.windows import consecutive
    for k, v in {**OFFLINE, "KVJAX_SOURCE": pair[0], "KVJAX_TARGET": pair[1]}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "run"
    text = fineweb_copy(str(tmp_path))
    cfg, _, _ = launch.parse(["--config=qwen32_8", f"--config.output_dir={out}", "--config.source.dtype=float32",
                              "--config.target.dtype=float32", *SMALL, *write_mc_sets(str(tmp_path)), *text])
    assert cfg.data.train_text == cfg.data.heldout_text == (text[0].split("=", 1)[1],)
    job = Job(cfg)
    job.check()
    os.makedirs(out)
    with jax.set_mesh(job.mesh()):
        job.stage_calibrate(job.stages["calibrate"])
    # the same arrays made here from the copy's documents: the calibration ones, then the held-out ones
    tok, docs = kvjax.load_tokenizer(TOKENIZER), stdlib_prose(PROSE_CHARS)

    def tokens(held, n):
        ids = [i for t in docs if corpus.is_heldout(t, 0.2, 0) == held
               for i in tok.encode(t, add_special_tokens=False).ids + [0]]  # the tiny pair's EOS: 0
        assert len(ids) > n  # more than the run read: it stopped at what it needed
        return np.asarray(ids[:n], np.int32)
    train, heldout = np.load(out / "data" / "train_tokens.npy"), np.load(out / "data" / "heldout.npy")
    np.testing.assert_array_equal(train, tokens(False, 6000))
    np.testing.assert_array_equal(heldout, consecutive(tokens(True, 3000), 80))
    cached = sorted(f for f in os.listdir(out / corpus.CACHE) if f.endswith(".json"))
    assert [f.split("-")[0] for f in cached] == ["heldout", "train"]
    real_open = corpus._open
    monkeypatch.setattr(corpus, "_open", lambda ds: pytest.fail(f"{ds.source} was read again"))
    shutil.rmtree(out / "data")
    with jax.set_mesh(job.mesh()):
        job.stage_calibrate(job.stages["calibrate"])  # --redo=calibrate: the cached tokens
    np.testing.assert_array_equal(np.load(out / "data" / "train_tokens.npy"), train)
    np.testing.assert_array_equal(np.load(out / "data" / "heldout.npy"), heldout)

    # the config's own hub name, its stream stood in for by the copy while "online": the same tokens; then, offline,
    # the fast checks pass on the run's cache alone, and refuse once it is gone
    copy, real_probe = corpus.dataset(cfg.data.train_text[0]), corpus.hub_unreachable
    monkeypatch.setattr(corpus, "_open", lambda ds: real_open(copy))
    monkeypatch.setattr(corpus, "hub_unreachable", lambda timeout=1.5: None)
    hub_out = tmp_path / "hub_run"
    cfg, _, _ = launch.parse(["--config=qwen32_8", f"--config.output_dir={hub_out}", "--config.source.dtype=float32",
                              "--config.target.dtype=float32", *SMALL, *write_mc_sets(str(tmp_path))])
    assert cfg.data.train_text == cfg.data.heldout_text == ("hf:HuggingFaceFW/fineweb-edu:sample-10BT:train",)
    job = Job(cfg)
    job.check()
    os.makedirs(hub_out)
    with jax.set_mesh(job.mesh()):
        job.stage_calibrate(job.stages["calibrate"])
    np.testing.assert_array_equal(np.load(hub_out / "data" / "train_tokens.npy"), train)
    monkeypatch.setattr(corpus, "hub_unreachable", real_probe)
    monkeypatch.setattr(corpus, "_open", lambda ds: pytest.fail("the hub was read"))
    preflight.check_fast(cfg)  # HF_HUB_OFFLINE=1: the cache serves
    shutil.rmtree(hub_out / corpus.CACHE)
    with pytest.raises(preflight.LaunchError, match="HF_HUB_OFFLINE=1 is set"):
        preflight.check_fast(cfg)


def test_second_run_reuses_every_stage(qwen_run):
    out, argv, env, _ = qwen_run
    before = stage_mtimes(out)
    metrics = open(os.path.join(out, "metrics.json")).read()
    assert run_job(argv, env) == 0
    assert stage_mtimes(out) == before and open(os.path.join(out, "metrics.json")).read() == metrics
    assert open(os.path.join(out, "run.log")).read().count("reused") >= len(before)


def test_changed_settings_conflict_and_redo_recomputes_downstream(qwen_run, capsys):
    out, argv, env, _ = qwen_run
    assert run_job(argv + ["--config.eval.mc.limit=2"], env) == 2
    err = capsys.readouterr().err
    assert "finished 'mc' stage made with other settings (mc.limit: 3 -> 2)" in err and "--redo=mc" in err
    before = stage_mtimes(out)
    assert run_job(argv + ["--config.eval.mc.limit=2", "--redo=mc"], env) == 0
    after = stage_mtimes(out)
    changed = {f for f in after if after[f] != before.get(f)}
    assert changed == {"mc.json", "report.json"}
    assert json.load(open(os.path.join(out, "metrics.json")))["mc"]["piqa"]["items"] == 2


def test_toy_config_resumes_residual_training(pair, tmp_path):
    """Default (toy) config with the models swapped for tiny ones: a run stopped mid-residual resumes from its
    checkpoint, and evaluations can be switched off."""
    out = str(tmp_path / "toy")
    argv = [f"--config.output_dir={out}", f"--config.source.path={pair[0]}", f"--config.target.path={pair[1]}",
            *SMALL, "--config.residual.steps=4", "--config.eval.mc.enabled=false",
            "--config.eval.retrieval.enabled=false", "--config.eval.throughput.enabled=false",
            # the default's fact-copy windows, kept on (a resume with copies) at tiny sizes
            "--config.residual.copy_windows=4", "--config.residual.copy_len=128", "--config.residual.copy_batch=1"]
    cfg, _, _ = launch.parse(argv)
    job = Job(cfg)
    job.check()
    os.makedirs(out)
    with jax.set_mesh(job.mesh()):
        for name in ("calibrate", "ridge"):
            getattr(job, f"stage_{name}")(job.stages[name])
            job.run.finish(job.stages[name], 0.0)
        # a residual run interrupted after 2 of 4 steps (checkpointed every 2)
        workdir = os.path.join(out, "residual")
        job.run.claim_workdir(job.stages["residual"], workdir)
        kvjax.train_residual(job.map("ridge"), *job.models(), np.asarray(job.data("train_tokens")), cfg.residual,
                             workdir=workdir, stop_at=2, tokenizer=job.tokenizer())  # as the job calls it
    assert launch.main(argv) == 0
    log_text = open(os.path.join(out, "run.log")).read()
    assert "resumed from step 2" in log_text and "stage calibrate  reused" in log_text
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    assert set(metrics) >= {"distances", "kl", "gate"} and "mc" not in metrics and "throughput" not in metrics
    assert metrics["run"]["config"] == DEFAULT_CONFIG and metrics["run"]["map"]["residual_steps"] == 4
    # the default's peer and fidelity measures: per-head map fitted, sized and scored; attention cosine gated
    assert set(metrics["run"]["maps"]) == {"perhead", "ridge", "residual"}
    assert all(m["size_bytes"] > 0 for m in metrics["run"]["maps"].values())
    assert "perhead" in metrics["distances"]["attn_cos"] and "attn_cos" in metrics["gate"]["checks"]


def test_truncated_checkpoint_ends_the_job_with_its_message_only(pair, tmp_path, capsys):
    """A truncated .safetensors: the job exits 1 printing the loader's message (no traceback) and leaves nothing
    half-written; once the file is whole again, the rerun reuses the finished stages and completes."""
    import shutil
    source = tmp_path / "source"
    shutil.copytree(pair[0], source)
    weights = source / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "run"
    argv = [f"--config.output_dir={out}", f"--config.source.path={source}", f"--config.target.path={pair[1]}",
            *SMALL, "--config.residual.steps=0", "--config.eval.mc.enabled=false",
            "--config.eval.retrieval.enabled=false", "--config.eval.throughput.enabled=false"]
    assert run_job(argv) == 1  # an uncaught exception would fail this test with its traceback
    err = capsys.readouterr().err
    assert f"kvjax.launch: error: {weights}" in err and "truncated" in err and "re-download or re-save" in err
    assert "Traceback" not in err
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    assert sorted(os.listdir(out / "stages")) == ["calibrate.json"]  # the data stage finished before the load
    assert not (out / "map_ridge").exists()
    weights.write_bytes(whole)
    assert run_job(argv) == 0
    assert "stage calibrate  reused" in (out / "run.log").read_text()

"""configs/qwen30a3_sibling: Qwen3-30B-A3B (MoE) reads, a dense Qwen3 sibling answers. Without checkpoints it fails
fast naming what to pass; `--help` shows every field; the main job runs end to end on tiny random checkpoints of the
two families sharing the toy tokenizer."""

import json
import os
import subprocess
import sys

import jax
import pytest

import kvjax
from kvjax.models.qwen3_moe import Qwen3MoeConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "checkpoints", "toy", "tokenizer")


def tiny_sibling_pair(root):
    """A 3-layer MoE reader (4 experts, top 2, its middle layer dense) and a 4-layer dense answerer with twice its KV
    heads, sharing the toy tokenizer (vocab 8192): 30B-A3B (48 layers, 4 KV heads) and 32B (64, 8) in miniature."""
    common = dict(vocab_size=8192, head_dim=16, rope_theta=1e6, tie_word_embeddings=True, eos_token_ids=(0,),
                  pad_token_id=0)
    moe = Qwen3MoeConfig(hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=1,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                         mlp_only_layers=(1,), **common)
    dense = kvjax.Qwen3Config(hidden_size=24, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                              **common)
    paths = []
    for name, cfg, seed in (("moe", moe, 0), ("dense", dense, 1)):
        path = os.path.join(root, name)
        kvjax.save_hf(path, cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1), tokenizer_dir=TOKENIZER)
        paths.append(path)
    return paths


def test_without_checkpoints_fails_fast_naming_what_to_pass(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KVJAX_SOURCE", "KVJAX_TARGET")}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "kvjax.launch", "--config=qwen30a3_sibling",
                           f"--config.output_dir={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not out.exists()
    assert "KVJAX_SOURCE" in proc.stderr and "--config.source.path" in proc.stderr and "Qwen3-30B-A3B" in proc.stderr


@pytest.mark.slow  # a whole main job (every stage of qwen32_8's plan, tiny sizes)
def test_runs_end_to_end_on_tiny_moe_and_dense_checkpoints(tmp_path, capsys):
    from test_launch import SMALL, STDLIB_TEXT, check_real_pair_relations, run_job, write_mc_sets
    from kvjax.job import command as launch
    reader, answerer = tiny_sibling_pair(str(tmp_path))
    out = str(tmp_path / "run")
    old = os.getcwd()
    os.chdir(REPO)  # the config names repository-relative data, as the README's commands run from the root
    try:
        capsys.readouterr()
        assert launch.main(["--config=qwen30a3_sibling", "--help"]) == 0
        shown = capsys.readouterr().out
        for field in ("source.name = 'Qwen3-30B-A3B'", "target.name = 'Qwen3-32B'", "map.pairing = 'depth'",
                      "residual.steps", "eval.kl.enabled", "gate.min_key_cos", "data.train_text"):
            assert field in shown, field
        argv = ["--config=qwen30a3_sibling", f"--config.output_dir={out}", "--config.source.dtype=float32",
                "--config.target.dtype=float32", *SMALL, *write_mc_sets(str(tmp_path)), *STDLIB_TEXT]
        assert run_job(argv, {"KVJAX_SOURCE": reader, "KVJAX_TARGET": answerer}) == 0
        metrics = check_real_pair_relations(out, reader, answerer)  # values, not just keys (test_launch says which)
    finally:
        os.chdir(old)
    assert metrics["run"]["config"] == "qwen30a3_sibling" and metrics["run"]["source"]["name"] == "Qwen3-30B-A3B"
    manifest = json.load(open(os.path.join(out, "map", "manifest.json")))
    assert [list(p) for p in manifest["spec"]["pairing"]] == [[0], [1], [1], [2]]  # depth: 3 MoE layers -> 4
    # the saved map loads for the pair (the throughput stage decoded from it through kvjax.split_generate)
    kvmap = kvjax.load_map(os.path.join(out, "map"), kvjax.load_hf(reader)[0], kvjax.load_hf(answerer)[0])
    assert kvmap.spec.pairing == ((0,), (1,), (1,), (2,))

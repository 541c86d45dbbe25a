"""The shipped toy pair (checkpoints/toy) and its pruned target: load unchanged in kvjax and transformers, agree, and
make a real pair."""

import json
import os

import numpy as np
import pytest
import torch

import kvjax
from kvjax.eval import window_losses

TOY = os.path.join(os.path.dirname(__file__), "..", "checkpoints", "toy")
ROLES = ("target", "source")  # the pair trained from scratch
PRUNED = "pruned"  # a target cut from the source (python -m launch.toy.pruned; configs/toy_pruned.py)


@pytest.fixture(scope="module", params=ROLES + (PRUNED,))
def role(request):
    return request.param


def test_shipped_checkpoints_are_hf_qwen3_and_small():
    total = 0
    for r in ROLES:
        cfg = json.load(open(os.path.join(TOY, r, "config.json")))
        assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["eos_token_id"] == 0
        total += sum(os.path.getsize(os.path.join(TOY, r, f)) for f in os.listdir(os.path.join(TOY, r)))
    assert total <= 40 * 2**20
    target, source = (kvjax.load_hf_config(os.path.join(TOY, r)) for r in ROLES)
    assert source.num_params() > 3 * target.num_params()
    assert source.vocab_size == target.vocab_size
    pruned = json.load(open(os.path.join(TOY, PRUNED, "config.json")))
    assert pruned["architectures"] == ["Qwen3ForCausalLM"] and pruned["torch_dtype"] == "bfloat16"
    assert os.path.getsize(os.path.join(TOY, PRUNED, "model.safetensors")) <= 10 * 2**20


def test_tokenizer_round_trip_and_agrees_with_transformers(role):
    import transformers
    tok = kvjax.load_tokenizer(os.path.join(TOY, role))
    text = 'def f(x):\n    """Return x squared."""\n    return x ** 2  # ünïcode, tabs\t and\r\n'
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    hf = transformers.AutoTokenizer.from_pretrained(os.path.join(TOY, role))
    assert hf(text)["input_ids"] == ids
    assert hf.eos_token_id == 0 and hf.pad_token_id == 0


def test_training_config_token_ids_match_the_shipped_tokenizer():
    from launch.toy.config import DIGITS, EQUALS_SPACE, get_config
    tok = kvjax.load_tokenizer(os.path.join(TOY, "tokenizer"))
    assert DIGITS == tuple(tok.token_to_id(str(d)) for d in range(10))
    assert list(EQUALS_SPACE) == tok.encode("x = 41199").ids[1:3]  # " =", " ", then one token per digit
    assert tok.encode("x = 41199").ids[3:] == [DIGITS[int(d)] for d in "41199"]
    facts = get_config().source_continue[-1]
    assert facts.copy_values == DIGITS and facts.copy_sep == EQUALS_SPACE


def test_kvjax_and_transformers_agree_on_heldout_loss(role):
    import transformers
    path = os.path.join(TOY, role)
    windows = np.load(os.path.join(TOY, "eval", "heldout_windows.npy"))[:2, :257].astype(np.int64)
    cfg, params = kvjax.load_hf(path)
    ours = window_losses(params, cfg, windows, batch_size=2)
    # float32 like load_hf (the pruned target is stored in bfloat16; transformers would compute in it)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.as_tensor(windows[:, :-1])).logits
        theirs = torch.nn.functional.cross_entropy(logits.transpose(1, 2), torch.as_tensor(windows[:, 1:]),
                                                   reduction="none").mean(1).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4)
    assert 1.0 < ours.mean() < 6.0  # trained: far below ln(8192) = 9.0


def test_source_is_clearly_better_than_target():
    windows = np.load(os.path.join(TOY, "eval", "heldout_windows.npy"))[:8, :513]
    ce = {}
    for r in ROLES + (PRUNED,):
        cfg, params = kvjax.load_hf(os.path.join(TOY, r))
        ce[r] = window_losses(params, cfg, windows, batch_size=8).mean()
    assert ce["source"] <= 0.85 * ce["target"], ce  # full held-out numbers: checkpoints/toy/README.md
    assert ce["source"] <= 0.85 * ce[PRUNED] and ce[PRUNED] < ce["target"], ce  # between the two


def test_source_retrieves_needles_the_target_cannot():
    from kvjax.eval import load_retrieval, score_retrieval
    tok = kvjax.load_tokenizer(os.path.join(TOY, "target"))
    items = load_retrieval(os.path.join(TOY, "eval", "retrieval_1024.jsonl"), tok, limit=20)
    hits = {r: score_retrieval(items, *kvjax.load_hf(os.path.join(TOY, r))[::-1], progress=False).correct.sum()
            for r in ROLES}
    # these 20: source 19/20; full set (200 items): source 97.5%, target 0% at 1K (checkpoints/toy/README.md)
    assert hits["target"] == 0 and hits["source"] >= 16, hits  # the goal: source >= 80%


def test_prune_layers_keeps_the_chosen_layers():
    import jax.numpy as jnp

    from kvjax.models.decoder import forward
    from launch.toy.pruned import prune_layers
    cfg, params = kvjax.load_hf(os.path.join(TOY, "source"))
    tokens = jnp.asarray(np.load(os.path.join(TOY, "eval", "heldout_windows.npy"))[:1, :32].astype(np.int32))
    same_cfg, same = prune_layers(cfg, params, range(cfg.num_layers))
    assert same_cfg == cfg
    np.testing.assert_array_equal(forward(same, same_cfg, tokens).logits, forward(params, cfg, tokens).logits)
    pcfg, pruned = prune_layers(cfg, params, (0, 3, 5))
    assert pcfg.num_layers == 3 and all(a is params.layers[i] for a, i in zip(pruned.layers, (0, 3, 5)))
    assert forward(pruned, pcfg, tokens).logits.shape == (1, 32, cfg.vocab_size)
    for bad in ((), (0, 6), (-1,)):
        with pytest.raises(ValueError, match="at least one index"):
            prune_layers(cfg, params, bad)


def test_pruned_build_refuses_a_checkpoint_of_another_build(tmp_path):
    from launch.toy.pruned import check_identity
    work = str(tmp_path / "w")
    ident = {"source_sha256": "a", "layers": [0, 3, 5], "train": {"steps": 100}}
    check_identity(work, ident)
    check_identity(work, ident)  # the same build resumes
    with pytest.raises(SystemExit, match="layers differ.*delete"):
        check_identity(work, {**ident, "layers": [0, 1]})
    os.makedirs(tmp_path / "v" / "ckpt")
    with pytest.raises(SystemExit, match="no pruned_identity.json"):
        check_identity(str(tmp_path / "v"), ident)


@pytest.mark.skipif(not os.path.isfile(os.path.join(TOY, "..", "..", "work", "toy", "data", "train.npy")),
                    reason="needs the tokenized corpus: python -m launch.toy.data")
def test_pruned_command_builds_a_checkpoint(tmp_path, monkeypatch):
    import dataclasses

    import launch.toy.pruned as pruned
    from launch.toy.config import get_config
    cfg = get_config()
    small = dataclasses.replace(cfg.pruned, layers=(0, 5), work_dir=str(tmp_path / "work"),
                                out_dir=str(tmp_path / "out"),
                                train=dataclasses.replace(cfg.pruned.train, steps=2, seq_len=64, batch_size=2,
                                                          eval_every=2, save_every=2, eval_batches=1))
    monkeypatch.setattr(pruned, "get_config", lambda: dataclasses.replace(cfg, pruned=small))
    monkeypatch.chdir(os.path.join(TOY, "..", ".."))
    pruned.main(["--shipped", os.path.abspath(TOY)])
    tcfg, params = kvjax.load_hf(str(tmp_path / "out"))
    assert tcfg.num_layers == 2 and not os.path.exists(tmp_path / "out.tmp")
    assert params.embed.dtype == np.float32  # stored in bfloat16, loaded in float32
    assert json.load(open(tmp_path / "out" / "config.json"))["torch_dtype"] == "bfloat16"
    pruned.main(["--shipped", os.path.abspath(TOY)])  # finished: resumes at the last step and re-exports

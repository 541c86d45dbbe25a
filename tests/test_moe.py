"""The Qwen3-MoE family: parity with transformers' Qwen3MoeForCausalLM on tiny random checkpoints (both dispatch
paths), routed == dense dispatch, sharded == one device, and its config/checkpoint handling."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
from kvjax import sharding
from kvjax.cache import shard_cache
from kvjax.models.family import family_of
from kvjax.models.params import param_specs, shard_params
from kvjax.models.qwen3_moe import Qwen3MoeConfig, SparseLayerParams, route

# name -> transformers.Qwen3MoeConfig kwargs: expert counts 4-8, top-1 and top-2, norm_topk_prob on and off, dense
# layers among sparse ones (mlp_only_layers, decoder_sparse_step), 1-3 layers, GQA 1/2/4, head_dim != hidden/heads
SHAPES = {
    "e8_top2_norm_dense_middle": dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                      mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2, head_dim=12),
    "e4_top1_step2_tied": dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=1, norm_topk_prob=False,
                               decoder_sparse_step=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                               tie_word_embeddings=True),
    "e6_top2_one_layer": dict(num_hidden_layers=1, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=8),
}


def hf_config(**kw):
    import transformers
    base = dict(vocab_size=128, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                max_position_embeddings=512, rope_theta=10_000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.Qwen3MoeConfig(**{**base, **kw})


def make_model(kw, seed=0, dtype=None):
    import transformers
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(hf_config(**kw)).eval()
    with torch.no_grad():  # non-trivial norms, and a router whose top-k is not decided by rounding
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model if dtype is None else model.to(dtype)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, kw in SHAPES.items():
        model = make_model(kw)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (str(path), model)
    return out


def tokens_of(vocab, shape, seed=0):
    return np.random.RandomState(seed).randint(3, vocab, shape).astype(np.int32)


def prefill_then_decode(params, cfg, tokens, split, capacity=48, dtype=jnp.float32):
    """Logits [B, T, V] from a prefill of tokens[:, :split] then one decode step per remaining token."""
    cache = kvjax.init_cache(cfg, tokens.shape[0], capacity, dtype)
    logits, cache = kvjax.prefill(params, cfg, tokens[:, :split], cache)
    out = [np.asarray(logits, np.float32)]
    for t in range(split, tokens.shape[1]):
        step, cache = kvjax.decode_step(params, cfg, tokens[:, t], cache)
        out.append(np.asarray(step, np.float32)[:, None])
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_prefill_and_every_decode_step_match_transformers_both_dispatches(checkpoints, name):
    path, model = checkpoints[name]
    cfg, params = kvjax.load_hf(path)
    kw = SHAPES[name]
    assert isinstance(cfg, Qwen3MoeConfig) and family_of(cfg).name == "qwen3_moe"
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob) == (
        kw["num_experts"], kw["num_experts_per_tok"], kw["norm_topk_prob"])
    kinds = [type(lp) is SparseLayerParams for lp in params.layers]
    assert kinds == [hasattr(layer.mlp, "experts") for layer in model.model.layers] and any(kinds)
    tokens = tokens_of(cfg.vocab_size, (2, 32))
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    got = {}
    # routed: a grouped matmul at prefill (48 routed pairs), at decode gathers (2 rows x top k <= experts / 2) or
    # the grouped matmul (e6_top2_one_layer); "auto" (the default) runs dense at prefill, the same gathers at decode
    for dispatch in ("dense", "routed"):
        c = dataclasses.replace(cfg, moe_dispatch=dispatch)
        got[dispatch] = prefill_then_decode(params, c, tokens, 24)
        np.testing.assert_allclose(got[dispatch], ref, atol=1e-4, rtol=0, err_msg=dispatch)
    np.testing.assert_allclose(got["routed"], got["dense"], atol=2e-5, rtol=0)


@pytest.mark.parametrize("name, dispatch", [("e8_top2_norm_dense_middle", "auto"), ("e4_top1_step2_tied", "dense")])
def test_greedy_generation_matches_transformers_generate(checkpoints, name, dispatch):
    path, model = checkpoints[name]
    cfg, params = kvjax.load_hf(path)
    prompt = tokens_of(cfg.vocab_size, (2, 7), seed=1)
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=24, min_new_tokens=24,
                                do_sample=False, eos_token_id=None)[:, 7:].numpy()
    c = dataclasses.replace(cfg, moe_dispatch=dispatch)
    ours = np.asarray(kvjax.generate(params, c, prompt, max_new_tokens=24, eos_token_ids=()))
    np.testing.assert_array_equal(ours, theirs)


def test_bfloat16_matches_transformers_bfloat16(tmp_path):
    kw = SHAPES["e8_top2_norm_dense_middle"]
    model = make_model(kw, seed=3, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg, params = kvjax.load_hf(tmp_path, dtype=jnp.bfloat16)
    assert params.layers[0].gate.dtype == jnp.bfloat16
    tokens = tokens_of(cfg.vocab_size, (1, 20), seed=2)
    with torch.no_grad():
        ref = model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    ours = prefill_then_decode(params, cfg, tokens, 12, capacity=32, dtype=jnp.bfloat16)
    scale = np.abs(ref).max()
    # bf16 rounding (and a near-tie in the router flipping an expert) stay within a few % of the logit scale...
    assert np.abs(ours - ref).max() <= 0.05 * scale
    # ...while different weights (a wrong expert layout, a missing norm) move them far more
    with torch.no_grad():
        other = make_model(kw, seed=4)(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(other - ref).max() > 0.2 * scale


def test_routing_is_transformers_router(checkpoints):
    path, model = checkpoints["e8_top2_norm_dense_middle"]
    cfg, params = kvjax.load_hf(path)
    h = np.random.RandomState(5).randn(30, cfg.hidden_size).astype(np.float32)
    with torch.no_grad():
        _, weights, ids = model.model.layers[0].mlp.gate(torch.tensor(h))
    w, i = route(params.layers[0], cfg, jnp.asarray(h))
    np.testing.assert_array_equal(np.asarray(i), ids.numpy())
    np.testing.assert_allclose(np.asarray(w), weights.numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, atol=1e-6)  # norm_topk_prob


def test_sharded_on_8_devices_equals_one_device(checkpoints):
    assert jax.device_count() == 8, "conftest sets XLA_FLAGS=--xla_force_host_platform_device_count=8"
    path, _ = checkpoints["e8_top2_norm_dense_middle"]
    cfg, params = kvjax.load_hf(path)
    tokens = tokens_of(cfg.vocab_size, (2, 14), seed=3)  # 2 rows x top 2 <= 8 experts / 2: decode gathers
    for dispatch in ("auto",):  # dense at prefill, gathers at decode (the grouped path: the parity test)
        c = dataclasses.replace(cfg, moe_dispatch=dispatch)
        want = prefill_then_decode(params, c, tokens, 12)
        mesh = sharding.make_mesh(data=2, model=4)
        with jax.set_mesh(mesh):
            sp = shard_params(params, c, mesh)
            cache = shard_cache(kvjax.init_cache(c, 2, 48), mesh)
            logits, cache = kvjax.prefill(sp, c, tokens[:, :12], cache)
            got = [np.asarray(logits)]
            for t in range(12, 14):
                step, cache = kvjax.decode_step(sp, c, tokens[:, t], cache)
                got.append(np.asarray(step)[:, None])
        np.testing.assert_allclose(np.concatenate(got, 1), want, atol=2e-5, err_msg=dispatch)
    # experts: the width (moe_intermediate_size 24) splits over 'model', the expert axis is replicated
    assert sp.layers[0].gate.sharding.spec == jax.sharding.PartitionSpec(None, None, "model")
    assert sp.layers[0].down.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert len(sp.layers[0].gate.sharding.device_set) == 8
    # expert parallelism is one rule away: the expert axis takes 'model' and the width replicates
    ep = shard_params(params, cfg, mesh, rules={**sharding.RULES, "experts": "model"})
    assert ep.layers[0].gate.sharding.spec == jax.sharding.PartitionSpec("model", None, None)


def test_config_reads_both_expert_count_names_and_round_trips(checkpoints, tmp_path):
    path, _ = checkpoints["e8_top2_norm_dense_middle"]
    with open(f"{path}/config.json") as f:
        d = json.load(f)
    assert "num_local_experts" in d  # what transformers 5 writes; hub checkpoints say num_experts
    d["num_experts"] = d.pop("num_local_experts")
    cfg = Qwen3MoeConfig.from_hf_dict(d)
    assert cfg.num_experts == 8 and cfg.mlp_only_layers == (1,) and cfg.moe_dispatch == "auto"
    assert [cfg.is_sparse(i) for i in range(3)] == [True, False, True]
    assert Qwen3MoeConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert cfg.fingerprint() != dataclasses.replace(cfg, num_experts_per_tok=1).fingerprint()
    # the parameter count is the checkpoint's
    model = checkpoints["e8_top2_norm_dense_middle"][1]
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert cfg.active_params() < cfg.num_params()
    with pytest.raises(kvjax.ConfigError, match="num_experts_per_tok"):
        dataclasses.replace(cfg, num_experts_per_tok=9)
    with pytest.raises(kvjax.ConfigError, match="moe_dispatch"):
        dataclasses.replace(cfg, moe_dispatch="fast")


def test_save_hf_writes_what_transformers_loads(checkpoints, tmp_path):
    import transformers
    path, model = checkpoints["e4_top1_step2_tied"]
    cfg, params = kvjax.load_hf(path)
    kvjax.save_hf(tmp_path, cfg, params)
    names = {n for s in param_specs(cfg).values() for n in (s.hf_parts or (s.hf_name,))}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.tensor(tokens_of(cfg.vocab_size, (1, 10)), dtype=torch.long)
    with torch.no_grad():
        np.testing.assert_allclose(again(tokens).logits.numpy(), model(tokens).logits.numpy(), atol=1e-6)


def test_checkpoint_missing_an_expert_names_it(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file
    path, _ = checkpoints["e6_top2_one_layer"]
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(f"{path}/config.json") as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(kvjax.CheckpointError, match=r"missing tensors.*experts\.5\.up_proj"):
        kvjax.load_hf(tmp_path)

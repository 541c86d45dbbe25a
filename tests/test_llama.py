"""The Llama family: parity with transformers' LlamaForCausalLM on tiny random checkpoints it writes (GQA ratios,
head_dim != hidden / heads, llama3 RoPE scaling on and off, biases on and off, tied and untied, 1-3 layers), its
config and errors, the map's exact un-RoPE / re-RoPE across RoPE descriptions, a Qwen3 -> Llama map, the tokenizer
check, and the minitron4_llama8 job on tiny random Llama checkpoints."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
from kvjax import sharding
from kvjax.cache import shard_cache
from kvjax.models.family import family_of
from kvjax.models.llama import LlamaConfig
from kvjax.models.params import shard_params
from kvjax.models.rope import Rope, apply_rope, rope_angles

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "checkpoints", "toy", "tokenizer")
# llama3 scaling with a short original context, so that at the tests' 40 positions every band is in play (wavelengths
# above 16 divided by 8, below 4 kept, between interpolated)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@dataclasses.dataclass(frozen=True)
class TinyLlama:
    hidden: int = 64
    layers: int = 3
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 24
    ffn: int = 96
    vocab: int = 160
    tied: bool = False
    rope: tuple = tuple(LLAMA3.items())
    attention_bias: bool = False
    mlp_bias: bool = False

    def hf_config(self):
        import transformers
        return transformers.LlamaConfig(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            tie_word_embeddings=self.tied, max_position_embeddings=1024, rope_parameters=dict(self.rope),
            attention_bias=self.attention_bias, mlp_bias=self.mlp_bias, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


PLAIN = (("rope_type", "default"), ("rope_theta", 10_000.0))
SHAPES = {
    # GQA 2, head_dim 24 != 64 / 4, llama3 scaling, every bias, untied, 3 layers
    "gqa2_llama3_biases": TinyLlama(attention_bias=True, mlp_bias=True),
    # MHA, plain RoPE, no biases, tied, 2 layers
    "mha_plain_tied": TinyLlama(hidden=48, layers=2, heads=3, kv_heads=3, head_dim=16, tied=True, rope=PLAIN),
    # GQA 4, head_dim 32 = 32 / 8 x 8, llama3, attention biases only, 1 layer
    "gqa4_llama3_attn_bias": TinyLlama(hidden=32, layers=1, heads=8, kv_heads=2, head_dim=32, attention_bias=True),
}


def make_hf(tiny: TinyLlama, seed=0, dtype=None):
    import transformers
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny.hf_config()).eval()
    with torch.no_grad():  # transformers starts norms at one and biases at zero: make both matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.05)
    return model if dtype is None else model.to(dtype)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, tiny in SHAPES.items():
        model = make_hf(tiny)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (str(path), model)
    return out


def torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def random_tokens(vocab, shape, seed=0):
    return np.random.RandomState(seed).randint(3, vocab, shape).astype(np.int32)


def prefill_then_decode(params, cfg, tokens, n_prefill, cache):
    logits, cache = kvjax.prefill(params, cfg, tokens[:, :n_prefill], cache)
    out = [np.asarray(logits, np.float32)]
    for t in range(n_prefill, tokens.shape[1]):
        step, cache = kvjax.decode_step(params, cfg, tokens[:, t], cache)
        out.append(np.asarray(step, np.float32)[:, None])
    return np.concatenate(out, axis=1), cache


# ---- parity with transformers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SHAPES))
def test_prefill_every_decode_step_and_greedy_generate_match_transformers(checkpoints, name):
    path, model = checkpoints[name]
    cfg, params = kvjax.load_hf(path)
    tiny = SHAPES[name]
    assert family_of(cfg).name == "llama" and isinstance(cfg, LlamaConfig)
    assert cfg.rope.kind == dict(tiny.rope)["rope_type"] and cfg.tie_word_embeddings == tiny.tied
    assert (params.layers[0].q_bias is not None) == tiny.attention_bias
    assert (params.layers[0].gate_bias is not None) == tiny.mlp_bias
    tokens = random_tokens(cfg.vocab_size, (2, 40))
    ref = torch_logits(model, tokens)
    ours, cache = prefill_then_decode(params, cfg, tokens, 24, kvjax.init_cache(cfg, 2, 64))
    for t in range(40):  # prefill positions, then every decode step
        np.testing.assert_allclose(ours[:, t], ref[:, t], atol=1e-4, rtol=0, err_msg=f"position {t}")
    assert np.asarray(cache.lengths).tolist() == [40, 40]

    prompt = random_tokens(cfg.vocab_size, (2, 9), seed=1)
    greedy = np.asarray(kvjax.generate(params, cfg, prompt, max_new_tokens=24, eos_token_ids=()))
    with torch.no_grad():
        theirs = model.generate(torch.tensor(prompt, dtype=torch.long), max_new_tokens=24, min_new_tokens=24,
                                do_sample=False, eos_token_id=None)
    np.testing.assert_array_equal(greedy, theirs[:, 9:].numpy())


def test_bfloat16_matches_transformers_bfloat16(tmp_path):
    tiny = SHAPES["gqa2_llama3_biases"]
    model = make_hf(tiny, seed=3, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    cfg, params = kvjax.load_hf(tmp_path, dtype=jnp.bfloat16)
    assert params.embed.dtype == jnp.bfloat16 and params.layers[0].q_bias.dtype == jnp.bfloat16
    tokens = random_tokens(cfg.vocab_size, (1, 24), seed=2)
    ref = torch_logits(model, tokens)
    ours, _ = prefill_then_decode(params, cfg, tokens, 16, kvjax.init_cache(cfg, 1, 32, jnp.bfloat16))
    scale = np.abs(ref).max()
    # bf16 keeps 8 mantissa bits: two correct implementations differ by rounding order (~1% of the logit scale)...
    assert np.abs(ours - ref).max() <= 0.03 * scale
    # ...while another model (a real bug's size of change) is far off
    assert np.abs(torch_logits(make_hf(tiny, seed=4), tokens) - ref).max() > 0.1 * scale


def test_sharded_on_8_devices_equals_one_device(checkpoints):
    assert jax.device_count() == 8, "conftest sets XLA_FLAGS=--xla_force_host_platform_device_count=8"
    path, _ = checkpoints["gqa4_llama3_attn_bias"]  # 8 q heads split 4 ways, 2 kv heads replicated; biases sharded
    cfg, params = kvjax.load_hf(path)
    tokens = random_tokens(cfg.vocab_size, (8, 18), seed=5)
    want, _ = prefill_then_decode(params, cfg, tokens, 12, kvjax.init_cache(cfg, 8, 32))
    mesh = sharding.make_mesh(data=2, model=4)
    with jax.set_mesh(mesh):
        sharded = shard_params(params, cfg, mesh)
        got, cache = prefill_then_decode(sharded, cfg, tokens, 12, shard_cache(kvjax.init_cache(cfg, 8, 32), mesh))
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert sharded.layers[0].q_bias.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert cache.keys[0].sharding.spec[0] == "data"


# ---- config, saving, errors ----------------------------------------------------------------------------------------

def _edit_config(path, **changes):
    p = os.path.join(path, "config.json")
    d = json.load(open(p))
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    json.dump(d, open(p, "w"))


def test_config_layouts_save_round_trip_and_unsupported_checkpoints(checkpoints, tmp_path):
    path, model = checkpoints["gqa2_llama3_biases"]
    cfg, params = kvjax.load_hf(path)
    assert cfg.rope == Rope(500_000.0, "llama3", 8.0, 1.0, 4.0, 16) and cfg.num_params() == model.num_parameters()

    old = tmp_path / "old_layout"  # transformers 4 wrote rope_theta + rope_scaling (rope_type once spelled "type")
    shutil.copytree(path, old)
    _edit_config(old, rope_parameters=None, rope_theta=500_000.0,
                 rope_scaling={"type": "llama3", **{k: v for k, v in LLAMA3.items() if k not in ("rope_type",
                                                                                                   "rope_theta")}})
    assert kvjax.load_hf_config(old) == cfg

    saved = tmp_path / "saved"  # kvjax.save_hf writes what transformers reads back to the same logits
    kvjax.save_hf(saved, cfg, params)
    import transformers
    again = transformers.LlamaForCausalLM.from_pretrained(saved).eval()
    tokens = random_tokens(cfg.vocab_size, (1, 12))
    np.testing.assert_allclose(torch_logits(again, tokens), torch_logits(model, tokens), atol=1e-6)
    assert kvjax.load_hf_config(saved) == cfg

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    for changes, message in [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
         r"rope_type 'yarn' is not supported; kvjax implements \['default', 'llama3'\]"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}, "llama3 rope scaling needs"),
        ({"architectures": ["LlamaForSequenceClassification"]},
         r"architectures \['LlamaForSequenceClassification'\] are not supported.*LlamaForCausalLM.*Qwen3ForCausalLM"),
        ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
         r"model_type 'mistral' is not supported; kvjax reads .*LlamaForCausalLM \(model_type 'llama'\).*"
         r"Qwen3ForCausalLM \(model_type 'qwen3'\)"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ]:
        shutil.copyfile(os.path.join(path, "config.json"), bad / "config.json")
        _edit_config(bad, **changes)
        with pytest.raises(kvjax.ConfigError, match=message):
            kvjax.load_hf(bad)
    shutil.copyfile(os.path.join(path, "config.json"), bad / "config.json")
    _edit_config(bad, attention_bias=False)  # weights with biases, a config without: named, not silently dropped
    with pytest.raises(kvjax.CheckpointError, match=r"unexpected tensors .*q_proj.bias.*Is this a Llama checkpoint"):
        kvjax.load_hf(bad)


# ---- the map across RoPE descriptions and families -----------------------------------------------------------------

def llama(layers, hidden, heads, kv_heads, head_dim, seed, rope, vocab=96, **kw):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope=rope, tie_word_embeddings=True,
                      eos_token_ids=(), pad_token_id=0, **kw)
    return kvjax.Model(cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1))


PLAIN_ROPE, SCALED_ROPE = Rope(10_000.0), Rope(500_000.0, "llama3", 8.0, 1.0, 4.0, 16)


@pytest.mark.parametrize("src_rope, tgt_rope", [(PLAIN_ROPE, SCALED_ROPE), (SCALED_ROPE, PLAIN_ROPE)],
                         ids=["unscaled_to_llama3", "llama3_to_unscaled"])
def test_map_unropes_and_reropes_exactly_across_rope_descriptions(src_rope, tgt_rope, tmp_path):
    """Two one-layer models with the same weights and different RoPE have the same pre-RoPE keys and the same values,
    so the direct map (copy, un-RoPE with the source's description, RoPE with the target's) must give the target's
    own cache, and decoding from it the target's own tokens."""
    source = llama(1, 32, 4, 2, 16, seed=0, rope=src_rope, attention_bias=True)
    target = kvjax.Model(dataclasses.replace(source.cfg, rope=tgt_rope), source.params)
    kvmap = kvjax.mapper.kvmap.direct_map(source.cfg, target.cfg, ((0,),))
    assert (kvmap.spec.source_rope, kvmap.spec.target_rope) == (src_rope, tgt_rope)
    tokens = random_tokens(96, (2, 40), seed=6)
    native = kvjax.NativePrefill(target)(tokens, np.full(2, 40))
    mapped = kvjax.apply_map(kvmap, kvjax.NativePrefill(source)(tokens, np.full(2, 40)))
    # float32 roundings of one rotation each way on keys of size ~1: a wrong frequency is off by O(1)
    np.testing.assert_allclose(np.asarray(mapped.k), np.asarray(native.k), atol=2e-5)
    np.testing.assert_allclose(np.asarray(mapped.v), np.asarray(native.v), atol=1e-6)
    keys = native.k[0, :, :, :40]  # [B, Hkv, T, hd]: the target's content rotated with ITS angles
    content = kvjax.kernels.features.content_features(keys, tgt_rope).reshape(2, 40, 2, 16).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(np.asarray(apply_rope(content, *rope_angles(jnp.arange(40), 16, tgt_rope))),
                               np.asarray(keys), atol=2e-5)
    prompts = random_tokens(96, (2, 12), seed=7)
    split = np.asarray(kvjax.split_generate(source, target, kvmap, prompts, 8, eos_token_ids=()))
    np.testing.assert_array_equal(split, np.asarray(kvjax.generate(target.params, target.cfg, prompts, 8,
                                                                   eos_token_ids=())))
    kvjax.save_map(tmp_path / "map", kvmap)  # the manifest records each Rope, scaling included
    spec = json.load(open(tmp_path / "map" / "manifest.json"))["spec"]
    assert spec["source_rope"] == src_rope.to_json() and spec["target_rope"] == tgt_rope.to_json()
    assert kvjax.load_map(tmp_path / "map", source.cfg, target.cfg).spec == kvmap.spec


def test_maps_saved_before_rope_descriptions_still_load(tmp_path):
    source = llama(1, 32, 4, 2, 16, seed=0, rope=PLAIN_ROPE)
    kvmap = kvjax.mapper.kvmap.direct_map(source.cfg, source.cfg, ((0,),))
    kvjax.save_map(tmp_path / "map", kvmap)
    mpath = tmp_path / "map" / "manifest.json"
    manifest = json.load(open(mpath))  # rewrite as kvjax-map-v1 wrote it: thetas as floats
    manifest["format"] = "kvjax-map-v1"
    for role in ("source", "target"):
        manifest["spec"][f"{role}_theta"] = manifest["spec"].pop(f"{role}_rope")["theta"]
    json.dump(manifest, open(mpath, "w"))
    assert kvjax.load_map(tmp_path / "map").spec == kvmap.spec


def test_qwen3_to_llama_map_fits_applies_and_decodes_and_other_tokenizers_are_refused(tmp_path):
    qcfg = kvjax.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                             num_kv_heads=2, head_dim=16, rope_theta=1e6, tie_word_embeddings=True, eos_token_ids=(),
                             pad_token_id=0)
    source = kvjax.Model(qcfg, kvjax.init_params(qcfg, jax.random.key(0), std=0.1))
    target = llama(2, 48, 4, 1, 24, seed=1, rope=SCALED_ROPE, attention_bias=True, mlp_bias=True)
    calib, held = random_tokens(96, (12, 32), seed=8), random_tokens(96, (4, 32), seed=9)
    kvmap, report = kvjax.fit_map(source, target, calib, held, residual_rank=4, batch_size=4)
    assert report["pairing"] == [[0], [2]] and (kvmap.spec.source_rope, kvmap.spec.target_rope) == (
        Rope(1e6), SCALED_ROPE)
    for layer in report["layers"]:  # a linear map of the target's own features: fitted, not noise
        assert layer["key"]["train_r2"] > 0.05 and layer["value"]["train_r2"] > 0.05
    prompts = random_tokens(96, (2, 10), seed=10)
    split = np.asarray(kvjax.split_generate(source, target, kvmap, prompts, 6, eos_token_ids=()))
    piped = np.asarray(kvjax.split_generate(source, target, kvmap, prompts, 6, eos_token_ids=(), pipeline=True))
    assert split.shape == (2, 6) and ((split >= 0) & (split < 96)).all()
    np.testing.assert_array_equal(split, piped)  # the pipelined path maps each layer with the same Rope pair

    # "the same tokenizer": equal vocab_size, and equal tokenizer.json fingerprints where both have one
    other = llama(2, 48, 4, 1, 24, seed=1, rope=SCALED_ROPE, vocab=97)
    with pytest.raises(ValueError, match=r"vocabularies differ \(96 vs 97\).*share a tokenizer"):
        kvjax.fit_map(source, other, calib, held)
    with pytest.raises(ValueError, match="tokenizers differ .*share a tokenizer"):
        kvjax.fit_map(source, target, calib, held, tokenizers=("aaaa", "bbbb"))
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        os.makedirs(d)
        shutil.copyfile(os.path.join(TOKENIZER, "tokenizer.json"), d / "tokenizer.json")
    assert kvjax.hf.tokenizer_mismatch(str(a), str(b)) is None
    tok = json.load(open(b / "tokenizer.json"))
    vocab = tok["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]  # two tokens swap ids: same size, other tokenizer
    vocab[first], vocab[second] = vocab[second], vocab[first]
    json.dump(tok, open(b / "tokenizer.json", "w"))
    assert "tokenizers differ" in kvjax.hf.tokenizer_mismatch(str(a), str(b))


# ---- the minitron4_llama8 job on tiny random Llama checkpoints -----------------------------------------------------

def tiny_llama_pair(root):
    """A 2-layer reader and a 3-layer answerer (llama3 RoPE, head_dim != hidden / heads, biases on the answerer)
    sharing the toy tokenizer (vocab 8192): Minitron-4B-Width and Llama-3.1-8B in miniature."""
    rope = Rope(500_000.0, "llama3", 8.0, 1.0, 4.0, 32)
    paths = []
    for name, layers, hidden, heads, seed, bias in (("reader", 2, 24, 2, 0, False), ("answerer", 3, 32, 4, 1, True)):
        cfg = LlamaConfig(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                          num_heads=heads, num_kv_heads=2, head_dim=16, rope=rope, attention_bias=bias,
                          tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
        path = os.path.join(root, name)
        kvjax.save_hf(path, cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1), tokenizer_dir=TOKENIZER)
        paths.append(path)
    return paths


def test_minitron4_llama8_without_checkpoints_fails_fast_naming_what_to_pass(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KVJAX_SOURCE", "KVJAX_TARGET")}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "kvjax.launch", "--config=minitron4_llama8",
                           f"--config.output_dir={out}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and not out.exists()
    assert "KVJAX_SOURCE" in proc.stderr and "--config.source.path" in proc.stderr
    assert "Llama-3.1-Minitron-4B-Width" in proc.stderr


@pytest.mark.slow  # a whole main job (every stage, tiny sizes)
def test_minitron4_llama8_runs_end_to_end_on_an_identity_pair(tmp_path, capsys):
    """The whole job with one tiny Llama checkpoint as both reader and answerer, where every number is known: the
    unmapped layers are the answerer's own cache, the fitted maps reproduce it, every arm answers as the native
    answerer does item for item, and the reader drafts exactly what the answerer would say. (Real pairs: the qwen32_8
    and qwen30a3_sibling jobs, whose relations test_launch.check_real_pair_relations checks.)"""
    from test_launch import SMALL, STDLIB_TEXT, run_job, write_mc_sets
    from kvjax.job import command as launch
    reader, answerer = tiny_llama_pair(str(tmp_path))
    out = str(tmp_path / "run")
    old = os.getcwd()
    os.chdir(REPO)  # the config names repository-relative data, as the README's commands run from the root
    try:
        assert "native_kl.enabled = True" in _help("minitron4_llama8", capsys)
        small = SMALL + ["--config.eval.native_kl.windows=3", "--config.eval.native_kl.prefix_len=56",
                         "--config.eval.native_kl.cont_len=8", "--config.eval.native_kl.batch_size=3",
                         "--config.eval.ttft.lengths=32", "--config.eval.ttft.repeats=1",
                         "--config.eval.retrieval.limit=1", "--config.eval.retrieval.lengths=48",
                         "--config.eval.speculative.lengths=32", "--config.eval.speculative.new_tokens=4",
                         "--config.eval.speculative.repeats=1", "--config.arms.partial_k=1"]
        argv = ["--config=minitron4_llama8", f"--config.output_dir={out}", "--config.source.dtype=float32",
                "--config.target.dtype=float32", *small, *write_mc_sets(str(tmp_path)), *STDLIB_TEXT]
        assert run_job(argv, {"KVJAX_SOURCE": reader, "KVJAX_TARGET": reader}) == 0
        metrics = json.load(open(os.path.join(out, "metrics.json")))
        assert metrics["run"]["config"] == "minitron4_llama8"
        assert {"native_kl", "ttft", "speculative", "mc", "distances"} <= set(metrics)
        assert "throughput" not in metrics and "kl" not in metrics
        check_identity_pair(out, metrics)
        manifest = json.load(open(os.path.join(out, "map", "manifest.json")))
        assert manifest["spec"]["target_rope"]["kind"] == "llama3"

        other = tmp_path / "other_tokenizer"  # a reader with another tokenizer: refused before any work
        shutil.copytree(reader, other)
        tok = json.load(open(other / "tokenizer.json"))
        vocab = tok["model"]["vocab"]
        first, second = sorted(vocab, key=vocab.get)[100:102]
        vocab[first], vocab[second] = vocab[second], vocab[first]
        json.dump(tok, open(other / "tokenizer.json", "w"))
        capsys.readouterr()
        assert launch.main([*argv[:1], f"--config.output_dir={tmp_path / 'refused'}", f"--config.source.path={other}",
                            f"--config.target.path={answerer}", *STDLIB_TEXT]) == 2
        assert "tokenizers differ" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    finally:
        os.chdir(old)


def check_identity_pair(out: str, metrics: dict) -> None:
    """What a job on an identity pair (reader = answerer) must measure."""
    d = metrics["distances"]
    assert d["raw_kind"] == "copy"
    for m in ("key", "value", "attn"):
        assert d[f"{m}_cos"]["raw"] == pytest.approx(1, abs=1e-6) and d[f"{m}_nrmse"]["raw"] < 1e-6, m  # same cache
        assert d[f"{m}_cos"]["ridge"] == pytest.approx(1, abs=1e-6) and d[f"{m}_nrmse"]["ridge"] < 1e-4, m  # identity
        # the residual: a few Adam steps on a zero KL gradient move it by about the learning rate
        assert d[f"{m}_cos"]["residual"] > 0.9999 and d[f"{m}_nrmse"]["residual"] < 1e-2, m
    nk = metrics["native_kl"]
    assert set(nk["kl"]) == {"direct", "ridge", "residual", "partial"}
    for arm in nk["kl"]:
        assert abs(nk["kl"][arm]) < 1e-4 and nk["agreement"][arm] == nk["first_agreement"][arm] == 1.0, arm
    record = json.load(open(os.path.join(out, "eval", "mc.json")))
    for s, rec in record.items():
        native = rec["arms"]["target"]
        assert set(rec["arms"]) == {"target", "source", "direct", "ridge", "residual", "partial"}
        for arm, r in rec["arms"].items():  # item for item, not only the accuracy
            assert r["predictions"] == native["predictions"] and r["correct"] == native["correct"], (s, arm)
            assert metrics["mc"][s]["acc"][arm] == pytest.approx(np.mean(native["correct"])), (s, arm)
    assert metrics["gate"]["passed"] and metrics["gate"]["checks"]["mc_retention"]["value"] == 1.0
    for length, row in metrics["retrieval"].items():
        lp = row["answer_logprob"]
        assert lp["source"] == pytest.approx(lp["target"], abs=1e-5), length  # the same model reads and answers
        assert lp["direct"] == pytest.approx(lp["target"], abs=1e-4), length
        assert lp["residual"] == pytest.approx(lp["target"], abs=0.05) and row["residual"] == row["target"], length
    for length, row in metrics["speculative"]["lengths"].items():
        draft = int(next(a for a in row if a.startswith("plain@")).split("@")[1])
        for arm, m in row.items():
            assert m["matches_native"] == m["prefix_match"] == m["first_token_match"] == 1.0, (length, arm)
            if arm.split("@")[0] in ("plain", "transfer", "repaired"):  # the reader drafts the answerer's tokens
                assert m["acceptance_length"] == draft + 1, (length, arm)
            if arm != "native":
                assert m["latency_vs_native"] == pytest.approx(m["latency_s"] / row["native"]["latency_s"])
    for length, row in metrics["ttft"]["lengths"].items():
        for arm, t in row["ttft_s"].items():  # the whole call takes at least its phases
            assert t >= sum(row["phases_s"][arm].values()) * (1 - 1e-9), (length, arm)
            if arm != "target":
                assert row["speedup"][arm] == pytest.approx(row["ttft_s"]["target"] / t), (length, arm)


def _help(config, capsys) -> str:
    from kvjax.job import command as launch
    capsys.readouterr()
    assert launch.main([f"--config={config}", "--help"]) == 0
    return capsys.readouterr().out

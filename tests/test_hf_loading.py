"""HF checkpoint loading: sharded checkpoints, tokenizer, and a clear error for every kind of bad input."""

import json
import os
import shutil
import struct

import numpy as np
import pytest

import kvjax
from kvjax.tensorfile import SafetensorsFile, save_file


@pytest.fixture
def ckpt(hf_checkpoints, tmp_path):
    """A private, editable copy of a tiny checkpoint."""
    src, _ = hf_checkpoints["gqa2_untied_odd"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_weights(path, edit):
    f = SafetensorsFile(str(path / "model.safetensors"))
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_sharded_index_checkpoint_loads_identically(hf_checkpoints, tmp_path):
    path, model = hf_checkpoints["gqa2_untied_odd"]
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    _, single = kvjax.load_hf(path)
    _, sharded = kvjax.load_hf(tmp_path)
    for a, b in zip(kvjax.models.params.to_flat(single).values(), kvjax.models.params.to_flat(sharded).values()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_hf_round_trips_through_transformers(hf_checkpoints, tmp_path):
    import torch
    import transformers
    path, model = hf_checkpoints["gqa1_tied"]
    cfg, params = kvjax.load_hf(path)
    kvjax.save_hf(tmp_path, cfg, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.arange(3, 20)[None]
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(tokens).logits.numpy(), model(tokens).logits.numpy(), atol=1e-6)
    cfg2, _ = kvjax.load_hf(tmp_path)
    assert cfg2 == cfg


def test_tokenizer_loads_and_round_trips(hf_checkpoints, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    src, _ = hf_checkpoints["gqa1_tied"]
    shutil.copytree(src, tmp_path / "m")
    tok.save(str(tmp_path / "m" / "tokenizer.json"))
    loaded = kvjax.load_tokenizer(tmp_path / "m")
    text = "def g(y):\n    return y * 2  # ünïcode\n"
    assert loaded.decode(loaded.encode(text).ids) == text


# ---- every bad input gets a message that says what is wrong and what to do ---------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(kvjax.CheckpointError, match="does not exist"):
        kvjax.load_hf(tmp_path / "nope")


def test_file_instead_of_directory(ckpt):
    with pytest.raises(kvjax.CheckpointError, match="is a file; pass the checkpoint directory"):
        kvjax.load_hf(ckpt / "config.json")


def test_missing_config(ckpt):
    os.remove(ckpt / "config.json")
    with pytest.raises(kvjax.CheckpointError, match="no config.json"):
        kvjax.load_hf(ckpt)


def test_missing_weights_names_pickle_alternative(ckpt):
    os.rename(ckpt / "model.safetensors", ckpt / "pytorch_model.bin")
    with pytest.raises(kvjax.CheckpointError, match="only safetensors.*safe_serialization=True"):
        kvjax.load_hf(ckpt)


def test_missing_shard_of_index(hf_checkpoints, tmp_path):
    _, model = hf_checkpoints["gqa2_untied_odd"]
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    os.remove(sorted(tmp_path.glob("model-*.safetensors"))[1])
    with pytest.raises(kvjax.CheckpointError, match="download is incomplete"):
        kvjax.load_hf(tmp_path)


def test_missing_tensor(ckpt):
    _rewrite_weights(ckpt, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(kvjax.CheckpointError, match=r"missing tensors.*layers\.1\.self_attn\.k_norm"):
        kvjax.load_hf(ckpt)


def test_unexpected_tensor(ckpt):
    def add(t):
        t["model.layers.3.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"]
    _rewrite_weights(ckpt, add)
    with pytest.raises(kvjax.CheckpointError, match=r"unexpected tensors.*layers\.3.*num_hidden_layers"):
        kvjax.load_hf(ckpt)


def test_shape_mismatch(ckpt):
    _edit_config(ckpt, intermediate_size=100)
    with pytest.raises(kvjax.CheckpointError, match=r"gate_proj.weight.*shape \[96, 64\].*implies \[100, 64\]"):
        kvjax.load_hf(ckpt)


def _header_len(b: bytes) -> int:
    return struct.unpack("<Q", b[:8])[0]


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:5], "too short for a safetensors header"),
    (lambda b: struct.pack("<Q", 10**12) + b[8:], "corrupt safetensors header"),
    (lambda b: b[:8] + b"{not json" + b[17:], r"corrupt safetensors header \(not valid JSON\)"),
    (lambda b: b[: 8 + _header_len(b) // 2], "ends inside its header: it is truncated"),
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\0" * 8, "bytes appended"),
])
def test_corrupt_safetensors(ckpt, damage, message):
    p = ckpt / "model.safetensors"
    p.write_bytes(damage(p.read_bytes()))
    with pytest.raises(kvjax.SafetensorsError, match=message) as e:
        kvjax.load_hf(ckpt)
    assert str(p) in str(e.value) and "re-download or re-save it" in str(e.value)  # which file, and the fix


def test_truncated_shard_of_index_names_the_shard(hf_checkpoints, tmp_path):
    _, model = hf_checkpoints["gqa2_untied_odd"]
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(kvjax.SafetensorsError, match=rf"{shard}.*truncated"):
        kvjax.load_hf(tmp_path)


def test_save_file_writes_strided_views_and_bfloat16_exactly(tmp_path):
    import ml_dtypes
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensors = {"t": a.T, "b": (a / 7).astype(ml_dtypes.bfloat16), "i": np.arange(5, dtype=np.int64)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    f = SafetensorsFile(str(tmp_path / "x.safetensors"))
    assert sorted(f.keys()) == ["b", "i", "t"] and f.shape("t") == (4, 3) and f.metadata == {"format": "pt"}
    for name, want in tensors.items():
        got = f.get(name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(kvjax.SafetensorsError, match=r"cannot write .*y.safetensors.*object"):
        save_file({"o": np.array([object()])}, str(tmp_path / "y.safetensors"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.safetensors"]  # nothing half-written


def test_save_hf_bfloat16_round_trips(hf_checkpoints, tmp_path):
    import jax.numpy as jnp
    path, _ = hf_checkpoints["gqa1_tied"]
    cfg, params = kvjax.load_hf(path, dtype=jnp.bfloat16)
    kvjax.save_hf(tmp_path, cfg, params)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, again = kvjax.load_hf(tmp_path, dtype=jnp.bfloat16)
    for a, b in zip(kvjax.models.params.to_flat(params).values(), kvjax.models.params.to_flat(again).values()):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2' is not supported.*qwen3"),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, "kvjax reads .*Qwen3ForCausalLM.*checkpoints; got"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope scaling .* not supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling .* not supported"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
])
def test_unsupported_config(ckpt, changes, message):
    _edit_config(ckpt, **changes)
    with pytest.raises(kvjax.ConfigError, match=message):
        kvjax.load_hf(ckpt)


def test_invalid_json_config(ckpt):
    (ckpt / "config.json").write_text("{")
    with pytest.raises(kvjax.ConfigError, match="not valid JSON"):
        kvjax.load_hf(ckpt)


def test_hub_name_without_network_is_a_clear_error():
    with pytest.raises(kvjax.CheckpointError, match="not a local directory and could not be fetched"):
        kvjax.load_hf("kvjax-test/does-not-exist")


def test_missing_tokenizer(ckpt):
    with pytest.raises(kvjax.CheckpointError, match="no tokenizer.json"):
        kvjax.load_tokenizer(ckpt)

"""The model-family seam: registry, Model, RoPE description."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.models.family import family_for_model_type, family_of, families
from kvjax.models.rope import Rope, rope_angles, rope_table
from maptools import tiny_model


def test_qwen3_is_a_registered_family_and_its_pieces_drive_the_decoder():
    cfg, params = tiny_model(2, 32, 2, 1, 16, seed=0, theta=1e4)
    fam = family_of(cfg)
    assert fam.name == "qwen3" and fam in families() and family_for_model_type("qwen3") is fam
    assert type(params.layers[0]) is fam.layer
    assert set(fam.param_specs(cfg)) == set(kvjax.models.params.to_flat(params))


def test_unknown_config_type_and_model_type_name_the_fix():
    @dataclasses.dataclass(frozen=True)
    class NotAFamily:
        num_layers: int = 1

    with pytest.raises(TypeError, match="not the config of a registered model family"):
        family_of(NotAFamily())
    with pytest.raises(kvjax.ConfigError, match="model_type 'gpt2' is not supported.*qwen3"):
        family_for_model_type("gpt2")


def test_model_is_one_pytree_that_unpacks_as_config_and_params():
    cfg, params = tiny_model(2, 32, 2, 1, 16, seed=0, theta=1e4)
    model = kvjax.Model(cfg, params)
    c, p = model
    assert c is cfg and p is params and model[0] is cfg and len(model) == 2
    assert len(jax.tree.leaves(model)) == len(jax.tree.leaves(params))  # the config is static
    total = jax.jit(lambda m: sum(x.sum() for x in jax.tree.leaves(m.params)))(model)
    np.testing.assert_allclose(total, sum(np.asarray(x).sum() for x in jax.tree.leaves(params)), rtol=1e-5)


def test_rope_description_is_what_the_forward_pass_and_the_map_use():
    cfg, _ = tiny_model(1, 32, 2, 1, 16, seed=0, theta=5e3)
    assert cfg.rope == Rope(5e3) and hash(cfg.rope) == hash(Rope(5e3))
    pos = jnp.arange(40)
    for a, b in zip(rope_angles(pos, 16, cfg.rope), rope_angles(pos, 16, 5e3)):  # a Rope or its theta: same angles
        np.testing.assert_array_equal(a, b)
    for a, b in zip(rope_table(40, 16, cfg.rope), rope_angles(pos, 16, cfg.rope)):
        np.testing.assert_allclose(a, b, atol=2e-6)


@pytest.mark.parametrize("d", [{"model_type": "qwen3"},
                               {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8}])
def test_every_family_names_a_missing_required_field(d):
    """The shared HF fields (kvjax.models.config.decoder_fields) turn a missing one into a ConfigError naming it."""
    from kvjax.models.config import ConfigError
    with pytest.raises(ConfigError, match="required field '(hidden_size|num_attention_heads)' is missing"):
        family_for_model_type(d["model_type"], "config.json").config.from_hf_dict(d, source="config.json")


def test_families_share_one_decoder_table():
    """Qwen3's and Llama's tables are the shared decoder table plus their own tensors (QK-norms; biases)."""
    from kvjax.models.config import Qwen3Config
    from kvjax.models.llama import LlamaConfig
    from kvjax.models.params import decoder_specs, param_specs
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=8)
    qwen, llama = Qwen3Config(**shape), LlamaConfig(**shape, attention_bias=True, mlp_bias=True)
    shared = set(decoder_specs(qwen))
    assert set(param_specs(qwen)) - shared == {f"layers.{i}.{n}" for i in range(2) for n in ("q_norm", "k_norm")}
    assert set(param_specs(llama)) - shared == {f"layers.{i}.{n}_bias" for i in range(2)
                                                for n in ("q", "k", "v", "o", "gate", "up", "down")}
    assert shared <= set(param_specs(qwen)) and shared <= set(param_specs(llama))

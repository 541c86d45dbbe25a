"""The same prefill/decode on 8 fake CPU devices, sharded over ('data', 'model'), equals one device."""

import jax
import numpy as np
import pytest

import kvjax
from kvjax import sharding
from kvjax.cache import shard_cache
from kvjax.models.params import shard_params


def run(params, cfg, tokens, steps):
    cache = kvjax.init_cache(cfg, tokens.shape[0], 48)
    return _run(params, cfg, tokens, steps, cache)


def _run(params, cfg, tokens, steps, cache):
    logits, cache = kvjax.prefill(params, cfg, tokens, cache)
    out = [np.asarray(logits)]
    for t in steps.T:
        step, cache = kvjax.decode_step(params, cfg, t, cache)
        out.append(np.asarray(step)[:, None])
    return np.concatenate(out, axis=1), cache


@pytest.mark.parametrize("data, model", [(2, 4), (1, 8), (8, 1), (4, 2)])
def test_sharded_prefill_and_decode_equal_single_device(hf_checkpoints, data, model):
    assert jax.device_count() == 8, "conftest sets XLA_FLAGS=--xla_force_host_platform_device_count=8"
    path, _ = hf_checkpoints["gqa4_hd_big"]  # 8 q heads, 2 kv heads: kv heads cannot split 4 or 8 ways
    cfg, params = kvjax.load_hf(path)
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, cfg.vocab_size, (8, 12)).astype(np.int32)
    steps = rng.randint(3, cfg.vocab_size, (8, 6)).astype(np.int32)
    want, _ = run(params, cfg, tokens, steps)

    mesh = sharding.make_mesh(data=data, model=model)
    with jax.set_mesh(mesh):
        sharded_params = shard_params(params, cfg, mesh)
        cache = shard_cache(kvjax.init_cache(cfg, 8, 48), mesh)
        got, cache = _run(sharded_params, cfg, tokens, steps, cache)
    np.testing.assert_allclose(got, want, atol=2e-5)
    q = sharded_params.layers[0].q
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
    assert len(q.sharding.device_set) == 8
    if data > 1:  # the cache keeps its batch sharding through prefill and decode
        assert cache.keys[0].sharding.spec[0] == "data"


def test_loading_straight_into_shardings(hf_checkpoints):
    path, _ = hf_checkpoints["gqa2_untied_odd"]
    cfg = kvjax.load_hf_config(path)
    mesh = sharding.make_mesh(data=2, model=4)
    abstract = kvjax.models.params.abstract_params(cfg)
    shardings = sharding.tree_shardings(abstract, kvjax.models.params.param_axes(cfg), mesh)
    _, params = kvjax.load_hf(path, shardings=shardings)
    assert params.layers[1].gate.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert params.embed.sharding.spec == jax.sharding.PartitionSpec("model", None)  # vocab 160 over 4
    # kv_heads=2 cannot be split 4 ways: replicated rather than an error
    assert params.layers[0].k.sharding.spec == jax.sharding.PartitionSpec(None, None, None)


def test_bad_mesh_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 12 devices, have 8"):
        sharding.make_mesh(data=3, model=4)

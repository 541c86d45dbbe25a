"""The arm table (kvjax.eval.arms.TABLE): its rows, the settings the arms take, and the cache each row builds."""

import jax
import numpy as np
import pytest

import kvjax

CFG = kvjax.Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=32, tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)


def test_arm_table():
    from kvjax import config_flags
    from kvjax.eval import arms
    from kvjax.run.config import RunConfig
    assert [a.name for a in arms.TABLE] == ["target", "direct", "perhead", "bridge", "ridge", "residual", "partial",
                                            "tail", "partial_tail", "source"]
    assert len({a.colour for a in arms.TABLE}) == len(arms.TABLE)
    for name in ("toy", "toy_pruned", "toy_pruned_quick", "qwen32_8", "toy_reverse"):  # every arm a shipped config
        # names: in the table
        cfg = config_flags.build(name, [], RunConfig)
        assert set(cfg.eval.mc.arms) | set(cfg.eval.retrieval.arms) <= set(arms.ARMS)
    assert arms.available(("target", "residual", "direct", "ridge"), ("ridge",)) == ("target", "direct", "ridge")
    assert arms.available(("residual", "nope"), ("ridge", "residual")) == ("residual", "nope")
    assert arms.in_table_order({"source", "ridge", "target", "items"}) == ["target", "ridge", "source"]


def test_arm_settings_problems_name_the_fix():
    from kvjax.eval.arm_settings import ArmSettings
    assert ArmSettings().problems(3) == []
    assert ArmSettings(tail_tokens=-1).problems() == ["arms.tail_tokens=-1: pass 0 or more"]
    assert ArmSettings(partial_k=4).problems(3) == ["arms.partial_k=4: pass 0..3 (the target's layers)"]
    assert ArmSettings(partial_mode="middle").problems()[0].startswith("arms.partial_mode='middle': pass one of")


def test_every_arm_builds_its_cache():
    params = kvjax.init_params(CFG, jax.random.key(0))
    """Each row of the arm table gives a cache of its answering model, made as the row says."""
    from kvjax.eval import arms
    from kvjax.mapper.injection import injection_map
    from kvjax.mapper.kvmap import apply_map
    source = (CFG, params)
    other = kvjax.init_params(CFG, jax.random.key(7))
    target = (CFG, other)
    ridge = injection_map(CFG, CFG)
    built = arms.make_arms([a.name for a in arms.TABLE], source, target,
                           {"direct": ridge, "perhead": ridge, "bridge": ridge, "ridge": ridge, "residual": ridge})
    tokens, lengths = np.asarray([[5, 6, 7, 8], [9, 10, 0, 0]], np.int32), np.asarray([4, 2], np.int32)
    caches = {a.name: a.batch_fn(tokens, lengths) for a in built}
    assert [a.name for a in built] == [a.name for a in arms.TABLE]
    assert {a.name for a in built if a.model is source} == {"source"}
    np.testing.assert_array_equal(np.asarray(caches["target"].lengths), lengths)
    mapped = apply_map(ridge, caches["source"])  # the mapped arms translate the source's cache
    for name in ("direct", "perhead", "bridge", "ridge", "residual"):
        np.testing.assert_allclose(np.asarray(caches[name].k), np.asarray(mapped.k), atol=1e-6)
        np.testing.assert_allclose(np.asarray(caches[name].v), np.asarray(mapped.v), atol=1e-6)
    assert not np.allclose(np.asarray(caches["target"].k), np.asarray(caches["source"].k))
    # partial (default: bottom 1 of the final map): layer 0 is the target's own, the layers above the mapped ones
    for what in ("k", "v"):
        got = np.asarray(getattr(caches["partial"], what))
        np.testing.assert_allclose(got[1:], np.asarray(getattr(mapped, what))[1:], atol=1e-6)
        for r, n in enumerate(lengths):
            np.testing.assert_allclose(got[0, r, :, :n], np.asarray(getattr(caches["target"], what))[0, r, :, :n],
                                       atol=1e-5)
    # tail (default 16 tokens: every row but its first token): the mapped first position, then the target's own
    for what in ("k", "v"):
        got = np.asarray(getattr(caches["tail"], what))
        np.testing.assert_allclose(got[:, :, :, :1], np.asarray(getattr(mapped, what))[:, :, :, :1], atol=1e-6)
        assert not np.allclose(got[:, 0, :, 1:4], np.asarray(getattr(mapped, what))[:, 0, :, 1:4], atol=1e-3)
    # partial_tail: the partial arm's cache with the tail arm's native tail on top. Layer 0 is the target's own
    # everywhere, so the tail above it is too (2 layers); layer 1 keeps the mapped first position
    for what in ("k", "v"):
        got, own = np.asarray(getattr(caches["partial_tail"], what)), np.asarray(getattr(caches["target"], what))
        np.testing.assert_allclose(got[1:, :, :, :1], np.asarray(getattr(mapped, what))[1:, :, :, :1], atol=1e-6)
        for r, n in enumerate(lengths):
            np.testing.assert_allclose(got[0, r, :, :n], own[0, r, :, :n], atol=1e-5)
            np.testing.assert_allclose(got[:, r, :, 1:n], own[:, r, :, 1:n], atol=1e-5)
    one = built[0].prefix_fn([5, 6, 7, 8, 11], 3)  # item by item: the context's prefix in `rows` identical rows
    np.testing.assert_allclose(np.asarray(one.k[:, 0]), np.asarray(caches["target"].k[:, 0]), atol=1e-5)
    assert np.asarray(one.lengths).tolist() == [4, 4, 4]
    with pytest.raises(ValueError, match="not in the arm table"):
        arms.make_arms(["oracle"], source, target, {})
    with pytest.raises(ValueError, match="no map 'ridge'"):
        arms.make_arms(["ridge"], source, target, {})

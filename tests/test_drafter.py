"""The block drafter (kvjax.drafter): its training forward equals its decode forward, speculative decoding with it is
token-identical to greedy kvjax.generate (ragged batches, b = 4 and 16, EOS), and bad inputs are clear errors."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.drafter import DrafterError, block_drafter, drafter_config, init_drafter, load_block_drafter, save_drafter
from kvjax.drafter import model as dm
from kvjax.models.config import Qwen3Config
from kvjax.models.params import init_params
from kvjax.speculative import speculative_generate

# a small vocabulary: a random drafter then agrees with the verifier often enough that every acceptance length
# (0 .. b drafts) occurs, which is what the rollback paths need to be exercised
VOCAB = 12


def tiny(layers: int, seed: int, eos=()) -> tuple:
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=layers, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=1e4, tie_word_embeddings=True, eos_token_ids=eos,
                      max_position_embeddings=512)
    return cfg, jax.jit(init_params, static_argnums=(0, 2, 3))(cfg, jax.random.key(seed), jnp.float32, 0.3)


@pytest.fixture(scope="module")
def pair():
    cfg, params = tiny(3, 0)
    dcfg = drafter_config(cfg, num_layers=1, block_sizes=(4, 16))
    return (cfg, params), dcfg, jax.jit(init_drafter, static_argnums=(0, 2))(dcfg, jax.random.key(1), 0.3)


def ragged_prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, int(rng.integers(2, 30))).tolist() for _ in range(n)]


def test_train_forward_equals_decode_forward(pair):
    """Many blocks per sequence in one pass (training) give the logits each block gets at decode time, over a cache
    built in pieces with a rollback."""
    (cfg, params), dcfg, dp = pair
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, VOCAB)
    feats = jax.jit(dm.target_features, static_argnums=(1, 3))(params, cfg, tokens, dcfg.feature_layers)
    ref = jax.jit(lambda p, t: kvjax.models.decoder.forward(
        p, cfg, t, kvjax.init_cache(cfg, 2, 128), fresh=True, features=dcfg.feature_layers).features)(params, tokens)
    np.testing.assert_allclose(feats, ref, atol=1e-5)
    anchors, sizes = jnp.array([[10, 20], [15, 30]]), jnp.array([[16, 4], [4, 16]])
    head = dm.draft_head(params, None)
    train = jax.jit(dm.train_logits, static_argnums=(1, 7))(dp, dcfg, params, feats, tokens, anchors, sizes, 16,
                                                            head)

    @jax.jit
    def decode(f, last, a):
        """The context written in two pieces, the first with two extra positions rolled back by the second."""
        cache = dm.init_context(dcfg, 1, 64)
        first = jnp.where(jnp.arange(40)[None, :, None] < a - 3, f, 0.0)
        cache = dm.extend_context(dp, dcfg, cache, first, (a - 5)[None])
        rest = jax.lax.dynamic_slice_in_dim(f, a - 5, 5, 1)
        cache = dm.extend_context(dp, dcfg, cache, rest, jnp.array([5]))
        return dm.draft_logits(dp, dcfg, params, cache, last, 16, head)

    for r in range(2):
        for k in range(2):
            a, s = anchors[r, k], int(sizes[r, k])
            got = decode(feats[r:r + 1], tokens[r:r + 1, a], a)
            if s == 16:  # a block trained at 16 is the decode block; a truncated one is checked on its own below
                np.testing.assert_allclose(got[0], train[r, k], atol=2e-5)
    cache = dm.extend_context(dp, dcfg, dm.init_context(dcfg, 1, 64), feats[1:2, :15], jnp.array([15]))
    got = jax.jit(dm.draft_logits, static_argnums=(1, 5))(dp, dcfg, params, cache, tokens[1:2, 15], 4, head)
    np.testing.assert_allclose(got[0], train[1, 0, :4], atol=2e-5)


@pytest.mark.parametrize("block", [4, 16])
def test_token_identical_to_greedy_generate(pair, block):
    verifier, dcfg, dp = pair
    drafter = block_drafter(verifier, dcfg, dp, draft_len=block)
    prompts = ragged_prompts(5, block)
    want = np.asarray(kvjax.generate(verifier[1], verifier[0], prompts, 40))
    got, stats = speculative_generate(verifier, drafter, prompts, 40, return_stats=True)
    np.testing.assert_array_equal(np.asarray(got), want)
    per_round = stats.per_round[stats.per_round >= 0]
    assert per_round.max() >= 2 and (per_round == 0).any()  # acceptances of several lengths were rolled back
    assert stats.rounds.min() < 40  # rounds accepted drafts


def test_refinement_feeds_back_the_confident_prefix_and_stays_exact(pair):
    """A refinement pass keeps the drafted tokens before the first one under the threshold, feeds them back as
    known inputs and drafts the rest again; speculative decoding with refinement is still the greedy decode."""
    verifier, dcfg, dp = pair
    cfg, params = verifier
    head = dm.draft_head(params, None)
    tokens = jax.random.randint(jax.random.key(4), (3, 20), 0, VOCAB)
    feats = dm.target_features(params, cfg, tokens, dcfg.feature_layers)
    cache = dm.extend_context(dp, dcfg, dm.init_context(dcfg, 3, 64), feats, jnp.array([19, 19, 19]))
    last = tokens[:, 19]
    first_tokens, first = dm.draft(dp, dcfg, params, cache, last, 4, head)
    conf = np.max(np.asarray(jax.nn.softmax(first, -1)), -1)
    threshold = float(conf[:, 0].max())  # the most confident row keeps its first draft at least; the others none
    sure = np.cumprod(conf >= threshold, axis=1).astype(bool)
    assert sure.any() and (~sure).any()  # some positions kept, some drafted again
    again = dm.draft_logits(dp, dcfg, params, cache, last, 4, head, first_tokens, jnp.asarray(sure))
    _, got = dm.draft(dp, dcfg, params, cache, last, 4, head, refine=1, threshold=threshold)
    np.testing.assert_allclose(got, np.where(sure[..., None], first, again), atol=1e-6)
    assert not np.allclose(np.asarray(again)[~sure], np.asarray(first)[~sure])  # the known prefix changed them
    drafter = block_drafter(verifier, dcfg, dp, draft_len=4, refine=2)
    prompts = ragged_prompts(5, 7)
    want = np.asarray(kvjax.generate(params, cfg, prompts, 40))
    np.testing.assert_array_equal(np.asarray(speculative_generate(verifier, drafter, prompts, 40)), want)


def test_eos_and_draft_vocabulary(pair):
    """Rows stopping at EOS mid-block, and a drafter restricted to part of the vocabulary (its head is a subset of
    the verifier's rows), still give the greedy output."""
    (cfg, params), dcfg, dp = pair
    eos_cfg = Qwen3Config(**{**cfg.__dict__, "eos_token_ids": (3,)})
    verifier = (eos_cfg, params)
    drafter = block_drafter(verifier, dcfg, dm.with_vocab(dp, np.arange(0, VOCAB, 2)), draft_len=4)
    prompts = ragged_prompts(6, 7)
    want = np.asarray(kvjax.generate(params, eos_cfg, prompts, 30))
    assert (want == 3).any()
    np.testing.assert_array_equal(np.asarray(speculative_generate(verifier, drafter, prompts, 30)), want)


def test_bad_inputs(pair, tmp_path):
    verifier, dcfg, dp = pair
    save_drafter(str(tmp_path / "d"), dcfg, dp)
    assert load_block_drafter(str(tmp_path / "d"), verifier, draft_len=4).draft_len == 4
    other = tiny(2, 5)
    with pytest.raises(DrafterError, match="trained for a target with config fingerprint"):
        load_block_drafter(str(tmp_path / "d"), other)
    with pytest.raises(DrafterError, match="block size 8 was not trained for"):
        load_block_drafter(str(tmp_path / "d"), verifier, draft_len=8)
    with pytest.raises(DrafterError, match="not a drafter directory"):
        load_block_drafter(str(tmp_path), verifier)
    small = block_drafter(verifier, dcfg, dp, draft_len=4, max_len=128)
    with pytest.raises(ValueError, match="do not fit the drafter's context cache of 128"):
        speculative_generate(verifier, small, ragged_prompts(2, 1) + [[1] * 100], 40)


def test_dflash_evaluation(pair, tmp_path):
    """The main job's `dflash` evaluation: a record, its metrics (every output identical), report and preflight."""
    from kvjax.eval.suite import dflash
    from kvjax.eval.suite.evaluation import EvalContext
    verifier, dcfg, dp = pair
    save_drafter(str(tmp_path / "d"), dcfg, dp)
    ec = dflash.DflashEval(enabled=True, drafter=str(tmp_path / "d"), blocks=(4,), prompts=3, prompt_len=12,
                           new_tokens=10)
    heldout = np.random.default_rng(0).integers(0, VOCAB, (3, 12))
    ctx = EvalContext(cfg=None, source=verifier, target=None, map=None, fitted=("ridge",), heldout=heldout,
                      tokenizer=None)
    m = dflash.metrics(dflash.run(ec, ctx), None)
    assert m["methods"]["dflash-4"]["identical"] == 3 and m["methods"]["dflash-4"]["tau"] >= 1
    assert "| dflash-4 |" in "\n".join(dflash.report(m, None))
    assert dflash.preflight(ec, None) == []
    assert "trained for block sizes" in dflash.preflight(dataclasses.replace(ec, blocks=(8,)), None)[0]
    assert "not a drafter directory" in dflash.preflight(dataclasses.replace(ec, drafter=str(tmp_path)), None)[0]


def test_training_data_mixes_greedy_and_sampled_continuations(pair, tmp_path):
    """DFlash's data: the verifier's own continuations, greedy for most batches and sampled for a share of them;
    the sampled batches are reproducible, and an interrupted generation resumes to the same sequences."""
    from kvjax.drafter.train import make_sequences, sampled_batch
    verifier, _, _ = pair
    cfg, params = verifier
    assert [sampled_batch(i, 0.5) for i in range(4)] == [False, True, False, True]
    assert not any(sampled_batch(i, 0.0) for i in range(8)) and all(sampled_batch(i, 1.0) for i in range(8))
    rng = np.random.default_rng(3)
    prompts = rng.integers(1, VOCAB, (8, 12)).astype(np.int32)
    plen = rng.integers(4, 13, 8).astype(np.int32)
    data = make_sequences(verifier, prompts, plen, 10, 4, str(tmp_path / "a"), -1, sampled_frac=0.5,
                          temperature=1.0)
    greedy = np.asarray(kvjax.generate(params, cfg, prompts, 10, prompt_lengths=plen, eos_token_ids=()))
    cont = np.stack([row[p: p + 10] for row, p in zip(data["tokens"], plen)])
    np.testing.assert_array_equal(cont[:4], greedy[:4])  # batch 0: greedy
    assert (cont[4:] != greedy[4:]).any()  # batch 1: sampled at temperature 1 over 12 tokens
    np.testing.assert_array_equal(data["sampled"], [False] * 4 + [True] * 4)
    for i, p in enumerate(plen):
        np.testing.assert_array_equal(data["tokens"][i, :p], prompts[i, :p])
    # interrupted after the first batch: the rerun generates only the rest, with the same key
    again = tmp_path / "b"
    make_sequences(verifier, prompts[:4], plen[:4], 10, 4, str(again), -1, sampled_frac=0.5, temperature=1.0)
    (again / "sequences.npz").unlink()
    resumed = make_sequences(verifier, prompts, plen, 10, 4, str(again), -1, sampled_frac=0.5, temperature=1.0)
    np.testing.assert_array_equal(resumed["tokens"], data["tokens"])


def test_toy_drafter_refuses_to_mix_data_recipes(tmp_path, capsys):
    from launch.toy.drafter import check_recipe
    check_recipe(str(tmp_path), {"sequences": 8, "sampled_frac": 0.0})
    check_recipe(str(tmp_path), {"sequences": 8, "sampled_frac": 0.0})  # the same recipe continues
    with pytest.raises(SystemExit, match=r"another recipe \(sampled_frac: 0.0 -> 0.5\)"):
        check_recipe(str(tmp_path), {"sequences": 8, "sampled_frac": 0.5})


def test_toy_drafter_records_its_recipe_without_paths():
    from launch.toy.drafter import recipe_args
    assert recipe_args(["--work", "w", "--steps", "5", "--out=o", "--sampled-frac", "0.5"]) == [
        "--steps", "5", "--sampled-frac", "0.5"]


def test_toy_drafter_grows_but_never_shrinks_a_trained_drafter(tmp_path):
    from launch.toy.drafter import main
    with pytest.raises(SystemExit, match=r"has (\d) layers .* pass --layers of at least \1"):
        main(["--init-from", "checkpoints/toy/drafter", "--layers", "1", "--work", str(tmp_path), "--data-only"])
    assert not any(tmp_path.iterdir())  # refused before anything is written


def test_training_continues_from_a_trained_drafter(pair, tmp_path):
    """`init`: training starts from the given drafter (its vocabulary aside), not from the verifier's layers. At the
    first step the warm-up's learning rate is 0, so one step returns exactly where it started."""
    from kvjax.drafter.train import DrafterTrainConfig, make_features, make_sequences, train_drafter
    verifier, dcfg, dp = pair
    rng = np.random.default_rng(4)
    prompts = rng.integers(1, VOCAB, (8, 12)).astype(np.int32)
    data = make_sequences(verifier, prompts, np.full(8, 12, np.int32), 24, 4, str(tmp_path), -1)
    feats = make_features(verifier, data["tokens"], dcfg.feature_layers, 4, str(tmp_path))
    tc = DrafterTrainConfig(steps=1, batch_size=2, blocks_per_seq=2, warmup_steps=10, eval_seqs=2, eval_every=1)
    init = dm.with_vocab(dp, np.arange(VOCAB))
    out = train_drafter(verifier, dcfg, tc, data, feats, None, str(tmp_path / "cont"), init=init)
    assert out.vocab_ids is None
    jax.tree.map(np.testing.assert_array_equal, out, dm.with_vocab(dp, None))
    fresh = train_drafter(verifier, dcfg, tc, data, feats, None, str(tmp_path / "fresh"))
    assert not np.array_equal(fresh.fc, dp.fc)  # without `init`: a new drafter


def test_growing_a_drafter_keeps_its_drafts_and_trains_the_new_layers(pair, tmp_path):
    """`grow`: the new layers on top start as the identity, so the grown drafter's logits are the small one's; their
    residual writes still get gradients (training moves them); shrinking is refused. Stored in bfloat16 it is half
    the size and loads back as float32."""
    (cfg, params), dcfg, dp = pair
    big = dataclasses.replace(dcfg, layer=dataclasses.replace(dcfg.layer, num_layers=3))
    grown = dm.grow(dp, big, params)
    assert len(grown.layers) == 3
    np.testing.assert_array_equal(grown.layers[0].q, dp.layers[0].q)
    np.testing.assert_array_equal(grown.layers[2].q, params.layers[-1].q)  # a copy of the verifier's top layer
    tokens = jax.random.randint(jax.random.key(5), (2, 40), 0, VOCAB)
    feats = dm.target_features(params, cfg, tokens, dcfg.feature_layers)
    anchors, sizes = jnp.array([[10, 20], [15, 30]]), jnp.array([[16, 4], [4, 16]])
    head = dm.draft_head(params, None)

    @functools.partial(jax.jit, static_argnums=1)
    def logits(d, c):
        return dm.train_logits(d, c, params, feats, tokens, anchors, sizes, 16, head)

    np.testing.assert_allclose(logits(grown, big), logits(dp, dcfg), atol=1e-5)
    grads = jax.grad(lambda d: jnp.sum(jax.nn.log_softmax(logits(d, big))[..., 3]))(grown)
    assert float(jnp.abs(grads.layers[2].o).max()) > 0 and float(jnp.abs(grads.layers[1].down).max()) > 0
    with pytest.raises(ValueError, match="cannot grow a 3-layer drafter to 1"):
        dm.grow(grown, dcfg, params)
    save_drafter(str(tmp_path / "f32"), big, grown)
    save_drafter(str(tmp_path / "bf16"), big, grown, dtype="bfloat16")
    size = {k: (tmp_path / k / "drafter.safetensors").stat().st_size for k in ("f32", "bf16")}
    assert size["bf16"] < 0.55 * size["f32"]
    _, back = kvjax.drafter.load_drafter(str(tmp_path / "bf16"), cfg)
    assert back.fc.dtype == jnp.float32
    np.testing.assert_allclose(back.fc, grown.fc, rtol=1e-2, atol=1e-3)

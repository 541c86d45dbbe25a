"""Speculative decoding: greedy output is the verifier's, sampled output is distributed as the verifier's, rows accept
different lengths, the transfer API decodes from the mapped cache, features reach a feature-reading drafter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import kvjax
from kvjax.generation import Sampling, sample
from kvjax.models.decoder import forward, stack_kv, write_block
from kvjax.speculative import (LookupDrafter, ModelDrafter, sampling_probs, speculative_generate,
                               speculative_split_generate)
from kvjax.speculative.api import transfer_builder
from kvjax.speculative.lookup import match_end, match_end_reference
from kvjax.speculative.loop import verify_loop
from maptools import VOCAB, tiny_pair


@pytest.fixture(scope="module")
def models():
    """(verifier 3 layers, small 2-layer drafter, a noisy copy of the verifier: accepts often but not always)."""
    big, small = (kvjax.Model(*m) for m in tiny_pair())
    leaves, tree = jax.tree.flatten(big.params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    noisy = jax.tree.unflatten(tree, [x + 0.03 * jax.random.normal(k, x.shape, x.dtype) for x, k in
                                      zip(leaves, keys)])
    return big, small, kvjax.Model(big.cfg, noisy)


def prompts(lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(1, VOCAB, n).tolist() for n in lengths]


def native(model, ps, n, **kw):
    return np.asarray(kvjax.generate(model.params, model.cfg, ps, n, **kw))


def test_greedy_equals_the_verifiers_greedy_decode(models):
    """Ragged rows, EOS (row 0 stops early), several draft lengths: the output is the verifier's greedy decode; rows
    accept different lengths; the verifier drafting for itself accepts everything."""
    big, small, noisy = models
    ps = prompts([5, 17, 1, 11])
    free = native(big, ps, 19, eos_token_ids=())
    eos = int(free[0, 4])  # row 0 stops by its 5th token
    want = native(big, ps, 19, eos_token_ids=(eos,), pad_token_id=0)
    stop = np.minimum([int(np.flatnonzero(np.r_[r == eos, True])[0]) + 1 for r in free], 19)
    unsure = ModelDrafter(noisy, draft_len=4, min_confidence=0.05)  # about half its tokens are below 0.05
    for drafter, g in ((noisy, 3), (small, 1), (big, 5), (unsure, 4)):
        got, stats = speculative_generate(big, drafter, ps, 19, draft_len=None if drafter is unsure else g,
                                          eos_token_ids=(eos,), pad_token_id=0, return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"draft_len {g}")
        np.testing.assert_array_equal(stats.emitted, stop)
        # per-round counts add up; accepted drafts + one verifier token per round cover the emitted tokens
        np.testing.assert_array_equal(np.where(stats.per_round >= 0, stats.per_round, 0).sum(1), stats.accepted)
        assert (stats.accepted + stats.rounds >= stats.emitted).all()
        assert (stats.rounds >= -(-stop // (g + 1))).all() and stats.rounds[0] < stats.rounds.max()
        if drafter is noisy:
            first = stats.per_round[:, 0]
            assert len(set(first.tolist())) > 1, f"rows accepted the same number of drafts in round 1: {first}"
            assert 0 < stats.acceptance_rate < 1
        if drafter is big:  # the verifier drafting for itself: every draft accepted, g + 1 tokens per round
            assert stats.mean_acceptance_length == g + 1
    tokens, lengths = kvjax.pad_prompts(ps)  # the same batch as a padded array with prompt_lengths
    tokens[np.arange(tokens.shape[1])[None] >= lengths[:, None]] = 95  # padding is never read
    got = speculative_generate(big, small, tokens, 19, draft_len=1, eos_token_ids=(eos,), pad_token_id=0,
                               prompt_lengths=lengths)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_the_read_only_verify_pass_and_write_block_store_what_the_writing_pass_stores(models):
    """The loop's read-only verify pass (forward(write=False) with the stack_kv tap): the logits and features the
    writing pass gives, and write_block leaves the cache the writing pass writes (ragged rows, one row with an
    empty cache)."""
    big, _, _ = models
    cfg = big.cfg
    ps = prompts([9, 1, 30], seed=4)
    tokens, lengths = kvjax.pad_prompts(ps)
    cache = kvjax.prefill(big.params, cfg, tokens, kvjax.init_cache(cfg, 3, 64), lengths)[1]
    cache = cache.replace(lengths=jnp.asarray([9, 0, 30], jnp.int32))  # row 1: nothing cached yet
    block = jnp.asarray(np.random.RandomState(2).randint(1, VOCAB, (3, 5)), jnp.int32)
    want_logits, want_cache, want_feats, _ = forward(big.params, cfg, block, cache, features=(0, 2))
    verify = jax.jit(lambda p, t, c: forward(p, cfg, t, c, write=False, features=(0, 2), tap=stack_kv))
    logits, nothing, feats, (k, v) = verify(big.params, block, cache)
    assert nothing is None  # a pass that does not write returns no cache
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), atol=1e-4)
    np.testing.assert_allclose(np.asarray(feats), np.asarray(want_feats), atol=1e-4)
    written = write_block(cache, k, v)
    np.testing.assert_array_equal(np.asarray(written.lengths), np.asarray(cache.lengths))
    for got, want in ((written.k, want_cache.k), (written.v, want_cache.v)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)


def test_sampling_probs_truncates_like_sample():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_allclose(sampling_probs(logits, Sampling(1.0, 0.7)), [[0.625, 0.375, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(sampling_probs(logits, Sampling(1.0, 1.0)), [[0.5, 0.3, 0.15, 0.05]], atol=1e-6)
    keys = jax.random.split(jax.random.key(0), 2000)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, Sampling(1.0, 0.8)))(keys))[:, 0]
    probs = np.asarray(sampling_probs(logits, Sampling(1.0, 0.8)))[0]
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 2000, probs, atol=0.03)


def _chi2_pvalue(counts, probs):
    """Pearson's chi-square p-value of `counts` under `probs`, bins with expected count < 5 pooled."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.r_[counts[big], counts[~big].sum()]
    exp = np.r_[expected[big], expected[~big].sum()]
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(jax.scipy.special.gammaincc((len(obs) - 1) / 2, stat / 2))


def test_sampling_follows_the_verifiers_distribution():
    """2000 rows of one prompt sampled in one call (independent draws): the first token's frequencies match the
    verifier's (temperature, top_p) distribution and NOT the drafter's; the second token's, given the most common
    first token, match the verifier's conditional one (the rejection residual and accepted drafts at position 2)."""
    cfg = kvjax.Qwen3Config(vocab_size=12, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=16, tie_word_embeddings=True, eos_token_ids=(), pad_token_id=0)
    verifier = kvjax.Model(cfg, kvjax.init_params(cfg, jax.random.key(0), std=0.1))
    drafter = kvjax.Model(cfg, kvjax.init_params(cfg, jax.random.key(1), std=0.1))
    prompt, rows, s = [3, 7, 1, 9], 2000, Sampling(0.9, 0.95)

    def dist(model, toks):
        return np.asarray(sampling_probs(forward(model.params, cfg, jnp.asarray([toks])).logits[0, -1], s),
                          np.float64)

    for d in (drafter, ModelDrafter(drafter, draft_len=2, min_confidence=0.2)):  # fixed and variable-length drafts
        out = np.asarray(speculative_generate(verifier, d, [prompt] * rows, 2, temperature=s.temperature,
                                              top_p=s.top_p, key=jax.random.key(42),
                                              draft_len=2 if d is drafter else None))
        counts = np.bincount(out[:, 0], minlength=12)
        assert _chi2_pvalue(counts, dist(verifier, prompt)) > 1e-3
        assert _chi2_pvalue(counts, dist(drafter, prompt)) < 1e-6  # the test can tell the two apart
        x1 = int(np.argmax(counts))
        second = np.bincount(out[out[:, 0] == x1, 1], minlength=12)
        assert _chi2_pvalue(second, dist(verifier, prompt + [x1])) > 1e-3
    # the lookup's drafts are certain (q one-hot): a repeated prompt makes it propose 7 then 1 after "... 9 3"
    loop = [3, 7, 1, 9, 3, 7, 1, 9, 3]
    out, stats = speculative_generate(verifier, LookupDrafter(12, draft_len=2), [loop] * rows, 2,
                                      temperature=s.temperature, top_p=s.top_p, key=jax.random.key(43),
                                      return_stats=True)
    out = np.asarray(out)
    assert stats.accepted.sum() > 0
    assert _chi2_pvalue(np.bincount(out[:, 0], minlength=12), dist(verifier, loop)) > 1e-3
    second = np.bincount(out[out[:, 0] == 7, 1], minlength=12)  # the drafted continuation 7 -> 1
    assert _chi2_pvalue(second, dist(verifier, loop + [7])) > 1e-3
    other = np.bincount(out[out[:, 0] != 7, 1], minlength=12)
    x1 = int(np.bincount(out[out[:, 0] != 7, 0], minlength=12).argmax())  # a rejected draft's most common fix
    assert _chi2_pvalue(np.bincount(out[out[:, 0] == x1, 1], minlength=12), dist(verifier, loop + [x1])) > 1e-3
    assert other.sum() > 0


def test_transfer_decodes_from_the_mapped_cache(models):
    big, small, _ = models
    windows = np.random.RandomState(0).randint(1, VOCAB, (8, 32)).astype(np.int32)
    kvmap = kvjax.fit_map(small, big, windows, windows[:4], batch_size=8)[0]  # small reads, large answers
    ps = prompts([9, 20, 4], seed=5)
    for repair, tail in ((0, 0), (1, 0), (1, 3)):
        result = speculative_split_generate(small, big, kvmap, ps, 12, draft_len=3, repair_layers=repair,
                                            tail_tokens=tail, eos_token_ids=(), timings=True)
        want = np.asarray(kvjax.generate_from(transfer_builder(small, big, kvmap, repair, tail_tokens=tail), ps, 12,
                                              eos_token_ids=()))
        np.testing.assert_array_equal(np.asarray(result.tokens), want, err_msg=f"repair {repair}, tail {tail}")
        assert set(result.phases) == {"prefill", "map", "repair", "tail", "decode"}
        assert (result.phases["tail"] > 0) == (tail > 0) and (result.stats.emitted == 12).all()
    with pytest.raises(ValueError, match="tail_tokens=-1: pass 0"):
        speculative_split_generate(small, big, kvmap, ps, 12, tail_tokens=-1)


@struct.dataclass
class FeatureProbe:
    """A drafter reading verifier features: drafts like `inner`, keeps the feature of the newest context position."""

    inner: ModelDrafter
    feature_layers: tuple = struct.field(pytree_node=False, default=(0, 2))

    @property
    def draft_len(self):
        return self.inner.draft_len

    def start(self, tokens, lengths, capacity, features):
        return self.inner.start(tokens, lengths, capacity), features[jnp.arange(len(lengths)), lengths - 1]

    def propose(self, state, last, key, sampling):
        drafts, q, inner = self.inner.propose(state[0], last, key, sampling)
        return drafts, q, (inner, state[1])

    def commit(self, state, tokens, n_new, features):
        newest = features[jnp.arange(len(n_new)), jnp.maximum(n_new - 1, 0)]
        return (self.inner.commit(state[0], tokens, n_new, None),
                jnp.where((n_new > 0)[:, None], newest, state[1]))


def test_a_feature_drafter_gets_the_verifiers_layer_outputs(models):
    big, _, _ = models
    cfg = big.cfg
    probe = FeatureProbe(ModelDrafter(big, draft_len=2))  # the verifier drafts for itself: 3 tokens per round
    ps = prompts([6, 3], seed=9)
    tokens, lengths = kvjax.pad_prompts(ps)
    prefix, plen, capacity = tokens[:, :-1], lengths - 1, 128
    cache, features = kvjax.NativePrefill(big).with_features(prefix, plen, layers=(0, 2), capacity=capacity)
    state = probe.start(prefix, plen, capacity, features)
    last = tokens[np.arange(2), lengths - 1]
    run = jax.jit(verify_loop, static_argnums=(6, 7, 8, 9))
    got, counters, _, (_, newest) = run(big, probe, cache, state, jnp.asarray(last), jax.random.key(0), 9,
                                        Sampling(), (), 0)
    got = np.asarray(got)
    np.testing.assert_array_equal(got, native(big, ps, 9, eos_token_ids=()))
    assert np.asarray(counters["rounds"]).tolist() == [3, 3]
    for r, p in enumerate(ps):  # the newest context position: the 8th generated token
        seq = jnp.asarray([p + got[r, :8].tolist()])
        ref = forward(big.params, cfg, seq, kvjax.init_cache(cfg, 1, 32), fresh=True, features=(0, 2)).features
        np.testing.assert_allclose(np.asarray(newest[r]), np.asarray(ref[0, -1]), atol=1e-4)


def test_bad_speculative_arguments(models):
    big, small, _ = models
    other = kvjax.Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                              num_kv_heads=1, head_dim=16)
    other = kvjax.Model(other, kvjax.init_params(other, jax.random.key(0)))
    with pytest.raises(ValueError, match="vocabulary .*differs"):
        speculative_generate(big, other, [[3, 4]], 4)
    with pytest.raises(ValueError, match="draft_len must be an integer >= 1"):
        speculative_generate(big, small, [[3, 4]], 4, draft_len=0)
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        speculative_generate(big, small, [[3, 4]], 0)
    with pytest.raises(ValueError, match="explicit key"):
        speculative_generate(big, small, [[3, 4]], 4, temperature=0.5)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 96\)"):
        speculative_generate(big, small, [[3, 96]], 4)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        speculative_generate(big, small, [[3] * 50], big.cfg.max_position_embeddings)
    with pytest.raises(ValueError, match="another model than the verifier"):
        speculative_generate(big, small, [[3, 4]], 4, builder=kvjax.NativePrefill(small))
    with pytest.raises(ValueError, match="leave draft_len unset"):
        speculative_generate(big, ModelDrafter(small, draft_len=3), [[3, 4]], 4, draft_len=2)
    with pytest.raises(TypeError, match="drafter object"):
        speculative_generate(big, object(), [[3, 4]], 4)
    with pytest.raises(ValueError, match="one drafter named by a string is 'lookup'"):
        speculative_generate(big, "ngram", [[3, 4]], 4)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        LookupDrafter(96, min_ngram=3, max_ngram=2)


def test_lookup_match_is_the_latest_longest_ngram():
    """match_end against the plain-Python reference on short alphabets (many repeats) and edge cases."""
    rng = np.random.RandomState(3)
    cases = [(np.array([5, 6, 7, 5, 6, 7, 5, 6, 0, 0]), 8), (np.array([1, 2, 3, 4, 0]), 4), (np.array([9, 9, 0]), 2),
             (np.array([4, 0, 0]), 1)]
    cases += [(rng.randint(0, k, 40), int(rng.randint(1, 40))) for k in (2, 3, 5, 20) for _ in range(25)]
    for history, length in cases:
        for max_n, min_n in ((3, 1), (4, 2), (1, 1), (2, 2)):
            end, n = match_end(jnp.asarray(history, jnp.int32), jnp.int32(length), max_n, min_n)
            want_end, want_n = match_end_reference(history, length, max_n, min_n)
            assert int(n) == want_n, (history[:length], max_n, min_n)
            if want_n:
                assert int(end) == want_end, (history[:length], max_n, min_n)
    end, n = match_end(jnp.asarray([5, 6, 7, 5, 6, 7, 5, 6, 0, 0]), jnp.int32(8), 3, 1)
    assert (int(end), int(n)) == (5, 3)  # "7 5 6" recurs ending at 5: history[5] = 7 followed it


def test_lookup_drafting_is_exact_and_accepts_repeats(models):
    """Greedy: ragged rows, EOS, several draft lengths: the verifier's own greedy decode. On prompts that repeat a
    phrase the lookup proposes and the verifier accepts (the verifier continues the loop it was shown)."""
    big, _, _ = models
    rng = np.random.RandomState(11)
    phrase = rng.randint(1, VOCAB, 6).tolist()
    ps = [phrase * 4, rng.randint(1, VOCAB, 9).tolist() + phrase * 3, [7], rng.randint(1, VOCAB, 13).tolist()]
    free = native(big, ps, 17, eos_token_ids=())
    eos = int(free[3, 6])
    want = native(big, ps, 17, eos_token_ids=(eos,), pad_token_id=0)
    for g in (1, 3, 5):
        got, stats = speculative_generate(big, "lookup", ps, 17, draft_len=g, eos_token_ids=(eos,), pad_token_id=0,
                                          return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"draft_len {g}")
        assert stats.accepted.sum() > 0
    drafter = LookupDrafter(VOCAB, draft_len=4, max_ngram=4, min_ngram=2)
    got = speculative_generate(big, drafter, ps, 17, eos_token_ids=(eos,), pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(got), want)


def _block(verifier, draft_len, seed=1):
    """A random block drafter (kvjax.drafter) for `verifier`: it drafts badly, which is all exactness needs."""
    from kvjax.drafter import block_drafter, drafter_config, init_drafter
    dcfg = drafter_config(verifier.cfg, num_layers=1, block_sizes=(draft_len,))
    return block_drafter(verifier, dcfg, init_drafter(dcfg, jax.random.key(seed), 0.3), draft_len=draft_len)


def test_combined_drafter_is_exact_and_takes_lookup_where_the_text_repeats(models):
    """Greedy: ragged rows, EOS: the verifier's own greedy decode, spliced (the block drafter after a copy's end) or
    not. Rows whose context repeats take lookup's copy (and it is accepted); rounds in which every row's block is a
    copy do not run the block drafter at all; splicing runs it where a copy ends inside the block."""
    from kvjax.speculative import combined
    big, _, _ = models
    rng = np.random.RandomState(12)
    phrase = rng.randint(1, VOCAB, 6).tolist()
    ps = [phrase * 4, rng.randint(1, VOCAB, 9).tolist() + phrase * 3, [7, 3], rng.randint(1, VOCAB, 13).tolist()]
    free = native(big, ps, 21, eos_token_ids=())
    eos = int(free[3, 9])
    want = native(big, ps, 21, eos_token_ids=(eos,), pad_token_id=0)
    for g, min_match, splice in ((4, 2, False), (6, 3, False), (4, 2, True), (6, 3, True)):
        drafter = combined(_block(big, g), VOCAB, min_match=min_match, splice=splice)
        got, stats = speculative_generate(big, drafter, ps, 21, eos_token_ids=(eos,), pad_token_id=0,
                                          return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"draft_len {g}, splice {splice}")
        rounds = int(np.sum(stats.widths))
        assert 0 < stats.drafter["lookup_rows"][0] and stats.accepted[0] > 0  # the repeated phrase is copied
        assert 0 < stats.drafter["model_rounds"] <= rounds
    # one row that repeats: most of its rounds copy, and those rounds skip the block drafter (model_rounds < rounds);
    # spliced, a copy that fills the block skips it too, one that ends inside it does not
    _, plain = speculative_generate(big, combined(_block(big, 4), VOCAB, splice=False), [phrase * 4], 24,
                                    eos_token_ids=(), return_stats=True)
    lookup_rounds = int(plain.drafter["lookup_rows"][0])
    assert lookup_rounds > 0 and int(plain.drafter["model_rounds"]) == int(np.sum(plain.widths)) - lookup_rounds
    # one round by hand: row 0's copy ("p0..p5 p0..p5" + pending p0) fills the block, row 1's ("a b c a" + pending
    # "b": "c a b") ends inside it
    a, b, c = phrase[:3]
    tokens, lengths = jnp.asarray([phrase * 2, [a, b, c, a] + [0] * 8]), jnp.asarray([12, 4])
    for rows, copy_ends in (([0], False), ([0, 1], True)):
        for splice in (False, True):
            drafter = combined(_block(big, 4), VOCAB, splice=splice)
            pick = jnp.asarray(rows)
            state = drafter.start(tokens[pick], lengths[pick], 32,
                                  jnp.ones((len(rows), 12, drafter.model.dcfg.feature_size), jnp.float32))
            last = jnp.asarray([phrase[0], b])[pick]
            drafts, _, state = drafter.propose(state, last, jax.random.key(0), Sampling(0.0))
            drafts = np.asarray(drafts)
            if copy_ends:
                np.testing.assert_array_equal(drafts[1, :3], [c, a, b])
                assert (drafts[1, 3] >= 0) == splice  # spliced: the block drafter's token after the copy's end
            assert np.all(np.asarray(state.lookup_rows) == 1)  # every row copies
            assert int(state.model_rounds) == int(splice and copy_ends)  # a round of full copies skips it


def test_combined_drafter_lets_a_sure_block_drafter_overrule_a_copy(models):
    """`overrule`: a copy is followed only up to where the model drafter contradicts it with probability >= overrule
    (here a block drafter made certain of token 5 everywhere, which the copies never hold, so no copy is taken); the
    output is still the verifier's greedy decode; overrule = 1 never cuts a copy, even for a certain drafter; a
    threshold outside (0, 1], overrule without splicing, or a drafter without confidences is refused. The block
    drafter's confidences are those of its own drafts."""
    from kvjax.speculative import combined
    big, _, _ = models
    block = _block(big, 4)
    state = block.start(jnp.asarray([[3, 4, 5, 6]]), jnp.asarray([4]), 64,
                        jnp.ones((1, 4, block.dcfg.feature_size), jnp.float32))
    tokens, _, _, (top, conf) = block.propose_with_confidence(state, jnp.asarray([2]), jax.random.key(0), Sampling(0.0))
    np.testing.assert_array_equal(top, tokens)
    assert top.shape == conf.shape == (1, 4) and float(conf.min()) > 0 and float(conf.max()) <= 1

    @struct.dataclass
    class Certain:  # the block drafter, claiming certainty of token 5 at every first position
        inner: object
        draft_len: int = struct.field(pytree_node=False, default=4)
        feature_layers: tuple = struct.field(pytree_node=False, default=())

        def start(self, *a):
            return self.inner.start(*a)

        def commit(self, *a):
            return self.inner.commit(*a)

        def propose(self, *a):
            return self.inner.propose(*a)

        def propose_with_confidence(self, st, last, key, sampling):
            d, q, st, _ = self.inner.propose_with_confidence(st, last, key, sampling)
            return d, q, st, (jnp.full(d.shape, 5, jnp.int32), jnp.ones(d.shape))

    certain = Certain(block, draft_len=4, feature_layers=block.feature_layers)
    rng = np.random.RandomState(12)
    phrase = [p if p != 5 else 6 for p in rng.randint(1, VOCAB, 6).tolist()]  # no copy starts with 5
    want = native(big, [phrase * 4], 16, eos_token_ids=())
    stats = {}
    for overrule in (0.5, 1.0):
        got, stats[overrule] = speculative_generate(big, combined(certain, VOCAB, overrule=overrule), [phrase * 4],
                                                    16, eos_token_ids=(), return_stats=True)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"overrule {overrule}")
    assert int(stats[1.0].drafter["lookup_rows"][0]) > 0
    assert int(stats[0.5].drafter["lookup_rows"][0]) == 0  # every copy overruled
    assert int(stats[0.5].drafter["model_rounds"]) == int(np.sum(stats[0.5].widths))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"overrule must be in \(0, 1\]"):
            combined(block, VOCAB, overrule=bad)
    with pytest.raises(ValueError, match="needs splice=True"):
        combined(block, VOCAB, splice=False, overrule=0.5)
    with pytest.raises(TypeError, match="propose_with_confidence"):
        combined(LookupDrafter(VOCAB, draft_len=4), VOCAB, overrule=0.5)


def test_combined_drafter_sampling_follows_the_verifiers_distribution():
    """The copy (one-hot q) where the context repeats, the block drafter's q where it does not or where it overrules
    the copy (`overrule`): either way the first two tokens are distributed as the verifier's."""
    from kvjax.speculative import combined
    cfg = kvjax.Qwen3Config(vocab_size=12, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                            num_kv_heads=1, head_dim=16, tie_word_embeddings=True, eos_token_ids=(), pad_token_id=0)
    verifier = kvjax.Model(cfg, kvjax.init_params(cfg, jax.random.key(0), std=0.1))
    s, rows = Sampling(0.9, 0.95), 2000

    def dist(toks):
        return np.asarray(sampling_probs(forward(verifier.params, cfg, jnp.asarray([toks])).logits[0, -1], s),
                          np.float64)

    # "3 7" recurs: copy; nothing recurs: block; with overrule = 0.01 the random block drafter cuts the copy short
    # (spliced rows draw some positions from the copy and the rest from the block drafter's q)
    for overrule, prompt in ((1.0, [3, 7, 1, 9, 3, 7, 1, 9, 3, 7]), (1.0, [3, 7, 1, 9, 5, 2]),
                             (0.01, [3, 7, 1, 9, 3, 7, 1, 9, 3, 7])):
        drafter = combined(_block(verifier, 2), 12, min_match=2, overrule=overrule)
        out, stats = speculative_generate(verifier, drafter, [prompt] * rows, 2, temperature=s.temperature,
                                          top_p=s.top_p, key=jax.random.key(44), return_stats=True)
        out = np.asarray(out)
        copied = int(stats.drafter["lookup_rows"].sum())
        if overrule < 1:  # overruled except where the drafter's own first choice is the copy's
            assert copied < rows // 2
        else:
            assert (copied >= rows) if prompt[-1] == 7 else (int(stats.drafter["model_rounds"]) >= 1)
        counts = np.bincount(out[:, 0], minlength=12)
        assert _chi2_pvalue(counts, dist(prompt)) > 1e-3
        x1 = int(np.argmax(counts))
        assert _chi2_pvalue(np.bincount(out[out[:, 0] == x1, 1], minlength=12), dist(prompt + [x1])) > 1e-3


def test_combined_drafter_refuses_what_it_cannot_combine(models):
    from kvjax.speculative import combined
    big, small, _ = models
    with pytest.raises(ValueError, match="ModelDrafter.*block drafter"):
        combined(ModelDrafter(small, draft_len=3), VOCAB)
    with pytest.raises(TypeError, match="lacks"):
        combined(object(), VOCAB)
    with pytest.raises(ValueError, match="min_match"):
        combined(_block(big, 4), VOCAB, min_match=4)

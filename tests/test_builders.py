"""Cache builders: native prefill, mapped, pipelined and partial recomputation agree with the paths they replace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.builders import (Clock, Mapped, NativePrefill, NativeTail, PartialRecompute, Pipelined, SourcePrefill,
                            recompute, repaired, split_tail)
from kvjax.builders.partial import recompute_layers
from kvjax.mapper.kvmap import apply_map
from maptools import VOCAB, tiny_model, tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(scope="module")
def kvmap(pair):
    source, target = pair
    windows = np.random.RandomState(0).randint(1, VOCAB, (8, 32)).astype(np.int32)
    return kvjax.fit_map(source, target, windows, windows[:4], batch_size=8)[0]


def batch(b=3, t=20, seed=1):
    tokens = np.random.RandomState(seed).randint(1, VOCAB, (b, t)).astype(np.int32)
    return tokens, np.asarray([t, t - 5, 7][:b], np.int32)


def valid(cache, what):
    """Per row, the valid part of k and v (what attention can read)."""
    return [np.asarray(getattr(cache, what)[:, r, :, : int(cache.lengths[r])]) for r in range(cache.batch_size)]


U = 2.0 ** -24  # float32 unit roundoff


def assert_same_cache(got, want, terms=0):
    """Equal valid parts. `terms`: how many float32 roundings can stand between the two computations of one entry
    (the same math in other programs: XLA may fuse and order it differently), so the difference is at most
    terms * U * the largest entry; 0 demands equality."""
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    for what in ("k", "v"):
        for g, w in zip(valid(got, what), valid(want, what)):
            np.testing.assert_allclose(g, w, atol=terms * U * np.abs(w).max(), rtol=0)


def forward_terms(cfg, t):
    """Roundings along one cache entry of a prefill: per layer, dot products over the hidden width and attention over
    the prompt (first order, any summation order)."""
    return cfg.num_layers * (cfg.hidden_size + t)


def test_native_prefill_is_the_models_prefill(pair):
    _, (cfg, params) = pair
    tokens, lengths = batch()
    built = NativePrefill((cfg, params))(tokens, lengths, capacity=128)
    assert built.capacity == 128 and built.origin == "native"
    _, want = kvjax.prefill(params, cfg, tokens, kvjax.init_cache(cfg, 3, 128), lengths)
    assert_same_cache(built, want, forward_terms(cfg, tokens.shape[1]))
    assert NativePrefill((cfg, params))(tokens, lengths).capacity == 64  # default: the token axis, bucketed


def test_mapped_is_apply_map_of_the_source_cache_and_shares_one_prefill(pair, kvmap):
    source, target = pair
    tokens, lengths = batch()
    shared = SourcePrefill(source)
    clock = Clock()
    built = Mapped(source, target, kvmap, shared=shared)(tokens, lengths, capacity=64, clock=clock)
    assert set(clock.phases) == {"source_prefill", "map"} and built.is_mapped
    want = apply_map(kvmap, NativePrefill(source)(tokens, lengths, capacity=tokens.shape[1]),
                     capacity=64, length=tokens.shape[1])
    # the map on top of the source prefill: un-rotate and re-rotate (angles up to T, 2 roundings each), features in
    map_terms = 4 * (tokens.shape[1] + 1) + kvmap.keys[0].w_in.shape[0]
    assert_same_cache(built, want, map_terms)
    again = Clock()
    Mapped(source, target, kvmap, name="other", shared=shared)(tokens, lengths, capacity=64, clock=again)
    assert "source_prefill" not in again.phases  # the second builder reused the first one's source prefill
    piped = Pipelined(source, target, kvmap, impl="xla")(tokens, lengths, capacity=64)
    assert_same_cache(piped, built, forward_terms(source[0], tokens.shape[1]) + map_terms)


def test_an_answerers_programs_compile_once_for_native_and_mapped_caches(pair, kvmap):
    """The answerer's prefill-free programs (first token, decode loop) and the source's prefill are compiled by the
    native arms; the mapped arm runs the same programs (kvjax.cache.cache_jit), its caches still labelled mapped."""
    from kvjax.generation.loop import decode_from
    from kvjax.models.decoder import decode_jit, prefill_jit
    source, target = pair
    tokens, _ = batch(b=2, t=23, seed=7)
    for model in (source, target):
        kvjax.generate_from(NativePrefill(model), tokens, 5, eos_token_ids=())
    sizes = [f._cache_size() for f in (prefill_jit, decode_jit, decode_from)]
    mapped = kvjax.generate_from(Mapped(source, target, kvmap), tokens, 5, eos_token_ids=())
    assert [f._cache_size() for f in (prefill_jit, decode_jit, decode_from)] == sizes
    assert np.asarray(mapped).shape == (2, 5)

    def cache():
        return Mapped(source, target, kvmap)(tokens[:, :-1], np.full(2, 22, np.int32), capacity=32)
    (cfg, params), last = target, jnp.asarray(tokens[:, -1])
    logits, after = decode_jit(params, cfg, last, cache())
    assert after.origin == f"mapped:{kvmap.map_id}"  # what the program returns keeps its input's label
    want, _ = decode_jit.jitted(params, cfg, last, cache())  # plain jax.jit: a program specialised on the label
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))


def test_partial_recompute_ends(pair, kvmap):
    source, target = pair
    tokens, lengths = batch()
    mapped = Mapped(source, target, kvmap)(tokens, lengths)
    native = NativePrefill(target)(tokens, lengths)
    for mode in ("bottom", "top"):
        assert_same_cache(PartialRecompute(source, target, kvmap, 0, mode)(tokens, lengths), mapped)
        assert_same_cache(PartialRecompute(source, target, kvmap, 2, mode)(tokens, lengths), native,
                          forward_terms(target[0], tokens.shape[1]))
    assert recompute_layers(4, 1, "bottom") == (0,) and recompute_layers(4, 1, "top") == (3,)
    with pytest.raises(ValueError, match="pass 0..2"):
        PartialRecompute(source, target, kvmap, 3)
    with pytest.raises(ValueError, match="mode must be one of"):
        PartialRecompute(source, target, kvmap, 1, mode="middle")
    # an explicit placement: the named layers, their k and mode; the bottom / top sets are named as such
    one = PartialRecompute(source, target, kvmap, layers=(1,))
    assert (one.layers, one.k, one.mode, one.name) == ((1,), 1, "top", "partial_top1")
    assert PartialRecompute(source, target, kvmap, layers=(0,)).mode == "bottom"
    assert_same_cache(PartialRecompute(source, target, kvmap, layers=(1, 0))(tokens, lengths), native,
                      forward_terms(target[0], tokens.shape[1]))
    with pytest.raises(ValueError, match="distinct layers of the target's 0..1"):
        PartialRecompute(source, target, kvmap, layers=(0, 2))
    with pytest.raises(ValueError, match="distinct layers"):
        PartialRecompute(source, target, kvmap, layers=(1, 1))


def test_partial_recompute_reads_mapped_layers_and_rewrites_only_its_own():
    cfg, params = model = tiny_model(3, 32, 4, 2, 8, seed=3, theta=1e4)
    tokens, lengths = batch()
    native = NativePrefill(model)(tokens, lengths)
    # reading an exact cache, the recomputed layers are the native ones: the hidden states that reach them match
    for layers in ((0,), (2,), (1, 2)):
        got = recompute(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), native, layers)
        assert_same_cache(got, native, forward_terms(cfg, tokens.shape[1]))
    # reading a perturbed cache: layers outside `layers` stay as given, layer 2 now differs from the native one
    noisy = native.with_stacked(native.k + 0.5 * jax.random.normal(jax.random.key(0), native.k.shape), native.v)
    got = recompute(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), noisy, (2,))
    np.testing.assert_array_equal(np.asarray(got.k[:2]), np.asarray(noisy.k[:2]))
    assert not np.allclose(valid(got, "k")[0][2], valid(native, "k")[0][2], atol=1e-3)
    assert got.origin.startswith("partial[2]")


def test_split_tail_keeps_a_mapped_head_in_every_row():
    tokens = np.arange(1, 21, dtype=np.int32).reshape(2, 10)
    head, tail, n = split_tail(tokens, np.asarray([10, 3], np.int32), 4)
    np.testing.assert_array_equal(head, [6, 1])
    np.testing.assert_array_equal(n, [4, 2])
    np.testing.assert_array_equal(tail, [[7, 8, 9, 10], [12, 13, 0, 0]])  # right-padded with 0
    head, tail, n = split_tail(tokens, np.asarray([0, 1], np.int32), 4)
    np.testing.assert_array_equal(head, [0, 1])
    np.testing.assert_array_equal(n, [0, 0])


def test_native_tail_maps_the_head_and_reads_the_tail_natively(pair, kvmap):
    source, target = pair
    (cfg, params), (tokens, lengths) = target, batch()
    mapped = Mapped(source, target, kvmap)(tokens, lengths, capacity=64)
    assert_same_cache(NativeTail(source, target, kvmap, 0)(tokens, lengths, capacity=64), mapped)
    clock = Clock()
    got = NativeTail(source, target, kvmap, 5, shared=SourcePrefill(source))(tokens, lengths, capacity=64,
                                                                             clock=clock)
    assert set(clock.phases) == {"source_prefill", "map", "tail"} and got.origin.startswith("tail5:mapped")
    # what reading the prompt in two pieces gives: the map's cache of each row's head, then the target's prefill
    head, tail, n = split_tail(tokens, lengths, 5)
    want = Mapped(source, target, kvmap)(tokens, head, capacity=64)
    _, want = kvjax.prefill(params, cfg, tail, want, n)
    assert_same_cache(got, want, forward_terms(cfg, tokens.shape[1]))
    for r, h in enumerate(head):  # the head is the mapped cache's, the tail is not
        np.testing.assert_array_equal(valid(got, "k")[r][:, :, :h], valid(mapped, "k")[r][:, :, :h])
        assert not np.allclose(valid(got, "k")[r][:, :, h:], valid(mapped, "k")[r][:, :, h:], atol=1e-3)
    # a map that is exact (the target read by itself through "direct" injection) gives the native cache
    from kvjax.mapper.injection import injection_map
    exact = NativeTail(target, target, injection_map(cfg, cfg), 5)(tokens, lengths, capacity=64)
    assert_same_cache(exact, NativePrefill(target)(tokens, lengths, capacity=64), forward_terms(cfg, tokens.shape[1]))
    with pytest.raises(ValueError, match="pass 0 or more"):
        NativeTail(source, target, kvmap, -1)


def test_native_tail_on_a_partially_recomputed_cache(pair, kvmap):
    """NativeTail(base=PartialRecompute(...)): the bottom layer recomputed over the whole prompt, then the tail read
    natively in every layer: the partial cache's head, the target's prefill of the tail after it."""
    source, target = pair
    (cfg, params), (tokens, lengths) = target, batch()
    partial = PartialRecompute(source, target, kvmap, 1)
    clock = Clock()
    got = NativeTail(source, target, kvmap, 5, base=partial)(tokens, lengths, capacity=64, clock=clock)
    assert set(clock.phases) == {"source_prefill", "map", "recompute", "tail"}
    assert got.origin.startswith("tail5:partial[0]:mapped")
    head, tail, n = split_tail(tokens, lengths, 5)
    want = partial(tokens, head, capacity=64)
    _, want = kvjax.prefill(params, cfg, tail, want, n)
    assert_same_cache(got, want, forward_terms(cfg, tokens.shape[1]))
    assert_same_cache(NativeTail(source, target, kvmap, 0, base=partial)(tokens, lengths, capacity=64),
                      partial(tokens, lengths, capacity=64))
    with pytest.raises(ValueError, match="makes another model's cache"):
        NativeTail(source, target, kvmap, 5, base=NativePrefill(source))
    # kvjax.builders.repaired composes them, the name on the outermost builder; neither repair: the mapped cache
    both = repaired(source, target, kvmap, 1, "bottom", 5, name="both")
    assert both.name == "both" and isinstance(both.mapped, PartialRecompute) and both.mapped.layers == partial.layers
    assert_same_cache(both(tokens, lengths, capacity=64), got)
    only = [repaired(source, target, kvmap, name="m"), repaired(source, target, kvmap, 1),
            repaired(source, target, kvmap, tail_tokens=5)]
    assert [type(b).__name__ for b in only] == ["Mapped", "PartialRecompute", "NativeTail"] and only[0].name == "m"
    assert isinstance(only[2].mapped, Mapped)


def test_builder_input_errors(pair):
    builder = NativePrefill(pair[1])
    with pytest.raises(ValueError, match="integer array"):
        builder(np.zeros((2,), np.int32))
    with pytest.raises(ValueError, match="lengths must be"):
        builder(np.ones((2, 4), np.int32), [5, 1])
    with pytest.raises(ValueError, match="capacity 2 is smaller"):
        builder(np.ones((2, 4), np.int32), capacity=2)


def test_alternating_decode_seconds_times_every_arm_and_refuses_two_answerers(pair, kvmap):
    from kvjax.generation import alternating_decode_seconds
    source, target = pair
    prompts = [list(batch(1, 12)[0][0])]
    times = alternating_decode_seconds({"target": NativePrefill(target), "mapped": Mapped(source, target, kvmap)},
                                       prompts, 6, repeats=3)
    assert set(times) == {"target", "mapped"} and all(len(t) == 3 and min(t) > 0 for t in times.values())
    with pytest.raises(ValueError, match="different models"):
        alternating_decode_seconds({"target": NativePrefill(target), "source": NativePrefill(source)}, prompts, 6, 1)

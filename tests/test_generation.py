"""Batching with unequal prompt lengths, EOS handling, sampling, and cache behaviour."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.cache import window_sizes


@pytest.fixture(scope="module")
def model(hf_checkpoints):
    path, _ = hf_checkpoints["gqa2_untied_odd"]
    return kvjax.load_hf(path)


def prompts(cfg, lengths, seed=0):
    rng = np.random.RandomState(seed)
    return [rng.randint(3, cfg.vocab_size, n).tolist() for n in lengths]


def test_batched_unequal_prompts_equal_one_by_one(model):
    cfg, params = model
    ps = prompts(cfg, [5, 17, 1, 11])
    batched = np.asarray(kvjax.generate(params, cfg, ps, max_new_tokens=20, eos_token_ids=()))
    for row, p in enumerate(ps):
        alone = np.asarray(kvjax.generate(params, cfg, [p], max_new_tokens=20, eos_token_ids=()))
        np.testing.assert_array_equal(batched[row], alone[0])


def test_batched_prefill_logits_equal_one_by_one(model):
    cfg, params = model
    ps = prompts(cfg, [7, 3, 12], seed=1)
    tokens, lengths = kvjax.pad_prompts(ps)
    cache = kvjax.init_cache(cfg, 3, 32)
    logits, cache = kvjax.prefill(params, cfg, tokens, cache, lengths)
    nxt = np.asarray([5, 6, 7], np.int32)
    step, _ = kvjax.decode_step(params, cfg, nxt, cache)
    for row, p in enumerate(ps):
        c1 = kvjax.init_cache(cfg, 1, 32)
        l1, c1 = kvjax.prefill(params, cfg, np.asarray([p]), c1)
        np.testing.assert_allclose(np.asarray(logits)[row, : len(p)], np.asarray(l1)[0], atol=1e-5)
        s1, _ = kvjax.decode_step(params, cfg, nxt[row : row + 1], c1)
        np.testing.assert_allclose(np.asarray(step)[row], np.asarray(s1)[0], atol=1e-5)


def test_chunked_prefill_equals_one_prefill(model):
    cfg, params = model
    tokens = np.asarray(prompts(cfg, [30, 30], seed=2))
    whole, _ = kvjax.prefill(params, cfg, tokens, kvjax.init_cache(cfg, 2, 40))
    cache = kvjax.init_cache(cfg, 2, 40)
    first, cache = kvjax.prefill(params, cfg, tokens[:, :13], cache)
    second, cache = kvjax.prefill(params, cfg, tokens[:, 13:], cache)
    np.testing.assert_allclose(np.concatenate([first, second], 1), whole, atol=1e-5)


def test_rows_stop_at_eos_and_are_padded(model):
    cfg, params = model
    ps = prompts(cfg, [6, 9], seed=3)
    free = np.asarray(kvjax.generate(params, cfg, ps, max_new_tokens=12, eos_token_ids=()))
    eos = int(free[0, 5])  # row 0 emits it by step 6 at the latest
    out = np.asarray(kvjax.generate(params, cfg, ps, max_new_tokens=12, eos_token_ids=(eos,), pad_token_id=0))
    for row in range(2):
        hits = np.flatnonzero(free[row] == eos)
        stop = hits[0] + 1 if len(hits) else 12
        np.testing.assert_array_equal(out[row, :stop], free[row, :stop])  # EOS itself is kept
        assert (out[row, stop:] == 0).all()
        assert row == 1 or stop <= 6


def test_sampling_is_reproducible_and_depends_on_key(model):
    cfg, params = model
    ps = prompts(cfg, [4, 4], seed=4)
    a = kvjax.generate(params, cfg, ps, 16, temperature=1.0, key=jax.random.key(1), eos_token_ids=())
    b = kvjax.generate(params, cfg, ps, 16, temperature=1.0, key=jax.random.key(1), eos_token_ids=())
    c = kvjax.generate(params, cfg, ps, 16, temperature=1.0, key=jax.random.key(2), eos_token_ids=())
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    # top_p so small that only the most likely token survives: sampling becomes greedy
    greedy = kvjax.generate(params, cfg, ps, 16, eos_token_ids=())
    tiny_p = kvjax.generate(params, cfg, ps, 16, temperature=1.0, top_p=1e-6, key=jax.random.key(3),
                            eos_token_ids=())
    np.testing.assert_array_equal(greedy, tiny_p)


def test_top_p_sampling_follows_the_truncated_distribution():
    from kvjax.generation import Sampling, sample
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 4000)
    draws = np.asarray(jax.vmap(lambda k: sample(logits, k, Sampling(1.0, 0.7)))(keys))[:, 0]
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.03)  # 0.5 and 0.3 renormalised


def test_bad_generate_arguments(model):
    cfg, params = model
    with pytest.raises(ValueError, match="explicit key"):
        kvjax.generate(params, cfg, [[3, 4]], 4, temperature=0.7)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 160\)"):
        kvjax.generate(params, cfg, [[3, 400]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        kvjax.generate(params, cfg, [[3, 4]], 0)
    with pytest.raises(ValueError, match="at least one token"):
        kvjax.generate(params, cfg, [[3, 4], []], 4)


def test_prefill_and_decode_reject_mismatched_inputs(model):
    cfg, params = model
    cache = kvjax.init_cache(cfg, 2, 16)
    with pytest.raises(ValueError, match="do not fit a cache of capacity 16"):
        kvjax.prefill(params, cfg, np.zeros((2, 17), np.int32), cache)
    with pytest.raises(ValueError, match="batch 3 but the cache was made for batch 2"):
        kvjax.prefill(params, cfg, np.zeros((3, 4), np.int32), cache)
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        kvjax.decode_step(params, cfg, np.zeros((2, 1), np.int32), cache)
    other = kvjax.Qwen3Config(vocab_size=160, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                              num_kv_heads=2, head_dim=24)
    with pytest.raises(ValueError, match="does not fit this model"):
        kvjax.decode_step(params, cfg, np.zeros((2,), np.int32), kvjax.init_cache(other, 2, 16))


def test_window_sizes_cover_capacity_with_bounded_overread():
    for capacity in [1, 100, 128, 129, 1000, 2048, 4096 + 17, 40_000]:
        ws = window_sizes(capacity)
        assert ws[-1] == capacity and list(ws) == sorted(set(ws))
        for live in range(1, capacity + 1, max(1, capacity // 97)):
            w = next(w for w in ws if w >= live)
            assert w <= max(128, 1.5 * live + 64), (capacity, live, w)


def test_long_context_crosses_attention_windows(model):
    """Decode through several window sizes; every step must match a fresh full prefill."""
    cfg, params = model
    tokens = np.asarray(prompts(cfg, [300], seed=5))
    ref, _ = kvjax.prefill(params, cfg, tokens, kvjax.init_cache(cfg, 1, 300))
    cache = kvjax.init_cache(cfg, 1, 300)
    _, cache = kvjax.prefill(params, cfg, tokens[:, :120], cache)
    for t in range(120, 300):
        step, cache = kvjax.decode_step(params, cfg, tokens[:, t], cache)
        if t in (127, 128, 191, 192, 255, 256, 299):
            np.testing.assert_allclose(np.asarray(step)[0], np.asarray(ref)[0, t], atol=1e-4)


def test_cache_is_a_pytree_with_static_metadata(model):
    cfg, _ = model
    cache = kvjax.init_cache(cfg, 2, 16)
    leaves, treedef = jax.tree.flatten(cache)
    assert len(leaves) == 2 * cfg.num_layers + 1  # one key and one value buffer per layer, and the lengths
    assert cache.keys[0].shape == (2, cfg.num_kv_heads, 16, cfg.head_dim)
    assert cache.k.shape == (cfg.num_layers, 2, cfg.num_kv_heads, 16, cfg.head_dim)  # the stacked view
    assert "capacity=16" in repr(cache) and not cache.is_mapped
    mapped = cache.replace(origin="mapped:test")
    assert mapped.is_mapped and jax.tree.structure(mapped) != treedef  # origin is part of the static structure


def cache_copies(compiled, cache) -> list[str]:
    """Why a compiled decode step does not update `cache` in place (empty: it does). Read from the executable, not
    from how its HLO prints: every cache buffer must be an input aliased to an output (the donated cache becomes the
    returned one: entry parameters in the module's input_output_alias, and alias bytes >= the cache's), and the
    step's scratch memory must be smaller than one layer's K buffer (a copy of any layer's keys or values, a slice of
    its whole window included, would need at least that much)."""
    import re
    text = compiled.as_text()
    header = text[: text.index("entry_computation_layout")]  # HloModule NAME, input_output_alias={...} (if any)
    aliased = {int(p) for p in re.findall(r"\}: \((\d+), \{\}, (?:may|must)-alias\)", header)}
    layout = text[text.index("entry_computation_layout={(") + 27:]
    params = re.findall(r"(\w+\[[\d,]*\])(?:\{[\d,]*\})?", layout[: layout.index(")->")])
    leaves = [*cache.keys, *cache.values]
    want = [f"{str(x.dtype).replace('float', 'f')}[{','.join(map(str, x.shape))}]" for x in leaves]  # f32, bf16
    shapes = sorted(params[i] for i in aliased)
    mem = compiled.memory_analysis()
    layer_bytes = min(x.nbytes for x in leaves)
    problems = []
    if not all(shapes.count(w) >= want.count(w) for w in set(want)):
        problems.append(f"cache buffers not aliased to outputs: aliased parameters {shapes}, cache {sorted(want)}")
    if mem.alias_size_in_bytes < sum(x.nbytes for x in leaves):
        problems.append(f"alias bytes {mem.alias_size_in_bytes} < the cache's {sum(x.nbytes for x in leaves)}")
    if mem.temp_size_in_bytes >= layer_bytes:
        problems.append(f"scratch {mem.temp_size_in_bytes} B >= one layer's buffer ({layer_bytes} B): a copy")
    return problems


def test_decode_updates_each_layers_cache_buffer_in_place(model, hf_checkpoints):
    # One buffer per layer (kvjax.cache): when decode's attention window is the whole capacity, no layer's keys or
    # values are sliced or copied before attention reads them, and the donated cache is written in place. With one
    # stacked [L, ...] buffer XLA copied every layer's window out of it on every step (about a quarter of a
    # batch-16/64 step: experiments.cache_layout).
    from kvjax.models.decoder import decode, decode_jit
    cfg, params = model
    tokens = jnp.ones((2,), jnp.int32)
    for transposed in (False, True):  # keys [B, Hkv, T, hd] or [B, Hkv, hd, T] (kvjax.cache)
        cache = kvjax.init_cache(cfg, 2, 128, keys_transposed=transposed)  # capacity 128: one window, all of it
        assert cache_copies(decode_jit.lower(params, cfg, tokens, cache).compile(), cache) == [], transposed
    # positive controls, the same check on decode steps that do copy (a 1-layer model: quicker to compile): without
    # donation the new cache is another buffer; donated, but the old keys read after the step has written them, XLA
    # must keep a copy of that layer
    cfg, params = kvjax.load_hf(hf_checkpoints["gqa4_hd_big"][0])
    cache = kvjax.init_cache(cfg, 2, 128)
    kept = jax.jit(decode, static_argnames="cfg").lower(params, cfg, tokens, cache).compile()
    assert [p.split(":")[0] for p in cache_copies(kept, cache)] == ["cache buffers not aliased to outputs",
                                                                   f"alias bytes 0 < the cache's {cache.k.nbytes * 2}"]
    reread = jax.jit(lambda p, t, c: (decode(p, cfg, t, c), c.keys[0].sum()), donate_argnums=2)
    problems = cache_copies(reread.lower(params, tokens, cache).compile(), cache)
    assert len(problems) == 1 and problems[0].startswith("scratch"), problems


def test_cache_slice_and_inspect_helpers(model):
    from kvjax.cache import slice_batch, valid
    cfg, params = model
    tokens, lengths = kvjax.pad_prompts(prompts(cfg, [5, 9, 3], seed=6))
    _, cache = kvjax.prefill(params, cfg, tokens, kvjax.init_cache(cfg, 3, 16), lengths)
    sub = slice_batch(cache, np.asarray([2, 0]))
    assert sub.batch_size == 2 and np.asarray(sub.lengths).tolist() == [3, 5]
    k, v = valid(cache, 1)
    assert k.shape == (cfg.num_layers, cfg.num_kv_heads, 9, cfg.head_dim) and v.shape == k.shape
    np.testing.assert_array_equal(valid(sub, 1)[0], valid(cache, 0)[0])


def test_decode_over_transposed_keys_equals_decode_over_standard_keys(model):
    # kvjax.generate's loop holds each layer's keys as [B, Hkv, hd, T] (kvjax.cache, keys_transposed); decode over
    # them must give the logits and the cache that decode over [B, Hkv, T, hd] keys gives, windows crossed included.
    from kvjax.models.decoder import forward
    cfg, params = model
    tokens, lengths = kvjax.pad_prompts(prompts(cfg, [120, 40, 7], seed=7))
    _, cache = kvjax.prefill(params, cfg, tokens, kvjax.init_cache(cfg, 3, 300), lengths)
    flipped = cache.with_keys_transposed(True)
    assert flipped.keys[0].shape == (3, cfg.num_kv_heads, cfg.head_dim, 300)
    assert (flipped.capacity, flipped.head_dim) == (cache.capacity, cache.head_dim) and "transposed" in repr(flipped)
    np.testing.assert_array_equal(flipped.k, cache.k)
    step = jax.jit(lambda c, t: forward(params, cfg, t[:, None], c)[:2])  # (logits, cache)
    for i in range(12):  # row 0 crosses the 128-position window
        nxt = jnp.asarray([3 + i, 9, 100 - i], jnp.int32)
        want, cache = step(cache, nxt)
        got, flipped = step(flipped, nxt)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert flipped.keys_transposed
    np.testing.assert_allclose(np.asarray(flipped.with_keys_transposed(False).k), np.asarray(cache.k), atol=1e-6)
    np.testing.assert_array_equal(flipped.lengths, cache.lengths)
    # prefill into a cache created transposed: fresh, then a chunk over the cached part
    first, rest = tokens[:, :50], tokens[:, 50:]
    fresh = kvjax.init_cache(cfg, 3, 300, keys_transposed=True)
    assert fresh.keys[0].shape == (3, cfg.num_kv_heads, cfg.head_dim, 300) and fresh.capacity == 300
    _, standard = kvjax.prefill(params, cfg, first, kvjax.init_cache(cfg, 3, 300))
    _, fresh = kvjax.prefill(params, cfg, first, fresh)
    want, standard = kvjax.prefill(params, cfg, rest, standard)
    got, fresh = kvjax.prefill(params, cfg, rest, fresh)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(fresh.k), np.asarray(standard.k), atol=1e-6)


def test_transposed_keys_helpers_and_refusals(model):
    from kvjax.cache import axes, slice_batch, valid
    from kvjax.models.decoder import forward
    cfg, params = model
    tokens, lengths = kvjax.pad_prompts(prompts(cfg, [5, 9], seed=8))
    _, cache = kvjax.prefill(params, cfg, tokens, kvjax.init_cache(cfg, 2, 16), lengths)
    flipped = cache.with_keys_transposed(True)
    assert flipped.with_keys_transposed(True) is flipped
    np.testing.assert_array_equal(valid(flipped, 1)[0], valid(cache, 1)[0])
    np.testing.assert_array_equal(slice_batch(flipped, np.asarray([1])).k, slice_batch(cache, np.asarray([1])).k)
    assert axes(flipped).keys[0] == ("batch", "kv_heads", "head_dim", "cache_seq")
    with pytest.raises(ValueError, match="with_keys_transposed"):
        flipped.map_layers(lambda a: a)
    with pytest.raises(ValueError, match=r"write=False.* reads keys as .*with_keys_transposed\(False\)"):
        forward(params, cfg, jnp.ones((2, 3), jnp.int32), flipped, write=False)


def test_prefill_and_decode_reject_token_ids_outside_the_vocabulary(model):
    cfg, params = model  # vocab_size 160: id 160 would be gathered from a clamped embedding row
    for bad in (160, -1):
        tokens = np.full((2, 4), 5, np.int32)
        tokens[1, 2] = bad
        with pytest.raises(ValueError, match=rf"prefill: token ids must be in \[0, 160\).*got {bad} at index \[1, 2\]"):
            kvjax.prefill(params, cfg, tokens, kvjax.init_cache(cfg, 2, 16))
        with pytest.raises(ValueError, match=rf"decode_step: token ids must be in \[0, 160\).*got {bad}"):
            kvjax.decode_step(params, cfg, jnp.asarray([5, bad], jnp.int32), kvjax.init_cache(cfg, 2, 16))
    # padding past a row's length is never embedded into the cache, so any pad value is accepted there
    tokens = np.asarray([[5, 6, 7], [8, -1, -1]], np.int32)
    logits, _ = kvjax.prefill(params, cfg, tokens, kvjax.init_cache(cfg, 2, 16), np.asarray([3, 1]))
    assert np.isfinite(np.asarray(logits)).all()


def test_decode_on_a_full_cache_is_an_error(model):
    cfg, params = model
    cache = kvjax.init_cache(cfg, 2, 8)
    tokens, lengths = kvjax.pad_prompts(prompts(cfg, [6, 3], seed=4))
    _, cache = kvjax.prefill(params, cfg, tokens, cache, lengths)
    nxt = np.asarray([5, 6], np.int32)
    for _ in range(2):  # row 0 reaches capacity 8; both steps were stored
        _, cache = kvjax.decode_step(params, cfg, nxt, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [8, 5])
    with pytest.raises(ValueError, match=r"cache is full \(all 8 positions used\) in row\(s\) \[0\].*init_cache"):
        kvjax.decode_step(params, cfg, nxt, cache)
    # the same overflow through a second prefill chunk
    with pytest.raises(ValueError, match=r"row 0 holds 8 positions and gets 1 more, past the cache capacity 8"):
        kvjax.prefill(params, cfg, nxt[:, None], cache)


def test_prefill_rejects_bad_lengths(model):
    cfg, params = model
    with pytest.raises(ValueError, match=r"lengths must be \[B\] = \[2\] integers in 0..4"):
        kvjax.prefill(params, cfg, np.zeros((2, 4), np.int32), kvjax.init_cache(cfg, 2, 16), [4, 5])


def test_every_entry_point_prepares_prompts_alike_and_pads_with_a_pad_id_of_0(model):
    """One prompt preparation (kvjax.generation.prepare) behind generate, generate_from (and the split path) and
    speculative_generate: a config's pad id of 0 is a pad id, not "unset" (it once fell back to the first EOS in
    the split path), and every entry point checks token ids against the vocabulary."""
    import dataclasses

    from kvjax.generation import prepare
    cfg, params = model
    assert cfg.pad_token_id == 0 and cfg.eos_token_ids == (2,)
    assert prepare([[5, 6]], cfg, 4).pad == 0
    assert prepare([[5, 6]], dataclasses.replace(cfg, pad_token_id=None), 4).pad == 2  # unset: the first EOS
    assert prepare([[5, 6]], cfg, 4, pad_token_id=7).pad == 7
    ps = prompts(cfg, [6, 9], seed=3)
    eos = (int(np.asarray(kvjax.generate(params, cfg, ps, 1, eos_token_ids=()))[0, 0]),)  # row 0 stops at once
    want = np.asarray(kvjax.generate(params, cfg, ps, 6, eos_token_ids=eos))
    assert want[0, 0] == eos[0] and (want[0, 1:] == 0).all()
    got = {"generate_from": kvjax.generate_from(kvjax.NativePrefill(model), ps, 6, eos_token_ids=eos),
           "native_generate": kvjax.native_generate(kvjax.Model(cfg, params), ps, 6, eos_token_ids=eos),
           "speculative_generate": kvjax.speculative_generate(model, "lookup", ps, 6, eos_token_ids=eos)}
    for name, out in got.items():
        np.testing.assert_array_equal(np.asarray(out), want, err_msg=name)
    bad = [[5, cfg.vocab_size]]
    for call in (lambda: kvjax.generate(params, cfg, bad, 2),
                 lambda: kvjax.generate_from(kvjax.NativePrefill(model), bad, 2),
                 lambda: kvjax.speculative_generate(model, "lookup", bad, 2)):
        with pytest.raises(ValueError, match=f"token ids must be in \\[0, {cfg.vocab_size}\\)"):
            call()


def test_sample_rows_draws_each_row_by_its_own_settings_and_key():
    """A server's rows sample by their own temperature, top_p and key: a row's token does not depend on the rows
    beside it, a top_p below the top token's mass keeps only it, and many keys draw softmax(logits / T) restricted to
    top_p (the distribution `sample` draws from)."""
    from kvjax.generation import Sampling, sample_rows, sampling_probs
    logits = jax.random.normal(jax.random.key(0), (4, 12)) * 2
    temperature, top_p = jnp.array([1.0, 0.7, 2.0, 1.0]), jnp.array([1e-6, 1.0, 0.6, 1.0])
    keys = jax.random.split(jax.random.key(1), 4)
    out = np.asarray(sample_rows(logits, temperature, top_p, keys))
    assert out[0] == int(jnp.argmax(logits[0]))
    np.testing.assert_array_equal(np.asarray(sample_rows(logits[1:3], temperature[1:3], top_p[1:3], keys[1:3])),
                                  out[1:3])
    n = 4000
    for row in (1, 2):
        draws = sample_rows(jnp.broadcast_to(logits[row], (n, 12)), jnp.full((n,), temperature[row]),
                            jnp.full((n,), top_p[row]), jax.random.split(jax.random.key(2 + row), n))
        freq = np.bincount(np.asarray(draws), minlength=12) / n
        want = np.asarray(sampling_probs(logits[row:row + 1], Sampling(float(temperature[row]), float(top_p[row]))))[0]
        assert np.all(freq[want == 0] == 0)
        np.testing.assert_allclose(freq, want, atol=0.03)

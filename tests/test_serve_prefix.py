"""Serving past the prefill bound: the prefix cache of transferred caches (kvjax.serve.prefix), prompts read in
pieces (kvjax.builders.base.Resumable, kvjax.serve.prefill) and chunked prefill. Every greedy answer is compared
token for token with offline generation of the whole prompt; tiny random models, the engine driven directly."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.builders import Mapped, NativePrefill
from kvjax.fitting.residual import with_attention, with_context
from kvjax.serve import Engine, EngineConfig
from kvjax.serve.config import Request
from kvjax.serve.prefix import PrefixCache

from test_serve import TOKENIZER, tiny_pair

CAPACITY = 256


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tok = kvjax.load_tokenizer(TOKENIZER)
    vocab = tok.get_vocab_size()
    source, target, kvmap = tiny_pair(vocab)
    # a context map as training leaves one (each position also reads the two before it), through its artifact
    rs = np.random.RandomState(2)
    ctx = with_context(kvmap, 2, seed=0)
    ctx = ctx.replace(keys=tuple(m.replace(up=jnp.asarray(rs.randn(*m.up.shape) * 0.1, jnp.float32)) for m in ctx.keys),
                      values=tuple(m.replace(up=jnp.asarray(rs.randn(*m.up.shape) * 0.1, jnp.float32))
                                   for m in ctx.values))
    path = tmp_path_factory.mktemp("ctxmap") / "map"
    kvjax.save_map(str(path), ctx)
    # a cross-position map (its residual attends over every earlier position), its output projection non-zero
    att = with_attention(kvmap, 2, 8, seed=0)
    att = att.replace(**{kind: tuple(m.replace(up=jnp.asarray(rs.randn(*m.up.shape) * 0.1, jnp.float32),
                                               att_o=jnp.asarray(rs.randn(*m.att_o.shape), jnp.float32))
                                     for m in getattr(att, kind)) for kind in ("keys", "values")})
    return dict(source=source, target=target, kvmap=kvmap, context=kvjax.load_map(str(path)), attending=att, tok=tok,
                vocab=vocab)


def ids(stack, n, seed):
    return [int(t) for t in np.random.RandomState(seed).randint(1, stack["vocab"], n)]


def offline(stack, prompt, n, kvmap=None, native=False):
    res = kvjax.split_generate(stack["source"], stack["target"], kvmap or stack["kvmap"], [list(prompt)], n,
                               gate=not native)
    assert res.path == ("native_target" if native else "split")
    out = [int(t) for t in np.asarray(res.tokens)[0]]
    return out[: out.index(0) + 1] if 0 in out else out


def serve(engine, prompts, max_tokens, on_token=None):
    """Submit `prompts` together; their generated ids (and token arrival times) once all finished."""
    done = [threading.Event() for _ in prompts]
    got = [[] for _ in prompts]
    times = [[] for _ in prompts]

    def sink(i):
        def f(ev):
            if ev.kind == "token":
                got[i].extend(ev.ids)
                times[i].append(time.perf_counter())
            elif ev.kind == "error":
                got[i].append(f"error {ev.status}: {ev.message}")
            if ev.kind in ("finish", "error"):
                done[i].set()
        return f
    reqs = [Request(prompt=list(p), max_tokens=max_tokens, sink=sink(i)) for i, p in enumerate(prompts)]
    for r in reqs:
        engine.submit(r)
    for d in done:
        assert d.wait(180), "a request did not finish"
    return got, times


def metric(engine, name) -> float:
    for line in engine.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


# ---- the prefix cache itself -----------------------------------------------------------------------------------

def host_state(tokens, layers=2):
    """A one-row host state whose position t holds t (keys) and -t (values): what was cached is checkable."""
    t = np.arange(len(tokens), dtype=np.float32)[None, None, :, None] * np.ones((1, 1, 1, 2), np.float32)
    return [([t.copy() for _ in range(layers)], [-t.copy() for _ in range(layers)])]


def test_prefix_cache_shares_whole_blocks_evicts_lru_leaves_and_never_a_pinned_one():
    block = 4
    per_block = 2 * 2 * (1 * 1 * block * 2) * 4  # keys + values, 2 layers, [1, 4, 2] float32
    cache = PrefixCache(block, budget_bytes=3 * per_block)
    a = list(range(1, 11))  # 10 tokens: two whole blocks, the rest is never stored
    chain = cache.store(a, cache.match(a), host_state(a), 0)
    assert [len(b.tokens) for b in chain] == [4, 4] and cache.blocks == 2 and cache.bytes == 2 * per_block
    cache.release(chain)

    # a prompt that leaves A in the middle of its second block shares only the first; what is filled back is A's
    b = a[:6] + [99] * 6
    hit = cache.match(b)
    assert len(hit) == 1
    filled = [([np.zeros((1, 1, 12, 2), np.float32) for _ in range(2)],
               [np.zeros((1, 1, 12, 2), np.float32) for _ in range(2)])]
    PrefixCache.fill(filled, 0, hit)
    np.testing.assert_array_equal(filled[0][0][1][0, 0, :4, 0], [0, 1, 2, 3])
    np.testing.assert_array_equal(filled[0][1][0][0, 0, :4, 0], [0, -1, -2, -3])
    chain = cache.store(b, hit, host_state(b), 0)  # B's own second and third blocks: one fits, then A's leaf goes
    assert cache.bytes <= cache.budget and len(chain) == 3 and cache.blocks == 3
    cache.release(chain)
    assert len(cache.match(a)) == 1  # A's second block was the least recently used leaf: evicted

    # every block of A and B is pinned now (A's match above is still held, and B's): a new prompt stores nothing
    pinned = cache.match(b)
    c = [7] * 8
    assert cache.store(c, cache.match(c), host_state(c), 0) == [] and cache.blocks == 3
    assert cache.bytes <= cache.budget
    cache.release(pinned)
    assert cache.stats()["pinned"] == 1  # A's first block: the match of A above was never released
    with pytest.raises(ValueError, match="block must be >= 1"):
        PrefixCache(0, 10)


# ---- reading a prompt in pieces --------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["mapped", "context", "attending", "native"])
def test_a_prompt_read_in_pieces_gets_the_cache_it_gets_read_whole(stack, which):
    builder = (NativePrefill(stack["target"]) if which == "native" else
               Mapped(stack["source"], stack["target"], stack["kvmap" if which == "mapped" else which]))
    rs = np.random.RandomState(1)
    tokens = rs.randint(1, stack["vocab"], (3, 90)).astype(np.int32)
    lengths = np.array([90, 70, 41], np.int32)
    whole = builder(tokens, lengths, capacity=128)
    state = builder.start(3, 128)
    cuts = [0, 33, 64, 90]  # a context map's second and third pieces read positions before them
    for i, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
        n = np.clip(lengths - lo, 0, hi - lo).astype(np.int32)
        state = builder.resume(state, tokens[:, lo:hi], n, fresh=i == 0)
    got = state[-1]
    np.testing.assert_array_equal(got.lengths, lengths)
    if which == "mapped":  # a source that is not plain text (e.g. an audio adapter listening) is refused
        other = Mapped(stack["source"], stack["target"], stack["kvmap"], shared=NativePrefill(stack["source"]))
        with pytest.raises(TypeError, match="cannot be read in pieces"):
            other.resume(other.start(3, 128), tokens[:, :8], np.full(3, 8, np.int32))
    assert got.origin == whole.origin
    for a, b in zip(got.keys + got.values, whole.keys + whole.values):
        for row, n in enumerate(lengths):
            np.testing.assert_allclose(a[row, :, :n], b[row, :, :n], atol=2e-5)


def test_the_rest_after_a_cached_prefix_is_read_in_pieces_that_pad_little(stack):
    """A piece costs its width whether its positions are real or padding: after a cached prefix the rest is read in
    the widest pieces that pad fewer than 64 positions (a 98-token rest in two 64-token pieces, not one of 256), and
    gets the cache that reading it whole gives. A prompt the cache holds whole reads nothing."""
    from kvjax.serve import programs
    from kvjax.serve.prefill import PrefillJob

    widths = []

    class Recording(Mapped):
        def resume(self, state, tokens, lengths, fresh=False):
            widths.append(tokens.shape[1])
            return super().resume(state, tokens, lengths, fresh=fresh)

    builder = Recording(stack["source"], stack["target"], stack["kvmap"])
    buckets = programs.buckets(CAPACITY)
    first = ids(stack, 101, 3)
    for cached, rest, expect in ((96, 98, [64, 64]), (16, 200, [256]), (96, 0, [])):
        prefix = PrefixCache(16, 1 << 30)
        PrefillJob(builder, [first], buckets, 1, prefix).finish()  # stores its 6 whole blocks: 96 tokens
        prompt = first[:cached] + ids(stack, rest + 1, 4)  # the last token is decoded, not prefilled
        widths.clear()
        job = PrefillJob(builder, [prompt], buckets, 1, prefix)
        got = job.finish()
        job.close()
        assert job.reused == cached and job.capacity == programs.bucket_for(cached + rest, buckets)
        assert widths == expect, (rest, widths)
        whole = programs.prefill_batch(Mapped(stack["source"], stack["target"], stack["kvmap"]), [prompt],
                                       job.capacity, 1)
        n = len(prompt) - 1
        for a, b in zip(got.keys + got.values, whole.keys + whole.values):
            np.testing.assert_allclose(a[0, :, :n], b[0, :, :n], atol=2e-5)


# ---- the engine ------------------------------------------------------------------------------------------------

def engine(stack, kvmap=None, split=True, **config):
    config = dict(dict(slots=4, capacity=CAPACITY, max_prefill_batch=4, max_tokens_limit=64), **config)
    devices = jax.devices()[:2] if config.get("topology") == "disaggregated" else None
    return Engine(stack["source"], stack["target"], kvmap or stack["kvmap"], stack["tok"], EngineConfig(**config),
                  split=split, devices=devices).start()


def conversations(stack, system=40, users=(5, 17, 30)):
    """A shared system prompt, prompts that end inside and on block boundaries, and a second turn of one of them."""
    sys_prompt = ids(stack, system, 10)
    prompts = [sys_prompt + ids(stack, n, 20 + n) for n in users]
    prompts.append(prompts[1] + ids(stack, 21, 7))  # the next turn of prompt 1: all of prompt 1 is a prefix
    prompts.append(prompts[0])  # asked again: every whole block cached
    return prompts


@pytest.mark.parametrize("kind", ["split", "context", "native", "disaggregated"])
def test_reused_prefixes_answer_as_offline(stack, kind):
    kvmap = stack["context"] if kind == "context" else None
    prompts = conversations(stack)
    want = [offline(stack, p, 10, kvmap, native=kind == "native") for p in prompts]
    topology = "disaggregated" if kind == "disaggregated" else "batched"  # there: the prefill worker's device
    e = engine(stack, kvmap, split=kind != "native", prefix_cache_mb=1, prefix_block=8, topology=topology)
    try:
        first, _ = serve(e, prompts[:3], 10)  # three at once: the system prompt's blocks stored by one batch
        second, _ = serve(e, prompts[3:], 10)
        again, _ = serve(e, prompts[:3], 10)
        assert first + second == want and again == want[:3]
        assert metric(e, "kvjax_prefix_hits_total") >= 5
        assert metric(e, "kvjax_prefix_reused_tokens_total") >= 5 * 40 // 8 * 8
        assert e.stats()["prefix_cache"]["pinned"] == 0  # nothing stays pinned after its prefill
    finally:
        e.stop()


def test_eviction_under_pressure_keeps_answers_and_the_budget(stack):
    prompts = [ids(stack, 24, 3) + ids(stack, 20 + i, 30 + i) for i in range(8)]  # a shared start, then apart
    want = [offline(stack, p, 6) for p in prompts]
    block_bytes = 2 * 8 * (3 * 2 * 16 + 2 * 1 * 16) * 4  # keys + values of both models, 8 positions, float32
    e = engine(stack, prefix_cache_mb=10 * block_bytes / 2**20, prefix_block=8)
    try:
        held = []
        for group in (prompts[:4], prompts[4:], prompts[:4]):
            got, _ = serve(e, group, 6)
            assert got == [want[prompts.index(p)] for p in group]
            held.append(metric(e, "kvjax_prefix_bytes"))
        assert metric(e, "kvjax_prefix_evictions_total") > 0
        assert max(held) <= e.prefix.budget and e.stats()["prefix_cache"]["pinned"] == 0
    finally:
        e.stop()


def test_chunked_prefill_interleaves_decode_steps_and_answers_as_offline(stack):
    short, long = ids(stack, 12, 50), ids(stack, 200, 51)
    want = [offline(stack, short, 40), offline(stack, long, 4)]
    e = engine(stack, max_step_tokens=32, prefix_cache_mb=1, prefix_block=16)
    try:
        got, times = [None, None], [None, None]

        def decoder():
            (got[0],), (times[0],) = serve(e, [short], 40)
        t = threading.Thread(target=decoder)
        t.start()
        while not e.slots.active():  # the short request is decoding
            time.sleep(0.005)
        submitted = time.perf_counter()
        (got[1],), (times[1],) = serve(e, [long], 4)
        t.join(60)
        assert got == want
        during = [x for x in times[0] if submitted < x < times[1][0]]
        assert metric(e, "kvjax_prefill_pieces_total") >= 199 // 32
        assert len(during) >= 2, "the decoding request waited for the whole long prefill"
    finally:
        e.stop()


def _window(windows, needed):
    return next(w for w in windows if w >= needed)


def test_warm_up_runs_every_attention_window_of_the_pieces_and_the_decode_step(stack, monkeypatch):
    """On XLA:CPU the first run of each attention window's branch (kvjax.cache.window_sizes, a lax.switch) costs
    15-30 ms more than the next; a prompt that first reached a window stalled every decoding row by that much. The
    warm-up must run each branch: a later piece of every width at every window, the decode step at every window and
    row count (and its sampling branch), and leave the slots as it found them."""
    from kvjax.cache import window_sizes
    from kvjax.serve import programs
    from kvjax.serve.prefill import compile_pieces, pieces
    windows = window_sizes(CAPACITY)
    assert len(windows) > 2  # the test needs windows past the first

    class Recording(Mapped):
        def resume(self, state, tokens, lengths, fresh=False):
            if not fresh:  # a later piece attends over its cached positions and itself
                needed = int(np.max(np.asarray(state[0].lengths) + np.asarray(lengths)))
                seen.add((tokens.shape[1], _window(windows, needed)))
            return super().resume(state, tokens, lengths, fresh=fresh)

    seen = set()
    widths = pieces(CAPACITY, 2, prefix=True, max_step_tokens=64)
    compile_pieces(Recording(stack["source"], stack["target"], stack["kvmap"]), 2, CAPACITY, widths)
    later = {w for w, _ in widths if w < CAPACITY}
    assert later == {32, 64}
    assert {(w, win) for w in later for win in windows if win > w} <= seen

    steps, step = set(), programs.step

    def recording_step(params, cfg, cache, tokens, active, temperature, *rest, rows=None):
        needed = int(np.max(np.where(active, np.asarray(cache.lengths), 0))) + 1
        steps.add((rows, _window(windows, needed), bool(np.any(np.asarray(temperature)[active] > 0))))
        return step(params, cfg, cache, tokens, active, temperature, *rest, rows=rows)
    monkeypatch.setattr(programs, "step", recording_step)
    e = engine(stack)
    try:
        e.slots.warm()
        rows = e.slots.row_buckets
        assert {(r, w, False) for r in rows for w in windows} <= steps
        assert {r for r, _, sampled in steps if sampled} == set(rows)
        assert e.slots.free() == e.config.slots and not np.asarray(e.slots.cache.lengths).any()
    finally:
        e.stop()


def test_settings_are_checked(stack):
    assert any("--topology=batched" in p for p in EngineConfig(topology="serial", max_step_tokens=64).problems())
    assert any("own" in p for p in EngineConfig(topology="disaggregated", max_step_tokens=64).problems())
    assert EngineConfig(prefix_cache_mb=-1).problems() and EngineConfig(prefix_block=0).problems()
    assert EngineConfig(max_step_tokens=8).problems() and not EngineConfig(max_step_tokens=64).problems()
    from kvjax.serve.cli import ServeError, parse
    with pytest.raises(ServeError, match="prefix_cache_mb must be >= 0"):
        parse(["--prefix-cache-mb", "-5", "--map", "x"])

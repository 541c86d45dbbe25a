"""Speculative decoding in the server (kvjax.serve.drafting): greedy answers are token-identical to offline decoding
and to the server without drafting (ragged acceptance across slots, EOS / a stop string / max_tokens inside a
round, the prefix cache and chunked prefill on), a sampled row follows the target's distribution, each slot's drafter
state follows its request whichever kind of step ran, the per-step choice follows the measured costs, and bad
settings are refused before anything is served. Tiny random models; the engine and its programs driven directly."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.serve import Engine, EngineConfig, programs
from kvjax.serve.config import Request
from kvjax.serve.scheduler import DraftPolicy

from test_serve import TOKENIZER, tiny, tiny_pair
from test_serve_prefix import ids, metric, offline, serve

CAPACITY = 128


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from kvjax.drafter import drafter_config, init_drafter, save_drafter
    tok = kvjax.load_tokenizer(TOKENIZER)
    vocab = tok.get_vocab_size()
    source, target, kvmap = tiny_pair(vocab)
    dcfg = drafter_config(target[0], num_layers=1, block_sizes=(4, 8))  # drafts badly: all exactness needs
    path = tmp_path_factory.mktemp("drafter") / "drafter"
    save_drafter(str(path), dcfg, init_drafter(dcfg, jax.random.key(1), 0.3))
    return dict(source=source, target=target, kvmap=kvmap, tok=tok, vocab=vocab, drafter=str(path))


def engine(stack, target=None, **config):
    config = dict(dict(slots=4, capacity=CAPACITY, max_prefill_batch=4, max_tokens_limit=64), **config)
    if config.get("speculative") in ("block", "combined"):
        config.setdefault("drafter", stack["drafter"])
        config.setdefault("draft_len", 4)
    return Engine(stack["source"], target or stack["target"], stack["kvmap"], stack["tok"],
                  EngineConfig(**config)).start()


def repeating(stack):
    """Prompts whose greedy answers repeat (prompt lookup accepts long copies) beside ones that do not, so the rows
    of one round accept different counts."""
    phrase = ids(stack, 7, 3)
    return [phrase * 4, ids(stack, 9, 5) + phrase * 3, ids(stack, 20, 1), ids(stack, 33, 2), phrase * 2 + [5],
            ids(stack, 45, 8)]


@pytest.mark.parametrize("kind", ["lookup", "block", "combined"])
def test_greedy_answers_equal_offline_with_every_drafter(stack, kind):
    """Six requests through four slots (they join and leave between rounds), drafting every step: each answer is
    offline split_generate's; with the prefix cache on (a second pass reuses every prompt's blocks) and with chunked
    prefill (requests join between the rounds of the others)."""
    prompts = repeating(stack)
    want = [offline(stack, p, 24) for p in prompts]
    e = engine(stack, speculative=kind, draft_policy="always", prefix_cache_mb=1, prefix_block=8,
               max_step_tokens=16)
    try:
        got, _ = serve(e, prompts, 24)
        again, _ = serve(e, prompts[::-1], 24)
        settled(e)
        assert got == want and again == want[::-1]
        assert metric(e, "kvjax_prefix_hits_total") >= len(prompts)
        assert metric(e, "kvjax_prefill_pieces_total") > 0
        steps = {k: metric(e, f'kvjax_decode_steps_total{{kind="{k}"}}') for k in ("draft",)}
        assert steps["draft"] > 0
        part = "block" if kind == "block" else "lookup"
        drafted = metric(e, f'kvjax_drafted_tokens_total{{drafter="{part}"}}')
        accepted = metric(e, f'kvjax_accepted_tokens_total{{drafter="{part}"}}')
        assert drafted > 0
        if kind == "lookup":  # the repeats are copied and accepted, not everything: rows accept different counts
            assert 0 < accepted < drafted
            # every emitted token streamed: no round ran past a request's end here (all hit max_tokens exactly or
            # later rounds); tokens per round sum to the tokens streamed only if nothing was dropped
            assert metric(e, 'kvjax_acceptance_length_count{drafter="lookup"}') > 0
    finally:
        e.stop()


def test_a_round_accepts_a_different_count_in_each_row(stack):
    """One verify round over three rows (kvjax.serve.programs.round_step): a row whose context repeats accepts its
    copied drafts, a row with nothing to copy emits one token, a free slot nothing; every emitted token is the
    target's greedy decode, and each row's cache length moves by what it emitted."""
    from kvjax.serve.drafting import Drafting
    from kvjax.serve.metrics import Metrics
    cfg, params = stack["target"]
    config = EngineConfig(slots=4, capacity=CAPACITY, speculative="lookup", draft_len=4)
    d = Drafting(stack["target"], config, jax.devices()[0], Metrics())
    # the greedy continuation of a prompt that loops is copied by lookup; find one offline
    loop_prompt = repeating(stack)[0]
    free = [int(t) for t in np.asarray(kvjax.generate(params, cfg, [loop_prompt], 12, eos_token_ids=()))[0]]
    prompts = [loop_prompt + free[:8], ids(stack, 11, 4)]  # row 0 has already decoded 8 tokens of its loop
    new = kvjax.NativePrefill((cfg, params))
    batch = programs.prefill_batch(new, prompts, CAPACITY, 2)
    cache = programs.empty_slots(cfg, 4, CAPACITY, jnp.float32)
    cache = programs.insert(cache, batch, jnp.asarray([0, 1], jnp.int32))
    d.insert([(0, 0, prompts[0]), (1, 1, prompts[1])], batch)
    active = np.array([True, True, False, False])
    tokens = np.array([prompts[0][-1], prompts[1][-1], 0, 0], np.int32)
    zeros = np.zeros(4, np.int32)
    ahead = d.lengths.copy()  # the look-ahead of the inserted rows: what their first round drafts
    cache, toks, n_new, drafted = d.step(d.widths[-1], cache, tokens, active, np.zeros(4, np.float32),
                                         np.ones(4, np.float32), zeros, zeros, rows=4, sampled=False)
    assert n_new[0] > 1 and n_new[1] == 1 and n_new[2] == n_new[3] == 0 and drafted[0] >= n_new[0] - 1
    assert list(drafted) == list(ahead) and ahead[0] >= 1
    for row, p in enumerate(prompts):
        greedy = [int(t) for t in np.asarray(kvjax.generate(params, cfg, [p], 6, eos_token_ids=()))[0]]
        assert list(toks[row, :n_new[row]]) == greedy[:n_new[row]]
    lengths = np.asarray(cache.lengths)
    assert list(lengths) == [len(prompts[0]) - 1 + n_new[0], len(prompts[1]) - 1 + 1, 0, 0]


def settled(e, seconds=30):
    """Wait until the engine's last step is fully accounted (its requests answered first, its metrics after)."""
    import time
    deadline = time.time() + seconds
    while metric(e, "kvjax_active_slots") != 0 or e.stats()["active_slots"]:
        assert time.time() < deadline, "the engine did not settle"
        time.sleep(0.01)


def events(e, reqs):
    """Submit `reqs` (Request kwargs) at once; each one's (token ids, text, finish reason, token events)."""
    import threading
    out = [dict(ids=[], text="", reason=None, chunks=[]) for _ in reqs]
    done = [threading.Event() for _ in reqs]

    def sink(i):
        def f(ev):
            if ev.kind == "token":
                out[i]["ids"] += ev.ids
                out[i]["text"] += ev.text
                out[i]["chunks"].append(len(ev.ids))
            else:
                out[i]["reason"] = ev.reason or f"error {ev.status}: {ev.message}"
                done[i].set()
        return f
    for i, kw in enumerate(reqs):
        e.submit(Request(sink=sink(i), **kw))
    for d in done:
        assert d.wait(180), "a request did not finish"
    return out


def test_eos_stop_text_and_max_tokens_inside_a_round_end_the_answer_there(stack):
    """A request ends at an EOS, a stop string or its max_tokens that falls inside a round's accepted drafts (the
    tiny target's answers run into loops of one token, which prompt lookup copies), with the tokens, text and finish
    reason of the server without drafting; the round's later tokens are dropped."""
    import dataclasses
    cfg, params = stack["target"]
    plain = (dataclasses.replace(cfg, eos_token_ids=()), params)

    def answer(prompt, n=24):
        return [int(t) for t in np.asarray(kvjax.split_generate(stack["source"], plain, stack["kvmap"], [prompt], n,
                                                                gate=True).tokens)[0]]
    base = repeating(stack)
    a, b = answer(base[1]), answer(base[2])
    k = next(i for i in range(2, len(a)) if a[i - 2] == a[i - 1] == a[i])  # inside a run: the prompt ends in it
    eos = a[k]
    assert eos not in b
    run = next(i for i in range(2, len(b)) if b[i - 2] == b[i - 1] == b[i])  # b's first run of one token
    stop_text = stack["tok"].decode(b[run - 2:run + 1])
    reqs = [dict(prompt=base[1] + a[:k], max_tokens=40),  # its first token is the EOS, drafted by lookup
            dict(prompt=base[2], max_tokens=run + 2),  # max_tokens inside the run
            dict(prompt=base[2], max_tokens=40, stop=(stop_text,))]
    answers = {}
    for kind in ("none", "lookup"):
        e = engine(stack, target=(dataclasses.replace(cfg, eos_token_ids=(eos,)), params), speculative=kind,
                   **({"draft_policy": "always"} if kind != "none" else {}))
        try:
            answers[kind] = events(e, reqs)
            settled(e)
            if kind == "lookup":  # rounds emitted more tokens than the requests took: the rest was dropped
                emitted = sum(metric(e, f'kvjax_acceptance_length_sum{{drafter="{d}"}}') for d in ("lookup", "none"))
                assert emitted > sum(len(x["ids"]) for x in answers[kind])
                assert max(max(x["chunks"]) for x in answers[kind]) > 1  # tokens arrived several to an event
        finally:
            e.stop()
    for x, y in zip(answers["none"], answers["lookup"]):
        assert (x["ids"], x["text"], x["reason"]) == (y["ids"], y["text"], y["reason"])
    at_eos, length, stop = answers["lookup"]
    assert at_eos["ids"] == [eos] and at_eos["reason"] == "stop"
    assert length["ids"] == b[:run + 2] and length["reason"] == "length"
    assert stop["reason"] == "stop" and stop_text not in stop["text"] and stop["ids"] == b[:run + 1]


def test_drafter_state_follows_the_request_through_plain_steps_and_rounds(stack, monkeypatch):
    """With steps alternating between plain steps and rounds, each slot's lookup context is its request's tokens
    exactly (plain_step's `advance` and a round's commit agree), and the block drafter's context grew by one entry
    per emitted token; answers stay the offline ones."""
    from kvjax.serve.drafting import Drafting
    calls = iter(range(10 ** 6))
    monkeypatch.setattr(Drafting, "choose", lambda self, rows, active, temp: self.widths[-1] * (next(calls) % 2))
    prompts = repeating(stack)[:4]
    want = [offline(stack, p, 20) for p in prompts]
    for kind in ("combined",):
        e = engine(stack, speculative=kind)
        try:
            got, _ = serve(e, prompts, 20)
            settled(e)
            assert got == want
            state = e.slots.drafting.state
            assert metric(e, 'kvjax_decode_steps_total{kind="plain"}') > 0
            assert metric(e, 'kvjax_decode_steps_total{kind="draft"}') > 0
            hist, length = np.asarray(state.lookup.history), np.asarray(state.lookup.length)
            ctx = np.asarray(state.model.cache.lengths)
            for slot in range(4):  # which request ended in which slot: the one whose tokens are there
                n = int(length[slot])
                match = [i for i, (p, a) in enumerate(zip(prompts, got))
                         if n >= len(p) + len(a) - 1 and [int(t) for t in hist[slot, :len(p) + len(a) - 1]] == (p + a)[:-1]]
                assert match, f"slot {slot}'s lookup context is no request's tokens"
                i = match[0]
                w = min(e.config.draft_context, len(prompts[i]) - 1)
                assert int(ctx[slot]) == w + n - (len(prompts[i]) - 1)  # one feature per token read after the prompt
        finally:
            e.stop()


def _chi2_pvalue(counts, probs):
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.r_[counts[big], counts[~big].sum()]
    exp = np.r_[expected[big], expected[~big].sum()]
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(jax.scipy.special.gammaincc((len(obs) - 1) / 2, stat / 2))


def test_sampled_rows_follow_the_targets_distribution():
    """Rows of one round with their own temperature, top_p and seed (a greedy row among them): lookup drafts 7, 1
    after "... 9 3"; each sampled row's first token is distributed as the target's sampling at its settings, and its
    second, after an accepted 7, as the target's given 7 (the accepted draft 1 or the corrected token); the greedy
    row takes the greedy token. 4 x 512 rows of one prompt, one round each (kvjax.serve.programs.round_step)."""
    from kvjax.builders import NativePrefill
    from kvjax.generation.sampling import Sampling, sampling_probs
    from kvjax.models.decoder import forward
    from kvjax.serve.drafting import Drafting
    from kvjax.serve.metrics import Metrics
    cfg, params = tiny(2, 32, 2, 1, 0, 1e4, 12)
    rows = 512
    d = Drafting((cfg, params), EngineConfig(slots=rows, capacity=64, speculative="lookup", draft_len=2),
                 jax.devices()[0], Metrics())
    prompt = [3, 7, 1, 9, 3, 7, 1, 9, 3]
    batch = programs.prefill_batch(NativePrefill((cfg, params)), [prompt] * rows, 64, rows)
    settings = [Sampling(0.9, 0.95), Sampling(1.5, 1.0)]
    temp = np.array([settings[i % 2].temperature for i in range(rows)], np.float32)
    top_p = np.array([settings[i % 2].top_p for i in range(rows)], np.float32)
    temp[7] = 0.0
    out = []
    for seed in range(4):
        cache = programs.insert(programs.empty_slots(cfg, rows, 64, jnp.float32), batch,
                                jnp.arange(rows, dtype=jnp.int32))
        d.reset()
        d.insert([(i, i, prompt) for i in range(rows)], batch)
        _, toks, n_new, drafted = d.step(d.widths[-1], cache, np.full(rows, prompt[-1], np.int32),
                                         np.ones(rows, bool), temp, top_p, np.arange(rows, dtype=np.int32) + 1000 * seed,
                                         np.zeros(rows, np.int32), rows=rows, sampled=True)
        assert (drafted == 2).all() and n_new.min() >= 1
        out.append(np.stack([toks[:, 0], np.where(n_new >= 2, toks[:, 1], -1)], 1))
    out = np.concatenate(out)  # [4 * rows, 2]: each round's first token, its second (-1: it emitted one)
    which = np.tile(np.arange(rows), 4)

    def dist(s, toks):
        logits = forward(params, cfg, jnp.asarray([toks])).logits[0, -1]
        return np.asarray(sampling_probs(logits, s), np.float64)

    greedy = int(np.argmax(forward(params, cfg, jnp.asarray([prompt])).logits[0, -1]))
    assert (out[which == 7, 0] == greedy).all()
    for k, s in enumerate(settings):
        mine = out[(which % 2 == k) & (which != 7)]
        counts = np.bincount(mine[:, 0], minlength=12)  # the accepted draft 7, or the corrected token
        assert 0 < counts[7] < len(mine)
        assert _chi2_pvalue(counts, dist(s, prompt)) > 1e-3
        second = np.bincount(mine[mine[:, 0] == 7, 1], minlength=12)  # after an accepted 7: in the same round
        assert _chi2_pvalue(second, dist(s, prompt + [7])) > 1e-3
    # the two settings' distributions differ, and each matched its own: rows used their own temperature / top_p
    assert _chi2_pvalue(np.bincount(out[(which % 2 == 1) & (which != 7), 0], minlength=12),
                        dist(settings[0], prompt)) < 1e-3


def test_the_choice_follows_measured_costs_and_yields():
    """DraftPolicy: plain steps are measured first and run where no row would draft; then the width with the most
    predicted tokens per second runs (each row's look-ahead draft, the measured acceptance of its source, the
    measured cost of each width), so drafting turns off for drafts that are not accepted and for a batch where a
    round costs more than it emits; a width not chosen runs again once its gap has passed; "always" drafts every
    step at the narrowest width that holds the longest draft (sampled rows: the widest)."""
    widths, greedy = (1, 2, 3, 5), [False] * 3
    p = DraftPolicy("auto", widths, sources=3, draft_len=4)
    copies, model = ([4] * 3, [2] * 3), ([4] * 3, [0] * 3)  # three rows' drafts: (lengths, sources)
    for _ in range(DraftPolicy.MIN_SAMPLES):
        assert p.choose(4, False, *copies, greedy) == 0  # the plain step not measured yet
        p.observe(0, 4, False, 1.0)
    assert p.choose(4, False, [0] * 3, [0] * 3, greedy) == 0  # nothing to draft
    for w, c in ((2, 1.2), (3, 1.4), (5, 1.8)):
        for _ in range(DraftPolicy.MIN_SAMPLES):
            p.observe(w, 4, False, c)
    for _ in range(200):  # lookup's copies (source 2) are accepted, the model drafter's (source 0) are not
        p.rounds([4, 4], [2, 0], [False, False], [4, 0])
    assert p.acceptance()[2, 0, 1:].min() > 0.97 and p.acceptance()[0, 0, 1] < 0.02
    assert p.choose(4, False, *copies, greedy) == 5
    assert math.isclose(p.predicted, p.expected(5, *copies, greedy) / 1.8 / (3 / 1.0))
    assert 14.5 < p.expected(5, *copies, greedy) < 15  # 3 rows x (4 accepted + the target's own token)
    assert p.choose(4, False, [2, 1, 0], [2, 2, 0], greedy) == 3  # no round wider than the longest draft
    assert p.choose(4, False, *model, greedy) == 0
    # 64 rows whose copies are all accepted, a round at the full width costing 6 plain steps: not worth it (the
    # unmeasured widths priced by the measured slope: 1 + 1.25 (w - 1) plain steps)
    rows64 = ([4] * 64, [2] * 64)
    for w, c in ((0, 1.0), (5, 6.0)):
        for _ in range(DraftPolicy.MIN_SAMPLES):
            p.observe(w, 64, False, c)
    assert math.isclose(p.cost(64, False, 2), 2.25)
    assert p.choose(64, False, *rows64, [False] * 64) == 0 and p.predicted < 1
    # the best other width (2) runs again once its gap has passed: what it loses is EXPLORE_LOSS of a step per step
    loss = 1 - p.expected(2, *rows64, [False] * 64) / 2.25 / 64
    gap = max(DraftPolicy.MIN_GAP, math.ceil(loss / DraftPolicy.EXPLORE_LOSS))
    steps = 2 * DraftPolicy.MIN_SAMPLES
    while p.choose(64, False, *rows64, [False] * 64) == 0:
        p.observe(0, 64, False, 1.0)
        steps += 1
    assert steps == gap and p.choose(64, False, *rows64, [False] * 64) == 2
    for _ in range(DraftPolicy.MIN_SAMPLES):  # a step with a sampled row is measured apart
        assert p.choose(4, True, *copies, [True, False, False]) == 0
        p.observe(0, 4, True, 1.0)
    assert p.choose(4, True, *copies, [True, False, False]) == 5  # a sampled row: the full width only
    always = DraftPolicy("always", widths, sources=3, draft_len=4)
    assert always.choose(4, False, [1, 2, 0], [1, 1, 0], greedy) == 3
    assert always.choose(4, True, [1, 2, 0], [1, 1, 0], greedy) == 5


def test_bad_settings_are_refused_before_serving(stack, tmp_path):
    def problems(**kw):
        return " ".join(EngineConfig(**kw).problems())
    assert "use one of none, lookup, block, combined" in problems(speculative="eagle")
    assert "--drafter DIR" in problems(speculative="block")
    assert "reads no drafter" in problems(speculative="lookup", drafter=stack["drafter"])
    assert "drop them" in problems(draft_len=4)
    assert "draft_len must be >= 1" in problems(speculative="lookup", draft_len=-2)
    assert "leaves no room" in problems(speculative="lookup", draft_len=200, capacity=128)
    assert "1 <= MIN <= MAX" in problems(speculative="lookup", lookup_ngram=(3, 1))
    assert "min_match" in problems(speculative="combined", drafter="x", min_match=5)
    assert "draft_policy" in problems(speculative="lookup", draft_policy="sometimes")
    assert not problems(speculative="lookup") and not problems(speculative="combined", drafter="x")
    from kvjax.serve.cli import ServeError, parse
    for argv, says in ((["--speculative", "block"], "--drafter DIR"),
                       (["--speculative", "block", "--drafter", str(tmp_path)], "not a block drafter directory"),
                       (["--speculative", "block", "--drafter", stack["drafter"], "--draft-len", "5"],
                        "trained for blocks of [4, 8]"),
                       (["--speculative", "lookup", "--lookup-ngram", "x"], "give MIN:MAX"),
                       (["--speculative", "medusa"], "invalid choice")):
        with pytest.raises(ServeError, match=".*".join(map(__import__("re").escape, says.split("*")))):
            parse(["--config=toy", "--map", str(tmp_path)] + argv)
    # a drafter trained for another model: refused when the engine loads it, naming both
    from kvjax.drafter import DrafterError
    with pytest.raises(DrafterError, match="trained for a target"):
        Engine(stack["source"], stack["source"], stack["kvmap"], stack["tok"], split=False,
               config=EngineConfig(slots=2, capacity=CAPACITY, speculative="block", drafter=stack["drafter"],
                                   draft_len=4))

"""The server's plan holds every program the server calls: an engine with the settings `python -m kvjax.plan --serve`
compiles (the prefix cache on; plain, and speculating with prompt lookup) serves concurrent requests, fresh and after
a cached prefix, greedy and sampled, under kvjax.aot.recording(), and the server plan of the same models and settings
names exactly the programs it called."""

import os
import threading

import jax
import numpy as np
import pytest

import kvjax
from kvjax import aot
from kvjax.config_flags import build
from kvjax.run.config import RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "checkpoints", "toy", "tokenizer")
SLOTS, CONTEXT = 4, 128
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan_serve")
    vocab = kvjax.load_tokenizer(TOKENIZER).get_vocab_size()

    def make(name, hidden, layers, heads, kv, seed):
        cfg = kvjax.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                num_layers=layers, num_heads=heads, num_kv_heads=kv, head_dim=16, rope_theta=1e4,
                                tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
        path = str(root / name)
        kvjax.save_hf(path, cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1), tokenizer_dir=TOKENIZER)
        return path

    return make("source", 64, 3, 4, 2, 0), make("target", 32, 2, 2, 1, 1), vocab


def serve(source_path, target_path, vocab, engine_cfg, phases) -> set[str]:
    """The programs an engine calls while it warms nothing up and answers `phases`: lists of (prompt, temperature)
    served concurrently, one list after the other."""
    from kvjax.serve import Engine
    from kvjax.serve.config import Request
    source, target = kvjax.load_hf(source_path), kvjax.load_hf(target_path)
    windows = lambda n, seed: np.random.RandomState(seed).randint(1, vocab, (n, 48)).astype(np.int32)  # noqa: E731
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 0), windows(8, 1), batch_size=8, residual_rank=4)
    with aot.recording() as rec:
        engine = Engine(tuple(source), tuple(target), kvmap, kvjax.load_tokenizer(TOKENIZER), engine_cfg).start()
        try:
            for phase in phases:
                done = [threading.Event() for _ in phase]
                for (p, temperature), ev in zip(phase, done):
                    engine.submit(Request(prompt=p, max_tokens=MAX_TOKENS, temperature=temperature, seed=1,
                                          sink=lambda e, ev=ev: e.kind != "token" and ev.set()))
                assert all(ev.wait(300) for ev in done)
        finally:
            engine.stop()
    return rec.names


def prompts(vocab):
    """3 concurrent prompts, then 2 that reuse the first's prefix (read in pieces after the cached blocks). Each
    first prompt repeats a phrase (so prompt lookup drafts and rounds run); one of the second is sampled."""
    rng = np.random.RandomState(3)
    first = [[int(t) for t in np.tile(rng.randint(1, vocab, k), n // k + 1)[:n]] for n, k in ((90, 15), (40, 8),
                                                                                               (17, 5))]
    again = [first[0][:80] + [int(t) for t in rng.randint(1, vocab, 10)], first[0][:70] + [5, 6, 7]]
    return [[(p, 0.0) for p in first], [(again[0], 0.0), (again[1], 0.8)]]


def plan(source, target, **drafting) -> set[str]:
    from kvjax.plan.serve import plan_serve
    cfg = build("qwen32_8", [("source.path", source), ("target.path", target), ("source.dtype", "float32"),
                             ("target.dtype", "float32")], RunConfig)
    p = plan_serve(cfg, "cpu:1", slots=SLOTS, context=CONTEXT, compile=False, **drafting)
    return {c.program.program for s in p.stages for c in s.programs}


@pytest.mark.parametrize("drafting", [{}, {"speculative": "lookup", "draft_len": 4}], ids=["plain", "lookup"])
def test_the_server_plan_names_every_program_the_server_calls(pair, drafting):
    from kvjax.plan.serve import engine_config
    source, target, vocab = pair
    planned = plan(source, target, **drafting)
    called = serve(source, target, vocab, engine_config(SLOTS, CONTEXT, **drafting), prompts(vocab))
    assert called == planned, (sorted(called - planned), sorted(planned - called))
    if drafting:  # the rounds ran: the comparison covers the speculating server's own programs
        assert {"kvjax.serve.programs.round_step", "kvjax.serve.programs.plain_step"} <= called

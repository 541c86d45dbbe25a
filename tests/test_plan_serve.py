"""The server's plan holds every program the server calls: an engine with the settings `python -m kvjax.plan --serve`
compiles (the prefix cache on) serves concurrent requests, fresh and after a cached prefix, under
kvjax.aot.recording(), and the server plan of the same models and settings names exactly the programs it called."""

import os
import threading

import jax
import numpy as np
import pytest

import kvjax
from kvjax import aot
from kvjax.config_flags import build
from kvjax.run_config import RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "checkpoints", "toy", "tokenizer")
SLOTS, CONTEXT = 4, 128


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


def serve(source_path, target_path, vocab, engine_cfg) -> set[str]:
    """The programs an engine calls while it warms nothing up and answers: 3 concurrent prompts, then 2 that reuse
    the first's prefix (read in pieces after the cached blocks)."""
    from kvjax.serve import Engine
    from kvjax.serve.config import Request
    source, target = kvjax.load_hf(source_path), kvjax.load_hf(target_path)
    windows = lambda n, seed: np.random.RandomState(seed).randint(1, vocab, (n, 48)).astype(np.int32)  # noqa: E731
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 0), windows(8, 1), batch_size=8, residual_rank=4)
    rng = np.random.RandomState(3)
    first = [[int(t) for t in rng.randint(1, vocab, n)] for n in (90, 40, 17)]
    again = [first[0][:80] + [int(t) for t in rng.randint(1, vocab, 10)], first[0][:70] + [5, 6, 7]]
    with aot.recording() as rec:
        engine = Engine(tuple(source), tuple(target), kvmap, kvjax.load_tokenizer(TOKENIZER), engine_cfg).start()
        try:
            for prompts in (first, again):
                done = [threading.Event() for _ in prompts]
                for p, ev in zip(prompts, done):
                    engine.submit(Request(prompt=p, max_tokens=8, sink=lambda e, ev=ev: e.kind != "token" and ev.set()))
                assert all(ev.wait(300) for ev in done)
        finally:
            engine.stop()
    return rec.names


def test_the_server_plan_names_every_program_the_server_calls(pair, monkeypatch):
    from kvjax.plan.serve import engine_config, plan_serve
    source, target, vocab = pair
    cfg = build("qwen32_8", [("source.path", source), ("target.path", target), ("source.dtype", "float32"),
                             ("target.dtype", "float32")], RunConfig)
    plan = plan_serve(cfg, "cpu:1", slots=SLOTS, context=CONTEXT, compile=False)
    planned = {c.program.program for s in plan.stages for c in s.programs}
    called = serve(source, target, vocab, engine_config(SLOTS, CONTEXT))
    assert called == planned, (sorted(called - planned), sorted(planned - called))

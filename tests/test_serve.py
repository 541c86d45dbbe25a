"""kvjax.serve: the OpenAI-compatible server. Tiny random source/target models (with the toy tokenizer's vocabulary) and
a map fitted on random windows, served in-process by uvicorn on a free localhost port; the official `openai` client and
raw httpx talk to it. Every greedy answer is compared token for token with offline `kvjax.split_generate` on the same
prompt; each fault the server must survive is a test after which the next request succeeds."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import numpy as np
import pytest

import kvjax
from kvjax.serve import Engine, EngineConfig
from kvjax.serve.app import Server
from kvjax.serve.chat import load_chat_template
from kvjax.serve.faults import Delay, Faults, InjectedFault, WorkerKilled
from kvjax.serve.text import TextStream

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "checkpoints", "toy", "tokenizer")
MODEL = "tiny"
CAPACITY = 128  # small: prefill buckets 64 and 128 only, so the whole file compiles a handful of programs
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tiny(layers, hidden, heads, kv_heads, seed, theta, vocab):
    cfg = kvjax.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                            num_heads=heads, num_kv_heads=kv_heads, head_dim=16, rope_theta=theta,
                            tie_word_embeddings=True, eos_token_ids=(0,), pad_token_id=0)
    return cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1)


def tiny_pair(vocab):
    """The serving tests' tiny source and target, and a map fitted on random windows."""
    source = tiny(3, 64, 4, 2, 0, 1e4, vocab)
    target = tiny(2, 32, 2, 1, 1, 5e3, vocab)
    windows = lambda n, seed: np.random.RandomState(seed).randint(1, vocab, (n, 48)).astype(np.int32)  # noqa: E731
    kvmap, _ = kvjax.fit_map(source, target, windows(16, 0), windows(8, 1), batch_size=8, residual_rank=4)
    return source, target, kvmap


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tok = kvjax.load_tokenizer(TOKENIZER)
    source, target, kvmap = tiny_pair(tok.get_vocab_size())
    chat_dir = tmp_path_factory.mktemp("chat")
    with open(chat_dir / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}, f)
    return dict(source=source, target=target, kvmap=kvmap, tok=tok, chat=load_chat_template(str(chat_dir)),
                offline={})


def offline(stack, prompt, n):
    """Offline greedy split_generate, cut after the first EOS (the server stops there); memoized per prompt."""
    key = (tuple(prompt), n)
    if key not in stack["offline"]:
        stack["offline"][key] = _offline(stack, prompt, n)
    return stack["offline"][key]


def _offline(stack, prompt, n):
    out = [int(t) for t in np.asarray(kvjax.split_generate(stack["source"], stack["target"], stack["kvmap"],
                                                           [list(prompt)], n))[0]]
    return out[: out.index(0) + 1] if 0 in out else out


def prompt_ids(stack, n, seed):
    return [int(t) for t in np.random.RandomState(seed).randint(1, stack["tok"].get_vocab_size(), n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Uvicorn:
    """A server's ASGI app (`server.app()`) on a free localhost port, in a thread of this process; the engine and the
    server are always stopped on exit. Subclasses build `self.engine` and call `_serve(server)`."""

    def _serve(self, server) -> None:
        import uvicorn
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(server.app(), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uv.started:
            assert time.time() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.uv.should_exit = True
        self.thread.join(10)
        self.engine.stop()


class Running(Uvicorn):
    """An engine served by uvicorn on a free localhost port, in this process; always stopped on exit."""

    def __init__(self, stack, chat=True, fault_injection=False, mesh=None, **config):
        config = dict(dict(slots=4, capacity=CAPACITY, max_prefill_batch=4, max_tokens_limit=100), **config)
        devices = jax.devices()[:2] if config.get("topology") == "disaggregated" else None
        self.faults = Faults()
        self.engine = Engine(stack["source"], stack["target"], stack["kvmap"], stack["tok"], EngineConfig(**config),
                             faults=self.faults, devices=devices, mesh=mesh).start()
        self._serve(Server(self.engine, MODEL, stack["chat"] if chat else None, fault_injection))

    def post(self, path, body, **kw):
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=kw.pop("timeout", 60), **kw)

    def metric(self, name) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_metric(self, name, value, seconds=30):
        deadline = time.time() + seconds
        while self.metric(name) != value:
            assert time.time() < deadline, f"{name} stayed at {self.metric(name)}, expected {value}"
            time.sleep(0.05)


def complete(server, prompt, n, **kw):
    r = server.post("/v1/completions", dict(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw))
    assert r.status_code == 200, r.text
    return r.json()


def test_openai_client_completions_streaming_and_chat_match_offline(stack):
    from openai import OpenAI
    prompts = [prompt_ids(stack, n, seed) for seed, n in enumerate((20, 33, 47, 20, 47, 33))]
    want = [offline(stack, p, 12) for p in prompts]
    with Running(stack) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]
        got = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=12, temperature=0)
        assert got.choices[0].token_ids == want[0]
        assert got.choices[0].text == stack["tok"].decode(want[0], skip_special_tokens=True)
        assert got.kvjax["path"] == "split" and got.usage.completion_tokens == len(want[0])
        # streaming: the same tokens and text, chunk by chunk
        chunks = list(client.completions.create(model=MODEL, prompt=prompts[1], max_tokens=12, temperature=0,
                                                stream=True))
        assert sum((c.choices[0].token_ids for c in chunks if c.choices), []) == want[1]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == stack["tok"].decode(
            want[1], skip_special_tokens=True)
        # several at once: requests join and leave the batch between steps (4 slots, 6 requests); each answer is
        # what the prompt gets alone offline
        results = [None] * len(prompts)

        def one(i):
            results[i] = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12,
                                                   temperature=0).choices[0].token_ids
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        assert results == want
        # text prompt: tokenized by the server as offline
        text = "def handler(request):\n    return"
        got = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0)
        assert got.choices[0].token_ids == offline(stack, stack["tok"].encode(text).ids, 8)
        # chat through the template
        messages = [{"role": "user", "content": "print the numbers"}]
        got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        ids = stack["tok"].encode(stack["chat"].render(messages)).ids
        assert got.choices[0].token_ids == offline(stack, ids, 8)
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == got.choices[0].message.content
        # sampling is per request: the same seed gives the same tokens whatever else runs
        a, b = (client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=10, temperature=0.9, seed=7)
                for _ in range(2))
        assert a.choices[0].token_ids == b.choices[0].token_ids
        srv.wait_metric("kvjax_active_slots", 0)
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"


def test_bad_requests_are_4xx_json_errors_and_the_next_request_succeeds(stack):
    p = prompt_ids(stack, 20, 0)
    good = dict(model=MODEL, prompt=p, max_tokens=4, temperature=0)
    cases = [
        (b'{"model": "tiny", "prompt": [1, 2', 400, "not valid JSON"),
        (dict(good, colour="blue"), 400, "unknown field"),
        (dict(good, prompt=""), 400, "empty"),
        (dict(good, prompt=[]), 400, "must not be empty"),
        (dict(good, prompt=[5]), 400, "at least 2"),
        (dict(good, prompt=prompt_ids(stack, CAPACITY, 1)), 400, "capacity"),
        (dict(good, max_tokens=0), 400, "max_tokens"),
        (dict(good, max_tokens=-3), 400, "max_tokens"),
        (dict(good, max_tokens=10_000), 400, "max_tokens"),
        (dict(good, max_tokens=90, prompt=prompt_ids(stack, 60, 2)), 400, "capacity"),
        ('{"model": "tiny", "prompt": "caf\xe9"}'.encode("latin-1"), 400, "UTF-8"),
        (dict(good, model="gpt-4"), 404, "does not exist"),
        (dict(good, prompt=[1, 10 ** 6]), 400, "vocabulary"),
        (dict(good, temperature="hot"), 400, "temperature"),
        (dict(good, n=3), 400, "not supported"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"model": "tiny", "prompt": [1, 2], "temperature": NaN}', 400, "not JSON"),  # Python's json reads NaN
        (b'{"model": "tiny", "prompt": [1, 2], "top_p": 1e999}', 400, "finite"),  # and 1e999 as infinity
    ]
    with Running(stack) as srv:
        for body, status, words in cases:
            r = srv.post("/v1/completions", body)
            assert r.status_code == status, (body, r.text)
            assert words in r.json()["error"]["message"], (body, r.json())
        r = srv.post("/v1/chat/completions", dict(model=MODEL, messages="hi"))
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/v1/nothing").status_code == 404
        assert complete(srv, p, 4)["choices"][0]["token_ids"] == offline(stack, p, 4)
    with Running(stack, chat=False) as srv:  # a tokenizer without a chat template: a clear 400
        r = srv.post("/v1/chat/completions", dict(model=MODEL, messages=[{"role": "user", "content": "hi"}]))
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_a_failing_request_fails_alone(stack):
    good, bad = prompt_ids(stack, 33, 3), prompt_ids(stack, 33, 4)
    with Running(stack) as srv:
        for stage in ("step", "prefill"):
            # a request that fails every time it is tried: when both share a prefill batch, the engine retries each
            # alone after the batch fails (a one-shot fault would then pass on the retry, as a transient one should)
            srv.faults.add(stage, lambda: InjectedFault("boom"), when=lambda r: r.prompt == bad, times=-1)
            out = {}
            threads = [threading.Thread(target=lambda k, p: out.__setitem__(k, srv.post(
                "/v1/completions", dict(model=MODEL, prompt=p, max_tokens=6, temperature=0))), args=(k, p))
                for k, p in (("good", good), ("bad", bad))]
            [t.start() for t in threads]
            [t.join(60) for t in threads]
            srv.faults.clear()
            assert out["bad"].status_code == 500 and "boom" in out["bad"].json()["error"]["message"], stage
            assert out["good"].json()["choices"][0]["token_ids"] == offline(stack, good, 6), stage
            assert complete(srv, bad, 6)["choices"][0]["token_ids"] == offline(stack, bad, 6)  # the next succeeds
        srv.wait_metric("kvjax_active_slots", 0)


def test_queue_full_is_429_and_disconnect_frees_the_slot(stack):
    long = dict(model=MODEL, prompt=prompt_ids(stack, 20, 5), max_tokens=100, temperature=0, stream=True)
    with Running(stack, slots=1, max_queue=1) as srv:
        # a slow step (50 ms) while the long request decodes, so it surely holds its slot while we look
        srv.faults.add("step", lambda: Delay(0.05), when=lambda r: r.prompt == long["prompt"], times=-1)
        with httpx.stream("POST", srv.url + "/v1/completions", json=long, timeout=60) as first:
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it holds the only slot
            srv.wait_metric("kvjax_active_slots", 1)
            waiting = threading.Thread(target=lambda: srv.post("/v1/completions", dict(long, stream=False)))
            waiting.start()
            srv.wait_metric("kvjax_queue_depth", 1)  # the queue's one place is taken
            r = srv.post("/v1/completions", dict(long, stream=False))
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert "retry" in r.json()["error"]["message"]
        # the first client went away mid-stream: its slot goes to the waiting request, then everything drains
        waiting.join(60)
        srv.wait_metric("kvjax_active_slots", 0)
        assert 'outcome="cancelled"' in httpx.get(srv.url + "/metrics").text
        # a non-streaming client that gives up (client timeout) frees its slot too
        with pytest.raises(httpx.TimeoutException):  # (the 50 ms steps make it last 5 s)
            srv.post("/v1/completions", dict(long, stream=False, max_tokens=100), timeout=0.3)
        srv.wait_metric("kvjax_active_slots", 0)
        r = srv.post("/v1/completions", dict(long, stream=False, timeout=0.5))  # the request's own deadline
        assert r.status_code == 504 and "timed out" in r.json()["error"]["message"]
        p = prompt_ids(stack, 20, 6)
        assert complete(srv, p, 5)["choices"][0]["token_ids"] == offline(stack, p, 5)


def test_disaggregated_matches_offline_and_survives_a_killed_prefill_worker(stack):
    prompts = [prompt_ids(stack, n, 10 + n) for n in (20, 33, 47)]
    with Running(stack, topology="disaggregated", max_worker_restarts=1) as srv:
        stats = httpx.get(srv.url + "/health").json()
        assert stats["prefill_workers"][0]["device"] != str(srv.engine.decode_device)  # two pools, two devices
        for p in prompts:
            assert complete(srv, p, 10)["choices"][0]["token_ids"] == offline(stack, p, 10)
        # kill the worker in the middle of a prefill: the request in flight gets a clear error (no hang), the
        # worker is replaced, the next request succeeds
        srv.faults.add("worker", lambda: WorkerKilled("test"))
        r = srv.post("/v1/completions", dict(model=MODEL, prompt=prompts[0], max_tokens=5, temperature=0),
                     timeout=30)
        assert r.status_code == 503 and "prefill worker 0" in r.json()["error"]["message"]
        assert complete(srv, prompts[1], 10)["choices"][0]["token_ids"] == offline(stack, prompts[1], 10)
        assert httpx.get(srv.url + "/health").status_code == 200
        assert srv.metric("kvjax_prefill_worker_restarts_total") == 1
        # past max_worker_restarts the server says it is unhealthy and refuses work, still without hanging
        srv.faults.add("worker", lambda: WorkerKilled("test"))
        r = srv.post("/v1/completions", dict(model=MODEL, prompt=prompts[0], max_tokens=5, temperature=0),
                     timeout=30)
        assert r.status_code == 503
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "max_worker_restarts" in health.json()["reason"]
        r = srv.post("/v1/completions", dict(model=MODEL, prompt=prompts[0], max_tokens=5, temperature=0))
        assert r.status_code == 503 and "unhealthy" in r.json()["error"]["message"]


def test_serial_topology_serves_one_request_at_a_time(stack):
    prompts = [prompt_ids(stack, n, 20 + n) for n in (20, 47)]
    with Running(stack, topology="serial") as srv:
        assert srv.engine.config.slots == 1
        out = [None, None]
        threads = [threading.Thread(target=lambda i: out.__setitem__(i, complete(srv, prompts[i], 8)), args=(i,))
                   for i in range(2)]
        [t.start() for t in threads]
        [t.join(60) for t in threads]
        assert [o["choices"][0]["token_ids"] for o in out] == [offline(stack, p, 8) for p in prompts]


def test_text_stream_holds_back_a_possible_stop_string(stack):
    tok = stack["tok"]
    ids = tok.encode("alpha beta gamma delta").ids
    stream = TextStream(tok, stop=("gamma",))
    out, stopped = "", False
    for t in ids:
        delta, stopped = stream.push(t)
        out += delta
        if stopped:
            break
    assert stopped and out == "alpha beta " and "gam" not in out


def test_cli_without_a_map_names_the_command_to_run(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvjax.serve", "--config=toy",
                        f"--config.output_dir={tmp_path / 'none'}"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "python -m kvjax.launch --config=toy" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvjax.serve", "--config=toy", f"--map={tmp_path}"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a map directory" in r.stderr and "Traceback" not in r.stderr


def test_a_step_over_the_first_rows_equals_the_full_step():
    """programs.step(rows=b) computes slots [0, b) exactly as the all-slot step does and leaves the others' cache as
    it was (the engine's low-load step: it reads only the occupied rows)."""
    import jax.numpy as jnp

    from kvjax.serve import programs
    cfg, params = tiny(2, 32, 2, 1, 3, 1e4, 64)
    slots, capacity = 8, 64
    rng = np.random.RandomState(0)
    cache = kvjax.init_cache(cfg, slots, capacity)
    cache = cache.with_stacked(jnp.asarray(rng.randn(*cache.k.shape).astype(np.float32)),
                               jnp.asarray(rng.randn(*cache.v.shape).astype(np.float32)),
                               lengths=jnp.asarray([5, 17, 0, 40, 9, 30, 2, 11], jnp.int32))
    active = np.array([True, True, False, True, False, False, False, False])
    tokens = rng.randint(1, 64, slots).astype(np.int32)
    args = (active, np.zeros(slots, np.float32), np.ones(slots, np.float32), np.zeros(slots, np.int32),
            np.zeros(slots, np.int32))
    copy = lambda c: jax.tree.map(jnp.copy, c)  # noqa: E731 - step donates its cache
    full_out, full = programs.step(params, cfg, copy(cache), tokens, *args)
    part_out, part = programs.step(params, cfg, copy(cache), tokens, *args, rows=4)
    assert programs.row_buckets(slots) == (1, 2, 4, 8)
    np.testing.assert_array_equal(np.asarray(part_out)[active], np.asarray(full_out)[active])
    np.testing.assert_array_equal(np.asarray(part.lengths), np.asarray(full.lengths))
    for got, want, before in ((part.k, full.k, cache.k), (part.v, full.v, cache.v)):
        np.testing.assert_allclose(np.asarray(got)[:, :4], np.asarray(want)[:, :4], atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got)[:, 4:], np.asarray(before)[:, 4:])


def test_a_server_sharded_over_a_mesh_answers_as_offline(stack):
    """The batched server on a data 1 x model 2 mesh: weights, map and slots sharded by their logical axes (as the
    job and the server's plan shard them), and every greedy answer of concurrent requests identical to offline."""
    from jax.sharding import NamedSharding

    from kvjax.sharding import make_mesh
    mesh = make_mesh(1, 2, jax.devices()[:2])
    with Running(stack, mesh=mesh) as srv:
        engine = srv.engine
        specs = {str(leaf.sharding.spec) for leaf in jax.tree.leaves(engine.target[1])}
        assert any("model" in s for s in specs), specs  # the target's heads / FFN split over 'model'
        key = engine.slots.cache.keys[0]
        assert isinstance(key.sharding, NamedSharding) and key.sharding.mesh.size == 2
        prompts = [prompt_ids(stack, n, seed) for n, seed in ((9, 31), (23, 32), (40, 33))]
        results = [None] * len(prompts)

        def ask(i):
            results[i] = complete(srv, prompts[i], 12)["choices"][0]["token_ids"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for p, got in zip(prompts, results):
            assert got == offline(stack, p, 12)
    with pytest.raises(ValueError, match="topology=batched"):
        Engine(stack["source"], stack["target"], stack["kvmap"], stack["tok"],
               EngineConfig(topology="disaggregated", slots=2, capacity=CAPACITY), mesh=mesh)


def test_a_server_its_devices_cannot_hold_is_refused_before_loading(hf_checkpoints):
    """The server's fit check: weights (sharded as the mesh places them) + slots + a prefill batch against
    --config.mesh.device_memory_gb, one message naming what to change; a mesh halves what each device holds."""
    from kvjax.config_flags import build
    from kvjax.run.config import RunConfig
    from kvjax.serve.cli import ServeError, check_fits
    from kvjax.serve.placement import Placement, held
    from kvjax.sharding import make_mesh
    path = hf_checkpoints["gqa2_untied_odd"][0]
    models = [("source.path", path), ("target.path", path)]
    small = build("toy", [*models, ("mesh.device_memory_gb", "0.001")], RunConfig)
    with pytest.raises(ServeError, match=r"64 slots x 1024 tokens need at least .* GB per device .*fewer --slots"):
        check_fits(small, EngineConfig(slots=64, capacity=1024), None)
    check_fits(build("toy", [*models, ("mesh.device_memory_gb", "1")], RunConfig), EngineConfig(slots=4,
               capacity=1024), None)
    cfg = kvjax.load_hf_config(path)
    one = held(Placement(jax.devices()[0]), {"target": (cfg, np.dtype("float32"))}, 8, 256, 2)
    two = held(Placement(make_mesh(1, 2, jax.devices()[:2])), {"target": (cfg, np.dtype("float32"))},
               8, 256, 2)
    assert 2 * two["slots' cache"] == one["slots' cache"] + 8 * 4  # kv heads split over 'model'; lengths not
    assert two["target weights"] < one["target weights"]

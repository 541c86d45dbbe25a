"""kvjax.serve with audio input: `python -m kvjax.serve --config=toy_audio` answers OpenAI-style
`input_audio` chat parts through the source's audio adapter and the run's audio map.

The server is built as the command builds it (kvjax.serve.cli.parse + build_server with --config=toy_audio) on a run
directory made here: the shipped toy source and pruned target, a tiny random audio adapter (2 s encoder window), a
text map (kvjax.fit_map on windows of stdlib source, which the toy models were trained on) and a distinct audio map
(the same with perturbed biases), a passing gate.json; and a tiny random adapter of the answerer's own with a failing
gate.json beside (--gate), for the native audio path. It is
served in-process by uvicorn on a free localhost port; the official `openai` client talks to it. Every greedy answer is
compared token for token with offline `generate_from` on the same audio; bad audio is a 4xx naming the fix."""

import argparse
import base64
import dataclasses
import inspect
import io
import json
import logging
import os
import threading
import wave

import httpx
import jax
import numpy as np
import pytest

import kvjax
from kvjax.builders import Mapped
from kvjax.builders.audio_prefill import AudioPrefill
from kvjax.generation import generate_from
from kvjax.models.audio_lm import ProjectorConfig, audio_token_count, init_projector, log_mel
from kvjax.hf.ultravox import load_ultravox, save_ultravox
from kvjax.models.model import Model
from kvjax.models.whisper import WhisperEncoderConfig, init_encoder
from test_serve import Uvicorn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "toy_audio"
PLACEHOLDER = 100  # the toy's audio placeholder id (launch/toy/speech_train.py AUDIO_TOKEN)
STACK = 4
WINDOW_S = 2.0  # max_source_positions 100: 200 mel frames


def wav_bytes(samples: np.ndarray, rate: int = 16_000, channels: int = 1, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(np.asarray(samples).tobytes())
    return buf.getvalue()


def speech(seconds: float, seed: int) -> np.ndarray:
    """A synthetic 'utterance': a few tones gliding in pitch, under noise; int16 at 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * 16_000)) / 16_000
    x = sum(0.2 * np.sin(2 * np.pi * (f0 + 80 * t) * t) for f0 in rng.uniform(150, 900, 3))
    x = x * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.05 * rng.standard_normal(t.size)
    return (np.clip(x, -1, 1) * 32000).astype(np.int16)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def audio_part(raw: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(raw), "format": fmt}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run directory and adapter the server reads, and the models and maps for the offline references."""
    from kvjax.eval.gate import GateResult, save_gate
    from kvjax.mapper.artifact import save_map
    old = os.getcwd()
    os.chdir(REPO)  # the config's checkpoints are relative to the repository
    try:
        tmp = tmp_path_factory.mktemp("toy_audio")
        source = kvjax.load_hf("checkpoints/toy/source")
        target = kvjax.load_hf("checkpoints/toy/pruned")
        ecfg = WhisperEncoderConfig(num_mel_bins=80, d_model=32, num_layers=1, num_heads=2, ffn_dim=64,
                                    max_source_positions=100)
        adapter = str(tmp / "adapter")
        save_ultravox(adapter, init_encoder(ecfg, jax.random.key(3), std=0.2),
                      init_projector(ProjectorConfig(32, source.cfg.hidden_size, hidden_size=64, stack_factor=STACK,
                                                     ln_mid=True), jax.random.key(4)),
                      text_model_id="checkpoints/toy/source", audio_token_index=PLACEHOLDER,
                      vocab_size=source.cfg.vocab_size)
        target_adapter = str(tmp / "target_adapter")  # the answerer's own: same stacking and window
        save_ultravox(target_adapter, init_encoder(ecfg, jax.random.key(5), std=0.2),
                      init_projector(ProjectorConfig(32, target.cfg.hidden_size, hidden_size=64, stack_factor=STACK,
                                                     ln_mid=True), jax.random.key(6)),
                      text_model_id="checkpoints/toy/pruned", audio_token_index=PLACEHOLDER,
                      vocab_size=target.cfg.vocab_size)
        tok = kvjax.load_tokenizer("checkpoints/toy/pruned")
        ids = np.concatenate([tok.encode(open(m.__file__).read()).ids for m in (json, argparse, inspect)])
        windows = ids[:40 * 64].astype(np.int32).reshape(40, 64)
        text_map, _ = kvjax.fit_map(source, target, windows[:32], windows[32:], batch_size=8, residual_rank=4)
        rng = np.random.default_rng(0)

        def nudge(layer):
            return layer.replace(bias=layer.bias + 0.6 * rng.standard_normal(layer.bias.shape).astype(np.float32))
        audio_map = text_map.replace(keys=tuple(map(nudge, text_map.keys)), values=tuple(map(nudge, text_map.values)))
        out = tmp / "run"
        save_map(str(out / "map"), text_map)
        save_map(str(out / "eval" / "audio" / "audio_map"), audio_map)
        save_gate(str(out / "gate.json"), GateResult(True, "residual", (), {}))
        failed = str(tmp / "failed" / "gate.json")
        os.makedirs(os.path.dirname(failed))
        save_gate(failed, GateResult(False, "residual", (), {}))
        alm = load_ultravox(adapter, lm=Model(source.cfg, source.params))
        target_alm = load_ultravox(target_adapter, lm=Model(target.cfg, target.params))
        yield dict(dir=str(out), adapter=adapter, source=tuple(source), target=tuple(target), text_map=text_map,
                   audio_map=audio_map, alm=alm, tok=tok, target_adapter=target_adapter, target_alm=target_alm,
                   failed_gate=failed, ecfg=ecfg)
    finally:
        os.chdir(old)


def argv(run, *extra):
    return ["--config=toy_audio", f"--config.output_dir={run['dir']}",
            f"--config.eval.audio.source_adapter={run['adapter']}", "--slots=4", "--capacity=128",
            "--max-prefill-batch=4", "--max-tokens=64", *extra]


class Serving(Uvicorn):
    """`python -m kvjax.serve --config=toy_audio ...` as its main() builds it, served by uvicorn on a free localhost
    port in this process; always stopped on exit."""

    def __init__(self, run, *extra):
        from kvjax.serve import cli
        old = os.getcwd()
        os.chdir(REPO)
        try:
            cfg, args, engine_cfg, map_dir, gate = cli.parse(argv(run, *extra))
            self.engine, server = cli.build_server(cfg, args, engine_cfg, map_dir, gate)
        finally:
            os.chdir(old)
        self._serve(server)

    def chat(self, content, **kw):
        body = dict(dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0),
                    **kw)
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)


def spoken_prompt(run, clips, text=""):
    """[EOS][each clip's audio positions][\\n][text]: the toy template kvjax.serve.audio builds."""
    tok = run["tok"]
    ids = [0]
    for f in clips:
        ids += [PLACEHOLDER] * int(audio_token_count(f.shape[1], STACK))
    return ids + tok.encode("\n", add_special_tokens=False).ids + (
        tok.encode(text, add_special_tokens=False).ids if text else [])


def features(samples_list):
    """Each clip's log-mel features as the offline path computes them (one clip at a time)."""
    out = []
    for s in samples_list:
        f, n = log_mel([s.astype(np.float32) / 32768.0], 80)
        out.append(f[0, :, :n[0]])
    return out


def offline_spoken(run, samples_list, text, n, kvmap=None, own=False):
    """Offline greedy decoding of the same audio: the source's adapter listens (all clips in one set_audio call), the
    audio map, the target answers (`own`: the answerer's own adapter listens and it answers from its own cache, the
    native audio path); cut after the first EOS (the server stops there)."""
    clips = features(samples_list)
    prompt = spoken_prompt(run, clips, text)
    f = np.zeros((len(clips), 80, max(c.shape[1] for c in clips)), np.float32)
    for i, c in enumerate(clips):
        f[i, :, :c.shape[1]] = c
    frames = np.asarray([c.shape[1] for c in clips], np.int32)
    if own:
        builder = AudioPrefill(run["target_alm"]).set_audio(f, frames)
    else:
        builder = Mapped(run["source"], run["target"], kvmap if kvmap is not None else run["audio_map"],
                         shared=AudioPrefill(run["alm"]).set_audio(f, frames))
    out = [int(t) for t in np.asarray(generate_from(builder, [prompt], n, eos_token_ids=()))[0]]
    return out[: out.index(0) + 1] if 0 in out else out


def offline_text(run, prompt, n):
    out = [int(t) for t in np.asarray(kvjax.split_generate(run["source"], run["target"], run["text_map"],
                                                           [list(prompt)], n))[0]]
    return out[: out.index(0) + 1] if 0 in out else out


def concurrent_mix(srv, client, a, b, text, text_prompt, want):
    """Three spoken requests and a text one at once: the spoken ones share a prefill batch (the first prefill is held
    back a moment so the others queue behind it; their clips in row order), the text one prefills apart; each answer
    is what it gets alone offline (`want`: a, b, ab, text)."""
    from kvjax.serve.faults import Delay
    results, spoken_batches = {}, []
    build = srv.engine._audio_builder

    def recorded(reqs, device):
        spoken_batches.append(len(reqs))
        return build(reqs, device)
    srv.engine._audio_builder = recorded
    srv.engine.faults.add("prefill", lambda: Delay(1.5), times=1)

    def spoken(key, parts, n):
        results[key] = client.chat.completions.create(
            model=MODEL, max_tokens=n, temperature=0,
            messages=[{"role": "user", "content": parts}]).choices[0].token_ids

    def plain():
        results["text"] = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=10,
                                                    temperature=0).choices[0].token_ids
    threads = [threading.Thread(target=spoken, args=("b", [audio_part(wav_bytes(b))], 10)),
               threading.Thread(target=spoken, args=("ab", [audio_part(wav_bytes(a)), audio_part(wav_bytes(b))],
                                                     10)),
               threading.Thread(target=spoken, args=("a", [audio_part(wav_bytes(a)),
                                                           {"type": "text", "text": text}], 12)),
               threading.Thread(target=plain)]
    [t.start() for t in threads]
    [t.join(300) for t in threads]
    assert results == want
    assert max(spoken_batches) >= 2, spoken_batches


def test_spoken_requests_through_the_openai_client_match_offline_greedy_decoding(run):
    from openai import OpenAI
    a, b = speech(1.5, 0), speech(0.8, 1)
    text = "import os\n"
    want_a = offline_spoken(run, [a], text, 12)
    want_a_alone = offline_spoken(run, [a], "", 12)
    want_b = offline_spoken(run, [b], "", 10)
    # the answers depend on the map: the audio map (not the text map) is what the server must answer from
    assert (want_a, want_b) != (offline_spoken(run, [a], text, 12, kvmap=run["text_map"]),
                                offline_spoken(run, [b], "", 10, kvmap=run["text_map"]))
    want_ab = offline_spoken(run, [a, b], "", 10)  # two parts: two placeholder runs, in order
    text_prompt = run["tok"].encode("def read_config(path):\n").ids
    want_text = offline_text(run, text_prompt, 10)
    with Serving(run) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        info = client.models.list().data[0].kvjax
        assert info["audio"]["map"].endswith("audio_map") and info["audio"]["max_seconds"] == WINDOW_S
        got = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": b64(wav_bytes(a)),
                                                                                 "format": "wav"}},
                                         {"type": "text", "text": text}]}])
        assert got.choices[0].token_ids == want_a
        assert got.choices[0].message.content == run["tok"].decode(want_a, skip_special_tokens=True)
        assert got.kvjax["path"] == "split"
        assert got.usage.prompt_tokens == len(spoken_prompt(run, features([a]), text))
        got = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": [audio_part(wav_bytes(a))]}])
        assert got.choices[0].token_ids == want_a_alone
        # streaming: the same answer
        stream = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, stream=True, messages=[
            {"role": "user", "content": [audio_part(wav_bytes(a)), {"type": "text", "text": text}]}])
        assert sum((c.choices[0].token_ids for c in stream if c.choices), []) == want_a
        # at once: spoken requests share a prefill batch (their clips in row order), a text request prefills apart
        # through the text map; each answer is what it gets alone offline. The first prefill is held back a moment,
        # so the others queue behind it and are batched
        concurrent_mix(srv, client, a, b, text, text_prompt, {"a": want_a, "b": want_b, "ab": want_ab,
                                                             "text": want_text})
        # text-only chat on the toy (no chat template): still the clear 400 it was
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json=dict(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]))
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_bad_audio_is_a_4xx_that_says_what_to_send(run):
    import openai
    from openai import OpenAI
    good = speech(1.0, 2)
    long = speech(WINDOW_S + 0.5, 3)
    stereo = np.stack([good, good], 1)
    not_wav = b"ID3\x03" + bytes(2000)
    cases = [
        ([{"type": "input_audio", "input_audio": {"data": "not base64!!", "format": "wav"}}], 400, "not valid base64"),
        ([audio_part(not_wav)], 400, "not a WAV file"),
        ([audio_part(wav_bytes(good), fmt="mp3")], 400, "send format 'wav'"),
        ([audio_part(wav_bytes(good, rate=44_100))], 400, "resample it to 16 kHz"),
        ([audio_part(wav_bytes(stereo, channels=2))], 400, "mono"),
        ([audio_part(wav_bytes((good // 256 + 128).astype(np.uint8), width=1))], 400, "16-bit PCM"),
        ([audio_part(wav_bytes(long))], 400, "window is 2 s"),
        ([audio_part(wav_bytes(speech(8.0, 4)))], 413, "at most"),  # over the byte limit: 413, before decoding
        ([audio_part(wav_bytes(good))] * 5, 400, "at most 4"),
        ([{"type": "image_url", "image_url": {"url": "x"}}], 400, "'text' or 'input_audio'"),
        ([{"type": "input_audio", "input_audio": {"format": "wav"}}], 400, "input_audio"),
    ]
    # disaggregated: the adapter listens on the prefill device, the answer decodes on another
    with Serving(run, "--topology=disaggregated", "--prefill-devices=1") as srv:
        for content, status, words in cases:
            r = srv.chat(content)
            assert r.status_code == status, (words, r.text)
            err = r.json()["error"]
            assert words in err["message"], (words, err)
            assert err["type"] == "invalid_request_error"
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json=dict(model=MODEL, max_tokens=4, messages=[
            {"role": "assistant", "content": [audio_part(wav_bytes(good))]}]))
        assert r.status_code == 400 and "user messages" in r.json()["error"]["message"]
        # the official client raises the server's message
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="resample it to 16 kHz"):
            client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                {"role": "user", "content": [audio_part(wav_bytes(good, rate=8_000))]}])
        # a body over the limit is refused from its Content-Length
        big = json.dumps({"model": MODEL, "messages": [], "pad": "x" * srv.engine.audio.max_body}).encode()
        r = httpx.post(srv.url + "/v1/chat/completions", content=big, timeout=60,
                       headers={"content-type": "application/json"})
        assert r.status_code == 413 and "request body" in r.json()["error"]["message"]
        # and the next request is answered (through the prefill worker's device)
        assert srv.engine.prefill_devices[0] != srv.engine.decode_device
        r = srv.chat([audio_part(wav_bytes(good))], max_tokens=6)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == offline_spoken(run, [good], "", 6)


def test_without_an_audio_map_the_text_map_answers_with_a_warning(run, tmp_path, caplog):
    from kvjax.config_flags import build
    from kvjax.run.config import RunConfig
    from kvjax.serve.audio import load
    cfg = build("toy_audio", [("output_dir", str(tmp_path)), ("eval.audio.source_adapter", run["adapter"])],
                RunConfig)
    with caplog.at_level(logging.WARNING, logger="kvjax.serve"):
        audio = load(cfg, run["source"], run["target"][0], run["tok"], run["text_map"])
    assert audio.kvmap is run["text_map"] and "no audio map" in caplog.text
    assert audio.placeholder == PLACEHOLDER and audio.window == 200 and audio.open_id == 0
    assert audio.close_ids == tuple(run["tok"].encode("\n", add_special_tokens=False).ids)


def test_audio_config_checks_and_a_text_only_server(run, tmp_path):
    from starlette.testclient import TestClient

    from kvjax.serve import Engine, EngineConfig, cli
    from kvjax.serve.app import Server
    old = os.getcwd()
    os.chdir(REPO)
    try:  # a missing adapter is reported before any model loads, naming the setting and the way out
        with pytest.raises(cli.ServeError, match="eval.audio.source_adapter.*eval.audio.enabled=false"):
            cli.parse(argv(run, f"--config.eval.audio.source_adapter={tmp_path}"))
    finally:
        os.chdir(old)
    engine = Engine(run["source"], run["target"], run["text_map"], run["tok"], EngineConfig(slots=1, capacity=128))
    with TestClient(Server(engine, MODEL).app()) as client:  # never started: the request stops before the engine
        r = client.post("/v1/chat/completions", json=dict(model=MODEL, messages=[
            {"role": "user", "content": [audio_part(wav_bytes(speech(0.5, 5)))]}]))
        assert r.status_code == 400 and "does not take audio input" in r.json()["error"]["message"]
        assert "toy_audio" in r.json()["error"]["message"]


def test_when_the_gate_failed_the_answerers_own_audio_path_answers_spoken_requests(run, caplog):
    """The native path's audio analogue: a failing gate.json, --config.eval.audio.target_adapter set: a spoken request
    through the official client is token-identical to offline generate_from(AudioPrefill(target_alm).set_audio(..)),
    batched or alone; text requests take the native target path; the startup log and /v1/models say which."""
    from openai import OpenAI
    a, b = speech(1.5, 0), speech(0.8, 1)
    text = "import os\n"
    want_a = offline_spoken(run, [a], text, 12, own=True)
    want_ab = offline_spoken(run, [a, b], "", 10, own=True)
    want_b = offline_spoken(run, [b], "", 10, own=True)
    # the answers depend on the path: the answerer's own adapter, not the source's + the audio map
    assert (want_a, want_b) != (offline_spoken(run, [a], text, 12), offline_spoken(run, [b], "", 10))
    text_prompt = run["tok"].encode("def read_config(path):\n").ids
    want_text = [int(t) for t in np.asarray(kvjax.native_generate(kvjax.Model(*run["target"]), [text_prompt],
                                                                  10))[0]]
    want_text = want_text[: want_text.index(0) + 1] if 0 in want_text else want_text
    with caplog.at_level(logging.INFO, logger="kvjax.serve"):
        # disaggregated: the answerer's adapter listens on the prefill device, the answer decodes on another
        srv = Serving(run, f"--gate={run['failed_gate']}", "--topology=disaggregated", "--prefill-devices=1",
                      f"--config.eval.audio.target_adapter={run['target_adapter']}")
    with srv:
        assert srv.engine.prefill_devices[0] != srv.engine.decode_device
        assert "spoken requests: native_target audio path" in caplog.text
        assert run["target_adapter"] in caplog.text
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        info = client.models.list().data[0].kvjax
        assert info["path"] == "native_target"
        assert info["audio"]["path"] == "native_target" and info["audio"]["map"] is None
        assert info["audio"]["adapter"] == run["target_adapter"] and info["audio"]["max_seconds"] == WINDOW_S
        got = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": [audio_part(wav_bytes(a)), {"type": "text", "text": text}]}])
        assert got.choices[0].token_ids == want_a
        assert got.choices[0].message.content == run["tok"].decode(want_a, skip_special_tokens=True)
        assert got.kvjax["path"] == "native_target"
        assert got.usage.prompt_tokens == len(spoken_prompt(run, features([a]), text))
        # at once: the spoken requests share a prefill batch (held back a moment so they queue), the text request
        # prefills apart through the target itself; each answer is what it gets alone offline
        concurrent_mix(srv, client, a, b, text, text_prompt, {"a": want_a, "b": want_b, "ab": want_ab,
                                                             "text": want_text})


def test_native_path_without_the_answerers_adapter_refuses_spoken_requests_or_startup(run, tmp_path):
    """Failing gate: no target adapter (unset) keeps the 400, naming the setting; adapters that stack frames
    differently or have another encoder window refuse to start, saying so."""
    from kvjax.serve import cli
    from kvjax.serve.audio import load_native
    with Serving(run, f"--gate={run['failed_gate']}", "--config.eval.audio.target_adapter=") as srv:
        assert srv.engine.audio is None
        assert httpx.get(srv.url + "/v1/models").json()["data"][0]["kvjax"]["audio"] is None
        r = srv.chat([audio_part(wav_bytes(speech(0.5, 5)))])
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and "--config.eval.audio.target_adapter" in msg and "quality gate" in msg, msg
        # text is still served, by the target alone
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json=dict(model=MODEL, prompt="import os\n",
                                                                           max_tokens=4, temperature=0))
        assert r.status_code == 200 and r.json()["kvjax"]["path"] == "native_target"
    from kvjax.config_flags import build
    from kvjax.run.config import RunConfig
    missing = build("toy_audio", [("output_dir", str(tmp_path)), ("eval.audio.source_adapter", run["adapter"]),
                                  ("eval.audio.target_adapter", str(tmp_path / "nothing"))], RunConfig)
    audio, why = load_native(missing, run["source"], run["target"], run["tok"])
    assert audio is None and "--config.eval.audio.target_adapter" in why and "nothing" in why
    # a mismatched adapter of the answerer's: refused while the server starts (main: exit status 2 with the message)
    ecfg, target_cfg = run["ecfg"], run["target"][0]
    for name, enc, stack in (("stacked", ecfg, 2 * STACK),
                             ("window", dataclasses.replace(ecfg, max_source_positions=50), STACK)):
        path = str(tmp_path / name)
        save_ultravox(path, init_encoder(enc, jax.random.key(7), std=0.2),
                      init_projector(ProjectorConfig(32, target_cfg.hidden_size, hidden_size=64, stack_factor=stack,
                                                     ln_mid=True), jax.random.key(8)),
                      text_model_id="checkpoints/toy/pruned", audio_token_index=PLACEHOLDER,
                      vocab_size=target_cfg.vocab_size)
        old = os.getcwd()
        os.chdir(REPO)
        try:
            cfg, args, engine_cfg, map_dir, gate = cli.parse(argv(run, f"--gate={run['failed_gate']}",
                                                                  f"--config.eval.audio.target_adapter={path}"))
            with pytest.raises(ValueError, match="must stack frames alike and share the encoder window.*"
                                                 "eval.audio.target_adapter"):
                cli.build_server(cfg, args, engine_cfg, map_dir, gate)
        finally:
            os.chdir(old)

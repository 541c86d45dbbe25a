"""The HTTP face of the engine: an OpenAI-compatible Starlette app.

  POST /v1/completions        prompt as text or token ids; stream=true answers as server-sent events
  POST /v1/chat/completions   where the tokenizer has a chat template (else 400 saying so); with an audio config,
                              also spoken requests (input_audio parts; kvjax.serve.audio), without the template
  GET  /v1/models             the served model (the run config's name)
  GET  /health                200 while the engine takes work, else 503 with the reason
  GET  /metrics               Prometheus text (kvjax.serve.metrics)
  POST /admin/faults          only with --enable-fault-injection: make a fault happen (load and fault tooling)

The event loop never runs JAX: a request is checked and tokenized here, submitted to the engine (its threads do the
work) and answered from the events the engine posts back through `loop.call_soon_threadsafe`. Every wait has a
deadline (the request's timeout plus a margin), and a client that goes away cancels its request, so no response
waits forever on an engine that stopped answering. Every response says which path served it ("kvjax": {"path"},
and the x-kvjax-path header): "split" (source prefill, map, target decode) or "native_target" (the map failed its
quality gate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse as _StarletteJSON
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvjax.serve import protocol
from kvjax.serve.engine import Engine, Event, QueueFull, Request, Unhealthy
from kvjax.serve.faults import InjectedFault, WorkerKilled
from kvjax.serve.protocol import ApiError, Limits

log = logging.getLogger("kvjax.serve")
MARGIN = 5.0  # seconds the server waits past a request's own deadline before answering 504 itself


class JSONResponse(_StarletteJSON):
    """JSON with every non-ASCII character escaped, as the stream's events are (`_sse`): a body that names what the
    client sent (an unknown field's name in an error) then holds no raw U+0085 / U+2028, which tools that split text
    into lines with Python's str.splitlines (httpx's iter_lines among them) would break inside a string."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


class _Gone(Exception):
    """The client disconnected."""


class Server:
    def __init__(self, engine: Engine, model: str, chat_template=None, fault_injection: bool = False):
        self.engine, self.model, self.chat_template = engine, model, chat_template
        self.fault_injection = fault_injection
        c = engine.config
        self.limits = Limits(model=model, vocab_size=engine.vocab_size, capacity=c.capacity,
                             max_tokens_limit=min(c.max_tokens_limit, c.capacity - 2))

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]
        if self.fault_injection:
            routes.append(Route("/admin/faults", self.faults, methods=["POST"]))
        return Starlette(routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                                            Exception: _server_error})

    # ---- simple endpoints --------------------------------------------------------------------------------------

    async def models(self, request: HttpRequest):
        return JSONResponse({"object": "list", "data": [{
            "id": self.model, "object": "model", "created": 0, "owned_by": "kvjax",
            "kvjax": {"path": self.engine.path, "reason": self.engine.reason,
                      "topology": self.engine.config.topology, "max_model_len": self.limits.capacity,
                      "chat": self.chat_template is not None,
                      "audio": self.engine.audio.info() if self.engine.audio is not None else None}}]})

    async def health(self, request: HttpRequest):
        ok, why = self.engine.healthy
        stats = self.engine.stats()
        return JSONResponse({"status": "ok" if ok else "unhealthy", "reason": why, **stats}, status_code=200 if ok
                            else 503)

    async def metrics(self, request: HttpRequest):
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def faults(self, request: HttpRequest):
        """{"stage": "worker"|"prefill"|"step", "kind": "kill"|"error", "times": N}"""
        body = protocol.parse_body(await request.body())
        stage, kind, times = body.get("stage"), body.get("kind", "error"), body.get("times", 1)
        if kind not in ("kill", "error") or not isinstance(times, int):
            raise ApiError(400, "faults: kind must be 'kill' or 'error', times an integer")
        make = (lambda: WorkerKilled("killed by /admin/faults")) if kind == "kill" else (
            lambda: InjectedFault("injected by /admin/faults"))
        try:
            self.engine.faults.add(stage, make, times=times)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return JSONResponse({"added": {"stage": stage, "kind": kind, "times": times}})

    # ---- generation --------------------------------------------------------------------------------------------

    async def completions(self, request: HttpRequest):
        params = protocol.parse_completion(protocol.parse_body(await request.body()), self.limits)
        ids = list(params.prompt) if params.prompt is not None else self._encode(params.text)
        return await self._generate(request, params, ids, chat=False)

    async def chat(self, request: HttpRequest):
        audio = self.engine.audio
        if audio is not None:  # spoken requests are large: refuse an oversized body before reading it
            size = request.headers.get("content-length", "")
            if size.isdigit() and int(size) > audio.max_body:
                raise ApiError(413, f"the request body is {size} bytes; this server takes at most {audio.max_body} "
                                    f"(at most {audio.max_parts} audio parts of {audio.max_bytes} bytes each)")
        raw = await request.body()
        if audio is not None and len(raw) > audio.max_body:
            raise ApiError(413, f"the request body is {len(raw)} bytes; this server takes at most {audio.max_body}")
        params = protocol.parse_chat(protocol.parse_body(raw), self.limits)
        if params.audio:
            return await self._spoken(request, params)
        if self.chat_template is None:
            raise ApiError(400, f"model {self.model!r} has no chat template (its tokenizer_config.json has no "
                                "chat_template); use /v1/completions with the prompt text"
                                + (", or send audio (input_audio parts)" if audio is not None else ""))
        try:
            text = self.chat_template.render(params.messages)
        except Exception as e:  # noqa: BLE001 - a template rejecting the messages (raise_exception) is the client's
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return await self._generate(request, params, self._encode(text), chat=True)

    async def _spoken(self, request: HttpRequest, params: protocol.GenerationParams):
        """A chat request with input_audio parts: the adapter's prompt template (kvjax.serve.audio), the clips'
        features computed off the event loop."""
        audio = self.engine.audio
        if audio is None:
            raise ApiError(400, f"this server does not take audio input: {self.engine.audio_reason}",
                           param="messages")
        clips = await asyncio.to_thread(audio.clips, params.audio)
        text = "\n".join(params.texts)
        ids = audio.prompt(clips, self.engine.tokenizer.encode(text, add_special_tokens=False).ids if text else [])
        return await self._generate(request, params, ids, chat=True, audio=tuple(clips))

    def _encode(self, text: str) -> list[int]:
        return self.engine.tokenizer.encode(text).ids

    async def _generate(self, http: HttpRequest, params: protocol.GenerationParams, ids: list[int], chat: bool,
                        audio: tuple = ()):
        protocol.check_prompt(ids, params.max_tokens, self.limits)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def sink(event: Event) -> None:  # engine thread -> event loop
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the loop is closed: the server is gone
                pass

        req = Request(prompt=ids, max_tokens=params.max_tokens, sink=sink, temperature=params.temperature,
                      top_p=params.top_p, seed=params.seed, stop=params.stop, timeout=params.timeout, audio=audio)
        try:
            self.engine.submit(req)
        except QueueFull as e:
            raise ApiError(429, str(e), headers={"Retry-After": str(e.retry_after)}) from None
        except Unhealthy as e:
            raise ApiError(503, f"the server is unhealthy: {e}") from None
        meta = _Meta(req, self.model, chat, len(ids), self.engine.path, self.engine.reason)
        headers = {"x-kvjax-path": self.engine.path}
        if params.stream:
            return StreamingResponse(self._sse(http, req, queue, meta, params.include_usage),
                                     media_type="text/event-stream", headers=headers)
        text, ids_out, reason = [], [], None
        try:
            while reason is None:
                event = await self._next(http, req, queue)
                if event.kind == "token":
                    text.append(event.text)
                    ids_out += event.ids
                elif event.kind == "finish":
                    reason = event.reason
                else:
                    raise ApiError(event.status, event.message)
        except _Gone:
            return Response(status_code=499)
        return JSONResponse(meta.full("".join(text), ids_out, reason), headers=headers)

    async def _next(self, http: HttpRequest, req: Request, queue: asyncio.Queue) -> Event:
        """The request's next event; the client disconnecting cancels it (_Gone); past its deadline, 504."""
        getter = asyncio.ensure_future(queue.get())
        gone = asyncio.ensure_future(_disconnected(http))
        remaining = req.deadline + MARGIN - time.perf_counter()
        try:
            done, _ = await asyncio.wait({getter, gone}, timeout=max(remaining, 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if getter in done:
            return getter.result()
        getter.cancel()
        self.engine.cancel(req)
        if gone in done:
            raise _Gone()
        raise ApiError(504, f"no answer from the engine within the request's deadline "
                            f"({req.deadline - req.submitted:.0f} s + {MARGIN:.0f} s)")

    async def _sse(self, http, req: Request, queue: asyncio.Queue, meta: "_Meta", include_usage: bool):
        try:
            yield _sse(meta.chunk("", (), None, first=True)) if meta.chat else b""
            ids_out = []
            while True:
                try:
                    event = await self._next(http, req, queue)
                except ApiError as e:
                    yield _sse(e.body())
                    break
                if event.kind == "token":
                    ids_out += event.ids
                    yield _sse(meta.chunk(event.text, event.ids, None))
                elif event.kind == "finish":
                    yield _sse(meta.chunk("", (), event.reason))
                    if include_usage:
                        yield _sse(meta.usage_chunk(len(ids_out)))
                    break
                else:
                    yield _sse(ApiError(event.status, event.message).body())
                    break
            yield b"data: [DONE]\n\n"
        except _Gone:
            return
        finally:
            if not req.finished:
                self.engine.cancel(req)


async def _disconnected(http: HttpRequest) -> None:
    """Returns when the client disconnects (the ASGI server's http.disconnect after the body was read)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Meta:
    """The response envelope of one request (completion or chat, whole or chunked)."""

    def __init__(self, req: Request, model: str, chat: bool, prompt_tokens: int, path: str, reason: str):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{req.id}"
        self.created, self.model, self.chat = int(time.time()), model, chat
        self.prompt_tokens, self.path = prompt_tokens, {"path": path, "reason": reason}

    def _envelope(self, kind: str, choices: list) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "kvjax": self.path}

    def usage(self, n: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}

    def full(self, text: str, ids: list[int], reason: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                      "token_ids": ids}
            out = self._envelope("chat.completion", [choice])
        else:
            out = self._envelope("text_completion", [{"index": 0, "text": text, "finish_reason": reason,
                                                      "logprobs": None, "token_ids": ids}])
        return dict(out, usage=self.usage(len(ids)))

    def chunk(self, text: str, ids, reason, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text or ids else {})
            return self._envelope("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": reason,
                                                             "token_ids": list(ids)}])
        return self._envelope("text_completion", [{"index": 0, "text": text, "finish_reason": reason,
                                                   "logprobs": None, "token_ids": list(ids)}])

    def usage_chunk(self, n: int) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return dict(self._envelope(kind, []), usage=self.usage(n))


async def _api_error(request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _http_error(request, exc: HTTPException):
    return JSONResponse(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").body(),
                        status_code=exc.status_code)


async def _server_error(request, exc: Exception):
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return JSONResponse(ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body(), status_code=500)

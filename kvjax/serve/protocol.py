"""The OpenAI-compatible request bodies: parsing and checking, with an error that says what is wrong.

Pure Python (no JAX): every check runs on the server's event loop before a request reaches the engine. A field the
OpenAI API defines but this server does not implement is accepted only at its neutral value; any other unknown field
is an error (a typo must not silently change nothing).
"""

from __future__ import annotations

import dataclasses
import json
import math


class ApiError(Exception):
    """An HTTP error with an OpenAI-style JSON body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
                503: "service_unavailable", 504: "timeout"}.get(self.status, "server_error"
                                                               if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the served engine can take."""

    model: str  # the served model's name (the run config's name)
    vocab_size: int
    capacity: int  # prompt + max_tokens per request
    max_tokens_limit: int


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    prompt: tuple[int, ...] | None  # token ids (completions given ids), else None
    text: str | None  # prompt text (completions) or None
    messages: tuple[dict, ...] | None  # chat messages
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    timeout: float | None  # seconds for this request (None: the server's request timeout)
    audio: tuple["AudioPart", ...] = ()  # chat: the input_audio parts, in order (kvjax.serve.audio answers them)
    texts: tuple[str, ...] = ()  # chat: every text part and string content, in message order


@dataclasses.dataclass(frozen=True)
class AudioPart:
    """A chat content part {"type": "input_audio", "input_audio": {"data": base64, "format": "wav"}}; checked and
    decoded by kvjax.serve.audio. `where`: its place in the request (messages[i].content[j]), for error messages."""

    data: str
    format: str
    where: str


# field -> its neutral value; a request may send them only with that value (the openai client sends none by default)
NEUTRAL = {"n": 1, "echo": False, "logprobs": None, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
           "logit_bias": None, "suffix": None, "user": None, "top_logprobs": None, "response_format": None,
           "tools": None, "tool_choice": None, "parallel_tool_calls": None, "service_tier": None, "store": None,
           "metadata": None}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "timeout"}
COMPLETION_FIELDS = COMMON | {"prompt"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens"}
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object; non-UTF-8, malformed JSON or a non-object is a 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                            "send JSON encoded as UTF-8") from None
    if not text.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        body = json.loads(text, parse_constant=_not_json)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") \
            from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got a JSON {type(body).__name__}")
    return body


def _not_json(constant: str):
    # Python's json reads NaN and Infinity, which JSON does not have; a NaN would pass every range check below
    raise ApiError(400, f"the request body holds {constant}, which is not JSON; send finite numbers")


def _number(body, name, default, lo, hi, kind=float, lo_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ApiError(400, f"'{name}' must be {'a number' if kind is float else 'an integer'}, got "
                            f"{json.dumps(value)}", param=name)
    if not math.isfinite(value):  # 1e999 reads as infinity
        raise ApiError(400, f"'{name}' must be a finite number, got {value}", param=name)
    if (value <= lo if lo_open else value < lo) or value > hi:
        raise ApiError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param=name)
    return kind(value)


def _check_fields(body: dict, allowed: set[str], what: str) -> None:
    unknown = sorted(k for k in body if k not in allowed and k not in NEUTRAL)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(map(repr, unknown))} for {what}; accepted: "
                            f"{', '.join(sorted(allowed))}", param=unknown[0])
    for k, neutral in NEUTRAL.items():
        if k in body and body[k] != neutral and not (k == "best_of" and body[k] is None):
            raise ApiError(400, f"'{k}' is not supported by this server (only {json.dumps(neutral)}), got "
                                f"{json.dumps(body[k])}", param=k)


def _common(body: dict, limits: Limits, max_tokens_field: str = "max_tokens") -> dict:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, f"'model' is required: the served model is {limits.model!r}", param="model")
    if model != limits.model:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {limits.model!r} (GET /v1/models)",
                       param="model", code="model_not_found")
    max_tokens = body.get(max_tokens_field, body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise ApiError(400, f"'max_tokens' must be an integer, got {json.dumps(max_tokens)}", param="max_tokens")
    if not 1 <= max_tokens <= limits.max_tokens_limit:
        raise ApiError(400, f"'max_tokens' must be in [1, {limits.max_tokens_limit}], got {max_tokens}",
                       param="max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {json.dumps(stream)}", param="stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise ApiError(400, "'stream_options' may only hold include_usage", param="stream_options")
    return dict(max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                seed=_number(body, "seed", 0, -2 ** 31, 2 ** 31 - 1, kind=int), stop=stop, stream=stream,
                include_usage=bool(opts.get("include_usage", False)),
                timeout=_number(body, "timeout", None, 0.0, 3600.0, lo_open=True))


def parse_completion(body: dict, limits: Limits) -> GenerationParams:
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a one-element list of either."""
    _check_fields(body, COMPLETION_FIELDS, "/v1/completions")
    common = _common(body, limits)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty; send the text to complete", param="prompt")
        return GenerationParams(prompt=None, text=prompt, messages=None, **common)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
        if bad:
            raise ApiError(400, f"'prompt' token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})",
                           param="prompt")
        return GenerationParams(prompt=tuple(prompt), text=None, messages=None, **common)
    if prompt is None or prompt == []:
        raise ApiError(400, "'prompt' is required and must not be empty", param="prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")


def parse_chat(body: dict, limits: Limits) -> GenerationParams:
    """POST /v1/chat/completions: `messages` [{role, content}], content a string or a list of parts: {"type": "text",
    "text"} and (user messages) {"type": "input_audio", "input_audio": {"data", "format"}}. A message's text parts
    reach the chat template joined by "\\n"; the audio parts are returned in order (GenerationParams.audio)."""
    _check_fields(body, CHAT_FIELDS, "/v1/chat/completions")
    common = _common(body, limits, "max_completion_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content}", param="messages")
    out, audio, texts = [], [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and (isinstance(content, str) or (isinstance(content, list) and content))):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role' and a 'content' that is a "
                                "string or a non-empty list of content parts", param="messages")
        if isinstance(content, str):
            out.append(m)
            texts.append(content)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "input_audio":
                inner = part.get("input_audio")
                if m["role"] != "user":
                    raise ApiError(400, f"{where}: input_audio parts go in user messages, not {m['role']!r} ones",
                                   param="messages")
                if not (isinstance(inner, dict) and isinstance(inner.get("data"), str) and inner["data"]
                        and isinstance(inner.get("format"), str)):
                    raise ApiError(400, f"{where}: an input_audio part is {{\"type\": \"input_audio\", "
                                        "\"input_audio\": {\"data\": BASE64, \"format\": \"wav\"}}", param="messages")
                audio.append(AudioPart(inner["data"], inner["format"], where))
            elif kind == "text":
                raise ApiError(400, f"{where}: a text part needs a string 'text'", param="messages")
            else:
                raise ApiError(400, f"{where}: content part type {json.dumps(kind)} is not supported; use 'text' or "
                                    "'input_audio'", param="messages")
        out.append(dict(m, content="\n".join(parts)))
        texts += parts
    return GenerationParams(prompt=None, text=None, messages=tuple(out), audio=tuple(audio),
                            texts=tuple(t for t in texts if t), **common)


def check_prompt(ids: list[int], max_tokens: int, limits: Limits) -> None:
    """A tokenized prompt against the engine: at least 2 tokens (the source prefills all but the last), and prompt
    + max_tokens within a slot's capacity."""
    if len(ids) < 2:
        raise ApiError(400, f"the prompt is {len(ids)} token(s); it needs at least 2 (the source model reads all but "
                            "the last)", param="prompt")
    if len(ids) + max_tokens > limits.capacity:
        raise ApiError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the cache "
                            f"capacity of {limits.capacity} tokens per request; shorten the prompt or lower "
                            "max_tokens", param="prompt", code="context_length_exceeded")

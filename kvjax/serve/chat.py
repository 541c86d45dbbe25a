"""Chat templates: the Jinja template a checkpoint ships (tokenizer_config.json "chat_template", or a
chat_template.jinja file beside it), rendered the way transformers renders it (sandboxed, generation prompt added).
A tokenizer without one has no chat endpoint: /v1/chat/completions then answers 400 saying so."""

from __future__ import annotations

import json
import os


class ChatTemplate:
    def __init__(self, source: str, special: dict):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.special = special

    def render(self, messages) -> str:
        return self.template.render(messages=list(messages), add_generation_prompt=True, **self.special)


def load_chat_template(path: str) -> ChatTemplate | None:
    """The template of the checkpoint directory `path`, or None."""
    cfg_path = os.path.join(path, "tokenizer_config.json")
    cfg = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cfg = json.load(f)
    source = cfg.get("chat_template")
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    jinja = os.path.join(path, "chat_template.jinja")
    if not source and os.path.isfile(jinja):
        with open(jinja) as f:
            source = f.read()
    if not source:
        return None
    special = {k: cfg[k] if isinstance(cfg.get(k), str) else (cfg.get(k) or {}).get("content", "")
               for k in ("bos_token", "eos_token")}
    return ChatTemplate(source, special)

"""kvjax.serve: an OpenAI-compatible server for the split path (source prefill -> map -> target decode).

  python -m kvjax.serve --config=toy [--map PATH] [--topology serial|batched|disaggregated] [--port 8000]

  engine     continuous batching: composes the scheduler, the slots and (disaggregated) the prefill pool
  scheduler  the bounded queue, prefill batches of one length bucket, each request's final answer, whether a step
             drafts (DraftPolicy)
  slots      the decode cache's rows: insert a prefilled batch, one decode step for every occupied row
  drafting   speculative decoding in the slots (--speculative): the drafter, each slot's drafter state, rounds
  workers    disaggregated: the prefill worker threads and their supervision
  config     EngineConfig and the request / event types (no JAX)
  programs   the compiled pieces: batched prefill (the builders), in-place slot insert, one decode step, a verify
             round
  app        the HTTP endpoints (Starlette): completions, chat, models, health, metrics
  protocol   request parsing and checks, OpenAI-style errors
  audio      spoken chat requests (input_audio parts): WAV checks, features, the audio prompt, the audio map
  text       incremental detokenization with stop strings
  chat       chat templates from the checkpoint
  metrics    Prometheus metrics
  faults     fault injection points (tests, load tooling)
  cli        the command line (checks its flags, config and checkpoints before JAX starts)

Engine loads on first use (it imports JAX); the other names here do not need it.
"""

from kvjax.serve.config import EngineConfig, Event, QueueFull, Request, Unhealthy

__all__ = ["Engine", "EngineConfig", "Event", "QueueFull", "Request", "Unhealthy"]


def __getattr__(name: str):
    if name == "Engine":
        from kvjax.serve.engine import Engine
        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""kvjax.serve: an OpenAI-compatible server for the split path (source prefill -> map -> target decode).

  python -m kvjax.serve --config=toy [--map PATH] [--topology serial|batched|disaggregated] [--port 8000]

  engine     continuous batching over fixed decode slots; serial / batched / disaggregated topologies
  programs   the compiled pieces: batched prefill (the builders), in-place slot insert, one decode step
  app        the HTTP endpoints (Starlette): completions, chat, models, health, metrics
  protocol   request parsing and checks, OpenAI-style errors
  text       incremental detokenization with stop strings
  chat       chat templates from the checkpoint
  metrics    Prometheus metrics
  faults     fault injection points (tests, load tooling)
  cli        the command line
"""

from kvjax.serve.engine import Engine, EngineConfig, Event, QueueFull, Request, Unhealthy

__all__ = ["Engine", "EngineConfig", "Event", "QueueFull", "Request", "Unhealthy"]

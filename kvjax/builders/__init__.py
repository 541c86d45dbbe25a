"""Cache builders: every way to give the answering model the cache of a prompt (see kvjax.builders.base).

  NativePrefill     the model reads the prompt itself
  Mapped            the source reads, a KVMap translates (XLA or the Pallas kernel)
  Pipelined         source prefill and map in one program, layer by layer
  PartialRecompute  a mapped cache in which the target recomputes k of its layers
"""

from kvjax.builders.base import BUCKET, CacheBuilder, Clock, bucket
from kvjax.builders.native import NativePrefill, prefill, prefill_cache, prefill_cache_jit
from kvjax.builders.mapped import Mapped, Pipelined, SourcePrefill
from kvjax.builders.partial import PartialRecompute, recompute, recompute_layers

__all__ = ["BUCKET", "CacheBuilder", "Clock", "bucket", "NativePrefill", "prefill", "prefill_cache", "prefill_cache_jit", "Mapped",
           "Pipelined", "SourcePrefill", "PartialRecompute", "recompute", "recompute_layers"]

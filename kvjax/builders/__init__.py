"""Cache builders: every way to give the answering model the cache of a prompt (see kvjax.builders.base).

  NativePrefill     the model reads the prompt itself
  Resumable         the interface of a builder that reads a prompt in pieces (NativePrefill, Mapped)
  Mapped            the source reads, a KVMap translates (XLA or the Pallas kernel)
  Pipelined         source prefill and map in one program, layer by layer
  PartialRecompute  a mapped cache in which the target recomputes k of its layers
  NativeTail        a mapped cache in which the target reads each prompt's last n tokens itself
  repaired          the map's cache with either repair or both (PartialRecompute, then NativeTail)
"""

from kvjax.builders.base import BUCKET, CacheBuilder, Clock, Resumable, bucket
from kvjax.builders.native import NativePrefill
from kvjax.builders.mapped import Mapped, SourcePrefill, map_jit
from kvjax.builders.pipelined import Pipelined
from kvjax.builders.partial import PartialRecompute, recompute, recompute_layers
from kvjax.builders.tail import NativeTail, repaired, split_tail

__all__ = ["BUCKET", "CacheBuilder", "Clock", "Resumable", "bucket", "NativePrefill", "Mapped", "map_jit",
           "Pipelined", "SourcePrefill", "PartialRecompute", "recompute", "recompute_layers", "NativeTail",
           "repaired", "split_tail"]

"""Split-path generation: the source reads the prompt, the map translates its cache, the target answers.

`native_generate` is the same pipeline without the map (one model prefills and decodes, with the same phases and
cache capacity): the baseline of throughput measurements and the fallback of a map that failed its quality gate.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from kvjax.builders import CacheBuilder, Clock, Mapped, NativePrefill, Pipelined
from kvjax.generation import alternating_decode_seconds, generate_from
from kvjax.mapper.kvmap import KVMap, check_models
from kvjax.models.model import Model

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SplitResult:
    """What split_generate returns when it is given a quality gate."""

    tokens: jax.Array  # int32 [B, N]
    phases: dict  # per-phase seconds (empty unless timings=True)
    path: str  # "split" (source prefill -> map -> target decode) or "native_target" (the gate failed)
    reason: str = ""  # why the native path was taken

    @property
    def fell_back(self) -> bool:
        return self.path != "split"


def _run(builder: CacheBuilder, prompts, max_new_tokens: int, timings: bool, **kwargs):
    clock = Clock(enabled=timings)
    out = generate_from(builder, prompts, max_new_tokens, clock=clock, **kwargs)
    return (out, clock.phases) if timings else out


def native_generate(model: Model, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                    key=None, eos_token_ids=None, pad_token_id: int | None = None, timings: bool = False,
                    decode_repeats: int = 1):
    """One model reads the prompt and answers, in split_generate's phases: it prefills all but each prompt's last
    token, runs that token (the first new token's logits), then decodes. Same arguments and cache capacity as
    split_generate; returns tokens int32 [B, N], and with `timings` a dict of seconds (prefill, first_token,
    decode; `decode_repeats` as in split_generate). Greedy output equals kvjax.generate's."""
    return _run(NativePrefill(model), prompts, max_new_tokens, timings, temperature=temperature, top_p=top_p,
                key=key, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, decode_repeats=decode_repeats)


def _gate_failed(gate) -> str:
    """'' if the gate passed, else why not. `gate`: a kvjax.eval.gate.GateResult (or anything with .passed) or a
    bool."""
    passed = gate if isinstance(gate, (bool, np.bool_)) else getattr(gate, "passed", None)
    if passed is None:
        raise TypeError(f"gate must be a GateResult (kvjax.eval.gate.load_gate) or a bool, got {type(gate).__name__}")
    if passed:
        return ""
    summary = getattr(gate, "summary", None)
    return "map failed its quality gate" + (f" ({summary()})" if callable(summary) else "")


def split_generate(source: Model, target: Model, kvmap: KVMap, prompts, max_new_tokens: int, *,
                   temperature: float = 0.0, top_p: float = 1.0, key=None, eos_token_ids=None,
                   pad_token_id: int | None = None, timings: bool = False, gate=None, pipeline: bool = False,
                   impl: str = "xla", decode_repeats: int = 1):
    """Source prefill -> map -> target decode. The source reads each prompt but its last token; the target reads
    that last token from the mapped cache and produces every generated token (greedy by default).

    `prompts`: list of token lists (>= 2 tokens each) or int array [B, T]. Returns tokens int32 [B, N], and with
    `timings` also a dict of per-phase seconds (source_prefill, map, first_token, decode), each measured with
    block_until_ready (so phases do not overlap; use timings=False for the fastest path). With timings,
    `decode_repeats` > 1 re-runs the decode phase from the same cache and reports its median time.

    `gate`: the map's quality gate (kvjax.eval.gate.GateResult, e.g. kvjax.load_gate("runs/toy/gate.json"), or a bool).
    With a gate the result is a SplitResult (tokens, phases, path, reason); when the gate failed, the map is not
    used: the target prefills the prompt itself (native_generate), a warning is logged, and path is
    "native_target".

    `pipeline`: run the source prefill and the map as one program, each target layer mapped as soon as its paired
    source layers exist and the source stopped at the deepest paired layer (kvjax.builders.pipelined; same tokens);
    its timings have one phase "prefill_map" instead of source_prefill + map. `impl`: how the map runs, "xla",
    "pallas" (the fused map-and-insert kernel) or "auto" (kernel on GPU/TPU, XLA on CPU).
    """
    check_models(kvmap, source[0], target[0])
    if gate is not None:
        reason = _gate_failed(gate)
        kwargs = dict(temperature=temperature, top_p=top_p, key=key, eos_token_ids=eos_token_ids,
                      pad_token_id=pad_token_id, timings=timings, decode_repeats=decode_repeats)
        if reason:
            log.warning("split_generate: %s; falling back to native target prefill", reason)
            result = native_generate(target, prompts, max_new_tokens, **kwargs)
        else:
            result = split_generate(source, target, kvmap, prompts, max_new_tokens, pipeline=pipeline, impl=impl,
                                    **kwargs)
        out, phases = result if timings else (result, {})
        return SplitResult(out, phases, "native_target" if reason else "split", reason)
    builder = (Pipelined(source, target, kvmap, impl=impl) if pipeline else
               Mapped(source, target, kvmap, impl=impl))
    return _run(builder, prompts, max_new_tokens, timings, temperature=temperature, top_p=top_p, key=key,
                eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, decode_repeats=decode_repeats)


def paired_decode_seconds(source: Model, target: Model, kvmap: KVMap, prompts, max_new_tokens: int,
                          repeats: int) -> dict[str, list[float]]:
    """Seconds of the decode phase of the native target and of the target on the mapped cache, timed alternately
    (kvjax.generation.alternating_decode_seconds): the paired measurement behind "mapped decode runs at native
    target speed"."""
    return alternating_decode_seconds({"target": NativePrefill(target), "mapped": Mapped(source, target, kvmap)},
                                      prompts, max_new_tokens, repeats)

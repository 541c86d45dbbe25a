"""Speculative decoding entry points: plain drafting, and drafting from a speculative KV transfer.

`speculative_generate`: the verifier's cache comes from a builder (its own prefill by default), the drafter prefills
the prompt itself (or, for a drafter object, does what its `start` does), then the verify loop runs.

`speculative_split_generate`: the SMALL model prefills each prompt once; that one cache is both the drafter's cache and
the input of a KVMap into the LARGE model's coordinates (optionally repaired by recomputing some large-model layers,
kvjax.builders.partial), and the large model verifies from the mapped cache. Greedy output is then the large model's
greedy decode FROM THE MAPPED CACHE (what kvjax.generate_from(transfer_builder(...), ...) produces), not from its
native prefill: speculation is lossless with respect to the verifier's cache, and the map decides what that cache
holds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.builders import CacheBuilder, Clock, NativePrefill, SourcePrefill, repaired
from kvjax.builders.partial import recompute_layers
from kvjax.generation import Prepared, prepare
from kvjax.mapper.kvmap import KVMap, check_models
from kvjax.models.model import Model, as_model
from kvjax.speculative.draft import ModelDrafter
from kvjax.speculative.lookup import LookupDrafter
from kvjax.speculative.loop import Stats, run_loop, stats_of

DEFAULT_DRAFT_LEN = 4


@dataclasses.dataclass(frozen=True)
class SpecResult:
    """What speculative_split_generate returns."""

    tokens: jax.Array  # int32 [B, N]
    phases: dict  # seconds per phase: prefill (small model), map, repair, decode (empty unless timings=True)
    stats: Stats


def _is_model(x) -> bool:
    return isinstance(x, Model) or (isinstance(x, (tuple, list)) and len(x) == 2 and hasattr(x[0], "vocab_size"))


def _as_drafter(drafter, draft_len: int | None, vocab: int):
    if isinstance(drafter, str):
        if drafter != "lookup":
            raise ValueError(f"drafter={drafter!r}: the one drafter named by a string is 'lookup' (prompt lookup, "
                             "kvjax.speculative.LookupDrafter); pass a model (kvjax.load_hf) or a drafter object")
        g = DEFAULT_DRAFT_LEN if draft_len is None else draft_len
        _check_draft_len(g)
        return LookupDrafter(vocab_size=int(vocab), draft_len=int(g))
    if _is_model(drafter):
        model = as_model(drafter)
        if model.cfg.vocab_size != vocab:
            raise ValueError(f"the drafter's vocabulary ({model.cfg.vocab_size}) differs from the verifier's ({vocab}); "
                             "speculative decoding needs two models that share a tokenizer")
        g = DEFAULT_DRAFT_LEN if draft_len is None else draft_len
        _check_draft_len(g)
        return ModelDrafter(model, draft_len=int(g))
    missing = [m for m in ("draft_len", "feature_layers", "start", "propose", "commit") if not hasattr(drafter, m)]
    if missing:
        raise TypeError(f"drafter must be a model (kvjax.load_hf) or a drafter object with draft_len, feature_layers, "
                        f"start, propose and commit (kvjax.speculative.loop); {type(drafter).__name__} lacks "
                        f"{', '.join(missing)}")
    if draft_len is not None and draft_len != drafter.draft_len:
        raise ValueError(f"draft_len={draft_len} but this drafter drafts {drafter.draft_len} tokens per round; leave "
                         "draft_len unset for a drafter object (its draft_len is fixed when it is built)")
    _check_draft_len(drafter.draft_len)
    return drafter


def _check_draft_len(g) -> None:
    if not isinstance(g, (int, np.integer)) or g < 1:
        raise ValueError(f"draft_len must be an integer >= 1 (tokens drafted per round), got {g!r}")


def _prepare(prompts, max_new_tokens: int, draft_len: int, cfgs, temperature: float, top_p: float, key,
             eos_token_ids, pad_token_id, prompt_lengths=None) -> Prepared:
    """kvjax.generation.prepare with what a speculative round needs: draft_len + 1 positions written past each row's
    end, within every model's max_position_embeddings."""
    return prepare(prompts, cfgs, max_new_tokens, prompt_lengths=prompt_lengths, temperature=temperature,
                   top_p=top_p, key=key, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                   extra=draft_len + 1, check_positions=True, what="speculative decoding")


def loop_verifier(verifier: Model) -> Model:
    """The verifier as the loop runs it: on CPU a tied head gets an explicit [D, V] copy of the embedding (one
    transpose per call), because XLA:CPU's GEMM repacks a [V, D] right operand on every call: with the verify pass's
    gamma + 1 rows the toy source's unembedding took 2.0 ms as [V, D] and 1.3 ms as [D, V] (5 rows; 1 row: 0.43 ms
    either way). The logits are the same products summed in another order (float rounding only)."""
    params = verifier.params
    if params.lm_head is not None or jax.default_backend() != "cpu":
        return verifier
    return Model(verifier.cfg, params.replace(lm_head=jnp.asarray(params.embed).T))


def _check_layers(layers, cfg) -> tuple[int, ...]:
    layers = tuple(int(i) for i in layers)
    if any(not 0 <= i < cfg.num_layers for i in layers):
        raise ValueError(f"drafter.feature_layers {layers} must be verifier layers in 0..{cfg.num_layers - 1}")
    return layers


def speculative_generate(verifier, drafter, prompts, max_new_tokens: int, *, draft_len: int | None = None,
                         builder: CacheBuilder | None = None, temperature: float = 0.0, top_p: float = 1.0,
                         key=None, return_stats: bool = False, eos_token_ids=None, pad_token_id: int | None = None,
                         prompt_lengths=None):
    """Speculative decoding: `drafter` proposes `draft_len` tokens per round, `verifier` checks them in one forward.

    verifier: a model as kvjax.load_hf returns it (Model or (cfg, params)). drafter: a model sharing the verifier's
    vocabulary (it drafts from its own cache, one forward per token; draft_len default 4), "lookup" (prompt lookup:
    copies what followed the context's latest n-gram match, no model; kvjax.speculative.LookupDrafter) or a drafter
    object (kvjax.speculative.loop: e.g. a block drafter reading the verifier's features; its draft_len is its own).
    prompts: token lists of any lengths or an int array [B, T] (as kvjax.generate takes them; with
    `prompt_lengths` [B] its rows are right-padded, so many lengths share one compiled program). builder: the
    CacheBuilder that makes the VERIFIER's cache of each prompt but its last token (default NativePrefill of the
    verifier; e.g. kvjax.Mapped(drafter, verifier, kvmap) for a transferred cache, though then the drafter prefills
    separately; speculative_split_generate shares one prefill).

    Greedy (temperature 0) output is the verifier's greedy decode from that cache (token-identical to
    kvjax.generate with the default builder, up to float rounding); with temperature > 0 (explicit `key`) the output
    is distributed as the verifier's sampling with the same temperature and top_p. Each row stops at EOS
    (`eos_token_ids`, default the verifier's) and later positions hold the pad id. Returns int32 [B, max_new_tokens],
    and with `return_stats` also a kvjax.speculative.Stats (rounds, accepted drafts, per-round acceptance, tau).
    """
    verifier = as_model(verifier)
    vcfg = verifier.cfg
    drafter = _as_drafter(drafter, draft_len, vcfg.vocab_size)
    layers = _check_layers(drafter.feature_layers, vcfg)
    cfgs = (vcfg,) + ((drafter.model.cfg,) if isinstance(drafter, ModelDrafter) else ())
    b = _prepare(prompts, max_new_tokens, drafter.draft_len, cfgs, temperature, top_p, key, eos_token_ids,
                 pad_token_id, prompt_lengths)
    features = None
    if builder is not None:
        if builder.model[0] != vcfg:
            raise ValueError(f"builder {builder!r} builds a cache for another model than the verifier; pass a builder "
                             "whose answering model is the verifier")
        if layers:
            raise ValueError("this drafter reads the verifier's hidden features of the prompt, which only the "
                             "verifier's own prefill computes; drop builder=")
        if b.prefix_lengths.min() < 1:
            raise ValueError("with a builder every prompt needs at least 2 tokens (the builder reads all but the last)")
        cache = builder(b.prefix, b.prefix_lengths, capacity=b.capacity)
    elif layers:
        cache, features = NativePrefill(verifier).with_features(b.prefix, b.prefix_lengths, layers=layers,
                                                                capacity=b.capacity)
    else:
        cache = NativePrefill(verifier)(b.prefix, b.prefix_lengths, capacity=b.capacity)
    state = drafter.start(b.prefix, b.prefix_lengths, b.capacity, features)
    out, counters = run_loop(loop_verifier(verifier), drafter, cache, state, b.last, b.key, int(max_new_tokens),
                             b.sampling, b.eos, b.pad)
    return (out, stats_of(counters, drafter.draft_len)) if return_stats else out


def transfer_builder(small, large, kvmap: KVMap, repair_layers: int = 0, repair_mode: str = "bottom", *,
                     tail_tokens: int = 0, impl: str = "xla", shared: SourcePrefill | None = None) -> CacheBuilder:
    """The builder whose cache the large model verifies from in speculative_split_generate: Mapped, or
    PartialRecompute with `repair_layers` large-model layers recomputed (`repair_mode` "bottom" or "top"); with
    `tail_tokens`, the large model then reads each prompt's last that many tokens itself on top (NativeTail);
    `shared`: the small model's prefill, when its cache also serves another purpose (the drafter's cache).
    kvjax.generate_from(transfer_builder(...), prompts, N) is the greedy output speculative_split_generate equals."""
    return repaired(small, large, kvmap, repair_layers, repair_mode, tail_tokens, impl=impl, shared=shared)


def speculative_split_generate(small, large, kvmap: KVMap, prompts, max_new_tokens: int, *, draft_len: int = 4,
                               repair_layers: int = 0, repair_mode: str = "bottom", tail_tokens: int = 0,
                               temperature: float = 0.0,
                               top_p: float = 1.0, key=None, eos_token_ids=None, pad_token_id: int | None = None,
                               timings: bool = False, impl: str = "xla") -> SpecResult:
    """Speculative KV transfer. The small model prefills each prompt (but its last token) ONCE; `kvmap` (fitted with
    the small model as source and the large one as target) maps that cache into the large model's coordinates, the
    large model optionally recomputes `repair_layers` of its layers over the prompt (`repair_mode` "bottom": layers
    0..k-1, "top": the last k; kvjax.builders.partial), then the small model drafts from its own cache and the large
    model verifies from the mapped one (the verify loop of kvjax.speculative.loop). With `tail_tokens` the large
    model also reads each prompt's last that many tokens itself, on top of the mapped (repaired) rest
    (kvjax.builders.NativeTail).

    Returns SpecResult(tokens int32 [B, N], phases, stats). With `timings` the phases are seconds, each measured with
    block_until_ready (so they do not overlap): prefill (small model), map, repair (0 without repair), tail (0
    without one), decode (the
    speculative loop; includes compiling on a first call, so time a second call). Greedy output equals the large
    model's greedy decode from the mapped (repaired) cache: kvjax.generate_from(transfer_builder(small, large, kvmap,
    repair_layers, repair_mode, tail_tokens=tail_tokens), prompts, N). Arguments otherwise as speculative_generate.
    """
    small, large = as_model(small), as_model(large)
    check_models(kvmap, small.cfg, large.cfg)
    _check_draft_len(draft_len)
    recompute_layers(large.cfg.num_layers, int(repair_layers), repair_mode)  # the placement is checked up front
    if tail_tokens < 0:
        raise ValueError(f"tail_tokens={tail_tokens}: pass 0 (no native tail) or more")
    drafter = _as_drafter(small, draft_len, large.cfg.vocab_size)
    b = _prepare(prompts, max_new_tokens, draft_len, (large.cfg, small.cfg), temperature, top_p, key, eos_token_ids,
                 pad_token_id)
    if b.prefix_lengths.min() < 1:
        raise ValueError("speculative_split_generate needs prompts of at least 2 tokens (all but the last are "
                         "prefilled and mapped)")
    clock = Clock(enabled=timings)
    shared = SourcePrefill(small)  # one prefill of the small model: the map's input and the drafter's cache
    small_cache = shared(b.prefix, b.prefix_lengths, capacity=b.capacity, clock=clock)
    builder = transfer_builder(small, large, kvmap, int(repair_layers), repair_mode, tail_tokens=int(tail_tokens),
                               impl=impl, shared=shared)
    cache = builder(b.prefix, b.prefix_lengths, capacity=b.capacity, clock=clock)
    state = drafter.from_cache(small_cache)  # the drafter continues from the very prefill that was mapped
    out, counters = clock("decode", run_loop(loop_verifier(large), drafter, cache, state, b.last, b.key,
                                             int(max_new_tokens), b.sampling, b.eos, b.pad))
    phases = clock.phases
    phases = {"prefill": phases.get("source_prefill", 0.0), "map": phases.get("map", 0.0),
              "repair": phases.get("recompute", 0.0), "tail": phases.get("tail", 0.0),
              "decode": phases.get("decode", 0.0)} if timings else {}
    return SpecResult(tokens=out, phases=phases, stats=stats_of(counters, draft_len))

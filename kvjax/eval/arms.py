"""Evaluation arms: the ways a prompt's cache can be made for the model that answers, as one table (`TABLE`).

  target    the target reads the prompt itself (native small model)
  direct    the target answers from the source's nearest-depth layers copied as they are (no map); when the KV
            widths differ, each layer's features are cut or zero-padded to the target's width (the "raw" baseline)
  perhead   the per-head ridge peer (kvjax.fitting.perhead, Heo et al.: each target KV head on its top-k source
            layers, fixed lambda, no residual); fitted when RunConfig.peers.perhead_topk > 0
  bridge    the bridge map (kvjax.fitting.bridge, CacheBridge-style: each target KV head on its best-matched source
            KV heads, the fit weighted by the target's attention mass); fitted when RunConfig.peers.bridge_topk > 0
  ridge     the target answers from the source cache mapped by the ridge map
  residual  the same with the ridge + residual map
  partial   the final map's cache with k target layers recomputed natively (kvjax.builders.PartialRecompute; k and
            the placement from RunConfig.arms)
  tail      the final map's cache with each prompt's last tokens read by the target itself (kvjax.builders.
            NativeTail; how many from RunConfig.arms.tail_tokens)
  partial_tail  both: the partial arm's cache with the tail arm's native tail on top (kvjax.builders.repaired)
  source    the source reads and answers (native large model)

Each row names the arm (its key in configs, eval records and metrics.json), its legend label and chart colour, how
its cache is built (a kvjax.builders builder) and the fitted map it needs. The table's order is the order of report columns and chart legends:
the native target first, the source's own answer last. How to add an arm: see kvjax.eval.suite.

The scorers here run every arm on one batch of items before moving on, so the arms that read the source share one
source prefill per batch (kvjax.builders.SourcePrefill), which is what a large source costs most; batching keeps per-call overhead
small.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.builders import (CacheBuilder, Mapped, NativePrefill, NativeTail, PartialRecompute, SourcePrefill,
                            repaired)
from kvjax.cache import KVCache, cache_jit
from kvjax.eval.arm_settings import ArmSettings
from kvjax.eval.likelihood import bucket, continuation_logprobs, fit_capacity
from kvjax.eval.multiple_choice import MCItem, MCResult, PrefixFn, encode
from kvjax.eval.needle_retrieval import RetrievalItem, RetrievalResult
from kvjax.generation import pad_prompts
from kvjax.models.model import Model
from kvjax.mapper.kvmap import KVMap
from kvjax.models.decoder import forward

# ---- the table -----------------------------------------------------------------------------------------------------

class ArmContext(NamedTuple):
    """What an arm's cache is built from."""

    source: Model
    target: Model
    map: Callable[[str], KVMap]  # a map by name: "direct" (kvjax.mapper.injection.injection_map) or a fitted map ("ridge", "residual")
    shared: SourcePrefill  # the source's prefill (a builder), shared by every arm that reads the source
    final: str  # the run's final map ("residual", or "ridge" when the residual is not trained)
    settings: ArmSettings  # RunConfig.arms


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    name: str  # key in configs (eval.*.arms), eval records and metrics.json
    label: str  # chart legend
    colour: str  # chart colour
    cache: Callable[[ArmContext], CacheBuilder]  # how its cache is built (kvjax.builders)
    needs: str | None = None  # the fitted map it reads (a stage of the job); None: it exists in every run
    # the fields of RunConfig.arms it is built with (a change in one reruns the evaluations that score it)
    reads_settings: tuple[str, ...] = ()


TARGET, DIRECT, RIDGE, RESIDUAL, PARTIAL, SOURCE = "target", "direct", "ridge", "residual", "partial", "source"
TAIL, PARTIAL_TAIL = "tail", "partial_tail"
PERHEAD = "perhead"
BRIDGE = "bridge"

TABLE = (
    ArmSpec(TARGET, "native target", "#4C72B0", lambda c: NativePrefill(c.target, name=TARGET)),
    ArmSpec(DIRECT, "direct injection", "#937860",
            lambda c: Mapped(c.source, c.target, c.map(DIRECT), name=DIRECT, shared=c.shared)),
    ArmSpec(PERHEAD, "per-head ridge (peer)", "#DA8BC3",
            lambda c: Mapped(c.source, c.target, c.map(PERHEAD), name=PERHEAD, shared=c.shared), needs=PERHEAD),
    ArmSpec(BRIDGE, "bridge (head-matched, attention-weighted)", "#64B5CD",
            lambda c: Mapped(c.source, c.target, c.map(BRIDGE), name=BRIDGE, shared=c.shared), needs=BRIDGE),
    ArmSpec(RIDGE, "ridge", "#8172B3", lambda c: Mapped(c.source, c.target, c.map(RIDGE), name=RIDGE, shared=c.shared),
            needs=RIDGE),
    ArmSpec(RESIDUAL, "ridge + residual", "#55A868",
            lambda c: Mapped(c.source, c.target, c.map(RESIDUAL), name=RESIDUAL, shared=c.shared), needs=RESIDUAL),
    ArmSpec(PARTIAL, "partial recompute", "#C44E52",
            lambda c: PartialRecompute(c.source, c.target, c.map(c.final), c.settings.partial_k,
                                       c.settings.partial_mode, name=PARTIAL, shared=c.shared),
            reads_settings=("partial_k", "partial_mode")),
    ArmSpec(TAIL, "map + native tail", "#8C8C8C",
            lambda c: NativeTail(c.source, c.target, c.map(c.final), c.settings.tail_tokens, name=TAIL,
                                 shared=c.shared), reads_settings=("tail_tokens",)),
    ArmSpec(PARTIAL_TAIL, "partial recompute + native tail", "#E6A0C4",
            lambda c: repaired(c.source, c.target, c.map(c.final), c.settings.partial_k, c.settings.partial_mode,
                               c.settings.tail_tokens, name=PARTIAL_TAIL, shared=c.shared),
            reads_settings=("partial_k", "partial_mode", "tail_tokens")),
    ArmSpec(SOURCE, "native source", "#DD8452", lambda c: c.shared),
)
ARMS = {a.name: a for a in TABLE}


def available(names, fitted) -> tuple[str, ...]:
    """The arms of `names` a run that fits the maps `fitted` can build (unknown names are kept: preflight names
    them)."""
    return tuple(a for a in names if a not in ARMS or ARMS[a].needs is None or ARMS[a].needs in fitted)


def in_table_order(names) -> list[str]:
    """`names` (arm names, any iterable) in the table's order: the order of report columns and chart legends."""
    names = set(names)
    return [a.name for a in TABLE if a.name in names]


class Arm(NamedTuple):
    name: str
    model: Model  # the model that scores / answers
    prefix_fn: PrefixFn  # (context_ids, rows) -> cache of context_ids[:-1], `rows` identical rows (kvjax.eval.score_mc)
    batch_fn: Callable  # (tokens int [B, T], lengths int [B]) -> that model's cache of each row's tokens[:length]


def repeat_rows(cache: KVCache, rows: int) -> KVCache:
    """A 1-row cache repeated to `rows` identical rows."""
    if rows == 1:
        return cache
    return cache.map_layers(lambda a: jnp.repeat(a, rows, axis=0), lengths=jnp.repeat(cache.lengths, rows))


def _one_context(cache: Callable, context_ids, rows: int) -> KVCache:
    """The item-by-item scorers' prefix function (kvjax.eval.score_mc / score_retrieval) from a batch cache."""
    prefix, lengths = _padded([list(context_ids[:-1])])
    return repeat_rows(cache(prefix, lengths), rows)


def make_arms(names, source: Model, target: Model, maps, final: str = RESIDUAL,
              settings: ArmSettings = ArmSettings()) -> list[Arm]:
    """Arms in the order of `names`. `maps`: name -> KVMap, a dict or a function (the job's, which loads on first
    use); the arms that read a map ("direct", "ridge", "residual", and "partial" the `final` one) need it."""
    def get(name: str) -> KVMap:
        if callable(maps):
            return maps(name)
        if name not in maps:
            raise ValueError(f"no map {name!r} for the arms {list(names)} (have {sorted(maps)})")
        return maps[name]

    ctx = ArmContext(source, target, get, SourcePrefill(source, name=SOURCE), final, settings)
    out = []
    for name in names:
        if name not in ARMS:
            raise ValueError(f"arm {name!r}: not in the arm table; arms are {', '.join(ARMS)} (kvjax.eval.arms)")
        cache = functools.partial(ARMS[name].cache(ctx), bucketed=True)  # bucketed token axis: few compiles
        out.append(Arm(name, cache.func.model, functools.partial(_one_context, cache), cache))
    return out


def even_batch(n: int, batch_size: int) -> int:
    """The batch size <= batch_size that splits n items into the fewest batches with the least padding."""
    batches = -(-n // max(1, batch_size))
    return -(-n // batches)


def _padded(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int32 [N, max(1, longest)] and lengths [N] (empty rows allowed)."""
    lengths = np.asarray([len(x) for x in seqs], np.int32)
    out = np.zeros((len(seqs), max(1, int(lengths.max()))), np.int32)
    for i, x in enumerate(seqs):
        out[i, : len(x)] = x
    return out, lengths


def score_mc_arms(items: list[MCItem], tokenizer, arms: list[Arm], normalize: str = "length", batch_size: int = 8,
                  progress: bool = True, desc: str = "multiple choice") -> dict[str, MCResult]:
    """Every arm on every item, `batch_size` items (x K options rows) at a time; within a batch the mapped arms share
    one source prefill. Same scores as kvjax.eval.score_mc item by item (a short last batch repeats its last item
    so every batch has one shape)."""
    if not items or len({len(it.options) for it in items}) != 1:
        raise ValueError("need a non-empty list of items that all have the same number of options")
    k = len(items[0].options)
    encoded = []
    for it in items:
        context, options = encode(tokenizer, it.context), [encode(tokenizer, o) for o in it.options]
        if not context or not all(options):
            raise ValueError(f"the context and every option need at least one token: {it}")
        encoded.append((context, options, [len(o.encode()) for o in it.options]))
    scores = {a.name: ([], []) for a in arms}
    bs = even_batch(len(items), batch_size)
    for start in tqdm(range(0, len(items), bs), desc=desc, unit="batch", disable=not progress):
        chunk = encoded[start : start + bs]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (bs - real)
        prefix, lengths = _padded([c[:-1] for c, _, _ in chunk])
        last = np.repeat(np.asarray([c[-1] for c, _, _ in chunk], np.int32), k)
        conts, cont_lengths = pad_prompts([o for _, options, _ in chunk for o in options])
        for arm in arms:
            cfg, params = arm.model
            cache = repeat_rows(arm.batch_fn(prefix, lengths), k)  # row b*K + j: item b's context, option j
            total, n = continuation_logprobs(params, cfg, cache, last, conts, cont_lengths)
            scores[arm.name][0].append(total.reshape(bs, k)[:real])
            scores[arm.name][1].append(n.reshape(bs, k)[:real])
    labels = np.asarray([it.label for it in items])
    n_bytes = np.asarray([b for _, _, b in encoded])
    return {name: MCResult(np.concatenate(lp), np.concatenate(nt), n_bytes, labels, normalize)
            for name, (lp, nt) in scores.items()}


@functools.partial(cache_jit, static_argnames=("cfg",))
def _teacher_forced(params, cfg, cache, tokens, answer_lengths):
    """tokens [B, 1 + A] = last prompt token then the answer: (answer sum log-prob [B], top token at each answer
    position [B, A] (-1 past each row's length))."""
    logits = forward(params, cfg, tokens, cache, lengths=1 + answer_lengths).logits
    logits = logits[:, :-1].astype(jnp.float32)  # position j predicts answer token j
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, 1:, None], -1)[..., 0]
    mask = jnp.arange(tokens.shape[1] - 1)[None, :] < answer_lengths[:, None]
    return jnp.where(mask, logp, 0.0).sum(1), jnp.where(mask, jnp.argmax(logits, -1), -1)


def answer_scores(model: Model, cache: KVCache, last, answers, answer_lengths):
    """(exact match [B], answer log-prob [B], top tokens [B, A]) of answers right-padded [B, A] after a prefix cache
    and each prompt's last token. Exact match = every answer token is the model's top prediction given the answer
    so far, i.e. greedy decoding would produce the answer; one teacher-forced pass instead of a decode loop."""
    cfg, params = model
    answers, answer_lengths = np.asarray(answers, np.int32), np.asarray(answer_lengths, np.int32)
    tokens = np.concatenate([np.asarray(last, np.int32)[:, None], answers], axis=1)
    cache = fit_capacity(cache, bucket(int(jnp.max(cache.lengths)) + tokens.shape[1]))
    logprob, top = _teacher_forced(params, cfg, cache, jnp.asarray(tokens), jnp.asarray(answer_lengths))
    top = np.asarray(top)
    mask = np.arange(answers.shape[1])[None, :] < answer_lengths[:, None]
    return np.all((top == answers) | ~mask, axis=1), np.asarray(logprob), top


def score_retrieval_arms(items: list[RetrievalItem], arms: list[Arm], batch_size: int = 8, progress: bool = True,
                         desc: str = "retrieval") -> dict[str, RetrievalResult]:
    """Exact-match retrieval for every arm, `batch_size` items at a time (see answer_scores; same `correct` and
    `answer_logprob` as kvjax.eval.score_retrieval's greedy decoding; `generated` holds the model's top token at each
    answer position, which is greedy decoding's output up to its first miss). A short last batch repeats its last
    item so every batch has one shape."""
    if not items:
        raise ValueError("no retrieval items")
    rows = {a.name: ([], [], []) for a in arms}
    bs = even_batch(len(items), batch_size)
    for start in tqdm(range(0, len(items), bs), desc=desc, unit="batch", disable=not progress):
        chunk = items[start : start + bs]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (bs - real)
        prefix, lengths = pad_prompts([it.prompt_ids[:-1] for it in chunk])
        last = np.asarray([it.prompt_ids[-1] for it in chunk], np.int32)
        answers, answer_lengths = pad_prompts([it.answer_ids for it in chunk])
        for arm in arms:
            correct, logprob, top = answer_scores(arm.model, arm.batch_fn(prefix, lengths), last, answers,
                                                  answer_lengths)
            generated, hits, lp = rows[arm.name]
            for i in range(real):
                generated.append(top[i, : int(answer_lengths[i])].tolist())
                hits.append(float(correct[i]))
                lp.append(float(logprob[i]))
    return {name: RetrievalResult(np.asarray(c, np.float64), g, np.asarray(lp)) for name, (g, c, lp) in rows.items()}

"""Needle retrieval (RULER style): exact match of a greedy continuation that must copy a fact from far back.

An item is a prompt (a long context with a fact inserted early, then a query) and the answer tokens. The prefix
cache holds prompt[:-1] (native prefill, or a mapped arm's `prefix_fn`); the model then runs the last prompt token
and greedily decodes len(answer) tokens. Correct = every generated token equals the answer's. The teacher-forced
log-probability of the answer is reported too, a smoother signal than exact match.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.cache import KVCache, cache_jit, check_compatible
from kvjax.eval.likelihood import bucket, continuation_logprobs, fit_capacity, native_prefix_cache
from kvjax.eval.multiple_choice import PrefixFn, encode
from kvjax.generation import greedy_continuation
from kvjax.models.family import DecoderConfig
from kvjax.models.params import Params


@dataclasses.dataclass(frozen=True)
class RetrievalItem:
    prompt_ids: list[int]
    answer_ids: list[int]
    length: int  # len(prompt_ids)
    needle_position: int  # token index in the prompt where the inserted fact starts
    prompt: str = ""
    answer: str = ""


@dataclasses.dataclass(frozen=True)
class RetrievalResult:
    correct: np.ndarray  # float [N]: 1.0 where the greedy continuation equals the answer exactly
    generated: list[list[int]]  # the greedy tokens of each item (len(answer_ids) each)
    answer_logprob: np.ndarray  # float [N]: teacher-forced sum log-prob of the answer tokens

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())


def load_retrieval(path: str, tokenizer, limit: int | None = None) -> list[RetrievalItem]:
    """Items from JSONL rows {"prompt", "answer", "length", "needle_position", ...}. The prompt is re-tokenized
    (the files store text only, to stay small); a row whose token count differs from its `length` is an error
    (wrong tokenizer)."""
    items = []
    with open(path) as f:
        for line in f:
            if limit is not None and len(items) == limit:
                break
            row = json.loads(line)
            prompt_ids = encode(tokenizer, row["prompt"])
            if len(prompt_ids) != row["length"]:
                raise ValueError(f"{path}: prompt tokenizes to {len(prompt_ids)} tokens, the file says "
                                 f"{row['length']}; use the tokenizer the set was built with")
            items.append(RetrievalItem(prompt_ids, row["answer_ids"], row["length"], row["needle_position"],
                                       row["prompt"], row["answer"]))
    return items


@functools.partial(cache_jit, static_argnames=("cfg", "n_new"))
def _greedy(params, cfg, cache, last_tokens, n_new):
    """Run last_tokens [B] after the cache, then greedy-decode: int32 [B, n_new] (no EOS stop)."""
    return greedy_continuation(params, cfg, cache, last_tokens, n_new)


def greedy_from_prefix(params: Params, cfg: DecoderConfig, prefix_cache: KVCache, last_tokens, n_new: int):
    """Greedy continuation int32 [B, n_new] of a cache holding prompt[:-1] and the prompts' last tokens [B]."""
    check_compatible(cfg, prefix_cache)
    capacity = bucket(int(jnp.max(prefix_cache.lengths)) + 1 + n_new)
    cache = fit_capacity(prefix_cache, capacity)
    return np.asarray(_greedy(params, cfg, cache, jnp.asarray(last_tokens, jnp.int32), n_new))


def score_item(item: RetrievalItem, params: Params, cfg: DecoderConfig, prefix_fn: PrefixFn):
    """(generated ids [A], exact match, answer sum log-prob) of one item."""
    cache = prefix_fn(item.prompt_ids, 1)
    last = np.asarray(item.prompt_ids[-1:], np.int32)
    out = greedy_from_prefix(params, cfg, cache, last, len(item.answer_ids))[0]
    logprob, _ = continuation_logprobs(params, cfg, cache, last, np.asarray([item.answer_ids]),
                                       [len(item.answer_ids)])
    return out.tolist(), out.tolist() == list(item.answer_ids), float(logprob[0])


def score_retrieval(items: list[RetrievalItem], params: Params, cfg: DecoderConfig, prefix_fn: PrefixFn | None = None,
                    progress: bool = True) -> RetrievalResult:
    """Exact match of greedy generation for every item. prefix_fn(prompt_ids, 1) -> a cache (1 row) holding
    prompt_ids[:-1]; default: the model's own prefill."""
    if not items:
        raise ValueError("no retrieval items")
    prefix_fn = prefix_fn or functools.partial(native_prefix_cache, params, cfg)
    rows = [score_item(it, params, cfg, prefix_fn)
            for it in tqdm(items, desc="retrieval", unit="item", disable=not progress)]
    generated, correct, logprob = zip(*rows)
    return RetrievalResult(np.asarray(correct, np.float64), list(generated), np.asarray(logprob))

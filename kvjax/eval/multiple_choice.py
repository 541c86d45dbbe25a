"""Multiple-choice evaluation (HellaSwag / PIQA style) by continuation log-likelihood.

Each item is a context and K options; the model scores every option as a continuation of the context and picks the
best. Tokenization: the context and each option are encoded separately (no special tokens) and concatenated as
ids, so the option keeps its own leading whitespace. When the context does not end in whitespace and an option does
not start with it, the loaders insert one space before the option (the lm-eval-harness convention for the hub
datasets, whose endings carry no leading space); the toy sets of launch/toy/evalsets.py end contexts with a newline
and start options at the next line, so their text is used as is.

Scores (`normalize`): "length" = sum log-prob / number of option tokens (default: the toy options are built with
similar token counts); "bytes" = sum log-prob / UTF-8 bytes of the option (lm-eval-harness `acc_norm`); "none" =
sum log-prob (`acc`). Every result keeps the per-option sums and counts, so all three are available afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable

import numpy as np
from tqdm import tqdm

from kvjax.cache import KVCache
from kvjax.eval.likelihood import continuation_logprobs, native_prefix_cache
from kvjax.generation import pad_prompts
from kvjax.models.family import DecoderConfig
from kvjax.models.params import Params

SCHEMAS = ("hellaswag", "piqa")
NORMALIZE = ("length", "bytes", "none")
PrefixFn = Callable[[list, int], KVCache]  # (context_ids, n_options) -> cache [n_options rows] of context_ids[:-1]


@dataclasses.dataclass(frozen=True)
class MCItem:
    context: str
    options: list[str]
    label: int  # index of the correct option


@dataclasses.dataclass(frozen=True)
class MCResult:
    """Per-item arrays (N items, K options) for accuracy and paired statistics."""

    logprobs: np.ndarray  # float [N, K]: sum log-prob of each option
    n_tokens: np.ndarray  # int [N, K]
    n_bytes: np.ndarray  # int [N, K]
    labels: np.ndarray  # int [N]
    normalize: str

    @property
    def scores(self) -> np.ndarray:
        """float [N, K]: the option scores under `normalize`."""
        denom = {"length": self.n_tokens, "bytes": self.n_bytes, "none": 1}[self.normalize]
        return self.logprobs / denom

    @property
    def predictions(self) -> np.ndarray:
        return self.scores.argmax(axis=1)

    @property
    def correct(self) -> np.ndarray:
        """float [N]: 1.0 where the prediction is the label (ready for kvjax.eval.stats)."""
        return (self.predictions == self.labels).astype(np.float64)

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())

    def renormalized(self, normalize: str) -> "MCResult":
        return dataclasses.replace(self, normalize=_check_normalize(normalize))


def _check_normalize(normalize: str) -> str:
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}, got {normalize!r}")
    return normalize


def _join_option(context: str, option: str) -> str:
    """The option as it follows the context: a space is inserted only if neither side has whitespace there."""
    return option if not context or context[-1].isspace() or option[:1].isspace() else " " + option


def _item(row: dict, schema: str) -> MCItem:
    if schema == "hellaswag":
        context, options = row["ctx"], list(row["endings"])
    else:
        context, options = row["goal"], [row["sol1"], row["sol2"]]
    label = row["label"]
    if label in ("", None):
        raise ValueError(f"an item has no label (hub test splits are unlabelled; use split='validation'): {row}")
    if not 0 <= int(label) < len(options):
        raise ValueError(f"label {label} is not an index into the {len(options)} options of {row}")
    return MCItem(context, [_join_option(context, o) for o in options], int(label))


def _read_hub(name: str, split: str) -> list[dict]:
    import datasets
    try:
        return list(datasets.load_dataset(name, split=split))
    except (ConnectionError, OSError) as e:
        raise RuntimeError(f"could not load hub dataset {name!r} (split {split!r}): {e}\nThis machine may be "
                           f"offline. Pass a local JSONL file instead (load_mc('path/to/{split}.jsonl', schema=...)),"
                           f" e.g. the toy sets in checkpoints/toy/eval/, or download the dataset where there is "
                           f"network and save it with Dataset.to_json.") from e


def load_mc(path_or_name: str, schema: str = "hellaswag", split: str = "validation",
            limit: int | None = None) -> list[MCItem]:
    """Items from a local JSONL file (one object per line in `schema`'s fields), or from a hub dataset name.

    hellaswag: {"ctx": str, "endings": [str, ...], "label": int | str}; piqa: {"goal", "sol1", "sol2", "label"}.
    Anything that is an existing file or ends in .jsonl is read locally; `split` applies to hub datasets only.
    """
    if schema not in SCHEMAS:
        raise ValueError(f"schema must be one of {SCHEMAS}, got {schema!r}")
    if os.path.isfile(path_or_name) or str(path_or_name).endswith(".jsonl"):
        if not os.path.isfile(path_or_name):
            raise FileNotFoundError(f"no such JSONL file: {path_or_name}")
        with open(path_or_name) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        rows = _read_hub(path_or_name, split)
    rows = rows[:limit] if limit is not None else rows
    try:
        return [_item(row, schema) for row in rows]
    except KeyError as e:
        raise ValueError(f"{path_or_name}: a row lacks field {e} of the {schema!r} schema") from e


def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens, from a `tokenizers.Tokenizer` or a transformers tokenizer."""
    enc = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(enc, "ids", enc))


def score_item(item: MCItem, tokenizer, params: Params, cfg: DecoderConfig, prefix_fn: PrefixFn):
    """(sum log-prob [K], tokens [K], bytes [K]) of one item's options."""
    context = encode(tokenizer, item.context)
    options = [encode(tokenizer, o) for o in item.options]
    if not context or not all(options):
        raise ValueError(f"the context and every option need at least one token: {item}")
    k = len(options)
    conts, lengths = pad_prompts(options)
    total, n = continuation_logprobs(params, cfg, prefix_fn(context, k), np.full((k,), context[-1], np.int32),
                                     conts, lengths)
    return total, n, np.asarray([len(o.encode()) for o in item.options])


def score_mc(items: list[MCItem], tokenizer, params: Params, cfg: DecoderConfig, *, prefix_fn: PrefixFn | None = None,
             normalize: str = "length", progress: bool = True) -> MCResult:
    """Score every option of every item (all items must have the same number of options K).

    prefix_fn(context_ids, K) returns a cache of `cfg`'s model with K rows holding context_ids[:-1]; by default the
    model's own prefill (`native_prefix_cache`). A mapped arm passes a function that maps another model's cache.
    """
    _check_normalize(normalize)
    if not items or len({len(it.options) for it in items}) != 1:
        raise ValueError("need a non-empty list of items that all have the same number of options")
    prefix_fn = prefix_fn or functools.partial(native_prefix_cache, params, cfg)
    rows = [score_item(it, tokenizer, params, cfg, prefix_fn)
            for it in tqdm(items, desc="multiple choice", unit="item", disable=not progress)]
    logprobs, n_tokens, n_bytes = (np.stack(col) for col in zip(*rows))
    return MCResult(logprobs, n_tokens, n_bytes, np.asarray([it.label for it in items]), normalize)

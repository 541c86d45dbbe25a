"""Needle retrieval items for any tokenizer, built in token space from held-out text (RULER-style).

A prompt of exactly `length` tokens: held-out text with the line "<key> = <value>" inserted 10-20% of the way in,
ending with the query "<key> =". The answer " <value>" must be copied from far back. The toy pair ships sets built
with line-aware placement (launch/toy/evalsets.py); this builder serves other tokenizers (e.g. Qwen3 32B -> 8B).
"""

from __future__ import annotations

import string

import numpy as np

from kvjax.eval.multiple_choice import encode
from kvjax.eval.needle_retrieval import RetrievalItem

DEPTH = (0.1, 0.2)


def make_needle_items(heldout_tokens: np.ndarray, tokenizer, length: int, n: int, seed: int = 0,
                      value_digits: int = 5) -> list[RetrievalItem]:
    """n items of `length` tokens from a flat held-out token array (deterministic in seed and length)."""
    rng = np.random.default_rng([seed, length])
    tokens = np.asarray(heldout_tokens).reshape(-1)
    items = []
    for _ in range(n):
        key = "_cfg_" + "".join(rng.choice(list(string.ascii_lowercase), 4))
        value = "".join(str(d) for d in rng.integers(1, 10, value_digits))
        needle = encode(tokenizer, f"\n{key} = {value}\n")
        query, answer = encode(tokenizer, f"\n{key} ="), encode(tokenizer, f" {value}")
        if encode(tokenizer, f"\n{key} = {value}") != query + answer:
            raise ValueError(f"this tokenizer merges the query {key!r} = with the answer; needle items need them to "
                             "tokenize separately")
        hay = length - len(needle) - len(query)
        if hay < 16 or len(tokens) < hay:
            raise ValueError(f"retrieval at {length} tokens needs at least {max(hay, 16)} held-out tokens of haystack "
                             f"(have {len(tokens)})")
        start = int(rng.integers(0, len(tokens) - hay + 1))
        haystack = tokens[start : start + hay].tolist()
        pos = int(rng.integers(int(DEPTH[0] * length), int(DEPTH[1] * length) + 1))
        prompt = haystack[:pos] + needle + haystack[pos:] + query
        items.append(RetrievalItem(prompt, answer, len(prompt), pos, answer=f" {value}"))
    return items

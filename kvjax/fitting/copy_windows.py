"""Fact-copy windows: training windows whose continuation is a long-range copy of a "key = value" fact.

Why the residual needs them (docs/method.md, "Retrieval through the mapped cache"): the target answers a needle by
attending from the repeated key back to the fact, far up the prompt, through one "reader" layer whose keys must carry
previous-token information. The ridge fits the target's *native* keys, and a pruned target may have lost the layer
that writes that information (the toy's pruned target lost source layer 1); the residual can write it, but only if
its objective ever scores a continuation that depends on distant context. The ordinary 256 + 64 KL windows almost
never do (on the toy's text, 16.8% of their continuation tokens are copyable at all, mostly < 64 back; the needle
sits ~870 back), so the map retrieves nothing (0/200 at 1K) while the source retrieves 97.5%.

A fact-copy window is `length` tokens of training text with a `span`-token fact written into it `gap` tokens before
its end (gap drawn from [max(64, span), length - 64]: near and far copies alike), then the fact again as the
continuation. The fact is 2-5 key tokens drawn from the window itself (a key that looks like the text), the separator
tokens, then value tokens drawn uniformly from an alphabet (what a needle's answer is made of): with the defaults
" = " and "0123456789" it reads like `timeout_x = 41199`. KL to the teacher is scored on the repeat after its first
COPY_SKIP tokens (before those, nothing says a copy is coming; after, an induction head predicts every token).

Everything here is a pure function of its arguments (seeded numpy), so a rerun and a resumed run make the same windows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KEY_TOKENS = (2, 5)  # key length range (inclusive), as the toy source's own fact-copy training phase drew them
MIN_GAP = 64  # the nearest and (from the window's start) the farthest a fact sits from the repeat
COPY_SKIP = 2  # repeat tokens not scored: the first key token cannot be foreseen, the second barely
RANDOM = "*"  # the separator setting that draws each fact's separator from the window's own text
RANDOM_SEPARATOR = (1, 3)  # its length range (inclusive), in tokens


@dataclasses.dataclass(frozen=True)
class FactFormat:
    """A fact's token ids: what separates key from value (empty: RANDOM, each fact's own 1-3 tokens of its window's
    text), and the value alphabet (one token per symbol)."""

    separator: tuple[int, ...]
    values: tuple[int, ...]

    def max_separator(self) -> int:
        return len(self.separator) if self.separator else RANDOM_SEPARATOR[1]

    def min_span(self) -> int:
        """The shortest span that holds the longest key, the separator and a value token scored after COPY_SKIP."""
        return max(KEY_TOKENS[1] + self.max_separator() + 1, COPY_SKIP + 1)


def fact_format(tokenizer, separator: str, values: str) -> FactFormat:
    """The FactFormat of text settings under a `tokenizers.Tokenizer` (e.g. " = " and "0123456789"; the separator
    RANDOM, "*": drawn per fact from the text, so that what the map learns to carry is no one format's). Each value
    symbol must be a single token (as Qwen3's tokenizer splits digits): a multi-token symbol would make values whose
    tokens the model never sees together."""
    sep = () if separator == RANDOM else tuple(tokenizer.encode(separator, add_special_tokens=False).ids)
    if not sep and separator != RANDOM:
        raise ValueError(f"the fact separator {separator!r} tokenizes to nothing; use visible text such as ' = '")
    ids = []
    for ch in dict.fromkeys(values):  # distinct, in order
        got = tokenizer.encode(ch, add_special_tokens=False).ids
        if len(got) != 1:
            raise ValueError(f"the fact value symbol {ch!r} is {len(got)} tokens under this tokenizer; each symbol "
                             "of the value alphabet must be one token (e.g. the digits '0123456789')")
        ids.append(got[0])
    if not ids:
        raise ValueError("the fact value alphabet is empty; use e.g. '0123456789'")
    return FactFormat(sep, tuple(ids))


def gap_range(length: int, span: int) -> tuple[int, int]:
    """(nearest, farthest) distance from a fact's start to the window's end (the repeat), inclusive."""
    return max(MIN_GAP, span), length - MIN_GAP


def fact_windows(tokens: np.ndarray, n: int, length: int, span: int, fmt: FactFormat,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(windows int32 [n, length + span], fact starts int [n]): `length` tokens of text cut at uniform offsets of
    `tokens` with a fact written at the start, followed by the fact again (window[:, length:] == the span there)."""
    lo, hi = gap_range(length, span)
    if span < fmt.min_span() or lo > hi:
        raise ValueError(f"fact-copy windows of {length} + {span} tokens: the span must be >= {fmt.min_span()} and "
                         f"the length >= {2 * MIN_GAP} and >= span + {MIN_GAP}")
    if len(tokens) < length:
        raise ValueError(f"need at least {length} training tokens for a fact-copy window, got {len(tokens)}")
    rng = np.random.default_rng([seed, 1021])  # a stream of its own: not the text windows' draws
    starts = rng.integers(0, len(tokens) - length + 1, n)
    values = np.asarray(fmt.values, np.int32)
    out = np.zeros((n, length + span), np.int32)
    at = np.zeros(n, np.int64)
    for i, s in enumerate(starts):
        w = np.array(tokens[s : s + length], np.int32)
        a = length - int(rng.integers(lo, hi + 1))
        key = int(rng.integers(KEY_TOKENS[0], KEY_TOKENS[1] + 1))
        separator = fmt.separator
        if not separator:  # RANDOM: this fact's own separator, tokens of its window's text
            separator = w[rng.integers(0, length, int(rng.integers(RANDOM_SEPARATOR[0], RANDOM_SEPARATOR[1] + 1)))]
        v = a + key + len(separator)
        w[a : a + key] = w[rng.integers(0, length, key)]
        w[a + key : v] = separator
        w[v : a + span] = rng.choice(values, a + span - v)
        out[i], at[i] = np.concatenate([w, w[a : a + span]]), a
    return out, at

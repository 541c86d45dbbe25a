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
continuation (`facts` > 1: that many facts, each at its own gap, all repeated in a drawn order). The fact is 2-5 key
tokens drawn from the window itself (a key that looks like the text), a separator (one, or one drawn per fact from
several), then value tokens drawn uniformly from an alphabet (what a needle's answer is made of): with the defaults
" = " and "0123456789" it reads like `timeout_x = 41199`. A separator may hold wildcards (WILDCARD, "?"): each is one
token of the fact's own window text, drawn per fact, so that "? " teaches the copy of a value after any token and a
space, not after a list's few (tokens the setting `avoid`s, and the value alphabet, are never drawn). KL to the
teacher is scored on each repeat after its first COPY_SKIP tokens (before those, nothing says a copy is coming;
after, an induction head predicts every token).

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
SEPARATORS = "|"  # joins several separators in one setting (" = | -> ")
WILDCARD = "?"  # in a separator: one token drawn per fact from its window's text ("? ": any token, then a space)
ANY = -1  # a wildcard's place in FactFormat.separators


@dataclasses.dataclass(frozen=True)
class FactFormat:
    """A fact's token ids: what may separate key from value (one or more separators, each fact drawing one, ANY where
    a wildcard draws a token of the window's text; empty: RANDOM, each fact's own 1-3 tokens of its window's text),
    the value alphabet (one token per symbol), and the tokens a wildcard never draws."""

    separators: tuple[tuple[int, ...], ...]
    values: tuple[int, ...]
    avoid: tuple[int, ...] = ()

    def max_separator(self) -> int:
        return max(map(len, self.separators)) if self.separators else RANDOM_SEPARATOR[1]

    def min_span(self) -> int:
        """The shortest span that holds the longest key, the longest separator and a value token scored after
        COPY_SKIP."""
        return max(KEY_TOKENS[1] + self.max_separator() + 1, COPY_SKIP + 1)


def _separator(tokenizer, text: str) -> tuple[int, ...]:
    """A separator's ids: its text pieces tokenized apart, ANY for each WILDCARD between them."""
    out: list[int] = []
    for i, piece in enumerate(text.split(WILDCARD)):
        if i:
            out.append(ANY)
        if piece:
            out.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
    return tuple(out)


def fact_format(tokenizer, separator: str, values: str, avoid: str = "") -> FactFormat:
    """The FactFormat of text settings under a `tokenizers.Tokenizer` (e.g. " = " and "0123456789"). `separator` is
    one separator, several joined by SEPARATORS (" = | -> | := ": each fact draws one, so the map learns more than
    one format's copy), or RANDOM ("*": drawn per fact from the text); a separator's WILDCARDs ("? ") are tokens drawn
    per fact from the text, never one of `avoid`'s (text joined by SEPARATORS: e.g. an evaluation's own separators,
    to keep them unseen). Each value symbol must be a single token (as Qwen3's tokenizer splits digits): a
    multi-token symbol would make values whose tokens the model never sees together."""
    seps = ()
    if separator != RANDOM:
        seps = tuple(dict.fromkeys(_separator(tokenizer, s) for s in separator.split(SEPARATORS)))
        if not all(seps):
            raise ValueError(f"the fact separator setting {separator!r} has a separator that tokenizes to nothing; "
                             f"use visible text such as ' = ' (several: ' = | -> ', any token then a space: '? ')")
    ids = []
    for ch in dict.fromkeys(values):  # distinct, in order
        got = tokenizer.encode(ch, add_special_tokens=False).ids
        if len(got) != 1:
            raise ValueError(f"the fact value symbol {ch!r} is {len(got)} tokens under this tokenizer; each symbol "
                             "of the value alphabet must be one token (e.g. the digits '0123456789')")
        ids.append(got[0])
    if not ids:
        raise ValueError("the fact value alphabet is empty; use e.g. '0123456789'")
    avoided = sorted({i for a in avoid.split(SEPARATORS) if a
                      for i in tokenizer.encode(a, add_special_tokens=False).ids})
    shown = sorted({i for sep in seps for i in sep if i in avoided})
    if shown:
        raise ValueError(f"the fact separator setting {separator!r} writes token(s) {shown} that the setting avoid "
                         f"({avoid!r}) keeps unseen; drop those separators or those avoided texts")
    return FactFormat(seps, tuple(ids), tuple(avoided))


def gap_range(length: int, span: int) -> tuple[int, int]:
    """(nearest, farthest) distance from a fact's start to the window's end (the repeat), inclusive."""
    return max(MIN_GAP, span), length - MIN_GAP


def max_facts(length: int, span: int) -> int:
    """The most facts of `span` tokens a window of `length` holds apart, each within gap_range."""
    lo, hi = gap_range(length, span)
    return max(0, (hi - lo) // span + 1)


def fact_windows(tokens: np.ndarray, n: int, length: int, span: int, fmt: FactFormat,
                 seed: int, facts: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(windows int32 [n, length + facts * span], fact starts int [n, facts]): `length` tokens of text cut at uniform
    offsets of `tokens` with `facts` facts written at the starts (each at its own gap, no two overlapping), followed by
    every fact again, in an order drawn per window (window[:, length:] is the facts' spans, each `span` long). More
    facts a window give the copy more to learn from for the same pass of the map over the window's text."""
    lo, hi = gap_range(length, span)
    if span < fmt.min_span() or lo > hi:
        raise ValueError(f"fact-copy windows of {length} + {span} tokens: the span must be >= {fmt.min_span()} and "
                         f"the length >= {2 * MIN_GAP} and >= span + {MIN_GAP}")
    if not 1 <= facts <= max_facts(length, span):
        raise ValueError(f"{facts} facts of {span} tokens do not fit apart where a fact may start ({hi - lo + 1} "
                         f"positions); use 1..{max_facts(length, span)} facts a window, or a longer copy_len")
    if len(tokens) < length:
        raise ValueError(f"need at least {length} training tokens for a fact-copy window, got {len(tokens)}")
    rng = np.random.default_rng([seed, 1021])  # a stream of its own: not the text windows' draws
    starts = rng.integers(0, len(tokens) - length + 1, n)
    values = np.asarray(fmt.values, np.int32)
    never = np.asarray(fmt.values + fmt.avoid, np.int32)  # what a wildcard does not draw
    out = np.zeros((n, length + facts * span), np.int32)
    at = np.zeros((n, facts), np.int64)
    for i, s in enumerate(starts):
        w = np.array(tokens[s : s + length], np.int32)
        if facts == 1:  # the draw the windows of one fact always made
            at[i] = length - int(rng.integers(lo, hi + 1))
        else:  # apart by construction: sorted draws from a range `facts - 1` spans shorter, the j-th moved j spans on
            first = np.sort(rng.integers(length - hi, length - lo - (facts - 1) * span + 1, facts))
            at[i] = first + span * np.arange(facts)
        for a in at[i]:
            key = int(rng.integers(KEY_TOKENS[0], KEY_TOKENS[1] + 1))
            if not fmt.separators:  # RANDOM: this fact's own separator, tokens of its window's text
                n_sep = int(rng.integers(RANDOM_SEPARATOR[0], RANDOM_SEPARATOR[1] + 1))
                separator = w[rng.integers(0, length, n_sep)]
            elif len(fmt.separators) > 1:  # several: each fact draws one (one separator draws nothing)
                separator = fmt.separators[int(rng.integers(len(fmt.separators)))]
            else:
                separator = fmt.separators[0]
            if ANY in separator:  # wildcards: tokens of this window's text, none avoided and none a value's
                pool = w[~np.isin(w, never)]
                if not len(pool):
                    raise ValueError("a fact-copy window's text holds no token a separator wildcard may draw")
                separator = np.where(np.asarray(separator) == ANY, pool[rng.integers(0, len(pool), len(separator))],
                                     separator)
            v = a + key + len(separator)
            w[a : a + key] = w[rng.integers(0, length, key)]
            w[a + key : v] = separator
            w[v : a + span] = rng.choice(values, a + span - v)
        order = rng.permutation(facts) if facts > 1 else [0]
        out[i] = np.concatenate([w, *(w[at[i, j] : at[i, j] + span] for j in order)])
    return out, at

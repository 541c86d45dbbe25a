"""RULER-style retrieval tasks for any tokenizer, built in token space from held-out text (evaluation `ruler`).

Every item is a prompt of exactly `length` tokens: a window of held-out tokens with one or more facts ("needles",
each "\\n" + its line + "\\n") inserted at token positions drawn uniformly between `depth` fractions of the haystack,
ending with a query; the answer must be copied (or, for `vt`, resolved) from far back and is scored by greedy exact
match of its tokens (kvjax.eval.arms.score_retrieval_arms). The tasks (TASKS):

  niah_single_kv      "<ident> = <digits>"  queried "<ident> =" -> " <digits>": the fact format the map was trained on
                      (kvjax.fitting.copy_windows: "key = digits"), built like the other rows: the seen-format control
  niah_single_secret  "The secret code for <word> is <digits>."  queried "The secret code for <word> is" (unseen)
  niah_single_json    "\\"<uuid>\\": \\"<digits>\\","  queried "\\"<uuid>\\": \\"" -> "<digits>" (unseen; uuid-like key
                      "7f3a9c2e-1b4d")
  niah_single_colon   "<word>: <digits>"  queried "<word>:" (unseen)
  niah_multikey       `needles` facts "<ident> = <digits>" with different keys and values, one of them asked; the
                      others are the distractors
  niah_multivalue     one key given `values` different values in as many facts "<ident> = <digits>"; the query
                      "<ident> =" asks for all of them: the answer is " v1, v2, v3" (values in the order they appear)
  vt                  variable tracking: "VAR <A> = <digits>", "VAR <B> = <A>", ... `chains` chains of `chain`
                      variables each (5 random capitals), each chain assigned in order, the chains' lines interleaved
                      at random through the haystack; the query "assert <last> ==" asks the value the last variable of
                      one chain holds -> " <digits>". The other chains hold other values: copying the only number
                      assigned would otherwise answer without tracking anything

Keys: identifiers like "_cfg_qmzx" (the trained format's), lowercase English words, or uuid-like hex strings; values
are `value_digits` digits without a leading zero. Within an item every key and value differs, and the haystack
window is redrawn while it holds an answer's tokens (so only the needles can be copied). Items are deterministic in
(seed, length, task name). A tokenizer that merges a query with its answer, or a value with the text around it in
its needle, cannot score exact match: building raises ValueError saying which task and text.
"""

from __future__ import annotations

import dataclasses
import string
import zlib

import numpy as np

UNSEEN = ("niah_single_secret", "niah_single_json", "niah_single_colon")  # formats never shown in training
WORDS = ("apple", "river", "garden", "window", "candle", "forest", "rocket", "pencil", "silver", "harbor", "island",
         "marble", "orange", "planet", "thunder", "violin", "wizard", "yellow", "anchor", "bridge", "castle",
         "desert", "engine", "falcon", "glacier", "hammer", "jungle", "kettle", "lantern", "meadow", "needle",
         "oyster", "pepper", "quartz", "saddle", "tunnel", "velvet", "walnut", "blanket", "compass", "dolphin",
         "feather", "giraffe", "horizon", "lobster", "mustard", "octopus", "pumpkin", "sparrow", "tractor",
         "volcano", "whistle", "biscuit", "cabinet", "diamond", "emerald", "fountain", "guitar", "helmet", "jacket")
KEY_WORDS = ("cfg", "opt", "tmp", "val", "ref", "buf", "key", "idx", "num", "ptr", "lim", "tag")
HEX = "0123456789abcdef"
ATTEMPTS = 50  # haystack draws per item before giving up (each must not hold an answer's tokens)


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    kind: str  # "single", "multikey", "multivalue" or "vt"
    needle: str  # the inserted fact, with {key} and {value}; starts and ends with a newline
    query: str  # the prompt's last text, with {key}
    answer: str  # what the model must generate, with {value}
    keys: str  # "ident", "word" or "uuid" (vt: its own capitals)

    @property
    def unseen(self) -> bool:
        return self.name in UNSEEN


KV = ("\n{key} = {value}\n", "\n{key} =", " {value}")
TASKS = {t.name: t for t in (
    Task("niah_single_kv", "single", *KV, "ident"),
    Task("niah_single_secret", "single", "\nThe secret code for {key} is {value}.\n", "\nThe secret code for {key} is",
         " {value}", "word"),
    Task("niah_single_json", "single", '\n"{key}": "{value}",\n', '\n"{key}": "', "{value}", "uuid"),
    Task("niah_single_colon", "single", "\n{key}: {value}\n", "\n{key}:", " {value}", "word"),
    Task("niah_multikey", "multikey", *KV, "ident"),
    Task("niah_multivalue", "multivalue", *KV, "ident"),
    Task("vt", "vt", "\nVAR {key} = {value}\n", "\nassert {key} ==", " {value}", "vt"),
)}
TASK_NAMES = tuple(TASKS)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The tasks' shape settings (eval.ruler's): needle depth range, multikey needles, multivalue values, vt chain
    length and chains."""

    depth: tuple[float, float] = (0.1, 0.9)
    needles: int = 4
    values: int = 3
    chain: int = 4
    chains: int = 2
    value_digits: int = 5


def _encode(tokenizer, text: str) -> list[int]:
    from kvjax.eval.multiple_choice import encode
    return encode(tokenizer, text)


def _key(kind: str, rng) -> str:
    letters = list(string.ascii_lowercase)
    if kind == "word":
        return str(rng.choice(WORDS))
    if kind == "uuid":
        return "".join(rng.choice(list(HEX), 8)) + "-" + "".join(rng.choice(list(HEX), 4))
    if kind == "vt":
        return "".join(rng.choice(list(string.ascii_uppercase), 5))
    return f"_{rng.choice(KEY_WORDS)}_{''.join(rng.choice(letters, 4))}"


def _distinct(draw, n: int, what: str) -> list[str]:
    out = []
    for _ in range(100 * n):
        x = draw()
        if x not in out:
            out.append(x)
            if len(out) == n:
                return out
    raise ValueError(f"could not draw {n} distinct {what}")


def _contains(hay: np.ndarray, sub: list[int]) -> bool:
    if len(sub) == 0 or len(hay) < len(sub):
        return False
    windows = np.lib.stride_tricks.sliding_window_view(hay, len(sub))
    return bool(np.any(np.all(windows == np.asarray(sub), axis=1)))


def _check(tokenizer, task: Task, query: str, answer: str) -> tuple[list[int], list[int]]:
    """(query ids, answer ids), checking that the two tokenize the same apart as together."""
    q, a = _encode(tokenizer, query), _encode(tokenizer, answer)
    if not a or _encode(tokenizer, query + answer) != q + a:
        raise ValueError(f"ruler task {task.name}: this tokenizer merges the query {query!r} with the answer "
                         f"{answer!r} (or the answer is empty); exact match needs them to tokenize separately")
    return q, a


def _needle(tokenizer, task: Task, key: str, value: str, must_hold: list[int] | None) -> list[int]:
    ids = _encode(tokenizer, task.needle.format(key=key, value=value))
    if must_hold is not None and not _contains(np.asarray(ids), must_hold):
        raise ValueError(f"ruler task {task.name}: the needle {task.needle.format(key=key, value=value)!r} does not "
                         f"hold the tokens of {value!r} as they are generated ({must_hold}): this tokenizer merges "
                         "the value with the text around it, so the answer cannot be copied")
    return ids


def task_parts(tokenizer, task: Task, rng, sizes: Sizes):
    """(needles [list of ids, in prompt order], query ids, answer ids, answer text, index of the needle whose
    position the item records, the values' ids: the haystack must not hold them) of one draw."""
    digits = sizes.value_digits
    value = lambda: str(rng.integers(10 ** (digits - 1), 10 ** digits))  # noqa: E731
    if task.kind == "vt":  # `chains` chains, interleaved at random (each in its own order); the first one asked
        names = _distinct(lambda: _key("vt", rng), sizes.chain * sizes.chains, "variable names")
        values = _distinct(value, sizes.chains, "values")
        chains = [names[c * sizes.chain : (c + 1) * sizes.chain] for c in range(sizes.chains)]
        query, answer = task.query.format(key=chains[0][-1]), task.answer.format(value=values[0])
        q, a = _check(tokenizer, task, query, answer)
        held = [_encode(tokenizer, task.answer.format(value=v)) for v in values]
        lines = [[_needle(tokenizer, task, chain[0], v, h)] + [_needle(tokenizer, task, n, p, None)
                                                               for p, n in zip(chain, chain[1:])]
                 for chain, v, h in zip(chains, values, held)]
        order = rng.permutation(np.repeat(np.arange(sizes.chains), sizes.chain))  # which chain's next line goes next
        needles, at = [], [0] * sizes.chains
        for c in order:
            needles.append(lines[c][at[c]])
            at[c] += 1
        return needles, q, a, answer, int(np.flatnonzero(order == 0)[0]), held
    if task.kind == "multivalue":
        key = _key(task.keys, rng)
        values = _distinct(value, sizes.values, "values")
        answer = task.answer.format(value=", ".join(values))
        q, a = _check(tokenizer, task, task.query.format(key=key), answer)
        held = [_encode(tokenizer, task.answer.format(value=v)) for v in values]
        return [_needle(tokenizer, task, key, v, h) for v, h in zip(values, held)], q, a, answer, 0, held
    n = sizes.needles if task.kind == "multikey" else 1
    keys = _distinct(lambda: _key(task.keys, rng), n, "keys")
    values = _distinct(value, n, "values")
    asked = int(rng.integers(n))
    answer = task.answer.format(value=values[asked])
    q, a = _check(tokenizer, task, task.query.format(key=keys[asked]), answer)
    held = [_encode(tokenizer, task.answer.format(value=v)) for v in values]
    return [_needle(tokenizer, task, k, v, h) for k, v, h in zip(keys, values, held)], q, a, answer, asked, held


def task_seed(seed: int, length: int, name: str) -> list[int]:
    return [seed, length, zlib.crc32(name.encode())]


def make_task_items(task: str | Task, heldout_tokens: np.ndarray, tokenizer, length: int, n: int, seed: int = 0,
                    sizes: Sizes = Sizes()) -> list:
    """n kvjax.eval.needle_retrieval.RetrievalItem of `length` tokens for one task, from a flat held-out token array
    (deterministic in seed, length and the task's name). `needle_position` is where the asked needle starts (the
    first needle for multivalue, the asked chain's first for vt)."""
    from kvjax.eval.needle_retrieval import RetrievalItem
    task = TASKS[task] if isinstance(task, str) else task
    lo, hi = sizes.depth
    if not 0 <= lo < hi <= 1:
        raise ValueError(f"ruler depth must be 0 <= lo < hi <= 1, got {sizes.depth}")
    rng = np.random.default_rng(task_seed(seed, length, task.name))
    tokens = np.asarray(heldout_tokens).reshape(-1)
    items = []
    for _ in range(n):
        needles, query, answer, text, marked, values = task_parts(tokenizer, task, rng, sizes)
        hay = length - sum(map(len, needles)) - len(query)
        if hay < 16:
            raise ValueError(f"ruler {task.name}: a prompt of {length} tokens cannot hold its "
                             f"{length - hay} needle and query tokens and 16 tokens of haystack; use longer lengths")
        if len(tokens) < hay:
            raise ValueError(f"ruler {task.name} at {length} tokens needs at least {hay} held-out tokens of haystack "
                             f"(have {len(tokens)})")
        for _ in range(ATTEMPTS):
            start = int(rng.integers(0, len(tokens) - hay + 1))
            haystack = tokens[start : start + hay]
            if not any(_contains(haystack, v) for v in values):
                break
        else:
            raise ValueError(f"ruler {task.name}: every haystack drawn holds a value of the item (answer {text!r})")
        span = np.arange(int(lo * hay), max(int(hi * hay), int(lo * hay) + len(needles)) + 1)
        cuts = np.sort(rng.choice(span, len(needles), replace=False))
        prompt, prev, where = [], 0, []
        for cut, needle in zip(cuts, needles):
            prompt += haystack[prev:cut].tolist()
            where.append(len(prompt))
            prompt += needle
            prev = int(cut)
        prompt += haystack[prev:].tolist() + query
        items.append(RetrievalItem(prompt, answer, len(prompt), where[marked], answer=text))
    return items

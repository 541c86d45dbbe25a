"""Speculative decoding timed side by side: the large model decoding natively, drafting by the small model from its own
prefill (plain), drafting from a speculative KV transfer (the small model prefills once, its cache is mapped,
optionally repaired, into the large model's, which verifies from it; kvjax.speculative), on request the same transfer
with the prompt's last tokens read by the large model itself on top ("tail": kvjax.builders.NativeTail), and, on
request, the large model drafting for itself by prompt lookup (no small model; kvjax.speculative.LookupDrafter).

One request = the cache of all but the prompt's last token, then `new_tokens` generated tokens (the first included;
EOS ignored, so every arm makes the same number). Each arm runs once per round in a rotating order; round 0 compiles
and is not counted. Per arm and round: end-to-end seconds, its phases, acceptance (tokens per verify round), and how
its output compares with the large model's native greedy output (plain drafting must equal it; a transfer decodes from
the mapped cache, so its agreement with native output is the transfer's accuracy).
"""

from __future__ import annotations

import time

import jax
import numpy as np
from tqdm import tqdm

from kvjax.builders import CacheBuilder, Clock, NativePrefill
from kvjax.mapper.kvmap import KVMap
from kvjax.split import native_generate
from kvjax.models.model import Model

NATIVE, PLAIN, TRANSFER, REPAIRED, LOOKUP, TAIL = "native", "plain", "transfer", "repaired", "lookup", "tail"


class _Prebuilt(CacheBuilder):
    """Hands the verify loop a cache built (and timed) beforehand: the plain arm's native prefill."""

    def __init__(self, model, cache):
        self.model, self.cache, self.name = tuple(model), cache, "prebuilt"

    def build(self, tokens, lengths, capacity: int, clock: Clock):
        if capacity != self.cache.capacity:
            raise ValueError(f"prebuilt cache has capacity {self.cache.capacity}, the loop asked for {capacity}")
        return self.cache


def _capacity(length: int, new_tokens: int, draft_len: int) -> int:
    from kvjax.generation import CACHE_ALIGN
    return -(-(length + new_tokens + draft_len + 1) // CACHE_ALIGN) * CACHE_ALIGN  # as kvjax.speculative sizes it


def _run(arm: str, small: Model, large: Model, kvmap: KVMap, prompts: np.ndarray, new_tokens: int, draft_len: int,
         repair: tuple[int, str], tail: int = 0) -> dict:
    """One request of one arm: {"seconds", "phases", "tokens" [B, N], "tau" (None for native)}."""
    from kvjax.speculative import speculative_generate, speculative_split_generate
    t0 = time.perf_counter()
    if arm == NATIVE:
        tokens, phases = native_generate(large, prompts, new_tokens, eos_token_ids=(), timings=True)
        stats = None
    elif arm in (PLAIN, LOOKUP):
        clock = Clock()
        t = prompts.shape[1] - 1
        cache = clock("prefill", NativePrefill(large)(prompts[:, :t], capacity=_capacity(prompts.shape[1],
                                                                                         new_tokens, draft_len)))
        drafter = small if arm == PLAIN else "lookup"
        tokens, stats = clock("decode", speculative_generate(large, drafter, prompts, new_tokens, draft_len=draft_len,
                                                             builder=_Prebuilt(large, cache), eos_token_ids=(),
                                                             return_stats=True))
        phases = dict(clock.phases)  # decode = the drafter's start (the small model's own prefill) + the verify loop
    else:
        k, mode = repair if arm in (REPAIRED, TAIL) else (0, "bottom")
        r = speculative_split_generate(small, large, kvmap, prompts, new_tokens, draft_len=draft_len, repair_layers=k,
                                       repair_mode=mode, tail_tokens=tail if arm == TAIL else 0, eos_token_ids=(),
                                       timings=True)
        tokens, phases, stats = r.tokens, r.phases, r.stats
    tokens = np.asarray(jax.block_until_ready(tokens))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "phases": {k: float(v) for k, v in phases.items()}, "tokens": tokens,
            "tau": None if stats is None else float(stats.mean_acceptance_length)}


def _agreement(tokens: np.ndarray, native: np.ndarray) -> tuple[float, float, float]:
    """(all tokens equal, mean matching prefix / N, first token equal), averaged over rows."""
    same = tokens == native
    prefix = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
    return float(same.all(1).mean()), float((prefix / same.shape[1]).mean()), float(same[:, 0].mean())


def measure_speculative(small: Model, large: Model, kvmap: KVMap, tokens: np.ndarray, lengths, *,
                        draft_lens=(4,), new_tokens: int = 64, repeats: int = 3, batch_size: int = 1,
                        repair: tuple[int, str] | None = (1, "bottom"), lookup: bool = False, tail: int = 0,
                        progress: bool = True) -> dict[int, dict]:
    """Per prompt length, per arm ("native", then "plain@G", "transfer@G", "repaired@G", with `tail` "tail@G" and
    with `lookup` "lookup@G" for each draft length G):
    {"seconds": [per timed round], "phases": [{phase: s}], "tau": float | None, "exact", "prefix", "first"}, the
    last three comparing its output with the native arm's. `tokens`: a flat held-out token array; row r of a batch
    is its r-th consecutive slice of each length. `repair`: (layers, mode) of the repaired arm, None to leave it out.
    `tail` > 0: the tail arm, the transfer (repaired as the repaired arm, when there is one) with each prompt's last
    `tail` tokens read by the large model itself."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    kinds = [PLAIN, TRANSFER] + ([REPAIRED] if repair and repair[0] > 0 else []) + ([TAIL] if tail > 0 else []) \
        + ([LOOKUP] if lookup else [])
    arms = [(NATIVE, 0)] + [(k, g) for g in draft_lens for k in kinds]
    name = lambda arm, g: arm if arm == NATIVE else f"{arm}@{g}"  # noqa: E731
    out = {}
    bar = tqdm(total=len(lengths) * (repeats + 1) * len(arms), desc="speculative", unit="run", disable=not progress)
    for length in lengths:
        if len(tokens) < length * batch_size:
            raise ValueError(f"speculative decoding at {length} tokens x batch {batch_size} needs "
                             f"{length * batch_size} held-out tokens, have {len(tokens)}")
        prompts = tokens[: length * batch_size].reshape(batch_size, length)
        rows = {name(a, g): {"seconds": [], "phases": [], "tau": None} for a, g in arms}
        outputs = {}
        for r in range(repeats + 1):
            for arm, g in arms[r % len(arms):] + arms[: r % len(arms)]:
                res = _run(arm, small, large, kvmap, prompts, new_tokens, g, repair or (0, "bottom"), tail)
                row = rows[name(arm, g)]
                outputs[name(arm, g)] = res["tokens"]  # greedy: the same every round
                row["tau"] = res["tau"]
                if r:
                    row["seconds"].append(res["seconds"])
                    row["phases"].append(res["phases"])
                bar.update()
        for n, row in rows.items():
            row["exact"], row["prefix"], row["first"] = _agreement(outputs[n], outputs[NATIVE])
        out[int(length)] = rows
    bar.close()
    return out

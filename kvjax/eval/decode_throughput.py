"""Throughput vs prefix length, measured the way the method's report does.

For each prefix length the same prompt goes through three arms, each generating a fixed number of new tokens
(EOS never stops them):
  target  the target prefills and decodes (native small model)
  source  the source prefills and decodes (native large model)
  mapped  the source prefills, the map translates the cache, the target decodes (kvjax.split_generate)
Phases are timed with block_until_ready (kvjax.split): prefill (source_prefill + map on the mapped path),
first_token (the prompt's last token: its logits give the first new token), decode (every later token).

  decode tok/s = (new tokens - 1) x batch / decode seconds       (tokens after the first / their time)
  TTFT         = prefill (+ map + transfer) + first_token
  active s     = native: prefill + first_token + decode; mapped: source prefill + first token + decode counted
                 once, map and transfer counted on both participating devices (x2), as in the method's accounting.
                 Here both models share the same devices, so transfer is 0 and the x2 is the method's convention.

Every arm is compiled in a warm-up round; then `repeats` timed rounds run the arms interleaved (rotating order) and
the medians are reported. A decode of a small model takes milliseconds, so within a round the decode phase is re-run
`decode_repeats` times from the same cache and its median is that round's decode time.

The mapped-vs-target decode comparison is the claim that matters (the answer phase runs at the small model's
speed), and both decodes are the same program on caches of the same shape: on a noisy machine, timing them minutes
apart measured noise (ratios 0.89-1.19 at 256 tokens across runs). With `paired_decode` > 0 (default 15), their
decode_tps come instead from kvjax.split.paired_decode_seconds: the two decodes timed alternately that many
times each from two prefilled caches (medians); the rounds' own decode times stay in phases_s.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from kvjax.models.model import Model
from kvjax.mapper.kvmap import KVMap
from kvjax.split import native_generate, paired_decode_seconds, split_generate

ARMS = ("target", "source", "mapped")
MAP_DEVICES = 2  # devices the map and transfer phases are counted on (the method's accounting)


def ttft_seconds(arm: str, phases: dict) -> float:
    if arm == "mapped":
        return phases["source_prefill"] + phases["map"] + phases.get("transfer", 0.0) + phases["first_token"]
    return phases["prefill"] + phases["first_token"]


def active_seconds(arm: str, phases: dict) -> float:
    if arm == "mapped":
        return (phases["source_prefill"] + phases["first_token"] + phases["decode"]
                + MAP_DEVICES * (phases["map"] + phases.get("transfer", 0.0)))
    return phases["prefill"] + phases["first_token"] + phases["decode"]


def _run(arm: str, source: Model, target: Model, kvmap: KVMap, prompts: np.ndarray, new_tokens: int,
         decode_repeats: int) -> dict:
    kw = dict(eos_token_ids=(), timings=True, decode_repeats=decode_repeats)
    if arm == "mapped":
        out, phases = split_generate(source, target, kvmap, prompts, new_tokens, **kw)
    else:
        out, phases = native_generate(source if arm == "source" else target, prompts, new_tokens, **kw)
    if np.asarray(out).shape != (len(prompts), new_tokens):
        raise RuntimeError(f"{arm}: expected {new_tokens} new tokens per row, got {np.asarray(out).shape}")
    return phases


def measure_throughput(source: Model, target: Model, kvmap: KVMap, tokens: np.ndarray, lengths, *,
                       new_tokens: int = 64, repeats: int = 5, batch_size: int = 1, decode_repeats: int = 1,
                       paired_decode: int = 15, progress: bool = True) -> dict[int, dict]:
    """Per prefix length: decode_tps, ttft_s, active_s, latency_s ({arm: seconds}) and phases_s ({arm: {phase: s}}),
    medians over `repeats` rounds (within a round the decode phase runs `decode_repeats` times from the same cache).
    `tokens`: a flat held-out token array; row r of a batch is the r-th consecutive slice of each length."""
    if new_tokens < 2:
        raise ValueError("new_tokens must be >= 2 (decode speed counts the tokens after the first)")
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    out = {}
    steps = len(lengths) * (repeats + 1) * len(ARMS)
    bar = tqdm(total=steps, desc="throughput", unit="run", disable=not progress)
    for length in lengths:
        if len(tokens) < length * batch_size:
            raise ValueError(f"throughput at {length} tokens x batch {batch_size} needs {length * batch_size} "
                             f"held-out tokens, have {len(tokens)}")
        prompts = tokens[: length * batch_size].reshape(batch_size, length)
        runs = {arm: [] for arm in ARMS}
        for r in range(repeats + 1):  # round 0 compiles and is not counted
            order = ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]
            for arm in order:
                phases = _run(arm, source, target, kvmap, prompts, new_tokens, decode_repeats if r else 1)
                if r:
                    runs[arm].append(phases)
                bar.update()
        med = lambda xs: float(np.median(xs))  # noqa: E731
        row = {"decode_tps": {}, "ttft_s": {}, "active_s": {}, "latency_s": {}, "phases_s": {}}
        for arm, rs in runs.items():
            row["decode_tps"][arm] = (new_tokens - 1) * batch_size / med([p["decode"] for p in rs])
            row["ttft_s"][arm] = med([ttft_seconds(arm, p) for p in rs])
            row["active_s"][arm] = med([active_seconds(arm, p) for p in rs])
            row["latency_s"][arm] = med([sum(p.values()) for p in rs])
            row["phases_s"][arm] = {k: med([p[k] for p in rs]) for k in rs[0]}
        if paired_decode > 0:
            paired = paired_decode_seconds(source, target, kvmap, prompts, new_tokens, paired_decode)
            for arm, secs in paired.items():
                row["decode_tps"][arm] = (new_tokens - 1) * batch_size / med(secs)
            row["paired_decode_s"] = {arm: med(secs) for arm, secs in paired.items()}
        row.update(new_tokens=new_tokens, batch_size=batch_size, repeats=repeats, decode_repeats=decode_repeats,
                   paired_decode=paired_decode)
        out[int(length)] = row
    bar.close()
    return out

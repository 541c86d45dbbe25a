"""Measuring lossless block drafting (kvjax.drafter) against the verifier's own greedy decoding, side by side.

For every group of prompts (one prompt at batch 1, or a batch), every method decodes it greedily once, back to back
in an order that rotates from group to group (load changes then hit every method alike): `greedy` (kvjax.generate:
prefill + the in-jit decode loop) and each drafter of `drafters` through the shared verify loop
(kvjax.speculative.loop.run_loop, after the verifier's prefill with features). Calls are timed end to end
(block_until_ready) after one compile call per padded shape. Each output is compared token for token with greedy's.
`record` keeps the rows as JSON and `summarize` turns them into medians: speed-up = median over groups of
t_greedy / t_method (paired, same moment), tokens/s = median of emitted tokens / t, tau = (accepted drafts + rounds)
/ rounds over all rounds.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

GREEDY = "greedy"


def pad_group(prompts, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded tokens int32 [B, width] and lengths [B] of token lists."""
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def methods_for(verifier, drafters: dict, new_tokens: int) -> dict:
    """name -> fn(tokens [B, T], lengths [B]) -> (output int32 [B, new_tokens], Stats or None)."""
    import jax
    import jax.numpy as jnp

    from kvjax.builders import NativePrefill
    from kvjax.generation import Sampling, aligned, generate
    from kvjax.models.model import as_model
    from kvjax.speculative.api import loop_verifier
    from kvjax.speculative.loop import run_loop, stats_of

    verifier = as_model(verifier)
    looped = loop_verifier(verifier)  # the verifier as speculative_generate runs it (an explicit [D, V] head on CPU)
    cfg, params = verifier
    eos = tuple(cfg.eos_token_ids)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    prefill = NativePrefill(verifier)

    def greedy(tokens, lengths):
        out = generate(params, cfg, tokens, new_tokens, prompt_lengths=lengths)
        return np.asarray(jax.block_until_ready(out)), None

    def speculative(drafter, tokens, lengths):
        """kvjax.speculative_generate's steps with prompt lengths, so a padded shape compiles once."""
        g = drafter.draft_len
        capacity = aligned(tokens.shape[1] + new_tokens + g + 1)
        prefix, plen = jnp.asarray(tokens), jnp.asarray(lengths - 1)
        last = tokens[np.arange(len(tokens)), lengths - 1]
        layers = tuple(drafter.feature_layers)
        if layers:
            cache, feats = prefill.with_features(tokens, lengths - 1, layers=layers, capacity=capacity)
        else:
            cache, feats = prefill(tokens, lengths - 1, capacity=capacity), None
        state = drafter.start(prefix, plen, capacity, feats)
        out, counters = run_loop(looped, drafter, cache, state, last, jax.random.key(0), new_tokens, Sampling(),
                                 eos, pad)
        return np.asarray(jax.block_until_ready(out)), stats_of(counters, g)

    return {GREEDY: greedy, **{name: (lambda t, n, d=d: speculative(d, t, n)) for name, d in drafters.items()}}


def measure(methods: dict, groups) -> list[dict]:
    """groups: [(tokens [B, T], lengths [B])]. Returns per group {method: (seconds, output, stats)}."""
    names = list(methods)
    for tokens, lengths in {t.shape: (t, n) for t, n in groups}.values():  # compile every shape first
        for name in names:
            methods[name](tokens, lengths)
    rows = []
    for i, (tokens, lengths) in enumerate(groups):
        rec = {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            t0 = time.perf_counter()
            out, stats = methods[name](tokens, lengths)
            rec[name] = (time.perf_counter() - t0, out, stats)
        rows.append(rec)
    return rows


def record(rows: list[dict], eos: tuple[int, ...]) -> dict:
    """JSON record of `measure`'s rows: tokens emitted per group (greedy's, up to EOS), per method the seconds and
    whether each output equals greedy's, and the drafting methods' accepted drafts and verify rounds."""
    ref = [r[GREEDY][1] for r in rows]
    out = {"emitted": [sum(int(np.argmax(hit)) + 1 if hit.any() else len(hit) for hit in np.isin(o, eos))
                       for o in ref], "methods": {}}
    for name in rows[0]:
        m = {"seconds": [r[name][0] for r in rows],
             "identical": [bool(np.array_equal(r[name][1], want)) for r, want in zip(rows, ref)]}
        if name != GREEDY:
            m["accepted"] = sum(int(np.sum(r[name][2].accepted)) for r in rows)
            m["rounds"] = sum(int(np.sum(r[name][2].rounds)) for r in rows)
        out["methods"][name] = m
    return out


def summarize(rec: dict) -> dict:
    """method -> {tok_s, median_s, speedup, identical (count), groups, tau (drafting methods)} of a `record`."""
    base = rec["methods"][GREEDY]["seconds"]
    res = {}
    for name, m in rec["methods"].items():
        times = m["seconds"]
        entry = {"tok_s": statistics.median(e / t for e, t in zip(rec["emitted"], times)),
                 "median_s": statistics.median(times),
                 "speedup": statistics.median(b / t for b, t in zip(base, times)),
                 "identical": sum(m["identical"]), "groups": len(times)}
        if name != GREEDY:
            entry["tau"] = (m["accepted"] + m["rounds"]) / max(m["rounds"], 1)
        res[name] = entry
    return res


def geomean(per_set: dict) -> dict:
    """method -> geometric-mean speed-up over the sets (and the mean tau)."""
    methods = next(iter(per_set.values()))
    return {m: {"speedup": math.exp(statistics.mean(math.log(per_set[s][m]["speedup"]) for s in per_set)),
                "tau": statistics.mean(per_set[s][m]["tau"] for s in per_set) if m != GREEDY else None}
            for m in methods}

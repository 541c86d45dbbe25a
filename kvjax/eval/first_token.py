"""Time to first token of several ways to build the answering model's cache, timed side by side in one run.

TTFT = build the cache of all but the prompt's last token (a builder: the answerer's own prefill, or the reader's
prefill + map, or + a partial recomputation) + the answerer's forward over that last token (the first new token's
logits). Every builder runs once per round in a rotating order (so a drift in machine speed hits them alike), round 0
compiles and is not counted; the caller takes medians and per-round ratios.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from kvjax.builders import CacheBuilder, Clock
from kvjax.models.decoder import decode_jit


def time_first_token(builder: CacheBuilder, prompts: np.ndarray, capacity: int) -> dict[str, float]:
    """Seconds of each phase (the builder's, then "first_token") for prompts int [B, T]; their sum is the TTFT."""
    cfg, params = builder.model
    clock = Clock()
    t = prompts.shape[1] - 1
    cache = builder(prompts[:, :t], capacity=capacity, clock=clock)
    clock("first_token", decode_jit(params, cfg, jnp.asarray(prompts[:, t]), cache)[0])
    return dict(clock.phases)


def measure_ttft(builders: dict[str, CacheBuilder], tokens: np.ndarray, lengths, *, repeats: int = 5,
                 batch_size: int = 1, headroom: int = 64, progress: bool = True) -> dict[int, dict]:
    """Per prompt length: {"rounds": {arm: [TTFT seconds per timed round]}, "phases": {arm: [{phase: s}, ...]}}.
    `tokens`: a flat held-out token array; row r of a batch is its r-th consecutive slice of each length. The cache
    holds the prompt + `headroom` positions (room to decode, as a request would allocate)."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    names = list(builders)
    out = {}
    bar = tqdm(total=len(lengths) * (repeats + 1) * len(names), desc="ttft", unit="run", disable=not progress)
    for length in lengths:
        if len(tokens) < length * batch_size:
            raise ValueError(f"TTFT at {length} tokens x batch {batch_size} needs {length * batch_size} held-out "
                             f"tokens, have {len(tokens)}")
        prompts = tokens[: length * batch_size].reshape(batch_size, length)
        rounds = {n: [] for n in names}
        phases = {n: [] for n in names}
        for r in range(repeats + 1):
            for name in names[r % len(names):] + names[: r % len(names)]:
                t0 = time.perf_counter()
                p = time_first_token(builders[name], prompts, length + headroom)
                seconds = time.perf_counter() - t0
                if r:
                    rounds[name].append(seconds)
                    phases[name].append(p)
                bar.update()
        out[int(length)] = {"rounds": rounds, "phases": phases}
    bar.close()
    return out

"""Where a drafter's rounds start, and how sure the verifier itself is there (issue 41: what holds tau down).

    python -m launch.research.round_starts --prompts 50 --blocks 16 --kinds block lookup --models \
        checkpoints/toy/pruned --refine 2                      # the spec_cost flags, the same prompts and drafters
    python -m launch.research.round_starts --smoke                       # tiny random models (the tests)

Greedy, every drafter's output is the verifier's own greedy continuation (launch.bench.spec_cost checks that token
for token), so one teacher-forced pass of the verifier over prompt + continuation gives, at every output position,
its own margin there: the log-probability of its pick minus that of its second choice. A round's first draft
predicts the token at the position where the round starts (the loop's rounds: kvjax.speculative.loop.Stats.per_round,
each round emitting its accepted drafts and one token of the verifier's), so a round that accepts nothing is a miss
of the first draft at that position.

Printed per prompt set and drafter, for margin buckets in nats: the share of all output positions in the bucket, the
share of the rounds that start there, and the share of those rounds whose first draft missed; then the share of all
first-draft misses at a margin under 0.5 nats. A drafter held back by the verifier's own near-ties misses where the
margin is small, which no drafter cheaper than the verifier can call; one held back by its own capacity misses at
large margins too.
"""

from __future__ import annotations

import os
import sys

import numpy as np

BUCKETS = (0.0, 0.1, 0.5, 1.0, 2.0, 4.0, np.inf)  # margin edges, nats


def margins(model, prompt, continuation) -> np.ndarray:
    """The verifier's top-1 minus top-2 log-probability at each continuation position, teacher-forced [N]; its top-1
    must be the continuation's token (a greedy continuation)."""
    import jax
    import jax.numpy as jnp

    import kvjax
    cfg, params = model
    tokens = np.concatenate([np.asarray(prompt, np.int32), np.asarray(continuation[:-1], np.int32)])[None]
    cache = kvjax.init_cache(cfg, 1, int(-(-tokens.shape[1] // 128) * 128))
    logits, _ = kvjax.prefill(params, cfg, jnp.asarray(tokens), cache)
    n = len(prompt)
    lp = np.asarray(jax.nn.log_softmax(logits[0, n - 1:].astype(jnp.float32), axis=-1))
    top2 = np.sort(lp, axis=-1)[:, -2:]
    if not np.array_equal(lp.argmax(-1), np.asarray(continuation)):
        raise ValueError("the continuation is not the verifier's greedy one")
    return top2[:, 1] - top2[:, 0]


def round_starts(per_round: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start position of each round, drafts it accepted) from one row's Stats.per_round (-1 after it stopped)."""
    acc = np.asarray(per_round)
    acc = acc[acc >= 0]
    return np.concatenate([[0], np.cumsum(acc + 1)[:-1]]).astype(int), acc


def tabulate(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict:
    """rows: (margins [N], round starts, accepted) per prompt -> per bucket: positions, starts, first-draft misses."""
    pos, starts, misses = np.zeros(len(BUCKETS) - 1), np.zeros(len(BUCKETS) - 1), np.zeros(len(BUCKETS) - 1)
    for m, s, a in rows:
        keep = s < len(m)  # the last round may start past the tokens kept
        s, a = s[keep], a[keep]
        pos += np.histogram(m, BUCKETS)[0]
        starts += np.histogram(m[s], BUCKETS)[0]
        misses += np.histogram(m[s[a == 0]], BUCKETS)[0]
    return {"positions": pos.tolist(), "starts": starts.tolist(), "misses": misses.tolist()}


def report(name: str, t: dict) -> str:
    pos, starts, misses = (np.asarray(t[k]) for k in ("positions", "starts", "misses"))
    lines = [f"{name}: {int(starts.sum())} rounds, first draft missed in {misses.sum() / max(starts.sum(), 1):.1%}",
             "| verifier's margin (nats) | output positions | round starts | first draft missed there |",
             "|---|---:|---:|---:|"]
    for i in range(len(BUCKETS) - 1):
        lo, hi = BUCKETS[i], BUCKETS[i + 1]
        label = f">= {lo:g}" if np.isinf(hi) else f"{lo:g} - {hi:g}"
        rate = f"{misses[i] / starts[i]:.1%}" if starts[i] else "-"
        lines.append(f"| {label} | {pos[i] / pos.sum():.1%} | {starts[i] / max(starts.sum(), 1):.1%} | {rate} |")
    near = misses[: np.searchsorted(BUCKETS, 0.5)].sum()
    lines.append(f"misses at a margin under 0.5 nats: {near / max(misses.sum(), 1):.1%} of all first-draft misses")
    return "\n".join(lines)


def main(argv=None) -> dict:
    from launch.bench import spec_cost
    from launch.bench.spec_drafters import make_drafters
    args = spec_cost.parse(argv)
    if not args.smoke:
        for path in (args.source, args.drafter, args.eval_dir):
            if not os.path.isdir(path):
                sys.exit(f"launch.research.round_starts: {path} is not a directory; run from the repository root "
                         "(the toy checkpoints ship in checkpoints/toy)")
    from kvjax.speculative.loop import stats_of
    source, sets = spec_cost.setup(args)
    drafters, _, _, builders = make_drafters(args, source)
    drafters = {k: d for k, d in drafters.items() if k not in builders}  # a transfer decodes from another cache
    out = {}
    for set_name, prompts in sets.items():
        rows = {name: [] for name in drafters}
        for prompt in prompts:
            runs = spec_cost.Runs(source, prompt, args.new, max(args.blocks))
            ref = runs.reference()
            m = margins(source, prompt, ref)
            for name, d in drafters.items():
                tokens, counters = runs.spec(d)
                if not np.array_equal(np.asarray(tokens)[0], ref):
                    raise SystemExit(f"{name} on a {set_name} prompt: output differs from greedy decoding")
                s, a = round_starts(stats_of(counters, d.draft_len).per_round[0])
                rows[name].append((m, s, a))
        out[set_name] = {name: tabulate(r) for name, r in rows.items()}
        for name, t in out[set_name].items():
            print(f"\n[{set_name}, {len(prompts)} prompts] " + report(name, t), flush=True)
    return out


if __name__ == "__main__":
    main()

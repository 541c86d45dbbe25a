"""Does accepting cost a verify round anything beyond its width? The speculative cost model prices a round by its
width alone (kvjax.speculative.cost), measured with NullDrafter rounds that accept nothing; on 2026-12-05 it
predicted lookup and the combined drafter at b = 8-16 12-15% faster than they ran, the drafters whose rounds accept
the most.

    python -m launch.research.accept_cost                    # toy source, 4 held-out windows, b = 4 / 8 / 16
    python -m launch.research.accept_cost --smoke            # tiny random model (the tests)

Per prompt, draft length b and path of the verify loop (fixed length, or the variable-length switch over widths that
lookup and the combined drafter take), three loops from the same prefilled cache, timed alternately --repeats times
(launch.bench.spec_cost's Runs and timed): plain decoding (its step s), the null round at width b + 1 (one token a
round), and the Oracle at width b + 1 accepting k = 1, b / 2 and b drafts a round (it drafts the verifier's own
greedy tokens, the first k of them right).
Reported per b: the cost of a round of each in plain steps (medians over prompts) and their ratio; a ratio above 1
is what accepting costs, which the cost model leaves out.

Second, what changing width costs (`mix-b`, the variable-length path): prompt lookup's rounds change width from one
round to the next (no match: 1; a match: up to b + 1), where the cost model's v(t) were each measured in a loop at one
width. Per prompt and b: lookup's own widths (its Stats), a null drafter replaying them in a shuffled order
(NullDrafter with a width schedule), each of those widths alone, and lookup itself, all per round in plain steps;
reported: the replay and lookup over the widths-alone mix (the cost model's price of lookup's rounds, drafting aside).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def per_round(runs, drafters: dict, want, b: int, new: int, repeats: int) -> tuple[dict, dict]:
    """Each drafter's loop from the prompt's cache: checked token-identical to `want`, then timed beside plain
    decoding (launch.bench.spec_cost's Runs and timed). Returns (seconds per round in plain steps, rounds) per key."""
    from kvjax.speculative.loop import stats_of
    from launch.bench.spec_cost import timed
    rounds = {}
    for name, d in drafters.items():  # compiles, and counts the rounds
        out, counters = runs.spec(d)
        np.testing.assert_array_equal(np.asarray(out)[0], want)  # every loop exact
        rounds[name] = int(stats_of(counters, b).rounds.sum())
    runs.plain()
    secs = timed({"plain": runs.plain, **{k: (lambda d=d: runs.spec(d)[0]) for k, d in drafters.items()}}, repeats)
    step = statistics.median(secs["plain"]) / (new - 1)
    return {k: statistics.median(secs[k]) / rounds[k] / step for k in drafters}, rounds


def measure(source, prompts, blocks, new: int, repeats: int) -> dict:
    import jax.numpy as jnp

    from kvjax.speculative.cost import NullDrafter, Oracle
    from launch.bench.spec_cost import Runs
    vocab = source.cfg.vocab_size
    rows = {(b, path, k): {"null": [], "oracle": [], "ratio": [], "oracle_tau": []}
            for b in blocks for path in ("fixed", "variable") for k in sorted({1, b // 2, b})}
    for i, prompt in enumerate(prompts):
        runs = Runs(source, prompt, new, max(blocks))
        ref = np.pad(runs.reference(), (0, max(blocks) + 1))[None]
        for (b, path, k), r in rows.items():
            variable = path == "variable"  # the loop's two paths: a fixed-length forward, or the switch over widths
            width = jnp.int32(b + 1) if variable else b + 1
            drafters = {"null": NullDrafter(vocab, draft_len=b, width=width, variable_length=variable),
                        "oracle": Oracle(jnp.asarray(ref), draft_len=b, variable_length=variable, accept=k)}
            per, rounds = per_round(runs, drafters, ref[0, :new], b, new, repeats)
            r["null"].append(per["null"])
            r["oracle"].append(per["oracle"])
            r["ratio"].append(per["oracle"] / per["null"])
            r["oracle_tau"].append(new / rounds["oracle"])
        print(f"  prompt {i + 1}/{len(prompts)}", flush=True)
    return {f"{b}-{path}-{k}": {**r, "b": b, "path": path, "accepted": k,
                                "median": {name: statistics.median(v) for name, v in r.items()}}
            for (b, path, k), r in rows.items()}


def measure_mix(source, prompts, blocks, new: int, repeats: int) -> dict:
    import jax.numpy as jnp

    from kvjax.speculative import LookupDrafter
    from kvjax.speculative.cost import NullDrafter
    from kvjax.speculative.loop import stats_of
    from launch.bench.spec_cost import Runs, replay
    vocab = source.cfg.vocab_size
    rows = {b: {"alone": [], "replay": [], "lookup": [], "replay_ratio": [], "lookup_ratio": [], "widths": []}
            for b in blocks}
    for i, prompt in enumerate(prompts):
        runs = Runs(source, prompt, new, max(blocks))
        want = runs.reference()
        for b, r in rows.items():
            lookup = LookupDrafter(vocab, draft_len=b)
            hist = np.asarray(stats_of(runs.spec(lookup)[1], b).widths)
            drafters = {"lookup": lookup, "replay": replay(vocab, b, hist, new, seed=i)}
            drafters.update({int(t): NullDrafter(vocab, draft_len=b, width=jnp.int32(int(t)), variable_length=True)
                             for t in np.nonzero(hist)[0]})
            per, _ = per_round(runs, drafters, want, b, new, repeats)
            alone = sum(int(hist[t]) * per[int(t)] for t in np.nonzero(hist)[0]) / int(hist.sum())
            r["alone"].append(alone)
            r["replay"].append(per["replay"])
            r["lookup"].append(per["lookup"])
            r["replay_ratio"].append(per["replay"] / alone)
            r["lookup_ratio"].append(per["lookup"] / alone)
            r["widths"].append(hist.tolist())
        print(f"  prompt {i + 1}/{len(prompts)} (widths)", flush=True)
    return {f"mix-{b}": {**r, "b": b, "median": {k: statistics.median(v) for k, v in r.items() if k != "widths"}}
            for b, r in rows.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="checkpoints/toy/source")
    p.add_argument("--eval-dir", default="checkpoints/toy/eval")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--smoke", action="store_true", help="a tiny random model, 2 prompts of 24 tokens, 12 new tokens")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.new < 2 or args.repeats < 1 or any(b < 1 for b in args.blocks):
        p.error("--prompts, --repeats and --blocks must be >= 1, --new >= 2")
    if args.smoke:
        from launch.bench.spec_cost import smoke_setup
        args.prompts, args.prompt_len, args.new, args.repeats = 2, 24, 12, 1
        source, sets = smoke_setup(argparse.Namespace(prompt_len=args.prompt_len, sets=["windows"]))
        prompts = sets["windows"]
    else:
        import os

        from kvjax.hf import load_hf
        if not os.path.isdir(args.source):
            raise SystemExit(f"accept_cost: {args.source} is not a directory; run from the repository root")
        source = load_hf(args.source)
        windows = np.load(os.path.join(args.eval_dir, "heldout_windows.npy"))
        prompts = [w[: args.prompt_len].astype(int).tolist() for w in windows[: args.prompts]]
    t0 = time.time()
    res = {"args": vars(args), "blocks": measure(source, prompts, args.blocks, args.new, args.repeats)}
    res["mix"] = measure_mix(source, prompts, args.blocks, args.new, args.repeats)
    res["seconds"] = time.time() - t0
    print("| b | path | accepted a round | null round (plain steps) | oracle round (plain steps) | oracle / null | "
          "oracle tau |\n|---|---|---|---|---|---|---|")
    for r in res["blocks"].values():
        m = r["median"]
        print(f"| {r['b']} | {r['path']} | {r['accepted']} | {m['null']:.2f} | {m['oracle']:.2f} | "
              f"{m['ratio']:.3f} [{min(r['ratio']):.3f}, {max(r['ratio']):.3f}] | {m['oracle_tau']:.2f} |")
    print("\n| b | lookup's rounds, widths alone (plain steps) | its widths replayed, shuffled / alone | "
          "lookup / alone |\n|---|---|---|---|")
    for r in res["mix"].values():
        m = r["median"]
        print(f"| {r['b']} | {m['alone']:.2f} | {m['replay_ratio']:.3f} [{min(r['replay_ratio']):.3f}, "
              f"{max(r['replay_ratio']):.3f}] | {m['lookup_ratio']:.3f} [{min(r['lookup_ratio']):.3f}, "
              f"{max(r['lookup_ratio']):.3f}] |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()

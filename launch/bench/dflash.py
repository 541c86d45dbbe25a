"""Block-drafter (DFlash-style) speculative decoding on the toy source: tau, tokens/s and speed-up over the source's
own greedy decode, side by side in one run, with the plain draft model (the toy target) beside it.

    python -m launch.bench.dflash --out /tmp/dflash.json                 # 5 sets x 40 prompts x 128 tokens
    python -m launch.bench.dflash --prompts 4 --new 32 --batch8 0        # a quick look

Prompt sets (held-out text only, never seen by the drafter's training, which reads the train split): windows64 /
windows256 (the first 64 / 256 tokens of checkpoints/toy/eval/heldout_windows.npy rows 0.. / 40..), hellaswag (the
contexts of hellaswag.jsonl), piqa (the goals of piqa.jsonl), retrieval1024 (the 1024-token needle prompts of
retrieval_1024.jsonl). Every method decodes each prompt greedily; each output is compared token for token with the
source's kvjax.generate output ("identical"). Methods: greedy (kvjax.generate: prefill + the in-jit decode loop),
dflash-b for each --blocks b (kvjax.drafter block drafter through the shared verify loop, kvjax.speculative), and
draft-g (the toy target as a plain draft model, gamma = --gamma). Timing: each call end to end (prefill + decode,
block_until_ready), compiled beforehand (one warm-up per padded prompt shape); for every prompt (batch 1) or batch of
8 prompts the methods run back to back in an order that rotates, so load changes hit them alike; speed-up of a set
= the median over its prompts of t_greedy / t_method, tokens/s = median of emitted tokens / t. Prompts are padded
to a multiple of 64 (prompt_lengths say the real lengths) so a few shapes compile, not one per length.
--cpu pins the process (and XLA's thread pool) to those CPUs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

SETS = ("windows64", "windows256", "hellaswag", "piqa", "retrieval1024")


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="checkpoints/toy/source")
    p.add_argument("--draft-model", default="checkpoints/toy/target", help="the plain draft model ('' to skip)")
    p.add_argument("--drafter", default="checkpoints/toy/drafter")
    p.add_argument("--eval-dir", default="checkpoints/toy/eval")
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    p.add_argument("--prompts", type=int, default=40, help="prompts per set")
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--blocks", type=int, nargs="+", default=(4, 8, 16), help="block sizes of the sweep")
    p.add_argument("--gamma", type=int, default=4, help="draft length of the plain draft model")
    p.add_argument("--refine", type=int, default=0, help="drafter refinement passes")
    p.add_argument("--batch8", type=int, default=5, help="batches of 8 prompts per set (0: skip batch 8)")
    p.add_argument("--cpu", type=str, default="", help="pin to these CPUs, e.g. 1 or 0,1")
    p.add_argument("--out", default="", help="write the results as JSON here")
    return p.parse_args(argv)


def prompt_sets(args, tok) -> dict[str, list[list[int]]]:
    import numpy as np
    n, d = args.prompts, args.eval_dir
    windows = np.load(os.path.join(d, "heldout_windows.npy")).astype(np.int64)

    def jsonl(name, field):
        with open(os.path.join(d, name)) as f:
            rows = [json.loads(line) for _, line in zip(range(n), f)]
        return [tok.encode(r[field]).ids for r in rows]

    out = {"windows64": [w[:64].tolist() for w in windows[:n]],
           "windows256": [w[:256].tolist() for w in windows[n:2 * n]]}
    for name, (file, field) in {"hellaswag": ("hellaswag.jsonl", "ctx"), "piqa": ("piqa.jsonl", "goal"),
                                "retrieval1024": ("retrieval_1024.jsonl", "prompt")}.items():
        if name in args.sets:
            out[name] = jsonl(file, field)
    return {k: v for k, v in out.items() if k in args.sets}


def main(argv=None) -> None:
    args = parse(argv)
    if args.cpu:
        os.sched_setaffinity(0, {int(c) for c in args.cpu.split(",")})  # before JAX sizes its thread pool
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.builders.native import prefill_cache_jit
    from kvjax.cache import init_cache
    from kvjax.drafter import load_block_drafter
    from kvjax.generation import CACHE_ALIGN, Sampling, generate
    from kvjax.hf import load_hf, load_tokenizer
    from kvjax.models.decoder import forward_features
    from kvjax.speculative import ModelDrafter
    from kvjax.speculative.loop import run_loop, stats_of

    source = load_hf(args.source)
    cfg = source.cfg
    eos = tuple(cfg.eos_token_ids)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    sets = prompt_sets(args, load_tokenizer(args.source))
    drafters = {f"dflash-{b}": load_block_drafter(args.drafter, source, draft_len=b, refine=args.refine)
                for b in args.blocks}
    if args.draft_model:
        drafters[f"draft-{args.gamma}"] = ModelDrafter(load_hf(args.draft_model), draft_len=args.gamma)

    prefill_features = jax.jit(
        lambda params, tokens, lengths, capacity, layers: forward_features(
            params, cfg, tokens, init_cache(cfg, tokens.shape[0], capacity), layers, lengths, fresh=True)[1:],
        static_argnames=("capacity", "layers"))

    def padded(prompts):
        """Right-padded tokens [B, multiple of 64] and lengths [B]."""
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        width = -(-int(lengths.max()) // 64) * 64
        tokens = np.zeros((len(prompts), width), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        return tokens, lengths

    def run_greedy(tokens, lengths):
        out = generate(source.params, cfg, tokens, args.new, prompt_lengths=lengths)
        return np.asarray(jax.block_until_ready(out)), None

    def run_spec(drafter, tokens, lengths):
        """kvjax.speculative_generate's steps, with prompt_lengths (a padded shape compiles once)."""
        g = drafter.draft_len
        capacity = math.ceil((tokens.shape[1] + args.new + g + 1) / CACHE_ALIGN) * CACHE_ALIGN
        prefix, plen = jnp.asarray(tokens), jnp.asarray(lengths - 1)
        last = tokens[np.arange(len(tokens)), lengths - 1]
        layers = tuple(drafter.feature_layers)
        if layers:
            cache, feats = prefill_features(source.params, prefix, plen, capacity, layers)
        else:
            cache, feats = prefill_cache_jit(source.params, cfg, prefix, plen, capacity), None
        state = drafter.start(prefix, plen, capacity, feats)
        out, counters = run_loop(source, drafter, cache, state, last, jax.random.key(0), args.new, Sampling(), eos,
                                 pad)
        return np.asarray(jax.block_until_ready(out)), stats_of(counters, g)

    methods = {"greedy": run_greedy, **{name: (lambda t, n, d=d: run_spec(d, t, n)) for name, d in drafters.items()}}

    def measure(groups):
        """Per group of prompts: every method once, in a rotating order; times, outputs and stats."""
        names = list(methods)
        for tokens, lengths in {(t.shape, ): (t, n) for t, n in groups}.values():  # compile every shape first
            for name in names:
                methods[name](tokens, lengths)
        rows = []
        for i, (tokens, lengths) in enumerate(groups):
            order = names[i % len(names):] + names[: i % len(names)]
            rec = {}
            for name in order:
                t0 = time.perf_counter()
                out, stats = methods[name](tokens, lengths)
                rec[name] = (time.perf_counter() - t0, out, stats)
            rows.append(rec)
        return rows

    def summarize(rows):
        ref = [r["greedy"][1] for r in rows]
        emitted = [sum(int(np.argmax(hit)) + 1 if hit.any() else len(hit) for hit in np.isin(o, eos)) for o in ref]
        res = {}
        for name in methods:
            times = [r[name][0] for r in rows]
            same = sum(int(np.array_equal(r[name][1], want)) for r, want in zip(rows, ref))
            entry = {"tok_s": statistics.median(e / t for e, t in zip(emitted, times)),
                     "median_s": statistics.median(times),
                     "speedup": statistics.median(r["greedy"][0] / r[name][0] for r in rows),
                     "identical": f"{same}/{len(rows)}"}
            if name != "greedy":
                st = [r[name][2] for r in rows]
                rounds = sum(int(np.sum(s.rounds)) for s in st)
                entry["tau"] = (sum(int(np.sum(s.accepted)) for s in st) + rounds) / max(rounds, 1)
            res[name] = entry
        return res

    report = {"args": vars(args), "sets": {}, "batch8": {}, "load": os.getloadavg()}
    t_start = time.time()
    for set_name, prompts in sets.items():
        rows = measure([padded([p]) for p in prompts])
        report["sets"][set_name] = summarize(rows)
        print(f"[{time.time() - t_start:.0f}s] batch 1, {set_name}: " + json.dumps(report["sets"][set_name]),
              flush=True)
        if args.batch8:
            groups = [padded(prompts[i * 8:(i + 1) * 8]) for i in range(min(args.batch8, len(prompts) // 8))]
            if groups:
                report["batch8"][set_name] = summarize(measure(groups))
                print(f"[{time.time() - t_start:.0f}s] batch 8, {set_name}: "
                      + json.dumps(report["batch8"][set_name]), flush=True)
    for key in ("sets", "batch8"):
        per = report[key]
        if not per:
            continue
        report[f"geomean_{key}"] = {m: {
            "speedup": math.exp(statistics.mean(math.log(per[s][m]["speedup"]) for s in per)),
            "tau": (statistics.mean(per[s][m]["tau"] for s in per) if m != "greedy" else None)}
            for m in methods}
    report["load_end"] = os.getloadavg()
    report["seconds"] = time.time() - t_start
    print(format_table(report, list(methods)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def format_table(report, methods) -> str:
    lines = []
    for key, title in (("sets", "batch 1"), ("batch8", "batch 8")):
        per = report.get(key) or {}
        if not per:
            continue
        lines.append(f"\n{title}: speed-up over greedy (tau) [tok/s] identical")
        lines.append("| set | " + " | ".join(methods) + " |")
        lines.append("|---" * (len(methods) + 1) + "|")
        for s, res in per.items():
            cells = []
            for m in methods:
                r = res[m]
                tau = f" ({r['tau']:.2f})" if "tau" in r else ""
                cells.append(f"{r['speedup']:.2f}x{tau} [{r['tok_s']:.0f}] {r['identical']}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        g = report[f"geomean_{key}"]
        lines.append("| geomean | " + " | ".join(
            f"{g[m]['speedup']:.2f}x" + (f" ({g[m]['tau']:.2f})" if g[m]["tau"] else "") for m in methods) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

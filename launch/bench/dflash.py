"""Block-drafter (DFlash-style) speculative decoding on the toy source: tau, tokens/s and speed-up over the source's
own greedy decode, side by side in one run, with the plain draft model (the toy target) beside it.

    python -m launch.bench.dflash --out runs/dflash.json                 # 5 sets x 40 prompts x 128 tokens
    python -m launch.bench.dflash --prompts 4 --new 32 --batch8 0        # a quick look

Prompt sets (held-out text only, never seen by the drafter's training, which reads the train split): windows64 /
windows256 (the first 64 / 256 tokens of checkpoints/toy/eval/heldout_windows.npy rows 0.. / 40..), hellaswag (the
contexts of hellaswag.jsonl), piqa (the goals of piqa.jsonl), retrieval1024 (the 1024-token needle prompts of
retrieval_1024.jsonl). Every method decodes each prompt greedily; each output is compared token for token with the
source's kvjax.generate output ("identical"). Methods: greedy (kvjax.generate: prefill + the in-jit decode loop),
dflash-b for each --blocks b (at batch 8: --batch8-blocks) (kvjax.drafter block drafter through the shared verify loop, kvjax.speculative), and
draft-g (the toy target as a plain draft model, gamma = --gamma). Timing: each call end to end (prefill + decode,
block_until_ready), compiled beforehand (one warm-up per padded prompt shape); for every prompt (batch 1) or batch of
8 prompts the methods run back to back in an order that rotates, so load changes hit them alike; speed-up of a set
= the median over its prompts of t_greedy / t_method, tokens/s = median of emitted tokens / t. The prompts of a set
are right-padded to one width (its longest, rounded up to 64; prompt_lengths say the real lengths) so each method
compiles once per set, not once per length; every method pays the same padded prefill.
--cpu pins the process (and XLA's thread pool) to those CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
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
    p.add_argument("--batch8-blocks", type=int, nargs="+", default=(16,), help="block sizes timed at batch 8")
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
    from kvjax import allocator
    applied = allocator.tune()  # as kvjax's programs run (kvjax.allocator); before XLA starts its threads
    print(f"host allocator: {applied}", flush=True)
    from kvjax.drafter import load_block_drafter
    from kvjax.eval.dflash import geomean, measure, methods_for, pad_group, record, summarize
    from kvjax.hf import load_hf, load_tokenizer
    from kvjax.speculative import ModelDrafter

    source = load_hf(args.source)
    cfg = source.cfg
    sets = prompt_sets(args, load_tokenizer(args.source))
    drafters = {f"dflash-{b}": load_block_drafter(args.drafter, source, draft_len=b, refine=args.refine)
                for b in args.blocks}
    if args.draft_model:
        drafters[f"draft-{args.gamma}"] = ModelDrafter(load_hf(args.draft_model), draft_len=args.gamma)

    methods = methods_for(source, drafters, args.new)
    methods8 = {k: v for k, v in methods.items()
                if not k.startswith("dflash-") or int(k.split("-")[1]) in args.batch8_blocks}
    eos = tuple(cfg.eos_token_ids)

    report = {"args": vars(args), "allocator": applied, "sets": {}, "batch8": {}, "records": {}, "load": os.getloadavg()}
    t_start = time.time()
    for set_name, prompts in sets.items():
        width = -(-max(len(p) for p in prompts) // 64) * 64  # one padded shape per set: one compile per method
        rows = measure(methods, [pad_group([p], width) for p in prompts])
        report["records"][set_name] = record(rows, eos)
        report["sets"][set_name] = summarize(report["records"][set_name])
        print(f"[{time.time() - t_start:.0f}s] batch 1, {set_name}: " + json.dumps(report["sets"][set_name]),
              flush=True)
        if args.batch8:
            n8 = min(args.batch8, len(prompts) // 8)
            groups = [pad_group(prompts[i * 8:(i + 1) * 8], width) for i in range(n8)]
            if groups:
                report["records"][f"{set_name}/batch8"] = record(measure(methods8, groups), eos)
                report["batch8"][set_name] = summarize(report["records"][f"{set_name}/batch8"])
                print(f"[{time.time() - t_start:.0f}s] batch 8, {set_name}: "
                      + json.dumps(report["batch8"][set_name]), flush=True)
        if args.out:  # after every set: an interrupted run keeps what it measured
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    for key in ("sets", "batch8"):
        if report[key]:
            report[f"geomean_{key}"] = geomean(report[key])
    report["load_end"] = os.getloadavg()
    report["seconds"] = time.time() - t_start
    print(format_table(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


def format_table(report) -> str:
    lines = []
    for key, title in (("sets", "batch 1"), ("batch8", "batch 8")):
        per = report.get(key) or {}
        if not per:
            continue
        methods = list(next(iter(per.values())))
        lines.append(f"\n{title}: speed-up over greedy (tau) [tok/s] identical")
        lines.append("| set | " + " | ".join(methods) + " |")
        lines.append("|---" * (len(methods) + 1) + "|")
        for s, res in per.items():
            cells = []
            for m in methods:
                r = res[m]
                tau = f" ({r['tau']:.2f})" if "tau" in r else ""
                cells.append(f"{r['speedup']:.2f}x{tau} [{r['tok_s']:.0f}] {r['identical']}/{r['groups']}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
        g = report[f"geomean_{key}"]
        lines.append("| geomean | " + " | ".join(
            f"{g[m]['speedup']:.2f}x" + (f" ({g[m]['tau']:.2f})" if g[m]["tau"] else "") for m in methods) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    from kvjax import allocator
    allocator.reexec()  # huge pages, as the main job and the server run (kvjax.allocator says why)
    sys.exit(main())

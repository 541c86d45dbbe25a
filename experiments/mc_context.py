"""How much of each model's multiple-choice accuracy is reading the context? Score the sets with every context cut
to its last S tokens, beside the full context.

    python -m experiments.mc_context --short 1 16 64 --limit 400
    python -m experiments.mc_context --models pruned=checkpoints/toy/pruned source=checkpoints/toy/source

A prefix cache (mapped or native) can only move the part of an accuracy that needs more than the last few context
tokens: what a model scores with S = 1 is what it gets from the endings alone. Contexts are cut at token level and
decoded back to text (the scorer re-encodes them; a cut may merge differently at its first token).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

import kvjax
from kvjax.eval import bootstrap_ci, load_mc, score_mc
from experiments import model_dirs

SCHEMAS = ("hellaswag", "piqa")


def cut_context(items, tokenizer, short: int):
    """Items with each context reduced to its last `short` tokens (short >= 1)."""
    if short < 1:
        raise ValueError(f"--short {short}: keep at least one context token")
    return [dataclasses.replace(it, context=tokenizer.decode(tokenizer.encode(it.context).ids[-short:]))
            for it in items]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy-dir", default="checkpoints/toy", help="eval sets (and default models) from here")
    p.add_argument("--models", nargs="+", metavar="NAME=DIR", help="default: the toy dir's target and source")
    p.add_argument("--short", type=int, nargs="+", default=[1, 16, 64], help="context tokens kept")
    p.add_argument("--limit", type=int, default=400, help="first N items of each set")
    p.add_argument("--sets", nargs="+", choices=SCHEMAS, default=list(SCHEMAS))
    args = p.parse_args(argv)
    models = model_dirs(p, args.models or [f"{r}={os.path.join(args.toy_dir, r)}" for r in ("target", "source")])
    tok = kvjax.load_tokenizer(next(iter(models.values())))
    loaded = {name: kvjax.load_hf(path) for name, path in models.items()}
    views = [0, *sorted(set(args.short))]
    print("| set | context | " + " | ".join(models) + " |")
    print("|---|---|" + "---:|" * len(models))
    for schema in args.sets:
        items = load_mc(os.path.join(args.toy_dir, "eval", f"{schema}.jsonl"), schema=schema, limit=args.limit)
        for s in views:
            view = items if s == 0 else cut_context(items, tok, s)
            cells = []
            for cfg, params in loaded.values():
                ci = bootstrap_ci(np.asarray(score_mc(view, tok, params, cfg, progress=False).correct, float))
                cells.append(f"{ci.mean:.1%} [{ci.lo:.1%}, {ci.hi:.1%}]")
            print(f"| {schema} ({len(items)}) | {'full' if s == 0 else f'last {s}'} | " + " | ".join(cells) + " |",
                  flush=True)


if __name__ == "__main__":
    main()

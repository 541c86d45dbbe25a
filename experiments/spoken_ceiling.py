"""How much of the reader's lead does a map carry on the spoken items' TRANSCRIPTS, with no audio at all? Against the
same map on the code multiple choice cut to the same length.

    python -m experiments.spoken_ceiling --run runs/toy_audio
    python -m experiments.spoken_ceiling --run runs/toy_audio --open newline The --hellaswag 0 24
    python -m experiments.spoken_ceiling --run runs/toy_reverse      # the reverse pair: small reads, large answers

Audio transfer can carry at most what the map carries of the listening model's lead over the answerer; on the
sealed set's transcripts that is measurable without any encoder. Reads a finished main-job run (its config.json for
the reader and the answerer, its final map) and scores the sealed spoken set's transcripts (`eval.audio.test`, the
`toy_audio` prompt: [open][transcript][\\n], endings by PMI, kvjax.eval.audio_transfer.correct) three ways: the reader
reading them, the answerer reading them, and the answerer on the map of the reader's cache (the `mapped_text` arm of
the evaluation `audio`). `--open`: the token that opens the prompt (`eos`, `newline`, or a word), to see whether the
map's translation of the document-start token decides it. `--hellaswag N...`: the same three on the toy HellaSwag
(code, length-normalised scores) with each context cut to its last N tokens (0: whole), where the map is known to
carry most of the lead. Prints one table row per view: each model's accuracy, the reader's paired lead, the map's
paired gain and the share of the lead recovered.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a finished main-job run (config.json and map/)")
    p.add_argument("--test", default="checkpoints/toy/audio/test", help="the sealed spoken set (its transcripts)")
    p.add_argument("--items", type=int, default=0, help="first N transcripts (0: all)")
    p.add_argument("--open", nargs="+", default=["eos"], help="prompt openers: eos, newline or a word")
    p.add_argument("--hellaswag", type=int, nargs="*", default=[], metavar="N",
                   help="also the toy HellaSwag with contexts cut to their last N tokens (0: whole)")
    p.add_argument("--limit", type=int, default=200, help="HellaSwag items")
    p.add_argument("--boot", type=int, default=2000)
    return p.parse_args(argv)


def row(view: str, correct: dict, boot: int) -> str:
    from kvjax.eval.stats import paired_bootstrap_ci
    lead = paired_bootstrap_ci(correct["reader"], correct["answerer"], n=boot)
    gain = paired_bootstrap_ci(correct["mapped"], correct["answerer"], n=boot)
    share = f"{gain.mean / lead.mean:.0%}" if lead.lo > 0 else "no lead"
    accs = " | ".join(f"{correct[k].mean():.1%}" for k in ("reader", "answerer", "mapped"))
    return (f"| {view} | {accs} | {lead.mean:+.1%} [{lead.lo:+.1%}, {lead.hi:+.1%}] | {gain.mean:+.1%} "
            f"[{gain.lo:+.1%}, {gain.hi:+.1%}] | {share} |")


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg_path, map_dir = os.path.join(args.run, "config.json"), os.path.join(args.run, "map")
    for path, fix in ((cfg_path, "run the main job first"), (map_dir, "finish the run (its final map)"),
                      (os.path.join(args.test, "features.npz"), "give a spoken set (python -m launch.toy.speech)")):
        if not os.path.exists(path):
            print(f"spoken_ceiling: {path} does not exist; {fix}", file=sys.stderr)
            return 2
    import jax.numpy as jnp

    import kvjax
    from kvjax.builders import Mapped, NativePrefill
    from kvjax.eval import audio_transfer as A
    from kvjax.eval.arms import make_arms, score_mc_arms
    from kvjax.eval.multiple_choice import load_mc

    run_cfg = json.load(open(cfg_path))
    reader, answerer = (tuple(kvjax.load_hf(run_cfg[r]["path"], dtype=jnp.dtype(run_cfg[r]["dtype"])))
                        for r in ("source", "target"))
    kvmap = kvjax.load_map(map_dir, reader[0], answerer[0])
    tok = kvjax.load_tokenizer(run_cfg["target"]["path"])
    newline = tuple(tok.encode("\n", add_special_tokens=False).ids)
    items = A.load_spoken(args.test, args.items)
    print(f"{args.run}: {run_cfg['source']['path']} reads, {run_cfg['target']['path']} answers; "
          f"{len(items)} transcripts of {args.test}")
    print("| view | reader | answerer | answerer on the map | reader's lead | map's gain | share |")
    print("|---|---:|---:|---:|---|---|---:|")
    for opener in args.open:
        open_id = {"eos": 0, "newline": newline[0]}.get(opener)
        if open_id is None:
            open_id = tok.encode(opener, add_special_tokens=False).ids[0]
        prompts = A.Prompts(open_id, newline, 0)  # no audio positions: the placeholder is never used
        builders = {"reader": (NativePrefill(reader), "text"), "null_reader": (NativePrefill(reader), "null"),
                    "answerer": (NativePrefill(answerer), "text"), "null_answerer": (NativePrefill(answerer), "null"),
                    "mapped": (Mapped(reader, answerer, kvmap), "text")}
        res = A.score_spoken(items, tok, builders, prompts, 8, [], 8, progress=False)
        null = {"reader": "null_reader", "answerer": "null_answerer", "mapped": "null_answerer"}
        correct = {k: A.correct(res[k]["logprobs"], res[n]["logprobs"], res["labels"]) for k, n in null.items()}
        print(row(f"spoken transcripts, opened by {opener!r}", correct, args.boot), flush=True)
    if args.hellaswag:
        mc = load_mc("checkpoints/toy/eval/hellaswag.jsonl", limit=args.limit)
        arms = make_arms(("target", "source", "residual"), reader, answerer, {"residual": kvmap})
        for n in args.hellaswag:
            view = mc if n == 0 else [dataclasses.replace(it, context=tok.decode(
                tok.encode(it.context, add_special_tokens=False).ids[-n:])) for it in mc]
            r = score_mc_arms(view, tok, arms, "length", 8, progress=False)
            correct = {k: np.asarray(r[a].correct, float) for k, a in
                       (("reader", "source"), ("answerer", "target"), ("mapped", "residual"))}
            print(row(f"HellaSwag (code), {'whole context' if n == 0 else f'last {n} tokens'}", correct, args.boot),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

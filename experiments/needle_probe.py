"""Needle-retrieval probes in any format, built fresh from held-out files and scored like the eval sets.

    python -m experiments.needle_probe                                      # 48 items at 1K, the sets' own format
    python -m experiments.needle_probe --needle $'{key}: {value}\n' --query '{key}:'    # another separator
    python -m experiments.needle_probe --value-letters 4 --models v21=DIR               # other values, other models

Items come from launch.toy.evalsets' generator with their own seed (123; not the shipped sets), so a probe can try
formats the shipped sets do not have. Every needle option of launch.toy.evalsets is accepted (--needle, --query,
--answer, --depth, --value-digits, --value-letters, --haystack). Each model greedily decodes the answer after the
prompt (kvjax.eval.score_retrieval: exact match, and the teacher-forced answer log-prob). Reads only the manifest's
held-out files of the haystack source, so no `launch.toy.data` step is needed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

import kvjax
from kvjax.eval import RetrievalItem, score_retrieval
from kvjax.eval.multiple_choice import encode
from experiments import model_dirs
from launch.toy import evalsets
from launch.toy.data import REPO


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", metavar="NAME=DIR",
                   default=[f"target={REPO / 'checkpoints/toy/target'}", f"source={REPO / 'checkpoints/toy/source'}"])
    p.add_argument("--n", type=int, default=48, help="items")
    p.add_argument("--length", type=int, default=1024, help="prompt tokens")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--manifest", type=Path, default=REPO / "checkpoints/toy/data/manifest.json")
    args, needle_args = p.parse_known_args(argv)
    fmt = evalsets.parse_args([*needle_args, "--n-retrieval", str(args.n)])  # the eval sets' own checks
    models = model_dirs(p, args.models)
    tok = kvjax.load_tokenizer(next(iter(models.values())))
    docs = evalsets.heldout_docs(args.manifest, tok, fmt.haystack)
    rows = evalsets.build_retrieval(docs, args.length, fmt, tok, np.random.default_rng(args.seed))
    items = [RetrievalItem(encode(tok, r["prompt"]), r["answer_ids"], r["length"], r["needle_position"], r["prompt"],
                           r["answer"]) for r in rows]
    example = rows[0]["prompt"][rows[0]["prompt"].rfind("\n") + 1 :] + rows[0]["answer"]
    print(f"\n{args.n} items of {args.length} tokens, e.g. ...{example!r}\n")
    print("| model | correct | accuracy | mean answer log-prob |")
    print("|---|---:|---:|---:|")
    for name, path in models.items():
        cfg, params = kvjax.load_hf(path)
        result = score_retrieval(items, params, cfg, progress=False)
        print(f"| {name} | {int(result.correct.sum())}/{len(items)} | {result.accuracy:.1%} "
              f"| {result.answer_logprob.mean():.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""Small reads, large answers: how the map, the repair depth and the draft length move speculative KV transfer.

    python -m launch.research.reverse_sweep --run runs/toy_reverse [--length 4096] [--agree-prompts 16]

Reads a finished `--config=toy_reverse` run (config.json for the models, its fitted maps, its held-out windows) and,
with the reader drafting and the answerer verifying (kvjax.speculative.speculative_split_generate), varies one piece
at a time around the default (final map, no repair, draft length 4):
  - the map: direct reuse of the reader's layers (no map), the ridge map, the final map;
  - the repair depth: 0..3 bottom answerer layers recomputed natively;
  - the draft length: 2, 4, 8;
and measures, beside the answerer's native prefill + decoding and plain drafting (native prefill, reader drafts):
  - end-to-end latency of one request at --length (cache + --new-tokens tokens, EOS ignored), arms in rotating order
    per round (kvjax.eval.speculative), medians of --repeats timed rounds after a compile round;
  - acceptance length (tokens per verify round);
  - accuracy of the transfer: its greedy output vs the answerer's native greedy output on --agree-prompts held-out
    prompts of --agree-length tokens (share of tokens before the first difference, first token equal).
Writes JSON (--out, default <run>/reverse_sweep.json) and prints a markdown table. Machine noise: ratios are of
medians from the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvjax.stages.plan import MAP_DIRS


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a finished `python -m kvjax.launch --config=toy_reverse` run")
    p.add_argument("--length", type=int, default=4096, help="prompt length of the latency measurement")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--agree-prompts", type=int, default=16, help="prompts of the accuracy measurement (0: skip)")
    p.add_argument("--agree-length", type=int, default=1024)
    p.add_argument("--vary", default="map,repair,draft", help="which pieces to vary (each a compile or more)")
    p.add_argument("--out", default="")
    return p.parse_args(argv)


# (label, map, repair layers, draft length); the first transfer row is the default the others vary
VARIANTS = [("transfer: final map, k=0, g=4", "final", 0, 4),
            ("map: ridge", "ridge", 0, 4), ("map: direct reuse", "direct", 0, 4),
            ("repair: k=1", "final", 1, 4), ("repair: k=2", "final", 2, 4), ("repair: k=3", "final", 3, 4),
            ("draft: g=2", "final", 0, 2), ("draft: g=8", "final", 0, 8)]


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg_path = os.path.join(args.run, "config.json")
    if not os.path.isfile(cfg_path) or not os.path.isdir(os.path.join(args.run, MAP_DIRS["ridge"])):
        print(f"reverse_sweep: {args.run} is not a finished run (no config.json / map_ridge); run "
              "`python -m kvjax.launch --config=toy_reverse` first", file=sys.stderr)
        return 2
    import time

    import numpy as np
    from tqdm import tqdm

    import kvjax
    from kvjax.mapper.injection import injection_map
    from kvjax.eval.speculative import NATIVE, _agreement, _run
    from kvjax.speculative import speculative_split_generate

    cfg = json.load(open(cfg_path))
    small, large = kvjax.load_hf(cfg["source"]["path"]), kvjax.load_hf(cfg["target"]["path"])
    final_dir = MAP_DIRS["residual"] if os.path.isdir(os.path.join(args.run, MAP_DIRS["residual"])) else MAP_DIRS["ridge"]
    maps = {"final": kvjax.load_map(os.path.join(args.run, final_dir), small[0], large[0]),
            "ridge": kvjax.load_map(os.path.join(args.run, MAP_DIRS["ridge"]), small[0], large[0]),
            "direct": injection_map(small[0], large[0])}
    held = np.load(os.path.join(args.run, "data", "heldout.npy"))
    flat = held.reshape(-1)
    prompts = flat[: args.length][None].astype(np.int32)

    # latency: native, plain@4 and every variant, in rotating order per round
    vary = set(args.vary.split(","))
    variants = [v for v in VARIANTS if v[0].split(":")[0] in vary or v is VARIANTS[0]]
    arms = [("native", None, 0, 4), ("plain: g=4", None, 0, 4)] + variants
    seconds = {a[0]: [] for a in arms}
    tau = {}
    t_start = time.perf_counter()
    bar = tqdm(total=(args.repeats + 1) * len(arms), desc="latency", unit="run")
    for r in range(args.repeats + 1):
        for label, m, k, g in arms[r % len(arms):] + arms[: r % len(arms)]:
            kind = NATIVE if label == "native" else "plain" if m is None else ("repaired" if k else "transfer")
            res = _run(kind, small, large, maps.get(m, maps["final"]), prompts, args.new_tokens, g, (k, "bottom"))
            if r:
                seconds[label].append(res["seconds"])
            tau[label] = res["tau"]
            bar.update()
    bar.close()

    # accuracy: greedy transfer output vs native greedy output on held-out prompts
    agree = {}
    if args.agree_prompts:
        rows = flat[: args.agree_prompts * args.agree_length].reshape(args.agree_prompts, args.agree_length)
        native = np.asarray(kvjax.native_generate(large, rows, args.new_tokens, eos_token_ids=()))
        for label, m, k, g in variants:
            if label.startswith("draft"):  # greedy output does not depend on the draft length
                continue
            out = speculative_split_generate(small, large, maps[m], rows, args.new_tokens, draft_len=g,
                                             repair_layers=k, eos_token_ids=())
            exact, prefix, first = _agreement(np.asarray(out.tokens), native)
            agree[label] = {"exact": exact, "prefix": prefix, "first": first}

    med = {a: float(np.median(v)) for a, v in seconds.items()}
    result = {"run": args.run, "length": args.length, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "agree_prompts": args.agree_prompts, "agree_length": args.agree_length, "latency_s": med,
              "latency_rounds_s": seconds, "vs_native": {a: med[a] / med["native"] for a in med},
              "acceptance_length": tau, "agreement": agree, "seconds": time.perf_counter() - t_start}
    out = args.out or os.path.join(args.run, "reverse_sweep.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nlatency of one {args.length}-token request + {args.new_tokens} tokens (medians of {args.repeats} "
          f"rounds); accuracy on {args.agree_prompts} prompts of {args.agree_length} tokens\n")
    print("| arm | latency s | vs native | acceptance | prefix match | first token |\n|---|---|---|---|---|---|")
    for label, *_ in arms:
        a = agree.get(label, {})
        t = "-" if tau[label] is None else f"{tau[label]:.2f}"
        match = ("- | -" if not a else f"{100 * a['prefix']:.0f}% | {100 * a['first']:.0f}%")
        print(f"| {label} | {med[label]:.3f} | {100 * (result['vs_native'][label] - 1):+.1f}% | {t} | {match} |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

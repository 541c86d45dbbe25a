"""How much of the source-target KL could a cache map remove at all? Splits it into reading and local modelling.

    python -m launch.research.reading_gap                        # prefixes 256 and 960, 128 held-out windows
    python -m launch.research.reading_gap --prefix 256 --short 1 16 64
    python -m launch.research.reading_gap --map runs/toy_map/map   # also: that map's ridge and residual KL at each P
    python -m launch.research.reading_gap --map runs/toy_map/map --by-position   # ... and along the continuation

For each prefix length P, both models score the same 64 continuation tokens of held-out windows reading either the
whole prefix or only its last S tokens (kvjax.eval.reading). `ceiling` = 1 - KL_local / KL_full: roughly how much
lower the source-teacher KL would be if the target read the prefix as well as the source does and kept its own local
modelling. A residual goal above this figure asks the map for more than reading. With --map, the map's KL at each P
with and without its residual (the ridge alone = the residual's output projection zeroed), on the same windows;
--by-position splits those KLs (and the native target's) by continuation position: 0, 1, 2-3, 4-7, ...
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import kvjax
from kvjax.eval import bootstrap_ci, paired_bootstrap_ci, reading_gaps
from kvjax.mapper.kvmap import ridge_only
from kvjax.fitting.residual import evaluate_kl


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toy-dir", default="checkpoints/toy")
    p.add_argument("--prefix", type=int, nargs="+", default=(256, 960), help="prefix lengths P")
    p.add_argument("--short", type=int, nargs="+", default=(16,), help="tokens of the prefix read in the local view")
    p.add_argument("--cont", type=int, default=64)
    p.add_argument("--windows", type=int, default=128, help="held-out windows (those the toy config's KL reads)")
    p.add_argument("--map", help="a map for this pair (python -m kvjax.launch --config=toy writes runs/toy/map): "
                                  "score it at each prefix too")
    p.add_argument("--by-position", action="store_true",
                   help="with --map: the KLs by continuation position (where along the continuation the map helps)")
    args = p.parse_args(argv)
    path = os.path.join(args.toy_dir, "eval", "heldout_windows.npy")
    if not os.path.isfile(path):
        raise SystemExit(f"no held-out windows at {path}: build them with `python -m launch.toy.evalsets`")
    heldout = np.load(path).astype(np.int32)
    if max(args.prefix) + args.cont > heldout.shape[1]:
        raise SystemExit(f"--prefix + --cont must be <= {heldout.shape[1]} (the windows' length)")
    if not 1 <= min(args.short) <= max(args.short) <= min(args.prefix):
        raise SystemExit(f"--short must be between 1 and the shortest --prefix ({min(args.prefix)})")
    if args.by_position and not args.map:
        raise SystemExit("--by-position scores a map along the continuation: give it one with --map")
    if args.map and not os.path.isdir(args.map):
        raise SystemExit(f"no map at {args.map}: fit one with `python -m kvjax.launch --config=toy` or drop --map")
    source, target = (kvjax.load_hf(os.path.join(args.toy_dir, r)) for r in ("source", "target"))
    kvmap = kvjax.load_map(args.map, source[0], target[0]) if args.map else None
    maps, positions = [], []
    print("| prefix | short | KL full (native target) | KL local | ceiling | source reading | target reading "
          "| CE source full / short | CE target full / short |")
    print("|---:|---:|---|---|---:|---:|---:|---|---|")
    for prefix in args.prefix:
        windows = heldout[32 : 32 + args.windows, : prefix + args.cont]
        gaps = reading_gaps(source, target, windows, prefix, args.short, by_position=args.by_position)
        native_pos = gaps[args.short[0]]["kl_full"]  # the same for every short view
        for short, m in gaps.items():
            m = {k: v.mean(1) if args.by_position else v for k, v in m.items()}  # per window
            full, local = bootstrap_ci(m["kl_full"]), bootstrap_ci(m["kl_local"])
            print(f"| {prefix} | {short} | {full} | {local} | {1 - local.mean / full.mean:.1%} "
                  f"| {m['source_reading'].mean():.3f} | {m['target_reading'].mean():.3f} "
                  f"| {m['ce_source_full'].mean():.3f} / {m['ce_source_short'].mean():.3f} "
                  f"| {m['ce_target_full'].mean():.3f} / {m['ce_target_short'].mean():.3f} |", flush=True)
        if kvmap is not None:
            ridge_pos = evaluate_kl(ridge_only(kvmap), source, target, windows, prefix, per_position=True)
            mapped_pos = evaluate_kl(kvmap, source, target, windows, prefix, per_position=True)
            ridge, mapped = ridge_pos.mean(1), mapped_pos.mean(1)
            maps.append((prefix, ridge.mean(), mapped.mean(), paired_bootstrap_ci(mapped, ridge), full.mean))
            if args.by_position:
                positions.append((prefix, native_pos, ridge_pos, mapped_pos))
    if maps:
        print(f"\nmap {args.map}:\n\n| prefix | KL ridge | KL ridge + residual | change (paired 95% CI) | native target |")
        print("|---:|---:|---:|---|---:|")
        for prefix, ridge, mapped, ci, native in maps:
            print(f"| {prefix} | {ridge:.4f} | {mapped:.4f} | {mapped / ridge - 1:+.1%} ({ci}) | {native:.4f} |")
    if positions:
        print("\nKL by continuation position (0 = the first token after the prefix):\n")
        print("| prefix | positions | native target | ridge | ridge + residual | residual vs ridge (paired 95% CI) "
              "| mapped vs native |")
        print("|---:|---:|---:|---:|---:|---|---:|")
        for prefix, native, ridge, mapped in positions:
            for lo, hi in position_buckets(native.shape[1]):
                n, r, f = (a[:, lo:hi].mean(1) for a in (native, ridge, mapped))
                span = str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}"
                print(f"| {prefix} | {span} | {n.mean():.4f} | {r.mean():.4f} | {f.mean():.4f} "
                      f"| {f.mean() / r.mean() - 1:+.1%} ({paired_bootstrap_ci(f, r)}) "
                      f"| {f.mean() / n.mean() - 1:+.1%} |")


def position_buckets(cont: int) -> list[tuple[int, int]]:
    """[0, 1), [1, 2), [2, 4), [4, 8), ... cut at cont."""
    out, lo = [(0, 1)], 1
    while lo < cont:
        out.append((lo, min(2 * lo, cont)))
        lo *= 2
    return out


if __name__ == "__main__":
    main()

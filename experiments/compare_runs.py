"""One map against another, item by item: paired deltas between two finished main-job runs.

    python -m experiments.compare_runs BASE RUN [RUN ...]             # run dirs of `python -m kvjax.launch`
    python -m experiments.compare_runs BASE RUN --arm residual --base-arm residual --json out.json

An attempt at a better map is a run that differs from a baseline run in one setting (often its calibrate / ridge stages
copied, `--redo=residual`). Both runs score the same multiple-choice items, KL windows, needles and RULER items when
their eval settings agree, so the difference between them is best measured per item: this reads each run's eval/*.json
(nothing is recomputed) and prints, for every measure both runs hold, RUN's arm minus BASE's arm with a paired 95%
bootstrap interval (kvjax.eval.stats), beside each run's own value and, for multiple choice, the share of the
target-to-source gap each recovers. Runs whose items differ (another limit or set) are refused per measure with the
reason, not compared.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from kvjax.eval.stats import paired_bootstrap_ci


def _load(run: str, name: str) -> dict | None:
    path = os.path.join(run, "eval", f"{name}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _check_run(run: str) -> None:
    if not os.path.isfile(os.path.join(run, "metrics.json")):
        raise SystemExit(f"{run}: no metrics.json (pass the output_dir of a finished `python -m kvjax.launch` run)")


def per_item(base: str, run: str, base_arm: str, arm: str) -> dict[str, tuple]:
    """{measure: (base scores [N], run scores [N], extra)} for every measure both runs scored on the same items, or
    {measure: (None, None, why)} where they cannot be paired. extra: BASE's native-target and source accuracies for
    a multiple-choice set (its gap), else None."""
    out = {}
    for name in ("mc", "retrieval"):  # per-item correctness: {set: {"items", "source", "arms": {arm: {"correct"}}}}
        for key, (a, b) in _pairs(base, run, name).items():
            measure = f"{name}.{key}"
            if a.get("source") != b.get("source") or a.get("items") != b.get("items"):
                out[measure] = (None, None, f"different items ({a.get('source')} x {a.get('items')} vs "
                                            f"{b.get('source')} x {b.get('items')})")
            elif base_arm not in a["arms"] or arm not in b["arms"]:
                out[measure] = (None, None, f"arm missing ({base_arm} in BASE: {base_arm in a['arms']}, {arm} in "
                                            f"RUN: {arm in b['arms']})")
            else:
                gap = (tuple(np.mean(a["arms"][r]["correct"]) if r in a["arms"] else None
                             for r in ("target", "source")) if name == "mc" else None)
                out[measure] = (np.asarray(a["arms"][base_arm]["correct"]), np.asarray(b["arms"][arm]["correct"]),
                                gap)
    for length, (a, b) in _pairs(base, run, "ruler").items():  # {length: {task: {"answers", "arms": {...}}}}
        for task in (t for t in a if t in b):
            measure, x, y = f"ruler.{length}.{task}", a[task], b[task]
            if x.get("answers") != y.get("answers"):
                out[measure] = (None, None, f"different items ({x.get('items')} vs {y.get('items')}; another "
                                            "seed, limit or setting of eval.ruler)")
            elif base_arm not in x["arms"] or arm not in y["arms"]:
                out[measure] = (None, None, "arm missing")
            else:
                out[measure] = (np.asarray(x["arms"][base_arm]["correct"]), np.asarray(y["arms"][arm]["correct"]),
                                None)
    kl_a, kl_b = _load(base, "kl"), _load(run, "kl")
    if kl_a and kl_b:
        a, b = kl_a["per_window"].get(base_arm), kl_b["per_window"].get(arm)
        if a is None or b is None:
            out["kl"] = (None, None, "arm missing")
        elif len(a) != len(b):
            out["kl"] = (None, None, f"different windows ({len(a)} vs {len(b)})")
        else:
            out["kl"] = (np.asarray(a), np.asarray(b), None)
    return out


def _pairs(base: str, run: str, name: str) -> dict[str, tuple[dict, dict]]:
    a, b = _load(base, name) or {}, _load(run, name) or {}
    return {k: (a[k], b[k]) for k in a if k in b}


def compare(base: str, run: str, base_arm: str = "residual", arm: str = "residual") -> list[dict]:
    rows = []
    for measure, (a, b, extra) in per_item(base, run, base_arm, arm).items():
        if a is None:
            rows.append({"measure": measure, "skipped": extra})
            continue
        ci = paired_bootstrap_ci(b, a)
        row = {"measure": measure, "n": len(a), "base": float(a.mean()), "run": float(b.mean()),
               "delta": ci.mean, "ci95": [ci.lo, ci.hi]}
        if extra is not None and None not in extra and extra[1] != extra[0]:
            target, source = extra
            row["gap_base"] = (row["base"] - target) / (source - target)
            row["gap_run"] = (row["run"] - target) / (source - target)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", help="the baseline run's output_dir")
    ap.add_argument("runs", nargs="+", help="runs to compare against it")
    ap.add_argument("--arm", default="residual", help="the arm of each RUN (default: residual)")
    ap.add_argument("--base-arm", default="residual", help="the arm of BASE (default: residual)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    for r in (args.base, *args.runs):
        _check_run(r)
    everything = {}
    for run in args.runs:
        rows = compare(args.base, run, args.base_arm, args.arm)
        everything[run] = rows
        print(f"{run} [{args.arm}] - {args.base} [{args.base_arm}]")
        for r in rows:
            if "skipped" in r:
                print(f"  {r['measure']:<29} not compared: {r['skipped']}")
                continue
            gap = (f"   gap {100 * r['gap_base']:.1f}% -> {100 * r['gap_run']:.1f}%" if "gap_base" in r else "")
            print(f"  {r['measure']:<29} n={r['n']:<5} {r['base']:.4f} -> {r['run']:.4f}   "
                  f"{r['delta']:+.4f} [{r['ci95'][0]:+.4f}, {r['ci95'][1]:+.4f}]{gap}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()

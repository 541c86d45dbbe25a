"""Which distance to the native cache predicts what a map keeps? Every map of finished main-job runs, side by side.

    python -m experiments.fidelity_predictors RUN [RUN ...]            # run dirs of `python -m kvjax.launch`
    python -m experiments.fidelity_predictors runs/* --json out.json

Public reports find the cosine between the target's attention outputs from the mapped and from its
native cache predicts task retention (r ~ +0.57) where calibration R^2 does not. This reads each run's metrics.json
(nothing is recomputed) and takes every map arm it measured: the per-head peer, the ridge, the residual, and the
unmapped source layers ("raw" in distances, "direct" in the multiple-choice table). For each: key / value /
attention-output cosine and NRMSE to the native cache (`distances`), and what it keeps: the share of the
target-to-source multiple-choice gap it recovers on each set (`mc.*.gap_recovered_by_arm`) and needle retrieval at
the shortest length (`retrieval`); and the source-teacher KL of the target reading it (`kl`). Then the Spearman and Pearson correlation of each distance with each kept measure
across the maps. A map that appears in several runs (a ridge reused through copied stages) counts once. Runs of
different configs score different item counts and windows: compare with care; the gap share is a ratio, so it is
comparable across item counts up to its sampling noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

# distances to the native cache (`distances`), and the source-teacher KL of the target reading the map (`kl`: a
# distance to the *source's* predictions; its windows differ between configs, so compare it within one config)
DISTANCES = ("key_cos", "value_cos", "attn_cos", "key_nrmse", "value_nrmse", "attn_nrmse", "kl")
MC_NAME = {"raw": "direct"}  # the distances' name of an arm -> its name in the multiple-choice and retrieval tables


def maps_of(run: str) -> list[dict]:
    """One row per map arm of a run: its distances and what it keeps (None where the run did not measure it)."""
    path = os.path.join(run, "metrics.json")
    if not os.path.isfile(path):
        raise SystemExit(f"{run}: no metrics.json (pass the output_dir of a finished `python -m kvjax.launch` run)")
    with open(path) as f:
        m = json.load(f)
    dist = m.get("distances") or {}
    arms = sorted({a for d in DISTANCES for a in (dist.get(d) or {})})
    retrieval = m.get("retrieval") or {}
    shortest = min(retrieval, key=int, default=None)
    rows = []
    for arm in arms:
        name = MC_NAME.get(arm, arm)
        row = {"run": os.path.basename(os.path.normpath(run)), "arm": arm}
        row.update({d: (dist.get(d) or {}).get(arm) for d in DISTANCES if d != "kl"})
        kl = (m.get("kl") or {}).get(name)
        row["kl"] = kl if isinstance(kl, (int, float)) else None
        for schema, s in (m.get("mc") or {}).items():
            row[f"gap_{schema}"] = (s.get("gap_recovered_by_arm") or {}).get(name)
        if shortest is not None:
            row[f"retrieval_{shortest}"] = retrieval[shortest].get(name)
        rows.append(row)
    return rows


def dedupe(rows: list[dict]) -> list[dict]:
    """Rows whose distances are identical describe the same map (a stage reused in another run): keep the first."""
    seen, out = set(), []
    for r in rows:
        key = (r["arm"], *(None if r[d] is None else round(r[d], 6) for d in DISTANCES))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    for v in np.unique(x):  # ties share their mean rank
        ranks[x == v] = ranks[x == v].mean()
    return ranks


def correlations(rows: list[dict], kept: list[str]) -> dict:
    """{kept measure: {distance: {"n", "spearman", "pearson"}}} over the maps measuring both."""
    out = {}
    for k in kept:
        out[k] = {}
        for d in DISTANCES:
            pairs = np.array([(r[d], r[k]) for r in rows if r.get(d) is not None and r.get(k) is not None], float)
            if len(pairs) < 3 or np.ptp(pairs[:, 0]) == 0 or np.ptp(pairs[:, 1]) == 0:
                continue
            x, y = pairs[:, 0], pairs[:, 1]
            out[k][d] = {"n": len(pairs), "spearman": float(np.corrcoef(_ranks(x), _ranks(y))[0, 1]),
                         "pearson": float(np.corrcoef(x, y)[0, 1])}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="output dirs of finished main-job runs")
    p.add_argument("--arms", nargs="+", metavar="ARM", help="only these map arms (e.g. residual: among trained maps)")
    p.add_argument("--json", help="also write the rows and correlations here")
    args = p.parse_args(argv)
    rows = dedupe([r for run in args.runs for r in maps_of(run) if not args.arms or r["arm"] in args.arms])
    if len(rows) < 3:
        raise SystemExit(f"{len(rows)} maps: correlations need at least 3 (pass more runs, or fewer --arms filters)")
    kept = sorted({k for r in rows for k in r if k.startswith(("gap_", "retrieval_"))})
    fmt = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
    cols = ["key_cos", "value_cos", "attn_cos", "kl", *kept]
    print("| run | map | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['run']} | {r['arm']} | " + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    corr = correlations(rows, kept)
    print("\ncorrelation with what the map keeps (Spearman / Pearson, n maps):")
    for k, by in corr.items():
        cells = ", ".join(f"{d} {c['spearman']:+.2f} / {c['pearson']:+.2f}" for d, c in by.items())
        n = max((c["n"] for c in by.values()), default=0)
        print(f"  {k} (n={n}): {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "correlations": corr}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

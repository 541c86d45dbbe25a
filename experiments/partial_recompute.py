"""Partial recomputation, k = 0..L: what letting the target recompute k of its layers does to a mapped cache.

    python -m experiments.partial_recompute --run runs/toy [--map residual|ridge] [--modes bottom,top] [--mc 200]
        [--sets 0,2] [--map-dir DIR] [--positions]

Reads a finished main-job run (its config.json for the models, its fitted map, its held-out windows) and measures,
for each placement (bottom k: the target's first k layers run natively; top k: the target reads the mapped lower
layers and recomputes its top k) and each k:
  - next-token agreement with the native target and with the source, and source-teacher KL, on the KL evaluation's
    held-out windows (the rows after the distance windows, prefix 256 + 64 continuation tokens by default);
  - multiple-choice accuracy on the run's HellaSwag / PIQA schema sets (same items for every arm);
  - with --sets, explicit placements too ("0,2;1": layers 0 and 2, then layer 1 alone), k = |set|;
  - with --positions, where the disagreements with the native target are: by continuation position and by the
    native target's own top-1 / top-2 margin (log-probability gap, nats) at the position, per arm;
  - cost at one prompt length: the builder's phases (source prefill, map, recompute) timed with block_until_ready,
    arms interleaved, medians; the recompute phase as a fraction of the target's own prefill and the whole build as
    a fraction of the source's prefill.
Writes JSON (--out, default <run>/partial_recompute.json) and prints a table. Run pinned (`taskset -c 1`) for cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from kvjax.run.layout import MAP_DIRS


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="a finished `python -m kvjax.launch` run directory")
    p.add_argument("--map", default="residual", choices=sorted(MAP_DIRS),
                   help="which of the run's maps: residual (the final map) or ridge")
    p.add_argument("--modes", default="bottom,top")
    p.add_argument("--windows", type=int, default=64, help="KL / agreement windows")
    p.add_argument("--skip", type=int, default=16, help="held-out rows before the KL windows (the distance windows)")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--cont", type=int, default=64)
    p.add_argument("--mc", type=int, default=200, help="items per multiple-choice set (0: skip)")
    p.add_argument("--cost-len", type=int, default=1024, help="prompt length of the cost measurement")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cost-only", action="store_true", help="skip agreement, KL and multiple choice")
    p.add_argument("--no-cost", action="store_true", help="skip the cost measurement")
    p.add_argument("--sets", default="", help='explicit placements, e.g. "0,2;1" (layers recomputed per arm)')
    p.add_argument("--map-dir", default="", help="a saved map to use instead of the run's --map (e.g. another run's)")
    p.add_argument("--positions", action="store_true",
                   help="where the disagreements are: by continuation position and the native target's margin")
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    cfg_path = os.path.join(args.run, "config.json")
    map_dir = args.map_dir or os.path.join(args.run, MAP_DIRS[args.map])
    for path, fix in ((cfg_path, "run the main job first"), (map_dir, "pass --map ridge or finish the run")):
        if not os.path.exists(path):
            print(f"partial_recompute: {path} does not exist; {fix}", file=sys.stderr)
            return 2
    import jax
    import jax.numpy as jnp

    import kvjax
    from kvjax.builders import Clock, NativePrefill, PartialRecompute, SourcePrefill
    from kvjax.eval.token_agreement import agreement_table
    from kvjax.eval.arms import Arm, score_mc_arms
    from kvjax.eval.multiple_choice import load_mc

    run_cfg = json.load(open(cfg_path))
    source, target = (kvjax.load_hf(run_cfg[r]["path"], dtype=jnp.dtype(run_cfg[r]["dtype"]))
                      for r in ("source", "target"))
    kvmap = kvjax.load_map(map_dir, source[0], target[0])
    heldout = np.load(os.path.join(args.run, "data", "heldout.npy"))
    windows = heldout[args.skip : args.skip + args.windows, : args.prefix + args.cont]
    n_layers = target[0].num_layers
    shared = SourcePrefill(source)
    arms = {"target": NativePrefill(target, name="target")}
    for mode in args.modes.split(","):
        for k in range(n_layers + 1):
            if mode == "top" and k == 0:
                continue  # the same cache as bottom 0: the map alone
            name = "mapped" if k == 0 else f"{mode}{k}"
            arms[name] = PartialRecompute(source, target, kvmap, k, mode, name=name, shared=shared)
    for spec in filter(None, args.sets.split(";")):
        layers = tuple(int(i) for i in spec.split(","))
        name = "layers" + "_".join(map(str, layers))
        try:
            arms[name] = PartialRecompute(source, target, kvmap, layers=layers, name=name, shared=shared)
        except ValueError as e:
            print(f"partial_recompute: --sets {spec}: {e}", file=sys.stderr)
            return 2
    rows = {name: {"mode": getattr(b, "mode", None), "k": getattr(b, "k", None),
                   "layers": list(getattr(b, "layers", range(n_layers)))} for name, b in arms.items()}
    if args.positions:
        where = disagreements(arms, target, windows, args.prefix)
        for name, w in where.items():
            rows[name]["disagreements"] = w

    if not args.cost_only:
        print(f"agreement and KL on {len(windows)} windows ({args.prefix} + {args.cont})", flush=True)
        for name, agree in agreement_table(arms, source, target, windows, args.prefix).items():
            rows[name].update(with_target=float(agree["with_target"].mean()),
                              with_source=float(agree["with_source"].mean()), kl=float(agree["kl_mapped"].mean()),
                              first_with_target=float(agree["first_with_target"].mean()),
                              first_with_source=float(agree["first_with_source"].mean()))

    if args.mc and not args.cost_only:
        tok = kvjax.load_tokenizer(run_cfg["target"]["path"])
        mc_arms = [Arm(n, b.model, None, lambda t, l, b=b: b(t, l, bucketed=True)) for n, b in arms.items()]
        mc_arms.append(Arm("source", source, None, lambda t, l: NativePrefill(source)(t, l, bucketed=True)))
        rows["source"] = {"mode": None, "k": None}
        for schema in ("hellaswag", "piqa"):
            where = run_cfg["eval"]["mc"][schema]
            if not where:
                continue
            items = load_mc(where, schema=schema, limit=args.mc)
            for name, r in score_mc_arms(items, tok, mc_arms, desc=schema).items():
                rows[name][schema] = float(r.accuracy)

    if args.no_cost:
        return _write(args, rows, len(windows), None, None)
    print(f"cost at {args.cost_len} tokens, {args.repeats} interleaved rounds", flush=True)
    prompt = np.asarray(heldout[:1, : args.cost_len], np.int32)
    timed = {"source_prefill": NativePrefill(source), **{n: b for n, b in arms.items() if n != "source"}}
    for b in timed.values():
        if isinstance(b, PartialRecompute):
            b.mapped.source = SourcePrefill(source, memo=False)  # time the source prefill every call
        jax.block_until_ready(b(prompt))  # compile
    phases = {n: [] for n in timed}
    for r in range(args.repeats):
        names = list(timed)
        for n in names[r % len(names):] + names[: r % len(names)]:
            clock = Clock()
            jax.block_until_ready(timed[n](prompt, clock=clock))
            phases[n].append(dict(clock.phases, total=sum(clock.phases.values())))
    med = {n: {p: float(np.median([x[p] for x in xs])) for p in xs[0]} for n, xs in phases.items()}
    src_s, tgt_s = med["source_prefill"]["total"], med["target"]["total"]
    for n, m in med.items():
        if n == "source_prefill":
            continue
        rows[n].update(seconds=m, recompute_vs_target_prefill=m.get("recompute", 0.0) / tgt_s,
                       total_vs_source_prefill=m["total"] / src_s)
    return _write(args, rows, len(windows), src_s, tgt_s)


POSITION_BUCKETS = ((0, 1), (1, 8), (8, 32), (32, None))  # continuation positions [lo, hi)
MARGIN_EDGES = (0.05, 0.2, 0.5, 1.0, 2.0)  # nats: the native target's top-1 minus top-2 log-probability


def disagreements(arms: dict, target, windows: np.ndarray, prefix: int, batch_size: int = 8) -> dict:
    """Per arm: how often its next token differs from the native target's, by continuation position bucket and by
    the native target's own margin there (a near tie flips on the smallest change of the cache), and the share of
    all its disagreements that fall where the margin is below MARGIN_EDGES[1]."""
    import jax

    from kvjax.models.decoder import forward

    tcfg, tparams = target
    step = jax.jit(lambda p, cache, cont: forward(p, tcfg, cont, cache)[0])
    native_b, picks = arms["target"], {n: [] for n in arms if n != "target"}
    margins, native_picks = [], []
    for i in range(0, len(windows), batch_size):
        batch = np.asarray(windows[i : i + batch_size], np.int32)
        cont = batch[:, prefix - 1 : -1]
        ref = jax.nn.log_softmax(step(tparams, native_b(batch[:, : prefix - 1], capacity=batch.shape[1]), cont))
        top2 = jax.lax.top_k(ref, 2)[0]
        margins.append(np.asarray(top2[..., 0] - top2[..., 1]))
        native_picks.append(np.asarray(ref.argmax(-1)))
        for n in picks:
            picks[n].append(np.asarray(step(tparams, arms[n](batch[:, : prefix - 1], capacity=batch.shape[1]),
                                            cont).argmax(-1)))
    margin, native = np.concatenate(margins), np.concatenate(native_picks)
    edges = (0.0, *MARGIN_EDGES, np.inf)
    out = {}
    for n, p in picks.items():
        differ = np.concatenate(p) != native  # [N, T']
        by_pos = {f"{lo}-{(hi or differ.shape[1]) - 1}": float(differ[:, lo:hi].mean()) for lo, hi in POSITION_BUCKETS}
        by_margin = {}
        for lo, hi in zip(edges, edges[1:]):
            sel = (margin >= lo) & (margin < hi)
            by_margin[f"{lo:g}-{hi:g}"] = {"positions": float(sel.mean()),
                                           "differ": float(differ[sel].mean()) if sel.any() else None}
        out[n] = {"rate": float(differ.mean()), "by_position": by_pos, "by_margin": by_margin,
                  "share_near_ties": float((differ & (margin < MARGIN_EDGES[1])).sum() / max(differ.sum(), 1)),
                  "count": int(differ.sum()), "positions": int(differ.size)}
    return out


def _write(args, rows: dict, windows: int, src_s, tgt_s) -> int:
    result = {"run": args.run, "map": args.map_dir or args.map, "windows": windows, "prefix": args.prefix, "cont": args.cont,
              "mc_items": args.mc, "cost_len": args.cost_len, "source_prefill_s": src_s, "target_prefill_s": tgt_s,
              "arms": rows, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = args.out or os.path.join(args.run, "partial_recompute.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    cols = ("with_target", "with_source", "first_with_target", "first_with_source", "kl", "hellaswag", "piqa",
            "recompute_vs_target_prefill", "total_vs_source_prefill")
    print("| arm | " + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
    for n, r in rows.items():
        print(f"| {n} | " + " | ".join("" if r.get(c) is None else f"{r[c]:.4f}" for c in cols) + " |")
    for n, r in rows.items():
        if "disagreements" in r:
            d = r["disagreements"]
            print(f"{n}: {d['count']} of {d['positions']} differ; by position {d['by_position']}; "
                  f"{100 * d['share_near_ties']:.0f}% where the native margin < {MARGIN_EDGES[1]} nats; by margin "
                  + ", ".join(f"{k}: {v['differ'] if v['differ'] is None else round(v['differ'], 3)} "
                              f"({100 * v['positions']:.0f}% of positions)" for k, v in d["by_margin"].items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

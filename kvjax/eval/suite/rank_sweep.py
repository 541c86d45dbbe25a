"""Evaluation `rank_sweep` (off by default: it refits): the reduced-rank ridge map (MapConfig.rank; no residual) at
ten ranks k, each measured on the three criteria a rank could be chosen by (the method reports "a ten-point sweep
picked k=24 on prefix loss while attention similarity peaked at k=8 and mapping time kept climbing").

Fitting: the job keeps no ridge statistics (stage ridge saves only the map), so the sweep recollects them once, as
fit_map does, on the run's calibration and lambda-selection windows (data/calib.npy, data/select.npy; the first
`calib_windows` calibration windows when set) with the pairing of the run's ridge map; every rank is a solve of the
same statistics (kvjax.fitting.rank_sweep), lambda chosen per rank, layer and kind on the selection windows. Full
rank (None) is the run's unreduced ridge map (the record's `full_vs_run_ridge` checks it when MapConfig.rank is None).

Per k:
  - prefix loss, two ways. `kl` (what the picks use): the source-teacher KL of the target reading the rank-k mapped
    prefix cache on held-out windows, kl.py's measure (kvjax.fitting.residual.evaluate_kl) on the KL evaluation's rows
    (the first `kl_windows` of them, `prefix_len` + `cont_len` tokens). `heldout_nmse`: the reconstruction MSE of the
    target's K/V features on the lambda-selection windows / their variance (1 - R^2), mean over layers and K/V; and
    `train_nmse`, the same on the calibration windows it was fitted on (non-increasing in k at a fixed lambda);
  - attention similarity `attn_cos` (and key / value cosines): as distances computes them for a map, on the first
    `attn_windows` held-out windows of `attn_window_len` tokens;
  - map time: median wall seconds of applying the map (jitted, XLA, warm) to a source cache of `time_batch` KL
    prefixes of `prefix_len` tokens, `time_repeats` rounds with the ranks in rotating order;
  - map size: the ridge parameters as the method stores them (mu, w_in [Fx, k], w_out [k, Fy], bias per layer and
    kind; float32 bytes).
metrics.json `rank_sweep` (docs/metrics.md); report section 35 with the chart rank_sweep.png."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one

log = logging.getLogger(__name__)
DEFAULT_RANKS = (1, 2, 4, 8, 16, 24, 32, 48, 64, None)  # None: full rank; clipped to min(Fx, Fy) of the pair
CRITERIA = (("kl", "min", "held-out KL"), ("heldout_nmse", "min", "held-out reconstruction"),
            ("attn_cos", "max", "attention similarity"))  # (point field, best, label): what each pick optimises


@dataclasses.dataclass(frozen=True)
class RankSweepEval:
    enabled: bool = False  # refits the ridge at every rank: --config.eval.rank_sweep.enabled=true
    ranks: tuple[int | None, ...] = DEFAULT_RANKS
    calib_windows: int = 0  # 0: all the run's calibration windows; n: the first n (the statistics' cost)
    kl_windows: int = 64  # the KL evaluation's held-out rows (after the distance windows), the first this many
    prefix_len: int = 256
    cont_len: int = 64
    attn_windows: int = 16  # the distance evaluation's rows (the first held-out windows)
    attn_window_len: int = 512
    batch_size: int = 8
    time_batch: int = 8  # prefixes per timed map application
    time_repeats: int = 20


def first_kl_row(cfg) -> int:
    from kvjax.eval.suite.kl import first_row
    return first_row(cfg)


def calibration(cfg, ec: RankSweepEval) -> tuple[np.ndarray, np.ndarray]:
    """The run's calibration and lambda-selection windows (stage calibrate's data/)."""
    data = os.path.join(cfg.output_dir, "data")
    calib = np.load(os.path.join(data, "calib.npy"), mmap_mode="r")
    calib = calib[: ec.calib_windows] if ec.calib_windows else calib
    return np.asarray(calib), np.asarray(np.load(os.path.join(data, "select.npy")))


def time_maps(maps: list, source, tokens: np.ndarray, repeats: int) -> list[list[float]]:
    """Per map the wall seconds of each timed application (after one warm-up, which compiles) to the source's cache
    of `tokens` [B, T]; rounds visit the maps in rotating order so drift spreads evenly."""
    import jax
    import jax.numpy as jnp
    from kvjax.builders import map_jit
    from kvjax.models.decoder import prefill_forward
    (scfg, sparams), t = source, tokens.shape[1]
    cache = jax.block_until_ready(prefill_forward(sparams, scfg, jnp.asarray(tokens, jnp.int32), logits=None).cache)
    apply = lambda m: map_jit(m, cache, capacity=t, length=t, impl="xla")  # noqa: E731
    for m in maps:
        jax.block_until_ready(apply(m))
    out = [[] for _ in maps]
    for r in range(repeats):
        for j in range(len(maps)):
            i = (r + j) % len(maps)
            t0 = time.perf_counter()
            jax.block_until_ready(apply(maps[i]))
            out[i].append(time.perf_counter() - t0)
    return out


def run(ec: RankSweepEval, ctx) -> dict:
    from kvjax.eval.cache_distances import map_distances
    from kvjax.fitting import rank_sweep as rs
    from kvjax.fitting.residual import evaluate_kl
    cfg, (scfg, tcfg) = ctx.cfg, (ctx.source[0], ctx.target[0])
    pairing = ctx.map("ridge").spec.pairing  # the run's pairing (a topK pairing was chosen by held-out R^2)
    calib, select = calibration(cfg, ec)
    t0 = time.perf_counter()
    stats = rs.collect(ctx.source, ctx.target, pairing, calib, select, cfg.map.batch_size)
    ranks = rs.rank_grid(ec.ranks, stats.max_rank)
    fits = rs.fit_ranks(stats, scfg, tcfg, ranks)
    log.info("rank sweep: statistics of %d calibration tokens and %d fits in %.1fs", int(stats.train[0][0].n),
             len(fits), time.perf_counter() - t0)
    # every rank padded to the widest (exact zeros): one shape, so the KL and distance programs compile once
    width = max(m.w_in.shape[1] for f in fits for m in (*f.kvmap.keys, *f.kvmap.values))
    padded = {f"k{i}": rs.padded(f.kvmap, width) for i, f in enumerate(fits)}
    skip = first_kl_row(cfg)
    kl_windows = ctx.heldout[skip : skip + ec.kl_windows, : ec.prefix_len + ec.cont_len]
    attn_windows = ctx.heldout[: ec.attn_windows, : ec.attn_window_len]
    distances = map_distances(padded, ctx.source, ctx.target, attn_windows, ec.batch_size)
    seconds = time_maps([f.kvmap for f in fits], ctx.source, kl_windows[: ec.time_batch, : ec.prefix_len],
                        ec.time_repeats)
    points = []
    for i, fit in enumerate(fits):
        kl = evaluate_kl(padded[f"k{i}"], ctx.source, ctx.target, kl_windows, ec.prefix_len, ec.batch_size)
        d = distances[f"k{i}"]["mean"]
        points.append({"rank": fit.rank, "effective_rank": fit.effective_rank, "kl": kl.tolist(),
                       "train_nmse": fit.train_nmse, "heldout_nmse": fit.heldout_nmse, "lambdas": fit.lambdas,
                       **{m: d[m] for m in ("key_cos", "value_cos", "attn_cos")},
                       "attn_cos_per_layer": [r["attn_cos"] for r in distances[f"k{i}"]["per_layer"]],
                       "map_seconds": seconds[i], "params": rs.ridge_params(fit.kvmap)})
        log.info("rank %-4s KL %.4f, held-out NMSE %.4f, attn cos %.4f, map %.2f ms, %d params",
                 fit.rank or "full", float(np.mean(kl)), float(np.mean(fit.heldout_nmse)), d["attn_cos"],
                 1e3 * float(np.median(seconds[i])), points[-1]["params"])
    record = {"points": points, "max_rank": stats.max_rank, "pairing": [list(p) for p in pairing],
              "calib_tokens": int(stats.train[0][0].n), "heldout_tokens": int(stats.heldout[0][0].n),
              "kl_windows": len(kl_windows), "prefix_len": ec.prefix_len, "cont_len": ec.cont_len,
              "attn_windows": len(attn_windows), "attn_window_len": int(attn_windows.shape[1]),
              "time_batch": int(min(ec.time_batch, len(kl_windows))), "time_repeats": ec.time_repeats,
              "run_rank": cfg.map.rank}
    if ranks[-1] is None and cfg.map.rank is None:  # the full-rank point is the run's ridge map, refitted
        record["full_vs_run_ridge"] = max_weight_difference(fits[-1].kvmap, ctx.map("ridge"))
    return record


def max_weight_difference(a, b) -> float:
    """Largest |w_a - w_b| of two maps' effective ridge weights, over the largest |w_b|, across layers and kinds."""
    from kvjax.fitting.rank_sweep import dense_weight
    worst = 0.0
    for ma, mb in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        wa, wb = dense_weight(ma), dense_weight(mb)
        worst = max(worst, float(np.abs(wa - wb).max() / max(np.abs(wb).max(), 1e-30)))
    return worst


def _label(point: dict) -> str:
    return "full" if point["rank"] is None else str(point["rank"])


def picks(points: list[dict]) -> dict:
    """For each criterion the rank it picks (argmin KL, argmin held-out NMSE, argmax attention similarity), with
    that rank's value, map time and size; and the fastest rank."""
    out = {}
    for field, best, _ in CRITERIA:
        values = [p[field] for p in points]
        i = int(np.argmin(values) if best == "min" else np.argmax(values))
        out[field] = {"rank": points[i]["rank"], "effective_rank": points[i]["effective_rank"], "value": values[i],
                      "map_s": points[i]["map_s"], "bytes": points[i]["bytes"]}
    i = int(np.argmin([p["map_s"] for p in points]))
    out["map_s"] = {"rank": points[i]["rank"], "effective_rank": points[i]["effective_rank"],
                    "value": points[i]["map_s"], "map_s": points[i]["map_s"], "bytes": points[i]["bytes"]}
    return out


def metrics(ev: dict, ctx) -> dict:
    from kvjax.eval.stats import bootstrap_ci, paired_bootstrap_ci
    points = []
    for p in ev["points"]:
        kl = np.asarray(p["kl"], np.float64)
        ci = bootstrap_ci(kl, n=ctx.n_boot)
        points.append({"rank": p["rank"], "effective_rank": p["effective_rank"], "kl": ci.mean,
                       "kl_ci95": [ci.lo, ci.hi], "heldout_nmse": float(np.mean(p["heldout_nmse"])),
                       "train_nmse": float(np.mean(p["train_nmse"])), "attn_cos": p["attn_cos"],
                       "key_cos": p["key_cos"], "value_cos": p["value_cos"],
                       "map_s": float(np.median(p["map_seconds"])), "params": p["params"], "bytes": 4 * p["params"]})
    out = {"points": points, "picks": picks(points)}
    best = out["picks"]["kl"]["rank"]
    best_kl = next(np.asarray(p["kl"], np.float64) for p in ev["points"] if p["rank"] == best)
    for p, row in zip(ev["points"], points):  # paired interval of each rank's KL minus the KL pick's
        ci = paired_bootstrap_ci(np.asarray(p["kl"], np.float64), best_kl, n=ctx.n_boot)
        row["kl_minus_best_ci95"] = [ci.lo, ci.hi]
    tied = next(row for row in points if row["kl_minus_best_ci95"][0] <= 0.0)
    out["picks"]["kl_tied"] = {"rank": tied["rank"], "effective_rank": tied["effective_rank"], "value": tied["kl"],
                               "map_s": tied["map_s"], "bytes": tied["bytes"]}
    out.update({k: ev[k] for k in ("max_rank", "pairing", "calib_tokens", "heldout_tokens", "kl_windows",
                                   "prefix_len", "cont_len", "attn_windows", "attn_window_len", "time_batch",
                                   "time_repeats", "run_rank")})
    if "full_vs_run_ridge" in ev:
        out["full_vs_run_ridge"] = ev["full_vs_run_ridge"]
    return out


def _k(rank) -> str:
    return "full" if rank is None else f"k={rank}"


def summary(s: dict, ctx) -> list[str]:
    pk = s["picks"]
    return [f"- Rank sweep ({len(s['points'])} ranks, no residual): held-out KL picks {_k(pk['kl']['rank'])} "
            f"({pk['kl']['map_s'] * 1e3:.2f} ms to map), attention similarity {_k(pk['attn_cos']['rank'])} "
            f"({pk['attn_cos']['map_s'] * 1e3:.2f} ms), reconstruction {_k(pk['heldout_nmse']['rank'])}; the "
            f"smallest rank within the KL pick's paired 95% CI: {_k(pk['kl_tied']['rank'])}."]


def report(s: dict, ctx) -> list[str]:
    out = ["## Reduced-rank ridge: rank sweep", "",
           f"The ridge map (no residual) refitted at {len(s['points'])} ranks on {s['calib_tokens']} calibration "
           f"tokens (lambda per rank on {s['heldout_tokens']} selection tokens; full rank = min(Fx, Fy) = "
           f"{s['max_rank']}). KL: source-teacher KL of the target reading the rank-k map's cache, {s['kl_windows']} "
           f"held-out windows ({s['prefix_len']} prefix + {s['cont_len']} scored tokens). NMSE: K/V reconstruction "
           f"MSE / variance (1 - R^2) on the selection (held-out) and calibration (train) windows. attn cos: the "
           f"target's attention outputs from the mapped vs its native cache, {s['attn_windows']} windows of "
           f"{s['attn_window_len']} tokens. Map: median of {s['time_repeats']} warm applications to "
           f"{s['time_batch']} x {s['prefix_len']} prefix tokens; size = float32 ridge parameters.", "",
           "| rank | KL (95% CI) | held-out NMSE | train NMSE | attn cos | key cos | value cos | map ms | size KB |",
           "|---|---|---|---|---|---|---|---|---|"]
    for p in s["points"]:
        lo, hi = p["kl_ci95"]
        out.append(f"| {_label(p)} | {p['kl']:.4f} [{lo:.4f}, {hi:.4f}] | {p['heldout_nmse']:.4f} | "
                   f"{p['train_nmse']:.4f} | {p['attn_cos']:.4f} | {p['key_cos']:.4f} | {p['value_cos']:.4f} | "
                   f"{p['map_s'] * 1e3:.3f} | {p['bytes'] / 1e3:.1f} |")
    pk = s["picks"]
    out += ["", "Which rank each criterion picks (and what it costs to map):", ""]
    for field, best, label in CRITERIA:
        q = pk[field]
        out.append(f"- {label} ({'arg' + best} {field}): {_k(q['rank'])}, {q['value']:.4f}; map "
                   f"{q['map_s'] * 1e3:.3f} ms, {q['bytes'] / 1e3:.1f} KB")
    q = pk["kl_tied"]
    out.append(f"- smallest rank whose KL is within the KL pick's paired 95% CI: {_k(q['rank'])}, {q['value']:.4f}; "
               f"map {q['map_s'] * 1e3:.3f} ms, {q['bytes'] / 1e3:.1f} KB")
    q = pk["map_s"]
    out.append(f"- fastest map: {_k(q['rank'])}, {q['map_s'] * 1e3:.3f} ms")
    if "full_vs_run_ridge" in s:
        out.append(f"- full rank vs the run's ridge map: max weight difference {s['full_vs_run_ridge']:.1e} of the "
                   "largest weight (the same fit)")
    out.append("")
    if "rank_sweep" in ctx.charts:
        out += [f"![rank sweep]({ctx.charts['rank_sweep']})", ""]
    return out


def chart(s: dict, path: str, ctx) -> str:
    """Three panels vs rank: prefix loss (KL with its interval; NMSE on a second axis), attention similarity, map
    time and size (second axis); each panel's pick marked."""
    from kvjax.eval import charts
    plt = charts.plt()
    pts = s["points"]
    x = np.array([p["effective_rank"] for p in pts], float)
    labels = [_label(p) for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))

    def axis(ax, title):
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, labels, fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("rank k")
        ax.set_title(title)
        ax.grid(alpha=0.3)

    kl = np.array([p["kl"] for p in pts])
    err = np.abs(np.array([p["kl_ci95"] for p in pts]).T - kl)
    ax = axes[0]
    ax.errorbar(x, kl, yerr=err, fmt="o-", color="#4C72B0", capsize=3, label="held-out KL")
    ax.set_ylabel("source-teacher KL (nats / token)", color="#4C72B0")
    twin = ax.twinx()
    twin.plot(x, [p["heldout_nmse"] for p in pts], "s--", color="#DD8452", label="held-out NMSE")
    twin.plot(x, [p["train_nmse"] for p in pts], ":", color="#DD8452", alpha=0.6, label="train NMSE")
    twin.set_ylabel("K/V reconstruction NMSE (1 - R^2)", color="#DD8452")
    twin.legend(fontsize=8, loc="upper right")
    axis(ax, "prefix loss")
    ax = axes[1]
    ax.plot(x, [p["attn_cos"] for p in pts], "o-", color="#55A868", label="attention output")
    ax.plot(x, [p["key_cos"] for p in pts], ".--", color="#8172B3", alpha=0.7, label="keys")
    ax.plot(x, [p["value_cos"] for p in pts], ".:", color="#937860", alpha=0.7, label="values")
    ax.set_ylabel("cosine to the native target")
    ax.legend(fontsize=8)
    axis(ax, "attention similarity")
    ax = axes[2]
    ax.plot(x, [p["map_s"] * 1e3 for p in pts], "o-", color="#C44E52")
    ax.set_ylabel(f"map time, ms ({s['time_batch']} x {s['prefix_len']} tokens)", color="#C44E52")
    twin = axes[2].twinx()
    twin.plot(x, [p["bytes"] / 1e3 for p in pts], "s--", color="#8C8C8C")
    twin.set_ylabel("map size (KB, float32)", color="#8C8C8C")
    axis(ax, "map time and size")
    pk = s["picks"]
    for ax in axes:  # the two picks in every panel: what each costs in the other criteria and in time
        ax.axvline(pk["kl"]["effective_rank"], color="#4C72B0", lw=1.2, alpha=0.6, ls="--")
        ax.axvline(pk["attn_cos"]["effective_rank"], color="#55A868", lw=1.2, alpha=0.6, ls=":")
    fig.suptitle(f"Reduced-rank ridge sweep: KL picks {_k(pk['kl']['rank'])} (blue dashed, "
                 f"{pk['kl']['map_s'] * 1e3:.2f} ms), attention similarity {_k(pk['attn_cos']['rank'])} (green "
                 f"dotted, {pk['attn_cos']['map_s'] * 1e3:.2f} ms)")
    return charts.save(fig, path)


def preflight(ec: RankSweepEval, cfg) -> list[str]:
    problems = at_least_one("eval.rank_sweep", ec, "kl_windows", "prefix_len", "cont_len", "attn_windows",
                            "attn_window_len", "batch_size", "time_batch", "time_repeats")
    if not ec.ranks or any(r is not None and r < 1 for r in ec.ranks):
        problems.append(f"eval.rank_sweep.ranks must be ranks >= 1 or none (full rank), got {ec.ranks}")
    if ec.calib_windows < 0:
        problems.append(f"eval.rank_sweep.calib_windows must be >= 0 (0: all), got {ec.calib_windows}")
    return problems


EVALUATION = Evaluation(
    name="rank_sweep", settings=RankSweepEval, run=run, metrics=metrics, section=32, report=report, summary=summary,
    charts=(Chart("rank_sweep", chart),), depends=lambda cfg: {"skip_rows": first_kl_row(cfg)},
    heldout=lambda ec, cfg: (max(ec.attn_windows, first_kl_row(cfg) + ec.kl_windows),
                             max(ec.attn_window_len, ec.prefix_len + ec.cont_len)),
    preflight=preflight)

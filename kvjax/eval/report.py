"""metrics.json (the documented schema of docs/metrics.md) from the evaluation artifacts, and report.md.

The evaluation stage stores per-item / per-window results; everything derived (means, paired bootstrap intervals,
gap recovered, reductions) is computed here, so a report can be rebuilt from a run directory without any model.
"""

from __future__ import annotations

import numpy as np

from kvjax.eval.stats import bootstrap_ci, paired_bootstrap_ci

SCHEMA_VERSION = 1
DIST_METRICS = ("key_cos", "value_cos", "key_nrmse", "value_nrmse")


def _ci(values, n: int) -> list[float]:
    ci = bootstrap_ci(values, n=n)
    return [ci.lo, ci.hi]


def distances_metrics(ev: dict) -> dict:
    maps = ev["maps"]
    out = {m: {arm: maps[arm]["mean"][m] for arm in maps} for m in DIST_METRICS}
    out.update(per_layer={arm: maps[arm]["per_layer"] for arm in maps}, windows=ev["windows"],
               tokens=ev["windows"] * ev["window_len"], raw_kind=ev["raw_kind"])
    return out


def kl_metrics(ev: dict, n_boot: int) -> dict:
    pw = {k: np.asarray(v, np.float64) for k, v in ev["per_window"].items()}
    out = {arm: float(v.mean()) for arm, v in pw.items()}
    if "residual" in pw:
        ci = paired_bootstrap_ci(pw["residual"], pw["ridge"], n=n_boot)
        out.update(reduction=1.0 - out["residual"] / out["ridge"], residual_minus_ridge=ci.mean,
                   residual_minus_ridge_ci95=[ci.lo, ci.hi],
                   windows_improved=int(np.sum(pw["residual"] < pw["ridge"])))
    final = "residual" if "residual" in pw else "ridge"
    if "target" in pw:  # the native target's own KL to the source: what the mapped cache has to beat
        ci = paired_bootstrap_ci(pw[final], pw["target"], n=n_boot)
        out.update(vs_target=out[final] / out["target"], final_minus_target=ci.mean,
                   final_minus_target_ci95=[ci.lo, ci.hi])
    if "agreement" in ev:
        ag = ev["agreement"]
        out["agreement"] = {"map": ag["map"], **{k: float(np.mean(ag[k]))
                                                 for k in ("with_source", "with_target", "target_with_source")}}
    out.update(windows=len(pw["ridge"]), prefix_len=ev["prefix_len"], cont_len=ev["cont_len"],
               per_window={k: v.tolist() for k, v in pw.items()})
    return out


def _gap(acc: dict, arm: str) -> float | None:
    gap = acc["source"] - acc["target"]
    if arm not in acc or "source" not in acc or "target" not in acc or abs(gap) < 1e-12:
        return None
    return (acc[arm] - acc["target"]) / gap


def mc_metrics(ev: dict, n_boot: int, final: str) -> dict:
    out = {}
    for name, s in ev.items():
        correct = {arm: np.asarray(v["correct"], np.float64) for arm, v in s["arms"].items()}
        acc = {arm: float(c.mean()) for arm, c in correct.items()}
        m = {"acc": acc, "acc_ci95": {arm: _ci(c, n_boot) for arm, c in correct.items()}, "items": s["items"],
             "normalize": s["normalize"]}
        if "source" in acc and "target" in acc:
            m["gap_recovered"] = _gap(acc, final) if final in acc else None
            m["gap_recovered_by_arm"] = {arm: _gap(acc, arm) for arm in acc if arm not in ("target", "source")}
        if "target" in correct:
            deltas = {arm: paired_bootstrap_ci(c, correct["target"], n=n_boot) for arm, c in correct.items()
                      if arm != "target"}
            m["delta_vs_target"] = {arm: {"mean": ci.mean, "ci95": [ci.lo, ci.hi]} for arm, ci in deltas.items()}
            if final in deltas:
                m["delta_vs_target_ci95"] = m["delta_vs_target"][final]["ci95"]
        out[name] = m
    return out


def retrieval_metrics(ev: dict) -> dict:
    out = {}
    for length, s in sorted(ev.items(), key=lambda kv: int(kv[0])):
        row = {arm: float(np.mean(v["correct"])) for arm, v in s["arms"].items()}
        row["items"] = s["items"]
        row["answer_logprob"] = {arm: float(np.mean(v["answer_logprob"])) for arm, v in s["arms"].items()}
        out[str(length)] = row
    return out


def throughput_metrics(ev: dict) -> dict:
    out = {}
    for length, row in sorted(ev.items(), key=lambda kv: int(kv[0])):
        row = dict(row)
        row["mapped_over_target_decode"] = row["decode_tps"]["mapped"] / row["decode_tps"]["target"]
        row["mapped_over_source_decode"] = row["decode_tps"]["mapped"] / row["decode_tps"]["source"]
        row["active_saving_vs_source"] = 1.0 - row["active_s"]["mapped"] / row["active_s"]["source"]
        out[str(length)] = row
    return out


def build_metrics(evals: dict, run: dict, n_boot: int, final: str) -> dict:
    """metrics.json without the gate (evaluate_gate reads this, then the launch adds metrics["gate"])."""
    metrics = {"schema_version": SCHEMA_VERSION, "run": run}
    if "distances" in evals:
        metrics["distances"] = distances_metrics(evals["distances"])
    if "kl" in evals:
        metrics["kl"] = kl_metrics(evals["kl"], n_boot)
    if "mc" in evals:
        metrics["mc"] = mc_metrics(evals["mc"], n_boot, final)
    if "retrieval" in evals:
        metrics["retrieval"] = retrieval_metrics(evals["retrieval"])
    if "throughput" in evals:
        metrics["throughput"] = throughput_metrics(evals["throughput"])
    return metrics


# ---- report.md ---------------------------------------------------------------------------------------------------

def _pct(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def _pts(ci) -> str:
    return f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}] pts"


def _len(x: int) -> str:
    return f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x)


def render_report(metrics: dict, charts: dict[str, str]) -> str:
    run, gate = metrics["run"], metrics["gate"]
    src, tgt = run["source"]["name"], run["target"]["name"]
    final = gate["map"]
    lines = [f"# kvjax run `{run['config']}`: {src} reads, {tgt} answers", ""]
    lines += [f"Source **{src}** ({run['source']['params_m']:.1f}M params, {run['source']['layers']} layers) prefills "
              f"the prompt; a {'ridge + rank-' + str(run['map']['residual_rank']) + ' residual' if final == 'residual' else 'ridge'} "
              f"map translates its KV cache; target **{tgt}** ({run['target']['params_m']:.1f}M params, "
              f"{run['target']['layers']} layers) decodes from the mapped cache. Every number below is on held-out "
              f"data; metrics.json holds them all (schema: docs/metrics.md).", ""]
    lines += _summary(metrics, src, tgt, final)
    lines += _quality(metrics, charts, final)
    lines += _speed(metrics, charts)
    lines += _map_section(metrics, charts)
    lines += _retrieval(metrics, charts)
    lines += _gate(gate)
    lines += _setup(run)
    return "\n".join(lines) + "\n"


def _summary(m: dict, src: str, tgt: str, final: str) -> list[str]:
    out = ["## Summary", ""]
    gate = m["gate"]
    failed = [f"{name} {c['value']:.4g} {'<' if c['kind'] == 'min' else '>'} {c['threshold']:.4g}"
              for name, c in gate.get("checks", {}).items() if c.get("passed") is False]
    out.append(f"- **Quality gate: {'PASS' if gate['passed'] else 'FAIL'}** (map: {final}"
               + (f"; failed: {', '.join(failed)}" if failed else "") + "). "
               + ("The map may serve requests." if gate["passed"] else
                  "`split_generate(..., gate=kvjax.load_gate(...))` falls back to native target prefill."))
    for name, mc in (m.get("mc") or {}).items():
        acc = mc["acc"]
        if final in acc and "target" in acc:
            s = (f"- {name}: target {_pct(acc['target'])}, mapped ({final}) {_pct(acc[final])}"
                 + (f", source {_pct(acc['source'])}" if "source" in acc else ""))
            if mc.get("delta_vs_target_ci95"):
                s += f"; mapped - target paired 95% CI {_pts(mc['delta_vs_target_ci95'])}"
            if mc.get("gap_recovered") is not None:
                s += f"; {_pct(mc['gap_recovered'])} of the target-to-source gap recovered"
            out.append(s + ".")
    tp = m.get("throughput")
    if tp:
        ratios = [r["mapped_over_target_decode"] for r in tp.values()]
        vs_src = [r["mapped_over_source_decode"] for r in tp.values()]
        save = [r["active_saving_vs_source"] for r in tp.values()]
        lens = sorted(int(k) for k in tp)
        out.append(f"- Decode speed ({_len(lens[0])}-{_len(lens[-1])} prefixes): mapped = {min(ratios):.2f}-"
                   f"{max(ratios):.2f}x native {tgt}, {min(vs_src):.2f}-{max(vs_src):.2f}x native {src}.")
        out.append(f"- Active compute vs native {src}: {_pct(min(save), 0)} to {_pct(max(save), 0)} saving "
                   "(negative = the split path costs more).")
    kl = m.get("kl")
    if kl and "reduction" in kl:
        lo, hi = kl["residual_minus_ridge_ci95"]
        out.append(f"- Residual: source-teacher KL {kl['ridge']:.4f} -> {kl['residual']:.4f} nats/token "
                   f"({_pct(kl['reduction'])} lower; paired 95% CI of the difference [{lo:.4f}, {hi:.4f}]).")
    return out + [""]


def _quality(m: dict, charts: dict, final: str) -> list[str]:
    mc = m.get("mc")
    if not mc:
        return []
    arms = [a for a in ("target", "direct", "ridge", "residual", "source") if any(a in s["acc"] for s in mc.values())]
    out = ["## Quality: multiple choice", "",
           "Every arm scores the same items (continuation log-likelihood); intervals are 95% percentile bootstrap, "
           "differences paired by item.", "",
           "| set | items | " + " | ".join(arms) + " | mapped - target (paired 95% CI) | gap recovered |",
           "|---|---|" + "---|" * len(arms) + "---|---|"]
    for name, s in mc.items():
        cells = [f"{_pct(s['acc'][a])} [{100 * s['acc_ci95'][a][0]:.1f}, {100 * s['acc_ci95'][a][1]:.1f}]"
                 if a in s["acc"] else "" for a in arms]
        delta = s.get("delta_vs_target", {}).get(final)
        out.append(f"| {name} | {s['items']} | " + " | ".join(cells) + " | "
                   + (f"{100 * delta['mean']:+.1f} pts {_pts(delta['ci95'])}" if delta else "n/a") + " | "
                   + _pct(s.get("gap_recovered")) + " |")
    out += ["", "Arms: target / source = the native models; direct = the source's nearest-depth layers injected "
            f"without a map ({m.get('distances', {}).get('raw_kind', 'see distances')}); ridge / residual = the "
            "fitted maps. Gap recovered = (mapped - target) / (source - target).", ""]
    if "mc" in charts:
        out += [f"![multiple choice]({charts['mc']})", ""]
    return out


def _speed(m: dict, charts: dict) -> list[str]:
    tp = m.get("throughput")
    if not tp:
        return []
    first = next(iter(tp.values()))
    out = ["## Speed: decode, TTFT and active compute", "",
           f"Batch {first['batch_size']}, {first['new_tokens']} new tokens (EOS ignored), medians of "
           f"{first['repeats']} interleaved rounds after a compile round (decode phase: median of "
           f"{first.get('decode_repeats', 1)} runs per round). Decode tok/s = tokens after the first / "
           "their time. TTFT = prefill (+ map) + first token. Active compute = source prefill + target decode once, "
           "map and transfer on both participating devices.", "",
           "| prefix | decode tok/s target | source | mapped | mapped / target | TTFT s target | source | mapped "
           "| active s target | source | mapped | saving vs source |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for length, r in tp.items():
        d, t, a = r["decode_tps"], r["ttft_s"], r["active_s"]
        out.append(f"| {_len(int(length))} | {d['target']:.1f} | {d['source']:.1f} | {d['mapped']:.1f} | "
                   f"{r['mapped_over_target_decode']:.3f} | {t['target']:.3f} | {t['source']:.3f} | {t['mapped']:.3f} | "
                   f"{a['target']:.3f} | {a['source']:.3f} | {a['mapped']:.3f} | {_pct(r['active_saving_vs_source'])} |")
    out.append("")
    for name, alt in (("throughput", "decode throughput"), ("active_compute", "active compute"), ("ttft", "TTFT")):
        if name in charts:
            out += [f"![{alt}]({charts[name]})", ""]
    return out


def _map_section(m: dict, charts: dict) -> list[str]:
    out = []
    d = m.get("distances")
    if d:
        arms = list(d["key_cos"])
        out += ["## What the map learned: tensor distances", "",
                f"{d['windows']} held-out windows ({d['tokens']} tokens), means over target layers; keys compared "
                f"before RoPE. 'raw' = the nearest-depth source layer unmapped ({d['raw_kind']}).", "",
                "| | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
        for metric in DIST_METRICS:
            out.append(f"| {metric} | " + " | ".join(f"{d[metric][a]:.3f}" for a in arms) + " |")
        out.append("")
        if "distances" in charts:
            out += [f"![tensor distances]({charts['distances']})", ""]
    kl = m.get("kl")
    if kl:
        out += ["## Residual: source-teacher KL on frozen windows", "",
                f"{kl['windows']} held-out windows, {kl['prefix_len']} prefix tokens mapped, KL(source || target from "
                f"mapped cache) averaged over the next {kl['cont_len']} tokens.", ""]
        if "reduction" in kl:
            lo, hi = kl["residual_minus_ridge_ci95"]
            out += [f"Ridge {kl['ridge']:.4f} -> ridge + residual {kl['residual']:.4f} nats/token: "
                    f"{_pct(kl['reduction'])} lower, {kl['windows_improved']} of {kl['windows']} windows improve; "
                    f"paired 95% CI of residual - ridge [{lo:.4f}, {hi:.4f}].", ""]
        else:
            out += [f"Ridge only (no residual trained): {kl['ridge']:.4f} nats/token.", ""]
        if "target" in kl:
            lo, hi = kl["final_minus_target_ci95"]
            out += [f"The native target (having read the prefix itself): {kl['target']:.4f} nats/token; the final map "
                    f"is at {kl['vs_target']:.3f} x that (paired 95% CI of map - native [{lo:.4f}, {hi:.4f}]; below "
                    "zero = the mapped cache brings the target closer to the source than its own cache does).", ""]
        if "agreement" in kl:
            ag = kl["agreement"]
            out += [f"Next-token agreement ({ag['map']} map): the target's top token matches the source's at "
                    f"{_pct(ag['with_source'])} of positions (native target: {_pct(ag['target_with_source'])}), and "
                    f"the native target's at {_pct(ag['with_target'])}.", ""]
        if "kl_slope" in charts:
            out += [f"![KL slope chart]({charts['kl_slope']})", ""]
    return out


def _retrieval(m: dict, charts: dict) -> list[str]:
    rt = m.get("retrieval")
    if not rt:
        return []
    arms = [a for a in ("target", "direct", "ridge", "residual", "source") if a in next(iter(rt.values()))]
    out = ["## Long-context retrieval (needle, exact match)", "",
           "| length | items | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for length, r in rt.items():
        out.append(f"| {_len(int(length))} | {r['items']} | " + " | ".join(_pct(r[a]) for a in arms) + " |")
    out.append("")
    if "retrieval" in charts:
        out += [f"![retrieval]({charts['retrieval']})", ""]
    return out


def _gate(gate: dict) -> list[str]:
    out = ["## Quality gate", "", f"**{'PASS' if gate['passed'] else 'FAIL'}** for the {gate['map']} map.", "",
           "| check | value | threshold | result |", "|---|---|---|---|"]
    for name, c in gate["checks"].items():
        value = "not measured" if c["value"] is None else f"{c['value']:.4f}"
        result = {True: "pass", False: "**fail**", None: "-"}[c["passed"]]
        note = f" ({c['note']})" if c.get("note") else ""
        out.append(f"| {name}{note} | {value} | {'>=' if c['kind'] == 'min' else '<='} {c['threshold']} | {result} |")
    if not gate["checks"]:
        out.append("| (no thresholds set) | | | |")
    return out + [""]


def _setup(run: dict) -> list[str]:
    out = ["## Setup", "",
           f"- Source: `{run['source']['path']}`; target: `{run['target']['path']}`; dtype {run['source']['dtype']}.",
           f"- Map: pairing {run['map']['pairing']}, rank {run['map']['rank'] or 'full'}, lambda per layer "
           f"{run['map']['lambdas']}; {run['data']['calib_tokens']:,} calibration tokens "
           f"({', '.join(run['data']['train_text'])}), residual {run['map']['residual_steps']} steps.",
           f"- Devices: {run['devices']}; kvjax {run['versions']['kvjax']}, jax {run['versions']['jax']}.",
           "- Stage wall times (measured when each stage ran): "
           + ", ".join(f"{k} {v:.1f}s" for k, v in run["stage_seconds"].items()) + ".",
           "- Timings depend on the machine and its load; compare arms within one run."]
    return out + [""]

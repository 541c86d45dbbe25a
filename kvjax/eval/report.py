"""report.md's frame and the number formats every section shares. The sections themselves are the evaluations'
(kvjax.eval.suite: each renders its metrics.json section); kvjax.eval.suite.render_report puts them in this frame:
title and setup line, summary (the gate's verdict, then each evaluation's bullets), the evaluations' sections, the
gate's checks, the run's setup. Everything here reads metrics.json alone, so a report can be rebuilt from a run
directory without any model."""

from __future__ import annotations

SCHEMA_VERSION = 1  # metrics.json schema (docs/metrics.md)


def pct(x, digits: int = 1) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def pts(ci) -> str:
    return f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}] pts"


def length_label(x: int) -> str:
    return f"{x // 1024}K" if x >= 1024 and x % 1024 == 0 else str(x)


def quality_cost(metrics: dict, arm: str) -> str:
    """How far answers from the cache arm `arm` (kvjax.eval.arms: the final map, "partial", ...) are from the
    answerer's own, from whatever this run measured: next-token agreement with the answerer's native predictions and
    its KL to them (native_kl) and each multiple-choice set's accuracy difference to the native target (mc, paired
    95% CI). An arm that answers from another cache is not faster at the same answer, so every summary line or chart
    that quotes its speed quotes this beside it."""
    parts = []
    nk = metrics.get("native_kl") or {}
    if arm in (nk.get("agreement") or {}):
        parts.append(f"next-token agreement with native {pct(nk['agreement'][arm])} (KL {nk['kl'][arm]:.4f} "
                     "nats/token)")
    for name, m in (metrics.get("mc") or {}).items():
        d = (m.get("delta_vs_target") or {}).get(arm)
        if d:
            parts.append(f"{name} accuracy {100 * d['mean']:+.1f} pts vs native target (95% CI {pts(d['ci95'])})")
    return "; ".join(parts) if parts else "answer quality not measured in this run"


def quality_tag(metrics: dict | None, arm: str) -> str:
    """quality_cost's short form for a chart legend: the next-token agreement with native where measured."""
    agreement = ((metrics or {}).get("native_kl") or {}).get("agreement") or {}
    return (f"answers differ: {pct(agreement[arm], 0)} next-token agreement" if arm in agreement
            else "answers differ from native")


def header(metrics: dict) -> list[str]:
    run = metrics["run"]
    src, tgt = run["source"]["name"], run["target"]["name"]
    # the gated (final) map: ridge + residual when a residual was trained
    kind = f"ridge + rank-{run['map']['residual_rank']} residual" if run["map"]["residual_steps"] > 0 else "ridge"
    context = run["map"].get("residual_context", 0)
    if run["map"]["residual_steps"] > 0 and context:  # a context map (ResidualConfig.context)
        kinds = {"k": " in its keys", "v": " in its values"}.get(run["map"].get("residual_context_kinds", "kv"), "")
        kind += f" (reading {context} previous position{'s' if context > 1 else ''}{kinds})"
    if run["map"]["residual_steps"] > 0 and run["map"].get("residual_attention"):  # a cross-position map
        kind += f" (attending over every earlier position, {run['map']['residual_attention']} heads)"
    if run["map"].get("ridge_trained"):  # ResidualConfig.train_ridge
        kind += ", trained end to end"
    return [f"# kvjax run `{run['config']}`: {src} reads, {tgt} answers", "",
            f"Source **{src}** ({run['source']['params_m']:.1f}M params, {run['source']['layers']} layers) prefills "
            f"the prompt; a {kind} "
            f"map translates its KV cache; target **{tgt}** ({run['target']['params_m']:.1f}M params, "
            f"{run['target']['layers']} layers) decodes from the mapped cache. Every number below is on held-out "
            f"data; metrics.json holds them all (schema: docs/metrics.md).", ""]


def gate_bullet(gate: dict) -> str:
    failed = [f"{name} {c['value']:.4g} {'<' if c['kind'] == 'min' else '>'} {c['threshold']:.4g}"
              for name, c in gate.get("checks", {}).items() if c.get("passed") is False]
    return (f"- **Quality gate: {'PASS' if gate['passed'] else 'FAIL'}** (map: {gate['map']}"
            + (f"; failed: {', '.join(failed)}" if failed else "") + "). "
            + ("The map may serve requests." if gate["passed"] else
               "`split_generate(..., gate=kvjax.load_gate(...))` falls back to native target prefill."))


def gate_section(gate: dict) -> list[str]:
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


def setup_section(run: dict) -> list[str]:
    out = ["## Setup", "",
           f"- Source: `{run['source']['path']}`; target: `{run['target']['path']}`; dtype {run['source']['dtype']}.",
           f"- Map: pairing {run['map']['pairing']}, rank {run['map']['rank'] or 'full'}, lambda per layer "
           f"{run['map']['lambdas']}; {run['data']['calib_tokens']:,} calibration tokens "
           f"({', '.join(run['data']['train_text'])}), residual {run['map']['residual_steps']} steps.",
           f"- Devices: {run['devices']}; kvjax {run['versions']['kvjax']}, jax {run['versions']['jax']}.",
           "- Stage wall times (measured when each stage ran): "
           + ", ".join(f"{k} {v:.1f}s" for k, v in run["stage_seconds"].items()) + ".",
           "- Timings depend on the machine and its load; compare arms within one run."]
    if run.get("maps"):  # older metrics lack it
        out.insert(-1, "- Fitted maps (size of the float32 parameters as the method stores them; wall seconds of the "
                   "stages that fitted them): " + ", ".join(f"{name} {m['size_bytes'] / 1e6:.2f} MB in "
                                                         f"{m['fit_seconds']:.1f}s" for name, m in run["maps"].items())
                   + ".")
    return out + [""]

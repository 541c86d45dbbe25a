"""Evaluation `speculative`: speculative decoding with the reader as drafter and the answerer as verifier, timed side by
side with the answerer's native decoding (kvjax.eval.speculative_timing): plain drafting (the verifier prefills
natively) and speculative KV transfer (the reader prefills once, its cache is mapped with the final map, optionally
repaired, and the verifier checks drafts from the mapped cache; kvjax.speculative.speculative_split_generate). Per
prompt length and draft length: acceptance length, decode tokens/s, end-to-end latency (cache + `new_tokens` tokens) and
the transfer's agreement with the answerer's native greedy output; with `tail`, also the transfer (repaired, when the
repaired arm runs) with the answerer reading each prompt's last RunConfig.arms.tail_tokens tokens itself on top
(kvjax.builders.NativeTail); with `lookup`, also the answerer drafting for itself by prompt lookup (no reader:
kvjax.speculative.LookupDrafter). For small reads, large answers; off by default. metrics.json `speculative`. The
summary's best arm is the fastest whose output equals native greedy (plain, lookup); a transfer answers from another
cache, so its latency is only ever quoted beside its agreement and its cache's quality."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.report import length_label, pct, quality_cost
from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one

log = logging.getLogger(__name__)
NATIVE = "native"
# arm kinds whose verifier reads the answerer's own native prefill: lossless, so their output is native greedy's and
# their latency is a speed-up of the same answer. transfer / repaired verify from the mapped cache: their latency buys
# a different answer, so they are never ranked against native (kvjax.eval.speculative_timing)
SAME_CACHE = ("plain", "lookup")
# the kvjax.eval.arms cache each reads (None: the final map; the tail's: "partial_tail" with a repair, else "tail")
CACHE_ARM = {"transfer": None, "repaired": "partial", "tail": "tail"}
COLOURS = {"native": "#4C72B0", "plain": "#8172B3", "transfer": "#55A868", "repaired": "#C44E52", "lookup": "#DD8452",
           "tail": "#E6A0C4"}


@dataclasses.dataclass(frozen=True)
class SpeculativeEval:
    enabled: bool = False
    lengths: tuple[int, ...] = (1024, 4096)  # prompt lengths (tokens of held-out text)
    draft_lens: tuple[int, ...] = (4,)  # tokens drafted per verify round (one set of arms each)
    new_tokens: int = 64  # generated tokens per request (the first included; EOS ignored)
    repeats: int = 3  # timed rounds after a compile round (arms in rotating order); medians are reported
    repair: bool = True  # also the transfer repaired by partial recomputation (RunConfig.arms settings)
    batch_size: int = 1
    lookup: bool = True  # also the answerer drafting for itself by prompt lookup (lookup@G; no reader involved)
    # also tail@G: the transfer (repaired as repaired@G when `repair`) with the answerer reading each prompt's last
    # RunConfig.arms.tail_tokens tokens itself on top (kvjax.builders.NativeTail)
    tail: bool = False


def run(ec: SpeculativeEval, ctx) -> dict:
    from kvjax.eval.speculative_timing import measure_speculative
    repair = (ctx.cfg.arms.partial_k, ctx.cfg.arms.partial_mode) if ec.repair else None
    tail = ctx.cfg.arms.tail_tokens if ec.tail else 0
    rows = measure_speculative(ctx.source, ctx.target, ctx.map(ctx.final), ctx.heldout.reshape(-1), ec.lengths,
                               draft_lens=ec.draft_lens, new_tokens=ec.new_tokens, repeats=ec.repeats,
                               batch_size=ec.batch_size, repair=repair, lookup=ec.lookup, tail=tail)
    for length, arms in rows.items():
        log.info("speculative %5d: %s", length, {a: (round(float(np.median(r["seconds"])), 3), r["tau"],
                                                    round(r["prefix"], 3)) for a, r in arms.items()})
    return {"rows": {str(k): v for k, v in rows.items()}, "final": ctx.final, "new_tokens": ec.new_tokens,
            "batch_size": ec.batch_size, "repeats": ec.repeats,
            "repair": None if repair is None else {"k": repair[0], "mode": repair[1]},
            **({"tail_tokens": tail} if tail else {})}


def _decode_seconds(phases: dict) -> float:
    """Seconds after the verifier's cache exists: native first token + decode; a speculative arm's loop ("decode",
    which for plain drafting includes the drafter's own prefill)."""
    return phases.get("first_token", 0.0) + phases["decode"]


def metrics(ev: dict, ctx) -> dict:
    n, b = ev["new_tokens"], ev["batch_size"]
    out = {}
    for length, arms in sorted(ev["rows"].items(), key=lambda kv: int(kv[0])):
        native = np.asarray(arms[NATIVE]["seconds"])
        row = {}
        for arm, r in arms.items():
            secs = np.asarray(r["seconds"], np.float64)
            decode = np.asarray([_decode_seconds(p) for p in r["phases"]])
            m = {"latency_s": float(np.median(secs)), "decode_tps": float(n * b / np.median(decode)),
                 "phases_s": {k: float(np.median([p[k] for p in r["phases"]])) for k in r["phases"][0]},
                 "acceptance_length": r["tau"], "matches_native": r["exact"], "prefix_match": r["prefix"],
                 "first_token_match": r["first"]}
            if arm != NATIVE:
                per_round = secs / native  # same round: machine drift cancels
                m["latency_vs_native"] = float(np.median(secs) / np.median(native))
                m["latency_vs_native_rounds"] = [float(per_round.min()), float(np.median(per_round)),
                                                 float(per_round.max())]
            row[arm] = m
        out[length] = row
    return {"lengths": out, "final": ev["final"], "new_tokens": n, "batch_size": b, "repeats": ev["repeats"],
            "repair": ev["repair"], **({"tail_tokens": ev["tail_tokens"]} if "tail_tokens" in ev else {})}


def _kind(arm: str) -> str:
    return arm.split("@")[0]


def same_answer(arm: str, m: dict) -> bool:
    """Whether `arm` may be ranked against native decoding by speed: it verifies from the answerer's own cache AND
    its output equalled native greedy on every request (a lossless arm that drifted numerically is not ranked
    either). A transfer that happened to match on the timed prompts still answers from another cache: never ranked."""
    return _kind(arm) in SAME_CACHE and m["matches_native"] == 1.0


def _cache_of(kind: str, sp: dict) -> str | None:
    """The kvjax.eval.arms cache a transfer kind's verifier reads (whose quality mc / native_kl measure); None for the
    kinds that read the answerer's own cache."""
    if kind not in CACHE_ARM:
        return None
    if kind == "tail" and sp["repair"] and sp["repair"]["k"]:
        return "partial_tail"
    return CACHE_ARM[kind] or sp["final"]


def _answers_from(kind: str, sp: dict, ctx) -> str:
    rep = sp["repair"]
    if kind == "transfer":
        return f"answers from the {sp['final']}-mapped cache, not {ctx.target}'s own"
    if kind == "repaired" and rep:
        return (f"answers from the {sp['final']}-mapped cache with {rep['mode']} {rep['k']} layer(s) recomputed, "
                f"not {ctx.target}'s own")
    if kind == "tail":
        repaired = f" with {rep['mode']} {rep['k']} layer(s) recomputed" if rep and rep["k"] else ""
        return (f"answers from the {sp['final']}-mapped cache{repaired} and the prompt's last {sp.get('tail_tokens')} "
                f"tokens read by {ctx.target} itself, not {ctx.target}'s own cache")
    return f"verifies from {ctx.target}'s own cache, but its output differed from native greedy"


def summary(sp: dict, ctx) -> list[str]:
    """The fastest arm whose output equals native greedy (the reference its latency is compared with), then every
    other arm in its own line: its latency beside its agreement with native greedy and, for a transfer, the quality
    of the cache it reads (kvjax.eval.report.quality_cost)."""
    longest = max(sp["lengths"], key=int)
    row = sp["lengths"][longest]
    at = f"at {length_label(int(longest))} ({sp['new_tokens']} tokens)"
    arms = [a for a in row if a != NATIVE]
    same = [a for a in arms if same_answer(a, row[a])]
    if same:
        best = min(same, key=lambda a: row[a]["latency_vs_native"])
        r = row[best]
        out = [f"- Speculative decoding {at}: best arm {best} at {pct(r['latency_vs_native'] - 1)} end-to-end "
               f"latency vs native {ctx.target} decoding, output identical to native greedy (acceptance length "
               f"{r['acceptance_length']:.2f}; ranked among the arms with native greedy's output: {', '.join(same)})."]
    else:
        out = [f"- Speculative decoding {at}: no arm's output equalled native {ctx.target} greedy on every request, "
               "so none is ranked by speed."]
    differ = [a for a in arms if a not in same]
    for kind in dict.fromkeys(_kind(a) for a in differ):  # one line per kind, in the table's order
        cells = [f"{a} at {pct(row[a]['latency_vs_native'] - 1)} end-to-end latency vs native, output equal to "
                 f"native greedy on {pct(row[a]['matches_native'], 0)} of requests, {pct(row[a]['prefix_match'])} of "
                 "tokens before the first difference" for a in differ if _kind(a) == kind]
        line = f"- Not ranked by speed {at}: {kind}@G {_answers_from(kind, sp, ctx)}. " + "; ".join(cells)
        cache = _cache_of(kind, sp)
        if cache:
            line += f"; quality of the {cache} cache: {quality_cost(ctx.metrics, cache)}"
        out.append(line + ".")
    return out


def report(sp: dict, ctx) -> list[str]:
    rep = sp["repair"]
    out = ["## Speculative decoding: plain drafting and speculative KV transfer", "",
           f"{ctx.source} drafts, {ctx.target} verifies; batch {sp['batch_size']}, {sp['new_tokens']} tokens per "
           f"request (EOS ignored), medians of {sp['repeats']} timed rounds (arms in rotating order, after a compile "
           f"round). native = {ctx.target}'s own prefill and decoding; plain@G = it prefills natively and {ctx.source} "
           f"drafts G tokens per round from its own prefill; transfer@G = {ctx.source} prefills once, the "
           f"{sp['final']} map gives {ctx.target} its cache, {ctx.target} verifies from it"
           + (f"; repaired@G = the same with {rep['mode']} {rep['k']} {ctx.target} layer(s) recomputed" if rep else "")
           + (f"; tail@G = the same{' repaired' if rep and rep['k'] else ''}, then {ctx.target} reads the prompt's "
              f"last {sp['tail_tokens']} tokens itself" if sp.get("tail_tokens") else "")
           + (f"; lookup@G = {ctx.target} prefills natively and drafts for itself by prompt lookup (the G tokens "
              "that followed the latest earlier match of the context's last n-gram; no reader)"
              if any(_kind(a) == "lookup" for row in sp["lengths"].values() for a in row) else "")
           + ". Latency = cache + all tokens; decode tok/s = tokens / (time after the cache exists); acceptance = "
             "tokens per verify round; matches = output equal to native greedy (all tokens / share of tokens before "
             "the first difference / first token).", "",
           "| prompt | arm | latency s | vs native [min, med, max of rounds] | decode tok/s | acceptance | matches "
           "native (all / prefix / first) |", "|---|---|---|---|---|---|---|"]
    for length, row in sp["lengths"].items():
        for arm, m in row.items():
            vs = (f"{pct(m['latency_vs_native'] - 1)} [{m['latency_vs_native_rounds'][0]:.2f}, "
                  f"{m['latency_vs_native_rounds'][1]:.2f}, {m['latency_vs_native_rounds'][2]:.2f}]"
                  if arm != NATIVE else "-")
            tau = "-" if m["acceptance_length"] is None else f"{m['acceptance_length']:.2f}"
            out.append(f"| {length_label(int(length))} | {arm} | {m['latency_s']:.3f} | {vs} | {m['decode_tps']:.1f} "
                       f"| {tau} | {pct(m['matches_native'], 0)} / {pct(m['prefix_match'], 0)} / "
                       f"{pct(m['first_token_match'], 0)} |")
    out.append("")
    # a latency is a speed-up only of the same answer: say which rows are ranked and what the others' answers cost
    kinds = list(dict.fromkeys(_kind(a) for row in sp["lengths"].values() for a in row))
    lossless = " and ".join(f"{k}@G" for k in kinds if k in SAME_CACHE)
    kinds = [k for k in kinds if k in CACHE_ARM]
    out += ["Ranked by speed (the summary's best arm): only arms whose output equals native greedy on every request"
            + (f" ({lossless} verify from {ctx.target}'s own cache)." if lossless else ".")
            + "".join(f" {k}@G {_answers_from(k, sp, ctx)}: its latency buys a different answer (matches columns; "
                      f"quality of the {_cache_of(k, sp)} cache: {quality_cost(ctx.metrics, _cache_of(k, sp))})."
                      for k in kinds), ""]
    if "speculative" in ctx.charts:
        out += [f"![speculative decoding latency]({ctx.charts['speculative']})", ""]
    return out


def chart(sp: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    plt = charts.plt()
    lengths = sorted(sp["lengths"], key=int)
    arms = list(sp["lengths"][lengths[0]])
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(arms) * len(lengths) + 2), 4.2))
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        x = np.arange(len(lengths)) + (i - (len(arms) - 1) / 2) * width
        ms = [sp["lengths"][ln][arm] for ln in lengths]
        # an arm whose output differs from native greedy is not faster at the same answer: hatched, its legend says
        # so and each bar carries its share of tokens matching native before the first difference
        same = [arm == NATIVE or same_answer(arm, m) for m in ms]
        bars = ax.bar(x, [m["latency_s"] for m in ms], width, color=COLOURS.get(_kind(arm), "#8C8C8C"),
                      label=arm if all(same) else f"{arm} (answers differ from native greedy)",
                      **({} if all(same) else {"hatch": "//", "edgecolor": "black"}),
                      alpha=1.0 if arm == NATIVE or arm.endswith(f"@{arms[-1].split('@')[-1]}") else 0.75)
        ax.bar_label(bars, labels=[f"{m['latency_s']:.2f}" if ok else f"{m['latency_s']:.2f}\n"
                                   f"{pct(m['prefix_match'], 0)} prefix match" for m, ok in zip(ms, same)],
                     fontsize=7, padding=2)
    ax.set_xticks(range(len(lengths)), [f"{length_label(int(ln))} prompt" for ln in lengths])
    ax.set(ylabel="end-to-end seconds (median)",
           title=f"Latency of {sp['new_tokens']} tokens: native {ctx.target} vs speculative decoding")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=min(len(arms), 3), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    return charts.save(fig, path)


def preflight(ec: SpeculativeEval, cfg) -> list[str]:
    problems = at_least_one("eval.speculative", ec, "repeats", "batch_size", "new_tokens")
    if not ec.lengths or min(ec.lengths) < 2:
        problems.append("eval.speculative.lengths must be prompt lengths >= 2 tokens")
    if not ec.draft_lens or min(ec.draft_lens) < 1:
        problems.append("eval.speculative.draft_lens must be draft lengths >= 1")
    elif ec.enabled and ec.lengths:
        from kvjax.hf import CheckpointError, load_hf_config
        from kvjax.models.config import ConfigError
        try:  # a verify round writes draft_len + 1 positions past the last token
            limit = min(load_hf_config(getattr(cfg, r).path).max_position_embeddings for r in ("source", "target"))
        except (CheckpointError, ConfigError, OSError):
            return problems  # preflight reports the checkpoint itself
        need = max(ec.lengths) + ec.new_tokens + max(ec.draft_lens) + 1
        if need > limit:
            problems.append(f"eval.speculative: the longest prompt ({max(ec.lengths)}) + new_tokens ({ec.new_tokens}) "
                            f"+ draft length ({max(ec.draft_lens)}) + 1 = {need} positions exceed the models' "
                            f"max_position_embeddings ({limit}); use prompts of at most "
                            f"{limit - ec.new_tokens - max(ec.draft_lens) - 1} tokens")
    return problems


EVALUATION = Evaluation(
    name="speculative", settings=SpeculativeEval, run=run, metrics=metrics, section=25, report=report,
    summary=summary, charts=(Chart("speculative", chart),),
    depends=lambda cfg: {"arm_settings": dataclasses.asdict(cfg.arms)}, preflight=preflight)

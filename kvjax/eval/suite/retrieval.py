"""Evaluation `retrieval`: long-context needle retrieval, exact match of the answer per arm and prompt length
(shipped JSONL sets, or items generated from the held-out text). metrics.json `retrieval`; the gate's
retrieval_retention and retrieval (exact match)."""

from __future__ import annotations

import dataclasses
import logging
import os

import numpy as np

from kvjax.eval.report import length_label, pct
from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one, unknown_arms
from kvjax.eval.gate import check, retention

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RetrievalEval:
    enabled: bool = True
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # prompt lengths in tokens
    # JSONL sets, "{length}" is replaced by each length; "" generates needle items from the held-out text
    files: str = "checkpoints/toy/eval/retrieval_{length}.jsonl"
    limit: int = 20  # items per length
    arms: tuple[str, ...] = ("target", "source", "residual")  # names in kvjax.eval.arms.TABLE
    batch_size: int = 8  # items decoded together


def retrieval_file(ec: RetrievalEval, length: int) -> str:
    return ec.files.replace("{length}", str(length))


def run(ec: RetrievalEval, ctx) -> dict:
    from kvjax.eval.arms import make_arms, score_retrieval_arms
    from kvjax.eval.needles import make_needle_items
    from kvjax.eval.needle_retrieval import load_retrieval
    arms = make_arms(ec.arms, ctx.source, ctx.target, ctx.map, ctx.final, ctx.cfg.arms)
    tokenizer = ctx.tokenizer()
    out = {}
    for length in ec.lengths:
        if ec.files:
            items = load_retrieval(retrieval_file(ec, length), tokenizer, limit=ec.limit)
        else:
            items = make_needle_items(ctx.heldout.reshape(-1), tokenizer, length, ec.limit, ctx.cfg.seed)
        results = score_retrieval_arms(items, arms, ec.batch_size, desc=f"retrieval {length}")
        out[str(length)] = {"items": len(items), "source": retrieval_file(ec, length) if ec.files else "generated",
                            "arms": {name: {"correct": r.correct.tolist(), "answer_logprob": r.answer_logprob.tolist()}
                                     for name, r in results.items()}}
        log.info("retrieval %d (%d items): %s", length, len(items),
                 {n: round(r.accuracy, 4) for n, r in results.items()})
    return out


def metrics(ev: dict, ctx) -> dict:
    out = {}
    for length, s in sorted(ev.items(), key=lambda kv: int(kv[0])):
        row = {arm: float(np.mean(v["correct"])) for arm, v in s["arms"].items()}
        row["items"] = s["items"]
        row["answer_logprob"] = {arm: float(np.mean(v["answer_logprob"])) for arm, v in s["arms"].items()}
        out[str(length)] = row
    return out


def report(rt: dict, ctx) -> list[str]:
    from kvjax.eval.arms import in_table_order
    arms = in_table_order(next(iter(rt.values())))
    out = ["## Long-context retrieval (needle, exact match)", "",
           "| length | items | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for length, r in rt.items():
        out.append(f"| {length_label(int(length))} | {r['items']} | " + " | ".join(pct(r[a]) for a in arms) + " |")
    out.append("")
    if "retrieval" in ctx.charts:
        out += [f"![retrieval]({ctx.charts['retrieval']})", ""]
    return out


def chart(rt: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    from kvjax.eval.arms import ARMS, in_table_order
    plt = charts.plt()
    xs = charts.lengths(rt)
    arms = in_table_order(rt[str(xs[0])])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in arms:
        ax.plot(xs, [100 * rt[str(x)][arm] for x in xs], "o-", color=ARMS[arm].colour, label=ARMS[arm].label)
    ax.set(xlabel="prompt length (tokens)", ylabel="exact match (%)", ylim=(-3, 103),
           title=f"Needle retrieval ({rt[str(xs[0])]['items']} items per length)")
    charts.length_axis(ax, xs)
    ax.grid(alpha=0.3)
    ax.legend()
    return charts.save(fig, path)


def preflight(ec: RetrievalEval, cfg) -> list[str]:
    from kvjax.eval.needle_retrieval import load_retrieval
    from kvjax.hf import CheckpointError, load_tokenizer
    problems = at_least_one("eval.retrieval", ec, "batch_size", "limit") + unknown_arms("eval.retrieval", ec.arms)
    if not ec.enabled:
        return problems
    if ec.files:
        tokenizer = None
        for length in ec.lengths:
            path = retrieval_file(ec, length)
            if not os.path.isfile(path):
                problems.append(f"eval.retrieval.files: no {path} for length {length} (or set "
                                "eval.retrieval.files='' to generate needle items from the held-out text)")
                continue
            try:
                tokenizer = tokenizer or load_tokenizer(cfg.target.path)
                load_retrieval(path, tokenizer, limit=ec.limit)
            except (ValueError, KeyError, OSError, CheckpointError) as e:
                problems.append(f"eval.retrieval: {path}: {e!r}" if isinstance(e, KeyError) else
                                f"eval.retrieval: {e}")
    if not ec.lengths or min(ec.lengths) < 16:
        problems.append("eval.retrieval.lengths must be lengths >= 16 tokens")
    return problems


def gate(rt: dict, config, map_arm: str) -> list:
    """Retention and exact match of the gated map on the worst length (named in the checks' notes)."""
    from kvjax.eval.arms import TARGET
    worst, where = None, ""
    for length, m in rt.items():
        if map_arm in m and TARGET in m:
            r = retention(m[map_arm], m[TARGET])
            if r is not None and (worst is None or r < worst):
                worst, where = r, f"length {length}"
    lowest = min(((m[map_arm], length) for length, m in rt.items() if map_arm in m), default=None)
    return (check("retrieval_retention", worst, config.min_retrieval_retention, "min",
                  where or "native target scored 0: retention undefined") +
            check("retrieval", None if lowest is None else lowest[0], config.min_retrieval, "min",
                  f"length {lowest[1]}" if lowest else f"arm {map_arm} not in eval.retrieval.arms"))


EVALUATION = Evaluation(
    name="retrieval", settings=RetrievalEval, run=run, metrics=metrics, section=50, report=report,
    charts=(Chart("retrieval", chart),), depends=lambda cfg: {"seed": cfg.seed}, preflight=preflight, gate=gate)

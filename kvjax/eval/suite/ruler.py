"""Evaluation `ruler` (off by default): RULER-style multi-task retrieval, exact match of the answer per task, arm and
prompt length, on items built in token space from the held-out text for any tokenizer (kvjax.eval.ruler_tasks: one
needle in the trained "key = digits" format and in three formats never shown in training, several keys, several
values, variable tracking). metrics.json `ruler`; the gate's ruler_unseen."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from kvjax.eval.report import length_label, pct
from kvjax.eval.ruler_tasks import TASK_NAMES, TASKS, Sizes
from kvjax.eval.suite.evaluation import Chart, Evaluation, at_least_one, unknown_arms
from kvjax.eval.gate import check

log = logging.getLogger(__name__)
MEANS = ("mean", "unseen")  # per length, beside the tasks: each arm's mean over the tasks / the unseen-format tasks


@dataclasses.dataclass(frozen=True)
class RulerEval:
    # off in the default job: 7 tasks x `limit` items x every length and arm. On the toy pair (toy_pruned_quick's maps,
    # 2026-12-04) 1K alone with 20 items and 3 arms took 84 CPU s (180 s wall on a loaded 2-core machine); the default
    # 1K / 2K / 4K costs several times that
    enabled: bool = False
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # prompt lengths in tokens
    tasks: tuple[str, ...] = TASK_NAMES  # names in kvjax.eval.ruler_tasks.TASKS
    limit: int = 20  # items per task and length
    arms: tuple[str, ...] = ("target", "source", "residual")  # names in kvjax.eval.arms.TABLE
    batch_size: int = 8  # items decoded together
    depth: tuple[float, ...] = (0.1, 0.9)  # needles start between these fractions of the haystack
    needles: int = 4  # niah_multikey: facts with different keys (one asked)
    values: int = 3  # niah_multivalue: values of the one key (all asked, in order)
    chain: int = 4  # vt: variables per chain of assignments (the last one of one chain asked)
    # vt: chains with different values, interleaved: copying any assigned number scores ~1 / chains (with 1 chain it
    # answers every item without tracking anything)
    chains: int = 2
    value_digits: int = 5  # digits of every value


def sizes_of(ec: RulerEval) -> Sizes:
    return Sizes(depth=tuple(ec.depth), needles=ec.needles, values=ec.values, chain=ec.chain,
                 chains=ec.chains, value_digits=ec.value_digits)


def run(ec: RulerEval, ctx) -> dict:
    from kvjax.eval.arms import make_arms, score_retrieval_arms
    from kvjax.eval.ruler_tasks import make_task_items
    arms = make_arms(ec.arms, ctx.source, ctx.target, ctx.map, ctx.final, ctx.cfg.arms)
    tokenizer, heldout = ctx.tokenizer(), ctx.heldout.reshape(-1)
    out = {}
    for length in ec.lengths:
        row = out[str(length)] = {}
        for task in ec.tasks:
            items = make_task_items(task, heldout, tokenizer, length, ec.limit, ctx.cfg.seed, sizes_of(ec))
            results = score_retrieval_arms(items, arms, ec.batch_size, desc=f"ruler {task} {length}")
            per_arm = {name: {"correct": r.correct.tolist(), "answer_logprob": r.answer_logprob.tolist(),
                              "prefix": [leading_matches(g, it.answer_ids) for g, it in zip(r.generated, items)]}
                       for name, r in results.items()}
            row[task] = {"items": len(items), "unseen": TASKS[task].unseen, "answers": [it.answer for it in items],
                         "answer_tokens": [len(it.answer_ids) for it in items], "arms": per_arm}
            log.info("ruler %d %s (%d items): %s", length, task, len(items),
                     {n: round(r.accuracy, 4) for n, r in results.items()})
    return out


def leading_matches(generated: list[int], answer: list[int]) -> int:
    """Answer tokens the greedy decode gets right before its first miss (score_retrieval_arms' `generated` is
    greedy decoding's output up to that miss)."""
    return next((i for i, (g, a) in enumerate(zip(generated, answer)) if g != a), min(len(generated), len(answer)))


def _mean(rows: list[dict], arm: str) -> float | None:
    vals = [r[arm] for r in rows if arm in r]
    return float(np.mean(vals)) if vals and len(vals) == len(rows) else None


def metrics(ev: dict, ctx) -> dict:
    out = {}
    for length, tasks in sorted(ev.items(), key=lambda kv: int(kv[0])):
        row = {}
        for task, s in tasks.items():
            row[task] = {arm: float(np.mean(v["correct"])) for arm, v in s["arms"].items()}
            row[task].update(items=s["items"], unseen=bool(s["unseen"]),
                             answer_logprob={arm: float(np.mean(v["answer_logprob"])) for arm, v in s["arms"].items()})
            if "answer_tokens" in s:  # the share of answer tokens right before the first miss: partial credit
                n = np.asarray(s["answer_tokens"], np.float64)
                row[task]["prefix_match"] = {arm: float(np.mean(np.asarray(v["prefix"]) / n))
                                             for arm, v in s["arms"].items()}
        arms = sorted({a for s in tasks.values() for a in s["arms"]})
        for name, rows in (("mean", list(row.values())), ("unseen", [r for r in row.values() if r["unseen"]])):
            if rows:
                row[name] = {a: m for a in arms if (m := _mean(rows, a)) is not None}
        out[str(length)] = row
    return out


def task_rows(rt_length: dict) -> list[str]:
    """The task names of one length's metrics, in TASKS order (then any others)."""
    names = [t for t in rt_length if t not in MEANS]
    return sorted(names, key=lambda t: (TASK_NAMES.index(t) if t in TASK_NAMES else len(TASK_NAMES), t))


def _arms(rt: dict) -> list[str]:
    from kvjax.eval.arms import in_table_order
    return in_table_order(a for r in rt.values() for t in task_rows(r) for a in r[t])


def summary(rt: dict, ctx) -> list[str]:
    from kvjax.eval.arms import SOURCE, TARGET
    parts = []
    for length, r in rt.items():
        m = r.get("unseen") or r.get("mean") or {}
        shown = [(a, n) for a, n in ((TARGET, "target"), (ctx.final, f"mapped ({ctx.final})"), (SOURCE, "source"))
                 if a in m]
        if shown:
            parts.append(f"{length_label(int(length))} " + ", ".join(f"{n} {pct(m[a])}" for a, n in shown))
    if not parts:
        return []
    which = "unseen needle formats" if any("unseen" in r for r in rt.values()) else "all tasks"
    return [f"- RULER-style retrieval (exact match, mean over the {which}): " + "; ".join(parts) + "."]


def report(rt: dict, ctx) -> list[str]:
    from kvjax.eval.arms import ARMS
    arms = _arms(rt)
    out = ["## Multi-task retrieval (RULER-style, exact match)", "",
           "Items built from the held-out text (kvjax.eval.ruler_tasks): one needle in the trained `key = digits` "
           "format (`niah_single_kv`) and in three formats never shown in training (marked \\*), several keys "
           "(`niah_multikey`: one asked, the others distractors), one key with several values (`niah_multivalue`: "
           "all asked, in order) and variable tracking (`vt`: the value at the end of a chain of assignments). "
           "Greedy exact match of every answer token.", ""]
    head = "| task | items | " + " | ".join(ARMS[a].label for a in arms) + " |"
    for length, r in rt.items():
        out += [f"**{length_label(int(length))} tokens**", "", head, "|---|---|" + "---|" * len(arms)]
        for t in task_rows(r):
            name = f"`{t}`" + (" \\*" if r[t].get("unseen") else "")
            out.append(f"| {name} | {r[t]['items']} | " + " | ".join(pct(r[t].get(a)) for a in arms) + " |")
        for key, label in (("mean", "mean over tasks"), ("unseen", "mean over unseen formats \\*")):
            if key in r:
                out.append(f"| {label} | | " + " | ".join(pct(r[key].get(a)) for a in arms) + " |")
        out.append("")
    if "ruler" in ctx.charts:
        out += [f"![ruler]({ctx.charts['ruler']})", ""]
    return out


def chart(rt: dict, path: str, ctx) -> str:
    """Grouped bars: exact match per task (x) and arm (bars), one panel per length."""
    from kvjax.eval import charts
    from kvjax.eval.arms import ARMS
    plt = charts.plt()
    xs = charts.lengths(rt)
    arms = _arms(rt)
    fig, axes = plt.subplots(len(xs), 1, figsize=(9, 3.2 * len(xs)), squeeze=False)
    width = 0.8 / max(len(arms), 1)
    for ax, x in zip(axes[:, 0], xs):
        r = rt[str(x)]
        tasks = task_rows(r) + [m for m in MEANS if m in r]
        for i, arm in enumerate(arms):
            vals = [100 * (r[t].get(arm) or 0.0) for t in tasks]
            ax.bar(np.arange(len(tasks)) + (i - (len(arms) - 1) / 2) * width, vals, width, color=ARMS[arm].colour,
                   label=ARMS[arm].label)
        labels = [t.replace("niah_", "").replace("single_", "") + ("*" if r[t].get("unseen") else "")
                  for t in task_rows(r)] + [{"mean": "mean", "unseen": "unseen*\nmean"}[m] for m in MEANS if m in r]
        ax.set_xticks(np.arange(len(tasks)), labels, fontsize=8)
        ax.set(ylabel="exact match (%)", ylim=(0, 122), title=f"{length_label(x)} tokens")
        ax.set_yticks(range(0, 101, 20))
        ax.grid(alpha=0.3, axis="y")
    axes[0, 0].legend(fontsize=8, ncol=len(arms))
    fig.suptitle("RULER-style retrieval per task (* = needle format unseen in training)")
    return charts.save(fig, path)


def preflight(ec: RulerEval, cfg) -> list[str]:
    from kvjax.hf import CheckpointError, load_tokenizer
    problems = (at_least_one("eval.ruler", ec, "batch_size", "limit", "value_digits") +
                unknown_arms("eval.ruler", ec.arms))
    bad = [t for t in ec.tasks if t not in TASKS]
    if bad or not ec.tasks:
        problems.append(f"eval.ruler.tasks: unknown tasks {bad}; choose from {list(TASK_NAMES)}" if bad else
                        "eval.ruler.tasks: name at least one task")
    problems += [f"eval.ruler.{f} must be >= 2, got {getattr(ec, f)}" for f in ("needles", "values", "chain")
                 if getattr(ec, f) < 2] + at_least_one("eval.ruler", ec, "chains")
    if len(ec.depth) != 2 or not 0 <= ec.depth[0] < ec.depth[1] <= 1:
        problems.append(f"eval.ruler.depth must be two fractions 0 <= lo < hi <= 1, got {ec.depth}")
    if not ec.lengths or min(ec.lengths) < 64:
        problems.append("eval.ruler.lengths must be lengths >= 64 tokens")
    if ec.enabled and not problems:
        try:
            check_formats(load_tokenizer(cfg.target.path), ec)
        except (ValueError, OSError, CheckpointError) as e:
            problems.append(f"eval.ruler: {e}")
    return problems


def check_formats(tokenizer, ec: RulerEval, draws: int = 4) -> None:
    """Raises ValueError when the tokenizer cannot score a task's items (query and answer merge, or a value merges
    with its needle's text): a few draws of every task's needles, query and answer."""
    from kvjax.eval.ruler_tasks import task_parts
    rng = np.random.default_rng(0)
    for task in ec.tasks:
        for _ in range(draws):
            task_parts(tokenizer, TASKS[task], rng, sizes_of(ec))


def gate(rt: dict, config, map_arm: str) -> list:
    """The gated map's exact match on the worst unseen-format task at the shortest length measured."""
    threshold = getattr(config, "min_ruler_unseen", None)
    if not rt:
        return check("ruler_unseen", None, threshold, "min", "evaluation ruler did not run")
    length = min(rt, key=int)
    scores = [(rt[length][t].get(map_arm), t) for t in task_rows(rt[length]) if rt[length][t].get("unseen")]
    if not scores or any(s is None for s, _ in scores):
        return check("ruler_unseen", None, threshold, "min",
                     f"no unseen-format task in eval.ruler.tasks, or arm {map_arm} not in eval.ruler.arms")
    worst = min(scores)
    return check("ruler_unseen", worst[0], threshold, "min", f"{worst[1]} at length {length}")


EVALUATION = Evaluation(
    name="ruler", settings=RulerEval, run=run, metrics=metrics, section=55, report=report, summary=summary,
    charts=(Chart("ruler", chart),), depends=lambda cfg: {"seed": cfg.seed}, preflight=preflight, gate=gate)

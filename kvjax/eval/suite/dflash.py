"""Evaluation `dflash`: lossless block drafting (kvjax.drafter) for one model of the pair, timed side by side with its
own greedy decoding (kvjax.eval.block_drafting): per block size, acceptance length tau, tokens/s, speed-up (median of
same-moment ratios) and whether every output equals greedy's. Off by default; on when a drafter is configured:
`--config.eval.dflash.enabled=true --config.eval.dflash.drafter=checkpoints/toy/drafter` (a drafter trained for the
verifier, `eval.dflash.verifier`: the source by default). metrics.json `dflash`."""

from __future__ import annotations

import dataclasses
import logging

from kvjax.eval.suite.evaluation import Evaluation, at_least_one

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DflashEval:
    enabled: bool = False
    drafter: str = ""  # directory of a block drafter (kvjax.drafter.io) trained for the verifier
    verifier: str = "source"  # the model of the pair that verifies (and that the drafter was trained for)
    blocks: tuple[int, ...] = (16,)  # drafted tokens per round, each a trained block size of the drafter
    prompts: int = 16  # held-out windows, each a prompt
    prompt_len: int = 256
    new_tokens: int = 128  # greedy tokens per prompt (rows stop at EOS)
    batch_size: int = 1


def run(ec: DflashEval, ctx) -> dict:
    from kvjax.drafter import load_block_drafter
    from kvjax.eval.block_drafting import measure, methods_for, pad_group, record

    model = ctx.source if ec.verifier == "source" else ctx.target
    drafters = {f"dflash-{b}": load_block_drafter(ec.drafter, model, draft_len=b) for b in ec.blocks}
    prompts = [list(map(int, w[: ec.prompt_len])) for w in ctx.heldout[: ec.prompts]]
    groups = [pad_group(prompts[i: i + ec.batch_size], ec.prompt_len) for i in range(0, len(prompts), ec.batch_size)]
    rec = record(measure(methods_for(model, drafters, ec.new_tokens), groups), tuple(model[0].eos_token_ids))
    log.info("dflash: %s", {m: (round(sum(v["seconds"]), 2), v.get("rounds")) for m, v in rec["methods"].items()})
    return {**rec, "verifier": ec.verifier, "drafter": ec.drafter, "new_tokens": ec.new_tokens,
            "prompt_len": ec.prompt_len, "batch_size": ec.batch_size}


def metrics(ev: dict, ctx) -> dict:
    from kvjax.eval.block_drafting import summarize
    return {"methods": summarize(ev), **{k: ev[k] for k in ("verifier", "drafter", "new_tokens", "prompt_len",
                                                           "batch_size")}}


def summary(m: dict, ctx) -> list[str]:
    """The fastest method whose output equals greedy's on every prompt group; a method that answered differently
    anywhere (block drafting is lossless by design, so numerics or a bug) is not faster at the same answer: its own
    line, its speed-up beside how often it matched, never the best."""
    methods = {k: r for k, r in m["methods"].items() if k != "greedy"}
    same = [k for k, r in methods.items() if r["identical"] == r["groups"]]
    if same:
        best = max(same, key=lambda k: methods[k]["speedup"])
        r = methods[best]
        out = [f"- Block drafting ({best}) for the {m['verifier']}: {r['speedup']:.2f}x its greedy decoding "
               f"(tau {r['tau']:.2f}), output identical on {r['identical']}/{r['groups']} prompts."]
    else:
        out = [f"- Block drafting for the {m['verifier']}: no method's output equalled its greedy decoding on every "
               "prompt, so none is ranked by speed."]
    return out + [f"- Not ranked by speed: {k} answered differently from greedy (output identical on "
                  f"{r['identical']}/{r['groups']} prompts) at {r['speedup']:.2f}x its greedy decoding "
                  f"(tau {r['tau']:.2f})." for k, r in methods.items() if k not in same]


def report(m: dict, ctx) -> list[str]:
    out = ["## Block drafting (DFlash-style speculative decoding)", "",
           f"The {m['verifier']} verifies blocks drafted by {m['drafter']} (kvjax.drafter); {m['new_tokens']} greedy "
           f"tokens per {m['prompt_len']}-token held-out prompt, batch {m['batch_size']}; each method timed end to end "
           "(prefill + decode) back to back in rotating order; speed-up = median of same-moment ratios to greedy; "
           "tau = tokens per verify round (accepted drafts + 1).", "",
           "| method | speed-up | tau | tokens/s | median s | identical to greedy |", "|---|---|---|---|---|---|"]
    for name, r in m["methods"].items():
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        out.append(f"| {name} | {r['speedup']:.2f}x | {tau} | {r['tok_s']:.1f} | {r['median_s']:.3f} | "
                   f"{r['identical']}/{r['groups']} |")
    return out + [""]


def preflight(ec: DflashEval, cfg) -> list[str]:
    if not ec.enabled:
        return []
    problems = at_least_one("eval.dflash", ec, "prompts", "prompt_len", "new_tokens", "batch_size")
    if ec.verifier not in ("source", "target"):
        problems.append(f"eval.dflash.verifier must be 'source' or 'target', got {ec.verifier!r}")
    if not ec.drafter:
        return problems + ["eval.dflash.drafter: set the directory of a trained block drafter "
                           "(e.g. checkpoints/toy/drafter, made by python -m launch.toy.drafter)"]
    from kvjax.drafter.io import DrafterError, load_manifest
    try:
        trained = load_manifest(ec.drafter)["block_sizes"]
    except DrafterError as e:
        return problems + [f"eval.dflash.drafter: {e}"]
    bad = [b for b in ec.blocks if b not in trained]
    if not ec.blocks or bad:
        problems.append(f"eval.dflash.blocks {list(ec.blocks)}: the drafter was trained for block sizes {trained}")
    return problems


EVALUATION = Evaluation(
    name="dflash", settings=DflashEval, run=run, metrics=metrics, section=26, report=report, summary=summary,
    heldout=lambda ec, cfg: (ec.prompts, ec.prompt_len) if ec.enabled else (0, 0), preflight=preflight)

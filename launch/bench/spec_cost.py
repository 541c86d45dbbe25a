"""Speculative decoding priced part by part (kvjax.speculative.cost): each drafter's tau and verify widths on held-out
prompts, the cost of every part measured inside the verify loop, the speed-up those predict, and the speed-up
measured on the same runs, side by side in one process.

    python -m launch.bench.spec_cost --out runs/spec_cost.json                # 2 sets x 12 prompts, b = 4 / 8 / 16
    python -m launch.bench.spec_cost --prompts 100 --repeats 0               # exactness and tau only (200 prompts)
    python -m launch.bench.spec_cost --kinds --models checkpoints/toy/target checkpoints/toy/pruned \
        --transfer runs/toy_reverse/map --transfer-repair 0 4    # the pair's small models and speculative KV transfer
    python -m launch.bench.spec_cost --smoke                                  # tiny random models (the tests)

Verifier: the toy source. Drafters: prompt lookup (`lookup-b`), the block drafter (`block-b`,
checkpoints/toy/drafter) and the two combined (`combined-b`: lookup's draft where the context's last n-gram of >=
--min-match tokens recurs, the block drafter's elsewhere and, --splice (the default), after a copy's end;
kvjax.speculative.combined), at each --blocks b; and each --models small model drafting one token per forward from
its own cache (`NAME-b`, NAME its directory's name; kvjax.speculative.ModelDrafter: the pair's small model as
drafter); and with --transfer MAP, speculative KV transfer (`transferK-b`): the small model of --models that MAP was
fitted from drafts, and the verifier checks from the cache MAP translated from the small model's prefill (K:
--transfer-repair, the verifier's bottom layers recomputed; kvjax.speculative.transfer_builder). Its rounds are the
small model drafter's rounds, so it is priced by the same parts and only its tau differs; it is compared token for
token with the verifier's greedy decode from that same cache (kvjax.generate_from), which is what it equals, and
timed against plain decoding from the native cache (the same shapes: the same cost). Prompt sets, none seen in any
training: `windows` (the first --prompt-len tokens of checkpoints/toy/eval/heldout_windows.npy rows, the corpus's
held-out split) and `code` (numpy's own Python sources, from outside the toy corpus, tokenized with the toy
tokenizer: --prompt-len tokens from the start of each file, files in sorted order).

Per prompt every drafter decodes --new tokens greedily (EOS off) and is compared token for token with kvjax.generate;
its Stats give tau, the verify widths and (combined) the rounds that ran the block drafter. Then, --repeats times in
a rotating order, the decode phase alone is timed (the verify loop from a prefilled cache, and plain decoding's
compiled loop, kvjax.generation.decode_from): measured speed-up = T_plain / T_spec.

The parts, on the set's first prompt (the contexts of a set have one length), each inside the loop itself: s = plain
decoding's step; v(t) = a round at width t with a drafter that costs nothing (NullDrafter; the fixed-length path at
b + 1 and the variable-length path at every width 1 .. b + 1); d = what each drafting part adds to a round
(Ignored(drafter) - v(b + 1), paired, 3 x --repeats times). Each is kept in units of s measured beside it, and
each prompt's prediction is priced at that prompt's own plain step (timed beside its drafters), so a uniform machine
drift between the two phases cancels, and its verify costs at draft length b are rescaled by a reference round timed
beside it (the full-width null round at b: its cost in plain steps now / the parts'): predicted T_spec = s_prompt *
(sum_t w[t] c_verify(t) + sum_k n_k c_draft_k) (kvjax.speculative.cost), predicted speed-up = sum T_plain / sum
predicted T_spec over a set's prompts, and the prediction error = measured / predicted - 1 (also without the
rescaling: error_parts).
A variable-length drafter's rounds change width round to round, which each width's loop alone does not pay, and its
narrow widths are not rescaled by a reference of their own; so each prompt also times, beside it, a null drafter that
replays that run's own widths (`replay`), and prices its rounds by it: predicted_speedup_replay, error_replay (for a
fixed-length drafter the same as the rescaled prediction: its rounds are all the reference round).
Each drafter's rounds are also counted by the drafts they accepted: `accept_given_previous[k - 1]` is the share of
rounds accepting draft position k among those that accepted k - 1 (the table's second part; --accept-chart draws it).
--cpu pins the process (and XLA's thread pool) to those CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

SETS = ("windows", "code")


def code_prompts(tok, n: int, length: int) -> list[list[int]]:
    """numpy's .py files in sorted order, the first `length` tokens of each that has that many."""
    import numpy
    root = os.path.dirname(numpy.__file__)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py"))
    out = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            ids = tok.encode(fh.read()).ids
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            break
    return out


class Runs:
    """One prompt's prefilled caches and the compiled loops that decode from them (greedy only, EOS off)."""

    def __init__(self, verifier, prompt: list[int], new_tokens: int, max_draft_len: int):
        import jax
        import jax.numpy as jnp

        from kvjax.builders import NativePrefill
        from kvjax.generation import Sampling, aligned
        from kvjax.models.decoder import decode_jit
        from kvjax.models.model import as_model
        from kvjax.speculative.api import loop_verifier
        self.model = as_model(verifier)
        cfg, params = self.model
        self.looped = loop_verifier(self.model)
        self.tokens = np.asarray(prompt, np.int32)[None]
        n = self.tokens.shape[1]
        self.new = int(new_tokens)
        self.pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
        self.prefill = NativePrefill(self.model)
        self.prefix, self.plen = jnp.asarray(self.tokens[:, :-1]), jnp.asarray([n - 1], jnp.int32)
        self.last = jnp.asarray(self.tokens[:, -1])
        self.key = jax.random.key(0)
        self.sampling = Sampling()
        # plain decoding as kvjax.generate_from runs it: the prompt but its last token, that token's step, the loop
        cache = self.prefill(self.prefix, self.plen, capacity=aligned(n + self.new))
        logits, cache = decode_jit(params, cfg, self.last, cache)
        self.plain_args = (params, cfg, cache, logits, self.key, self.new, self.sampling, (), self.pad)
        self.capacity = aligned(n + self.new + max_draft_len + 1)
        self.caches, self.states = {}, {}

    def reference(self, builder=None) -> np.ndarray:
        """The verifier's greedy decode: from its own prefill, or (a transfer's builder) from that builder's cache."""
        import kvjax
        cfg, params = self.model
        if builder is not None:
            return np.asarray(kvjax.generate_from(builder, self.tokens, self.new, eos_token_ids=()))[0]
        return np.asarray(kvjax.generate(params, cfg, self.tokens, self.new, eos_token_ids=()))[0]

    def plain(self):
        from kvjax.generation.loop import decode_from
        return decode_from(*self.plain_args)

    def spec(self, drafter, builder=None):
        """(tokens [1, N], counters) of the verify loop with `drafter` (its start state made once and kept); the
        verifier reads its own prefill, or the cache `builder` (a speculative KV transfer's) makes."""
        from kvjax.speculative.loop import run_loop
        layers = ("built", id(builder)) if builder is not None else tuple(drafter.feature_layers)
        if builder is not None and layers not in self.caches:
            self.caches[layers] = (builder(self.prefix, self.plen, capacity=self.capacity), None)
        elif layers not in self.caches:
            if layers:
                self.caches[layers] = self.prefill.with_features(self.prefix, self.plen, layers=layers,
                                                                 capacity=self.capacity)
            else:
                self.caches[layers] = (self.prefill(self.prefix, self.plen, capacity=self.capacity), None)
        cache, feats = self.caches[layers]
        if id(drafter) not in self.states:
            self.states[id(drafter)] = (drafter, drafter.start(self.prefix, self.plen, self.capacity, feats))
        state = self.states[id(drafter)][1]
        return run_loop(self.looped, drafter, cache, state, self.last, self.key, self.new, self.sampling, (), self.pad)


def timed(fns: dict, repeats: int) -> dict:
    """Seconds of each callable (compiled beforehand by the caller) per repeat: `repeats` rounds over all of them
    in a rotating order (neighbours in `fns` stay neighbours, so their per-repeat differences are paired)."""
    import jax
    names, times = list(fns), {k: [] for k in fns}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t0 = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - t0)
    return times


def measure_parts(runs: Runs, parts: dict, repeats: int, vocab: int, variable: bool = True) -> dict:
    """Seconds of: a plain step; a null round per (path, draft length g, width t); each drafting part's addition to
    a round (kvjax.speculative.cost). parts: part name -> the drafter object that is that part alone (e.g.
    "block-16" -> the block drafter at b = 16, "lookup-16" -> LookupDrafter(16)). Widths measured: the fixed path
    at t = g + 1 for every fixed-length part, and (with `variable`) the variable path at t = 1 .. g + 1 for every
    variable-length part's g (one compiled loop per g: the width is an input).

    A part's addition is a difference of two rounds of several plain steps each, so it is measured apart: its
    Ignored round and the null round at its full width back to back, 3 x `repeats` times, the median of the paired
    differences, and no less than zero (a part costs something; a negative difference is the machine's noise,
    kept as "draft_raw"). Returns {"step": s, "verify": {path: {g: {t: s}}}, "draft": {part: s}, "draft_raw"}."""
    import jax.numpy as jnp

    from kvjax.speculative.cost import Ignored, NullDrafter
    from kvjax.speculative.loop import stats_of
    nulls = {}
    for p in parts.values():
        g = p.draft_len
        if getattr(p, "variable_length", False):
            if variable:
                nulls.update({("variable", g, t): NullDrafter(vocab, draft_len=g, width=jnp.int32(t),
                                                              variable_length=True) for t in range(1, g + 2)})
        else:
            nulls[("fixed", g, g + 1)] = NullDrafter(vocab, draft_len=g, width=g + 1)
    ignored = {name: Ignored(p, vocab) for name, p in parts.items()
               if variable or not getattr(p, "variable_length", False)}
    fns = {"plain": runs.plain}
    fns.update({("null",) + k: (lambda d=d: runs.spec(d)[0]) for k, d in nulls.items()})
    rounds = {}
    for key, d in [(("null",) + k, d) for k, d in nulls.items()] + [(("ignored", k), d) for k, d in ignored.items()]:
        rounds[key] = int(np.sum(stats_of(runs.spec(d)[1], d.draft_len).widths))  # compiles it, too
    runs.plain()
    secs = {k: statistics.median(v) for k, v in timed(fns, repeats).items()}
    verify = {"fixed": {}, "variable": {}}
    for (path, g, t) in nulls:
        verify[path].setdefault(g, {})[t] = secs[("null", path, g, t)] / rounds[("null", path, g, t)]
    draft, raw = {}, {}
    for name, p in ignored.items():
        g = p.draft_len
        null = ("null", path_of(p), g, g + 1)
        pair = timed({null: fns[null], name: (lambda d=p: runs.spec(d)[0])}, 3 * repeats)
        raw[name] = statistics.median(a / rounds[("ignored", name)] - b / rounds[null]
                                      for a, b in zip(pair[name], pair[null]))
        draft[name] = max(raw[name], 0.0)
    return {"step": secs["plain"] / (runs.new - 1),  # plain decoding's loop: N - 1 steps after the first token's
            "verify": verify, "draft": draft, "draft_raw": raw}


def replay(vocab: int, draft_len: int, widths, rounds: int, seed: int):
    """A null drafter whose rounds replay a run's verify widths (Stats.widths: rounds per width) in a shuffled
    order, tiled to `rounds` rounds (it emits one token a round: the run's token count), so one program per draft
    length serves every run. Its cost per round is what the run's rounds cost without drafting or accepting."""
    import jax.numpy as jnp

    from kvjax.speculative.cost import NullDrafter
    order = np.repeat(np.arange(len(widths)), np.asarray(widths))
    np.random.default_rng(seed).shuffle(order)
    return NullDrafter(vocab, draft_len=draft_len, width=jnp.asarray(np.resize(order, rounds), jnp.int32),
                       variable_length=True)


def path_of(drafter) -> str:
    return "variable" if getattr(drafter, "variable_length", False) else "fixed"


def run_set(args, source, prompts, drafters, parts, calls, builders=None) -> dict:
    """One prompt set: exactness and tau per drafter; with --repeats, the parts (on the first prompt) and per prompt
    the measured and predicted speed-ups.

    The prediction prices each prompt at its own plain step, which cancels a uniform change in the machine's speed
    between the parts' phase and the prompt's. It does not cancel a change in the RATIO of a wide verify round to a
    plain step (on this shared 2-core VM it moved the windows set's predictions 8-17% on 2026-12-04), so every
    prompt also times, beside its drafters, the full-width null round at each draft length b, and the verify costs
    of that b are scaled by its cost in plain steps now over the parts' (`verify_scale`, one per prompt). A model
    drafter's forward is wide work too (a block of b + 1 tokens, or b steps of a small model), which drifts like the
    verify round: each fixed-length drafting part's Ignored round (its drafting plus the full-width verify) is timed
    beside the prompt as well, and that part's drafting cost is scaled by the Ignored round's cost in plain steps now
    over the parts' (`draft_scale`, one per part and prompt; lookup's parts cost ~0 and are not rescaled). Both
    predictions are kept: `predicted_speedup` (rescaled) and `predicted_speedup_parts` (the parts alone)."""
    from kvjax.speculative.cost import Ignored, NullDrafter, predict_seconds
    from kvjax.speculative.loop import stats_of
    builders = builders or {}
    max_b = max(args.blocks)
    vocab = source.cfg.vocab_size
    costs = None
    if args.repeats:
        costs = measure_parts(Runs(source, prompts[0], args.new, max_b), parts, args.repeats, vocab)
        s = costs["step"]
        steps = {"verify": {path: {g: {t: v / s for t, v in c.items()} for g, c in per_g.items()}
                            for path, per_g in costs["verify"].items()},
                 "draft": {k: v / s for k, v in costs["draft"].items()}}
    per = {name: {"identical": 0, "prompts": 0, "accepted": 0, "rounds": 0, "t_spec": 0.0, "t_plain": 0.0,
                  "t_pred": 0.0, "t_pred_parts": 0.0, "t_pred_replay": 0.0, "widths": np.zeros(max_b + 2, np.int64),
                  "hist": np.zeros(max_b + 1, np.int64), "calls": {}}
           for name in drafters}
    # a reference round per draft length, timed with every prompt: the full-width null round, whose cost in plain
    # steps the parts also measured; its ratio rescales that prompt's verify costs (see run_set's docstring)
    refs = {b: NullDrafter(vocab, draft_len=b, width=b + 1) for b in sorted({d.draft_len for d in drafters.values()})}
    scales = {b: [] for b in refs}
    # a reference per fixed-length drafting part: its Ignored round, whose cost in plain steps the parts measured too
    # (the full-width null round plus the part's addition); its ratio rescales that prompt's cost of the part
    drefs, draft_scales = None, {}  # made with the first prompt's calls (the parts its drafters use)
    t0 = time.time()
    for i, prompt in enumerate(prompts):
        runs = Runs(source, prompt, args.new, max_b)
        want = {None: runs.reference(), **{id(b): runs.reference(b) for b in builders.values()}}
        stats = {}
        for name, d in drafters.items():
            out, counters = runs.spec(d, builders.get(name))
            st = stats_of(counters, d.draft_len)
            stats[name] = st
            r = per[name]
            reference = want[id(builders[name])] if name in builders else want[None]
            r["identical"] += int(np.array_equal(np.asarray(out)[0], reference))
            r["prompts"] += 1
            r["accepted"] += int(st.accepted.sum())
            r["rounds"] += int(st.rounds.sum())
            r["widths"][: len(st.widths)] += np.asarray(st.widths)
            accepted = np.asarray(st.per_round)
            r["hist"] += np.bincount(accepted[accepted >= 0], minlength=max_b + 1)[: max_b + 1]
            for k, n in calls[name](st).items():
                r["calls"][k] = r["calls"].get(k, 0) + int(n)
        if args.repeats:
            runs.plain()  # compiled (the drafters' loops are, above)
            ref_rounds = {b: int(np.sum(stats_of(runs.spec(d)[1], b).widths)) for b, d in refs.items()}  # compiles
            if drefs is None:
                used = {k for name in drafters for k in calls[name](stats[name])}
                drefs = {name: Ignored(p, vocab) for name, p in parts.items()
                         if name in used and not getattr(p, "variable_length", False)}
                draft_scales = {name: [] for name in drefs}
            dref_rounds = {name: int(np.sum(stats_of(runs.spec(d)[1], d.draft_len).widths))
                           for name, d in drefs.items()}  # compiles
            replays = {name: replay(vocab, d.draft_len, stats[name].widths, args.new, seed=i)
                       for name, d in drafters.items() if path_of(d) == "variable"}
            replay_rounds = {name: int(np.sum(stats_of(runs.spec(d)[1], d.draft_len).widths))
                             for name, d in replays.items()}  # compiles (one program per draft length)
            fns = {"plain": runs.plain, **{name: (lambda d=d, b=builders.get(name): runs.spec(d, b)[0])
                                           for name, d in drafters.items()},
                   **{("ref", b): (lambda d=d: runs.spec(d)[0]) for b, d in refs.items()},
                   **{("dref", name): (lambda d=d: runs.spec(d)[0]) for name, d in drefs.items()},
                   **{("replay", name): (lambda d=d: runs.spec(d)[0]) for name, d in replays.items()}}
            secs = {k: statistics.median(v) for k, v in timed(fns, args.repeats).items()}
            step = secs["plain"] / (args.new - 1)  # this prompt's plain step, timed beside its drafters
            scale = {b: secs[("ref", b)] / ref_rounds[b] / step / steps["verify"]["fixed"][b][b + 1] for b in refs}
            for b, k in scale.items():
                scales[b].append(k)
            draft_now = dict(steps["draft"])
            for name, d in drefs.items():
                then = steps["verify"]["fixed"][d.draft_len][d.draft_len + 1] + steps["draft"][name]
                draft_scales[name].append(secs[("dref", name)] / dref_rounds[name] / step / then)
                draft_now[name] = steps["draft"][name] * draft_scales[name][-1]
            for name, d in drafters.items():
                r = per[name]
                r["t_spec"] += secs[name]
                r["t_plain"] += step * args.new  # N tokens at plain decoding's step rate
                # the parts are priced in plain steps (measured beside them), so a machine that ran faster or slower
                # while they were measured than while this prompt was does not move the prediction; the reference
                # round rescales the verify costs for what a uniform slowdown does not explain
                verify = steps["verify"][path_of(d)][d.draft_len]
                n_calls = calls[name](stats[name])
                r["t_pred_parts"] += step * predict_seconds(stats[name].widths, verify, n_calls, steps["draft"])
                verify = {t: c * scale[d.draft_len] for t, c in verify.items()}
                r["t_pred"] += step * predict_seconds(stats[name].widths, verify, n_calls, draft_now)
                if name in replays:  # its own widths, replayed by a null drafter beside it: one price for its rounds
                    rounds = int(np.sum(stats[name].widths))
                    c_round = secs[("replay", name)] / replay_rounds[name] / step
                    r["t_pred_replay"] += step * (rounds * c_round + sum(n * draft_now[k] for k, n in n_calls.items()))
                else:  # a fixed-length drafter's rounds are all the reference round
                    r["t_pred_replay"] += step * predict_seconds(stats[name].widths, verify, n_calls, draft_now)
        print(f"  [{time.time() - t0:.0f}s] prompt {i + 1}/{len(prompts)}", flush=True)
    out = {"costs": None, "drafters": {}}
    if costs:
        s = costs["step"]
        out["costs"] = {"step_ms": s * 1e3,
                        "c_verify": {path: {str(g): {str(t): v / s for t, v in sorted(c.items())}
                                            for g, c in sorted(per_g.items())}
                                     for path, per_g in costs["verify"].items()},
                        "c_draft": {k: v / s for k, v in costs["draft"].items()},
                        "c_draft_raw": {k: v / s for k, v in costs["draft_raw"].items()},
                        "verify_scale": {str(b): v for b, v in scales.items()},
                        "draft_scale": draft_scales}
    for name, r in per.items():
        row = {"identical": r["identical"], "prompts": r["prompts"],
               "tau": (r["accepted"] + r["rounds"]) / max(r["rounds"], 1), "rounds": r["rounds"],
               "widths": r["widths"].tolist(), "calls": r["calls"],
               "accepted_hist": r["hist"][: drafters[name].draft_len + 1].tolist(),
               "accept_given_previous": accept_given_previous(r["hist"][: drafters[name].draft_len + 1])}
        if costs:
            s = costs["step"]
            d = drafters[name]
            path = costs["verify"][path_of(d)][d.draft_len]
            row["c_verify_mean"] = sum(w * path[t] for t, w in enumerate(r["widths"]) if w) / r["rounds"] / s
            row["c_draft_per_round"] = sum(n * costs["draft"][k] for k, n in r["calls"].items()) / r["rounds"] / s
            row["predicted_speedup"] = r["t_plain"] / r["t_pred"]
            row["predicted_speedup_parts"] = r["t_plain"] / r["t_pred_parts"]
            row["measured_speedup"] = r["t_plain"] / r["t_spec"]
            row["error"] = row["measured_speedup"] / row["predicted_speedup"] - 1
            row["error_parts"] = row["measured_speedup"] / row["predicted_speedup_parts"] - 1
            row["predicted_speedup_replay"] = r["t_plain"] / r["t_pred_replay"]
            row["error_replay"] = row["measured_speedup"] / row["predicted_speedup_replay"] - 1
        out["drafters"][name] = row
    return out


def accept_given_previous(hist) -> list[float | None]:
    """From rounds counted by drafts accepted (hist[k]: rounds that accepted exactly k), for each draft position
    k = 1 .. b the share of rounds that accepted it among those that accepted position k - 1: where a drafter's
    acceptance dies. tau = 1 + sum over k of the product of the first k (None where no round got that far)."""
    at_least = np.cumsum(np.asarray(hist)[::-1])[::-1]  # rounds that accepted >= k drafts
    return [float(at_least[k] / at_least[k - 1]) if at_least[k - 1] else None for k in range(1, len(at_least))]


def parse(argv):
    from launch.bench.spec_drafters import KINDS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="checkpoints/toy/source")
    p.add_argument("--drafter", default="checkpoints/toy/drafter")
    p.add_argument("--eval-dir", default="checkpoints/toy/eval")
    p.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    p.add_argument("--prompts", type=int, default=12, help="prompts per set")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--blocks", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS,
                   help="which of the toy source's own drafters run (default: all; none: only --models / --transfer)")
    p.add_argument("--models", nargs="*", default=[],
                   help="small models (HF directories sharing the verifier's tokenizer) drafting one token a forward, "
                        "e.g. checkpoints/toy/target checkpoints/toy/pruned")
    p.add_argument("--transfer", default="", help="speculative KV transfer through this map (fitted from one of "
                   "--models into the verifier, e.g. runs/toy_reverse/map); with --smoke any value: a tiny fitted map")
    p.add_argument("--transfer-repair", type=int, nargs="+", default=[0],
                   help="verifier layers recomputed over the prompt (bottom) before a transfer decodes, one arm each")
    p.add_argument("--min-match", type=int, default=2, help="combined: the shortest recurring n-gram lookup copies")
    p.add_argument("--splice", action=argparse.BooleanOptionalAction, default=True,
                   help="combined: the block drafter drafts the positions after a copy's end (--no-splice: the copy "
                   "alone, and rounds where every row copies skip the block drafter)")
    p.add_argument("--overrule", type=float, default=1.0, help="combined, spliced: the block drafter's probability at "
                   "which its token cuts a copy short (1: never)")
    p.add_argument("--refine", type=int, default=0, help="the block drafter's refinement passes per greedy draft "
                   "(kvjax.drafter.model.draft: the confident prefix fed back, the rest drafted again)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (0: exactness and tau only)")
    p.add_argument("--cpu", default="", help="pin to these CPUs, e.g. 1 or 0,1")
    p.add_argument("--smoke", action="store_true", help="tiny random models, 2 prompts of 24 tokens, 12 new tokens")
    p.add_argument("--out", default="", help="write the results as JSON here")
    p.add_argument("--chart", default="", help="draw the costs and predicted-vs-measured chart here (PNG)")
    p.add_argument("--accept-chart", default="", help="draw each drafter's acceptance by draft position here (PNG)")
    p.add_argument("--replot", default="", help="only draw --chart / --accept-chart from this earlier --out JSON")
    args = p.parse_args(argv)
    if args.replot and not (args.chart or args.accept_chart):
        p.error("--replot needs --chart PATH or --accept-chart PATH")
    if any(b < 1 for b in args.blocks) or args.prompts < 1 or args.new < 2 or args.repeats < 0 or args.refine < 0:
        p.error("--blocks must be >= 1, --prompts >= 1, --new >= 2, --repeats >= 0 and --refine >= 0")
    if any(k < 0 for k in args.transfer_repair) or len(set(args.transfer_repair)) < len(args.transfer_repair):
        p.error("--transfer-repair: distinct layer counts >= 0")
    if not (args.kinds or args.models or args.smoke):
        p.error("nothing to run: --kinds is empty and no --models are given")
    if args.transfer and not (args.models or args.smoke):
        p.error("--transfer needs --models with the small model its map was fitted from (e.g. checkpoints/toy/target)")
    if args.smoke:
        args.prompts, args.prompt_len, args.new, args.repeats = 2, 24, 12, 1
    return args


def setup(args):
    """(the verifier, {set name: prompts}): the --smoke models and prompts, or the toy source and the --sets prompt
    sets (--prompts each, of --prompt-len tokens)."""
    if args.smoke:
        return smoke_setup(args)
    from kvjax.hf import load_hf, load_tokenizer
    sets = {}
    if "windows" in args.sets:
        windows = np.load(os.path.join(args.eval_dir, "heldout_windows.npy"))
        sets["windows"] = [w[: args.prompt_len].astype(int).tolist() for w in windows[: args.prompts]]
    if "code" in args.sets:
        sets["code"] = code_prompts(load_tokenizer(args.source), args.prompts, args.prompt_len)
    return load_hf(args.source), sets


def smoke_setup(args):
    import jax

    import kvjax
    cfg = kvjax.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                            num_kv_heads=2, head_dim=16, eos_token_ids=(), pad_token_id=0)
    source = kvjax.Model(cfg, kvjax.init_params(cfg, jax.random.key(0)))
    rng = np.random.default_rng(0)
    motif = rng.integers(1, 256, 6).tolist()  # a repeated motif, so lookup has something to copy
    prompts = [(motif * 5)[: args.prompt_len], rng.integers(1, 256, args.prompt_len).tolist()]
    return source, {s: prompts for s in args.sets}


def main(argv=None) -> dict:
    from launch.bench.spec_report import accept_chart, chart, table
    args = parse(argv)
    if args.replot:
        with open(args.replot) as f:
            earlier = json.load(f)
        if args.chart:
            print(chart(earlier, args.chart))
        if args.accept_chart:
            print(accept_chart(earlier, args.accept_chart))
        return {}
    if args.cpu:
        os.sched_setaffinity(0, {int(c) for c in args.cpu.split(",")})  # before JAX sizes its thread pool
    if not args.smoke:
        for path in (args.source, args.drafter, args.eval_dir):
            if not os.path.isdir(path):
                sys.exit(f"launch.bench.spec_cost: {path} is not a directory; run from the repository root "
                         "(the toy checkpoints ship in checkpoints/toy)")
    from kvjax import allocator
    applied = allocator.tune()  # as kvjax's programs run (kvjax.allocator); before XLA starts its threads
    source, sets = setup(args)
    from launch.bench.spec_drafters import make_drafters
    drafters, parts, calls, builders = make_drafters(args, source)
    result = {"args": vars(args), "allocator": applied, "load": os.getloadavg(), "sets": {}}
    t0 = time.time()
    for name, prompts in sets.items():
        print(f"[{time.time() - t0:.0f}s] set {name}: {len(prompts)} prompts", flush=True)
        result["sets"][name] = run_set(args, source, prompts, drafters, parts, calls, builders)
        if args.out:  # after every set: an interrupted run keeps what it measured
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    result["seconds"] = time.time() - t0
    result["table"] = table(result)
    print(result["table"])
    if args.chart and any(r["costs"] for r in result["sets"].values()):
        print("chart:", chart(result, args.chart))
    if args.accept_chart:
        print("acceptance chart:", accept_chart(result, args.accept_chart))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    from kvjax import allocator
    allocator.reexec()  # huge pages, as the main job and the server run (kvjax.allocator says why)
    main()

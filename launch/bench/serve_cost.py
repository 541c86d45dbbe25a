"""Serving priced part by part: the conversation workload's tokens/s and time to first token for each server arm,
predicted from what a request costs, on this machine or on a device (launch.bench.accelerator's `serving` section).

    python -m launch.bench.serve_cost --map MAP --out runs/serve_cost.json   # the toy pair here (MAP: docs/serving.md)
    python -m launch.bench.serve_cost --map MAP --load runs/serve_load/load.json   # and beside a load run's numbers
    python -m launch.bench.serve_cost --smoke                                   # tiny random models (the tests)

The workload is `launch.bench.load --workload conversation` with its defaults: C clients, each one conversation of K
turns; turn k's prompt is a shared S-token system prompt, k user messages of U tokens and the k - 1 answers (A tokens
each) between them, and its answer is A tokens.

What a request asks of the server (counts: the same on every machine):
    prompt           L_k = S + k U + (k - 1) A tokens; the server prefills L_k - 1 of them (the last one is decoded)
    with the prefix  the blocks turn k - 1's prompt stored are found again: r_k = floor((L_{k-1} - 1) / B) B tokens
    cache            (turn 1: the shared system prompt's full blocks), so n_k = L_k - 1 - r_k are prefilled
With the defaults 80.3% of the prompt tokens are reused; the load tool counted 80.2% (2026-12-04).

The parts (seconds), each measured with the server's own programs at each turn's shapes (median of --repeats):
    P1(k)   the serial topology's prefill of one prompt (kvjax.serve.programs.prefill_batch: source + map)
    P(k)    the same in a batch of --batch prompts, per prompt
    Pc(k)   a batch read after its cached prefix (kvjax.serve.prefill.PrefillJob with a PrefixCache: the cached
            blocks filled in, n_k tokens read, the new blocks stored), per prompt
    D(R)    one decode step of R rows (kvjax.serve.programs.step) at the conversation's context, R = 1 and R = slots

The model. One device runs the prefills and the decode steps one after another; a saturated server keeps R = slots
rows decoding, so a decode step's cost is shared by R requests. A request costs
    serial  P1(k) + A D(1)        batched  P(k) + A D(R) / R        batched + prefix  Pc(k) + A D(R) / R
and the server's tokens/s is K A / sum_k cost_k. In the load tool's closed loop (a client sends its next turn when
an answer is complete) every request spends C / X in the system (Little's law; X requests per second), of which its
decoding takes A steps, each stretched by the prefill work done between steps: A D(R) / (1 - f), f the prefill share
of the server's time. So its time to first token is TTFT = C / X - A D(R) / (1 - f) (serial: C / X - A D(1)): the
mean, predicted; the load tool reports percentiles.

Why it matters: on this CPU a decode step of the toy target is compute-bound, D(64) / 64 is ~0.3 of D(1), and the
answers' decoding bounds every arm; on an accelerator a step streams the weights, D(64) costs about D(1), and the
prefill the cache removes is what is left. The same formula with the device's measured parts says what the prefix
cache buys there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ARMS = ("serial", "batched", "batched+prefix")


@dataclasses.dataclass(frozen=True)
class Workload:
    clients: int = 128
    turns: int = 4
    system: int = 512
    user: int = 96
    answer: int = 64
    slots: int = 64
    batch: int = 4  # the load tool's --max-prefill-batch
    block: int = 32  # the prefix cache's block (EngineConfig.prefix_block)

    def prompt(self, k: int) -> int:
        """Tokens of turn k's prompt (k = 1 .. turns)."""
        return self.system + k * self.user + (k - 1) * self.answer

    def reused(self, k: int) -> int:
        """Prompt tokens turn k finds in the prefix cache: the full blocks turn k - 1's prompt stored (turn 1: the
        shared system prompt's, stored by whichever conversation came first)."""
        before = self.system if k == 1 else self.prompt(k - 1) - 1
        return before // self.block * self.block

    def counts(self) -> list[dict]:
        return [{"turn": k, "prompt": self.prompt(k), "prefilled": self.prompt(k) - 1, "reused": self.reused(k),
                 "new": self.prompt(k) - 1 - self.reused(k)} for k in range(1, self.turns + 1)]

    def capacity(self) -> int:
        """The load tool's server capacity: the longest prompt plus its answer, in multiples of 64."""
        return -(-(self.prompt(self.turns) + self.answer) // 64) * 64


SMOKE = Workload(clients=8, turns=3, system=40, user=12, answer=8, slots=4, batch=2, block=16)


def predict(w: Workload, parts: dict) -> dict:
    """Each arm's tokens/s, cost per request (s) and mean TTFT (s) from the parts: parts["turns"][k - 1] holds P1, P,
    Pc for turn k (a list may cover fewer turns: their mean stands for every turn), parts["D1"], parts["DR"]."""
    per = parts["turns"]
    mean = lambda key: statistics.fmean(t[key] for t in per)  # noqa: E731
    decode_shared = w.answer * parts["DR"] / w.slots
    prefill = {"serial": mean("P1"), "batched": mean("P"), "batched+prefix": mean("Pc")}
    out = {}
    for arm in ARMS:
        decode = w.answer * parts["D1"] if arm == "serial" else decode_shared
        cost = prefill[arm] + decode
        x = 1.0 / cost  # requests per second
        share = prefill[arm] / cost
        decoding = w.answer * parts["D1"] if arm == "serial" else w.answer * parts["DR"] / (1.0 - share)
        out[arm] = {"cost_s": cost, "prefill_s": prefill[arm], "decode_s": decode, "prefill_share": share,
                    "tokens_per_s": w.answer * x, "ttft_s": max(w.clients / x - decoding, 0.0)}
    serial = out["serial"]
    for arm in ARMS:
        out[arm]["x_serial"] = out[arm]["tokens_per_s"] / serial["tokens_per_s"]
    out["ttft_prefix_vs_batched"] = out["batched+prefix"]["ttft_s"] / out["batched"]["ttft_s"]
    counts = w.counts()
    out["reused_frac"] = sum(c["reused"] for c in counts) / sum(c["prefilled"] for c in counts)
    return out


# ---- measuring the parts --------------------------------------------------------------------------------------------

def conversation(w: Workload, vocab: int, k: int, rows: int, seed: int = 0) -> tuple[list, list]:
    """(before, now): `rows` conversations' turn k - 1 prompts (turn 1: the shared system prompt and one more token,
    so that all of it is read) and turn k prompts. Random ids: what a request costs does not depend on them."""
    import numpy as np
    rng = np.random.default_rng(seed)
    system = rng.integers(1, vocab, w.system).tolist()
    before, now = [], []
    for _ in range(rows):
        rest = rng.integers(1, vocab, w.prompt(w.turns) - w.system).tolist()
        now.append(system + rest[: w.prompt(k) - w.system])
        before.append(system + rest[: w.prompt(k - 1) - w.system] if k > 1 else system + [0])
    return before, now


def measure_turn(builder, w: Workload, vocab: int, k: int, repeats: int) -> dict:
    """P1, P and Pc of turn k (seconds per prompt)."""
    import jax

    from kvjax.serve import programs
    from kvjax.serve.prefill import PrefillJob
    from kvjax.serve.prefix import PrefixCache
    from launch.bench.kernel import median_seconds  # compiles first, then the median of `repeats` runs
    buckets = programs.buckets(w.capacity())
    before, now = conversation(w, vocab, k, w.batch)
    bucket = programs.bucket_for(w.prompt(k) - 1, buckets)
    p1 = median_seconds(lambda: programs.prefill_batch(builder, now[:1], bucket, 1), repeats)
    p = median_seconds(lambda: programs.prefill_batch(builder, now, bucket, w.batch), repeats) / w.batch

    def cached():
        # a fresh cache holding what the previous turn stored (untimed), then this turn read after it (timed)
        prefix = PrefixCache(w.block, 1 << 40)
        job = PrefillJob(builder, before, buckets, w.batch, prefix)
        job.finish()
        job.close()
        job = PrefillJob(builder, now, buckets, w.batch, prefix)
        assert job.reused == w.batch * w.reused(k), (job.reused, w.reused(k))
        t0 = time.perf_counter()
        jax.block_until_ready(job.finish())
        job.close()
        return time.perf_counter() - t0
    cached()  # compile
    pc = statistics.median(cached() for _ in range(repeats)) / w.batch
    return {"turn": k, "P1": p1, "P": p, "Pc": pc}


def measure_steps(target, w: Workload, repeats: int) -> dict:
    """D(1) and D(slots): a decode step of the serial topology's one slot, and of every slot of the batched one, each
    row at the middle turn's context."""
    import jax.numpy as jnp

    from kvjax.serve import programs
    from launch.bench.kernel import median_seconds
    cfg, params = target
    ctx = w.prompt(w.turns // 2 + 1) + w.answer // 2
    out = {"context": ctx}
    for name, s in (("D1", 1), ("DR", w.slots)):
        cache = programs.empty_slots(cfg, s, w.capacity(), jnp.dtype(params.embed.dtype))
        state = {"cache": cache.replace(lengths=jnp.full((s,), ctx, jnp.int32))}
        args = dict(tokens=jnp.ones((s,), jnp.int32), active=jnp.ones((s,), bool), temperature=jnp.zeros((s,)),
                    top_p=jnp.ones((s,)), seeds=jnp.zeros((s,), jnp.int32), counters=jnp.zeros((s,), jnp.int32))

        def one(s=s, state=state, args=args):
            # the cache is donated and comes back a position longer: reset, so every step reads the same context
            nxt, c = programs.step(params, cfg, state["cache"], rows=s, **args)
            state["cache"] = c.replace(lengths=jnp.full((s,), ctx, jnp.int32))
            return nxt
        out[name] = median_seconds(one, repeats)
        del state
    return out


def measure(source, target, kvmap, w: Workload, repeats: int, turns=None, progress=print) -> dict:
    """Every part, at each of `turns` (default: every turn)."""
    from kvjax.builders import Mapped
    builder = Mapped(source, target, kvmap)
    parts = {"turns": []}
    for k in turns or range(1, w.turns + 1):
        t0 = time.perf_counter()
        parts["turns"].append(measure_turn(builder, w, source.cfg.vocab_size, k, repeats))
        progress(f"turn {k}: " + ", ".join(f"{n} {1e3 * parts['turns'][-1][n]:.1f} ms" for n in ("P1", "P", "Pc"))
                 + f" ({time.perf_counter() - t0:.0f}s)")
    parts.update(measure_steps(target, w, repeats))
    progress(f"decode step at context {parts['context']}: D(1) {1e3 * parts['D1']:.2f} ms, D({w.slots}) "
             f"{1e3 * parts['DR']:.2f} ms")
    return parts


# ---- a load run's numbers beside the prediction ---------------------------------------------------------------------

def measured_from_load(path: str, clients: int) -> dict:
    """tokens/s, TTFT p50 of turns >= 2 and prefix reuse of each arm of a `launch.bench.load --workload
    conversation` run (its load.json) at `clients`."""
    with open(path) as f:
        run = json.load(f)
    if run.get("workload") != "conversation":
        raise ValueError(f"{path}: a {run.get('workload')!r} load run; this compares with --workload conversation")
    out = {}
    for arm, levels in run["results"].items():
        for r in levels:
            if r.get("concurrency") == clients:
                out[arm] = {"tokens_per_s": r["tokens_per_s"], "ttft_later_p50": r.get("ttft_later_p50"),
                            "reused_frac": r.get("prefix_reused_frac")}
    if "serial" in out:
        for arm in out:
            out[arm]["x_serial"] = out[arm]["tokens_per_s"] / out["serial"]["tokens_per_s"]
    return out


def table(w: Workload, parts: dict, pred: dict, measured: dict | None = None) -> str:
    lines = [f"conversation: {w.clients} clients x {w.turns} turns, system {w.system}, user {w.user}, answers "
             f"{w.answer}, {w.slots} slots, prefill batch {w.batch}, block {w.block}; {100 * pred['reused_frac']:.1f}% "
             f"of prompt tokens reused",
             f"parts: D(1) {1e3 * parts['D1']:.2f} ms, D({w.slots}) {1e3 * parts['DR']:.2f} ms (D({w.slots}) / "
             f"{w.slots} = {parts['DR'] / w.slots / parts['D1']:.2f} D(1)); per turn P1 / P / Pc (ms): "
             + "; ".join(f"{t['turn']}: {1e3 * t['P1']:.1f} / {1e3 * t['P']:.1f} / {1e3 * t['Pc']:.1f}"
                         for t in parts["turns"]),
             "", "| arm | cost per request (ms): prefill + decode | predicted tokens/s | x serial | mean TTFT (s) |"
             + (" measured tokens/s | x serial | TTFT p50, turns >= 2 (s) |" if measured else ""),
             "|---|---|---|---|---|" + ("---|---|---|" if measured else "")]
    for arm in ARMS:
        p = pred[arm]
        row = (f"| {arm} | {1e3 * p['prefill_s']:.1f} + {1e3 * p['decode_s']:.1f} | {p['tokens_per_s']:.0f} | "
               f"{p['x_serial']:.2f} | {p['ttft_s']:.2f} |")
        if measured:
            m = measured.get(arm)
            row += (f" {m['tokens_per_s']:.0f} | {m.get('x_serial', float('nan')):.2f} | "
                    f"{m['ttft_later_p50'] or float('nan'):.2f} |" if m else " - | - | - |")
        lines.append(row)
    lines.append(f"predicted mean TTFT, prefix cache / without: {pred['ttft_prefix_vs_batched']:.2f}")
    return "\n".join(lines)


def parse(argv):
    d = Workload()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="toy", help="the run config whose source and target are served")
    p.add_argument("--map", help="the served map directory (kvjax.save_map)")
    p.add_argument("--load", help="a `launch.bench.load --workload conversation` run's load.json to set beside")
    p.add_argument("--out", help="write parts, prediction (and the load run's numbers) as JSON here")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="tiny random models and a short conversation (the tests)")
    for f in dataclasses.fields(Workload):
        p.add_argument("--" + f.name.replace("_", "-"), type=int, default=getattr(d, f.name))
    a = p.parse_args(argv)
    if a.smoke:
        vars(a).update(dataclasses.asdict(SMOKE), repeats=2)
    elif not a.map:
        p.error("--map is required (a served map directory, e.g. the default job's runs/toy/map; docs/serving.md)")
    bad = [f.name for f in dataclasses.fields(Workload) if getattr(a, f.name) < 1]
    if bad or a.repeats < 1:
        p.error(f"--{', --'.join(bad or ['repeats'])} must be >= 1")
    return a


def smoke_models():
    import jax
    import numpy as np

    import kvjax

    def tiny(layers, hidden, seed):
        cfg = kvjax.Qwen3Config(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                                num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=True,
                                eos_token_ids=(0,), pad_token_id=0)
        return kvjax.Model(cfg, kvjax.init_params(cfg, jax.random.key(seed), std=0.1))
    source, target = tiny(3, 64, 0), tiny(2, 32, 1)
    windows = lambda n, s: np.random.RandomState(s).randint(1, 256, (n, 32)).astype(np.int32)  # noqa: E731
    kvmap, _ = kvjax.fit_map(source, target, windows(8, 0), windows(4, 1), batch_size=4, residual_rank=4)
    return source, target, kvmap


def main(argv=None) -> dict:
    a = parse(argv)
    w = Workload(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Workload)})
    if a.smoke:
        source, target, kvmap = smoke_models()
    else:
        import jax.numpy as jnp

        import kvjax
        from kvjax.config_flags import ConfigFlagError, build
        try:
            cfg = build(a.config, [])
        except ConfigFlagError as e:
            sys.exit(f"error: {e}")
        if not os.path.isfile(os.path.join(a.map, "manifest.json")):
            sys.exit(f"error: {a.map} is not a map directory (no manifest.json); pass the map the server serves")
        source = kvjax.load_hf(cfg.source.path, dtype=jnp.dtype(cfg.source.dtype))
        target = kvjax.load_hf(cfg.target.path, dtype=jnp.dtype(cfg.target.dtype))
        kvmap = kvjax.load_map(a.map, source.cfg, target.cfg)
    measured = None
    if a.load:
        try:
            measured = measured_from_load(a.load, w.clients)
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"error: --load {a.load}: {e}")
    parts = measure(source, target, kvmap, w, a.repeats)
    pred = predict(w, parts)
    result = {"command": "python -m launch.bench.serve_cost " + " ".join(sys.argv[1:] if argv is None else argv),
              "workload": dataclasses.asdict(w), "parts": parts, "predicted": pred, "measured": measured}
    print(table(w, parts, pred, measured))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    return result


if __name__ == "__main__":
    main()

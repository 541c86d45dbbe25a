"""Speculative decoding on the toy pair: exactness against the verifier's greedy decode, and batch-1 speed.

    taskset -c 1 python -m launch.bench.speculative                     # both parts, drafters target and pruned
    taskset -c 1 python -m launch.bench.speculative --part exact --prompts 200
    taskset -c 1 python -m launch.bench.speculative --part speed --draft-lens 1 2 3 4 6 --repeats 5
    taskset -c 1 python -m launch.bench.speculative --part cost      # where a round's time goes

Verifier: TOY_DIR/source (6 layers); drafters: TOY_DIR/target (2 layers x 64) and TOY_DIR/pruned (3 layers x 256),
and `lookup` (prompt lookup, kvjax.speculative.LookupDrafter: no model) when named in --drafters.
Prompts are prefixes of the held-out windows (checkpoints/toy/eval/heldout_windows.npy), window i for prompt i.

exact: every prompt decoded greedily by kvjax.speculative_generate and by kvjax.generate (the verifier alone), batches
  of --batch ragged prompts (lengths drawn in [32, --prompt-len]; the first of each batch has the full length so every
  batch compiles the same program), the verifier's EOS on; reports prompts whose output differs anywhere.
speed: batch 1, --speed-prompts prompts of --prompt-len tokens, --new-tokens tokens each with EOS off (every arm
  produces the same number of tokens). Arms: the verifier's native greedy decode (kvjax.generate) and
  speculative_generate for each drafter x draft length; each repeat times every arm on every prompt in a rotated
  order (interleaved, so machine drift hits all arms alike), medians per prompt; speed-up = native median / arm
  median per prompt, geometric mean over prompts. Times are end to end (prefill + decode), compile excluded. tau:
  mean tokens per verify round (accepted drafts + the verifier's token).
cost: a round's parts in ms against one native decode step: the verify forward of draft_len + 1 tokens with the
  loop's bookkeeping (a drafter that costs nothing and is never accepted) and each drafter's time per drafted token
  (the difference to that round). The speed-up a drafter can reach is tau / (verify/step + draft_len * draft/step).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def load(args):
    import kvjax
    verifier = kvjax.load_hf(f"{args.toy_dir}/source")
    drafters = {name: name if name == "lookup" else kvjax.load_hf(f"{args.toy_dir}/{name}") for name in args.drafters}
    windows = np.load(f"{args.toy_dir}/eval/heldout_windows.npy").astype(np.int32)
    return verifier, drafters, windows


def exact(args, verifier, drafters, windows) -> dict:
    import kvjax
    from kvjax.speculative import speculative_generate
    rng = np.random.default_rng(0)
    n = min(args.prompts, len(windows))
    lengths = rng.integers(32, args.prompt_len + 1, n)
    lengths[:: args.batch] = args.prompt_len
    prompts = [windows[i, : lengths[i]].tolist() for i in range(n)]
    cfg, params = verifier
    result = {}
    native = []
    for s in range(0, n, args.batch):
        native.append(np.asarray(kvjax.generate(params, cfg, prompts[s: s + args.batch], args.exact_tokens)))
    native = np.concatenate(native)
    for name, drafter in drafters.items():
        got, accepted, rounds = [], 0, 0
        t0 = time.perf_counter()
        for s in range(0, n, args.batch):
            out, stats = speculative_generate(verifier, drafter, prompts[s: s + args.batch], args.exact_tokens,
                                              draft_len=args.exact_draft_len, return_stats=True)
            got.append(np.asarray(out))
            accepted, rounds = accepted + int(stats.accepted.sum()), rounds + int(stats.rounds.sum())
        got = np.concatenate(got)
        differ = np.flatnonzero((got != native).any(axis=1))
        result[name] = {"prompts": n, "identical": int(n - len(differ)), "differing_prompts": differ.tolist(),
                        "tau": (accepted + rounds) / rounds, "seconds": time.perf_counter() - t0}
        print(f"exact {name}: {n - len(differ)}/{n} prompts token-identical to the verifier's greedy decode "
              f"({args.exact_tokens} new tokens, draft_len {args.exact_draft_len}, tau {result[name]['tau']:.2f})",
              flush=True)
    return result


def speed(args, verifier, drafters, windows) -> dict:
    import jax

    import kvjax
    from kvjax.models.model import as_model
    from kvjax.speculative import LookupDrafter, ModelDrafter, speculative_generate
    cfg, params = verifier
    prompts = [windows[len(windows) - 1 - i, : args.prompt_len][None] for i in range(args.speed_prompts)]
    n = args.new_tokens

    def native(p):
        return kvjax.generate(params, cfg, p, n, eos_token_ids=())

    arms, made = {"native": native}, {}
    for name, drafter in drafters.items():
        for g in args.draft_lens:
            for c in ([0.0] if drafter == "lookup" else args.min_confidence):
                arm = f"{name}/g{g}" + (f"/c{c}" if c else "")
                made[arm] = (LookupDrafter(cfg.vocab_size, draft_len=g) if drafter == "lookup" else
                             ModelDrafter(as_model(drafter), draft_len=g, min_confidence=c))
                arms[arm] = lambda p, d=made[arm]: speculative_generate(verifier, d, p, n, eos_token_ids=())
    taus = {}
    ref = [np.asarray(native(p)) for p in prompts]
    for arm, fn in arms.items():  # compile, and check the outputs while at it
        if arm == "native":
            continue
        rounds = accepted = 0
        for p, want in zip(prompts, ref):
            out, stats = speculative_generate(verifier, made[arm], p, n, eos_token_ids=(), return_stats=True)
            if not np.array_equal(np.asarray(out), want):
                print(f"WARNING {arm}: output differs from the native greedy decode", flush=True)
            rounds, accepted = rounds + int(stats.rounds.sum()), accepted + int(stats.accepted.sum())
        taus[arm] = (accepted + rounds) / rounds
    times = {arm: [[] for _ in prompts] for arm in arms}
    names = list(arms)
    for r in range(args.repeats):
        for i, p in enumerate(prompts):
            order = names[(r + i) % len(names):] + names[: (r + i) % len(names)]
            for arm in order:
                t0 = time.perf_counter()
                jax.block_until_ready(arms[arm](p))
                times[arm][i].append(time.perf_counter() - t0)
    med = {arm: np.asarray([np.median(t) for t in ts]) for arm, ts in times.items()}
    rows = {}
    for arm in arms:
        ratio = med["native"] / med[arm]
        rows[arm] = {"seconds_median": float(np.median(med[arm])), "tokens_per_s": float(n / np.median(med[arm])),
                     "speedup_geomean": float(np.exp(np.mean(np.log(ratio)))),
                     "speedup_per_prompt": ratio.round(3).tolist(), "tau": taus.get(arm, 1.0)}
    print(f"\nbatch 1, {args.prompt_len}-token prompts, {n} new tokens, {args.speed_prompts} prompts x "
          f"{args.repeats} interleaved repeats (medians; end to end, compile excluded)")
    print("| arm | draft_len | min_confidence | tau (tokens/round) | tokens/s | speed-up vs native (geo-mean) |")
    print("|---|---:|---:|---:|---:|---:|")
    for arm, row in rows.items():
        parts = arm.split("/") + ["", ""]
        g, c = parts[1][1:] or "-", parts[2][1:] or "-"
        print(f"| {parts[0]} | {g} | {c} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} | "
              f"{row['speedup_geomean']:.2f}x |")
    return rows


def cost(args, verifier, drafters, windows) -> dict:
    """Where a round's time goes: one verify forward of g + 1 tokens (a null drafter) vs one native decode step, and
    each drafter's cost per drafted token; medians of interleaved repeats, batch 1, EOS off."""
    import jax
    import jax.numpy as jnp
    from flax import struct

    import kvjax
    from kvjax.speculative import speculative_generate
    cfg, params = verifier
    vocab = cfg.vocab_size

    @struct.dataclass
    class Null:  # costs nothing and proposes the last id, which the verifier (almost) never picks
        draft_len: int = struct.field(pytree_node=False, default=1)
        feature_layers: tuple = struct.field(pytree_node=False, default=())

        def start(self, tokens, lengths, capacity, features=None):
            return jnp.zeros((), jnp.int32)

        def propose(self, state, last, key, sampling):
            return jnp.full((last.shape[0], self.draft_len), vocab - 1, jnp.int32), None, state

        def commit(self, state, tokens, n_new, features):
            return state

    p, n = windows[-1:, : args.prompt_len], args.new_tokens
    arms = {"native": lambda: kvjax.generate(params, cfg, p, n, eos_token_ids=())}
    for g in args.draft_lens:
        arms[f"null/g{g}"] = lambda g=g: speculative_generate(verifier, Null(draft_len=g), p, n, eos_token_ids=(),
                                                              return_stats=True)
        for name, drafter in drafters.items():
            arms[f"{name}/g{g}"] = lambda g=g, d=drafter: speculative_generate(verifier, d, p, n, draft_len=g,
                                                                               eos_token_ids=(), return_stats=True)
    rounds = {}
    for arm, fn in arms.items():
        out = fn()
        rounds[arm] = n if arm == "native" else int(out[1].rounds.sum())
    times = {arm: [] for arm in arms}
    names = list(arms)
    for r in range(args.repeats):
        for arm in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(arms[arm]())
            times[arm].append(time.perf_counter() - t0)
    ms = {arm: 1e3 * float(np.median(t)) / rounds[arm] for arm, t in times.items()}  # per step / per round
    step = ms["native"]
    print(f"\nwhere the time goes (batch 1, {args.prompt_len}-token prompt, {n} tokens, {args.repeats} interleaved "
          f"repeats): native decode {step:.2f} ms/token")
    print("| draft_len | verify round (null drafter) ms | / native step | drafter | drafter ms per drafted token | "
          "/ native step |")
    print("|---:|---:|---:|---|---:|---:|")
    rows = {"native_ms_per_token": step}
    for g in args.draft_lens:
        verify = ms[f"null/g{g}"]
        rows[f"verify_g{g}_ms"] = verify
        for name in drafters:
            per = (ms[f"{name}/g{g}"] - verify) / g
            rows[f"{name}_g{g}_ms_per_draft"] = per
            print(f"| {g} | {verify:.2f} | {verify / step:.2f} | {name} | {per:.2f} | {per / step:.2f} |")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["exact", "speed", "cost", "all"], default="all")
    p.add_argument("--toy-dir", default="checkpoints/toy")
    p.add_argument("--drafters", nargs="+", default=["target", "pruned", "lookup"],
                   help="checkpoint names under TOY_DIR, or lookup (prompt lookup, no model)")
    p.add_argument("--prompts", type=int, default=200, help="exact: held-out prompts")
    p.add_argument("--batch", type=int, default=8, help="exact: prompts per batch")
    p.add_argument("--exact-tokens", type=int, default=64, help="exact: new tokens per prompt")
    p.add_argument("--exact-draft-len", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--speed-prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--draft-lens", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-confidence", type=float, nargs="+", default=[0.0],
                   help="speed: ModelDrafter(min_confidence=...) values (0: fixed draft length)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    from kvjax import allocator
    applied = allocator.tune()  # as kvjax's programs run (kvjax.allocator); before XLA starts its threads
    print(f"host allocator: {applied}", flush=True)
    verifier, drafters, windows = load(args)
    result = {"args": vars(args), "allocator": applied}
    if args.part in ("exact", "all"):
        result["exact"] = exact(args, verifier, drafters, windows)
    if args.part in ("speed", "all"):
        result["speed"] = speed(args, verifier, drafters, windows)
    if args.part in ("cost", "all"):
        result["cost"] = cost(args, verifier, drafters, windows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    from kvjax import allocator
    allocator.reexec()  # huge pages, as the main job and the server run (kvjax.allocator says why)
    main()

"""The method's speed claims priced at the real pairs' shapes on a TPU slice: each time is the roofline of the
program that runs (its FLOPs at the chip's peak or its bytes at the HBM bandwidth, whichever is longer;
kvjax.plan.costs), so these are what the shapes allow on that chip, not measurements. Collectives, launch overheads
and the host are left out: a priced ratio says which side of a claim the shapes are on, a measured one on the
hardware says how far.

  decode      one greedy token of the answering model at batch 1 over a context of C positions: native, from the
              mapped cache (the same program over a cache of the same shape: the same price), and the reading model's
  ttft        time to the first token: the reading model's prefill of the prompt + the map + the answering model's
              first token (the split path) against the reading model's own prefill + first token
  speculative c_verify(b) and c_draft(b) in decode steps at the answering model's shapes (kvjax.speculative.cost),
              and the speed-up tau / (c_verify + c_draft) at the drafters' measured acceptance lengths
  serving     tokens/s of the conversation workload at S slots against one request at a time (serial)
"""

from __future__ import annotations

import dataclasses

from kvjax.plan.hardware import Slice
from kvjax.plan.programs import Builder


def seconds(p, sl: Slice) -> float:
    """The roofline time of a Program on the slice."""
    return max(p.flops / sl.flops_per_s, p.hbm_bytes / sl.hbm_bytes_per_s)


@dataclasses.dataclass
class Priced:
    rows: list[dict]  # one dict per priced point
    slice: str


def decode(b: Builder, sl: Slice, contexts=(1024, 4096, 16384)) -> list[dict]:
    out = []
    for c in contexts:
        t = seconds(b.decode("target", 1, c + 128, c), sl)
        s = seconds(b.decode("source", 1, c + 128, c), sl)
        out.append({"context": c, "native_target_ms": 1e3 * t, "mapped_target_ms": 1e3 * t, "source_ms": 1e3 * s,
                    "mapped_over_source_speed": s / t})
    return out


def ttft(b: Builder, sl: Slice, kvmap, lengths=(1024, 2048, 4096, 8192, 16384)) -> list[dict]:
    out = []
    for n in lengths:
        cap = n + 128
        prefill = seconds(b.prefill("source", 1, n - 1, cap), sl)
        mapped = seconds(b.apply_map(kvmap, 1, n - 1, cap), sl)
        first_t = seconds(b.decode("target", 1, cap, n), sl)
        first_s = seconds(b.decode("source", 1, cap, n), sl)
        split, native = prefill + mapped + first_t, prefill + first_s
        out.append({"prompt": n, "split_ms": 1e3 * split, "source_ms": 1e3 * native, "map_ms": 1e3 * mapped,
                    "split_over_source": split / native})
    return out


def speculative(b: Builder, sl: Slice, taus: dict, context: int = 4096, blocks=(4, 8, 16),
                drafter_layers: int = 4) -> list[dict]:
    """c_verify(b + 1), c_draft(b) and the speed-up at each measured tau ({(drafter, b): tau}). The block drafter is
    priced at the answering model's layer shapes with `drafter_layers` layers (kvjax.drafter: a drafter's layers
    are its target's), reading the target's features and sharing its head; prompt lookup drafts on the host."""
    from kvjax.speculative.cost import speedup
    step = seconds(b.decode("target", 1, context + 128, context), sl)
    tcfg = b.target.cfg
    out = []
    for g in blocks:
        verify = seconds(b.prefill("target", 1, g + 1, context + 128, cache=True, context=context, logits=True,
                                   last_only=False, what="verify"), sl)
        frac = drafter_layers / tcfg.num_layers
        draft_flops = frac * b.fwd("target", 1, g, context / 2, 0) + b.fwd("target", 1, g, 0, g) \
            - b.fwd("target", 1, g, 0, 0)
        draft_bytes = frac * b.wbytes("target", g, False) + (b.wbytes("target", g, True) - b.wbytes("target", g, False))
        draft = max(draft_flops / sl.flops_per_s, draft_bytes / sl.hbm_bytes_per_s)
        row = {"b": g, "c_verify": verify / step, "c_draft_block": draft / step, "decode_step_ms": 1e3 * step}
        for (name, bb), tau in taus.items():
            if bb == g:
                c_draft = 0.0 if name == "lookup" else draft / step
                row[f"speedup_{name}"] = speedup(tau, verify / step, c_draft)
                row[f"tau_{name}"] = tau
        out.append(row)
    return out


def serving(b: Builder, sl: Slice, kvmap, slots: int = 128, system: int = 512, user: int = 96, turns: int = 4,
            new_tokens: int = 64, prefill_batch: int = 8) -> dict:
    """Tokens/s of the conversation workload (launch.bench.load's defaults: a 512-token system prompt, 4 turns of a
    96-token user message and a 64-token answer) at `slots` concurrent conversations with the prefix cache (each turn
    prefills only its new user message: the rest is cached), against one request at a time without it (every
    prompt read whole). Prefill and decode share the device (the batched topology)."""
    prompts = [system + k * (user + new_tokens) + user for k in range(turns)]
    serial = 0.0
    for p in prompts:
        cap = p + new_tokens + 128
        serial += (seconds(b.prefill("source", 1, p - 1, cap), sl) + seconds(b.apply_map(kvmap, 1, p - 1, cap), sl)
                   + new_tokens * seconds(b.decode("target", 1, cap, p + new_tokens // 2), sl))
    serial_tps = turns * new_tokens / serial
    ctx = prompts[-1] + new_tokens
    cap = ctx + 128
    step = seconds(b.decode("target", slots, cap, prompts[len(prompts) // 2] + new_tokens // 2), sl)
    # the first turn reads the system prompt whole once per conversation; later turns read their user message
    first = seconds(b.prefill("source", prefill_batch, system + user, cap), sl) \
        + seconds(b.apply_map(kvmap, prefill_batch, system + user, cap), sl)
    later = seconds(b.prefill("source", prefill_batch, user, cap, cache=True, context=ctx - user,
                              what="prefill piece"), sl) + seconds(b.map_span(kvmap, prefill_batch, user, cap), sl)
    requests = slots * turns
    prefill = slots / prefill_batch * (first + (turns - 1) * later)
    decode = turns * new_tokens * step
    batched_tps = requests * new_tokens / (prefill + decode)
    return {"slots": slots, "serial_tokens_per_s": serial_tps, "batched_tokens_per_s": batched_tps,
            "ratio": batched_tps / serial_tps, "decode_step_ms": 1e3 * step,
            "prefill_share": prefill / (prefill + decode)}


# acceptance lengths measured on the toy pair's held-out windows (docs/speculative.md: the shipped 4-layer block
# drafter refined twice, prompt lookup, and the two spliced), by draft length b: what the speculative rows are priced
# at (a drafter's tau at Qwen3-8B shapes is the one thing the toy cannot give)
TOY_TAU = {("block", 4): 2.67, ("block", 8): 2.92, ("block", 16): 2.96,
           ("lookup", 4): 2.94, ("lookup", 8): 3.62, ("lookup", 16): 4.11,
           ("combined", 4): 3.53, ("combined", 8): 4.66, ("combined", 16): 5.49}


def price(cfg, slice_name: str) -> dict:
    """Every priced table of the config's pair on the slice (JSON-able)."""
    from kvjax.plan import job, shapes
    from kvjax.plan.hardware import get_slice
    sl = get_slice(slice_name)
    b = job.pair(cfg, sl)
    kvmap = shapes.kvmap(b.source.cfg, b.target.cfg, b.mesh, pairing=cfg.map.pairing, rank=cfg.map.rank,
                         residual_rank=cfg.map.residual_rank)
    return {"config": cfg.name, "slice": sl.name, "source": cfg.source.name, "target": cfg.target.name,
            "decode": decode(b, sl), "ttft": ttft(b, sl, kvmap), "speculative": speculative(b, sl, TOY_TAU),
            "serving": serving(b, sl, kvmap)}


def markdown(t: dict) -> str:
    src, tgt = t["source"], t["target"]
    out = [f"# Priced on {t['slice']}: {t['config']} ({src} reads, {tgt} answers)", "",
           "Roofline times from the shapes (kvjax.plan.pricing): priced, not measured; collectives and launch "
           "overheads left out.", "", "## Decode, batch 1", "",
           f"| context | {tgt} native ms | from the mapped cache ms | {src} ms | mapped speed / {src}'s |",
           "|---|---|---|---|---|"]
    out += [f"| {r['context']} | {r['native_target_ms']:.3g} | {r['mapped_target_ms']:.3g} | {r['source_ms']:.3g} | "
            f"{r['mapped_over_source_speed']:.2f}x |" for r in t["decode"]]
    out += ["", "## Time to first token", "", f"| prompt | split path ms | {src} alone ms | map ms | split / {src} |",
            "|---|---|---|---|---|"]
    out += [f"| {r['prompt']} | {r['split_ms']:.4g} | {r['source_ms']:.4g} | {r['map_ms']:.3g} | "
            f"{r['split_over_source']:.3f} |" for r in t["ttft"]]
    out += ["", f"## Speculative decoding at {tgt}'s shapes (context 4096)", "",
            "| b | c_verify(b+1) | c_draft(b), block drafter | speed-up: block | lookup | combined |",
            "|---|---|---|---|---|---|"]
    for r in t["speculative"]:
        out.append(f"| {r['b']} | {r['c_verify']:.3f} | {r['c_draft_block']:.3f} | "
                   + " | ".join(f"{r[f'speedup_{k}']:.2f}x (tau {r[f'tau_{k}']})" if f"speedup_{k}" in r else "-"
                                for k in ("block", "lookup", "combined")) + " |")
    s = t["serving"]
    out += ["", "## Serving the conversation workload", "",
            f"{s['slots']} conversations at once with the prefix cache: {s['batched_tokens_per_s']:.0f} tokens/s "
            f"against {s['serial_tokens_per_s']:.0f} one request at a time: **{s['ratio']:.1f}x** (decode step "
            f"{s['decode_step_ms']:.3g} ms; prefill {s['prefill_share']:.0%} of the time)."]
    return "\n".join(out) + "\n"

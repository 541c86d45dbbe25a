"""The launch job's evaluations, each a function from (its settings, models, maps, held-out data) to a JSON-able
record of per-item / per-window results (kvjax.eval.report turns them into metrics)."""

from __future__ import annotations

import logging
import os
import re

import numpy as np

from kvjax.eval.agreement import next_token_agreement
from kvjax.eval.arms import injection_kind, make_arms, score_mc_arms, score_retrieval_arms
from kvjax.eval.distances import map_distances
from kvjax.eval.multiple_choice import load_mc
from kvjax.eval.needles import make_needle_items
from kvjax.eval.retrieval import load_retrieval
from kvjax.eval.throughput import measure_throughput
from kvjax.mapper.calibrate import Model
from kvjax.mapper.residual import evaluate_kl
from kvjax.run_config import DistancesEval, KLEval, MCEval, RetrievalEval, ThroughputEval

log = logging.getLogger(__name__)
MC_SETS = ("hellaswag", "piqa")


def distance_windows(heldout: np.ndarray, ec: DistancesEval) -> np.ndarray:
    return heldout[: ec.windows, : ec.window_len]


def kl_windows(heldout: np.ndarray, ec: KLEval, skip: int) -> np.ndarray:
    """Rows after the distance windows, so the two evaluations never share a window."""
    return heldout[skip : skip + ec.windows, : ec.prefix_len + ec.cont_len]


def run_distances(ec: DistancesEval, source: Model, target: Model, maps: dict, heldout: np.ndarray) -> dict:
    """maps: {"raw": injection map, "ridge": ..., "residual": ...}."""
    windows = distance_windows(heldout, ec)
    result = map_distances(maps, source, target, windows, ec.batch_size)
    for name, r in result.items():
        log.info("distances %-8s %s", name, {k: round(v, 4) for k, v in r["mean"].items()})
    return {"maps": result, "windows": len(windows), "window_len": int(windows.shape[1]),
            "raw_kind": injection_kind(source[0], target[0])}


def run_kl(ec: KLEval, source: Model, target: Model, maps: dict, heldout: np.ndarray, skip: int) -> dict:
    """maps: {"ridge": ..., "residual": ...} (residual optional; the last one is the final map). Besides each map's
    KL, the native target's own KL to the source on the same windows (what the map must beat: the target having
    read the prefix itself) and the final map's next-token agreement."""
    windows = kl_windows(heldout, ec, skip)
    final = list(maps)[-1]
    # one pass for the final map gives its KL, the native target's KL and the agreement rates
    agree = next_token_agreement(maps[final], source, target, windows, ec.prefix_len, ec.batch_size)
    per_window = {name: evaluate_kl(kvmap, source, target, windows, ec.prefix_len, ec.batch_size).tolist()
                  for name, kvmap in maps.items() if name != final}
    per_window[final] = agree["kl_mapped"].tolist()
    per_window["target"] = agree["kl_native"].tolist()
    for name, kl in per_window.items():
        log.info("KL %-8s %.4f nats/token over %d windows", name, float(np.mean(kl)), len(windows))
    agreement = {"map": final, **{k: agree[k].tolist() for k in ("with_source", "with_target", "target_with_source")}}
    log.info("next-token agreement of %s: with the source %.4f (native target %.4f), with the native target %.4f",
             final, agree["with_source"].mean(), agree["target_with_source"].mean(), agree["with_target"].mean())
    return {"per_window": per_window, "agreement": agreement, "windows": len(windows), "prefix_len": ec.prefix_len,
            "cont_len": ec.cont_len}


def run_mc(ec: MCEval, source: Model, target: Model, maps: dict, tokenizer) -> dict:
    arms = make_arms(ec.arms, source, target, maps)
    out = {}
    for schema in MC_SETS:
        where = getattr(ec, schema)
        if not where:
            continue
        items = load_mc(where, schema=schema, split=ec.split, limit=ec.limit)
        results = score_mc_arms(items, tokenizer, arms, ec.normalize, ec.batch_size, desc=schema)
        out[schema] = {"items": len(items), "normalize": ec.normalize, "source": where,
                       "arms": {name: {"correct": r.correct.tolist(), "predictions": r.predictions.tolist()}
                                for name, r in results.items()}}
        log.info("%s (%d items): %s", schema, len(items), {n: round(r.accuracy, 4) for n, r in results.items()})
    return out


def retrieval_file(ec: RetrievalEval, length: int) -> str:
    return ec.files.replace("{length}", str(length))


def run_retrieval(ec: RetrievalEval, source: Model, target: Model, maps: dict, tokenizer, heldout: np.ndarray,
                  seed: int) -> dict:
    arms = make_arms(ec.arms, source, target, maps)
    out = {}
    for length in ec.lengths:
        if ec.files:
            items = load_retrieval(retrieval_file(ec, length), tokenizer, limit=ec.limit)
        else:
            items = make_needle_items(heldout.reshape(-1), tokenizer, length, ec.limit, seed)
        results = score_retrieval_arms(items, arms, ec.batch_size, desc=f"retrieval {length}")
        out[str(length)] = {"items": len(items), "source": retrieval_file(ec, length) if ec.files else "generated",
                            "arms": {name: {"correct": r.correct.tolist(), "answer_logprob": r.answer_logprob.tolist()}
                                     for name, r in results.items()}}
        log.info("retrieval %d (%d items): %s", length, len(items),
                 {n: round(r.accuracy, 4) for n, r in results.items()})
    return out


def run_throughput(ec: ThroughputEval, source: Model, target: Model, kvmap, heldout: np.ndarray) -> dict:
    rows = measure_throughput(source, target, kvmap, heldout.reshape(-1), ec.lengths, new_tokens=ec.new_tokens,
                              repeats=ec.repeats, batch_size=ec.batch_size, decode_repeats=ec.decode_repeats,
                              paired_decode=ec.paired_decode)
    for length, r in rows.items():
        log.info("throughput %5d: decode tok/s %s, TTFT s %s, active s %s", length,
                 {k: round(v, 1) for k, v in r["decode_tps"].items()}, {k: round(v, 4) for k, v in r["ttft_s"].items()},
                 {k: round(v, 4) for k, v in r["active_s"].items()})
    return {str(k): v for k, v in rows.items()}


def check_sources(ec: MCEval) -> list[str]:
    """Problems with the multiple-choice sources, found before any work."""
    problems = []
    for schema in MC_SETS:
        where = getattr(ec, schema)
        if not where or os.path.isfile(where):
            continue
        if where.endswith((".jsonl", ".json")):
            problems.append(f"eval.mc.{schema}: no such file {where} (give a local JSONL file in the {schema} schema, "
                            "a hub dataset name, or '' to skip the set)")
        elif not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", where):
            problems.append(f"eval.mc.{schema}={where!r} is neither a local JSONL file nor a hub dataset name "
                            "(e.g. Rowan/hellaswag)")
    return problems

"""Evaluation `audio`: audio cache transfer (the method's speech claim: "An 8B model listened once. A 1B model answered,
and got smarter doing it"). Off by default; `--config=toy_audio` runs it.

The source and the answerer each have an audio adapter (a Whisper encoder + Ultravox projector trained by distillation,
launch/toy/speech_train.py). The stage first trains the AUDIO MAP: the run's final text map with its residual trained
further on the source's audio-prompt caches (kvjax.fitting.audio_map; `map_train` clips, never the sealed ones), then
scores the sealed spoken multiple-choice test (kvjax.eval.audio_transfer) through every arm on the same items, and times
the mapped path against the answerer's own audio path side by side (time to first token with the encoder; decode
tokens/s). metrics.json `audio`: accuracy per arm with 95% intervals, the paired differences that carry the method's
speech claims (mapped vs the answerer's audio path: interval and sign-flip p-value; share of the gap to the source
recovered; each model's spoken margin over chance kept from its transcript margin), map training KL, timings.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

from kvjax.eval.report import pct
from kvjax.eval.suite.evaluation import Chart, Evaluation

log = logging.getLogger(__name__)
CHANCE = 0.25
AUDIO_MAP = "audio_map"  # under the evaluation's artifacts: runs/NAME/eval/audio/audio_map


@dataclasses.dataclass(frozen=True)
class AudioEval:
    enabled: bool = False
    source_adapter: str = "checkpoints/toy/audio/source"  # Ultravox layout: the source's encoder + projector
    target_adapter: str = "checkpoints/toy/audio/pruned"  # the answerer's own (its native audio path)
    test: str = "checkpoints/toy/audio/test"  # the sealed spoken multiple-choice set
    map_train: str = "checkpoints/toy/audio/map_train"  # clips the audio map trains on (train-split documents)
    map_valid: int = 32  # of them held out of the map's training (its KL before / after)
    map_steps: int = 300
    map_lr: float = 1e-3
    map_cont: int = 16  # text tokens after each prompt the KL is taken over
    # whose predictions the map learns: "listening" (the source hearing the clip) or "transcript" (the source
    # reading the clip's transcript, Ultravox's own distillation target; the student still reads the audio cache)
    map_teacher: str = "listening"
    map_rank: int = 0  # the audio map's residual width (0: the text map's; wider units start at zero output)
    map_train_ridge: bool = False  # the ridge's weights train too, from their text fit (else only the residual)
    # a saved audio map (kvjax.mapper.artifact; e.g. the shipped checkpoints/toy/audio/map) used instead of training
    # one here; its held-out measures are taken on the first `map_valid` clips of `map_train` all the same
    map_from: str = ""
    placeholder: int | None = None  # the audio positions' id (None: the source adapter's audio_token_index)
    open_id: int = 0  # the token that opens a prompt (the toy: <|endoftext|>, which opens every document)
    close: str = "\n"  # the text between the audio and what follows (the adapters' prompt template)
    limit: int = 0  # sealed items scored (0: all)
    batch_size: int = 8
    speed_tokens: int = 128  # decode length of the side-by-side timing
    speed_rounds: int = 5  # interleaved rounds of the whole path (time to first token: medians)
    paired_decode: int = 21  # the two decodes timed alternately from caches prefilled once (decode speed: medians)
    # mapped_text: the text map on the source READING the transcript, the answerer answering: how much of the
    # source's lead a map carries on these items when no audio is involved (the ceiling of the audio arms' transfer)
    arms: tuple[str, ...] = ("target_audio", "direct_audio", "text_map_audio", "mapped_audio", "source_audio",
                             "target_text", "source_text", "mapped_text")


def load_adapter(path: str, model, placeholder: int | None):
    """An AudioLM from an adapter directory (Ultravox layout) around the run's own loaded model; `placeholder`
    overrides its audio_token_index."""
    from kvjax.hf.ultravox import load_ultravox
    from kvjax.models.model import Model
    alm = load_ultravox(path, lm=Model(*model))
    if placeholder is not None:
        alm = alm.replace(audio_token_index=int(placeholder))
    if alm.audio_token_index is None:
        raise ValueError(f"{path}: the adapter names no audio_token_index; set --config.eval.audio.placeholder=ID")
    return alm


def audio_map_for(ec: AudioEval, ctx, src_alm, tgt_alm, prompts, tok):
    """The audio map: the run's final text map with its residual trained further on the source's audio caches of
    the `map_train` clips after the first `map_valid` (or, with `map_from`, a saved audio map), and its held-out
    measures on those first clips: KL to the listening source and the NLL of the true text, beside the NLL of the
    source listening and of the answerer's own audio path (the two ends the map sits between). Returns (audio map,
    text map, record)."""
    from kvjax.eval import audio_transfer as A
    from kvjax.fitting.audio_map import (audio_pool, pool_kl, pool_nll, prompt_rows, teacher_nll, train_audio_map,
                                         transcript_teacher)
    from kvjax.generation import pad_prompts
    from kvjax.models.audio_lm import audio_token_count
    clips = [c for c in A.load_spoken(ec.map_train) if c.features.shape[1] <= src_alm.encoder.cfg.max_frames]
    texts = [tok.encode(c.endings[0].lstrip(), add_special_tokens=False).ids[:ec.map_cont] for c in clips]
    kept = [(c, t) for c, t in zip(clips, texts) if len(t) == ec.map_cont]  # whole continuations
    v = ec.map_valid
    if not 0 < v < len(kept) + bool(ec.map_from):
        raise ValueError(f"eval.audio: map_valid={v} must hold some clips out and leave some to train on; "
                         f"{ec.map_train} has {len(kept)} usable clips (a continuation of >= map_cont={ec.map_cont} "
                         "tokens, within the encoder's window)")
    clips, texts = [c for c, _ in kept], np.asarray([t for _, t in kept], np.int32)
    if ec.map_from:  # a saved map: only the held-out clips are read
        clips, texts = clips[:v], texts[:v]
    feats, frames = A.pad_features([c.features for c in clips])
    counts = audio_token_count(frames.astype(np.int64), src_alm.stack_factor)
    rows, lengths = prompt_rows(counts, prompts.open_id, prompts.placeholder, list(prompts.close_ids))
    t0 = time.perf_counter()
    valid = audio_pool(src_alm, rows[:v], lengths[:v], texts[:v], feats[:v], frames[:v])
    text_map = ctx.map(ctx.final)
    if ec.map_from:
        from kvjax.mapper.artifact import load_map, read_manifest
        audio_map = load_map(ec.map_from, ctx.source[0], ctx.target[0],
                             sharding=text_map.keys[0].mu.sharding)  # placed as the run's own maps are
        losses = []
        info = read_manifest(ec.map_from)["info"]  # preflight checked it held out this run's held-out clips
    else:
        train = audio_pool(src_alm, rows[v:], lengths[v:], texts[v:], feats[v:], frames[v:])
        if ec.map_teacher == "transcript":
            said, said_lengths = pad_prompts([A.text_prompt_ids(prompts, tok.encode(
                c.context, add_special_tokens=False).ids) for c in clips])
            train = train._replace(teacher=transcript_teacher(ctx.source, said[v:], said_lengths[v:], texts[v:]))
        start = text_map
        if ec.map_rank:
            import jax

            from kvjax.mapper.kvmap import widen_residual
            start = widen_residual(text_map, ec.map_rank, jax.random.key(ctx.cfg.seed))
        audio_map, losses = train_audio_map(start, ctx.target, train, ec.map_steps, ec.map_lr, seed=ctx.cfg.seed,
                                            train_ridge=ec.map_train_ridge)
        info = {"kind": "audio", "from": ctx.final, "map_train": ec.map_train, "steps": ec.map_steps,
                "lr": ec.map_lr, "clips": len(clips) - v, "held_out": v, "teacher": ec.map_teacher,
                "residual_rank": audio_map.spec.residual_rank, "train_ridge": ec.map_train_ridge}
    record = {**info, "from_saved": ec.map_from or None, "valid_clips": v,
              "kl_text_map": pool_kl(text_map, ctx.target, valid),
              "kl_audio_map": pool_kl(audio_map, ctx.target, valid),
              "nll_text_map": pool_nll(text_map, ctx.target, valid),
              "nll_audio_map": pool_nll(audio_map, ctx.target, valid), "nll_source_audio": teacher_nll(valid),
              "nll_target_audio": teacher_nll(audio_pool(tgt_alm, rows[:v], lengths[:v], texts[:v], feats[:v],
                                                         frames[:v]))}
    record["seconds"] = time.perf_counter() - t0
    if ctx.artifacts:  # the server's audio path reads it (kvjax.serve with an audio config)
        from kvjax.mapper.artifact import save_map
        save_map(os.path.join(ctx.artifacts, AUDIO_MAP), audio_map,
                 {k: val for k, val in record.items() if k not in ("seconds", "from_saved")})
    log.info("audio map (%s): held-out audio-cache KL to the listening source %.4f (text map) -> %.4f, NLL of the "
             "true text %.4f -> %.4f (source listening %.4f, answerer's own audio path %.4f); %s steps on %s clips, "
             "%s teacher (%.0f s)", ec.map_from or "trained here", record["kl_text_map"], record["kl_audio_map"],
             record["nll_text_map"], record["nll_audio_map"], record["nll_source_audio"], record["nll_target_audio"],
             record.get("steps"), record.get("clips"), record.get("teacher", "listening"), record["seconds"])
    record["loss"] = losses
    return audio_map, text_map, record


def run(ec: AudioEval, ctx) -> dict:
    from kvjax.builders import Clock, Mapped, NativePrefill, SourcePrefill
    from kvjax.builders.audio_prefill import AudioPrefill
    from kvjax.eval import audio_transfer as A
    from kvjax.generation import alternating_decode_seconds, generate_from
    from kvjax.mapper.injection import injection_map

    tok = ctx.tokenizer()
    close = tuple(tok.encode(ec.close, add_special_tokens=False).ids)
    src_alm = load_adapter(ec.source_adapter, ctx.source, ec.placeholder)
    tgt_alm = load_adapter(ec.target_adapter, ctx.target, src_alm.audio_token_index)
    eos, placeholder = ec.open_id, src_alm.audio_token_index
    prompts = A.Prompts(eos, close, placeholder)

    audio_map, text_map, map_record = audio_map_for(ec, ctx, src_alm, tgt_alm, prompts, tok)

    # ---- the sealed test through every arm
    listen = AudioPrefill(src_alm, name="source_audio")
    own = AudioPrefill(tgt_alm, name="target_audio")
    read = SourcePrefill(ctx.source, name="source_text")  # the source reads each batch's transcripts once for both
    makers = {
        "target_audio": lambda: (own, "audio"),
        "direct_audio": lambda: (Mapped(ctx.source, ctx.target, injection_map(ctx.source[0], ctx.target[0]),
                                        name="direct_audio", shared=listen), "audio"),
        "text_map_audio": lambda: (Mapped(ctx.source, ctx.target, text_map, name="text_map_audio", shared=listen),
                                   "audio"),
        "mapped_audio": lambda: (Mapped(ctx.source, ctx.target, audio_map, name="mapped_audio", shared=listen),
                                 "audio"),
        "source_audio": lambda: (listen, "audio"),
        "target_text": lambda: (NativePrefill(ctx.target, name="target_text"), "text"),
        "source_text": lambda: (read, "text"),
        "mapped_text": lambda: (Mapped(ctx.source, ctx.target, text_map, name="mapped_text", shared=read), "text"),
    }
    builders = {a: makers[a]() for a in ec.arms}
    for who, model in (("source", ctx.source), ("target", ctx.target)):  # each answering model without the context
        builders[f"null_{who}"] = (NativePrefill(model, name=f"null_{who}"), "null")
    items = A.load_spoken(ec.test, ec.limit)
    window = min(src_alm.encoder.cfg.max_frames, tgt_alm.encoder.cfg.max_frames)
    if src_alm.stack_factor != tgt_alm.stack_factor or src_alm.encoder.cfg.max_frames != window:
        raise ValueError("eval.audio: the two adapters must stack frames alike and share the encoder window (the "
                         "prompts' audio lengths are the same for both audio paths)")
    res = A.score_spoken(items, tok, builders, prompts, src_alm.stack_factor, [listen, own], ec.batch_size,
                         window=window)

    # ---- speed side by side: the answerer from the mapped audio cache vs from its own audio path
    speed = {}
    one = items[:1]
    f1, n1, c1 = A.clip_inputs([it.features for it in one], src_alm.stack_factor, window)
    prompt = [A.audio_prompt_ids(prompts, int(c1[0]))]
    timed = {"mapped_audio": Mapped(ctx.source, ctx.target, audio_map, name="mapped_audio",
                                    shared=AudioPrefill(src_alm, memo=False).set_audio(f1, n1)),
             "target_audio": AudioPrefill(tgt_alm, memo=False).set_audio(f1, n1)}
    for arm, b in timed.items():  # warm-up: compile
        generate_from(b, prompt, ec.speed_tokens, eos_token_ids=())
    phases = {arm: [] for arm in timed}
    outputs = {}
    for _ in range(ec.speed_rounds):  # interleaved rounds, medians
        for arm, b in timed.items():
            clock = Clock()
            outputs[arm] = np.asarray(generate_from(b, prompt, ec.speed_tokens, eos_token_ids=(), clock=clock))
            phases[arm].append(dict(clock.phases))
    # decode speed from the two decodes timed alternately (a decode of the toy takes tens of milliseconds: timed once
    # per round, the ratio of the rounds' medians measured the machine's noise, 0.94-1.13x on the same code)
    paired = alternating_decode_seconds(timed, prompt, ec.speed_tokens, ec.paired_decode)
    for arm, ps in phases.items():
        med = {k: float(np.median([p[k] for p in ps])) for k in ps[0]}
        ttft = sum(v for k, v in med.items() if k != "decode")
        speed[arm] = {"phases_s": med, "ttft_s": ttft,
                      "decode_tok_s": (ec.speed_tokens - 1) / float(np.median(paired[arm])),
                      "paired_decode_s": paired[arm]}
    speed["tokens"] = ec.speed_tokens
    speed["rounds"] = ec.speed_rounds
    speed["paired_decode"] = ec.paired_decode
    return {"arms": {a: {k: v.tolist() for k, v in res[a].items()} for a in builders},
            "labels": res["labels"].tolist(), "items": len(items),
            "map": map_record,
            "speed": speed}


def metrics(ev: dict, ctx) -> dict:
    from kvjax.eval.audio_transfer import correct, sign_flip_p
    from kvjax.eval.stats import bootstrap_ci, paired_bootstrap_ci
    from kvjax.eval.audio_transfer import BY_NAME
    labels = np.asarray(ev["labels"])
    null = {who: np.asarray(ev["arms"][f"null_{who}"]["logprobs"]) for who in ("source", "target")}
    acc = {a: correct(np.asarray(r["logprobs"]), null[BY_NAME[a].reads], labels) for a, r in ev["arms"].items()
           if a in BY_NAME}
    out = {"items": ev["items"], "accuracy": {}, "accuracy_ci95": {}}
    for a, c in acc.items():
        ci = bootstrap_ci(c, n=ctx.n_boot)
        out["accuracy"][a], out["accuracy_ci95"][a] = float(c.mean()), [ci.lo, ci.hi]
    if "mapped_audio" in acc and "target_audio" in acc:
        d = acc["mapped_audio"] - acc["target_audio"]
        ci = paired_bootstrap_ci(acc["mapped_audio"], acc["target_audio"], n=ctx.n_boot)
        out["mapped_minus_target_audio"] = ci.mean
        out["mapped_minus_target_audio_ci95"] = [ci.lo, ci.hi]
        out["mapped_minus_target_audio_p"] = sign_flip_p(d)
        if "source_audio" in acc:
            # a share of the gap means something only where there is one: the listening source ahead of the
            # answerer's own audio path (paired interval above zero); else not measured (None)
            lead = paired_bootstrap_ci(acc["source_audio"], acc["target_audio"], n=ctx.n_boot)
            out["source_lead"], out["source_lead_ci95"] = lead.mean, [lead.lo, lead.hi]
            out["gap_recovered"] = float(d.mean() / lead.mean) if lead.lo > 0 else None
    if "text_map_audio" in acc and "mapped_audio" in acc:
        ci = paired_bootstrap_ci(acc["mapped_audio"], acc["text_map_audio"], n=ctx.n_boot)
        out["audio_map_minus_text_map"], out["audio_map_minus_text_map_ci95"] = ci.mean, [ci.lo, ci.hi]
    if {"mapped_text", "target_text", "source_text"} <= set(acc):  # the same claims with no audio: the map's ceiling
        d = paired_bootstrap_ci(acc["mapped_text"], acc["target_text"], n=ctx.n_boot)
        lead = paired_bootstrap_ci(acc["source_text"], acc["target_text"], n=ctx.n_boot)
        out["text_mapped_minus_target"], out["text_mapped_minus_target_ci95"] = d.mean, [d.lo, d.hi]
        out["text_source_lead"], out["text_source_lead_ci95"] = lead.mean, [lead.lo, lead.hi]
        out["text_gap_recovered"] = float(d.mean / lead.mean) if lead.lo > 0 else None
    for who in ("source", "target"):  # does the model hear? its spoken margin over chance / its transcript margin
        sa, st = acc.get(f"{who}_audio"), acc.get(f"{who}_text")
        if sa is not None and st is not None and st.mean() > CHANCE:
            out[f"{who}_margin_kept"] = float((sa.mean() - CHANCE) / (st.mean() - CHANCE))
    m = ev["map"]
    out["map"] = {k: m.get(k) for k in ("kl_text_map", "kl_audio_map", "nll_text_map", "nll_audio_map",
                                         "nll_source_audio", "nll_target_audio", "steps", "clips", "valid_clips",
                                         "teacher", "residual_rank", "from_saved", "seconds")}
    sp = ev["speed"]
    out["speed"] = {a: {"ttft_s": sp[a]["ttft_s"], "decode_tok_s": sp[a]["decode_tok_s"], "phases_s": sp[a]["phases_s"]}
                    for a in ("mapped_audio", "target_audio") if a in sp}
    if len(out["speed"]) == 2:
        out["speed"]["decode_ratio"] = sp["mapped_audio"]["decode_tok_s"] / sp["target_audio"]["decode_tok_s"]
        out["speed"]["tokens"] = sp["tokens"]
        out["speed"]["paired_decode"] = sp.get("paired_decode", 0)
    out["per_item"] = {a: c.tolist() for a, c in acc.items()}
    return out


def _label(arm: str) -> str:
    from kvjax.eval.audio_transfer import BY_NAME
    return BY_NAME[arm].label if arm in BY_NAME else arm


def summary(au: dict, ctx) -> list[str]:
    if "mapped_minus_target_audio" not in au:
        return []
    acc, (lo, hi) = au["accuracy"], au["mapped_minus_target_audio_ci95"]
    line = (f"- Audio transfer ({au['items']} sealed spoken items): the text-only answerer reading the source's mapped "
            f"audio cache {pct(acc['mapped_audio'])} vs its own audio path {pct(acc['target_audio'])} (paired "
            f"{pct(au['mapped_minus_target_audio'])}, 95% CI [{pct(lo)}, {pct(hi)}], p = "
            f"{au['mapped_minus_target_audio_p']:.3g}); the source listening {pct(acc.get('source_audio', float('nan')))}")
    if au.get("gap_recovered") is not None:
        line += f", {pct(au['gap_recovered'])} of the gap recovered"
    elif "source_lead" in au:
        line += " (not ahead of the answerer's own audio path, so no gap to recover)"
    sp = au.get("speed", {})
    if "decode_ratio" in sp:
        line += f"; mapped decode at {sp['decode_ratio']:.2f}x the answerer's own audio path's speed"
    return [line + "."]


def report(au: dict, ctx) -> list[str]:
    acc, ci = au["accuracy"], au["accuracy_ci95"]
    out = ["## Audio transfer: a model that listened hands its cache to a text-only answerer", "",
           f"{au['items']} sealed spoken multiple-choice items (held-out documentation spoken by espeak-ng; four text "
           "endings, chance 25%; the chosen ending is the one the context raises most over no context under the "
           "answering model, kvjax.eval.audio_transfer.correct). Every arm on the same items; 95% bootstrap "
           "intervals.", "",
           "| arm | accuracy | 95% CI |", "|---|---|---|"]
    for a in acc:
        out.append(f"| {_label(a)} (`{a}`) | {pct(acc[a])} | [{pct(ci[a][0])}, {pct(ci[a][1])}] |")
    out.append("")
    if "mapped_minus_target_audio" in au:
        lo, hi = au["mapped_minus_target_audio_ci95"]
        out += [f"Mapped audio cache - the answerer's own audio path: {pct(au['mapped_minus_target_audio'])} (paired "
                f"95% CI [{pct(lo)}, {pct(hi)}], sign-flip p = {au['mapped_minus_target_audio_p']:.3g})"
                + (f"; {pct(au['gap_recovered'])} of the gap from its audio path to the source listening recovered."
                   if au.get("gap_recovered") is not None else "."), ""]
        if "source_lead" in au:
            lo, hi = au["source_lead_ci95"]
            out += [f"The source listening - the answerer's own audio path: {pct(au['source_lead'])} [{pct(lo)}, "
                    f"{pct(hi)}]" + ("" if au.get("gap_recovered") is not None else
                                     ": no lead, so the share of the gap recovered is not measured") + ".", ""]
    if "audio_map_minus_text_map" in au:
        lo, hi = au["audio_map_minus_text_map_ci95"]
        out += [f"Does the text map alone transfer an audio cache? The audio map - the text map on the same cache: "
                f"{pct(au['audio_map_minus_text_map'])} [{pct(lo)}, {pct(hi)}].", ""]
    if "text_mapped_minus_target" in au:
        lo, hi = au["text_mapped_minus_target_ci95"]
        llo, lhi = au["text_source_lead_ci95"]
        rec = au.get("text_gap_recovered")
        out += [f"The same claims with no audio (the map's ceiling on these items): the text map on the source reading "
                f"the transcript - the answerer reading it: {pct(au['text_mapped_minus_target'])} [{pct(lo)}, "
                f"{pct(hi)}], against the source's lead on the transcript {pct(au['text_source_lead'])} [{pct(llo)}, "
                f"{pct(lhi)}]" + (f": {pct(rec)} of that gap recovered." if rec is not None else "."), ""]
    for who, name in (("source", ctx.source), ("target", ctx.target)):
        if f"{who}_margin_kept" in au:
            out.append(f"- {name} hears: its spoken margin over chance is {pct(au[f'{who}_margin_kept'])} of its "
                       "transcript margin.")
    m = au["map"]
    made = (f"loaded from {m['from_saved']}, trained" if m.get("from_saved") else "trained here") + \
        f" {m['steps']} steps on {m['clips']} clips"
    out += ["", f"Audio map ({made}): held-out audio-cache KL to the source {m['kl_text_map']:.4f} (text map) -> "
            f"{m['kl_audio_map']:.4f}; {m['valid_clips']} clips held out ({m['seconds']:.0f} s)."]
    if m.get("nll_audio_map") is not None:
        lo, hi = m["nll_target_audio"], m["nll_source_audio"]
        share = f", {pct((lo - m['nll_audio_map']) / (lo - hi))} of the way" if lo > hi else ""
        out += [f"On the same clips, the NLL of the true text (nats / token): the answerer's own audio path {lo:.3f}, "
                f"the text map {m['nll_text_map']:.3f}, the audio map {m['nll_audio_map']:.3f}, the source "
                f"listening {hi:.3f}{share} from the answerer's own audio path to the source."]
    out += [""]
    sp = au.get("speed", {})
    if "decode_ratio" in sp:
        ma, ta = sp["mapped_audio"], sp["target_audio"]
        runs = f"{sp['paired_decode']} alternating runs from caches prefilled once" if sp.get("paired_decode") else \
            "interleaved rounds"
        out += [f"Side by side ({sp['tokens']} tokens; decode: medians of {runs}): decode {ma['decode_tok_s']:.1f} "
                f"tok/s from the mapped cache vs {ta['decode_tok_s']:.1f} from the answerer's own audio path "
                f"({sp['decode_ratio']:.2f}x); time to first token with the encoder {1e3 * ma['ttft_s']:.1f} ms "
                f"(source listens + map) vs {1e3 * ta['ttft_s']:.1f} ms.", ""]
    if "audio" in ctx.charts:
        out += [f"![audio transfer]({ctx.charts['audio']})", ""]
    return out


def chart(au: dict, path: str, ctx) -> str:
    from kvjax.eval import charts
    from kvjax.eval.audio_transfer import BY_NAME
    plt = charts.plt()
    arms = list(au["accuracy"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ys = [au["accuracy"][a] for a in arms]
    err = np.array([[y - au["accuracy_ci95"][a][0], au["accuracy_ci95"][a][1] - y] for a, y in zip(arms, ys)]).T
    ax.barh(range(len(arms)), ys, xerr=err, color=[BY_NAME[a].colour if a in BY_NAME else "#8C8C8C" for a in arms])
    ax.axvline(CHANCE, color="black", ls=":", lw=1, label="chance")
    ax.set_yticks(range(len(arms)), [_label(a) for a in arms], fontsize=8)
    ax.set(xlabel="accuracy (95% CI)", title=f"Sealed spoken multiple choice ({au['items']} items)")
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    return charts.save(fig, path)


def preflight(ec: AudioEval, cfg) -> list[str]:
    if not ec.enabled:
        return []
    out = []
    for name in ("source_adapter", "target_adapter"):
        if not os.path.isfile(os.path.join(getattr(ec, name), "config.json")):
            out.append(f"eval.audio.{name}: {getattr(ec, name)!r} is not an audio adapter directory (config.json in "
                       "Ultravox's layout; the toy's: python -m launch.toy.speech_train)")
    for name in ("test", "map_train"):
        if not os.path.isfile(os.path.join(getattr(ec, name), "features.npz")):
            out.append(f"eval.audio.{name}: {getattr(ec, name)!r} holds no spoken set (items.jsonl + features.npz; "
                       "the toy's: python -m launch.toy.speech)")
    if ec.map_from and not os.path.isfile(os.path.join(ec.map_from, "manifest.json")):
        out.append(f"eval.audio.map_from: {ec.map_from!r} is not a saved map (manifest.json); give the directory a "
                   "run wrote (runs/NAME/eval/audio/audio_map) or '' to train the audio map in the run")
    elif ec.map_from:
        import json
        held = json.load(open(os.path.join(ec.map_from, "manifest.json"))).get("info", {}).get("held_out", 0)
        if held < ec.map_valid:
            out.append(f"eval.audio.map_from: {ec.map_from} held out only the first {held} clips of its training "
                       f"set, so it trained on some of the first map_valid={ec.map_valid} this run measures it on; "
                       f"set --config.eval.audio.map_valid={held} or less (or train the map here: map_from='')")
    if ec.map_teacher not in ("listening", "transcript"):
        out.append(f"eval.audio.map_teacher: {ec.map_teacher!r} is not one of 'listening', 'transcript'")
    from kvjax.eval.audio_transfer import BY_NAME
    unknown = [a for a in ec.arms if a not in BY_NAME]
    if unknown:
        out.append(f"eval.audio.arms: unknown {unknown}")
    return out


def depends(cfg) -> dict:
    """The adapters', the sets' and a saved audio map's identities (their config / meta / manifest contents, which
    name how they were trained and built): a retrained adapter, a rebuilt set or another saved map reruns the stage."""
    import hashlib
    ec, out = cfg.eval.audio, {}
    for name, file in (("source_adapter", "config.json"), ("target_adapter", "config.json"), ("test", "meta.json"),
                       ("map_train", "meta.json"), ("map_from", "manifest.json")):
        path = os.path.join(getattr(ec, name), file) if getattr(ec, name) else ""  # map_from "": none
        out[name] = hashlib.sha256(open(path, "rb").read()).hexdigest()[:16] if os.path.isfile(path) else None
    return out


def gate(au: dict, config, map_arm: str) -> list:
    """The method's speech claims on the audio map (not the run's text map: the gated map of this section)."""
    from kvjax.eval.gate import check
    lo = au.get("mapped_minus_target_audio_ci95", [None])[0]
    kept = [au[k] for k in ("source_margin_kept",) if k in au]
    return (check("audio_gain_ci_lo", lo, config.min_audio_gain_ci_lo, "min", "mapped_audio - target_audio")
            + check("audio_gap_recovered", au.get("gap_recovered"), config.min_audio_gap_recovered, "min")
            + check("audio_margin_kept", min(kept, default=None), config.min_audio_margin_kept, "min",
                    "the source's spoken / transcript margin over chance")
            + check("audio_decode_ratio", au.get("speed", {}).get("decode_ratio"), config.min_audio_decode_ratio,
                    "min"))


EVALUATION = Evaluation(name="audio", settings=AudioEval, run=run, metrics=metrics, section=60, report=report,
                        summary=summary, charts=(Chart("audio", chart),), preflight=preflight, depends=depends,
                        gate=gate)

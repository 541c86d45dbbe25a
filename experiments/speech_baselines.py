"""Where an audio adapter's distillation KL stands: the same KL for a listener that heard nothing, or the wrong words.

    python -m experiments.speech_baselines --lm source      # (after python -m launch.toy.speech)

The adapters (launch/toy/speech_train.py) are trained on KL(LM reading the transcript || LM reading the audio) over
the 16 tokens after the prompt. The right transcript scores 0; this prints, on the validation utterances, the KL of
the LM reading NO context ([EOS][\\n] then the text) and reading ANOTHER item's transcript (a shuffled pairing): an
adapter's validation KL between those two says how much of the words' information it carries (the wrong transcript
keeps the register, position and length of a context, only the words are wrong). Also, with `--adapter [PATH]`
(default: the shipped adapter of --lm), its PMI accuracy on `--items` multiple-choice items with audio and with the
transcript (kvjax.eval.audio_transfer.correct), and with `--heard work/toy/audio/asr`, the LM reading what the
pre-trained encoder heard (its greedy CTC transcript of each clip, launch/toy/speech_asr.py): a cascade that says how
much of the transcript's margin the encoder's hearing leaves for any adapter on top of it.

    python -m experiments.speech_baselines --lm source --adapter work/toy/audio/out3/source --on valid

`--on valid` (the default) asks the multiple-choice question of the VALIDATION utterances (train documents, four
endings built as the sealed set's are, launch.toy.speech.mc_items), so adapters can be compared and chosen without
the sealed set; `--on sealed` reads the shipped sealed test, for reporting only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lm", choices=("source", "pruned"), required=True)
    p.add_argument("--data", default="work/toy/audio/data/valid")
    p.add_argument("--adapter", nargs="?", const="", default=None, metavar="PATH",
                   help="also an adapter's multiple-choice accuracy (no PATH: the shipped one of --lm)")
    p.add_argument("--on", choices=("valid", "sealed"), default="valid",
                   help="the multiple-choice items: from the validation utterances, or the sealed test (report only)")
    p.add_argument("--items", type=int, default=120)
    p.add_argument("--heard", default=None, help="the speech-recognition encoder's folder (launch.toy.speech_asr)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import kvjax
    from kvjax.models.decoder import prefill_jit
    from launch.toy.speech import load_set
    from launch.toy.speech_train import AUDIO_TOKEN, CONT, LMS, MAX_CTX, tokenize_set

    lm = kvjax.load_hf(LMS[args.lm])
    tok = kvjax.load_tokenizer("checkpoints/toy/tokenizer")
    nl = tok.encode("\n", add_special_tokens=False).ids[0]
    items, vfeats, voffsets = load_set(Path(args.data))
    ctx, cont, keep = tokenize_set(tok, items)
    contexts = {"no context": [[] for _ in items], "wrong transcript": None}
    if args.heard:  # the cascade's contexts on the validation utterances: what the encoder heard, and the truth
        from launch.toy.speech import dequantize  # spelled as it spells (lower case, no punctuation)
        from launch.toy.speech_asr import labels, spell, transcribe
        hear = transcribe(args.heard)

        def ids(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids[:MAX_CTX]
        kept = set(keep.tolist())  # only the scored utterances are heard
        contexts["transcript spelled"] = [ids(spell(labels(it["context"]))) for it in items]
        contexts["heard"] = [ids(spell(hear(dequantize(vfeats[:, voffsets[i]:voffsets[i + 1]])))) if i in kept else []
                             for i in range(len(items))]

    def logp(rows, pos):
        n = max(len(r) for r in rows)
        t = np.zeros((len(rows), n), np.int32)
        for i, r in enumerate(rows):
            t[i, :len(r)] = r
        out = prefill_jit(lm.params, lm.cfg, jnp.asarray(t), jnp.asarray([len(r) for r in rows], jnp.int32),
                          logits="all").logits
        return jax.nn.log_softmax(jnp.take_along_axis(out, jnp.asarray(pos)[..., None], 1), -1)

    rng = np.random.default_rng(0)
    kls = {name: [] for name in contexts}
    for s in range(0, len(keep), 32):
        idx = keep[s:s + 32]
        other = rng.permutation(idx)
        teacher = logp([[0] + ctx[i] + [nl] + list(cont[i]) for i in idx],
                       np.array([len(ctx[i]) + 1 + np.arange(CONT) for i in idx]))
        for name, cs in contexts.items():
            read = [ctx[j] for j in other] if cs is None else [cs[i] for i in idx]  # None: another item's
            rows = [[0] + c + [nl] + list(cont[i]) for c, i in zip(read, idx)]
            pos = np.array([len(c) + 1 + np.arange(CONT) for c in read])
            kls[name].append(float(jnp.mean(jnp.sum(jnp.exp(teacher) * (teacher - logp(rows, pos)), -1))))
    if args.adapter is not None:  # the adapter's own distillation KL on the same utterances
        from kvjax.hf.ultravox import load_ultravox
        from launch.toy.speech_train import batch, make_fns
        alm = load_ultravox(args.adapter or f"checkpoints/toy/audio/{args.lm}", jnp.float32, lm=lm)
        kl = jax.jit(make_fns(lm, alm.encoder.cfg, alm.projector.cfg))
        kls["the adapter's audio"] = [
            float(kl((alm.encoder.params, alm.projector.params),
                     batch(keep[s:s + 32], ctx, cont, vfeats, voffsets, alm.stack_factor, 0, nl)))
            for s in range(0, len(keep), 32)]
    for name, v in kls.items():
        print(f"{args.lm}: KL(transcript || {name}) = {np.mean(v):.4f} nats/token over {len(keep)} utterances")

    def mc_set():
        from kvjax.eval import audio_transfer as A
        if args.on == "sealed":
            return A.load_spoken("checkpoints/toy/audio/test", args.items)
        import random

        from launch.toy.speech import dequantize, load_set, mc_items
        items, feats, offsets = load_set(Path(args.data))
        mc = mc_items(items, random.Random(0))[:args.items]
        return [A.SpokenItem(it["context"], it["endings"], it["label"],
                             dequantize(feats[:, offsets[i]:offsets[i + 1]])) for i, it in enumerate(mc)]

    if args.adapter is not None:
        from kvjax.builders import NativePrefill
        from kvjax.builders.audio_prefill import AudioPrefill
        from kvjax.eval import audio_transfer as A
        from kvjax.eval.suite.audio import load_adapter
        alm = load_adapter(args.adapter or f"checkpoints/toy/audio/{args.lm}", (lm.cfg, lm.params), None)
        sealed = mc_set()
        listen, native = AudioPrefill(alm), NativePrefill((lm.cfg, lm.params))
        res = A.score_spoken(sealed, tok, {"audio": (listen, "audio"), "text": (native, "text"),
                                           "null": (native, "null")}, A.Prompts(0, (nl,), alm.audio_token_index),
                             alm.stack_factor, [listen], window=alm.encoder.cfg.max_frames)
        acc = {k: A.correct(res[k]["logprobs"], res["null"]["logprobs"], res["labels"]).mean() for k in ("audio", "text")}
        print(f"{args.lm} + {args.adapter or 'shipped adapter'} on {len(sealed)} {args.on} items: "
              f"audio {acc['audio']:.3f}, transcript {acc['text']:.3f}, "
              f"margin over chance kept {(acc['audio'] - 0.25) / (acc['text'] - 0.25):.2f}")
    if args.heard:
        import dataclasses
        from kvjax.builders import NativePrefill
        from kvjax.eval import audio_transfer as A
        from launch.toy.speech_asr import edit_distance, labels, spell, transcribe
        hear = transcribe(args.heard)
        sealed = mc_set()
        heard, errs, chars = [], 0, 0
        for it in sealed:
            ids = hear(it.features)
            truth = labels(it.context)
            errs, chars = errs + edit_distance(ids, truth), chars + len(truth)
            heard.append(dataclasses.replace(it, context=spell(ids)))
        native = NativePrefill((lm.cfg, lm.params))
        pr = A.Prompts(0, (nl,), AUDIO_TOKEN)
        spelled = [dataclasses.replace(it, context=spell(labels(it.context))) for it in sealed]
        acc = {}
        for name, its in (("heard", heard), ("spelled", spelled), ("transcript", sealed)):
            res = A.score_spoken(its, tok, {"text": (native, "text"), "null": (native, "null")}, pr, 8, [])
            acc[name] = A.correct(res["text"]["logprobs"], res["null"]["logprobs"], res["labels"]).mean()
        print(f"{args.lm} on {len(sealed)} {args.on} items: reading what the encoder heard {acc['heard']:.3f} "
              f"(character error rate {errs / chars:.3f}), the transcript spelled as the encoder spells (lower case, "
              f"no punctuation) "
              f"{acc['spelled']:.3f}, the transcript {acc['transcript']:.3f}; margin over chance kept "
              f"{(acc['heard'] - 0.25) / (acc['transcript'] - 0.25):.2f}")


if __name__ == "__main__":
    main()

"""Where an audio adapter's distillation KL stands: the same KL for a listener that heard nothing, or the wrong words.

    python -m launch.research.speech_baselines --lm source      # (after python -m launch.toy.speech)

The adapters (launch/toy/speech_train.py) are trained on KL(LM reading the transcript || LM reading the audio) over
the 16 tokens after the prompt. The right transcript scores 0; this prints, on the validation utterances, the KL of
the LM reading NO context ([EOS][\\n] then the text) and reading ANOTHER item's transcript (a shuffled pairing): an
adapter's validation KL between those two says how much of the words' information it carries (the wrong transcript
keeps the register, position and length of a context, only the words are wrong). Also, with `--adapter`, its PMI
accuracy on the first `--items` sealed items with audio and with the transcript (kvjax.eval.audio.correct), and with
`--heard work/toy/audio/asr`, the LM reading what the pre-trained encoder heard (its greedy CTC transcript of each
sealed clip, launch/toy/speech_asr.py): a cascade that says how much of the transcript's margin the encoder's hearing
leaves for any adapter on top of it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lm", choices=("source", "pruned"), required=True)
    p.add_argument("--data", default="work/toy/audio/data/valid")
    p.add_argument("--adapter", action="store_true", help="also the shipped adapter's sealed-set accuracy")
    p.add_argument("--items", type=int, default=120)
    p.add_argument("--heard", default=None, help="the speech-recognition encoder's folder (launch.toy.speech_asr)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import kvjax
    from kvjax.models.decoder import prefill_jit
    from launch.toy.speech import load_set
    from launch.toy.speech_train import AUDIO_TOKEN, CONT, LMS, tokenize_set

    lm = kvjax.load_hf(LMS[args.lm])
    tok = kvjax.load_tokenizer("checkpoints/toy/tokenizer")
    nl = tok.encode("\n", add_special_tokens=False).ids[0]
    items, _, _ = load_set(Path(args.data))
    ctx, cont, keep = tokenize_set(tok, items)

    def logp(rows, pos):
        n = max(len(r) for r in rows)
        t = np.zeros((len(rows), n), np.int32)
        for i, r in enumerate(rows):
            t[i, :len(r)] = r
        out = prefill_jit(lm.params, lm.cfg, jnp.asarray(t), jnp.asarray([len(r) for r in rows], jnp.int32),
                          last_only=False).logits
        return jax.nn.log_softmax(jnp.take_along_axis(out, jnp.asarray(pos)[..., None], 1), -1)

    rng = np.random.default_rng(0)
    kls = {"no context": [], "wrong transcript": []}
    for s in range(0, len(keep), 32):
        idx = keep[s:s + 32]
        other = rng.permutation(idx)
        teacher = logp([[0] + ctx[i] + [nl] + list(cont[i]) for i in idx],
                       np.array([len(ctx[i]) + 1 + np.arange(CONT) for i in idx]))
        for name, rows, pos in (
                ("no context", [[0, nl] + list(cont[i]) for i in idx], np.array([1 + np.arange(CONT)] * len(idx))),
                ("wrong transcript", [[0] + ctx[j] + [nl] + list(cont[i]) for i, j in zip(idx, other)],
                 np.array([len(ctx[j]) + 1 + np.arange(CONT) for j in other]))):
            kls[name].append(float(jnp.mean(jnp.sum(jnp.exp(teacher) * (teacher - logp(rows, pos)), -1))))
    for name, v in kls.items():
        print(f"{args.lm}: KL(transcript || {name}) = {np.mean(v):.4f} nats/token over {len(keep)} utterances")

    if args.adapter:
        from kvjax.builders import NativePrefill
        from kvjax.builders.audio import AudioPrefill
        from kvjax.eval import audio as A
        from kvjax.eval.suite.audio import load_adapter
        alm = load_adapter(f"checkpoints/toy/audio/{args.lm}", (lm.cfg, lm.params), None)
        sealed = A.load_spoken("checkpoints/toy/audio/test", args.items)
        listen, native = AudioPrefill(alm), NativePrefill((lm.cfg, lm.params))
        res = A.score_spoken(sealed, tok, {"audio": (listen, "audio"), "text": (native, "text"),
                                           "null": (native, "null")}, A.Prompts(0, (nl,), alm.audio_token_index),
                             alm.stack_factor, [listen], window=alm.encoder.cfg.max_frames)
        acc = {k: A.correct(res[k]["logprobs"], res["null"]["logprobs"], res["labels"]).mean() for k in ("audio", "text")}
        print(f"{args.lm} on {len(sealed)} sealed items: audio {acc['audio']:.3f}, transcript {acc['text']:.3f}, "
              f"margin over chance kept {(acc['audio'] - 0.25) / (acc['text'] - 0.25):.2f}")
    if args.heard:
        import dataclasses
        from kvjax.builders import NativePrefill
        from kvjax.eval import audio as A
        from launch.toy.speech_asr import edit_distance, labels, spell, transcribe
        hear = transcribe(args.heard)
        sealed = A.load_spoken("checkpoints/toy/audio/test", args.items)
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
        print(f"{args.lm} on {len(sealed)} sealed items: reading what the encoder heard {acc['heard']:.3f} (character "
              f"error rate {errs / chars:.3f}), the transcript spelled as the encoder spells (lower case, no punctuation) "
              f"{acc['spelled']:.3f}, the transcript {acc['transcript']:.3f}; margin over chance kept "
              f"{(acc['heard'] - 0.25) / (acc['transcript'] - 0.25):.2f}")


if __name__ == "__main__":
    main()

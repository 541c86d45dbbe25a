"""Teach a toy language model to listen: a Whisper encoder + Ultravox projector trained by Ultravox's distillation.

  python -m launch.toy.speech_asr                                                    # the encoder hears first
  python -m launch.toy.speech_train --lm source --encoder-from work/toy/audio/asr    # checkpoints/toy/audio/source
  python -m launch.toy.speech_train --lm pruned --encoder-from work/toy/audio/asr    # checkpoints/toy/audio/pruned
  python -m launch.toy.speech_train --lm source --init-from checkpoints/toy/audio/source --train-encoder \
      --steps 600 --lr 5e-4 --warmup 50 --repeat-frac 0.5 --work work/toy/audio/ft3  # go on, the encoder learning too

Both language models get the same speech-recognition encoder, frozen, as every Ultravox model starts from Whisper's
(`launch.toy.speech_asr`); only the projector learns here, until `--init-from` continues an exported adapter with
`--train-encoder`: the encoder then learns through the language model too (the shipped adapters' second run; it
doubled the source's spoken margin, docs/audio.md). Without either the encoder starts random and
trains through the language model alone: the toy's first adapters did so and kept only ~20% of the transcript's
margin on the sealed set.

Ultravox's recipe (fixie-ai/ultravox, "KD" training): the language model stays frozen. The TEACHER is the LM reading
the transcript, the STUDENT the same LM reading the audio embeddings in the transcript's place; the loss is
KL(teacher || student) on the next-token distributions over the text that follows (here: the paragraph's next 16
tokens), so only the encoder and projector learn, and they learn to make the LM continue as if it had read the words.
Rows: [EOS][transcript | audio tokens][\\n][continuation]: EOS opens every document of the toy corpus, and the line
break (where the reST sources wrap their prose) gives the prompt a last TEXT token, from which a text-only answerer
reading a mapped audio cache predicts the first word.

Data: `python -m launch.toy.speech` (work/toy/audio/data/{train,valid}: train-split documentation spoken by
espeak-ng). Resumable: orbax checkpoints every `--save-every` steps in work/toy/audio/<lm>/ckpt with metrics.jsonl
(train and validation KL); the export (Ultravox layout, `kvjax.load_ultravox(dir, text_path=<lm>)`) is rewritten at
every validation, so a stopped run still leaves its latest encoder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from launch.toy.speech_asr import BUCKETS, Shapes  # the encoder speech_asr pre-trains, and its projector

LMS = {"source": "checkpoints/toy/source", "pruned": "checkpoints/toy/pruned"}
CONT = 16  # continuation tokens the KL is taken over (the context matters most to the first ones)
AUDIO_TOKEN = 100  # the toy's <|audio|>: a byte token the corpus never produces (its tokenizer has no spare special)
MAX_CTX = 48  # transcript tokens (longer transcripts are left out; 18 words are ~25)
TEMPLATE = "<|endoftext|><|audio|>\n"  # then the text; the line break: rST prose wraps, the toy LM reads it mid-sentence


def tokenize_set(tok, items: list[dict]) -> tuple[list[list[int]], np.ndarray, np.ndarray]:
    """(transcript ids per item, the first CONT continuation ids [N, CONT] (the words after the line break, without
    their leading space), the items whose continuation has CONT tokens)."""
    ctx = [tok.encode(it["context"], add_special_tokens=False).ids for it in items]
    cont = np.zeros((len(items), CONT), np.int32)
    keep = []
    for i, it in enumerate(items):
        ids = tok.encode(it["continuation"].lstrip(), add_special_tokens=False).ids[:CONT]
        if len(ids) == CONT and len(ctx[i]) <= MAX_CTX:
            cont[i] = ids
            keep.append(i)
    return ctx, cont, np.asarray(keep)


def batch(idx, ctx, cont, feats, offsets, stack: int, eos: int, newline: int, repeat=None) -> dict:
    """Host arrays of one batch: features padded to a bucket, the student's rows [EOS][audio][\\n][continuation]
    and the teacher's [EOS][transcript][\\n][continuation], each padded to a fixed width (one compile per bucket)."""
    from kvjax.models.audio_lm import audio_token_count
    from launch.toy.speech import dequantize
    frames = np.asarray([offsets[i + 1] - offsets[i] for i in idx], np.int32)
    t = next(b for b in BUCKETS if b >= frames.max())
    f = np.zeros((len(idx), feats.shape[0], t), np.float32)
    for r, i in enumerate(idx):
        f[r, :, :frames[r]] = dequantize(feats[:, offsets[i]:offsets[i + 1]])
    counts = audio_token_count(frames, stack)
    amax = (t + 2 * stack - 1) // (2 * stack)
    st = np.zeros((len(idx), 2 + amax + CONT), np.int32)
    smask = np.zeros(st.shape, bool)
    tt = np.zeros((len(idx), 2 + MAX_CTX + CONT), np.int32)
    spos = np.zeros((len(idx), CONT), np.int32)
    tpos = np.zeros((len(idx), CONT), np.int32)
    for r, i in enumerate(idx):
        a, n = int(counts[r]), len(ctx[i])
        # a repeat row's text is the transcript again (then the continuation): what was said, said back
        text = np.concatenate([ctx[i], cont[i]])[:CONT] if repeat is not None and repeat[r] else cont[i]
        st[r, 0], smask[r, 1:1 + a], st[r, 1 + a] = eos, True, newline
        st[r, 2 + a:2 + a + CONT] = text
        tt[r, 0], tt[r, 1:1 + n], tt[r, 1 + n], tt[r, 2 + n:2 + n + CONT] = eos, ctx[i], newline, text
        spos[r] = 1 + a + np.arange(CONT)  # the logits at these positions predict cont[0..CONT-1]
        tpos[r] = 1 + n + np.arange(CONT)
    return {"features": f, "frames": frames, "student": st, "audio_mask": smask,
            "student_len": (2 + counts + CONT).astype(np.int32), "teacher": tt,
            "teacher_len": np.asarray([2 + len(ctx[i]) + CONT for i in idx], np.int32),
            "student_pos": spos, "teacher_pos": tpos}


def lean(continues):
    """The provenance of a continued run without its metrics (training_metrics.jsonl beside the weights has them),
    at every level: a continued run's `training` holds the run it continued."""
    if not isinstance(continues, dict):
        return continues
    out = {k: v for k, v in continues.items() if k != "runs"}
    if isinstance(out.get("training"), dict):
        out["training"] = {**out["training"], "continues": lean(out["training"].get("continues"))}
    return out


def make_fns(lm, ecfg, pcfg, frozen_encoder: bool = False):
    import jax
    import jax.numpy as jnp

    from kvjax.models.audio_lm import audio_token_count, merge_audio, project_forward
    from kvjax.models.decoder import prefill_forward
    from kvjax.models.whisper import encode_forward

    def logits_at(inputs, lengths, pos):  # inputs: token ids [B, T] or embeddings [B, T, D]
        out = prefill_forward(lm.params, lm.cfg, inputs, lengths, logits="all")
        return jnp.take_along_axis(out.logits, pos[..., None], axis=1)  # [B, C, V]

    def kl(trainable, b):
        enc, proj = trainable
        if frozen_encoder:  # no backward pass through it
            enc = jax.lax.stop_gradient(enc)
        audio = project_forward(proj, pcfg, encode_forward(enc, ecfg, b["features"], b["frames"]))
        emb = merge_audio(lm.params, b["student"], b["audio_mask"], audio, audio_token_count(b["frames"], pcfg.stack_factor))
        s = jax.nn.log_softmax(logits_at(emb, b["student_len"], b["student_pos"]).astype(jnp.float32))
        t = jax.nn.log_softmax(jax.lax.stop_gradient(
            logits_at(b["teacher"], b["teacher_len"], b["teacher_pos"])).astype(jnp.float32))
        return jnp.mean(jnp.sum(jnp.exp(t) * (t - s), -1))

    return kl


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lm", choices=sorted(LMS), required=True)
    p.add_argument("--steps", type=int, default=700)
    p.add_argument("--stop-at", type=int, default=None, help="end this run after that step (resume later)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--repeat-frac", type=float, default=0.0,
                   help="share of rows whose text is the transcript said back (then the continuation)")
    p.add_argument("--repeat-from", type=int, default=0, help="the step from which rows repeat")
    p.add_argument("--encoder-from", default=None,
                   help="start from the speech-recognition encoder of `python -m launch.toy.speech_asr` (this "
                        "folder, e.g. work/toy/audio/asr) and keep it frozen, as Ultravox keeps Whisper's")
    p.add_argument("--init-from", default=None, metavar="ADAPTER",
                   help="start the encoder AND projector from an exported adapter (e.g. checkpoints/toy/audio/source) "
                        "and go on with a new schedule; the encoder stays frozen unless --train-encoder")
    p.add_argument("--train-encoder", action="store_true",
                   help="with --encoder-from or --init-from: train the encoder too (by the same distillation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="work/toy/audio/data")
    p.add_argument("--work", default="work/toy/audio")
    p.add_argument("--out", default="checkpoints/toy/audio")
    args = p.parse_args(argv)
    if args.train_encoder and not (args.encoder_from or args.init_from):
        p.error("--train-encoder goes with --encoder-from or --init-from (without them the encoder starts random and "
                "always trains)")
    if args.encoder_from and args.init_from:
        p.error("--encoder-from and --init-from both give the encoder: pass one")
    if args.init_from and not (Path(args.init_from) / "config.json").exists():
        p.error(f"--init-from {args.init_from}: no config.json there; pass an exported adapter "
                "(e.g. checkpoints/toy/audio/source)")
    frozen = bool(args.encoder_from or args.init_from) and not args.train_encoder

    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from kvjax import checkpointing
    from kvjax.hf import load_hf, load_tokenizer
    from kvjax.models.audio_lm import Projector, ProjectorConfig, init_projector
    from kvjax.hf.ultravox import save_ultravox
    from kvjax.models.whisper import AudioEncoder, WhisperEncoderConfig, init_encoder
    from launch.toy.config import EOS
    from launch.toy.speech import load_set
    logging.getLogger("absl").setLevel(logging.WARNING)

    sh = Shapes()
    lm = load_hf(LMS[args.lm], jnp.float32)
    tok = load_tokenizer(LMS[args.lm])
    eos = EOS  # <|endoftext|>: what opens every document of the toy corpus
    newline = tok.encode("\n", add_special_tokens=False).ids[0]
    data = {}
    for split in ("train", "valid"):
        items, feats, offsets = load_set(Path(args.data) / split)
        ctx, cont, keep = tokenize_set(tok, items)
        keep = keep[np.diff(offsets)[keep] <= BUCKETS[-1]]  # the encoder's window: 2 x its positions
        data[split] = (ctx, cont, keep, feats, offsets)
    ecfg = WhisperEncoderConfig(num_mel_bins=data["train"][3].shape[0], d_model=sh.d_model, num_layers=sh.layers,
                                num_heads=sh.heads, ffn_dim=sh.ffn, max_source_positions=sh.positions)
    pcfg = ProjectorConfig(audio_dim=sh.d_model, text_dim=lm.cfg.hidden_size, hidden_size=sh.hidden,
                           stack_factor=sh.stack, ln_mid=True)
    k1, k2 = jax.random.split(jax.random.key(args.seed))
    encoder = init_encoder(ecfg, k1).params
    if args.encoder_from:
        from launch.toy.speech_asr import load_encoder
        encoder, acfg = load_encoder(args.encoder_from)
        if acfg != ecfg:
            raise SystemExit(f"the encoder in {args.encoder_from} has other shapes ({acfg}) than this run's ({ecfg})")
    projector = init_projector(pcfg, k2).params
    continues, encoder_history = None, ""
    if args.init_from:  # a continued run: the adapter's encoder and projector, a new optimizer and schedule
        from kvjax.hf.ultravox import load_ultravox
        alm = load_ultravox(args.init_from, jnp.float32, lm=lm)
        if (alm.encoder.cfg, alm.projector.cfg) != (ecfg, pcfg):
            raise SystemExit(f"speech_train: the adapter in {args.init_from} has other shapes "
                             f"({alm.encoder.cfg}, {alm.projector.cfg}) than this run's ({ecfg}, {pcfg})")
        encoder, projector = alm.encoder.params, alm.projector.params
        from launch.toy.speech_asr import encoder_runs
        continues = {"from": args.init_from, "training": json.loads((Path(args.init_from) / "config.json").read_text())
                     .get("kvjax_training"), "runs": encoder_runs(args.init_from, "training_metrics.jsonl")}
        history = Path(args.init_from, "encoder_metrics.jsonl")
        encoder_history = history.read_text() if history.exists() else ""
    trainable = (encoder, projector)
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, args.steps // 2), args.steps, end_value=0.1 * args.lr)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    if frozen:  # Ultravox's default: the pre-trained encoder frozen
        opt = optax.multi_transform({"train": opt, "frozen": optax.set_to_zero()},
                                    (jax.tree.map(lambda _: "frozen", encoder), jax.tree.map(lambda _: "train", trainable[1])))
    state = {"params": trainable, "opt": opt.init(trainable)}
    kl = make_fns(lm, ecfg, pcfg, frozen_encoder=frozen)

    @jax.jit
    def step(state, b):
        loss, g = jax.value_and_grad(kl)(state["params"], b)
        upd, o = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], upd), "opt": o}, loss

    kl_jit = jax.jit(kl)

    def done_before(i: int) -> bool:
        return i >= args.repeat_from

    def export(state, done: int, vkl: float) -> None:
        """The encoder and projector in Ultravox's layout (load_ultravox(out, text_path=the LM)), bfloat16."""
        enc, proj = state["params"]
        save_ultravox(os.path.join(args.out, args.lm), AudioEncoder(ecfg, enc), Projector(pcfg, proj),
                      text_model_id=LMS[args.lm], audio_token_index=AUDIO_TOKEN, vocab_size=lm.cfg.vocab_size,
                      extra={"kvjax_training": {**settings, "continues": lean(continues), "step": done, "valid_kl": vkl,
                                                "built_by": "python -m launch.toy.speech_train --lm " + args.lm}},
                      dtype=jnp.bfloat16)  # trained in float32, stored in bfloat16 (as the pruned target)
        # the training's record travels with the weights: KL per validation (after the runs this one continues,
        # each record with its `run`), and the encoder's pre-training
        from launch.toy.speech_asr import runs_record
        own = [json.loads(ln) for ln in open(metrics)]
        Path(args.out, args.lm, "training_metrics.jsonl").write_text(
            runs_record(continues["runs"] + [own]) if continues else "".join(json.dumps(r) + "\n" for r in own))
        if encoder_history:  # read before the export replaced the folder (it may be the one continued)
            Path(args.out, args.lm, "encoder_metrics.jsonl").write_text(encoder_history)
        elif args.encoder_from:
            from launch.toy.speech_asr import encoder_record
            Path(args.out, args.lm, "encoder_metrics.jsonl").write_text(encoder_record(args.encoder_from))
    work = Path(args.work) / args.lm
    work.mkdir(parents=True, exist_ok=True)
    settings = {"lm": LMS[args.lm], "shapes": dataclasses.asdict(sh), "args": vars(args), "cont_tokens": CONT,
                "prompt": TEMPLATE, "continues": continues}
    (work / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")
    manager = checkpointing.manager(str(work / "ckpt"))
    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        state = manager.restore(start, args=ocp.args.StandardRestore(state))
    metrics = work / "metrics.jsonl"
    if metrics.exists():
        metrics.write_text("".join(ln for ln in open(metrics) if json.loads(ln)["step"] <= start))
    ctx, cont, keep, feats, offsets = data["train"]
    vctx, vcont, vkeep, vfeats, voffsets = data["valid"]
    valid = [batch(vkeep[i:i + 32], vctx, vcont, vfeats, voffsets, sh.stack, eos, newline)
             for i in range(0, len(vkeep), 32)]
    end = min(args.steps, args.stop_at or args.steps)
    bar = tqdm(range(start, end), initial=start, total=args.steps, desc=f"listen {args.lm}", unit="step")
    t0, losses = time.perf_counter(), []
    for i in bar:
        rng = np.random.default_rng((args.seed, i))
        repeat = rng.random(args.batch) < (args.repeat_frac if done_before(i) else 0.0)
        state, loss = step(state, batch(rng.choice(keep, args.batch, replace=False), ctx, cont, feats, offsets,
                                        sh.stack, eos, newline, repeat))
        losses.append(float(loss))
        done = i + 1
        if done % args.eval_every == 0 or done == end:
            vkl = float(np.mean([kl_jit(state["params"], v) for v in valid]))
            rec = {"step": done, "train_kl": float(np.mean(losses[-args.eval_every:])), "valid_kl": vkl,
                   "utterances": done * args.batch, "seconds": time.perf_counter() - t0, "time": time.time()}
            with open(metrics, "a") as f:
                f.write(json.dumps(rec) + "\n")
            bar.set_postfix(kl=f"{rec['train_kl']:.3f}", valid=f"{vkl:.3f}")
            export(state, done, vkl)
        if done % args.save_every == 0 or done == end:
            manager.save(done, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    if start >= end:  # nothing left to train: rewrite the export from the checkpoint (e.g. after a code change)
        records = [json.loads(ln) for ln in open(metrics)] if metrics.exists() else []
        export(state, start, records[-1]["valid_kl"] if records else float("nan"))


if __name__ == "__main__":
    main()

"""Pre-train the toy's Whisper encoder on speech recognition, as Whisper was, before Ultravox's projector learns.

  python -m launch.toy.speech_asr                   # work/toy/audio/asr (then speech_train --encoder-from it)
  python -m launch.toy.speech_asr --init-from checkpoints/toy/audio/source --steps 2000 --lr 1e-3 \
      --work work/toy/audio/asr-2                    # continue the shipped encoder's pre-training (a fresh head)

Ultravox starts from a Whisper encoder that already hears: Whisper was trained on 680,000 hours of transcribed speech,
and Ultravox's distillation then trains the projector (the encoder frozen). The toy's first adapters trained a
random encoder through the frozen language model alone (a KL over 16 continuation tokens is a faint signal for
learning to hear from scratch) and kept ~20% of the transcript's multiple-choice margin. This script gives the toy
encoder Whisper's start: the same encoder shapes, a linear head over characters, and CTC on the transcripts
(`optax.ctc_loss`; a decoder-free stand-in for Whisper's sequence-to-sequence objective, enough for espeak-ng's
regular speech), on the training utterances of `python -m launch.toy.speech` (never the sealed test).

Resumable: orbax checkpoints every `--save-every` steps in work/toy/audio/asr/ckpt, metrics.jsonl with the
validation character error rate of greedy CTC decoding (a measure of hearing that needs no language model).
`--init-from ADAPTER` continues an exported encoder (an Ultravox-layout directory, e.g. the shipped adapter) with a new
schedule; settings.json keeps the run it continues and that run's metrics, so the adapters trained on it ship the
whole pre-training record (`encoder_runs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

import numpy as np

ALPHABET = " abcdefghijklmnopqrstuvwxyz'"  # CTC classes 1..28; 0 is the blank
MAX_CHARS = 160  # an 18-word context is ~110 characters
BUCKETS = tuple(range(256, 1025, 128))  # mel-frame paddings (one compile each)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The toy encoder's shapes (pre-trained here) and its projector's (trained by launch.toy.speech_train)."""
    d_model: int = 192
    layers: int = 3
    heads: int = 4
    ffn: int = 768
    positions: int = 512  # window 1024 frames (10.24 s)
    hidden: int = 1024  # projector's linear_1 width (SwiGLU halves it)
    stack: int = 8


def labels(text: str) -> list[int]:
    """The transcript as character classes: lowercase letters, apostrophes, single spaces (hyphens and slashes
    spoken as breaks; other punctuation is silent)."""
    t = "".join(c if c in ALPHABET else (" " if c in "-/" else "") for c in text.lower())
    return [ALPHABET.index(c) + 1 for c in " ".join(t.split())]


def spell(classes: list[int]) -> str:
    """Character classes back to text (labels' inverse on its output)."""
    return "".join(ALPHABET[c - 1] for c in classes)


def greedy(ids: np.ndarray, n: int) -> list[int]:
    """Greedy CTC decoding of one row's argmax classes (its first n positions): merge repeats, drop blanks."""
    out, prev = [], 0
    for c in ids[:n]:
        if c != prev and c != 0:
            out.append(int(c))
        prev = c
    return out


def edit_distance(a: list[int], b: list[int]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (x != y))
    return row[-1]


def batch(idx, items, feats, offsets, buckets, spec=None) -> dict:
    """Features padded to a bucket (with SpecAugment-style masks when `spec` is a numpy Generator) and labels."""
    from launch.toy.speech import dequantize
    frames = np.asarray([offsets[i + 1] - offsets[i] for i in idx], np.int32)
    t = next(b for b in buckets if b >= frames.max())
    f = np.zeros((len(idx), feats.shape[0], t), np.float32)
    lab = np.zeros((len(idx), MAX_CHARS), np.int32)
    lpad = np.ones((len(idx), MAX_CHARS), np.float32)
    for r, i in enumerate(idx):
        x = dequantize(feats[:, offsets[i]:offsets[i + 1]])
        if spec is not None:  # one band of up to 12 mel bins and two spans of up to 20 frames set to the mean
            lo = spec.integers(0, x.shape[0] - 12)
            x[lo:lo + spec.integers(0, 13)] = x.mean()
            for _ in range(2):
                s = spec.integers(0, max(1, x.shape[1] - 20))
                x[:, s:s + spec.integers(0, 21)] = x.mean()
        f[r, :, :frames[r]] = x
        y = labels(items[i]["context"])[:MAX_CHARS]
        lab[r, :len(y)], lpad[r, :len(y)] = y, 0.0
    return {"features": f, "frames": frames, "labels": lab, "label_pad": lpad}


def optimizer(lr: float, warmup: int, steps: int):
    import optax
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(warmup, steps // 2), steps, end_value=0.05 * lr)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))


def initial_state(ecfg, opt, seed: int) -> dict:
    """{"params": {encoder, head, head_bias}, "opt": ...}: random encoder (Whisper's shapes), a character head."""
    import jax
    import jax.numpy as jnp

    from kvjax.models.whisper import init_encoder
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"encoder": init_encoder(ecfg, k1).params,
              "head": jax.random.normal(k2, (ecfg.d_model, len(ALPHABET) + 1)) * 0.02,
              "head_bias": jnp.zeros((len(ALPHABET) + 1,))}
    return {"params": params, "opt": opt.init(params)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--stop-at", type=int, default=None, help="end this run after that step (resume later)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, metavar="ADAPTER",
                   help="start the encoder from an exported adapter's (Ultravox layout); a fresh character head")
    p.add_argument("--data", default="work/toy/audio/data")
    p.add_argument("--work", default="work/toy/audio/asr")
    args = p.parse_args(argv)
    if args.init_from and not (Path(args.init_from) / "config.json").exists():
        raise SystemExit(f"speech_asr: --init-from {args.init_from}: no config.json there; pass an exported adapter "
                         "directory such as checkpoints/toy/audio/source")
    if not (Path(args.data) / "train" / "features.npz").exists():
        raise SystemExit(f"speech_asr: no training utterances in {args.data}/train; build them first: "
                         "python -m launch.toy.speech")

    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    from kvjax import checkpointing
    from kvjax.models.whisper import WhisperEncoderConfig, encode_forward, encoded_length
    from launch.toy.speech import load_set
    logging.getLogger("absl").setLevel(logging.WARNING)

    sh = Shapes()
    data = {}
    for split in ("train", "valid"):
        items, feats, offsets = load_set(Path(args.data) / split)
        keep = np.flatnonzero((np.diff(offsets) <= BUCKETS[-1])
                              & np.asarray([0 < len(labels(it["context"])) <= MAX_CHARS for it in items]))
        data[split] = (items, feats, offsets, keep)
    ecfg = WhisperEncoderConfig(num_mel_bins=data["train"][1].shape[0], d_model=sh.d_model, num_layers=sh.layers,
                                num_heads=sh.heads, ffn_dim=sh.ffn, max_source_positions=sh.positions)
    opt = optimizer(args.lr, args.warmup, args.steps)
    state = initial_state(ecfg, opt, args.seed)
    continues = None
    if args.init_from:  # a continued pre-training: the adapter's encoder, a fresh head and optimizer
        from kvjax.hf.ultravox import load_audio_encoder
        enc = load_audio_encoder(args.init_from, jnp.float32)
        if enc.cfg != ecfg:
            raise SystemExit(f"speech_asr: the encoder in {args.init_from} has other shapes ({enc.cfg}) than this "
                             f"script's ({ecfg})")
        state["params"]["encoder"] = enc.params
        state["opt"] = opt.init(state["params"])
        continues = {"from": args.init_from, "runs": encoder_runs(args.init_from)}

    def logits_of(params, b):
        h = encode_forward(params["encoder"], ecfg, b["features"], b["frames"])
        return h @ params["head"] + params["head_bias"]  # [B, T2, K]

    def loss_fn(params, b):
        logits = logits_of(params, b)
        n = encoded_length(b["frames"])
        pad = (jnp.arange(logits.shape[1])[None, :] >= n[:, None]).astype(jnp.float32)
        per = optax.ctc_loss(logits, pad, b["labels"], b["label_pad"], blank_id=0)
        return jnp.mean(per / jnp.maximum(jnp.sum(1 - b["label_pad"], -1), 1.0))  # per character

    @jax.jit
    def step(state, b):
        loss, g = jax.value_and_grad(loss_fn)(state["params"], b)
        upd, o = opt.update(g, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], upd), "opt": o}, loss

    argmax = jax.jit(lambda params, b: jnp.argmax(logits_of(params, b), -1))

    def cer(params) -> float:
        items, feats, offsets, keep = data["valid"]
        errs = chars = 0
        for s in range(0, len(keep), 32):
            b = batch(keep[s:s + 32], items, feats, offsets, BUCKETS)
            ids = np.asarray(argmax(params, b))
            n = np.asarray(encoded_length(b["frames"]))
            for r in range(len(ids)):
                truth = [int(c) for c in b["labels"][r][b["label_pad"][r] == 0]]
                errs += edit_distance(greedy(ids[r], n[r]), truth)
                chars += len(truth)
        return errs / chars

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "settings.json").write_text(json.dumps({"shapes": dataclasses.asdict(sh), "encoder": ecfg.to_hf_dict(),
                                                    "alphabet": ALPHABET, "args": vars(args), "continues": continues},
                                                   indent=1) + "\n")
    manager = checkpointing.manager(str(work / "ckpt"))
    start = manager.latest_step() or 0
    if start:
        state = manager.restore(start, args=ocp.args.StandardRestore(state))
    metrics = work / "metrics.jsonl"
    if metrics.exists():
        metrics.write_text("".join(ln for ln in open(metrics) if json.loads(ln)["step"] <= start))
    items, feats, offsets, keep = data["train"]
    end = min(args.steps, args.stop_at or args.steps)
    bar = tqdm(range(start, end), initial=start, total=args.steps, desc="asr", unit="step")
    t0, losses = time.perf_counter(), []
    for i in bar:
        rng = np.random.default_rng((args.seed, i))
        state, loss = step(state, batch(rng.choice(keep, args.batch, replace=False), items, feats, offsets,
                                        BUCKETS, spec=rng))
        losses.append(float(loss))
        done = i + 1
        if done % args.eval_every == 0 or done == end:
            rec = {"step": done, "train_ctc": float(np.mean(losses[-args.eval_every:])), "valid_cer": cer(state["params"]),
                   "utterances": done * args.batch, "seconds": time.perf_counter() - t0, "time": time.time()}
            with open(metrics, "a") as f:
                f.write(json.dumps(rec) + "\n")
            bar.set_postfix(ctc=f"{rec['train_ctc']:.3f}", cer=f"{rec['valid_cer']:.3f}")
        if done % args.save_every == 0 or done == end:
            manager.save(done, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()


def encoder_runs(adapter: str | Path, record: str = "encoder_metrics.jsonl") -> list[list[dict]]:
    """The pre-training record an exported adapter ships (`encoder_metrics.jsonl`; the projector's distillation:
    `training_metrics.jsonl`), one list of records per run, oldest first: a continued run's records follow the runs
    it continued (their `run` field)."""
    path = Path(adapter) / record
    recs = [json.loads(ln) for ln in open(path)] if path.exists() else []
    runs: dict[int, list[dict]] = {}
    for r in recs:
        runs.setdefault(r.get("run", 0), []).append(r)
    return [runs[k] for k in sorted(runs)]


def encoder_record(work: str | Path) -> str:
    """The pre-training record of the encoder in `work` as JSON lines: the runs it continued, then its own, each
    record with its `run` (0 = the first pre-training)."""
    work = Path(work)
    settings = json.loads((work / "settings.json").read_text())
    runs = (settings.get("continues") or {}).get("runs", [])
    own = [json.loads(ln) for ln in open(work / "metrics.jsonl")] if (work / "metrics.jsonl").exists() else []
    return runs_record(runs + [own])


def runs_record(runs: list[list[dict]]) -> str:
    """Runs' records (oldest first) as JSON lines, each with its `run` (0 = the first)."""
    return "".join(json.dumps({**r, "run": k}) + "\n" for k, recs in enumerate(runs) for r in recs)


def transcribe(work: str | Path):
    """A function features [M, F] (one clip) -> its greedy CTC transcript (character classes), from the latest
    checkpoint in `work`. A clip longer than the encoder's window is heard chunk by chunk, as the evaluation and
    Ultravox's processor split it (kvjax.models.audio_lm.audio_chunks); every chunk is padded to the window (one
    compile)."""
    import jax.numpy as jnp

    from kvjax.models.audio_lm import audio_chunks
    from kvjax.models.whisper import encode_jit, encoded_length
    state, ecfg = _restore(work)
    p = state["params"]
    w = ecfg.max_frames

    def hear(features: np.ndarray) -> list[int]:
        chunks, frames, _ = audio_chunks(features[None], [features.shape[1]], w)
        chunks = np.pad(chunks, ((0, 0), (0, 0), (0, w - chunks.shape[2])))
        h = np.asarray(encode_jit(p["encoder"], ecfg, jnp.asarray(chunks), jnp.asarray(frames)))
        h = np.concatenate([h[i, :encoded_length(n)] for i, n in enumerate(frames)])
        return greedy(np.argmax(h @ np.asarray(p["head"]) + np.asarray(p["head_bias"]), -1), len(h))
    return hear


def load_encoder(work: str | Path):
    """The pre-trained encoder's parameters (the latest checkpoint in `work`) and its config."""
    state, ecfg = _restore(work)
    return state["params"]["encoder"], ecfg


def _restore(work: str | Path):
    import orbax.checkpoint as ocp

    from kvjax import checkpointing
    from kvjax.models.whisper import WhisperEncoderConfig
    work = Path(work)
    if not (work / "settings.json").exists():
        raise SystemExit(f"no pre-trained encoder in {work}; train one: python -m launch.toy.speech_asr")
    settings = json.loads((work / "settings.json").read_text())
    ecfg = WhisperEncoderConfig.from_hf_dict(settings["encoder"])
    manager = checkpointing.manager(str(work / "ckpt"))
    if manager.latest_step() is None:
        raise SystemExit(f"no checkpoint in {work}/ckpt; train one: python -m launch.toy.speech_asr")
    a = settings["args"]
    like = initial_state(ecfg, optimizer(a["lr"], a["warmup"], a["steps"]), 0)
    return manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(like)), ecfg


if __name__ == "__main__":
    main()

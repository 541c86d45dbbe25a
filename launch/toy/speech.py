"""Build the toy speech set: English prose of the toy corpus spoken by espeak-ng, as Whisper log-mel features.

  python -m launch.toy.speech                    # writes work/toy/audio/data/ (local) and the sealed test set
  python -m launch.toy.speech --train 6000       # fewer training utterances (the shipped adapters' recipe: 16,000)

The prose is the corpus's documentation (the python3.11-doc reST sources of `checkpoints/toy/data/manifest.json`),
never its code: paragraphs of plain text with the reST markup removed. Each item is a CONTEXT of 8-18 words, spoken,
followed by the paragraph's next words as text. Training items come from the manifest's train files; the sealed
test items (`checkpoints/toy/audio/test/`, shipped) from its held-out files, so no sealed item's text was ever used
for training the models, the speech encoders or the map. Every clip is spoken by a voice drawn from seven espeak-ng
English accents x eleven voice variants, at 150-220 words a minute and pitch 25-75, so an encoder cannot learn one
voice; the sealed set draws its own voices the same way.

Features: transformers' WhisperFeatureExtractor (80 mel bins, 16 kHz: espeak-ng's 22.05 kHz resampled by
scipy.signal.resample_poly), stored as uint8 (`quantize`: (x + 1.5) * 64, a step of 1/64 over Whisper's
normalised range [-1.5, 2.48]) so the shipped set stays a few MB; training reads the same quantized features.

Sealed test (`test/items.jsonl` + `test/features.npz`):
  mc        the context spoken, four endings as text (the true next words and three from other held-out paragraphs,
            none sharing its first word with the truth), label = index of the truth.
Needs espeak-ng (`apt-get install espeak-ng`) and the docs package (`apt-get install python3.11-doc`); the shipped test
set and trained encoders mean nothing else ever needs them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

TEST = Path("checkpoints/toy/audio/test")  # shipped
DATA = Path("work/toy/audio/data")  # local: training and validation utterances
MAP_TRAIN = Path("checkpoints/toy/audio/map_train")  # shipped: the job's audio map trains on these
ACCENTS = ("en-us", "en-gb", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan", "en-gb-x-gbcwmd")
VARIANTS = ("", "+m1", "+m2", "+m3", "+m4", "+m5", "+f1", "+f2", "+f3", "+f4", "+klatt")
SPEED = (150, 220)
PITCH = (25, 75)
MEL_BINS = 80
Q_OFFSET, Q_SCALE = 1.5, 64.0
CTX_WORDS = (8, 18)
ENDING_WORDS = 10
WORD = re.compile(r"^[A-Za-z][A-Za-z'\-]*[.,;:?!]?$")


def quantize(x: np.ndarray) -> np.ndarray:
    return np.clip(np.rint((x + Q_OFFSET) * Q_SCALE), 0, 255).astype(np.uint8)


def dequantize(q: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) / Q_SCALE - Q_OFFSET


# ---- prose -----------------------------------------------------------------------------------------------------------

ROLE = re.compile(r":[a-z:+-]+:`~?!?([^`<]*?)\s*(?:<[^>]*>)?`")
LINK = re.compile(r"`([^`<]+?)\s*(?:<[^>]*>)?`_{1,2}")


def clean(par: str) -> str:
    par = ROLE.sub(r"\1", par)
    par = LINK.sub(r"\1", par)
    par = par.replace("``", "").replace("**", "").replace("`", "")
    par = re.sub(r"(?<!\w)\*([^*]+)\*", r"\1", par)
    return " ".join(par.split())


def paragraphs(text: str) -> list[str]:
    """Plain-prose paragraphs of a reST file: not indented (code, directives' bodies), not markup lines."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if not lines or any(not ln or ln[0].isspace() for ln in lines):
            continue
        if any(ln.lstrip().startswith(("..", "=", "-", "*", "|", "+", ">>>", ":", "#", "~", "^")) for ln in lines):
            continue
        words = clean(" ".join(lines)).split()
        if len(words) < CTX_WORDS[1] + ENDING_WORDS + 2:
            continue
        if sum(bool(WORD.match(w)) for w in words) < 0.9 * len(words):
            continue  # identifiers, numbers, symbols: espeak spells them, the toy cannot hear them
        out.append(" ".join(words))
    return out


def prose(split: str) -> list[tuple[str, str]]:
    """(file, paragraph) of the corpus's documentation files in `split`, in manifest order."""
    from launch.toy.data import DOCS_ROOT, load_corpus
    manifest = json.loads(Path("checkpoints/toy/data/manifest.json").read_text())
    docs = {**manifest, "sources": {"pydoc": manifest["sources"]["pydoc"]},
            "files": [e for e in manifest["files"] if e["path"].startswith("pydoc/") and e["split"] == split]}
    texts = load_corpus(docs, {"pydoc": DOCS_ROOT})
    return [(name, p) for name, text in texts.items() for p in paragraphs(text)]


def items_from(pars: list[tuple[str, str]], n: int, rng: random.Random) -> list[dict]:
    """n items: a context of 8-18 words at a sentence start (or the paragraph's start) and the words after it."""
    out = []
    while len(out) < n:
        name, p = pars[rng.randrange(len(pars))]
        words = p.split()
        starts = [0] + [i + 1 for i, w in enumerate(words[:-1]) if w.endswith(".")]
        k = rng.randint(*CTX_WORDS)
        starts = [s for s in starts if s + k + ENDING_WORDS <= len(words)]
        if not starts:
            continue
        s = rng.choice(starts)
        out.append({"file": name, "context": " ".join(words[s:s + k]),
                    "continuation": " " + " ".join(words[s + k:s + k + 3 * ENDING_WORDS])})
    return out


# ---- speech ----------------------------------------------------------------------------------------------------------

def voice(rng: random.Random) -> dict:
    return {"voice": rng.choice(ACCENTS) + rng.choice(VARIANTS), "speed": rng.randint(*SPEED),
            "pitch": rng.randint(*PITCH)}


def speak(job: tuple[str, dict]) -> np.ndarray:
    """16 kHz float32 waveform of `text` by espeak-ng with the voice settings."""
    from scipy.io import wavfile
    from scipy.signal import resample_poly
    text, v = job
    with tempfile.NamedTemporaryFile(suffix=".wav") as f:
        run = subprocess.run(["espeak-ng", "-v", v["voice"], "-s", str(v["speed"]), "-p", str(v["pitch"]), "-w",
                              f.name, "--stdin"], input=text.encode(), capture_output=True)
        if run.returncode or not os.path.getsize(f.name):
            raise RuntimeError(f"espeak-ng {v} failed on {text!r}: {run.stderr.decode().strip()}")
        rate, wav = wavfile.read(f.name)
    wav = wav.astype(np.float32) / 32768.0
    if rate != 16_000:
        g = np.gcd(16_000, rate)
        wav = resample_poly(wav, 16_000 // g, rate // g).astype(np.float32)
    return wav


def features(texts: list[str], voices: list[dict], workers: int, desc: str,
             mel_bins: int = MEL_BINS) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 log-mel frames concatenated [80, sum(frames)], frames per clip [N])."""
    from tqdm import tqdm
    from transformers import WhisperFeatureExtractor

    from kvjax.models.audio_lm import log_mel
    fe = WhisperFeatureExtractor(feature_size=mel_bins)
    feats, frames = [], []
    with ProcessPoolExecutor(workers) as pool:
        for wav in tqdm(pool.map(speak, zip(texts, voices), chunksize=8), total=len(texts), desc=desc, unit="clip"):
            f, n = log_mel([wav], mel_bins, feature_extractor=fe)
            feats.append(quantize(f[0, :, :n[0]]))
            frames.append(int(n[0]))
    return np.concatenate(feats, axis=1), np.asarray(frames, np.int32)


def save_set(out: Path, items: list[dict], feats: np.ndarray, frames: np.ndarray, meta: dict) -> None:
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.savez_compressed(tmp / "features.npz", features=feats, frames=frames)
    with open(tmp / "items.jsonl", "w") as f:
        for it in items:
            f.write(json.dumps(it) + "\n")
    (tmp / "meta.json").write_text(json.dumps({**meta, "items": len(items), "frames": int(frames.sum()),
                                               "sha256": hashlib.sha256(feats.tobytes()).hexdigest()}, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def load_set(path: Path) -> tuple[list[dict], np.ndarray, np.ndarray]:
    """(items, uint8 features [80, total], offsets [N + 1]) of a set written by save_set."""
    with np.load(path / "features.npz") as z:
        feats, frames = z["features"], z["frames"]
    items = [json.loads(line) for line in open(path / "items.jsonl")]
    return items, feats, np.concatenate([[0], np.cumsum(frames)])


def mc_items(items: list[dict], rng: random.Random) -> list[dict]:
    """Four endings per context: its own next ENDING_WORDS words and three other items' (first words differ)."""
    endings = [" " + " ".join(it["continuation"].split()[:ENDING_WORDS]) for it in items]
    out = []
    for i, it in enumerate(items):
        others = []
        while len(others) < 3:
            j = rng.randrange(len(items))
            if j != i and endings[j].split()[0] != endings[i].split()[0] and endings[j] not in others:
                others.append(endings[j])
        label = rng.randrange(4)
        choices = others[:label] + [endings[i]] + others[label:]
        out.append({**it, "endings": choices, "label": label})
    return out


def write_map_train(train: Path, n: int, out: Path) -> None:
    """The first n training utterances, shipped so the main job can train its audio map without espeak-ng (the
    continuation is what the map's KL is taken over)."""
    items, feats, offsets = load_set(train)
    meta = json.loads((train / "meta.json").read_text())
    save_set(out, [{**it, "endings": [it["continuation"]]} for it in items[:n]], feats[:, :offsets[n]],
             np.diff(offsets[:n + 1]).astype(np.int32), {**meta, "subset": f"the first {n} of {train.name}"})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", type=int, default=16000, help="training utterances (from the train split's docs)")
    p.add_argument("--valid", type=int, default=256, help="validation utterances (train split, other draws)")
    p.add_argument("--test", type=int, default=240, help="sealed multiple-choice items (held-out docs)")
    p.add_argument("--map-train", type=int, default=192,
                   help="training utterances also shipped (checkpoints/toy/audio/map_train) for the job's audio map")
    p.add_argument("--only-map-train", action="store_true", help="only (re)write map_train from the built train set")
    p.add_argument("--mel-bins", type=int, default=MEL_BINS,
                   help="80 for the toy encoders and Whisper v1/v2; 128 for whisper-large-v3(-turbo), Ultravox v0.5's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--test-out", default=str(TEST))
    p.add_argument("--map-train-out", default=str(MAP_TRAIN))
    p.add_argument("--data-out", default=str(DATA))
    args = p.parse_args(argv)
    if args.only_map_train:
        return write_map_train(Path(args.data_out) / "train", args.map_train, Path(args.map_train_out))
    if shutil.which("espeak-ng") is None:
        sys.exit("launch.toy.speech: espeak-ng is not installed; install it: apt-get install -y espeak-ng")
    rng = random.Random(args.seed)
    meta = {"built_by": "python -m launch.toy.speech", "args": vars(args), "mel_bins": args.mel_bins,
            "quantize": f"uint8 = round((x + {Q_OFFSET}) * {Q_SCALE})", "accents": ACCENTS, "variants": VARIANTS,
            "speed_wpm": SPEED, "pitch": PITCH,
            "espeak_ng": subprocess.run(["espeak-ng", "--version"], capture_output=True, text=True).stdout.strip()}

    test_pars = prose("heldout")
    test = mc_items(items_from(test_pars, args.test, rng), rng)
    tv = [voice(rng) for _ in test]
    for it, v in zip(test, tv):
        it["voice"] = v
    feats, frames = features([it["context"] for it in test], tv, args.workers, "sealed test", args.mel_bins)
    save_set(Path(args.test_out), test, feats, frames, {**meta, "split": "heldout docs", "kind": "mc"})

    train_pars = prose("train")
    for name, n in (("valid", args.valid), ("train", args.train)):
        items = items_from(train_pars, n, rng)
        vs = [voice(rng) for _ in items]
        for it, v in zip(items, vs):
            it["voice"] = v
        feats, frames = features([it["context"] for it in items], vs, args.workers, name, args.mel_bins)
        save_set(Path(args.data_out) / name, items, feats, frames, {**meta, "split": "train docs"})
    write_map_train(Path(args.data_out) / "train", args.map_train, Path(args.map_train_out))
    print(f"wrote {args.test_out} (sealed, shipped), {args.map_train_out} (shipped) and "
          f"{args.data_out}/{{valid,train}} (local)")


if __name__ == "__main__":
    main()

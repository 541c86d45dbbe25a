"""Audio transfer, evaluated: a sealed spoken multiple-choice test scored through every way of giving a model the
spoken context (the method's speech claim: "An 8B model listened once. A 1B model answered").

Items (launch/toy/speech.py's sealed set): a context spoken (log-mel features), its transcript, four text endings.
Prompts (the toy adapters' template, launch/toy/speech_train.py): [EOS][audio tokens][\\n] for a listening model,
[EOS][transcript][\\n] for a reading one, [EOS][\\n] for none (the "null" prompt); an ending is scored by how much
the context raises its log-probability over the null prompt under the answering model (`correct`). The last prompt
token, a line break, is run by the answering model itself, so a text-only answerer can read a mapped audio cache.

Arms (ARMS below): each is a cache builder (kvjax.builders) and the prompt kind it reads. The arms that listen
through the source share one AudioPrefill, so the source listens once per batch for all of them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

Q_OFFSET, Q_SCALE = 1.5, 64.0  # the sealed set's uint8 features (launch/toy/speech.py quantize)
FRAME_BUCKET = 128


class ArmRow(NamedTuple):
    name: str
    label: str
    colour: str
    prompt: str  # "audio" or "text" (the transcript)
    reads: str  # "source" or "target": the model that answers


ARMS = (
    ArmRow("target_audio", "answerer's own audio path", "#4C72B0", "audio", "target"),
    ArmRow("direct_audio", "direct injection (audio cache)", "#937860", "audio", "target"),
    ArmRow("text_map_audio", "text map on the audio cache", "#8172B3", "audio", "target"),
    ArmRow("mapped_audio", "audio map (answerer reads the source's audio cache)", "#55A868", "audio", "target"),
    ArmRow("source_audio", "source listens and answers", "#DD8452", "audio", "source"),
    ArmRow("target_text", "answerer reads the transcript", "#A6BDDB", "text", "target"),
    ArmRow("source_text", "source reads the transcript", "#FDBF6F", "text", "source"),
    ArmRow("mapped_text", "text map, the source reading the transcript", "#B8DDB0", "text", "target"),
)
BY_NAME = {a.name: a for a in ARMS}


@dataclasses.dataclass(frozen=True)
class SpokenItem:
    context: str  # the transcript
    endings: list[str]
    label: int
    features: np.ndarray  # float32 [M, frames]


def dequantize(q: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) / Q_SCALE - Q_OFFSET


def load_spoken(path: str, limit: int = 0) -> list[SpokenItem]:
    """A spoken set written by launch/toy/speech.py (items.jsonl + features.npz)."""
    p = Path(path)
    if not (p / "items.jsonl").is_file() or not (p / "features.npz").is_file():
        raise FileNotFoundError(f"{path}: not a spoken set (items.jsonl + features.npz); the toy's is "
                                "checkpoints/toy/audio/test (python -m launch.toy.speech builds it)")
    with np.load(p / "features.npz") as z:
        feats, frames = z["features"], z["frames"]
    offsets = np.concatenate([[0], np.cumsum(frames)])
    items = [json.loads(line) for line in open(p / "items.jsonl")]
    out = [SpokenItem(it["context"], it.get("endings", [it.get("continuation", "")]), int(it.get("label", 0)),
                      dequantize(feats[:, offsets[i]:offsets[i + 1]])) for i, it in enumerate(items)]
    return out[:limit] if limit else out


def pad_features(feats: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Clips [M, F_i] -> (features [N, M, F] zero-padded to a multiple of FRAME_BUCKET frames, frames [N])."""
    frames = np.asarray([f.shape[1] for f in feats], np.int32)
    t = -(-int(frames.max()) // FRAME_BUCKET) * FRAME_BUCKET
    out = np.zeros((len(feats), feats[0].shape[0], t), np.float32)
    for i, f in enumerate(feats):
        out[i, :, :f.shape[1]] = f
    return out, frames


class Prompts(NamedTuple):
    open_id: int  # what starts a prompt (the toy: EOS, which opens every document)
    close_ids: tuple[int, ...]  # the text after the audio (the toy: a line break); its last token is run by the scorer
    placeholder: int  # the audio positions' id


def audio_prompt_ids(p: Prompts, audio_tokens: int) -> list[int]:
    return [p.open_id] + [p.placeholder] * int(audio_tokens) + list(p.close_ids)


def text_prompt_ids(p: Prompts, transcript_ids: list[int]) -> list[int]:
    return [p.open_id] + list(transcript_ids) + list(p.close_ids)


def clip_inputs(feats: list[np.ndarray], stack_factor: int, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Clips [M, F_i] -> (encoder inputs [N', M, <= window], their frames [N'], audio tokens per clip [N]): a clip
    longer than the encoder's window is split into window-long chunks, each encoded alone, their tokens consecutive
    (Ultravox's processor; kvjax.models.audio_lm.audio_chunks)."""
    from kvjax.models.audio_lm import audio_chunks, audio_token_count
    f, frames = pad_features(feats)
    counts = audio_token_count(frames.astype(np.int64), stack_factor, window)
    if f.shape[2] > window:
        f, frames, _ = audio_chunks(f, frames, window)
    return f, frames, counts


def score_spoken(items: list[SpokenItem], tokenizer, builders: dict[str, tuple], prompts: Prompts,
                 stack_factor: int, listeners: list, batch_size: int = 8, progress: bool = True,
                 window: int = 3000) -> dict:
    """Every arm on every item: builders name -> (CacheBuilder, prompt kind "audio" / "text"); `listeners`: the
    AudioPrefill objects to give each batch's clips (set_audio); `window`: the encoders' longest input in frames
    (longer clips are chunked). Returns name -> {"logprobs" [N, K], "n_tokens" [N, K]} (numpy) and "labels" [N]."""
    from tqdm import tqdm

    from kvjax.eval.arms import _padded, repeat_rows
    from kvjax.eval.likelihood import continuation_logprobs
    from kvjax.generation import pad_prompts
    k = len(items[0].endings)
    out = {name: ([], []) for name in builders}
    for start in tqdm(range(0, len(items), batch_size), desc="spoken multiple choice", unit="batch",
                      disable=not progress):
        chunk = items[start:start + batch_size]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - real)  # one shape per batch
        feats, frames, counts = clip_inputs([it.features for it in chunk], stack_factor, window)
        for listener in listeners:
            listener.set_audio(feats, frames)
        ids = {"audio": [audio_prompt_ids(prompts, a) for a in counts], "null": [text_prompt_ids(prompts, [])] * len(chunk),
               "text": [text_prompt_ids(prompts, tokenizer.encode(it.context, add_special_tokens=False).ids)
                        for it in chunk]}
        endings = [tokenizer.encode(e.lstrip(), add_special_tokens=False).ids for it in chunk for e in it.endings]
        conts, cont_lengths = pad_prompts(endings)
        for name, (builder, kind) in builders.items():
            prefix, lengths = _padded([x[:-1] for x in ids[kind]])
            last = np.repeat(np.asarray([x[-1] for x in ids[kind]], np.int32), k)
            cfg, params = builder.model
            cache = repeat_rows(builder(prefix, lengths, bucketed=True), k)
            total, n = continuation_logprobs(params, cfg, cache, last, conts, cont_lengths)
            out[name][0].append(total.reshape(batch_size, k)[:real])
            out[name][1].append(n.reshape(batch_size, k)[:real])
    res = {name: {"logprobs": np.concatenate(lp), "n_tokens": np.concatenate(nt)} for name, (lp, nt) in out.items()}
    res["labels"] = np.asarray([it.label for it in items])
    return res


def correct(logprobs: np.ndarray, null: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per item 1.0 where the ending the context raises most is the label: log p(ending | context) - log p(ending |
    no context) under the answering model (`null`: its scores after the prompt without the context), the pointwise
    mutual information of context and ending (Holtzman et al. 2021, "domain-conditional PMI"). Length-normalised
    likelihood lets an ending's own fluency decide: the toy source reading the transcripts scores 35.8% with it and
    52.5% with PMI on the first 120 sealed items (chance 25%), so the context's part is what PMI measures."""
    return (np.argmax(logprobs - null, axis=1) == labels).astype(np.float64)


def sign_flip_p(diff: np.ndarray, n: int = 100_000, seed: int = 0) -> float:
    """Two-sided paired permutation (sign-flip) p-value of mean(diff) = 0."""
    diff = np.asarray(diff, np.float64)
    rng = np.random.default_rng(seed)
    signs = rng.choice((-1.0, 1.0), size=(n, diff.size))
    null = np.abs((signs * diff).mean(1))
    return float((1 + np.sum(null >= abs(diff.mean()) - 1e-12)) / (n + 1))



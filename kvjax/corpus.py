"""Text sources -> one flat token array, offline: the local Python standard library split by a manifest, .txt and
.jsonl files, or token arrays saved as .npy.

A source string is one of
  "stdlib:train" / "stdlib:heldout"  the .py files of this machine's Python standard library that `manifest` (the
                                     toy corpus record, checkpoints/toy/data/manifest.json) puts in that split
  path/to/file.txt                   one document
  path/to/file.jsonl                 one document per record (its `text_field`)
  path/to/tokens.npy                 token ids, used as they are (1-D, or 2-D rows concatenated)
Documents are tokenized without special tokens and each is followed by the EOS id, in a fixed order, so the same
sources always give the same array.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig

import numpy as np

STDLIB_SPLITS = ("train", "heldout")


class CorpusError(ValueError):
    """A text source that cannot be read; the message says what to pass instead."""


def stdlib_files(manifest: str, split: str) -> list[str]:
    """Absolute paths of the local stdlib files in `split` of the manifest, in the order of their recorded sha256
    (files missing here are skipped)."""
    if split not in STDLIB_SPLITS:
        raise CorpusError(f"'stdlib:{split}': the split must be one of {STDLIB_SPLITS}")
    if not os.path.isfile(manifest):
        raise CorpusError(f"'stdlib:{split}' needs the corpus manifest {manifest} (set data.manifest)")
    with open(manifest) as f:
        entries = json.load(f)["files"]
    root = sysconfig.get_paths()["stdlib"]
    chosen = sorted((e for e in entries if e["split"] == split and e["path"].startswith("stdlib/")),
                    key=lambda e: e["sha256"])  # a fixed pseudo-random order: any prefix mixes all packages
    paths = [os.path.join(root, e["path"][len("stdlib/"):]) for e in chosen]
    return [p for p in paths if os.path.isfile(p)]


def check_source(source: str, manifest: str) -> None:
    """Raise CorpusError now (before any work) if `source` cannot be read."""
    if source.startswith("stdlib:"):
        if not stdlib_files(manifest, source.split(":", 1)[1]):
            raise CorpusError(f"{source!r}: none of the manifest's files exist under this Python's standard library "
                              f"({sysconfig.get_paths()['stdlib']}); pass local .txt/.jsonl/.npy files instead")
    elif not source.endswith((".txt", ".jsonl", ".npy")):
        raise CorpusError(f"text source {source!r}: expected 'stdlib:train', 'stdlib:heldout' or a .txt, .jsonl or "
                          ".npy file")
    elif not os.path.isfile(source):
        raise CorpusError(f"text source {source!r} does not exist")


def _documents(source: str, manifest: str, text_field: str):
    if source.startswith("stdlib:"):
        for path in stdlib_files(manifest, source.split(":", 1)[1]):
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()
    elif source.endswith(".txt"):
        with open(source, encoding="utf-8") as f:
            yield f.read()
    else:
        with open(source, encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                record = json.loads(line)
                if text_field not in record:
                    raise CorpusError(f"{source} line {i + 1} has no {text_field!r} field (fields: "
                                      f"{sorted(record)}); set data.text_field")
                yield record[text_field]


def read_tokens(sources, tokenizer, eos_id: int, max_tokens: int, manifest: str = "",
                text_field: str = "text", batch: int = 64) -> np.ndarray:
    """The sources' tokens (EOS after each document) as one int32 array of at most `max_tokens`."""
    out, total = [], 0
    for source in sources:
        if total >= max_tokens:
            break
        check_source(source, manifest)
        if source.endswith(".npy"):
            arr = np.load(source, mmap_mode="r")
            flat = np.asarray(arr.reshape(-1)[: max_tokens - total], np.int32)
            out.append(flat)
            total += len(flat)
            continue
        pending = []
        for doc in _documents(source, manifest, text_field):
            pending.append(doc)
            if len(pending) == batch:
                total = _encode(pending, tokenizer, eos_id, out, total)
                pending = []
                if total >= max_tokens:
                    break
        if pending and total < max_tokens:
            total = _encode(pending, tokenizer, eos_id, out, total)
    if not out:
        raise CorpusError(f"no tokens from {list(sources)}")
    return np.concatenate(out)[:max_tokens]


def _encode(docs: list[str], tokenizer, eos_id: int, out: list, total: int) -> int:
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids = np.asarray(enc.ids + [eos_id], np.int32)
        out.append(ids)
        total += len(ids)
    return total


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()

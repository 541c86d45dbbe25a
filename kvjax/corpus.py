"""Text sources -> one flat token array, offline: the toy corpus's files split by its manifest, .txt and .jsonl
files, or token arrays saved as .npy.

A source string is one of
  "stdlib:train" / "stdlib:heldout"  the .py files of this machine's Python standard library that `manifest` (the
                                     toy corpus record, checkpoints/toy/data/manifest.json) puts in that split
  "pydoc:train" / "pydoc:heldout"    the documentation's reST sources the manifest records (Debian's python3.11-doc),
                                     prose and examples: what the toy models read besides code
  "corpus:train" / "corpus:heldout"  both, mixed, as the toy models were trained on them
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

SPLITS = ("train", "heldout")
SOURCES = ("stdlib", "pydoc", "corpus")  # the manifest's two sources, and both ("corpus")
FIX = {"stdlib": "pass local .txt/.jsonl/.npy files instead",
       "pydoc": "install the documentation the manifest records: apt-get install -y python3.11-doc"}


class CorpusError(ValueError):
    """A text source that cannot be read; the message says what to pass instead."""


def _manifest_source(source: str) -> tuple[str, str] | None:
    """("pydoc", "train") for "pydoc:train"; None for a file path."""
    name, _, split = source.partition(":")
    return (name, split) if name in SOURCES and split else None


def manifest_files(manifest: str, source: str, split: str) -> list[str]:
    """Absolute paths of the local files of `source` ("stdlib", "pydoc" or "corpus": both) in `split` of the
    manifest, in the order of their recorded sha256 (files missing here are skipped). The standard library is this
    Python's; the documentation is where the manifest recorded it (Debian's python3.11-doc puts it at one path)."""
    if split not in SPLITS:
        raise CorpusError(f"'{source}:{split}': the split must be one of {SPLITS}")
    if not os.path.isfile(manifest):
        raise CorpusError(f"'{source}:{split}' needs the corpus manifest {manifest} (set data.manifest)")
    with open(manifest) as f:
        record = json.load(f)
    roots = {name: info.get("root", "") for name, info in record.get("sources", {}).items()}
    roots["stdlib"] = sysconfig.get_paths()["stdlib"]
    chosen = sorted((e for e in record["files"] if e["split"] == split
                     and (source == "corpus" or e["path"].startswith(source + "/"))),
                    key=lambda e: e["sha256"])  # a fixed pseudo-random order: any prefix mixes all packages
    paths = [os.path.join(roots.get(e["path"].split("/", 1)[0], ""), e["path"].split("/", 1)[1]) for e in chosen]
    return [p for p in paths if os.path.isfile(p)]


def check_source(source: str, manifest: str) -> None:
    """Raise CorpusError now (before any work) if `source` cannot be read."""
    named = _manifest_source(source)
    if named:
        name, split = named
        for part in ("stdlib", "pydoc") if name == "corpus" else (name,):  # each part of a mix must be here
            if not manifest_files(manifest, part, split):
                raise CorpusError(f"{source!r}: none of the manifest's {part} files of split {split!r} exist on this "
                                  f"machine; {FIX[part]}")
    elif not source.endswith((".txt", ".jsonl", ".npy")):
        raise CorpusError(f"text source {source!r}: expected one of "
                          f"{', '.join(f'{s}:{sp}' for s in SOURCES for sp in SPLITS)} or a .txt, .jsonl or .npy file")
    elif not os.path.isfile(source):
        raise CorpusError(f"text source {source!r} does not exist")


def _documents(source: str, manifest: str, text_field: str):
    if _manifest_source(source):
        for path in manifest_files(manifest, *_manifest_source(source)):
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

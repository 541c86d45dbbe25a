"""Text sources -> one flat token array: the toy corpus's files split by its manifest, .txt and .jsonl files, token
arrays saved as .npy, and datasets read through `datasets` (a hub name or a local copy), streamed.

A source string is one of
  "stdlib:train" / "stdlib:heldout"  the .py files of this machine's Python standard library that `manifest` (the
                                     toy corpus record, checkpoints/toy/data/manifest.json) puts in that split
  "pydoc:train" / "pydoc:heldout"    the documentation's reST sources the manifest records (Debian's python3.11-doc),
                                     prose and examples: what the toy models read besides code
  "corpus:train" / "corpus:heldout"  both, mixed, as the toy models were trained on them
  path/to/file.txt                   one document
  path/to/file.jsonl                 one document per record (its `text_field`)
  path/to/tokens.npy                 token ids, used as they are (1-D, or 2-D rows concatenated)
  hf:NAME[:CONFIG[:SPLIT]]           a dataset read with `datasets` in streaming mode, one document per record (its
                                     `text_field`): NAME is a hub name (HuggingFaceFW/fineweb-edu) or a local copy,
                                     read the same way: a `save_to_disk` directory, data files (.parquet, .jsonl,
                                     .json, .csv, .arrow; a glob is allowed), or a dataset repository's directory
                                     (its README names the configs). SPLIT defaults to train.
Documents are tokenized without special tokens and each is followed by the EOS id, in a fixed order, so the same
sources always give the same array.

An hf: source splits its documents into calibration and held-out ones: a document is held out when the first 8 bytes
of sha256("{split_seed}:" + its text), read as a number in [0, 1), fall below `heldout_share`. Listed in
data.train_text it gives the calibration documents, in data.heldout_text the held-out ones, so the two never share a
document (exact duplicates fall on one side) however far each stream is read. The stream is read only until the
tokens asked for are there (documents are tokenized in batches that stop where the budget may be reached: at most
`batch` - 1 documents of the part past it, usually none); the tokens are cached under the
run directory (`CACHE`), keyed by the source, its local files' sizes and times, the part, the split and the
tokenizer, so a rerun reads no dataset at all, offline too.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import socket
import sysconfig
import threading
from urllib.parse import urlparse

import numpy as np

SPLITS = ("train", "heldout")
SOURCES = ("stdlib", "pydoc", "corpus")  # the manifest's two sources, and both ("corpus")
FIX = {"stdlib": "pass local .txt/.jsonl/.npy files instead",
       "pydoc": "install the documentation the manifest records: apt-get install -y python3.11-doc"}
HF = "hf:"
PARTS = ("train", "heldout")  # the documents of an hf: source data.train_text / data.heldout_text read
CACHE = "corpus"  # the run directory's folder of tokenized hf: sources
DATA_FILES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
# the variables that put the hub client offline (huggingface_hub and datasets read them so)
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
PROBE_SECONDS = 1.5  # how long the preflight waits for the hub's host to answer

log = logging.getLogger("kvjax.corpus")


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


# ---- hf: sources ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Dataset:
    """An hf: source: `name` is a hub name or a local path (directory, data file or glob)."""
    source: str
    name: str
    config: str | None
    split: str

    @property
    def local(self) -> bool:
        """A path here, as `datasets` decides (an existing path wins over a hub name), or one that is plainly a
        path (absolute, relative with ./ or ~, a data file's suffix or a glob)."""
        path = os.path.expanduser(self.name)
        return (os.path.exists(path) or self.name.startswith(("/", ".", "~")) or "*" in self.name
                or self.name.endswith(tuple(DATA_FILES)))

    @property
    def path(self) -> str:
        return os.path.expanduser(self.name)

    def files(self) -> list[str]:
        """A local copy's files (those of a directory, or a glob's matches), sorted."""
        if os.path.isdir(self.path):
            return sorted(os.path.join(root, f) for root, _, names in os.walk(self.path) for f in names)
        return sorted(p for p in glob.glob(self.path) if os.path.isfile(p))


def dataset(source: str) -> Dataset | None:
    """The hf: source `source` parsed; None for any other kind of source."""
    if not source.startswith(HF):
        return None
    fields = source[len(HF):].split(":")
    if len(fields) > 3 or not fields[0]:
        raise CorpusError(f"text source {source!r}: expected hf:NAME[:CONFIG[:SPLIT]] (e.g. "
                          "hf:HuggingFaceFW/fineweb-edu:sample-10BT:train, or hf:/path/to/a/local/copy)")
    name, config, split = fields + [""] * (3 - len(fields))
    return Dataset(source, name, config or None, split or "train")


def _saved(path: str) -> bool:
    """A `save_to_disk` directory (a Dataset's state.json or a DatasetDict's dataset_dict.json)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in ("state.json", "dataset_dict.json"))


def _check_dataset(ds: Dataset) -> None:
    if not ds.local:
        return  # a hub name: whether the hub can be reached is `hub_problem`'s to say, once for every source
    if not ds.files():
        raise CorpusError(f"text source {ds.source!r}: no such dataset directory or data files {ds.path!r}")
    saved_dict = os.path.join(ds.path, "dataset_dict.json")
    if os.path.isfile(saved_dict):
        with open(saved_dict) as f:
            splits = json.load(f).get("splits", [])
        if ds.split not in splits:
            raise CorpusError(f"text source {ds.source!r}: the saved dataset has splits {splits}, not {ds.split!r}; "
                              f"name one as hf:{ds.name}::SPLIT")
    if ds.config and (_saved(ds.path) or not os.path.isdir(ds.path)):
        raise CorpusError(f"text source {ds.source!r}: a config names a part of a dataset repository (its README); "
                          f"{ds.path!r} is a saved dataset or data files: drop {ds.config!r}")


def identity(source: str) -> dict:
    """What identifies an hf: source's data cheaply: a local copy's files with their sizes and modification times
    (a hub dataset: its name, config and split, in the source string). Empty for other sources."""
    ds = dataset(source)
    if ds is None or not ds.local:
        return {}
    root = ds.path if os.path.isdir(ds.path) else ""
    out = {}
    for f in ds.files():
        st = os.stat(f)
        out[os.path.relpath(f, root) if root else f] = [st.st_size, st.st_mtime_ns]
    return out


def tokenizer_id(checkpoint: str) -> str:
    """The checkpoint's tokenizer.json as kvjax.job.markers.model_identity records it ("" when it has none)."""
    path = os.path.join(checkpoint, "tokenizer.json")
    if not os.path.isfile(path):
        return ""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def is_heldout(text: str, heldout_share: float, split_seed: int) -> bool:
    """Whether an hf: source's document is held out (see the module's docstring)."""
    h = hashlib.sha256(f"{split_seed}:".encode() + text.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(h[:8], "big") < heldout_share * 2.0 ** 64


@dataclasses.dataclass(frozen=True)
class Split:
    """Which documents of an hf: source a read takes, and where its tokens are cached ("" : not cached)."""
    part: str = "train"  # "train" (calibration documents) or "heldout"
    heldout_share: float = 0.2
    split_seed: int = 0
    cache_dir: str = ""
    tokenizer_id: str = ""  # part of the cache's key: tokens made by another tokenizer are not reused

    def cache_file(self, source: str, text_field: str) -> str:
        """The cache's path without its suffix (.npz: the documents' ids and lengths; .json: what it holds)."""
        key = json.dumps({"source": source, "files": identity(source), "part": self.part, "text_field": text_field,
                          "heldout_share": self.heldout_share, "split_seed": self.split_seed,
                          "tokenizer": self.tokenizer_id}, sort_keys=True)
        return os.path.join(self.cache_dir, f"{self.part}-{hashlib.sha256(key.encode()).hexdigest()[:16]}")

    def cached(self, source: str, text_field: str, max_tokens: int) -> dict | None:
        """The cache's record when it holds `max_tokens` tokens (EOS included) of `source`, or all it has."""
        if not self.cache_dir:
            return None
        base = self.cache_file(source, text_field)
        if not (os.path.isfile(base + ".json") and os.path.isfile(base + ".npz")):
            return None
        try:
            with open(base + ".json") as f:
                record = json.load(f)
            return record if record["exhausted"] or record["tokens"] >= max_tokens else None
        except (OSError, ValueError, KeyError, TypeError):
            return None  # not a record this module wrote: read the dataset again (and rewrite it)


def _open(ds: Dataset):
    """An iterable over the dataset's records: streamed from the hub or from local data files; a saved dataset is
    memory-mapped. The same reader follows for all of them."""
    import datasets
    if ds.local and _saved(ds.path):
        data = datasets.load_from_disk(ds.path)
        if isinstance(data, datasets.DatasetDict):
            data = data[ds.split]
        return data.to_iterable_dataset()
    if ds.local and not os.path.isdir(ds.path):
        builder = DATA_FILES.get(os.path.splitext(ds.path)[1])
        if builder is None:
            raise CorpusError(f"text source {ds.source!r}: data files must end in {', '.join(DATA_FILES)}")
        return datasets.load_dataset(builder, data_files=ds.files(), split=ds.split, streaming=True)
    return datasets.load_dataset(ds.path if ds.local else ds.name, ds.config, split=ds.split, streaming=True)


def _failed(ds: Dataset, e: Exception) -> CorpusError:
    where = "the local copy" if ds.local else "the hub (without network, pass a local copy as hf:/path/to/copy)"
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    hint = ""
    if ds.local and os.path.isdir(ds.path) and type(e).__name__ == "DataFilesNotFoundError":
        # `datasets` picks a repository's file format from its README's first config, whatever config is asked for
        hint = (f"; a partial download of a dataset repository: name its data files instead, e.g. "
                f"hf:{os.path.join(ds.name, 'sample', '10BT', '*.parquet')}")
    return CorpusError(f"text source {ds.source!r}: reading {where} failed: {type(e).__name__}: {first}{hint}")


def _dataset_documents(ds: Dataset, text_field: str, split: Split, counter: list):
    """The texts of `split.part`'s documents, in the dataset's order; counter[0] counts the records read."""
    try:
        records = iter(_open(ds))
    except CorpusError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the hub client or `datasets` raises, told as one line
        raise _failed(ds, e) from e
    while True:
        try:
            record = next(records)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - a stream that breaks off midway
            raise _failed(ds, e) from e
        counter[0] += 1
        if text_field not in record:
            raise CorpusError(f"{ds.source} record {counter[0]} has no {text_field!r} field (fields: "
                              f"{sorted(record)}); set data.text_field")
        text = record[text_field]
        if not isinstance(text, str):
            raise CorpusError(f"{ds.source} record {counter[0]}: field {text_field!r} holds "
                              f"{type(text).__name__}, not text; set data.text_field")
        if is_heldout(text, split.heldout_share, split.split_seed) == (split.part == "heldout"):
            yield text


def _read_dataset(source: str, tokenizer, max_tokens: int, text_field: str, split: Split,
                  batch: int) -> list[np.ndarray]:
    """The token ids (no EOS) of the part's first documents, until they and an EOS each hold `max_tokens`: from the
    cache when it holds them, else streamed, tokenized and cached."""
    ds = dataset(source)
    if split.part not in PARTS:
        raise CorpusError(f"{source!r}: the part must be one of {PARTS}, got {split.part!r}")
    if record := split.cached(source, text_field, max_tokens):
        with np.load(split.cache_file(source, text_field) + ".npz") as z:
            ids, lengths = z["ids"], z["lengths"]
        log.info("%s (%s documents): %d documents, %d tokens from the cache %s", source, split.part,
                 record["documents"], record["tokens"], split.cache_file(source, text_field) + ".npz")
        return np.split(ids, np.cumsum(lengths)[:-1]) if len(lengths) else []
    docs, total, pending, counter, exhausted = [], 0, [], [0], True
    # tokens per character (an EOS counted as one), measured on what was tokenized so far: a batch is tokenized as
    # soon as it may reach the budget, so the stream is read hardly a document past it
    rate, chars, seen_chars = 1.0, 0, 0
    for text in _dataset_documents(ds, text_field, split, counter):
        pending.append(text)
        chars += len(text) + 1
        if len(pending) == batch or total + rate * chars >= max_tokens:
            total = _encode_docs(pending, tokenizer, docs, total)
            seen_chars += chars
            rate, pending, chars = total / seen_chars, [], 0
            if total >= max_tokens:
                exhausted = False
                break
    if pending:
        total = _encode_docs(pending, tokenizer, docs, total)
    if split.cache_dir:
        _write_cache(split.cache_file(source, text_field), docs, {
            "source": source, "part": split.part, "documents": len(docs), "records_read": counter[0],
            "tokens": total, "exhausted": exhausted, "text_field": text_field, "heldout_share": split.heldout_share,
            "split_seed": split.split_seed, "tokenizer": split.tokenizer_id})
    log.info("%s (%s documents): %d documents of %d read, %d tokens%s", source, split.part, len(docs), counter[0],
             total, " (all there are)" if exhausted else "")
    return docs


def _encode_docs(texts: list[str], tokenizer, docs: list, total: int) -> int:
    """Append each text's ids to `docs`; the running total counts an EOS after each."""
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        docs.append(np.asarray(enc.ids, np.int32))
        total += len(enc.ids) + 1
    return total


def _write_cache(base: str, docs: list[np.ndarray], record: dict) -> None:
    """The .npz first, then the .json that makes it count (each replaced whole: a reader never sees half)."""
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    ids = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    with open(base + ".npz.tmp", "wb") as f:
        np.savez(f, ids=ids, lengths=np.asarray([len(d) for d in docs], np.int64))
    os.replace(base + ".npz.tmp", base + ".npz")
    with open(base + ".json.tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(base + ".json.tmp", base + ".json")


def _offline_setting() -> str | None:
    for var in OFFLINE:
        if os.environ.get(var, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return f"{var}={os.environ[var]} is set"
    return None


def hub_unreachable(timeout: float = PROBE_SECONDS) -> str | None:
    """Why the hub cannot be read from here (the offline settings, or no TCP connection to the endpoint or the
    HTTPS proxy within `timeout` seconds, name resolution included), or None. Never waits longer."""
    if why := _offline_setting():
        return why
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    proxy = next((os.environ[v] for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
                  if os.environ.get(v)), "")
    target = urlparse(proxy if "://" in proxy else f"http://{proxy}") if proxy else endpoint
    host = target.hostname or ""
    port = target.port or (443 if target.scheme == "https" else 80)
    result: list = []

    def probe():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except Exception as e:  # noqa: BLE001 - OSError, or a name the resolver refuses (UnicodeError)
            result.append(e)

    thread = threading.Thread(target=probe, daemon=True)  # a name lookup cannot be given a timeout of its own
    thread.start()
    thread.join(timeout)
    via = f" (the proxy for {endpoint.hostname})" if proxy else ""
    if not result:
        return f"{host}:{port}{via} did not answer within {timeout:g} s"
    if result[0] is not None:
        reason = getattr(result[0], "strerror", None) or f"{type(result[0]).__name__}: {result[0]}"
        return f"{host}:{port}{via} cannot be reached ({reason})"
    return None


def hub_problem(reads, text_field: str, cache: Split) -> str | None:
    """Why the run cannot start: a hub dataset it must fetch (not in the run's cache) while the hub cannot be read.
    `reads`: (data field, part, sources, max_tokens) of each text the run reads. One line naming the datasets and
    what to pass instead, or None."""
    fields, names = {}, []
    for field, part, sources, max_tokens in reads:
        split = dataclasses.replace(cache, part=part)
        for source in sources:
            ds = dataset(source)
            if ds and not ds.local and not split.cached(source, text_field, max_tokens):
                fields[field] = part
                names += [source] if source not in names else []
    if not names or not (why := hub_unreachable()):
        return None
    return (f"{', '.join(names)} ({' and '.join(fields)}) must be streamed from the Hugging Face hub, but {why}: "
            "pass a local copy the same way, e.g. " + " ".join(f"--config.{f}=hf:/path/to/copy" for f in fields)
            + " (a save_to_disk directory, or .parquet / .jsonl files or a glob of them), or for a smoke run "
            + " ".join(f"--config.{f}=stdlib:{part}" for f, part in fields.items()))


# ---- every source --------------------------------------------------------------------------------------------------

def check_source(source: str, manifest: str) -> None:
    """Raise CorpusError now (before any work) if `source` cannot be read (a hub dataset: see `hub_problem`)."""
    named = _manifest_source(source)
    if named:
        name, split = named
        for part in ("stdlib", "pydoc") if name == "corpus" else (name,):  # each part of a mix must be here
            if not manifest_files(manifest, part, split):
                raise CorpusError(f"{source!r}: none of the manifest's {part} files of split {split!r} exist on this "
                                  f"machine; {FIX[part]}")
    elif ds := dataset(source):
        _check_dataset(ds)
    elif not source.endswith((".txt", ".jsonl", ".npy")):
        raise CorpusError(f"text source {source!r}: expected one of "
                          f"{', '.join(f'{s}:{sp}' for s in SOURCES for sp in SPLITS)}, a .txt, .jsonl or .npy file, "
                          "or a dataset as hf:NAME[:CONFIG[:SPLIT]]")
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
                text_field: str = "text", batch: int = 64, split: Split = Split()) -> np.ndarray:
    """The sources' tokens (EOS after each document) as one int32 array of at most `max_tokens`. `split` says which
    documents an hf: source gives and where they are cached."""
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
        if dataset(source):
            for ids in _read_dataset(source, tokenizer, max_tokens - total, text_field, split, batch):
                out.append(np.append(ids, np.int32(eos_id)).astype(np.int32))
                total += len(ids) + 1
                if total >= max_tokens:
                    break
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

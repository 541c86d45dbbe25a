"""Toy-model data: corpus manifest, byte-level BPE tokenizer, tokenized uint16 arrays.

    python -m launch.toy.data                 # verify corpus vs manifest (write it if absent), train tokenizer
                                              # if absent, tokenize both splits; --check: verify all, write nothing
    python -m launch.toy.data --new-manifest  # start over from the local corpus (new split, retrains the tokenizer)

Corpus (offline, PSF licence): stdlib/ = the interpreter's standard library .py files (no tests, site-packages,
build-machine or generated files); pydoc/ = reST sources of Debian's python3.11-doc (skipped with a note if absent).
Split by file: per source, files in sha256(path) order go to held-out until it has max(--heldout-frac,
--min-heldout-chars / total) of the source's characters. checkpoints/toy/data/manifest.json is the record (path,
sha256, bytes, chars, split of every file); a rebuild stops with the differences when a sha256 differs.
Tokenizer (checkpoints/toy/tokenizer/): byte-level BPE on the train split, Qwen2/3 split regex + ByteLevel, no
normalizer: decode(encode(x)) == x. One special token, <|endoftext|> (id 0) = EOS and pad; no BOS, none added.
Arrays (--out, default work/toy/data/): {split}.npy uint16, each file followed by one EOS, manifest order;
{split}_offsets.npy int64 [n_files + 1]: file i = tokens[off[i] : off[i+1] - 1], its EOS at off[i+1] - 1;
meta.json: manifest and tokenizer sha256, the files of each split in order, token counts.
"""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread: the CPU is shared
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse
import hashlib
import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
DOCS_PACKAGE = "python3.11-doc"
DOCS_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
EOS = "<|endoftext|>"
SPLITS = ("train", "heldout")
# Qwen2/Qwen3's pre-tokenizer split: single digits, letters with one leading non-letter, punctuation runs,
# newline runs, whitespace runs that leave one space for the next word (indentation stays tokenizable).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
SKIP_FILES = {"pydoc_data/topics.py"}  # generated copy of the docs: would leak held-out docs into train


class DataError(SystemExit):
    """Exit with a message (no traceback): the corpus, manifest or outputs are not what they should be."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source_roots() -> dict[str, Path]:
    roots = {"stdlib": Path(sysconfig.get_paths()["stdlib"])}
    if DOCS_ROOT.is_dir():
        roots["pydoc"] = DOCS_ROOT
    return roots


def source_versions(roots: dict[str, Path]) -> dict[str, str]:
    versions = {"stdlib": f"CPython {sys.version.split()[0]}"}
    if "pydoc" in roots:
        deb = subprocess.run(["dpkg-query", "-W", "-f=${Version}", DOCS_PACKAGE], capture_output=True, text=True)
        versions["pydoc"] = f"{DOCS_PACKAGE} {deb.stdout or 'unknown'}"
    return versions


def wanted(source: str, rel: str) -> bool:
    """Selection by path relative to the source root (config-*/ and _sysconfigdata_* describe the build machine)."""
    parts = rel.split("/")
    if source == "pydoc":
        return rel.endswith(".rst.txt")
    return (rel.endswith(".py") and not SKIP_DIRS & set(parts[:-1]) and rel not in SKIP_FILES
            and not parts[0].startswith("config-") and not parts[-1].startswith("_sysconfigdata_"))


def read_text(path: Path) -> tuple[bytes, str | None]:
    """The file's bytes and its UTF-8 text (None if it is not UTF-8); bytes, so that \r\n etc. survive."""
    data = path.read_bytes()
    try:
        return data, data.decode("utf-8")
    except UnicodeDecodeError:
        return data, None


def scan(roots: dict[str, Path]) -> list[dict]:
    """Manifest entries of all selected files, sorted by manifest path (`source/relative/path`)."""
    entries = []
    for source, root in roots.items():
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            rel = path.relative_to(root).as_posix()
            if not wanted(source, rel):
                continue
            data, text = read_text(path)
            if text is None or b"with gencodec.py" in data[:300]:  # non-UTF-8; generated codec tables
                continue
            entries.append({"path": f"{source}/{rel}", "sha256": sha256(data), "bytes": len(data), "chars": len(text)})
    return sorted(entries, key=lambda e: e["path"])


def assign_splits(entries: list[dict], frac: float, min_chars: int) -> None:
    """Per source, hash-ordered files go to held-out until it has its share of that source's characters."""
    share = max(frac, min_chars / sum(e["chars"] for e in entries))
    for source in sorted({e["path"].split("/")[0] for e in entries}):
        files = [e for e in entries if e["path"].startswith(source + "/")]
        target, held = share * sum(e["chars"] for e in files), 0
        for e in sorted(files, key=lambda e: sha256(f"split:{e['path']}".encode())):
            e["split"] = "heldout" if held < target else "train"
            held += e["chars"] if e["split"] == "heldout" else 0


def totals(entries: list[dict]) -> dict:
    out = {}
    for split in (*SPLITS, "all"):
        sel = [e for e in entries if split in ("all", e["split"])]
        out[split] = {"files": len(sel), "bytes": sum(e["bytes"] for e in sel), "chars": sum(e["chars"] for e in sel)}
    return out


def write_manifest(path: Path, roots, entries, args) -> None:
    head = {"format": 1, "built_by": "python -m launch.toy.data", "python_version": sys.version.split()[0],
            "sources": {s: {"root": str(roots[s]), "version": v} for s, v in source_versions(roots).items()},
            "split": {"method": "per source: sha256('split:' + path) order, held-out until its char share is reached",
                      "heldout_frac": args.heldout_frac, "min_heldout_chars": args.min_heldout_chars},
            "totals": totals(entries), "files": None}
    files = ",\n".join("  " + json.dumps(e) for e in entries)  # one line per file: reviewable diffs
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(head, indent=1).replace('"files": null', f'"files": [\n{files}\n ]') + "\n")


def load_corpus(manifest: dict, roots: dict[str, Path]) -> dict[str, str]:
    """Texts of the manifest's files; stop with every difference if the local corpus is not the recorded one."""
    problems = []
    for source, info in manifest["sources"].items():
        if source not in roots:
            problems.append(f"source '{source}' ({info['version']}) not found at {info['root']}"
                            + (f"; install it: apt-get install {DOCS_PACKAGE}" if source == "pydoc" else ""))
    texts = {}
    for e in tqdm(manifest["files"], desc="verify corpus", unit="file"):
        source, rel = e["path"].split("/", 1)
        if source not in roots:
            continue
        path = roots[source] / rel
        if not path.is_file():
            problems.append(f"missing: {e['path']} ({path})")
            continue
        data, text = read_text(path)
        if sha256(data) != e["sha256"]:
            problems.append(f"sha256 differs: {e['path']} ({len(data)} bytes here, {e['bytes']} in manifest)")
        texts[e["path"]] = text
    if problems:
        here = {"python": sys.version.split()[0], **source_versions(roots)}
        raise DataError(f"local corpus differs from the manifest in {len(problems)} place(s):\n  "
                        + "\n  ".join(problems[:20]) + ("\n  ..." if len(problems) > 20 else "")
                        + f"\nmanifest: python {manifest['python_version']}, "
                        + ", ".join(f"{s}={i['version']}" for s, i in manifest["sources"].items())
                        + f"\nhere:     python {here.pop('python')}, " + ", ".join(f"{s}={v}" for s, v in here.items())
                        + "\nuse the recorded versions, or start over with --new-manifest (new split, tokenizer and arrays).")
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {"eos_token": EOS, "pad_token": EOS}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "bos_token": None, "unk_token": None,
              "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": 1 << 20}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def check_tokenizer(tok, tok_dir: Path, texts: dict[str, str]) -> None:
    """Exact round trip on the given texts; AutoTokenizer gives the same ids on a few of them."""
    from transformers import AutoTokenizer
    for name, text in tqdm(texts.items(), desc="round trip", unit="file"):
        if tok.decode(tok.encode(text).ids, skip_special_tokens=False) != text:
            raise DataError(f"tokenizer round trip fails on {name}")
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    if hf.eos_token_id != tok.token_to_id(EOS) or hf.pad_token_id != hf.eos_token_id:
        raise DataError(f"{tok_dir}: AutoTokenizer eos/pad ids {hf.eos_token_id}/{hf.pad_token_id} are wrong")
    for name, text in list(texts.items())[:: max(1, len(texts) // 20)]:
        if hf(text)["input_ids"] != tok.encode(text).ids or hf.decode(hf(text)["input_ids"]) != text:
            raise DataError(f"AutoTokenizer({tok_dir}) and tokenizers disagree on {name}")


def tokenize(tok, names: list[str], texts: dict[str, str], split: str) -> tuple[np.ndarray, np.ndarray]:
    eos = tok.token_to_id(EOS)
    pieces, offsets = [], [0]
    for name in tqdm(names, desc=f"tokenize {split}", unit="file"):
        ids = tok.encode(texts[name]).ids + [eos]
        pieces.append(np.asarray(ids, dtype=np.uint16))
        offsets.append(offsets[-1] + len(ids))
    return np.concatenate(pieces), np.asarray(offsets, dtype=np.int64)


def check_arrays(out: Path, manifest_sha: str, tok_sha: str, eos: int) -> None:
    if not (out / "meta.json").exists():
        raise DataError(f"--check: no tokenized arrays at {out} (build them with python -m launch.toy.data)")
    meta = json.loads((out / "meta.json").read_text())
    if (meta["manifest_sha256"], meta["tokenizer_sha256"]) != (manifest_sha, tok_sha):
        raise DataError(f"{out} was built from another manifest or tokenizer: rebuild with python -m launch.toy.data")
    for split in SPLITS:
        arr, off = np.load(out / f"{split}.npy", mmap_mode="r"), np.load(out / f"{split}_offsets.npy")
        if len(off) != len(meta["files"][split]) + 1 or off[-1] != len(arr) or (arr[off[1:] - 1] != eos).any():
            raise DataError(f"{out}/{split}.npy or its offsets are inconsistent with meta.json: rebuild them")


def ensure_manifest(args, roots: dict[str, Path]) -> bool:
    """Write the manifest from the local corpus if asked to or absent; True if it was written."""
    if not (args.new_manifest or not args.manifest.exists()):
        return False
    if args.check:
        raise DataError(f"--check: no manifest at {args.manifest}")
    entries = scan(roots)
    assign_splits(entries, args.heldout_frac, args.min_heldout_chars)
    write_manifest(args.manifest, roots, entries, args)
    print(f"wrote {args.manifest} ({len(entries)} files)")
    return True


def ensure_tokenizer(args, train_texts: list[str], retrain: bool) -> Path:
    tok_file = args.tokenizer_dir / "tokenizer.json"
    if args.check or not (retrain or args.retrain_tokenizer or not tok_file.exists()):
        if not tok_file.exists():
            raise DataError(f"--check: no tokenizer at {tok_file}")
        return tok_file
    t = time.time()
    tok = train_tokenizer(train_texts, args.vocab_size)
    if train_tokenizer(train_texts, args.vocab_size).to_str() != tok.to_str():  # cheap (seconds): always check
        raise DataError("tokenizer training is not deterministic: two runs gave different tokenizer.json")
    save_tokenizer(tok, args.tokenizer_dir)
    print(f"trained tokenizer twice, identical -> {args.tokenizer_dir} ({tok_file.stat().st_size / 1e6:.2f} MB, "
          f"{time.time() - t:.1f}s)")
    return tok_file


def write_arrays(out: Path, tok, names: dict, texts: dict, manifest: dict, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "eos_id": tok.token_to_id(EOS), "dtype": "uint16", "splits": {}, "files": names,
            "layout": "each file's tokens then one EOS; file i = tokens[off[i]:off[i+1]-1]"}
    for split in SPLITS:
        t = time.time()
        arr, off = tokenize(tok, names[split], texts, split)
        np.save(out / f"{split}.npy", arr)
        np.save(out / f"{split}_offsets.npy", off)
        chars = manifest["totals"][split]["chars"]
        meta["splits"][split] = {"files": len(names[split]), "chars": chars, "tokens": int(len(arr)),
                                 "chars_per_token": round(chars / (len(arr) - len(names[split])), 3)}
        print(f"{split}: {meta['splits'][split]} ({time.time() - t:.1f}s)")
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "work/toy/data", help="tokenized arrays (git-ignored)")
    p.add_argument("--manifest", type=Path, default=REPO / "checkpoints/toy/data/manifest.json")
    p.add_argument("--tokenizer-dir", type=Path, default=REPO / "checkpoints/toy/tokenizer")
    p.add_argument("--heldout-frac", type=float, default=0.15,
                   help="held-out share of each source's characters (0.15: text for 200 distinct 4K-token contexts)")
    p.add_argument("--min-heldout-chars", type=int, default=1_000_000)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--check", action="store_true", help="verify corpus, tokenizer and arrays; write nothing")
    p.add_argument("--new-manifest", action="store_true", help="rewrite the manifest from the local corpus, retrain")
    p.add_argument("--retrain-tokenizer", action="store_true", help="train even if the tokenizer exists")
    args = p.parse_args(argv)
    if not 257 <= args.vocab_size <= 1 << 16:
        p.error("--vocab-size must be in [257, 65536]: 256 bytes + <|endoftext|>, ids stored as uint16")
    from tokenizers import Tokenizer
    t0, roots = time.time(), source_roots()
    if "pydoc" not in roots:
        print(f"note: {DOCS_ROOT} not found ({DOCS_PACKAGE} not installed): corpus is stdlib only")
    new_manifest = ensure_manifest(args, roots)
    manifest = json.loads(args.manifest.read_text())
    texts = load_corpus(manifest, roots)
    names = {s: [e["path"] for e in manifest["files"] if e["split"] == s] for s in SPLITS}
    if any(EOS in text for text in texts.values()):
        raise DataError(f"a corpus file contains the literal special token {EOS}")
    print(f"corpus ok: {json.dumps(manifest['totals'])} ({time.time() - t0:.1f}s)")

    tok_file = ensure_tokenizer(args, [texts[n] for n in names["train"]], retrain=new_manifest)
    tok, t = Tokenizer.from_file(str(tok_file)), time.time()
    if tok.get_vocab_size() != args.vocab_size:
        raise DataError(f"{tok_file} has {tok.get_vocab_size()} tokens, not --vocab-size {args.vocab_size}: "
                        "add --retrain-tokenizer")
    check_tokenizer(tok, args.tokenizer_dir, {n: texts[n] for n in names["heldout"]})
    print(f"tokenizer ok: exact round trip on {len(names['heldout'])} held-out files, AutoTokenizer agrees "
          f"({time.time() - t:.1f}s)")

    shas = {"manifest_sha256": sha256(args.manifest.read_bytes()), "tokenizer_sha256": sha256(tok_file.read_bytes())}
    if args.check:
        check_arrays(args.out, shas["manifest_sha256"], shas["tokenizer_sha256"], tok.token_to_id(EOS))
        print(f"arrays ok: {args.out}")
    else:
        write_arrays(args.out, tok, names, texts, manifest, shas)
        print(f"done in {time.time() - t0:.1f}s: {args.out}")


if __name__ == "__main__":
    main()

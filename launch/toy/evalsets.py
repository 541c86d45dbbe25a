"""Eval sets for the toy pair, built from held-out files only (deterministic for a given --seed).

    python -m launch.toy.evalsets            # needs launch.toy.data's outputs; writes checkpoints/toy/eval/

Outputs (schemas in checkpoints/toy/eval/README.md):
  hellaswag.jsonl  {ctx, endings[4], label, source_file}: ctx = a passage of --ctx-tokens tokens starting and ending
                   at a line start; the true ending = the next whole lines (--ending-tokens, <= --ending-lines lines);
                   3 distractors = endings of similar token count (+-20%) from other held-out files of the same
                   source (docs vs code) whose first line has the same indentation as the true ending's.
                   --same-file K takes K of them from the item's own file instead, >= --far tokens away: they
                   share the context's identifiers, so copying names from the context helps less (an identifier-
                   overlap heuristic scores 80% on hellaswag with K=0, 72% with K=1, 64% with K=3).
  piqa.jsonl       {goal, sol1, sol2, label, source_file}: the same construction with 1 distractor. MC items never
                   share text: every ctx + true ending is a disjoint span of the held-out files.
  retrieval_{L}.jsonl  {prompt, answer, answer_ids, length, needle_position, key, value, source_file}: a window of
                   a held-out stdlib file, exactly L tokens with the needle and the query, the needle line inserted
                   at a line start at --depth of the prompt, the query as the last line. Defaults:
                       needle  "{key} = {value}\n"   e.g. "_cfg_qmzx = 48213\n"   (indented like the line it precedes)
                       query   "{key} ="             (indented like the haystack line it replaces)
                       answer  " {value}"            -> 6 tokens: a space and one token per digit
                   so an induction-capable model answers by copying. Change them with --needle/--query/--answer
                   (format fields {key} and {value}), e.g. --query "assert {key} ==". --depth LO HI sets where the
                   needle goes (fraction of the prompt), --value-digits the number's length (--value-letters N:
                   N random letters instead; worse for the v2 source: 8/24 at 1K for 4 letters, 11/24 for 5 digits).
                   Prompts are stored as text only (re-tokenized at load, `length` checks it); answer_ids are stored.
  heldout_windows.npy  uint16 [N, T+1] (--windows, --window-len): disjoint aligned windows of work/toy/data/heldout.npy
                   (may cross file boundaries, whose EOS id 0 they then contain), for perplexity and KL.
  meta.json        the arguments, counts and tokenizer/manifest sha256 of this build.
Every MC option and retrieval answer is checked to tokenize the same alone as after its context.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import string
from collections import defaultdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from launch.toy.data import REPO, load_corpus, source_roots

KEY_WORDS = ("cfg", "opt", "tmp", "val", "ref", "buf", "key", "idx", "num", "ptr", "lim", "tag")


class Doc:
    """One held-out file: its text, tokens, and the line starts where a token starts (valid cut points)."""

    def __init__(self, name: str, text: str, tok):
        self.name, self.text, self.source = name, text, name.split("/")[0]
        enc = tok.encode(text)
        self.token_starts = np.asarray([o[0] for o in enc.offsets] + [len(text)], np.int64)  # then len(text)
        nonblank, pos = [], 0
        for line in text.split("\n"):
            if line.strip():
                nonblank.append(pos)
            pos += len(line) + 1
        tok_idx = np.searchsorted(self.token_starts, nonblank)
        ok = self.token_starts[tok_idx] == np.asarray(nonblank, np.int64)
        self.cuts = np.asarray(nonblank, np.int64)[ok]  # char offsets of valid cuts
        self.cut_tokens = tok_idx[ok]  # token index at each cut

    def ntok(self, lo: int, hi: int) -> int:
        """Approximate token count of text[lo:hi] (tokens starting inside it)."""
        return int(np.searchsorted(self.token_starts, hi) - np.searchsorted(self.token_starts, lo))

    def line_end(self, pos: int) -> int:
        """Char offset just past the newline of the line holding `pos` (or the end of the text)."""
        return self.text.find("\n", pos) + 1 or len(self.text)

    def ending(self, cut: int, args) -> tuple[int, int] | None:
        """(end char, token count) of the ending that starts at cut index `cut`: whole lines up to the first
        non-blank one that brings it to >= --ending-tokens MIN tokens; None if that takes more than --ending-lines
        non-blank lines or MAX tokens, or the ending has under 10 alphanumeric characters."""
        pos, lines = int(self.cuts[cut]), 0
        while lines < args.ending_lines and pos < len(self.text):
            end = self.line_end(pos)
            blank, pos = not self.text[pos:end].strip(), end
            lines += not blank
            n = self.ntok(int(self.cuts[cut]), end)
            if not blank and n >= args.ending_tokens[0]:
                text = self.text[self.cuts[cut]:end]
                ok = n <= args.ending_tokens[1] and sum(c.isalnum() for c in text) >= 10
                return (end, n) if ok else None
        return None

    def indent(self, char: int) -> str:
        """Leading whitespace of the line starting at `char`."""
        line = self.text[char:self.line_end(char)]
        return line[: len(line) - len(line.lstrip())]


def mc_candidates(docs: list[Doc], args, rng) -> list[tuple[Doc, int, int, int]]:
    """Disjoint (doc, ctx start char, ending start char, ending end char) spans, walking each file in order."""
    out = []
    for doc in docs:
        k = 0
        while k < len(doc.cuts):
            target = rng.integers(args.ctx_tokens[0], args.ctx_tokens[1] + 1)
            m = int(np.searchsorted(doc.cut_tokens, doc.cut_tokens[k] + target))
            if m >= len(doc.cuts):
                break
            span = doc.ending(m, args) if doc.cut_tokens[m] - doc.cut_tokens[k] <= args.ctx_tokens[1] else None
            if span is None:
                k = m
                continue
            out.append((doc, int(doc.cuts[k]), int(doc.cuts[m]), span[0]))
            k = int(np.searchsorted(doc.cuts, span[0]))
    return out


def distractor_pool(docs: list[Doc], args) -> dict:
    """(source, indent) -> (texts, token counts, doc index, start token) of every ending in held-out."""
    pool = defaultdict(lambda: ([], [], [], []))
    for i, doc in enumerate(tqdm(docs, desc="distractor pool", unit="file")):
        for c in range(len(doc.cuts)):
            span = doc.ending(c, args)
            if span:
                entry = pool[(doc.source, doc.indent(int(doc.cuts[c])))]
                for column, value in zip(entry, (doc.text[doc.cuts[c]:span[0]], span[1], i, doc.cut_tokens[c])):
                    column.append(value)
    return {key: (texts, *map(np.asarray, rest)) for key, (texts, *rest) in pool.items()}


def consistent(tok, context: str, options: list[str]) -> bool:
    """Each option tokenizes the same alone as after the context."""
    ctx = tok.encode(context).ids
    return all(tok.encode(context + o).ids == ctx + tok.encode(o).ids for o in options)


def pick(texts: list[str], mask: np.ndarray, exclude: str, k: int, rng) -> list[str] | None:
    """k distinct texts where mask holds, none of them inside `exclude`; None if there are not enough."""
    choices = [t for t in sorted({texts[i] for i in np.flatnonzero(mask)}) if t not in exclude]
    return [choices[i] for i in rng.choice(len(choices), k, replace=False)] if len(choices) >= k else None


def make_mc(cand, docs, pool, n_options: int, label: int, args, tok, rng) -> dict | None:
    """A HellaSwag-schema row for one span with n_options - 1 distractors from the pool (--same-file of them from
    the same file, >= --far tokens away), or None if too few fit or an option tokenizes differently after the ctx."""
    doc, a, b, e = cand
    context, true = doc.text[a:b], doc.text[b:e]
    empty = np.zeros(0, np.int64)
    texts, counts, files, starts = pool.get((doc.source, doc.indent(b)), ([], empty, empty, empty))
    n, at = doc.ntok(b, e), int(np.searchsorted(doc.token_starts, b))
    similar = np.abs(counts - n) <= max(3, 0.2 * n)
    n_same = min(args.same_file, n_options - 1)
    same = pick(texts, similar & (files == docs.index(doc)) & (np.abs(starts - at) >= args.far), context + true,
                n_same, rng)
    other = pick(texts, similar & (files != docs.index(doc)), context + true, n_options - 1 - n_same, rng)
    if same is None or other is None:
        return None
    options = same + other
    options = [options[i] for i in rng.permutation(len(options))]
    options.insert(label, true)
    if not consistent(tok, context, options):
        return None
    return {"ctx": context, "endings": options, "label": label, "source_file": doc.name}


def build_mc(cands, docs, pool, n_items: int, n_options: int, args, tok, rng, desc: str) -> list[dict]:
    labels = rng.permutation(np.arange(n_items) % n_options)  # balanced labels
    items, bar = [], tqdm(total=n_items, desc=desc, unit="item")
    while len(items) < n_items:
        if not cands:
            raise SystemExit(f"{desc}: ran out of held-out spans after {len(items)} items; lower the counts")
        item = make_mc(cands.pop(), docs, pool, n_options, int(labels[len(items)]), args, tok, rng)
        if item:
            items.append(item)
            bar.update()
    bar.close()
    return items


def needle_item(doc: Doc, length: int, args, tok, rng, used: set) -> dict | None:
    """One retrieval prompt of exactly `length` tokens from `doc`, or None if this draw does not work out."""
    key = f"_{rng.choice(KEY_WORDS)}_{''.join(rng.choice(list(string.ascii_lowercase), 4))}"
    if args.value_letters:
        value = "".join(rng.choice(list(string.ascii_lowercase), args.value_letters))
    else:
        value = str(rng.integers(10 ** (args.value_digits - 1), 10 ** args.value_digits))
    fields = {"key": key, "value": value}
    needle, query, answer = (t.format(**fields) for t in (args.needle, args.query, args.answer))
    ends = np.flatnonzero(doc.cut_tokens >= length + 16)
    if key in used or not len(ends):
        return None
    end = int(rng.choice(ends))
    t0 = int(doc.cut_tokens[end]) - length  # first haystack token, moved below until the prompt has `length` tokens
    lo, hi = (int(doc.cut_tokens[end]) - length + int(f * length) for f in args.depth)
    inserts = np.flatnonzero((doc.cut_tokens >= lo) & (doc.cut_tokens < hi))
    if not len(inserts):
        return None
    ins = int(doc.cuts[rng.choice(inserts)])
    for _ in range(5):
        if not 0 <= t0 < lo:
            return None
        hay_start = int(doc.token_starts[t0])
        head, tail = doc.text[hay_start:ins], doc.text[ins:doc.cuts[end]]
        prompt = head + doc.indent(ins) + needle + tail + doc.indent(int(doc.cuts[end])) + query
        ids = tok.encode(prompt).ids
        if len(ids) == length:
            break
        t0 += len(ids) - length
    haystack = head + tail
    if len(ids) != length or key in haystack or value in haystack:
        return None
    answer_ids = tok.encode(answer).ids
    pos = len(tok.encode(head).ids)
    if tok.encode(prompt + answer).ids != ids + answer_ids or tok.encode(head).ids != ids[:pos]:
        return None
    used.add(key)
    return {"prompt": prompt, "answer": answer, "answer_ids": answer_ids, "length": length, "needle_position": pos,
            "key": key, "value": value, "source_file": doc.name}


def build_retrieval(docs: list[Doc], length: int, args, tok, rng) -> list[dict]:
    docs = [d for d in docs if d.source == args.haystack and len(d.cut_tokens) and d.cut_tokens[-1] >= length + 16]
    if not docs:
        raise SystemExit(f"no held-out {args.haystack} file has {length + 16} tokens")
    weights = np.asarray([d.cut_tokens[-1] - length for d in docs], np.float64)
    items, used = [], set()
    bar = tqdm(total=args.n_retrieval, desc=f"retrieval {length}", unit="item")
    for _ in range(args.n_retrieval * 20):
        item = needle_item(docs[rng.choice(len(docs), p=weights / weights.sum())], length, args, tok, rng, used)
        if item:
            items.append(item)
            bar.update()
            if len(items) == args.n_retrieval:
                break
    bar.close()
    if len(items) < args.n_retrieval:
        raise SystemExit(f"retrieval {length}: only {len(items)} items after {args.n_retrieval * 20} draws")
    return items


def heldout_windows(tokens: np.ndarray, n: int, window: int, rng) -> np.ndarray:
    """uint16 [n, window]: n distinct aligned slots tokens[s * window : (s + 1) * window], in slot order."""
    slots = np.sort(rng.choice(len(tokens) // window, n, replace=False))
    return np.stack([tokens[s * window:(s + 1) * window] for s in slots]).astype(np.uint16)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {path} ({len(rows)} items, {path.stat().st_size / 1e6:.2f} MB)")


def heldout_docs(manifest_path: Path, tok, source: str | None = None) -> list[Doc]:
    """The manifest's held-out files (of one source, e.g. "stdlib", if given), verified and tokenized, in manifest
    order."""
    manifest = json.loads(Path(manifest_path).read_text())
    keep = lambda path: source is None or path.split("/")[0] == source  # noqa: E731
    manifest["files"] = [e for e in manifest["files"] if e["split"] == "heldout" and keep(e["path"])]
    manifest["sources"] = {k: v for k, v in manifest["sources"].items() if source is None or k == source}
    texts = load_corpus(manifest, source_roots())
    return [Doc(e["path"], texts[e["path"]], tok) for e in tqdm(manifest["files"], desc="tokenize", unit="file")]


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=REPO / "work/toy/data", help="launch.toy.data's arrays")
    p.add_argument("--manifest", type=Path, default=REPO / "checkpoints/toy/data/manifest.json")
    p.add_argument("--tokenizer", type=Path, default=REPO / "checkpoints/toy/tokenizer/tokenizer.json")
    p.add_argument("--out", type=Path, default=REPO / "checkpoints/toy/eval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-hellaswag", type=int, default=1000)
    p.add_argument("--n-piqa", type=int, default=500)
    p.add_argument("--ctx-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"))
    p.add_argument("--ending-tokens", type=int, nargs=2, default=(20, 40), metavar=("MIN", "MAX"))
    p.add_argument("--ending-lines", type=int, default=3, help="most non-blank lines in an ending")
    p.add_argument("--same-file", type=int, default=0, help="distractors per item from the item's own file")
    p.add_argument("--far", type=int, default=1000, help="same-file distractors start >= this many tokens away")
    p.add_argument("--lengths", type=int, nargs="+", default=(1024, 2048, 4096), help="retrieval prompt tokens")
    p.add_argument("--n-retrieval", type=int, default=200, help="items per retrieval length")
    p.add_argument("--needle", default="{key} = {value}\n", help="the inserted line (must end with a newline)")
    p.add_argument("--query", default="{key} =", help="the last line of the prompt (no newline)")
    p.add_argument("--answer", default=" {value}", help="what the model must generate after the query")
    p.add_argument("--depth", type=float, nargs=2, default=(0.1, 0.2), metavar=("LO", "HI"),
                   help="the needle starts at a line start within this fraction of the prompt")
    p.add_argument("--value-digits", type=int, default=5, help="the value: a number of this many digits ...")
    p.add_argument("--value-letters", type=int, default=0, help="... or, if > 0, this many random lowercase letters")
    p.add_argument("--haystack", choices=("stdlib", "pydoc"), default="stdlib", help="held-out source of contexts")
    p.add_argument("--windows", type=int, default=256, help="held-out windows for perplexity / KL")
    p.add_argument("--window-len", type=int, default=1025, help="tokens per window (T + 1)")
    args = p.parse_args(argv)
    if not args.needle.endswith("\n") or args.query.endswith("\n") or not 0 <= args.depth[0] < args.depth[1] < 1:
        p.error("--needle must end with a newline, --query must not, and 0 <= LO < HI < 1 for --depth")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(args.tokenizer))
    meta = json.loads((args.data / "meta.json").read_text())
    shas = {k: hashlib.sha256(path.read_bytes()).hexdigest()
            for k, path in (("manifest_sha256", args.manifest), ("tokenizer_sha256", args.tokenizer))}
    if any(meta[k] != v for k, v in shas.items()):
        raise SystemExit(f"{args.data} was built from another manifest or tokenizer: rerun python -m launch.toy.data")
    docs = heldout_docs(args.manifest, tok)  # manifest order = meta["files"]["heldout"] (launch.toy.data writes both)

    rng = np.random.default_rng(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    cands = mc_candidates(docs, args, rng)
    cands = [cands[i] for i in rng.permutation(len(cands))]
    pool = distractor_pool(docs, args)
    counts = {"mc_spans": len(cands)}
    for name, n, k in (("hellaswag", args.n_hellaswag, 4), ("piqa", args.n_piqa, 2)):
        rows = build_mc(cands, docs, pool, n, k, args, tok, rng, name)
        if name == "piqa":
            rows = [{"goal": r["ctx"], "sol1": r["endings"][0], "sol2": r["endings"][1], "label": r["label"],
                     "source_file": r["source_file"]} for r in rows]
        write_jsonl(args.out / f"{name}.jsonl", rows)
        counts[name] = len(rows)
    for length in args.lengths:
        write_jsonl(args.out / f"retrieval_{length}.jsonl", build_retrieval(docs, length, args, tok, rng))
        counts[f"retrieval_{length}"] = args.n_retrieval
    windows = heldout_windows(np.load(args.data / "heldout.npy"), args.windows, args.window_len, rng)
    np.save(args.out / "heldout_windows.npy", windows)
    counts["heldout_windows"] = list(windows.shape)
    build = {k: v for k, v in vars(args).items() if not isinstance(v, Path)}  # the settings, not the paths
    (args.out / "meta.json").write_text(json.dumps({"built_by": "python -m launch.toy.evalsets", "args": build,
                                                    "counts": counts, **shas}, indent=1) + "\n")
    print(f"done: {counts}")


if __name__ == "__main__":
    main()

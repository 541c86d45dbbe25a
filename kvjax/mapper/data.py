"""Calibration and training text from local text / JSONL files, through `datasets`, as one flat token array (cut it
into windows with ``kvjax.windows``)."""

from __future__ import annotations

import numpy as np


def tokens_from_files(paths: list[str] | str, tokenizer, text_field: str = "text", eos_id: int | None = None,
                      max_tokens: int | None = None) -> np.ndarray:
    """Tokenize local .txt / .jsonl / .json files (via `datasets`) into one flat int32 array, EOS between records."""
    import datasets
    paths = [paths] if isinstance(paths, str) else list(paths)
    kinds = {"json" if p.endswith((".jsonl", ".json")) else "text" for p in paths}
    if len(kinds) != 1:
        raise ValueError(f"mix of text and JSON files {paths}: pass one kind at a time")
    ds = datasets.load_dataset(kinds.pop(), data_files=paths, split="train")
    if text_field not in ds.column_names:
        raise ValueError(f"{paths}: no {text_field!r} field (columns: {ds.column_names}); pass text_field=...")
    out, total = [], 0
    for record in ds:
        ids = tokenizer.encode(record[text_field]).ids + ([eos_id] if eos_id is not None else [])
        out.append(np.asarray(ids, np.int32))
        total += len(ids)
        if max_tokens is not None and total >= max_tokens:
            break
    if not out:
        raise ValueError(f"{paths}: no records")
    flat = np.concatenate(out)
    return flat[:max_tokens] if max_tokens is not None else flat

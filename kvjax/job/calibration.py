"""Stage calibrate -> data/: the calibration text tokenized with the pair's tokenizer, the calibration and
lambda-selection windows drawn from it, and the held-out windows (given, or cut from the held-out text). A dataset's
tokens are cached beside it, in corpus/ (kvjax.corpus)."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil

import numpy as np

from kvjax import corpus
from kvjax.hf import load_hf_config
from kvjax.run.preflight import LaunchError
from kvjax.job.markers import Stage, write_json
from kvjax.windows import consecutive, sample

log = logging.getLogger("kvjax.launch")


def run(job, stage: Stage) -> None:
    """`job`: the run's kvjax.job.context.Context."""
    cfg, d = job.cfg, job.cfg.data
    tcfg = load_hf_config(cfg.target.path)
    eos = tcfg.eos_token_ids[0] if tcfg.eos_token_ids else (tcfg.pad_token_id or 0)
    tok = job.tokenizer()
    # an hf: dataset's documents: calibration ones for the training text, held-out ones for the held-out text; its
    # tokens cached in the run directory, kept across --redo=calibrate (a rerun fetches nothing)
    split = corpus.Split(heldout_share=d.heldout_share, split_seed=d.split_seed, cache_dir=job.run.path(corpus.CACHE),
                         tokenizer_id=corpus.tokenizer_id(cfg.target.path))
    train = corpus.read_tokens(d.train_text, tok, eos, d.max_train_tokens, d.manifest, d.text_field,
                               split=dataclasses.replace(split, part="train"))
    rc = cfg.residual
    copies = rc.copy_window_len if rc.copy_windows else 0
    need = max(cfg.map.window_len, rc.prefix_len + rc.cont_len, copies) + 2
    if len(train) < 2 * need:
        raise LaunchError(f"data.train_text gave {len(train)} tokens; calibration and residual windows need at "
                          f"least {2 * need}; add text or raise data.max_train_tokens")
    calib = sample(train, cfg.map.calib_windows, cfg.map.window_len, seed=cfg.seed + 1)
    select = sample(train, cfg.map.select_windows, cfg.map.window_len, seed=cfg.seed + 2)
    if d.heldout_windows:
        heldout = np.asarray(np.load(d.heldout_windows), np.int32)
    else:
        flat = corpus.read_tokens(d.heldout_text, tok, eos, d.max_heldout_tokens, d.manifest, d.text_field,
                                  split=dataclasses.replace(split, part="heldout"))
        if len(flat) < d.heldout_window_len:
            raise LaunchError(f"data.heldout_text gave {len(flat)} tokens, less than one held-out window of "
                              f"{d.heldout_window_len}; add text or lower data.heldout_window_len")
        heldout = consecutive(flat, d.heldout_window_len)
    for name, arr in (("train text", train), ("held-out windows", heldout)):
        if arr.min() < 0 or arr.max() >= tcfg.vocab_size:
            raise LaunchError(f"{name} hold token ids outside the vocabulary [0, {tcfg.vocab_size}): "
                              "they were made with another tokenizer")
    out = job.run.path("data")
    tmp = out + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    for name, arr in (("train_tokens", train), ("calib", calib), ("select", select), ("heldout", heldout)):
        np.save(os.path.join(tmp, f"{name}.npy"), np.asarray(arr, np.int32))
    write_json(os.path.join(tmp, "data.json"), {
        "train_text": list(d.train_text), "train_tokens": int(len(train)), "calib_windows": list(calib.shape),
        "select_windows": list(select.shape), "heldout_windows": list(heldout.shape),
        "heldout_from": d.heldout_windows or list(d.heldout_text),
        "sha256": {"train": corpus.sha256(train), "calib": corpus.sha256(calib), "heldout": corpus.sha256(heldout)}})
    replace_dir(tmp, out)
    log.info("calibration text: %d tokens from %s; calib %s, select %s, held-out windows %s", len(train),
             list(d.train_text), calib.shape, select.shape, heldout.shape)


def replace_dir(tmp: str, out: str) -> None:
    """Put the finished directory `tmp` in place of `out` (a reader never sees half of it)."""
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)

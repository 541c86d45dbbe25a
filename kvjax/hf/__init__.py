"""HF checkpoint directory <-> (a family's config, Params), and the tokenizer.

A checkpoint is a directory with config.json and either model.safetensors or a sharded
model.safetensors.index.json. Files are read by the `safetensors` package (kvjax.tensorfile): every header is
checked when its file is opened, then tensors are streamed one at a time: each is read from a memory map, checked
against the expected shape, converted to our layout and dtype, and placed on its devices before the next is read.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.models.config import ConfigError, load_config
from kvjax.models.family import DecoderConfig
from kvjax.models.model import Model
from kvjax.models.params import (Params, from_flat, from_hf_tensors, hf_names, hf_shape, param_specs, to_flat,
                                 to_hf_tensors)
from kvjax.tensorfile import SafetensorsFile, save_file

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
IGNORED = ("rotary_emb.inv_freq",)  # buffers some exporters write; recomputed here


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message says what to fix."""


def resolve(path: str) -> str:
    """A local checkpoint directory for `path`: the directory itself, or a hub snapshot (needs network)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise CheckpointError(f"{path} is a file; pass the checkpoint directory that contains {CONFIG}")
    looks_like_hub = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if looks_like_hub:
        try:
            from huggingface_hub import snapshot_download
            return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "tokenizer*"])
        except Exception as e:  # no network, unknown repo, ...
            raise CheckpointError(f"{path!r} is not a local directory and could not be fetched from the hub "
                                  f"({type(e).__name__}: {e}); download it and pass the local directory") from None
    raise CheckpointError(f"checkpoint directory {path!r} does not exist; pass a directory with {CONFIG} and "
                          f"{SINGLE} (or {INDEX})")


def load_hf_config(path: str) -> DecoderConfig:
    path = resolve(path)
    cfg_path = os.path.join(path, CONFIG)
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path} has no {CONFIG}; an HF checkpoint directory needs config.json next to "
                              "its .safetensors files")
    return load_config(cfg_path)


def _open_weights(path: str) -> dict[str, SafetensorsFile]:
    """tensor name -> the file holding it."""
    index_path, single = os.path.join(path, INDEX), os.path.join(path, SINGLE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path} is not a valid safetensors index ({e!r}); re-save the "
                                      "checkpoint") from None
        files = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise CheckpointError(f"{INDEX} names shard {shard!r} but {shard_path} is missing; the download "
                                      "is incomplete")
            files[shard] = SafetensorsFile(shard_path)
        names = {shard: set(f.keys()) for shard, f in files.items()}
        out = {}
        for name, shard in weight_map.items():
            if name not in names[shard]:
                raise CheckpointError(f"{INDEX} says {name!r} is in {shard}, but that file does not contain it")
            out[name] = files[shard]
        return out
    if os.path.isfile(single):
        f = SafetensorsFile(single)
        return {k: f for k in f.keys()}
    others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".safetensors")))
    hint = (f" It has {others}: kvjax reads only safetensors (never pickle); re-save with "
            "`model.save_pretrained(dir, safe_serialization=True)`." if others else "")
    raise CheckpointError(f"{path} has neither {SINGLE} nor {INDEX}.{hint}")


def open_weights(path: str) -> dict[str, SafetensorsFile]:
    """tensor name -> the open file holding it, for a checkpoint directory (model.safetensors or a sharded index);
    a CheckpointError naming the fix otherwise. For readers of other layouts (kvjax.hf.ultravox: Whisper, Ultravox)."""
    return _open_weights(resolve(path))


def load_hf(path: str, dtype=jnp.float32, shardings=None) -> Model:
    """Load an HF checkpoint directory (or hub name, with network) of a registered family into a Model, which
    unpacks as (cfg, params).

    `dtype` is the parameter dtype (float32 or bfloat16). `shardings`, if given, is a Params-shaped tree of
    jax.sharding.Sharding (e.g. from kvjax.sharding.tree_shardings) and each tensor is placed accordingly.
    """
    path = resolve(path)
    cfg = load_hf_config(path)
    tensors = _open_weights(path)
    specs = param_specs(cfg)
    expected = {n for s in specs.values() for n in hf_names(s)}
    allowed_extra = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(expected - set(tensors))
    unexpected = sorted(n for n in set(tensors) - expected - allowed_extra if not n.endswith(IGNORED))
    if missing:
        raise CheckpointError(f"{path}: missing tensors for this config ({len(missing)}): {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''}. Does config.json match the weights?")
    if unexpected:
        raise CheckpointError(f"{path}: unexpected tensors ({len(unexpected)}): {unexpected[:8]}"
                              f"{' ...' if len(unexpected) > 8 else ''}. Is this a "
                              f"{type(cfg).__name__.removesuffix('Config')} checkpoint, and does config.json "
                              "(num_hidden_layers, tie_word_embeddings, biases) match the weights?")
    np_dtype = np.dtype(jnp.dtype(dtype))
    flat_shardings = to_flat(shardings) if shardings is not None else {}
    flat = {}
    for name, spec in specs.items():
        want = hf_shape(spec)
        for hf_name in hf_names(spec):
            if tensors[hf_name].shape(hf_name) != want:
                raise CheckpointError(f"{path}: tensor {hf_name!r} has shape {list(tensors[hf_name].shape(hf_name))}, "
                                      f"config.json implies {list(want)}; the config does not match the weights")
        host = from_hf_tensors(spec, lambda n: tensors[n].get(n), np_dtype)
        flat[name] = jax.device_put(host, flat_shardings.get(name))
        del host
    return Model(cfg, from_flat(cfg, flat))


def save_hf(path: str, cfg: DecoderConfig, params: Params, tokenizer_dir: str | None = None,
            dtype=None) -> None:
    """Write an HF checkpoint directory loadable by transformers and by load_hf."""
    os.makedirs(path, exist_ok=True)
    specs = param_specs(cfg)
    flat = to_flat(params)
    tensors = {}
    for name, spec in specs.items():
        a = np.asarray(jax.device_get(flat[name]))
        if dtype is not None:
            a = a.astype(np.dtype(jnp.dtype(dtype)))
        tensors.update(to_hf_tensors(spec, a))
    save_file(tensors, os.path.join(path, SINGLE), metadata={"format": "pt"})
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = str(np.dtype(next(iter(tensors.values())).dtype).name)
    with open(os.path.join(path, CONFIG), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    if tokenizer_dir is not None:
        import shutil
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))


def load_tokenizer(path: str):
    """The `tokenizers.Tokenizer` stored with a checkpoint (tokenizer.json)."""
    from tokenizers import Tokenizer
    path = resolve(path)
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise CheckpointError(f"{path} has no tokenizer.json; copy the tokenizer files of the model family next to "
                              "config.json")
    return Tokenizer.from_file(tok_path)


# the parts of tokenizer.json that decide which ids a text gets (not truncation, padding, post-processing templates
# or decoding): two checkpoints agreeing on these tokenize every text alike
TOKENIZING = ("normalizer", "pre_tokenizer", "model", "added_tokens")


def tokenizer_fingerprint(path: str) -> str | None:
    """A hash of how a checkpoint's tokenizer.json turns text into ids (its vocabulary, merges, normalizer,
    pre-tokenizer and added tokens), or None when the directory has no tokenizer.json."""
    import hashlib
    tok_path = os.path.join(resolve(path), "tokenizer.json")
    if not os.path.isfile(tok_path):
        return None
    with open(tok_path) as f:
        try:
            d = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{tok_path} is not valid JSON ({e}); re-download or re-save the tokenizer") from None
    added = sorted((t.get("id"), t.get("content")) for t in d.get("added_tokens") or [])
    blob = json.dumps({**{k: d.get(k) for k in TOKENIZING}, "added_tokens": added}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tokenizer_mismatch(source_path: str, target_path: str, source_cfg=None, target_cfg=None) -> str | None:
    """Why a cache map between these two checkpoints cannot work, or None: a map aligns the two models position by
    position on the same token ids, so they must share a tokenizer. "The same tokenizer" is checked as: equal
    vocab_size (from the configs, when given) and, where both directories have tokenizer.json, equal
    `tokenizer_fingerprint`s."""
    if source_cfg is not None and target_cfg is not None and source_cfg.vocab_size != target_cfg.vocab_size:
        return (f"source and target vocabularies differ ({source_cfg.vocab_size} vs {target_cfg.vocab_size}); a "
                "cache map needs models that share a tokenizer")
    fps = tokenizer_fingerprint(source_path), tokenizer_fingerprint(target_path)
    if None not in fps and fps[0] != fps[1]:
        return (f"the source ({source_path}) and target ({target_path}) tokenizers differ (tokenizer.json "
                f"fingerprints {fps[0]} vs {fps[1]}): a cache map needs models that share a tokenizer; pick a pair "
                "of the same family and tokenizer")
    return None


__all__ = ["CheckpointError", "ConfigError", "load_hf", "load_hf_config", "load_tokenizer", "save_hf", "resolve",
           "tokenizer_fingerprint", "tokenizer_mismatch"]

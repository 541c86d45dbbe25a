"""Saving and loading a drafter: a directory with `drafter.safetensors` (its own tensors only; the verifier's
embedding and head are shared and never stored) and `manifest.json` (format, the DrafterConfig with the verifier's
config fingerprint and the trained block sizes, and free-form training notes).

Loading against a verifier checks the fingerprint, so a drafter trained for another model is a clear error rather
than a silent collapse of the acceptance rate. Writes are atomic per file and the manifest is written last.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.drafter.config import DrafterConfig
from kvjax.drafter.model import DrafterParams, from_flat, param_specs, to_flat, with_vocab
from kvjax.tensorfile import SafetensorsFile, save_file

FORMAT = "kvjax-drafter/1"
WEIGHTS, MANIFEST = "drafter.safetensors", "manifest.json"


class DrafterError(ValueError):
    """A drafter directory that cannot be used (missing, corrupt, or for another verifier)."""


def save_drafter(path: str, dcfg: DrafterConfig, params: DrafterParams, notes: dict | None = None,
                 dtype=None) -> None:
    """Write the drafter to directory `path` (created). `dtype` (e.g. "bfloat16") stores the weights smaller; they
    load back as float32."""
    os.makedirs(path, exist_ok=True)
    flat = to_flat(params)
    tensors = {}
    for name in param_specs(dcfg):
        a = np.asarray(jax.device_get(flat[name]))
        tensors[name] = a.astype(np.dtype(jnp.dtype(dtype))) if dtype is not None else a
    if params.vocab_ids is not None:
        tensors["vocab_ids"] = np.asarray(jax.device_get(params.vocab_ids), np.int32)
    save_file(tensors, os.path.join(path, WEIGHTS), metadata={"format": FORMAT})
    manifest = {"format": FORMAT, "config": dcfg.to_dict(), "target_fingerprint": dcfg.target_fingerprint,
                "block_sizes": list(dcfg.block_sizes), "notes": notes or {}}
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
    os.replace(tmp, os.path.join(path, MANIFEST))


def load_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST)
    if not os.path.isfile(file):
        raise DrafterError(f"{path} is not a drafter directory (no {MANIFEST}); train one with "
                           "`python -m launch.toy.drafter` or pass the directory it wrote")
    try:
        with open(file) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise DrafterError(f"{file} is not valid JSON ({e}); the drafter directory is corrupt: retrain it") from None
    if manifest.get("format") != FORMAT:
        raise DrafterError(f"{file}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _config(path: str, target_cfg) -> DrafterConfig:
    """The drafter's config from its manifest; with `target_cfg`, DrafterError unless it was trained for it."""
    dcfg = DrafterConfig.from_dict(load_manifest(path)["config"])
    if target_cfg is not None:
        try:
            dcfg.check_target(target_cfg)
        except ValueError as e:
            raise DrafterError(f"{path}: {e}") from None
    return dcfg


def load_drafter(path: str, target_cfg=None, dtype=jnp.float32) -> tuple[DrafterConfig, DrafterParams]:
    """(config, params) of the drafter in `path`. With `target_cfg`, raise DrafterError unless the drafter was
    trained for that verifier (config fingerprint in the manifest)."""
    dcfg = _config(path, target_cfg)
    weights = SafetensorsFile(os.path.join(path, WEIGHTS))
    flat = {}
    for name, s in param_specs(dcfg).items():
        if name not in weights.keys():
            raise DrafterError(f"{path}: tensor {name!r} is missing from {WEIGHTS}; the directory is corrupt")
        if weights.shape(name) != s.shape:
            raise DrafterError(f"{path}: tensor {name!r} has shape {list(weights.shape(name))}, the manifest's "
                               f"config implies {list(s.shape)}")
        flat[name] = jnp.asarray(np.asarray(weights.get(name), np.float32), dtype)
    params = from_flat(dcfg, flat)
    if "vocab_ids" in weights.keys():
        ids = np.asarray(weights.get("vocab_ids"), np.int64)
        if ids.ndim != 1 or ids.min() < 0 or ids.max() >= dcfg.layer.vocab_size:
            raise DrafterError(f"{path}: vocab_ids must be verifier token ids in [0, {dcfg.layer.vocab_size})")
        params = with_vocab(params, ids)
    return dcfg, params


def drafter_shapes(path: str, target_cfg=None, dtype=jnp.float32) -> tuple[DrafterConfig, DrafterParams]:
    """`load_drafter`'s (config, params) with jax.ShapeDtypeStructs for the params, from the manifest and the weights
    file's header alone (no tensor is read): what a plan compiles the drafter's programs with."""
    dcfg = _config(path, target_cfg)
    weights = SafetensorsFile(os.path.join(path, WEIGHTS))
    flat = {name: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)) for name, s in param_specs(dcfg).items()}
    params = from_flat(dcfg, flat)
    if "vocab_ids" in weights.keys():
        params = params.replace(vocab_ids=jax.ShapeDtypeStruct(weights.shape("vocab_ids"), jnp.int32))
    return dcfg, params

"""Ultravox and Whisper checkpoints <-> the audio-language model (kvjax.models.audio_lm): `load_audio_encoder` reads
the encoder of an HF Whisper directory (WhisperModel or WhisperForConditionalGeneration; encoder tensors only) or of
an Ultravox directory; `load_ultravox` reads Ultravox's layout: config.json (model_type "ultravox", `audio_config`
(Whisper), `text_config` (the LM, any kvjax family) and/or `text_model_id`, `hidden_size`, `stack_factor`,
`projector_act`, `projector_ln_mid`, `norm_init`, `audio_token_index`) and safetensors with `audio_tower.*`,
`multi_modal_projector.*` and `language_model.*`. The released checkpoints hold no language_model.* tensors (they
name the LM by text_model_id): pass its directory as `text_path`. `audio_configs` reads the same config.json without
any weights: the encoder's, the projector's and the language model's configs (configs/models/ holds the released
checkpoints' config.json files). `save_ultravox` writes an encoder and projector in that layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.hf import CheckpointError, load_hf, load_hf_config, open_weights, resolve
from kvjax.models.audio_lm import IGNORED, AudioLM, Projector, ProjectorConfig, ProjectorParams, projector_specs
from kvjax.models.family import family_for_model_type
from kvjax.models.model import Model
from kvjax.models.params import ParamSpec, from_flat, from_hf_tensors, hf_names, hf_shape, param_specs
from kvjax.models.whisper import AudioEncoder, WhisperEncoderConfig, encoder_from_flat, encoder_specs


# ---- checkpoints -----------------------------------------------------------------------------------------------------

def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path} has no config.json; pass a Whisper or Ultravox checkpoint directory")
    with open(cfg_path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON ({e}); re-download or re-save the "
                                  "checkpoint") from None


def _read_ultravox(path: str, what: str) -> tuple[dict, str]:
    """An Ultravox config.json (and its name, for messages), with the checks every reader of one makes."""
    d = _read_config(path)
    source = os.path.join(path, "config.json")
    if d.get("model_type") != "ultravox":
        raise CheckpointError(f"{source}: model_type {d.get('model_type')!r} is not 'ultravox'; {what} reads "
                              "Ultravox checkpoints (a plain LM: kvjax.load_hf; a Whisper encoder: load_audio_encoder)")
    if d.get("audio_latency_block_size") is not None:
        raise CheckpointError(f"{source}: audio_latency_block_size {d['audio_latency_block_size']!r} (Ultravox's "
                              "block-causal streaming mask in the encoder) is not supported; kvjax's encoder attends "
                              "over the whole clip (audio_latency_block_size null)")
    return d, source


def _check_vocab(d: dict, lm_cfg, source: str) -> None:
    vocab = d.get("vocab_size")
    if vocab is not None and int(vocab) != lm_cfg.vocab_size:
        raise CheckpointError(f"{source}: vocab_size {vocab} but the language model has {lm_cfg.vocab_size}; is "
                              "text_path the checkpoint named by text_model_id?")


def _prefixed(specs: dict[str, ParamSpec], prefix: str) -> dict[str, ParamSpec]:
    return {k: dataclasses.replace(s, hf_name=prefix + s.hf_name, hf_parts=tuple(prefix + p for p in s.hf_parts))
            for k, s in specs.items()}


def _read(specs: dict[str, ParamSpec], tensors: dict, prefix: str, dtype, source: str,
          extra: tuple[str, ...] = ()) -> dict:
    """Our arrays of `specs` from the checkpoint's tensors; every tensor under `prefix` must be one of them (or in
    `extra`), so a config that does not match the weights is an error, not a silent drop."""
    expected = {n for s in specs.values() for n in hf_names(s)}
    missing = sorted(expected - set(tensors))
    unexpected = sorted(n for n in tensors if n.startswith(prefix) and n not in expected and n not in extra
                        and not n.endswith(IGNORED))
    for kind, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            raise CheckpointError(f"{source}: {kind} tensors under {prefix or 'the root'!r} ({len(names)}): "
                                  f"{names[:8]}{' ...' if len(names) > 8 else ''}; does config.json match the weights?")
    np_dtype = np.dtype(jnp.dtype(dtype))
    flat = {}
    for name, s in specs.items():
        for n in hf_names(s):
            if tensors[n].shape(n) != hf_shape(s):
                raise CheckpointError(f"{source}: tensor {n!r} has shape {list(tensors[n].shape(n))}, config.json "
                                      f"implies {list(hf_shape(s))}; the config does not match the weights")
        flat[name] = jnp.asarray(from_hf_tensors(s, lambda n: tensors[n].get(n), np_dtype))
    return flat


ENCODER_PREFIXES = ("model.encoder.", "encoder.", "audio_tower.", "")


def _encoder_prefix(tensors: dict, source: str) -> str:
    for p in ENCODER_PREFIXES:
        if p + "conv1.weight" in tensors:
            return p
    raise CheckpointError(f"{source}: no Whisper encoder tensors (looked for conv1.weight under "
                          f"{[p or '(root)' for p in ENCODER_PREFIXES]}); is this a Whisper or Ultravox checkpoint?")


def _load_encoder(cfg: WhisperEncoderConfig, tensors: dict, dtype, source: str) -> AudioEncoder:
    prefix = _encoder_prefix(tensors, source)
    flat = _read(encoder_specs(cfg, prefix), tensors, prefix, dtype, source)
    return AudioEncoder(cfg, encoder_from_flat(cfg, flat))


def load_audio_encoder(path: str, dtype=jnp.float32) -> AudioEncoder:
    """The Whisper encoder of an HF checkpoint directory: WhisperModel / WhisperForConditionalGeneration (model_type
    "whisper"; the decoder's tensors are not read), a bare WhisperEncoder, or an Ultravox directory (its audio
    tower). `dtype`: the parameter dtype (float32 or bfloat16)."""
    path = resolve(path)
    d = _read_config(path)
    source = os.path.join(path, "config.json")
    if d.get("model_type") == "ultravox":
        d, source = d.get("audio_config") or {}, source + " audio_config"
    if d.get("model_type") != "whisper":
        raise CheckpointError(f"{source}: model_type {d.get('model_type')!r}; load_audio_encoder reads Whisper "
                              "checkpoints (WhisperModel, WhisperForConditionalGeneration) and Ultravox's audio tower")
    return _load_encoder(WhisperEncoderConfig.from_hf_dict(d, source), open_weights(path), dtype, path)


def _text_config(d: dict, source: str):
    """A kvjax family config from an Ultravox text_config (its model_type; "llama" when absent, as Ultravox)."""
    return family_for_model_type(d.get("model_type", "llama"), source).config.from_hf_dict(d, source=source)


def load_ultravox(path: str, dtype=jnp.float32, text_path: str | None = None,
                  audio_path: str | None = None, lm: Model | None = None) -> AudioLM:
    """An Ultravox checkpoint directory as an AudioLM (encoder, projector, language model).

    The language model comes from the directory's language_model.* tensors with its `text_config`, or, when given
    (and always when the directory has none, as in the released checkpoints, which name it by `text_model_id`), from
    the HF checkpoint `text_path`, or `lm`, a language model already loaded (e.g. the job's own); likewise the
    encoder from audio_tower.* or `audio_path`. `dtype`: the parameter dtype of all three (`lm` is taken as it is)."""
    path = resolve(path)
    d, source = _read_ultravox(path, "load_ultravox")
    tensors = open_weights(path)
    has = {p: any(n.startswith(p) for n in tensors) for p in ("audio_tower.", "language_model.")}

    if audio_path is not None:
        encoder = load_audio_encoder(audio_path, dtype)
    elif has["audio_tower."]:
        if not d.get("audio_config"):
            raise CheckpointError(f"{source} has no audio_config for its audio_tower.* tensors; re-save the config "
                                  "with the Whisper config inlined")
        encoder = _load_encoder(WhisperEncoderConfig.from_hf_dict(d["audio_config"], source + " audio_config"),
                                {n: f for n, f in tensors.items() if n.startswith("audio_tower.")}, dtype, path)
    else:
        raise CheckpointError(f"{path} holds no audio_tower.* tensors (audio_model_id {d.get('audio_model_id')!r}); "
                              "pass audio_path= a local directory of that Whisper checkpoint")

    if lm is not None:
        pass
    elif text_path is not None:
        lm = load_hf(text_path, dtype)
    elif has["language_model."]:
        if not d.get("text_config"):
            raise CheckpointError(f"{source} has no text_config for its language_model.* tensors; re-save the "
                                  "config with the LM's config inlined, or pass text_path= the LM's directory")
        cfg = _text_config(d["text_config"], source + " text_config")
        extra = ("language_model.lm_head.weight",) if cfg.tie_word_embeddings else ()
        flat = _read(_prefixed(param_specs(cfg), "language_model."), tensors, "language_model.", dtype, path, extra)
        lm = Model(cfg, from_flat(cfg, flat))
    else:
        raise CheckpointError(f"{path} holds no language_model.* tensors (text_model_id {d.get('text_model_id')!r}): "
                              "pass text_path= a local directory of that checkpoint")

    pcfg = ProjectorConfig.from_ultravox(d, encoder.cfg.d_model, lm.cfg.hidden_size)
    names = set(tensors)
    for flag, present, absent in ((True, "ln_mid", "ln_post"), (False, "ln_post", "ln_mid")):
        if pcfg.ln_mid != flag and f"multi_modal_projector.{present}.weight" in names \
                and f"multi_modal_projector.{absent}.weight" not in names:
            raise CheckpointError(f"{source}: projector_ln_mid is {str(pcfg.ln_mid).lower()} but the weights have "
                                  f"multi_modal_projector.{present}.weight (Ultravox "
                                  f"{'v0.5+' if flag else 'v0.4.1 and earlier'}); set \"projector_ln_mid\": "
                                  f"{str(flag).lower()}")
    projector = Projector(pcfg, ProjectorParams(**_read(projector_specs(pcfg), tensors, "multi_modal_projector.",
                                                        dtype, path)))
    _check_vocab(d, lm.cfg, source)
    index = d.get("audio_token_index")
    return AudioLM(encoder, projector, lm, None if index is None else int(index))


class AudioConfigs(NamedTuple):
    """What an Ultravox checkpoint's config.json says about its shapes: the encoder's, the projector's and the
    language model's configs (a kvjax family config), and the audio placeholder's id (None when it names none)."""

    encoder: WhisperEncoderConfig
    projector: ProjectorConfig
    lm: Any
    audio_token_index: int | None


def _named_sibling(path: str, model_id: str | None) -> str | None:
    """The directory next to `path` named as the hub id's repository ("meta-llama/Llama-3.2-1B-Instruct" ->
    ../Llama-3.2-1B-Instruct), when it holds a config.json: how a directory of configs (configs/models/) keeps a
    checkpoint beside the models it names."""
    if not model_id:
        return None
    sibling = os.path.join(os.path.dirname(os.path.abspath(path)), str(model_id).rstrip("/").split("/")[-1])
    return sibling if os.path.isfile(os.path.join(sibling, "config.json")) else None


def _local_dir(path: str, what: str) -> str:
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{what} {path!r} is not a directory; pass a local directory that holds its config.json")
    return path


def audio_configs(path: str, text_path: str | None = None, audio_path: str | None = None) -> AudioConfigs:
    """The configs of an Ultravox checkpoint directory from its config.json alone (no weights are read; a directory
    holding only config.json is enough): its shapes for planning, abstract params or a cost model.

    The encoder's config comes from `audio_path`'s config.json when given (a Whisper or an Ultravox directory), else
    the inlined `audio_config` (the v0.5 releases inline it), else the config.json of the directory next to `path`
    named as `audio_model_id`'s repository. The language model's likewise: `text_path`, else `text_config`, else the
    directory next to `path` named as `text_model_id`'s repository (the released checkpoints name their LM by id:
    configs/models/ultravox-v0_5-llama-3_1-8b finds configs/models/Llama-3.1-8B-Instruct)."""
    path = _local_dir(path, "audio_configs: the Ultravox checkpoint")
    d, source = _read_ultravox(path, "audio_configs")

    if audio_path is None and d.get("audio_config"):
        encoder = WhisperEncoderConfig.from_hf_dict(d["audio_config"], source + " audio_config")
    else:
        where = audio_path if audio_path is not None else _named_sibling(path, d.get("audio_model_id"))
        if where is None:
            raise CheckpointError(f"{source} has no audio_config (audio_model_id {d.get('audio_model_id')!r}); pass "
                                  "audio_path= a directory with that Whisper checkpoint's config.json")
        where = _local_dir(where, "audio_configs: audio_path")
        a, a_source = _read_config(where), os.path.join(where, "config.json")
        if a.get("model_type") == "ultravox":
            a, a_source = a.get("audio_config") or {}, a_source + " audio_config"
        encoder = WhisperEncoderConfig.from_hf_dict(a, a_source)

    if text_path is None and d.get("text_config"):
        lm = _text_config(d["text_config"], source + " text_config")
    else:
        where = text_path if text_path is not None else _named_sibling(path, d.get("text_model_id"))
        if where is None:
            raise CheckpointError(f"{source} has no text_config (text_model_id {d.get('text_model_id')!r}); pass "
                                  "text_path= a directory with that checkpoint's config.json")
        lm = load_hf_config(_local_dir(where, "audio_configs: text_path"))

    _check_vocab(d, lm, source)
    index = d.get("audio_token_index")
    return AudioConfigs(encoder, ProjectorConfig.from_ultravox(d, encoder.d_model, lm.hidden_size), lm,
                        None if index is None else int(index))


def save_ultravox(path: str, encoder: AudioEncoder, projector: Projector, text_model_id: str | None = None,
                  audio_token_index: int | None = None, vocab_size: int | None = None, extra: dict | None = None,
                  dtype=None) -> None:
    """Write an encoder and projector in Ultravox's layout (config.json with `audio_config` inlined, the LM named by
    `text_model_id` as the released checkpoints name it; model.safetensors with audio_tower.* and
    multi_modal_projector.*), so load_ultravox(path, text_path=...) reads them back. `extra`: more config fields
    (e.g. how it was trained). Written to a temporary name, then renamed: never half-written."""
    import shutil

    from safetensors.numpy import save_file

    from kvjax.models.params import to_hf_tensors
    from kvjax.models.whisper import encoder_to_flat
    pc = projector.cfg
    tensors = {}
    for specs, flat in ((encoder_specs(encoder.cfg, "audio_tower."), encoder_to_flat(encoder.params)),
                        (projector_specs(pc), {k: getattr(projector.params, k) for k in projector_specs(pc)})):
        for name, s in specs.items():
            a = np.asarray(jax.device_get(flat[name]))
            for n, t in to_hf_tensors(s, a if dtype is None else a.astype(np.dtype(jnp.dtype(dtype)))).items():
                tensors[n] = np.ascontiguousarray(t)  # safetensors writes a transposed view's memory as it lies
    config = {"model_type": "ultravox", "architectures": ["UltravoxModel"], "audio_config": encoder.cfg.to_hf_dict(),
              "text_model_id": text_model_id, "hidden_size": pc.hidden_size, "stack_factor": pc.stack_factor,
              "projector_act": pc.act, "projector_ln_mid": pc.ln_mid, "norm_init": pc.norm_init,
              "audio_token_index": audio_token_index, "audio_latency_block_size": None,
              **({} if vocab_size is None else {"vocab_size": vocab_size}), **(extra or {})}
    tmp = path.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
